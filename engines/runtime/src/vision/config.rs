//! The vision half of a multimodal checkpoint's configuration: the tower's
//! shape (`config.json` `vision_config`), the image token ids and soft-token
//! counts (`config.json` top level), and the pixel preprocessing
//! (`preprocessor_config.json` / `processor_config.json`). Two families:
//!
//! * Gemma 3 (`Gemma3ForConditionalGeneration`): a SigLIP tower on a fixed
//!   square image, average pooling to `mm_tokens_per_image` soft tokens, an
//!   RMS-normed linear projection;
//! * Gemma 4 (`Gemma4ForConditionalGeneration`): images resized keeping
//!   their aspect ratio to fit a patch budget, a transformer with 2D rope
//!   over the patch grid, pooling by `pooling_kernel_size`, so the number of
//!   soft tokens depends on the image's shape.

use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_layers: i32,
    pub num_heads: i32,
    pub patch_size: i32,
    pub num_channels: i32,
    pub tower: TowerKind,
    /// `<image_soft_token>` / `<|image|>`: the placeholder each soft token
    /// replaces.
    pub image_token_id: u32,
    /// The delimiters around each image's soft tokens.
    pub boi_token_id: u32,
    pub eoi_token_id: u32,
    /// Divisor of the projected features before the text model multiplies
    /// every embedding by its own scale. Gemma 3: mlx-vlm's
    /// `sqrt(config.hidden_size)`; Gemma 4: the text model's scale itself,
    /// since the reference puts image features in after scaling.
    pub feature_divisor: f32,
    /// Whether the model wants an image's soft tokens to attend to each
    /// other both ways (Gemma 4's `use_bidirectional_attention: vision`).
    /// Gemma 3: false, as mlx-vlm runs it.
    pub bidirectional_images: bool,
    pub preprocess: Preprocess,
}

