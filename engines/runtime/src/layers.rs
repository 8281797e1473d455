//! The building blocks shared by the model families: linear layers (dense or
//! MLX group-quantized), embeddings, RMSNorm and rotary embeddings.

use mlx_rs::ops::indexing::{Ellipsis, TryIndexOp};
use mlx_rs::{fast, ops, Array, Dtype};

use crate::cache::Offsets;
use crate::config::{Quantization, RopeScaling};
use crate::weights::Weights;

type R<T> = Result<T, mlx_rs::error::Exception>;

/// A dense `[out, in]` weight kept as its transposed view `[in, out]`, the
/// operand a product reads, so a step's graph holds no Transpose node per
/// product. It is a parameter like any other: evaluated at load with the
/// rest, and in a plugin replaced by the host's array (a copy derived from
/// the plugin's own lazy weight would load the checkpoint a second time).
pub struct DenseWeight {
    t: Array,
}

impl DenseWeight {
    pub fn new(weight: &Array) -> Self {
        Self { t: weight.t() }
    }

    /// The `[out, in]` weight (a view).
    pub fn weight(&self) -> Array {
        self.t.t()
    }

    fn out_features(&self) -> i32 {
        self.t.dim(1)
    }

    /// `x @ weight.T`: a few rows on a GPU by our kernel
    /// ([`crate::gpu_fused::product`]), else MLX's.
    fn product(&self, x: &Array) -> R<Array> {
        if crate::gpu_fused::takes_product(x, &self.t, false) {
            return crate::gpu_fused::product(x, &self.t, false);
        }
        x.matmul(&self.t)
    }
}

pub enum Linear {
    Dense {
        weight: DenseWeight,
        bias: Option<Array>,
    },
    Quantized {
        weight: Array,
        scales: Array,
        biases: Array,
        bias: Option<Array>,
        group_size: i32,
        bits: i32,
        /// The weights expanded to the compute dtype, kept beside the packed
        /// ones on a GPU where that is cheap
        /// ([`crate::ComputeDtype::keeps_dense_copies`]): products of
        /// [`DEQUANTIZE_ROWS`] rows or more use it.
        expanded: Option<DenseWeight>,
    },
}

/// From this many rows on (a batched step, a verify, a prefill chunk), a
/// product with packed weights multiplies densely where no faster kernel
/// takes it. On the CPU, past [`PACKED_ROWS`] or for widths the project's
/// kernel lacks, it unpacks them first: MLX's CPU kernel costs a pass over
/// the packed weights per row, where unpacking once costs about three
/// rows' worth. On a GPU it uses the
/// layer's expanded copy where it keeps one: MLX CUDA's 4-bit kernels take
/// 1.2-4.6x cuBLAS's time for 4-32 rows (docs/gpu.md, "Gemma 4 and other
/// MoE shapes").
const DEQUANTIZE_ROWS: i32 = 4;

/// Up to this many rows, a product with packed weights on the CPU runs the
/// project's kernel ([`crate::packed`]), which reads the packed weights once
/// for all the rows; more rows (a long prefill chunk) do too where its path
/// is fast at many rows ([`crate::packed::many_rows_fast`], faster than
/// dequantizing and BLAS's `sgemm` at 256-512 rows), and are dequantized
/// and multiplied by BLAS elsewhere.
const PACKED_ROWS: i32 = 64;

/// `dequantize` into `dtype`, its scales and biases widened first: MLX
/// computes `scale * q + bias` in the scales' dtype, and fp16 ones
/// ([`Weights::keep_half_scales`]) would round each weight to fp16.
fn dequantize_as(
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
    dtype: Dtype,
) -> R<Array> {
    let (s, b) = (scales.as_dtype(dtype)?, biases.as_dtype(dtype)?);
    ops::dequantize(w, &s, &b, group_size, bits)
}

/// Rows of `x`: every axis but the last.
pub(crate) fn rows(x: &Array) -> i32 {
    x.shape()[..x.ndim() - 1].iter().product()
}

