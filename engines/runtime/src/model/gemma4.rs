//! The parts of Gemma 4's decoder other families lack: the sparse
//! mixture-of-experts block beside the dense MLP (26B-A4B) and the
//! per-layer input embeddings (E2B/E4B).

use mlx_rs::{fast, nn, ops, Array};

use crate::activations;
use crate::config::{ModelConfig, MoeConfig};
use crate::layers::{quantized_shape, Embedding, Linear, RmsNorm};
use crate::weights::Weights;

type R<T> = Result<T, mlx_rs::error::Exception>;

/// Routing many (token, expert) pairs sorts them by expert first, so the
/// gathered matmuls read each expert's weights in one run (mlx-lm's
/// threshold, so both compute the same way).
const SORT_FROM: usize = 64;

/// `norm -> scale -> project -> top-k -> softmax over the k -> per-expert
/// scale`.
struct Router {
    proj: Linear,
    /// The learned scale times `hidden^-1/2`, as one norm weight.
    norm_weight: Array,
    per_expert_scale: Array,
    top_k: i32,
    eps: f32,
}

/// One projection of every expert, `[experts, out, in]`, applied to the
/// experts each token was routed to through MLX's gathered matmuls.
enum SwitchLinear {
    Dense {
        /// `[experts, in, out]`: transposed once at load.
        weight_t: Array,
    },
    Quantized {
        weight: Array,
        scales: Array,
        biases: Array,
        group_size: i32,
        bits: i32,
    },
}

pub(super) struct Moe {
    router: Router,
    gate: SwitchLinear,
    up: SwitchLinear,
    down: SwitchLinear,
    /// Norms around the two branches: the dense MLP's output, the experts'
    /// input and output.
    pub post_mlp_norm: RmsNorm,
    pub pre_experts_norm: RmsNorm,
    pub post_experts_norm: RmsNorm,
}

impl Moe {
    pub fn load(
        w: &mut Weights,
        cfg: &ModelConfig,
        moe: MoeConfig,
        p: &str,
    ) -> anyhow::Result<Self> {
        let (h, e, i) = (cfg.hidden_size, moe.num_experts, moe.intermediate);
        let eps = cfg.rms_norm_eps;
        let norm =
            |w: &mut Weights, n: &str| RmsNorm::load_sized(w, &format!("{p}.{n}"), h, eps, false);
        let router_prefix = format!("{p}.router.proj");
        let proj = Linear::load_checked(w, &router_prefix, cfg.quant_for(&router_prefix), e, h)?;
        let scale = w.take_shaped(&format!("{p}.router.scale"), &[h])?;
        let norm_weight = scale
            .multiply(Array::from_f32((h as f32).powf(-0.5)))?
            .as_dtype(scale.dtype())?;
        let router = Router {
            proj,
            norm_weight,
            per_expert_scale: w.take_shaped(&format!("{p}.router.per_expert_scale"), &[e])?,
            top_k: moe.top_k,
            eps,
        };
        let experts = format!("{p}.experts");
        let (gate, up, down) = if w.contains(&format!("{experts}.gate_up_proj")) {
            // Hugging Face: gate and up stacked on the output axis, no
            // `.weight` suffix.
            let name = format!("{experts}.gate_up_proj");
            let gate_up = w.take_shaped(&name, &[e, 2 * i, h])?;
            let halves = ops::split_equal(&gate_up, 2, 1)?;
            let down_name = format!("{experts}.down_proj");
            let down = w.take_shaped(&down_name, &[e, h, i])?;
            (
                SwitchLinear::dense(&halves[0])?,
                SwitchLinear::dense(&halves[1])?,
                SwitchLinear::dense(&down)?,
            )
        } else {
            // MLX conversions: `switch_glu.{gate,up,down}_proj`, optionally
            // quantized.
            let sw = format!("{experts}.switch_glu");
            let load = |w: &mut Weights, n: &str, out: i32, inp: i32| {
                let prefix = format!("{sw}.{n}");
                SwitchLinear::load(w, &prefix, cfg.quant_for(&prefix), e, out, inp)
            };
            (
                load(w, "gate_proj", i, h)?,
                load(w, "up_proj", i, h)?,
                load(w, "down_proj", h, i)?,
            )
        };
        Ok(Self {
            router,
            gate,
            up,
            down,
            post_mlp_norm: norm(w, "post_feedforward_layernorm_1")?,
            pre_experts_norm: norm(w, "pre_feedforward_layernorm_2")?,
            post_experts_norm: norm(w, "post_feedforward_layernorm_2")?,
        })
    }

