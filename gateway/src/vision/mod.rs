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

use crate::protocol::ApiError;
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

/// An image ready for the engines: its soft-token embeddings (`tokens`
/// rows of the text model's width) and content hash.
#[derive(Debug, Clone)]
pub struct PreparedImage {
    pub hash: cache::ImageHash,
    pub embeddings: Arc<Vec<f32>>,
}

/// An image read from its source, not yet encoded: how many soft tokens it
/// takes and either its cached features or its bytes.
pub struct FetchedImage {
    hash: cache::ImageHash,
    pub tokens: usize,
    found: Found,
}

enum Found {
    Cached(Arc<Vec<f32>>),
    Bytes(Vec<u8>),
}

pub struct Vision {
    pub settings: VisionSettings,
    pub cache: FeatureCache,
    pub tokens: ImageTokens,
    shared: Arc<SharedModel>,
    width: u32,
    bidirectional: bool,
}

impl Vision {
    /// `None` when the served model has no vision tower.
    pub fn new(shared: Arc<SharedModel>, settings: VisionSettings) -> anyhow::Result<Option<Self>> {
        let Some(tower) = &shared.model.vision else {
            return Ok(None);
        };
        let cfg = &tower.config;
        let tokens = ImageTokens::for_model(cfg, &shared.model.tokenizer)?;
        let width = shared.model.model.config.hidden_size as u32;
        let bidirectional = match settings.image_attention {
            Some(a) => a == settings::ImageAttention::Bidirectional,
            None => cfg.bidirectional_images,
        };
        Ok(Some(Self {
            cache: FeatureCache::new(settings.feature_cache_images),
            settings,
            tokens,
            shared,
            width,
            bidirectional,
        }))
    }

    fn config(&self) -> &runtime::vision::VisionConfig {
        &self
            .shared
            .model
            .vision
            .as_ref()
            .expect("vision model")
            .config
    }

    /// Soft tokens every image takes, when that does not depend on the image
    /// (Gemma 3): the prompt can then be checked before any image is read.
    pub fn fixed_tokens(&self) -> Option<usize> {
        self.config().fixed_soft_tokens()
    }

    /// Reads every image's bytes (or finds its features in the cache) and
    /// its soft-token count (from the image's header, not decoding it).
    pub async fn fetch(&self, parts: &[ImagePart]) -> Result<Vec<FetchedImage>, ApiError> {
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
        let mut out = Vec::with_capacity(parts.len());
        for part in parts {
            let bytes = source::fetch(&part.url, &self.settings)
                .await
                .map_err(|e| e.into_api(&part.param))?;
            let hash = cache::hash(&bytes);
            let fetched = match self.cache.get(&hash) {
                Some(features) => FetchedImage {
                    hash,
                    tokens: features.len() / self.width as usize,
                    found: Found::Cached(features),
                },
                None => {
                    let (w, h) = pixels::dimensions(&bytes, self.settings.max_image_pixels)
                        .map_err(|e| e.into_api(&part.param))?;
                    let tokens = self
                        .config()
                        .soft_tokens(w, h)
                        .map_err(|e| ImageError::Invalid(e).into_api(&part.param))?;
                    FetchedImage {
                        hash,
                        tokens,
                        found: Found::Bytes(bytes),
                    }
                }
            };
            out.push(fetched);
        }
        Ok(out)
    }

    /// Decodes and encodes the fetched images that were not cached (on a
    /// blocking thread) and caches their features.
    pub async fn encode(
        &self,
        parts: &[ImagePart],
        fetched: Vec<FetchedImage>,
    ) -> Result<Vec<PreparedImage>, ApiError> {
        let mut out: Vec<Option<PreparedImage>> = vec![None; fetched.len()];
        // (index, hash, encoded bytes) of the images to encode.
        let mut missing = Vec::new();
        for (i, f) in fetched.into_iter().enumerate() {
            match f.found {
                Found::Cached(embeddings) => {
                    out[i] = Some(PreparedImage {
                        hash: f.hash,
                        embeddings,
                    })
                }
                Found::Bytes(bytes) => missing.push((i, f.hash, bytes)),
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
            for ((i, hash, _), features) in missing.into_iter().zip(features) {
                let embeddings = Arc::new(features);
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
                tokens: (im.embeddings.len() / self.width as usize) as u32,
                width: self.width,
                embeddings: im.embeddings.clone(),
                bidirectional: self.bidirectional,
            })
            .collect()
    }
}

enum EncodeError {
    /// The `k`-th image to encode is bad.
    Image(usize, ImageError),
    Tower(anyhow::Error),
}

/// Decodes and preprocesses `encoded` images, then runs the tower on each;
/// every image's soft-token embeddings as float32.
fn decode_and_encode(
    shared: &SharedModel,
    encoded: &[Vec<u8>],
    max_pixels: u64,
) -> Result<Vec<Vec<f32>>, EncodeError> {
    let tower = shared.model.vision.as_ref().expect("vision model");
    let mut images = Vec::with_capacity(encoded.len());
    for (k, bytes) in encoded.iter().enumerate() {
        let image = pixels::decode(bytes, max_pixels).map_err(|e| EncodeError::Image(k, e))?;
        images.push(
            pixels::preprocess(&image, &tower.config.preprocess)
                .map_err(|e| EncodeError::Image(k, e))?,
        );
    }
    let _device = shared.lock_device();
    images
        .iter()
        .map(|px| encode(tower, px).map_err(EncodeError::Tower))
        .collect()
}

/// Runs the tower on one preprocessed image (the caller holds the device
/// lock); its soft-token embeddings as float32.
fn encode(tower: &runtime::vision::VisionTower, px: &pixels::Pixels) -> anyhow::Result<Vec<f32>> {
    let input = Array::from_slice(&px.data, &[1, px.height as i32, px.width as i32, 3]);
    let features = tower.forward(&input)?.as_dtype(mlx_rs::Dtype::Float32)?;
    eval([&features])?;
    Ok(features.as_slice::<f32>().to_vec())
}