/// The parts of the two towers that differ.
#[derive(Debug, Clone, PartialEq)]
pub enum TowerKind {
    /// SigLIP on `image_size` squares, pooled to `tokens_per_image`.
    Gemma3 {
        image_size: i32,
        layer_norm_eps: f32,
        tokens_per_image: i32,
    },
    Gemma4(Gemma4Tower),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Tower {
    /// The text model's width, where `embed_vision` projects to.
    pub text_hidden: i32,
    pub head_dim: i32,
    pub kv_heads: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Rows of each axis' learned position table.
    pub position_embedding_size: i32,
    /// Side of the square of patches averaged into one soft token.
    pub pooling_kernel: i32,
    /// Linear layers clamp their inputs and outputs to stored bounds.
    pub clipped_linears: bool,
    /// A learned affine map after pooling (`std_bias`, `std_scale`).
    pub standardize: bool,
}

/// How pixels become the tower's input: resize, scale by `rescale_factor`,
/// optionally normalise per channel.
#[derive(Debug, Clone, PartialEq)]
pub struct Preprocess {
    pub resize: Resize,
    pub rescale_factor: f64,
    /// Rescale in float32 (Gemma 4's processor: `uint8 -> f32 * f32`);
    /// else in float64 (Hugging Face's Gemma 3 processor).
    pub rescale_in_f32: bool,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub do_rescale: bool,
    pub do_normalize: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Resize {
    /// Bilinear, to exactly this size (Gemma 3).
    Fixed { width: u32, height: u32 },
    /// Bicubic, keeping the aspect ratio, to the largest size of at most
    /// `max_patches` patches whose sides are multiples of `side_multiple`
    /// (Gemma 4's `aspect_ratio_preserving_resize`).
    FitPatches {
        patch_size: u32,
        max_patches: u32,
        side_multiple: u32,
        /// `pooling_kernel`^2 patches make one soft token.
        pooling_kernel: u32,
    },
}

impl Resize {
    /// The size (width, height) an image of `width` x `height` is resized
    /// to; an error for an image too thin to keep any whole tile.
    pub fn target(&self, width: u32, height: u32) -> Result<(u32, u32), String> {
        match *self {
            Resize::Fixed { width, height } => Ok((width, height)),
            Resize::FitPatches {
                patch_size,
                max_patches,
                side_multiple,
                pooling_kernel,
            } => {
                let (h, w) = (height as f64, width as f64);
                let target_px = max_patches as f64 * (patch_size as f64).powi(2);
                let factor = (target_px / (h * w)).sqrt();
                let m = side_multiple as f64;
                let mut th = ((factor * h / m).floor() * m) as u32;
                let mut tw = ((factor * w / m).floor() * m) as u32;
                if th == 0 && tw == 0 {
                    return Err(format!("a {width}x{height} image cannot be resized"));
                }
                // A very thin image keeps one tile across and as many along
                // as its aspect ratio gives, up to the budget.
                let max_side = (max_patches / pooling_kernel.pow(2)) * side_multiple;
                if th == 0 {
                    th = side_multiple;
                    tw = ((w / h).floor() as u32 * side_multiple).min(max_side);
                } else if tw == 0 {
                    tw = side_multiple;
                    th = ((h / w).floor() as u32 * side_multiple).min(max_side);
                }
                Ok((tw, th))
            }
        }
    }
}

#[derive(Deserialize)]
struct RawTop {
    model_type: String,
    vision_config: Option<RawVision>,
    text_config: Option<Value>,
    // Gemma 3's names.
    image_token_index: Option<u32>,
    boi_token_index: Option<u32>,
    eoi_token_index: Option<u32>,
    mm_tokens_per_image: Option<i32>,
    // Gemma 4's names.
    image_token_id: Option<u32>,
    boi_token_id: Option<u32>,
    eoi_token_id: Option<u32>,
    audio_config: Option<Value>,
    hidden_size: Option<f32>,
}

/// `vision_config`. Hugging Face writes only the fields that differ from
/// the config class's defaults, so Gemma 4's fall back to
/// `Gemma4VisionConfig`'s; Gemma 3's SigLIP fields must be present.
#[derive(Deserialize)]
struct RawVision {
    hidden_size: Option<i32>,
    intermediate_size: Option<i32>,
    num_hidden_layers: Option<i32>,
    num_attention_heads: Option<i32>,
    patch_size: Option<i32>,
    image_size: Option<i32>,
    num_channels: Option<i32>,
    layer_norm_eps: Option<f32>,
    // Gemma 4.
    num_key_value_heads: Option<i32>,
    head_dim: Option<i32>,
    rms_norm_eps: Option<f32>,
    rope_parameters: Option<Value>,
    position_embedding_size: Option<i32>,
    pooling_kernel_size: Option<i32>,
    use_clipped_linears: Option<bool>,
    standardize: Option<bool>,
    hidden_activation: Option<String>,
}

#[derive(Deserialize, Default)]
struct RawPreprocessor {
    size: Option<RawSize>,
    rescale_factor: Option<f64>,
    image_mean: Option<[f32; 3]>,
    image_std: Option<[f32; 3]>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    do_resize: Option<bool>,
    do_pan_and_scan: Option<bool>,
    // Gemma 4.
    patch_size: Option<u32>,
    max_soft_tokens: Option<u32>,
    pooling_kernel_size: Option<u32>,
}

#[derive(Deserialize)]
struct RawSize {
    height: u32,
    width: u32,
}

fn read_json(path: &Path) -> anyhow::Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

impl VisionConfig {
    /// `None` for a text-only model directory.
    pub fn from_dir(dir: &Path) -> anyhow::Result<Option<Self>> {
        let path = dir.join("config.json");
        let value = read_json(&path)?;
        if ["qwen3_5", "qwen3_5_moe"]
            .iter()
            .any(|t| value["model_type"] == *t)
            && !value["vision_config"].is_null()
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
        let Some(v) = top.vision_config.as_ref() else {
            return Ok(None);
        };
        let config = match top.model_type.as_str() {
            "gemma3" => Self::gemma3(dir, &top, v),
            "gemma4" => Self::gemma4(dir, &top, v),
            other => Err(anyhow::anyhow!(
                "vision towers of model_type `{other}` are not supported (supported: gemma3, gemma4)"
            )),
        };
        let config = config
            .and_then(|c| c.check().map(|()| c))
            .with_context(|| format!("{}", path.display()))?;
        Ok(Some(config))
    }