impl Linear {
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        quant: Option<Quantization>,
    ) -> anyhow::Result<Self> {
        let bias = w.take_optional(&format!("{prefix}.bias"));
        let weight = w.take(&format!("{prefix}.weight"))?;
        let quant = w.quantization(prefix).or(quant);
        match (quant, w.take_optional(&format!("{prefix}.scales"))) {
            (Some(q), Some(scales)) => {
                let biases = w.take(&format!("{prefix}.biases"))?;
                let expanded = w
                    .keeps_dense_copy(prefix, &weight)
                    .then(|| {
                        ops::dequantize(&weight, &scales, &biases, q.group_size, q.bits)
                            .map(|d| DenseWeight::new(&d))
                    })
                    .transpose()?;
                Ok(Linear::Quantized {
                    weight,
                    scales,
                    biases,
                    bias,
                    group_size: q.group_size,
                    bits: q.bits,
                    expanded,
                })
            }
            _ => Ok(Linear::Dense {
                weight: DenseWeight::new(&weight),
                bias,
            }),
        }
    }

    /// [`Linear::load`] of a layer mapping `in_features` to `out_features`:
    /// a tensor of another shape, or quantized weights the config does not
    /// describe, fail naming the tensor and its file.
    pub fn load_checked(
        w: &mut Weights,
        prefix: &str,
        quant: Option<Quantization>,
        out_features: i32,
        in_features: i32,
    ) -> anyhow::Result<Self> {
        let name = format!("{prefix}.weight");
        let quantized = w.contains(&format!("{prefix}.scales"));
        // A GGUF file gives each tensor its own quantization, as `load` reads.
        if quantized && w.quantization(prefix).or(quant).is_none() {
            anyhow::bail!(
                "tensor `{name}` in {} is quantized (it has scales) but config.json has no quantization for it",
                w.file_of(&name)
            );
        }
        let layer = Self::load(w, prefix, quant)?;
        match &layer {
            Linear::Dense { weight, bias } => {
                w.check_shape(&name, &weight.weight(), &[out_features, in_features])?;
                if let Some(b) = bias {
                    w.check_shape(&format!("{prefix}.bias"), b, &[out_features])?;
                }
            }
            Linear::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
                ..
            } => {
                let (packed, groups) = quantized_shape(in_features, *group_size, *bits)
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "tensor `{name}` in {}: {in_features} inputs do not split into {bits}-bit groups of {group_size}",
                            w.file_of(&name)
                        )
                    })?;
                w.check_shape(&name, weight, &[out_features, packed])?;
                w.check_shape(&format!("{prefix}.scales"), scales, &[out_features, groups])?;
                w.check_shape(&format!("{prefix}.biases"), biases, &[out_features, groups])?;
            }
        }
        Ok(layer)
    }

    pub fn forward(&self, x: &Array) -> R<Array> {
        match self {
            Linear::Dense { weight, bias: None } => weight.product(x),
            Linear::Dense {
                weight,
                bias: Some(b),
            } => ops::addmm(b, x, &weight.t, None, None),
            Linear::Quantized {
                weight,
                scales,
                biases,
                bias,
                group_size,
                bits,
                expanded,
            } => {
                let rows = rows(x);
                let many = rows >= DEQUANTIZE_ROWS;
                let y = match expanded {
                    Some(dense) if many => dense.product(x)?,
                    _ if (rows <= PACKED_ROWS || crate::packed::many_rows_fast())
                        && crate::packed::supports(*bits, *group_size)
                        && crate::compute::on_cpu() =>
                    {
                        crate::packed::matmul(x, weight, scales, biases, *group_size, *bits)?
                    }
                    _ if many && crate::compute::on_cpu() => {
                        let w =
                            dequantize_as(weight, scales, biases, *group_size, *bits, x.dtype())?;
                        x.matmul(w.t())?
                    }
                    _ => {
                        ops::quantized_matmul(x, weight, scales, biases, true, *group_size, *bits)?
                    }
                };
                match bias {
                    Some(b) => y.add(b),
                    None => Ok(y),
                }
            }
        }
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        match self {
            Linear::Dense { weight, bias } => {
                out.extend(std::iter::once(&weight.t).chain(bias.as_ref()))
            }
            Linear::Quantized {
                weight,
                scales,
                biases,
                bias,
                expanded,
                ..
            } => out.extend(
                [weight, scales, biases]
                    .into_iter()
                    .chain(bias.as_ref())
                    .chain(expanded.as_ref().map(|e| &e.t)),
            ),
        }
    }

    fn bias(&self) -> Option<&Array> {
        match self {
            Linear::Dense { bias, .. } | Linear::Quantized { bias, .. } => bias.as_ref(),
        }
    }

    /// Stacks layers that read the same input on the output axis, so one
    /// matmul replaces several. `None` when they differ in kind (dense vs
    /// quantized, bit width, bias or not).
    fn stack(parts: &[Linear]) -> Option<R<Linear>> {
        let cat = |xs: &[&Array]| ops::concatenate(xs, 0);
        let biases: Vec<&Array> = parts.iter().filter_map(Linear::bias).collect();
        if !biases.is_empty() && biases.len() != parts.len() {
            return None;
        }
        let bias = (!biases.is_empty()).then(|| cat(&biases));
        // The `[out, in]` weights of dense parts, stacked.
        let stack_dense = |ws: Vec<Array>| -> R<DenseWeight> {
            Ok(DenseWeight::new(&cat(&ws.iter().collect::<Vec<_>>())?))
        };
        let dense: Option<Vec<Array>> = parts
            .iter()
            .map(|p| match p {
                Linear::Dense { weight, .. } => Some(weight.weight()),
                Linear::Quantized { .. } => None,
            })
            .collect();
        if let Some(ws) = dense {
            return Some((|| {
                Ok(Linear::Dense {
                    weight: stack_dense(ws)?,
                    bias: bias.transpose()?,
                })
            })());
        }
        let mut spec = None;
        let (mut ws, mut ss, mut bs, mut es) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for p in parts {
            let Linear::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
                expanded,
                ..
            } = p
            else {
                return None;
            };
            if spec.is_some_and(|s| s != (*group_size, *bits)) {
                return None;
            }
            spec = Some((*group_size, *bits));
            ws.push(weight);
            ss.push(scales);
            bs.push(biases);
            es.push(expanded.as_ref().map(DenseWeight::weight));
        }
        let (group_size, bits) = spec?;
        // Copies stack where every part keeps one (they all do, or none).
        let expanded = es.into_iter().collect::<Option<Vec<_>>>().map(stack_dense);
        Some((|| {
            Ok(Linear::Quantized {
                weight: cat(&ws)?,
                scales: cat(&ss)?,
                biases: cat(&bs)?,
                bias: bias.transpose()?,
                group_size,
                bits,
                expanded: expanded.transpose()?,
            })
        })())
    }

    pub fn out_features(&self) -> i32 {
        match self {
            Linear::Dense { weight, .. } => weight.out_features(),
            Linear::Quantized { weight, .. } => weight.dim(0),
        }
    }
}

