//! The memory budget (`memory:` in config.yaml), as vLLM's
//! `gpu_memory_utilization`: the process may use a share of the device's
//! memory (or an absolute figure). At startup, with the model loaded, the
//! host measures the weights and the activations of the largest step the
//! engines run (a real forward of `step_tokens` tokens), gives the KV pool
//! what remains, and has MLX keep to the budget: its allocation limit is
//! the budget, and the buffers it caches for reuse are bounded by the
//! activation headroom, so freed memory goes back instead of piling up.

use anyhow::Context;
use mlx_rs::transforms::eval;
use mlx_rs::Array;
use runtime::memory::{self, mib};
use runtime::model::Logits;
use runtime::LoadedModel;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// Share of the device's memory (the GPU's; the machine's RAM on the
    /// CPU backend) this process may use.
    #[serde(default)]
    pub fraction: Option<f64>,
    /// An absolute budget instead of `fraction`.
    #[serde(default)]
    pub limit_mb: Option<u64>,
    /// Tokens in the largest step an engine runs (a prefill chunk plus the
    /// decode rows beside it): the activation headroom is measured on it.
    #[serde(default = "default_step_tokens")]
    pub step_tokens: usize,
}

fn default_step_tokens() -> usize {
    512
}

impl MemoryConfig {
    pub fn check(&self) -> Result<(), String> {
        match (self.fraction, self.limit_mb) {
            (Some(_), Some(_)) => Err("memory: give `fraction` or `limit_mb`, not both".into()),
            (None, None) => {
                Err("memory: give `fraction` (of the device's memory) or `limit_mb`".into())
            }
            (Some(f), None) if !(f > 0.0 && f <= 1.0) => {
                Err(format!("memory.fraction must be in (0, 1], not {f}"))
            }
            (None, Some(0)) => Err("memory.limit_mb must be at least 1".into()),
            _ if self.step_tokens == 0 => Err("memory.step_tokens must be at least 1".into()),
            _ => Ok(()),
        }
    }
}

/// How the budget was divided at startup, in bytes.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MemoryPlan {
    pub device_total: u64,
    pub budget: u64,
    pub weights: u64,
    /// Peak extra memory of the largest step, measured.
    pub activations: u64,
    /// What the KV pool was given.
    pub kv_pool: u64,
}

/// Divides the budget (see the module doc); `kv_cap` (from
/// `model.kv_cache_mb`, when set) bounds the KV pool's share. Applies the
/// limits to MLX.
pub fn plan(
    cfg: &MemoryConfig,
    model: &LoadedModel,
    kv_cap: Option<u64>,
) -> anyhow::Result<MemoryPlan> {
    let device_total = memory::device_total()
        .context("the device's memory size cannot be read; give memory.limit_mb instead")?;
    let budget = match (cfg.limit_mb, cfg.fraction) {
        (Some(mb), _) => mb << 20,
        (None, Some(f)) => (device_total as f64 * f) as u64,
        (None, None) => unreachable!("checked with the config"),
    };
    memory::release_cache();
    let weights = memory::mlx_memory().active;
    let activations = measure_step(model, cfg.step_tokens)?;
    let kv_room = budget.checked_sub(weights + activations).filter(|&b| b > 0);
    let Some(kv_room) = kv_room else {
        anyhow::bail!(
            "the memory budget ({}) does not hold the weights ({}) and the activations of a {}-token step ({}) with room for KV; raise memory.fraction or memory.limit_mb, or lower memory.step_tokens",
            mib(budget),
            mib(weights),
            cfg.step_tokens,
            mib(activations)
        );
    };
    let kv_pool = kv_cap.map_or(kv_room, |cap| cap.min(kv_room));
    memory::apply_limits(budget, activations);
    memory::reset_peak();
    let plan = MemoryPlan {
        device_total,
        budget,
        weights,
        activations,
        kv_pool,
    };
    tracing::info!(
        device = %mib(device_total),
        budget = %mib(budget),
        weights = %mib(weights),
        activations = %mib(activations),
        kv_pool = %mib(kv_pool),
        "memory budget"
    );
    Ok(plan)
}

/// Peak memory above what is live now while one `tokens`-token step runs.
fn measure_step(model: &LoadedModel, tokens: usize) -> anyhow::Result<u64> {
    let before = memory::mlx_memory().active;
    memory::reset_peak();
    {
        let ids = Array::from_slice(&vec![0i32; tokens], &[1, tokens as i32]);
        let mut cache = model.model.new_cache(1);
        let logits = model
            .model
            .forward(&ids, &mut cache, Logits::Last)
            .context("measuring one step's activations")?;
        eval([&logits]).context("measuring one step's activations")?;
    }
    let peak = memory::mlx_memory().peak;
    memory::release_cache();
    Ok(peak.saturating_sub(before))
}
