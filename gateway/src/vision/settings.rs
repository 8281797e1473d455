//! `vision:` in config.yaml: limits on images in requests and the feature
//! cache size. Reading images from local files or http URLs is off unless
//! the operator turns it on.
//!
//! ```yaml
//! vision:
//!   max_images: 8                 # images per request
//!   max_image_bytes: 10485760     # one encoded image (data: URL, file, download)
//!   max_image_pixels: 16777216    # width x height of one decoded image
//!   feature_cache_images: 20      # LRU of vision tower outputs by content hash
//!   allow_local_files: false      # file:///abs/path and /abs/path URLs
//!   allow_remote_urls: false      # http:// URLs
//!   fetch_timeout_s: 10           # per download
//!   # image_attention: causal     # or bidirectional; unset: the model's choice
//! ```

use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VisionSettings {
    pub max_images: usize,
    pub max_image_bytes: usize,
    pub max_image_pixels: u64,
    pub feature_cache_images: usize,
    pub allow_local_files: bool,
    pub allow_remote_urls: bool,
    pub fetch_timeout_s: f64,
    /// Unset: the model's choice (Gemma 4's `use_bidirectional_attention`;
    /// causal for Gemma 3, as mlx-vlm runs it).
    pub image_attention: Option<ImageAttention>,
}

/// How an image's soft tokens attend to each other during prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageAttention {
    /// Causally, like every other token: what mlx-vlm does for Gemma 3.
    Causal,
    /// Both ways within each image: what Hugging Face's Gemma 3 and Gemma 4
    /// do.
    Bidirectional,
}

impl Default for VisionSettings {
    fn default() -> Self {
        Self {
            max_images: 8,
            max_image_bytes: 10 << 20,
            max_image_pixels: 1 << 24,
            feature_cache_images: 20,
            allow_local_files: false,
            allow_remote_urls: false,
            fetch_timeout_s: 10.0,
            image_attention: None,
        }
    }
}

impl VisionSettings {
    pub fn check(&self) -> Result<(), String> {
        if self.max_images == 0 {
            return Err("vision.max_images must be at least 1".into());
        }
        if self.max_image_bytes == 0 || self.max_image_pixels == 0 {
            return Err(
                "vision.max_image_bytes and vision.max_image_pixels must be at least 1".into(),
            );
        }
        if !(self.fetch_timeout_s > 0.0 && self.fetch_timeout_s.is_finite()) {
            return Err("vision.fetch_timeout_s must be a positive number".into());
        }
        Ok(())
    }
}