/// Packed uint32 columns and scale groups of `in_features` quantized to
/// `bits` in groups of `group_size`, `None` when they do not divide.
pub fn quantized_shape(in_features: i32, group_size: i32, bits: i32) -> Option<(i32, i32)> {
    let fits = in_features % group_size == 0 && (in_features * bits) % 32 == 0;
    fits.then(|| (in_features * bits / 32, in_features / group_size))
}

/// Several projections of the same input (q/k/v, or gate/up), computed by
/// one stacked matmul whose output is sliced into them, when their weights
/// allow it.
pub enum Projections {
    Stacked { linear: Linear, sizes: Vec<i32> },
    Separate(Vec<Linear>),
}

impl Projections {
    pub fn new(parts: Vec<Linear>) -> R<Self> {
        match Linear::stack(&parts) {
            Some(linear) => {
                let sizes = parts.iter().map(Linear::out_features).collect();
                Ok(Projections::Stacked {
                    linear: linear?,
                    sizes,
                })
            }
            None => Ok(Projections::Separate(parts)),
        }
    }

    pub fn forward(&self, x: &Array) -> R<Vec<Array>> {
        match self {
            Projections::Separate(parts) => parts.iter().map(|p| p.forward(x)).collect(),
            // Slices of the output, not `split`: MLX's Split gives a
            // strided part the data size of its element count, and MLX
            // CUDA's rope allocates its output with that size and the
            // input's strides, so rope on a split part (q and k of a model
            // without q/k norms: Llama, Qwen2) writes past its buffer and
            // returns wrong, run-to-run different values for prompts of
            // more than one token. A slice's data size spans its strides.
            Projections::Stacked { linear, sizes } => {
                let y = linear.forward(x)?;
                let mut at = 0;
                sizes
                    .iter()
                    .map(|&size| {
                        at += size;
                        y.try_index((Ellipsis, at - size..at))
                    })
                    .collect()
            }
        }
    }