    fn gemma3(dir: &Path, top: &RawTop, v: &RawVision) -> anyhow::Result<Self> {
        let need = |field: Option<i32>, name: &str| {
            field.with_context(|| format!("vision_config.{name} missing"))
        };
        let patch_size = need(v.patch_size, "patch_size")?;
        let pre_path = dir.join("preprocessor_config.json");
        let pre: RawPreprocessor = serde_json::from_value(read_json(&pre_path)?)
            .with_context(|| format!("parsing {}", pre_path.display()))?;
        if pre.do_pan_and_scan == Some(true) {
            bail!("{}: pan-and-scan is not supported", pre_path.display());
        }
        let image_size = v.image_size.unwrap_or(224);
        let size = pre.size.unwrap_or(RawSize {
            height: image_size as u32,
            width: image_size as u32,
        });
        if size.height as i32 != image_size || size.width as i32 != image_size {
            bail!(
                "preprocessor size {}x{} differs from the tower's image_size {image_size}",
                size.width,
                size.height
            );
        }
        Ok(Self {
            hidden_size: need(v.hidden_size, "hidden_size")?,
            intermediate_size: need(v.intermediate_size, "intermediate_size")?,
            num_layers: need(v.num_hidden_layers, "num_hidden_layers")?,
            num_heads: need(v.num_attention_heads, "num_attention_heads")?,
            patch_size,
            num_channels: v.num_channels.unwrap_or(3),
            tower: TowerKind::Gemma3 {
                image_size,
                layer_norm_eps: v.layer_norm_eps.unwrap_or(1e-6),
                tokens_per_image: top.mm_tokens_per_image.unwrap_or(256),
            },
            image_token_id: top.image_token_index.unwrap_or(262_144),
            boi_token_id: top.boi_token_index.unwrap_or(255_999),
            eoi_token_id: top.eoi_token_index.unwrap_or(256_000),
            feature_divisor: top.hidden_size.unwrap_or(2048.0).sqrt(),
            bidirectional_images: false,
            preprocess: Preprocess {
                resize: Resize::Fixed {
                    width: size.width,
                    height: size.height,
                },
                rescale_factor: pre.rescale_factor.unwrap_or(1.0 / 255.0),
                rescale_in_f32: false,
                mean: pre.image_mean.unwrap_or([0.5; 3]),
                std: pre.image_std.unwrap_or([0.5; 3]),
                do_rescale: pre.do_rescale.unwrap_or(true),
                do_normalize: pre.do_normalize.unwrap_or(true),
            },
        })
    }

