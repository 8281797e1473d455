//! The parts of Gemma 4's decoder other families lack: the sparse
//! mixture-of-experts block beside the dense MLP (26B-A4B) and the
//! per-layer input embeddings (E2B/E4B).

use mlx_rs::{ops, Array};

use super::experts::{top_k, SwitchGlu};
use crate::config::{ModelConfig, MoeConfig};
use crate::layers::{Embedding, Linear, RmsNorm};
use crate::weights::Weights;

type R<T> = Result<T, mlx_rs::error::Exception>;

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

pub(super) struct Moe {
    router: Router,
    experts: SwitchGlu,
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
        let prefix = format!("{p}.experts");
        let dims = (e, i, h);
        // Hugging Face fuses gate and up; MLX conversions split them under
        // `switch_glu`, optionally quantized.
        let experts = if w.contains(&format!("{prefix}.gate_up_proj")) {
            SwitchGlu::load_fused(w, &prefix, dims, true)?
        } else {
            SwitchGlu::load_stacked(w, cfg, &format!("{prefix}.switch_glu"), dims, true)?
        };
        Ok(Self {
            router,
            experts,
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
        let y = self.experts.forward(&x, &indices)?;
        let y = weights.expand_dims(-1)?.multiply(&y)?.sum_axis(-2, false)?;
        self.post_experts_norm.forward(&y)
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.router.proj.collect(out);
        out.push(&self.router.norm_weight);
        out.push(&self.router.per_expert_scale);
        self.experts.collect(out);
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
        let x = crate::cpu_fused::rms_norm(h, Some(&self.norm_weight), self.eps)?;
        let scores = self.proj.forward(&x)?;
        let indices = top_k(&scores, self.top_k)?;
        let weights = scores.take_along_axis(&indices, -1)?;
        let weights = ops::softmax_axis(&weights, -1, None)?;
        let weights = weights.multiply(self.per_expert_scale.take_axis(&indices, 0)?)?;
        Ok((indices, weights))
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
        let g = crate::activations::gelu_approx(&self.gate.forward(h)?)?.multiply(input)?;
        h.add(self.norm.forward(&self.projection.forward(&g)?)?)
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.gate.collect(out);
        self.projection.collect(out);
        self.norm.collect(out);
    }
}
