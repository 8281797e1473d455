//! Gemma 4's vision encoder, computed the way mlx-vlm 0.7.6 computes it
//! (the oracle test's reference):
//!
//! * patches of `patch_size`^2 pixels (rows, then columns, then channels),
//!   mapped from [0, 1] to [-1, 1] and through a linear `input_proj`;
//! * learned positions: one table per axis, the row's and the column's
//!   entries added;
//! * pre- and post-normed (RMSNorm, plain weight) transformer layers: q, k
//!   normed with a weight and v without, 2D rope (half of each head rotated
//!   by the patch's column, half by its row), attention scale 1, no mask
//!   (every patch is real), a gated tanh-GELU MLP; linear layers optionally
//!   clamp their inputs and outputs (`use_clipped_linears`);
//! * average pooling of `pooling_kernel` x `pooling_kernel` patches into one
//!   soft token, times `sqrt(hidden)`, optionally standardized;
//! * `embed_vision`: a weightless RMSNorm and a linear map into the text
//!   model's width.

use mlx_rs::{fast, ops, Array, Dtype};

use super::config::{Gemma4Tower, TowerKind, VisionConfig};
use crate::config::Quantization;
use crate::layers::Linear;
use crate::weights::Weights;

type R<T> = Result<T, mlx_rs::error::Exception>;

const TOWER: &str = "vision_tower";
const EMBED: &str = "embed_vision";

/// A linear layer whose input and output may be clamped to learned bounds.
struct ClippedLinear {
    linear: Linear,
    /// `(input_min, input_max, output_min, output_max)` scalars.
    bounds: Option<[Array; 4]>,
}

impl ClippedLinear {
    fn load(
        w: &mut Weights,
        prefix: &str,
        quant: Option<Quantization>,
        (out_features, in_features): (i32, i32),
        clipped: bool,
    ) -> anyhow::Result<Self> {
        let linear = Linear::load_checked(
            w,
            &format!("{prefix}.linear"),
            quant,
            out_features,
            in_features,
        )?;
        let bounds = if clipped {
            let mut b = Vec::with_capacity(4);
            for name in ["input_min", "input_max", "output_min", "output_max"] {
                let name = format!("{prefix}.{name}");
                let a = w.take(&name)?;
                if a.size() != 1 {
                    anyhow::bail!(
                        "tensor `{name}` in {} has shape {:?}, expected a scalar",
                        w.file_of(&name),
                        a.shape()
                    );
                }
                b.push(a.reshape(&[])?);
            }
            Some([b[0].clone(), b[1].clone(), b[2].clone(), b[3].clone()])
        } else {
            None
        };
        Ok(Self { linear, bounds })
    }

    fn forward(&self, x: &Array) -> R<Array> {
        match &self.bounds {
            None => self.linear.forward(x),
            Some([in_min, in_max, out_min, out_max]) => {
                let x = ops::clip(x, (in_min, in_max))?;
                let y = self.linear.forward(&x)?;
                ops::clip(&y, (out_min, out_max))
            }
        }
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.linear.collect(out);
        if let Some(b) = &self.bounds {
            out.extend(b.iter());
        }
    }
}

struct Layer {
    input_norm: Array,
    post_attention_norm: Array,
    pre_mlp_norm: Array,
    post_mlp_norm: Array,
    q: ClippedLinear,
    k: ClippedLinear,
    v: ClippedLinear,
    o: ClippedLinear,
    q_norm: Array,
    k_norm: Array,
    gate: ClippedLinear,
    up: ClippedLinear,
    down: ClippedLinear,
}

pub struct Gemma4Encoder {
    shape: Gemma4Tower,
    input_proj: Linear,
    /// `[2, position_embedding_size, hidden]`: columns' table, rows' table.
    positions: Array,
    layers: Vec<Layer>,
    /// `(std_bias, std_scale)` when the config standardizes.
    standardize: Option<(Array, Array)>,
    projection: Linear,
}