    fn gemma4(dir: &Path, top: &RawTop, v: &RawVision) -> anyhow::Result<Self> {
        let path = dir.join("config.json");
        if top.audio_config.as_ref().is_some_and(|a| !a.is_null()) {
            // The audio tower is not built: audio parts are refused by the
            // API (no such content type), so it is only reported here.
            tracing::warn!(
                "{}: the Gemma 4 audio tower is not supported; images and text only",
                path.display()
            );
        }
        if let Some(act) = v.hidden_activation.as_deref() {
            if act != "gelu_pytorch_tanh" {
                bail!(
                    "vision_config.hidden_activation `{act}` is not supported (gelu_pytorch_tanh)"
                );
            }
        }
        let text = top.text_config.as_ref();
        let text_hidden = text
            .and_then(|t| t["hidden_size"].as_f64())
            .context("text_config.hidden_size missing")? as f32;
        let bidirectional_images = match text.map(|t| &t["use_bidirectional_attention"]) {
            None | Some(Value::Null) => false,
            Some(Value::String(s)) if s == "vision" => true,
            Some(other) => bail!(
                "text_config.use_bidirectional_attention {other} is not supported (null or \"vision\")"
            ),
        };
        let rope_theta = v
            .rope_parameters
            .as_ref()
            .and_then(|r| r["rope_theta"].as_f64())
            .unwrap_or(100.0) as f32;
        let pre = gemma4_preprocessor(dir)?;
        let patch_size = v.patch_size.unwrap_or(16);
        let num_heads = v.num_attention_heads.unwrap_or(12);
        let pooling_kernel = v.pooling_kernel_size.unwrap_or(3);
        if pre.patch_size.is_some_and(|p| p as i32 != patch_size)
            || pre
                .pooling_kernel_size
                .is_some_and(|k| k as i32 != pooling_kernel)
        {
            bail!(
                "{}: the processor's patch_size / pooling_kernel_size differ from vision_config's",
                dir.display()
            );
        }
        if pre.do_resize == Some(false) {
            bail!("{}: do_resize false is not supported", dir.display());
        }
        let max_soft_tokens = pre.max_soft_tokens.unwrap_or(280);
        Ok(Self {
            hidden_size: v.hidden_size.unwrap_or(768),
            intermediate_size: v.intermediate_size.unwrap_or(3072),
            num_layers: v.num_hidden_layers.unwrap_or(16),
            num_heads,
            patch_size,
            num_channels: v.num_channels.unwrap_or(3),
            tower: TowerKind::Gemma4(Gemma4Tower {
                text_hidden: text_hidden as i32,
                head_dim: v.head_dim.unwrap_or(64),
                kv_heads: v.num_key_value_heads.unwrap_or(num_heads),
                rms_norm_eps: v.rms_norm_eps.unwrap_or(1e-6),
                rope_theta,
                position_embedding_size: v.position_embedding_size.unwrap_or(10_240),
                pooling_kernel,
                clipped_linears: v.use_clipped_linears.unwrap_or(false),
                standardize: v.standardize.unwrap_or(false),
            }),
            image_token_id: top.image_token_id.unwrap_or(258_880),
            boi_token_id: top.boi_token_id.unwrap_or(255_999),
            eoi_token_id: top.eoi_token_id.unwrap_or(258_882),
            feature_divisor: text_hidden.sqrt(),
            bidirectional_images,
            preprocess: Preprocess {
                resize: Resize::FitPatches {
                    patch_size: patch_size as u32,
                    max_patches: max_soft_tokens * (pooling_kernel as u32).pow(2),
                    side_multiple: (pooling_kernel * patch_size) as u32,
                    pooling_kernel: pooling_kernel as u32,
                },
                rescale_factor: pre.rescale_factor.unwrap_or(1.0 / 255.0),
                rescale_in_f32: true,
                mean: pre.image_mean.unwrap_or([0.0; 3]),
                std: pre.image_std.unwrap_or([1.0; 3]),
                do_rescale: pre.do_rescale.unwrap_or(true),
                do_normalize: pre.do_normalize.unwrap_or(false),
            },
        })
    }

    fn check(&self) -> anyhow::Result<()> {
        if self.num_channels != 3 {
            bail!(
                "vision config: {} channels (only RGB is supported)",
                self.num_channels
            );
        }
        match &self.tower {
            TowerKind::Gemma3 {
                image_size,
                tokens_per_image,
                ..
            } => {
                let patches = image_size / self.patch_size;
                let side = (*tokens_per_image as f64).sqrt() as i32;
                if image_size % self.patch_size != 0
                    || side * side != *tokens_per_image
                    || side == 0
                    || patches % side != 0
                {
                    bail!(
                        "vision config: image_size {image_size} / patch_size {} and mm_tokens_per_image {tokens_per_image} do not pool evenly",
                        self.patch_size
                    );
                }
            }
            TowerKind::Gemma4(g) => {
                // The 2D rope splits each head in two halves, each rotated
                // in pairs.
                if g.head_dim % 4 != 0 {
                    bail!(
                        "vision_config.head_dim {} is not a multiple of 4 (2D rope)",
                        g.head_dim
                    );
                }
                if self.num_heads % g.kv_heads != 0 {
                    bail!(
                        "vision_config: {} heads do not share {} key/value heads evenly",
                        self.num_heads,
                        g.kv_heads
                    );
                }
                let Resize::FitPatches { max_patches, .. } = self.preprocess.resize else {
                    unreachable!("Gemma 4 resizes to fit patches")
                };
                if g.pooling_kernel < 1 || max_patches == 0 {
                    bail!(
                        "vision config: pooling_kernel_size and max_soft_tokens must be positive"
                    );
                }
                // The widest image's patch coordinates index the tables.
                let max_side = max_patches as i32 / g.pooling_kernel.pow(2) * g.pooling_kernel;
                if max_side > g.position_embedding_size {
                    bail!(
                        "vision_config.position_embedding_size {} is smaller than the {max_side} patches an image side can have",
                        g.position_embedding_size
                    );
                }
            }
        }
        Ok(())
    }

