//! Qwen's sparse MoE block in place of the MLP (Qwen3 MoE, Qwen 3.5 MoE):
//! softmax router over every expert, the top k renormalised (as
//! configured), and on Qwen 3.5 a shared expert behind a sigmoid gate.

use mlx_rs::{ops, Array};

use super::experts::{top_k, SwitchGlu};
use super::Mlp;
use crate::config::{ModelConfig, SparseMoeConfig};
use crate::layers::Linear;
use crate::weights::Weights;

type R<T> = Result<T, mlx_rs::error::Exception>;

pub(super) struct SparseMoe {
    router: Linear,
    experts: SwitchGlu,
    top_k: i32,
    norm_topk_prob: bool,
    /// The shared expert and its `[1, hidden]` gate.
    shared: Option<(Mlp, Linear)>,
}

impl SparseMoe {
    /// The block of `{p}.mlp`, experts in any of the published layouts:
    /// Hugging Face per expert (`experts.{j}.*`, Qwen3 MoE) or fused
    /// (`experts.gate_up_proj`, Qwen 3.5 MoE), or MLX's stacked
    /// `switch_mlp.*` (optionally quantized).
    pub fn load(
        w: &mut Weights,
        cfg: &ModelConfig,
        m: &SparseMoeConfig,
        p: &str,
    ) -> anyhow::Result<Self> {
        let h = cfg.hidden_size;
        let linear = |w: &mut Weights, name: &str, out: i32, inp: i32| {
            Linear::load_checked(w, name, cfg.quant_for(name), out, inp)
        };
        let dims = (m.num_experts, m.intermediate, h);
        let experts = format!("{p}.experts");
        let experts = if w.contains(&format!("{experts}.gate_up_proj")) {
            SwitchGlu::load_fused(w, &experts, dims, false)?
        } else if w.contains(&format!("{experts}.0.gate_proj.weight")) {
            SwitchGlu::load_per_expert(w, &experts, dims, false)?
        } else {
            SwitchGlu::load_stacked(w, cfg, &format!("{p}.switch_mlp"), dims, false)?
        };
        let shared = match m.shared_intermediate {
            Some(width) => Some((
                Mlp::load(w, cfg, &format!("{p}.shared_expert"), width)?,
                linear(w, &format!("{p}.shared_expert_gate"), 1, h)?,
            )),
            None => None,
        };
        Ok(Self {
            router: linear(w, &format!("{p}.gate"), m.num_experts, h)?,
            experts,
            top_k: m.top_k,
            norm_topk_prob: m.norm_topk_prob,
            shared,
        })
    }

    /// `[B, L, hidden]` from the normed residual stream `x`.
    pub fn forward(&self, x: &Array) -> R<Array> {
        let probs = ops::softmax_axis(&self.router.forward(x)?, -1, true)?;
        let indices = top_k(&probs, self.top_k)?;
        let mut scores = probs.take_along_axis(&indices, -1)?;
        if self.norm_topk_prob {
            scores = scores.divide(scores.sum_axis(-1, true)?)?;
        }
        let y = self.experts.forward(x, &indices)?;
        let y = y
            .multiply(scores.expand_dims(-1)?)?
            .sum_axis(-2, false)?
            .as_dtype(y.dtype())?;
        match &self.shared {
            None => Ok(y),
            Some((mlp, gate)) => {
                let gate = ops::sigmoid(gate.forward(x)?)?;
                y.add(gate.multiply(mlp.forward(x)?)?)
            }
        }
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.router.collect(out);
        self.experts.collect(out);
        if let Some((mlp, gate)) = &self.shared {
            mlp.collect(out);
            gate.collect(out);
        }
    }
}