    /// The experts' branch for `h` (the residual stream): routed on `h`,
    /// applied to its normed copy. `[B, L, hidden]`.
    pub fn forward(&self, h: &Array) -> R<Array> {
        let (indices, weights) = self.router.forward(h)?;
        let x = self.pre_experts_norm.forward(h)?;
        let y = self.experts(&x, &indices)?;
        let y = weights.expand_dims(-1)?.multiply(&y)?.sum_axis(-2, false)?;
        self.post_experts_norm.forward(&y)
    }

    /// `[B, L, k, hidden]`: each token through each of its k experts.
    fn experts(&self, x: &Array, indices: &Array) -> R<Array> {
        let shape = indices.shape().to_vec();
        let x = x.expand_dims_axes(&[-2, -3])?;
        let sort = indices.size() >= SORT_FROM;
        let (x, idx, inverse) = if sort {
            let k = shape[shape.len() - 1];
            let flat = indices.flatten(None, None)?;
            let order = ops::argsort(&flat)?;
            let inverse = ops::argsort(&order)?;
            let rows = order.floor_divide(Array::from_int(k))?;
            let x = x.flatten(0, -3)?.take_axis(&rows, 0)?;
            (x, flat.take_axis(&order, 0)?, Some(inverse))
        } else {
            (x, indices.clone(), None)
        };
        let up = self.up.forward(&x, &idx, sort)?;
        let gate = self.gate.forward(&x, &idx, sort)?;
        let mut y = self
            .down
            .forward(&activations::gated(&gate, &up, true)?, &idx, sort)?;
        if let Some(inverse) = inverse {
            let mut unflat = shape.clone();
            unflat.extend_from_slice(&y.shape()[1..]);
            y = y.take_axis(&inverse, 0)?.reshape(&unflat)?;
        }
        y.squeeze_axes(&[-2])
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.router.proj.collect(out);
        out.push(&self.router.norm_weight);
        out.push(&self.router.per_expert_scale);
        for s in [&self.gate, &self.up, &self.down] {
            s.collect(out);
        }
        for n in [
            &self.post_mlp_norm,
            &self.pre_experts_norm,
            &self.post_experts_norm,
        ] {
            n.collect(out);
        }
    }
}

impl Router {
    /// Expert indices `[B, L, k]` (int) and their weights `[B, L, k]`.
    fn forward(&self, h: &Array) -> R<(Array, Array)> {
        let x = fast::rms_norm(h, Some(&self.norm_weight), self.eps)?;
        let scores = self.proj.forward(&x)?;
        let experts = scores.dim(-1);
        let kth = experts - self.top_k;
        let part = ops::argpartition_axis(&scores, kth, -1)?;
        let top = Array::from_iter(kth..experts, &[self.top_k]);
        let indices = part.take_axis(&top, -1)?;
        let weights = scores.take_along_axis(&indices, -1)?;
        let weights = ops::softmax_axis(&weights, -1, None)?;
        let weights = weights.multiply(self.per_expert_scale.take_axis(&indices, 0)?)?;
        Ok((indices, weights))
    }
}

impl SwitchLinear {
    fn dense(weight: &Array) -> R<Self> {
        Ok(SwitchLinear::Dense {
            weight_t: weight.swap_axes(-1, -2)?,
        })
    }

    fn load(
        w: &mut Weights,
        prefix: &str,
        quant: Option<crate::config::Quantization>,
        experts: i32,
        out: i32,
        inp: i32,
    ) -> anyhow::Result<Self> {
        let name = format!("{prefix}.weight");
        let weight = w.take(&name)?;
        match w.take_optional(&format!("{prefix}.scales")) {
            None => {
                w.check_shape(&name, &weight, &[experts, out, inp])?;
                Ok(Self::dense(&weight)?)
            }
            Some(scales) => {
                let q = quant.ok_or_else(|| {
                    anyhow::anyhow!(
                        "tensor `{name}` in {} is quantized (it has scales) but config.json has no quantization for it",
                        w.file_of(&name)
                    )
                })?;
                let (packed, groups) =
                    quantized_shape(inp, q.group_size, q.bits).ok_or_else(|| {
                        anyhow::anyhow!(
                        "tensor `{name}` in {}: {inp} inputs do not split into {}-bit groups of {}",
                        w.file_of(&name), q.bits, q.group_size
                    )
                    })?;
                let biases = w.take(&format!("{prefix}.biases"))?;
                w.check_shape(&name, &weight, &[experts, out, packed])?;
                w.check_shape(
                    &format!("{prefix}.scales"),
                    &scales,
                    &[experts, out, groups],
                )?;
                w.check_shape(
                    &format!("{prefix}.biases"),
                    &biases,
                    &[experts, out, groups],
                )?;
                Ok(SwitchLinear::Quantized {
                    weight,
                    scales,
                    biases,
                    group_size: q.group_size,
                    bits: q.bits,
                })
            }
        }
    }