    /// The stacked projections' output widths, `None` when they are separate.
    pub fn stacked_sizes(&self) -> Option<&[i32]> {
        match self {
            Projections::Stacked { sizes, .. } => Some(sizes),
            Projections::Separate(_) => None,
        }
    }

    /// The stacked dense weight's transposed view `[in, sum of outs]`, for
    /// a kernel of our own to read; `None` when separate, quantized or
    /// biased.
    pub fn stacked_dense(&self) -> Option<&Array> {
        match self {
            Projections::Stacked {
                linear: Linear::Dense { weight, bias: None },
                ..
            } => Some(&weight.t),
            _ => None,
        }
    }

    /// The stacked product's output, not yet sliced into the projections
    /// (`None` when they are separate).
    pub fn joined(&self, x: &Array) -> Option<R<Array>> {
        match self {
            Projections::Stacked { linear, .. } => Some(linear.forward(x)),
            Projections::Separate(_) => None,
        }
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        match self {
            Projections::Stacked { linear, .. } => linear.collect(out),
            Projections::Separate(parts) => parts.iter().for_each(|p| p.collect(out)),
        }
    }
}

/// `down(act(gate(x)) * up(x))` with separate projections, for drafter
/// layers loaded by name.
pub struct GatedMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    gelu: bool,
}

impl GatedMlp {
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        quant: Option<Quantization>,
        gelu: bool,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            gate: Linear::load(w, &format!("{prefix}.gate_proj"), quant)?,
            up: Linear::load(w, &format!("{prefix}.up_proj"), quant)?,
            down: Linear::load(w, &format!("{prefix}.down_proj"), quant)?,
            gelu,
        })
    }

    pub fn forward(&self, x: &Array) -> R<Array> {
        let g = self.gate.forward(x)?;
        let u = self.up.forward(x)?;
        self.down
            .forward(&crate::activations::gated(&g, &u, self.gelu)?)
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        for l in [&self.gate, &self.up, &self.down] {
            l.collect(out);
        }
    }
}

/// Token embedding; also serves as the output head when weights are tied.
pub struct Embedding {
    table: Linear,
    /// The rows' dtype ([`Weights::layer_dtype`]).
    dtype: Dtype,
}

impl Embedding {
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        quant: Option<Quantization>,
    ) -> anyhow::Result<Self> {
        let dtype = w.layer_dtype(prefix);
        let table = Linear::load(w, prefix, quant)?;
        Ok(Self {
            dtype: dtype.ok_or_else(|| anyhow::anyhow!("no table at `{prefix}`"))?,
            table,
        })
    }

    /// A `rows` x `dims` table, checked like [`Linear::load_checked`].
    pub fn load_checked(
        w: &mut Weights,
        prefix: &str,
        quant: Option<Quantization>,
        rows: i32,
        dims: i32,
    ) -> anyhow::Result<Self> {
        let dtype = w.layer_dtype(prefix);
        let table = Linear::load_checked(w, prefix, quant, rows, dims)?;
        Ok(Self {
            dtype: dtype.ok_or_else(|| anyhow::anyhow!("no table at `{prefix}`"))?,
            table,
        })
    }

    pub fn forward(&self, ids: &Array) -> R<Array> {
        match &self.table {
            Linear::Dense { weight, .. } => weight.weight().take_axis(ids, 0),
            Linear::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
                ..
            } => {
                let w = weight.take_axis(ids, 0)?;
                let s = scales.take_axis(ids, 0)?;
                let b = biases.take_axis(ids, 0)?;
                dequantize_as(&w, &s, &b, *group_size, *bits, self.dtype)
            }
        }
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.table.collect(out);
    }

    /// `x @ table.T`: logits from hidden states for tied embeddings.
    pub fn as_linear(&self, x: &Array) -> R<Array> {
        self.table.forward(x)
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
}

pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

impl RmsNorm {
    /// Gemma stores `w` and normalises with `1 + w`; folded in at load.
    pub fn load(w: &mut Weights, name: &str, eps: f32, plus_one: bool) -> anyhow::Result<Self> {
        let weight = w.take(&format!("{name}.weight"))?;
        Self::new(weight, eps, plus_one)
    }

