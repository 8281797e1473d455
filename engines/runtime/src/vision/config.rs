//! The vision half of a multimodal checkpoint's configuration: the tower's
//! shape (`config.json` `vision_config`), the image token ids and soft-token
//! count (`config.json` top level), and the pixel preprocessing
//! (`preprocessor_config.json`). Gemma 3 (`Gemma3ForConditionalGeneration`)
//! is the family we run: a SigLIP tower, average pooling to
//! `mm_tokens_per_image` soft tokens, an RMS-normed linear projection.

use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;

#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_layers: i32,
    pub num_heads: i32,
    pub patch_size: i32,
    pub image_size: i32,
    pub num_channels: i32,
    pub layer_norm_eps: f32,
    /// Soft tokens one image becomes in the prompt.
    pub tokens_per_image: i32,
    /// `<image_soft_token>`: the placeholder each soft token replaces.
    pub image_token_id: u32,
    /// `<start_of_image>` / `<end_of_image>` around each image's soft tokens.
    pub boi_token_id: u32,
    pub eoi_token_id: u32,
    /// Divisor of the projected features before the text model multiplies
    /// every embedding by its own scale (mlx-vlm's `config.hidden_size`).
    pub feature_divisor: f32,
    pub preprocess: Preprocess,
}

/// How pixels become the tower's input: resize to `height` x `width`,
/// scale by `rescale_factor`, normalise per channel.
#[derive(Debug, Clone, PartialEq)]
pub struct Preprocess {
    pub height: u32,
    pub width: u32,
    pub rescale_factor: f64,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub do_rescale: bool,
    pub do_normalize: bool,
}

#[derive(Deserialize)]
struct RawTop {
    model_type: String,
    vision_config: Option<RawVision>,
    image_token_index: Option<u32>,
    boi_token_index: Option<u32>,
    eoi_token_index: Option<u32>,
    mm_tokens_per_image: Option<i32>,
    hidden_size: Option<f32>,
}

#[derive(Deserialize)]
struct RawVision {
    hidden_size: i32,
    intermediate_size: i32,
    num_hidden_layers: i32,
    num_attention_heads: i32,
    patch_size: i32,
    image_size: Option<i32>,
    num_channels: Option<i32>,
    layer_norm_eps: Option<f32>,
}

#[derive(Deserialize)]
struct RawPreprocessor {
    size: Option<RawSize>,
    rescale_factor: Option<f64>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    do_pan_and_scan: Option<bool>,
}

#[derive(Deserialize)]
struct RawSize {
    height: u32,
    width: u32,
}

impl VisionConfig {
    /// `None` for a text-only model directory.
    pub fn from_dir(dir: &Path) -> anyhow::Result<Option<Self>> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let text_only = ["gemma4", "qwen3_5", "qwen3_5_moe"];
        if text_only.iter().any(|t| value["model_type"] == *t) && !value["vision_config"].is_null()
        {
            // As mlx-lm does: the text model serves, requests with images
            // are refused.
            tracing::warn!(
                "{}: the {} vision tower is not supported; serving text only",
                path.display(),
                value["model_type"]
            );
            return Ok(None);
        }
        let top: RawTop =
            serde_json::from_value(value).with_context(|| format!("parsing {}", path.display()))?;
        let Some(v) = top.vision_config else {
            return Ok(None);
        };
        if top.model_type != "gemma3" {
            bail!(
                "{}: vision towers of model_type `{}` are not supported (supported: gemma3)",
                path.display(),
                top.model_type
            );
        }
        let pre_path = dir.join("preprocessor_config.json");
        let pre_text = std::fs::read_to_string(&pre_path)
            .with_context(|| format!("reading {}", pre_path.display()))?;
        let pre: RawPreprocessor = serde_json::from_str(&pre_text)
            .with_context(|| format!("parsing {}", pre_path.display()))?;
        if pre.do_pan_and_scan == Some(true) {
            bail!("{}: pan-and-scan is not supported", pre_path.display());
        }
        let image_size = v.image_size.unwrap_or(224);
        let size = pre.size.unwrap_or(RawSize {
            height: image_size as u32,
            width: image_size as u32,
        });
        let tokens_per_image = top.mm_tokens_per_image.unwrap_or(256);
        let config = Self {
            hidden_size: v.hidden_size,
            intermediate_size: v.intermediate_size,
            num_layers: v.num_hidden_layers,
            num_heads: v.num_attention_heads,
            patch_size: v.patch_size,
            image_size,
            num_channels: v.num_channels.unwrap_or(3),
            layer_norm_eps: v.layer_norm_eps.unwrap_or(1e-6),
            tokens_per_image,
            image_token_id: top.image_token_index.unwrap_or(262_144),
            boi_token_id: top.boi_token_index.unwrap_or(255_999),
            eoi_token_id: top.eoi_token_index.unwrap_or(256_000),
            feature_divisor: top.hidden_size.unwrap_or(2048.0).sqrt(),
            preprocess: Preprocess {
                height: size.height,
                width: size.width,
                rescale_factor: pre.rescale_factor.unwrap_or(1.0 / 255.0),
                mean: pre.image_mean.unwrap_or([0.5; 3]),
                std: pre.image_std.unwrap_or([0.5; 3]),
                do_rescale: pre.do_rescale.unwrap_or(true),
                do_normalize: pre.do_normalize.unwrap_or(true),
            },
        };
        config.check()?;
        Ok(Some(config))
    }

    fn check(&self) -> anyhow::Result<()> {
        let patches = self.patches_per_side();
        let side = (self.tokens_per_image as f64).sqrt() as i32;
        if self.image_size % self.patch_size != 0
            || side * side != self.tokens_per_image
            || side == 0
            || patches % side != 0
        {
            bail!(
                "vision config: image_size {} / patch_size {} and mm_tokens_per_image {} do not pool evenly",
                self.image_size,
                self.patch_size,
                self.tokens_per_image
            );
        }
        if self.preprocess.height as i32 != self.image_size
            || self.preprocess.width as i32 != self.image_size
        {
            bail!(
                "preprocessor size {}x{} differs from the tower's image_size {}",
                self.preprocess.width,
                self.preprocess.height,
                self.image_size
            );
        }
        if self.num_channels != 3 {
            bail!(
                "vision config: {} channels (only RGB is supported)",
                self.num_channels
            );
        }
        Ok(())
    }

    pub fn patches_per_side(&self) -> i32 {
        self.image_size / self.patch_size
    }

    /// The soft tokens of one image sit on a `side` x `side` grid.
    pub fn tokens_per_side(&self) -> i32 {
        (self.tokens_per_image as f64).sqrt() as i32
    }
}