    /// Soft tokens of an image of `width` x `height` pixels (as decoded).
    pub fn soft_tokens(&self, width: u32, height: u32) -> Result<usize, String> {
        match &self.tower {
            TowerKind::Gemma3 {
                tokens_per_image, ..
            } => Ok(*tokens_per_image as usize),
            TowerKind::Gemma4(g) => {
                let (w, h) = self.preprocess.resize.target(width, height)?;
                let p = self.patch_size as u32;
                let k = g.pooling_kernel as u32;
                Ok(((w / p) * (h / p) / (k * k)) as usize)
            }
        }
    }

    /// The soft-token count when every image has the same one (Gemma 3).
    pub fn fixed_soft_tokens(&self) -> Option<usize> {
        match &self.tower {
            TowerKind::Gemma3 {
                tokens_per_image, ..
            } => Some(*tokens_per_image as usize),
            TowerKind::Gemma4(_) => None,
        }
    }
}

/// Gemma 4's image processor settings: `processor_config.json`'s
/// `image_processor` (Hugging Face's layout), else a flat
/// `preprocessor_config.json`; defaults when neither exists.
fn gemma4_preprocessor(dir: &Path) -> anyhow::Result<RawPreprocessor> {
    let nested = dir.join("processor_config.json");
    if nested.exists() {
        let v = read_json(&nested)?;
        if v["image_processor"].is_object() {
            return serde_json::from_value(v["image_processor"].clone())
                .with_context(|| format!("parsing {} image_processor", nested.display()));
        }
    }
    let flat = dir.join("preprocessor_config.json");
    if flat.exists() {
        return serde_json::from_value(read_json(&flat)?)
            .with_context(|| format!("parsing {}", flat.display()));
    }
    Ok(RawPreprocessor::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hugging Face writes only what differs from the config class's
    /// defaults; a Gemma 4 vision config of defaults is the real tower's.
    #[test]
    fn gemma4_defaults_are_hugging_faces() {
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({
            "model_type": "gemma4",
            "text_config": { "hidden_size": 2816, "use_bidirectional_attention": "vision" },
            "vision_config": { "model_type": "gemma4_vision" },
        });
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        let cfg = VisionConfig::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(
            (
                cfg.hidden_size,
                cfg.num_layers,
                cfg.num_heads,
                cfg.patch_size
            ),
            (768, 16, 12, 16)
        );
        let TowerKind::Gemma4(g) = &cfg.tower else {
            panic!("a Gemma 4 tower")
        };
        assert_eq!((g.head_dim, g.kv_heads, g.pooling_kernel), (64, 12, 3));
        assert_eq!(g.position_embedding_size, 10_240);
        assert!(cfg.bidirectional_images && !cfg.preprocess.do_normalize);
        assert_eq!(
            (cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id),
            (258_880, 255_999, 258_882)
        );
        // 280 soft tokens at most: a 640x480 photo takes 19 x 14.
        assert_eq!(cfg.soft_tokens(640, 480), Ok(266));
        assert_eq!(cfg.soft_tokens(1000, 1000), Ok(256));
        assert_eq!(cfg.fixed_soft_tokens(), None);
    }

    #[test]
    fn fit_patches_keeps_aspect_ratio_within_the_budget() {
        // Gemma 4's defaults: 16-pixel patches, 280 soft tokens of 3x3.
        let r = Resize::FitPatches {
            patch_size: 16,
            max_patches: 280 * 9,
            side_multiple: 48,
            pooling_kernel: 3,
        };
        // sqrt(645120 / 307200) = 1.449: 640x480 -> 912x672 (19x14 tiles).
        assert_eq!(r.target(640, 480), Ok((912, 672)));
        assert_eq!(r.target(768, 768), Ok((768, 768)));
        // Too thin for one tile across: one tile, and the ratio along.
        assert_eq!(r.target(4000, 10), Ok((280 * 48, 48)));
        let tiny = Resize::FitPatches {
            patch_size: 4,
            max_patches: 64,
            side_multiple: 8,
            pooling_kernel: 2,
        };
        assert_eq!(tiny.target(32, 32), Ok((32, 32)));
        assert_eq!(tiny.target(16, 48), Ok((16, 48)));
        assert_eq!(tiny.target(24, 48), Ok((16, 40)));
    }
}