    /// [`RmsNorm::load`] of a norm over `dims` features.
    pub fn load_sized(
        w: &mut Weights,
        name: &str,
        dims: i32,
        eps: f32,
        plus_one: bool,
    ) -> anyhow::Result<Self> {
        let weight = w.take_shaped(&format!("{name}.weight"), &[dims])?;
        Self::new(weight, eps, plus_one)
    }

    fn new(mut weight: Array, eps: f32, plus_one: bool) -> anyhow::Result<Self> {
        if plus_one {
            weight = weight.add(Array::from_f32(1.0))?.as_dtype(weight.dtype())?;
        }
        Ok(Self { weight, eps })
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        out.push(&self.weight);
    }

    pub fn forward(&self, x: &Array) -> R<Array> {
        crate::cpu_fused::rms_norm(x, Some(&self.weight), self.eps)
    }

    /// `x + r` and the norm of it.
    pub fn forward_added(&self, x: &Array, r: &Array) -> R<(Array, Array)> {
        if let Some(fused) = crate::gpu_fused::add_rms_norm(x, r, &self.weight, self.eps) {
            return fused;
        }
        crate::cpu_fused::add_rms_norm(x, r, &self.weight, self.eps)
    }

    /// The weight (any `1 +` folded in) and epsilon.
    pub fn parts(&self) -> (&Array, f32) {
        (&self.weight, self.eps)
    }
}

/// Rotary position embedding with per-row offsets for padded batches.
pub struct Rope {
    dims: i32,
    base: Option<f32>,
    scale: f32,
    freqs: Option<Array>,
    /// The inverse frequencies of the CPU's one-node RoPE, made on first use.
    cpu_inv_freqs: std::sync::OnceLock<Array>,
}