impl Gemma4Encoder {
    pub fn load(
        config: &VisionConfig,
        w: &mut Weights,
        quant: Option<Quantization>,
    ) -> anyhow::Result<Self> {
        let TowerKind::Gemma4(shape) = &config.tower else {
            unreachable!("a Gemma 4 config")
        };
        let (d, i, p) = (
            config.hidden_size,
            config.intermediate_size,
            config.patch_size,
        );
        let (heads, kv, hd) = (config.num_heads, shape.kv_heads, shape.head_dim);
        let clip = shape.clipped_linears;
        let input_proj = Linear::load_checked(
            w,
            &format!("{TOWER}.patch_embedder.input_proj"),
            quant,
            d,
            3 * p * p,
        )?;
        let positions = w.take_shaped(
            &format!("{TOWER}.patch_embedder.position_embedding_table"),
            &[2, shape.position_embedding_size, d],
        )?;
        let mut layers = Vec::with_capacity(config.num_layers as usize);
        for l in 0..config.num_layers {
            let pre = format!("{TOWER}.encoder.layers.{l}");
            let mut lin = |name: &str, dims| {
                ClippedLinear::load(w, &format!("{pre}.{name}"), quant, dims, clip)
            };
            let q = lin("self_attn.q_proj", (heads * hd, d))?;
            let k = lin("self_attn.k_proj", (kv * hd, d))?;
            let v = lin("self_attn.v_proj", (kv * hd, d))?;
            let o = lin("self_attn.o_proj", (d, heads * hd))?;
            let gate = lin("mlp.gate_proj", (i, d))?;
            let up = lin("mlp.up_proj", (i, d))?;
            let down = lin("mlp.down_proj", (d, i))?;
            let mut norm =
                |name: &str, n: i32| w.take_shaped(&format!("{pre}.{name}.weight"), &[n]);
            layers.push(Layer {
                input_norm: norm("input_layernorm", d)?,
                post_attention_norm: norm("post_attention_layernorm", d)?,
                pre_mlp_norm: norm("pre_feedforward_layernorm", d)?,
                post_mlp_norm: norm("post_feedforward_layernorm", d)?,
                q_norm: norm("self_attn.q_norm", hd)?,
                k_norm: norm("self_attn.k_norm", hd)?,
                q,
                k,
                v,
                o,
                gate,
                up,
                down,
            });
        }
        let standardize = if shape.standardize {
            Some((
                w.take_shaped(&format!("{TOWER}.std_bias"), &[d])?,
                w.take_shaped(&format!("{TOWER}.std_scale"), &[d])?,
            ))
        } else {
            None
        };
        let projection = Linear::load_checked(
            w,
            &format!("{EMBED}.embedding_projection"),
            quant,
            shape.text_hidden,
            d,
        )?;
        Ok(Self {
            shape: shape.clone(),
            input_proj,
            positions,
            layers,
            standardize,
            projection,
        })
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.input_proj.collect(out);
        out.push(&self.positions);
        for l in &self.layers {
            out.extend([
                &l.input_norm,
                &l.post_attention_norm,
                &l.pre_mlp_norm,
                &l.post_mlp_norm,
                &l.q_norm,
                &l.k_norm,
            ]);
            for lin in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
                lin.collect(out);
            }
        }
        if let Some((b, s)) = &self.standardize {
            out.extend([b, s]);
        }
        self.projection.collect(out);
    }

    pub fn dtype(&self) -> Dtype {
        self.positions.dtype()
    }

    /// `pixels`: `[N, H, W, 3]` in [0, 1], sides multiples of
    /// `pooling_kernel * patch_size`. The projected soft tokens
    /// `[N, (H/p/k) * (W/p/k), text_hidden]`, in raster order.
    pub fn forward(&self, config: &VisionConfig, pixels: &Array) -> anyhow::Result<Array> {
        let dtype = self.dtype();
        let (n, height, width) = (pixels.dim(0), pixels.dim(1), pixels.dim(2));
        let p = config.patch_size;
        let k = self.shape.pooling_kernel;
        let (rows, cols) = (height / p, width / p);
        anyhow::ensure!(
            height % (p * k) == 0 && width % (p * k) == 0,
            "a {width}x{height} image does not split into {k}x{k} tiles of {p}-pixel patches"
        );
        anyhow::ensure!(
            rows.max(cols) <= self.shape.position_embedding_size,
            "a {width}x{height} image has more patches per side than the position table's {}",
            self.shape.position_embedding_size
        );
        let patches = pixels
            .reshape(&[n, rows, p, cols, p, 3])?
            .transpose_axes(&[0, 1, 3, 2, 4, 5])?
            .reshape(&[n, rows * cols, p * p * 3])?;
        let two = Array::from_f32(2.0);
        let patches = patches
            .subtract(Array::from_f32(0.5))?
            .multiply(&two)?
            .as_dtype(dtype)?;
        let mut h = self.input_proj.forward(&patches)?;

        // Raster order: the column index varies fastest.
        let col_ids = ops::tile(&Array::arange::<_, i32>(0, cols, 1)?, &[rows])?;
        let row_ids =
            Array::arange::<_, i32>(0, rows * cols, 1)?.floor_divide(Array::from_int(cols))?;
        let tables = self.positions.split_equal(2, 0)?;
        let col_table = tables[0].squeeze_axes(&[0])?;
        let row_table = tables[1].squeeze_axes(&[0])?;
        let pos = col_table
            .take_axis(&col_ids, 0)?
            .add(row_table.take_axis(&row_ids, 0)?)?;
        h = h.add(&pos)?;

        let rope = self.rope_tables(&col_ids, &row_ids, dtype)?;
        for layer in &self.layers {
            h = layer.forward(&h, config, &self.shape, &rope)?;
        }

        // Pooling: k x k patches to one soft token, in raster order.
        let d = config.hidden_size;
        // Averaged in float32, as the reference does.
        let pooled = h
            .as_dtype(Dtype::Float32)?
            .reshape(&[n, rows / k, k, cols / k, k, d])?
            .mean_axes(&[2, 4], false)?
            .reshape(&[n, (rows / k) * (cols / k), d])?
            .as_dtype(dtype)?;
        let mut x = pooled.multiply(Array::from_f32((d as f32).sqrt()).as_dtype(dtype)?)?;
        if let Some((bias, scale)) = &self.standardize {
            x = x.subtract(bias)?.multiply(scale)?;
        }
        let normed = fast::rms_norm(&x, None, self.shape.rms_norm_eps)?;
        Ok(self.projection.forward(&normed)?)
    }

    /// cos and sin `[1, L, 1, head_dim]` of the 2D rope: the head's first
    /// half turns with the patch's column, its second with its row; each
    /// half at frequencies `theta^(-2j / half)`.
    fn rope_tables(&self, cols: &Array, rows: &Array, dtype: Dtype) -> R<(Array, Array)> {
        let half_head = self.shape.head_dim / 2;
        let pairs = half_head / 2;
        let exponents = Array::arange::<_, f32>(0, pairs, 1)?
            .multiply(Array::from_f32(2.0 / half_head as f32))?;
        let timescale = ops::power(Array::from_f32(self.shape.rope_theta), &exponents)?;
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for ids in [cols, rows] {
            let angles = ids
                .as_dtype(Dtype::Float32)?
                .expand_dims(-1)?
                .divide(&timescale)?;
            let (c, s) = (angles.cos()?, angles.sin()?);
            cos.extend([c.clone(), c]);
            sin.extend([s.clone(), s]);
        }
        let shape = |parts: &[Array]| -> R<Array> {
            ops::concatenate(parts, -1)?
                .as_dtype(dtype)?
                .expand_dims(0)?
                .expand_dims(2)
        };
        Ok((shape(&cos)?, shape(&sin)?))
    }
}