    /// `x`: `[..., 1, in]` rows, `idx`: the expert of each row's batch
    /// position. Returns `[..., 1, out]`.
    fn forward(&self, x: &Array, idx: &Array, sorted: bool) -> R<Array> {
        match self {
            SwitchLinear::Dense { weight_t } => ops::gather_mm(x, weight_t, None, idx, sorted),
            SwitchLinear::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
            } => ops::gather_qmm(
                x,
                weight,
                scales,
                biases,
                None,
                idx,
                true,
                *group_size,
                *bits,
                sorted,
            ),
        }
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        match self {
            SwitchLinear::Dense { weight_t } => out.push(weight_t),
            SwitchLinear::Quantized {
                weight,
                scales,
                biases,
                ..
            } => out.extend([weight, scales, biases]),
        }
    }
}

/// The model-level half of per-layer inputs: a second embedding table with
/// a slice per layer, mixed with a projection of the input embeddings.
pub(super) struct PerLayerInputs {
    table: Embedding,
    projection: Linear,
    norm: RmsNorm,
    layers: i32,
    width: i32,
    table_scale: f32,
    projection_scale: f32,
}

impl PerLayerInputs {
    pub fn load(
        w: &mut Weights,
        cfg: &ModelConfig,
        width: i32,
        vocab: i32,
    ) -> anyhow::Result<Self> {
        let n = cfg.num_layers;
        let table_prefix = "model.embed_tokens_per_layer";
        let projection_prefix = "model.per_layer_model_projection";
        Ok(Self {
            table: Embedding::load_checked(
                w,
                table_prefix,
                cfg.quant_for(table_prefix),
                vocab,
                n * width,
            )?,
            projection: Linear::load_checked(
                w,
                projection_prefix,
                cfg.quant_for(projection_prefix),
                n * width,
                cfg.hidden_size,
            )?,
            norm: RmsNorm::load_sized(
                w,
                "model.per_layer_projection_norm",
                width,
                cfg.rms_norm_eps,
                false,
            )?,
            layers: n,
            width,
            table_scale: (width as f32).sqrt(),
            projection_scale: (cfg.hidden_size as f32).powf(-0.5),
        })
    }

    /// `[B, L, layers, width]` from the token ids and the scaled input
    /// embeddings `h`.
    pub fn forward(&self, tokens: &Array, h: &Array) -> R<Array> {
        let (b, l) = (h.dim(0), h.dim(1));
        let split = [b, l, self.layers, self.width];
        let dtype = h.dtype();
        let scale = |x: Array, s: f32| x.multiply(Array::from_f32(s).as_dtype(dtype)?);
        let from_table = scale(self.table.forward(tokens)?, self.table_scale)?.reshape(&split)?;
        let projected =
            scale(self.projection.forward(h)?, self.projection_scale)?.reshape(&split)?;
        let projected = self.norm.forward(&projected)?;
        scale(projected.add(&from_table)?, std::f32::consts::FRAC_1_SQRT_2)
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.table.collect(out);
        self.projection.collect(out);
        self.norm.collect(out);
    }
}

/// The layer-level half: the layer's slice of the per-layer inputs gates a
/// residual branch.
pub(super) struct PerLayerGate {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
}

impl PerLayerGate {
    pub fn load(w: &mut Weights, cfg: &ModelConfig, p: &str, width: i32) -> anyhow::Result<Self> {
        let h = cfg.hidden_size;
        let gate = format!("{p}.per_layer_input_gate");
        let projection = format!("{p}.per_layer_projection");
        Ok(Self {
            gate: Linear::load_checked(w, &gate, cfg.quant_for(&gate), width, h)?,
            projection: Linear::load_checked(w, &projection, cfg.quant_for(&projection), h, width)?,
            norm: RmsNorm::load_sized(
                w,
                &format!("{p}.post_per_layer_input_norm"),
                h,
                cfg.rms_norm_eps,
                false,
            )?,
        })
    }

    /// `h + norm(projection(gelu(gate(h)) * input))`.
    pub fn forward(&self, h: &Array, input: &Array) -> R<Array> {
        let g = nn::gelu_approximate(self.gate.forward(h)?)?.multiply(input)?;
        h.add(self.norm.forward(&self.projection.forward(&g)?)?)
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.gate.collect(out);
        self.projection.collect(out);
        self.norm.collect(out);
    }
}
