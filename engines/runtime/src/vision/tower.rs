//! The vision towers: pixels to soft-token embeddings in the text model's
//! units. [`VisionTower`] picks the family's encoder; this file holds
//! Gemma 3's: a SigLIP tower (patch embedding, learned positions, pre-norm
//! encoder layers with full attention, a final LayerNorm), then the
//! multimodal projector (average pooling of the patch grid to the soft-token
//! grid, Gemma RMSNorm, a linear map into the text model's width). Computed
//! the way mlx-vlm computes it, the reference the oracle test compares
//! against (exact GELU in the MLP, eps 1e-5 on the post-LayerNorm).
//! Gemma 4's is in [`super::gemma4`].

use mlx_rs::{fast, nn, ops, Array, Dtype};

use super::config::TowerKind;
use super::gemma4::Gemma4Encoder;
use crate::config::Quantization;
use crate::layers::{Linear, RmsNorm};
use crate::vision::config::VisionConfig;
use crate::weights::Weights;

type R<T> = Result<T, mlx_rs::error::Exception>;

const TOWER: &str = "vision_tower.vision_model";
const PROJECTOR: &str = "multi_modal_projector";

struct LayerNorm {
    weight: Array,
    bias: Array,
    eps: f32,
}

impl LayerNorm {
    fn load(w: &mut Weights, name: &str, eps: f32) -> anyhow::Result<Self> {
        Ok(Self {
            weight: w.take(&format!("{name}.weight"))?,
            bias: w.take(&format!("{name}.bias"))?,
            eps,
        })
    }

