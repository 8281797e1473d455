//! Images in chat requests, for models with a vision tower: fetching and
//! decoding `image_url` parts, the feature cache, running the tower, and
//! the image soft tokens in the prompt. Engines receive the soft tokens'
//! embeddings in `GenerateRequest::images` and never see pixels.

pub mod cache;
pub mod pixels;
pub mod prompt;
pub mod settings;
pub mod source;

use std::sync::Arc;

use engine_core::ImageInput;
use mlx_rs::transforms::eval;
use mlx_rs::Array;
use runtime::SharedModel;

use crate::api::ApiError;
pub use cache::FeatureCache;
pub use prompt::ImageTokens;
pub use settings::VisionSettings;

/// Why an image was refused; each becomes a 400 naming the image's part.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ImageError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    NotAllowed(String),
    #[error("{0}")]
    Fetch(String),
}

impl ImageError {
    pub fn into_api(self, param: &str) -> ApiError {
        let code = match &self {
            ImageError::Invalid(_) => "invalid_image",
            ImageError::TooLarge(_) => "image_too_large",
            ImageError::NotAllowed(_) => "image_url_not_allowed",
            ImageError::Fetch(_) => "image_fetch_failed",
        };
        ApiError::InvalidRequest {
            message: self.to_string(),
            param: Some(param.to_string()),
            code: Some(code),
        }
    }
}

/// One `image_url` part of a request, in prompt order.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePart {
    pub url: String,
    /// Where it sits in the request, for error messages
    /// (`messages[0].content[1].image_url.url`).
    pub param: String,
}

/// An image ready for the engines: its soft-token embeddings
/// (`tokens_per_image` rows of the text model's width) and content hash.
#[derive(Debug, Clone)]
pub struct PreparedImage {
    pub hash: cache::ImageHash,
    pub embeddings: Arc<Vec<f32>>,
}

pub struct Vision {
    pub settings: VisionSettings,
    pub cache: FeatureCache,
    pub tokens: ImageTokens,
    shared: Arc<SharedModel>,
    width: u32,
}

impl Vision {
    /// `None` when the served model has no vision tower.
    pub fn new(shared: Arc<SharedModel>, settings: VisionSettings) -> anyhow::Result<Option<Self>> {
        let Some(tower) = &shared.model.vision else {
            return Ok(None);
        };
        let cfg = &tower.config;
        let tokenizer = &shared.model.tokenizer;
        let text = |id: u32| -> anyhow::Result<String> {
            tokenizer
                .id_to_token(id)
                .ok_or_else(|| anyhow::anyhow!("the tokenizer has no image token with id {id}"))
        };
        let tokens = ImageTokens {
            boi: text(cfg.boi_token_id)?,
            eoi: text(cfg.eoi_token_id)?,
            soft: text(cfg.image_token_id)?,
            soft_id: cfg.image_token_id,
            per_image: cfg.tokens_per_image as usize,
        };
        let width = shared.model.model.config.hidden_size as u32;
        Ok(Some(Self {
            cache: FeatureCache::new(settings.feature_cache_images),
            settings,
            tokens,
            shared,
            width,
        }))
    }

    /// Fetches, decodes and encodes every image (cached ones skip decoding
    /// and the tower). Decoding and the tower run on a blocking thread.
    pub async fn prepare(&self, parts: &[ImagePart]) -> Result<Vec<PreparedImage>, ApiError> {
        if parts.len() > self.settings.max_images {
            return Err(ApiError::InvalidRequest {
                message: format!(
                    "the request has {} images, more than the limit of {}",
                    parts.len(),
                    self.settings.max_images
                ),
                param: Some("messages".into()),
                code: Some("too_many_images"),
            });
        }
        let mut out: Vec<Option<PreparedImage>> = vec![None; parts.len()];
        // (index in `parts`, hash, encoded bytes) of the images to encode.
        let mut missing = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let bytes = source::fetch(&part.url, &self.settings)
                .await
                .map_err(|e| e.into_api(&part.param))?;
            let hash = cache::hash(&bytes);
            match self.cache.get(&hash) {
                Some(embeddings) => out[i] = Some(PreparedImage { hash, embeddings }),
                None => missing.push((i, hash, bytes)),
            }
        }
        if !missing.is_empty() {
            let shared = self.shared.clone();
            let max_pixels = self.settings.max_image_pixels;
            let encoded: Vec<Vec<u8>> = missing
                .iter_mut()
                .map(|(_, _, bytes)| std::mem::take(bytes))
                .collect();
            let features = tokio::task::spawn_blocking(move || {
                decode_and_encode(&shared, &encoded, max_pixels)
            })
            .await
            .map_err(|e| ApiError::Internal(format!("the vision tower panicked: {e}")))?
            .map_err(|e| match e {
                EncodeError::Image(k, bad) => bad.into_api(&parts[missing[k].0].param),
                EncodeError::Tower(failed) => {
                    ApiError::Internal(format!("the vision tower failed: {failed}"))
                }
            })?;
            let per_image = self.tokens.per_image * self.width as usize;
            for (k, (i, hash, _)) in missing.into_iter().enumerate() {
                let embeddings = Arc::new(features[k * per_image..(k + 1) * per_image].to_vec());
                self.cache.insert(hash, embeddings.clone());
                out[i] = Some(PreparedImage { hash, embeddings });
            }
        }
        Ok(out
            .into_iter()
            .map(|p| p.expect("every image prepared"))
            .collect())
    }

    /// The engines' view of the prepared images at `starts` in the prompt.
    pub fn inputs(&self, images: &[PreparedImage], starts: &[usize]) -> Vec<ImageInput> {
        images
            .iter()
            .zip(starts)
            .map(|(im, &start)| ImageInput {
                start: start as u32,
                tokens: self.tokens.per_image as u32,
                width: self.width,
                embeddings: im.embeddings.clone(),
                bidirectional: self.settings.image_attention
                    == settings::ImageAttention::Bidirectional,
            })
            .collect()
    }
}

enum EncodeError {
    /// The `k`-th image to encode is bad.
    Image(usize, ImageError),
    Tower(anyhow::Error),
}

/// Decodes and preprocesses `encoded` images, then runs the tower on them
/// all at once.
fn decode_and_encode(
    shared: &SharedModel,
    encoded: &[Vec<u8>],
    max_pixels: u64,
) -> Result<Vec<f32>, EncodeError> {
    let p = &shared
        .model
        .vision
        .as_ref()
        .expect("vision model")
        .config
        .preprocess;
    let mut batch = Vec::new();
    for (k, bytes) in encoded.iter().enumerate() {
        let image = pixels::decode(bytes, max_pixels).map_err(|e| EncodeError::Image(k, e))?;
        batch.extend(pixels::preprocess(&image, p));
    }
    encode(shared, &batch, encoded.len(), p).map_err(EncodeError::Tower)
}

/// Runs the tower on `n` preprocessed images under the device lock; the
/// soft-token embeddings as float32, image after image.
fn encode(
    shared: &SharedModel,
    pixels: &[f32],
    n: usize,
    p: &runtime::vision::Preprocess,
) -> anyhow::Result<Vec<f32>> {
    let tower = shared.model.vision.as_ref().expect("vision model");
    let _device = shared.model.lock_device();
    let input = Array::from_slice(pixels, &[n as i32, p.height as i32, p.width as i32, 3]);
    let features = tower.forward(&input)?.as_dtype(mlx_rs::Dtype::Float32)?;
    eval([&features])?;
    Ok(features.as_slice::<f32>().to_vec())
}