impl Rope {
    /// Rotary embedding over heads of `dims` features.
    pub fn new(dims: i32, base: f32, scaling: &RopeScaling) -> Self {
        match *scaling {
            RopeScaling::None => Self {
                dims,
                base: Some(base),
                scale: 1.0,
                freqs: None,
                cpu_inv_freqs: Default::default(),
            },
            RopeScaling::Linear { factor } => Self {
                dims,
                base: Some(base),
                scale: 1.0 / factor,
                freqs: None,
                cpu_inv_freqs: Default::default(),
            },
            RopeScaling::Proportional {
                rotated_fraction,
                factor,
            } => {
                // Infinite wavelengths leave the unrotated tail unchanged.
                let rotated = (dims as f32 * rotated_fraction) as i32;
                let freqs: Vec<f32> = (0..dims / 2)
                    .map(|i| {
                        if 2 * i < rotated {
                            factor * base.powf((2 * i) as f32 / dims as f32)
                        } else {
                            f32::INFINITY
                        }
                    })
                    .collect();
                Self {
                    dims,
                    base: None,
                    scale: 1.0,
                    freqs: Some(Array::from_slice(&freqs, &[dims / 2])),
                    cpu_inv_freqs: Default::default(),
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let low_wavelen = original_max_position_embeddings / low_freq_factor;
                let high_wavelen = original_max_position_embeddings / high_freq_factor;
                let freqs: Vec<f32> = (0..dims / 2)
                    .map(|i| {
                        let freq = base.powf((2 * i) as f32 / dims as f32);
                        let wavelen = 2.0 * std::f32::consts::PI * freq;
                        let scaled = if wavelen > low_wavelen {
                            freq * factor
                        } else {
                            freq
                        };
                        if wavelen > high_wavelen && wavelen < low_wavelen {
                            let smooth = (original_max_position_embeddings / wavelen
                                - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            scaled / ((1.0 - smooth) / factor + smooth)
                        } else {
                            scaled
                        }
                    })
                    .collect();
                Self {
                    dims,
                    base: None,
                    scale: 1.0,
                    freqs: Some(Array::from_slice(&freqs, &[dims / 2])),
                    cpu_inv_freqs: Default::default(),
                }
            }
        }
    }

    /// Plain rotary embedding over `dims` with base `base` (drafter layers).
    pub fn plain(dims: i32, base: f32) -> Self {
        Self {
            dims,
            base: Some(base),
            scale: 1.0,
            freqs: None,
            cpu_inv_freqs: Default::default(),
        }
    }

    /// The rotation as [`crate::gpu_fused::heads`] applies it.
    pub fn spec(&self) -> crate::gpu_fused::RopeSpec<'_> {
        crate::gpu_fused::RopeSpec {
            dims: self.dims,
            base: self.base,
            scale: self.scale,
            freqs: self.freqs.as_ref(),
        }
    }

    /// The inverse frequencies of the CPU's one-node RoPE
    /// ([`crate::cpu_fused::inverse_frequencies`]), made on first use.
    pub fn cpu_inverse_frequencies(&self) -> R<&Array> {
        if let Some(inv) = self.cpu_inv_freqs.get() {
            return Ok(inv);
        }
        let inv = crate::cpu_fused::inverse_frequencies(self.dims, self.base, self.freqs.as_ref())?;
        Ok(self.cpu_inv_freqs.get_or_init(|| inv))
    }

    /// `x`: [B, H, L, D]. `offset` is the position of the first of the L
    /// tokens, one per row (rows of a padded batch start at different
    /// positions).
    pub fn forward(&self, x: &Array, offset: &Offsets) -> R<Array> {
        if crate::cpu_fused::takes_rope(x) {
            let inv = self.cpu_inverse_frequencies()?;
            return crate::cpu_fused::rope(x, self.dims, self.scale, &offset.to_array(), inv);
        }
        match offset {
            Offsets::Scalar(o) => fast::rope(
                x,
                self.dims,
                false,
                self.base,
                self.scale,
                *o,
                self.freqs.as_ref(),
            ),
            Offsets::PerRow(o) => fast::rope_dynamic(
                x,
                self.dims,
                false,
                self.base,
                self.scale,
                o,
                self.freqs.as_ref(),
            ),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn packed(out: i32, seed: u64, expanded: impl Fn(&Array) -> Array) -> Linear {
        mlx_rs::random::seed(seed).unwrap();
        let w = mlx_rs::random::normal::<f32>(&[out, 64], None, None, None).unwrap();
        let (weight, scales, biases) = ops::quantize(&w, 64, 4).unwrap();
        let dense = ops::dequantize(&weight, &scales, &biases, 64, 4).unwrap();
        Linear::Quantized {
            expanded: Some(DenseWeight::new(&expanded(&dense))),
            weight,
            scales,
            biases,
            bias: None,
            group_size: 64,
            bits: 4,
        }
    }

    /// The values of `a`, slices included (a sum makes them contiguous).
    pub(crate) fn values(a: &Array) -> Vec<f32> {
        a.add(Array::from_f32(0.0))
            .unwrap()
            .as_slice::<f32>()
            .to_vec()
    }

    #[test]
    fn a_kept_copy_serves_products_of_several_rows_and_stacks() {
        // A copy that differs from the packed weights shows which one a
        // product read: one row reads the packed ones, four the copy.
        let doubled = |d: &Array| d.multiply(Array::from_f32(2.0)).unwrap();
        let layer = packed(32, 1, doubled);
        let x = mlx_rs::random::normal::<f32>(&[4, 64], None, None, None).unwrap();
        let Linear::Quantized {
            weight,
            scales,
            biases,
            ..
        } = &layer
        else {
            unreachable!()
        };
        let exact = ops::quantized_matmul(&x, weight, scales, biases, true, 64, 4).unwrap();
        let one = layer.forward(&x.try_index(..1).unwrap()).unwrap();
        let four = layer.forward(&x).unwrap();
        for (a, b) in values(&one)
            .iter()
            .zip(values(&exact.try_index(..1).unwrap()))
        {
            assert!((a - b).abs() < 1e-4, "one row: {a} vs {b}");
        }
        for (a, b) in values(&four).iter().zip(values(&exact)) {
            assert!((a - 2.0 * b).abs() < 1e-3, "four rows: {a} vs 2 x {b}");
        }

        // Stacked with another layer that keeps a copy, the copies stack.
        let other = packed(16, 2, doubled);
        let Projections::Stacked { linear, .. } = Projections::new(vec![layer, other]).unwrap()
        else {
            panic!("two 4-bit layers stack");
        };
        let Linear::Quantized { expanded, .. } = &linear else {
            panic!("stacked packed layers stay packed");
        };
        assert_eq!(expanded.as_ref().unwrap().weight().shape(), &[48, 64]);
        let stacked = linear.forward(&x).unwrap();
        for (a, b) in values(&stacked.try_index((.., ..32)).unwrap())
            .iter()
            .zip(values(&four))
        {
            assert!((a - b).abs() < 1e-4);
        }
    }
}