/// The q, k and v norms: computed in float32 and rounded once, as the
/// reference does (it matters in bf16).
fn head_norm(x: &Array, weight: Option<&Array>, eps: f32) -> R<Array> {
    let dtype = x.dtype();
    let w = match weight {
        Some(w) => Some(w.as_dtype(Dtype::Float32)?),
        None => None,
    };
    fast::rms_norm(x.as_dtype(Dtype::Float32)?, w.as_ref(), eps)?.as_dtype(dtype)
}

/// `x * cos + rotate_half(x) * sin`, rotate_half within each half of the
/// head (each axis' part).
fn rope_2d(x: &Array, (cos, sin): &(Array, Array)) -> R<Array> {
    let s = x.shape().to_vec();
    let pairs = s[3] / 4;
    let parts = x.reshape(&[s[0], s[1], s[2], 2, 2, pairs])?;
    let halves = parts.split_equal(2, 4)?;
    let rotated = ops::concatenate(&[halves[1].negative()?, halves[0].clone()], 4)?.reshape(&s)?;
    x.multiply(cos)?.add(rotated.multiply(sin)?)
}

impl Layer {
    fn forward(
        &self,
        x: &Array,
        config: &VisionConfig,
        shape: &Gemma4Tower,
        rope: &(Array, Array),
    ) -> anyhow::Result<Array> {
        let eps = shape.rms_norm_eps;
        let (b, l) = (x.dim(0), x.dim(1));
        let (heads, kv, hd) = (config.num_heads, shape.kv_heads, shape.head_dim);
        let y = fast::rms_norm(x, Some(&self.input_norm), eps)?;
        let q = self.q.forward(&y)?.reshape(&[b, l, heads, hd])?;
        let k = self.k.forward(&y)?.reshape(&[b, l, kv, hd])?;
        let v = self.v.forward(&y)?.reshape(&[b, l, kv, hd])?;
        let q = rope_2d(&head_norm(&q, Some(&self.q_norm), eps)?, rope)?;
        let k = rope_2d(&head_norm(&k, Some(&self.k_norm), eps)?, rope)?;
        let v = head_norm(&v, None, eps)?;
        let t = |a: Array| a.transpose_axes(&[0, 2, 1, 3]);
        let a = fast::scaled_dot_product_attention(&t(q)?, &t(k)?, &t(v)?, 1.0, None, None)?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[b, l, heads * hd])?;
        let attn = fast::rms_norm(&self.o.forward(&a)?, Some(&self.post_attention_norm), eps)?;
        let h = x.add(&attn)?;
        let m = fast::rms_norm(&h, Some(&self.pre_mlp_norm), eps)?;
        let m = crate::activations::gelu_approx(&self.gate.forward(&m)?)?
            .multiply(self.up.forward(&m)?)?;
        let m = fast::rms_norm(&self.down.forward(&m)?, Some(&self.post_mlp_norm), eps)?;
        Ok(h.add(&m)?)
    }
}