    fn forward(&self, x: &Array) -> R<Array> {
        fast::layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

struct EncoderLayer {
    norm1: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

pub struct VisionTower {
    pub config: VisionConfig,
    encoder: Encoder,
}

enum Encoder {
    Siglip(Siglip),
    Gemma4(Gemma4Encoder),
}

impl VisionTower {
    /// Takes the tower's and projector's weights out of `w`, leaving the
    /// text model's.
    /// `quant`: the checkpoint's MLX quantization, for towers whose linear
    /// layers were quantized with the text model.
    pub fn load(
        config: VisionConfig,
        w: &mut Weights,
        quant: Option<Quantization>,
    ) -> anyhow::Result<Self> {
        let encoder = match &config.tower {
            TowerKind::Gemma3 { .. } => Encoder::Siglip(Siglip::load(&config, w, quant)?),
            TowerKind::Gemma4(_) => Encoder::Gemma4(Gemma4Encoder::load(&config, w, quant)?),
        };
        Ok(Self { config, encoder })
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        match &self.encoder {
            Encoder::Siglip(s) => s.collect(out),
            Encoder::Gemma4(g) => g.collect(out),
        }
    }

    pub fn dtype(&self) -> Dtype {
        match &self.encoder {
            Encoder::Siglip(s) => s.patch_weight.dtype(),
            Encoder::Gemma4(g) => g.dtype(),
        }
    }

    /// `pixels`: `[N, H, W, 3]` float32, preprocessed (images of one size).
    /// Returns the soft-token embeddings `[N, tokens, text_hidden]` in the
    /// units the text model's embedding table uses before its own scale.
    pub fn forward(&self, pixels: &Array) -> anyhow::Result<Array> {
        let dtype = self.dtype();
        let projected = match &self.encoder {
            Encoder::Siglip(s) => s.forward(&self.config, pixels)?,
            Encoder::Gemma4(g) => g.forward(&self.config, pixels)?,
        };
        let divisor = Array::from_f32(self.config.feature_divisor).as_dtype(dtype)?;
        Ok(projected.divide(&divisor)?)
    }
}

/// Gemma 3's tower and projector.
struct Siglip {
    /// `[out, kh, kw, in]`, MLX's convolution layout.
    patch_weight: Array,
    patch_bias: Array,
    positions: Array,
    layers: Vec<EncoderLayer>,
    post_norm: LayerNorm,
    soft_norm: RmsNorm,
    projection: Array,
}

impl Siglip {
    fn load(
        config: &VisionConfig,
        w: &mut Weights,
        quant: Option<Quantization>,
    ) -> anyhow::Result<Self> {
        let TowerKind::Gemma3 {
            layer_norm_eps: eps,
            ..
        } = config.tower
        else {
            unreachable!("a Gemma 3 config")
        };
        let mut patch_weight = w.take(&format!("{TOWER}.embeddings.patch_embedding.weight"))?;
        // Hugging Face stores PyTorch's `[out, in, kh, kw]`; MLX conversions
        // store `[out, kh, kw, in]` already.
        if patch_weight.dim(1) == config.num_channels && patch_weight.dim(3) != config.num_channels
        {
            patch_weight = patch_weight.transpose_axes(&[0, 2, 3, 1])?;
        }
        let patch_bias = w.take(&format!("{TOWER}.embeddings.patch_embedding.bias"))?;
        let positions = w.take(&format!("{TOWER}.embeddings.position_embedding.weight"))?;
        let mut layers = Vec::with_capacity(config.num_layers as usize);
        for i in 0..config.num_layers {
            let p = format!("{TOWER}.encoder.layers.{i}");
            layers.push(EncoderLayer {
                norm1: LayerNorm::load(w, &format!("{p}.layer_norm1"), eps)?,
                q: Linear::load(w, &format!("{p}.self_attn.q_proj"), quant)?,
                k: Linear::load(w, &format!("{p}.self_attn.k_proj"), quant)?,
                v: Linear::load(w, &format!("{p}.self_attn.v_proj"), quant)?,
                out: Linear::load(w, &format!("{p}.self_attn.out_proj"), quant)?,
                norm2: LayerNorm::load(w, &format!("{p}.layer_norm2"), eps)?,
                fc1: Linear::load(w, &format!("{p}.mlp.fc1"), quant)?,
                fc2: Linear::load(w, &format!("{p}.mlp.fc2"), quant)?,
            });
        }
        // mlx-vlm builds the post-LayerNorm with MLX's default eps.
        let post_norm = LayerNorm::load(w, &format!("{TOWER}.post_layernorm"), 1e-5)?;
        let soft_norm = RmsNorm::load(w, &format!("{PROJECTOR}.mm_soft_emb_norm"), eps, true)?;
        let projection = w.take(&format!("{PROJECTOR}.mm_input_projection_weight"))?;
        Ok(Self {
            patch_weight,
            patch_bias,
            positions,
            layers,
            post_norm,
            soft_norm,
            projection,
        })
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        out.extend([
            &self.patch_weight,
            &self.patch_bias,
            &self.positions,
            &self.projection,
        ]);
        for l in &self.layers {
            for lin in [&l.q, &l.k, &l.v, &l.out, &l.fc1, &l.fc2] {
                lin.collect(out);
            }
            for n in [&l.norm1, &l.norm2] {
                out.extend([&n.weight, &n.bias]);
            }
        }
        out.extend([&self.post_norm.weight, &self.post_norm.bias]);
        self.soft_norm.collect(out);
    }

    /// The projected soft tokens `[N, tokens_per_image, text_hidden]`.
    fn forward(&self, config: &VisionConfig, pixels: &Array) -> anyhow::Result<Array> {
        let dtype = self.patch_weight.dtype();
        let x = pixels.as_dtype(dtype)?;
        let p = config.patch_size;
        let patches =
            ops::conv2d(&x, &self.patch_weight, (p, p), None, None, None)?.add(&self.patch_bias)?;
        let n = patches.dim(0);
        let d = config.hidden_size;
        let mut h = patches.reshape(&[n, -1, d])?.add(&self.positions)?;
        for layer in &self.layers {
            h = layer.forward(&h, config.num_heads)?;
        }
        let h = self.post_norm.forward(&h)?;
        let pooled = pool(config, &h)?;
        let normed = self.soft_norm.forward(&pooled)?;
        Ok(normed.matmul(&self.projection)?.as_dtype(dtype)?)
    }
}

/// Average pooling of the `patches x patches` grid down to the soft token
/// grid, rows in raster order.
fn pool(config: &VisionConfig, h: &Array) -> R<Array> {
    let TowerKind::Gemma3 {
        image_size,
        tokens_per_image,
        ..
    } = config.tower
    else {
        unreachable!("a Gemma 3 config")
    };
    let n = h.dim(0);
    let d = h.dim(2);
    let patches = image_size / config.patch_size;
    let side = (tokens_per_image as f64).sqrt() as i32;
    let k = patches / side;
    h.reshape(&[n, side, k, side, k, d])?
        .mean_axes(&[2, 4], false)?
        .reshape(&[n, side * side, d])
}

impl EncoderLayer {
    fn forward(&self, x: &Array, heads: i32) -> anyhow::Result<Array> {
        let (b, l, d) = (x.dim(0), x.dim(1), x.dim(2));
        let y = self.norm1.forward(x)?;
        let split = |t: Array| -> R<Array> {
            t.reshape(&[b, l, heads, d / heads])?
                .transpose_axes(&[0, 2, 1, 3])
        };
        let q = split(self.q.forward(&y)?)?;
        let k = split(self.k.forward(&y)?)?;
        let v = split(self.v.forward(&y)?)?;
        let scale = ((d / heads) as f32).powf(-0.5);
        let a = fast::scaled_dot_product_attention(&q, &k, &v, scale, None, None)?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[b, l, d])?;
        let h = x.add(&self.out.forward(&a)?)?;
        let m = self
            .fc2
            .forward(&nn::gelu(self.fc1.forward(&self.norm2.forward(&h)?)?)?)?;
        Ok(h.add(&m)?)
    }
}
