//! The memory budget (`memory:` in config.yaml), as vLLM's
//! `gpu_memory_utilization`: the process may use a share of the device's
//! memory (or an absolute figure). At startup, with the model loaded, the
//! host measures the weights and the activations of the largest step the
//! engines run (a real forward of `step_tokens` tokens), gives the KV pool
//! what remains, and has MLX keep to the budget: its allocation limit is
//! the budget, and the buffers it caches for reuse are bounded by the
//! activation headroom, so freed memory goes back instead of piling up.
//!
//! The budget is also checked against what the device has free (other
//! processes may hold part of it, as vLLM checks its share before it
//! starts): when the weights, the largest step and the KV pool do not fit
//! in what is free, the server refuses to start and says what to change,
//! or with `when_short: shrink` starts with the KV pool that fits.

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
    /// What to do when the device has less free than the budget needs.
    #[serde(default)]
    pub when_short: WhenShort,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenShort {
    /// Refuse to start, naming the figures and the settings to change.
    #[default]
    Fail,
    /// Start with the KV pool that fits in what is free, and log it.
    Shrink,
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
    /// Free on the device at startup, besides the weights this process
    /// held then (`None`: the device does not say).
    pub device_free: Option<u64>,
    pub budget: u64,
    pub weights: u64,
    /// Peak extra memory of the largest step, measured.
    pub activations: u64,
    /// What the KV pool was given.
    pub kv_pool: u64,
    /// The pool was cut to what was free (`when_short: shrink`).
    pub shrunk: bool,
}

/// Divides the budget (see the module doc); `kv_cap` (from
/// `model.kv_cache_mb`, when set) bounds the KV pool's share, and the pool
/// must hold at least `min_kv` (one step's tokens). Applies the limits to
/// MLX.
pub fn plan(
    cfg: &MemoryConfig,
    model: &LoadedModel,
    kv_cap: Option<u64>,
    min_kv: u64,
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
    let step = format!("a {}-token step", cfg.step_tokens);
    let kv_room = budget
        .checked_sub(weights + activations)
        .filter(|&b| b >= min_kv);
    let Some(kv_room) = kv_room else {
        anyhow::bail!(
            "the memory budget ({}) does not hold the weights ({}) and the activations of {step} ({}) with room for KV ({} at least); raise memory.fraction or memory.limit_mb, or lower memory.step_tokens",
            mib(budget),
            mib(weights),
            mib(activations),
            mib(min_kv),
        );
    };
    let wanted = kv_cap.map_or(kv_room, |cap| cap.min(kv_room));
    let device_free = memory::device_free();
    let fit = Fit {
        weights,
        activations,
        step: &step,
        kv: wanted,
        min_kv,
        device_free,
        device_total,
    };
    let kv_pool = fit.check(cfg.when_short)?;
    let shrunk = kv_pool < wanted;
    // A shrunk pool shrinks the budget with it: MLX may not take what the
    // device does not have.
    let budget = if shrunk {
        weights + activations + kv_pool
    } else {
        budget
    };
    memory::apply_limits(budget, activations);
    memory::reset_peak();
    let plan = MemoryPlan {
        device_total,
        device_free,
        budget,
        weights,
        activations,
        kv_pool,
        shrunk,
    };
    tracing::info!(
        device = %mib(device_total),
        free = %device_free.map_or_else(|| "unknown".into(), mib),
        budget = %mib(budget),
        weights = %mib(weights),
        activations = %mib(activations),
        kv_pool = %mib(kv_pool),
        shrunk,
        "memory budget"
    );
    Ok(plan)
}

/// Without a `memory:` budget: the weights and the KV pool
/// (`model.kv_cache_mb`) must fit in what the device has free.
pub fn check_free(weights: u64, kv_pool: u64, min_kv: u64) -> anyhow::Result<()> {
    let (Some(device_free), Some(device_total)) = (memory::device_free(), memory::device_total())
    else {
        return Ok(());
    };
    Fit {
        weights,
        activations: 0,
        step: "",
        kv: kv_pool,
        min_kv,
        device_free: Some(device_free),
        device_total,
    }
    .check(WhenShort::Fail)
    .map(|_| ())
}

/// What the process needs against what the device has free to it.
struct Fit<'a> {
    weights: u64,
    activations: u64,
    /// How the measured step is named in messages ("" without one).
    step: &'a str,
    /// The KV pool asked for.
    kv: u64,
    min_kv: u64,
    device_free: Option<u64>,
    device_total: u64,
}

impl Fit<'_> {
    /// The KV pool to start with: the one asked for when it fits, the one
    /// that fits with `Shrink`; an error naming the figures otherwise.
    fn check(&self, when_short: WhenShort) -> anyhow::Result<u64> {
        let Some(free) = self.device_free else {
            return Ok(self.kv);
        };
        // The weights are already loaded: what is free comes on top.
        let available = free + self.weights;
        let fixed = self.weights + self.activations;
        let need = fixed + self.kv;
        if need <= available {
            return Ok(self.kv);
        }
        let parts = if self.step.is_empty() {
            format!(
                "the weights ({}) and the KV pool ({})",
                mib(self.weights),
                mib(self.kv)
            )
        } else {
            format!(
                "the weights ({}), the activations of {} ({}) and the KV pool ({})",
                mib(self.weights),
                self.step,
                mib(self.activations),
                mib(self.kv)
            )
        };
        let shortfall = format!(
            "{parts} need {}, but only {} of the device's {} is free to this process ({} free besides the weights it holds; other processes use the rest)",
            mib(need),
            mib(available),
            mib(self.device_total),
            mib(free),
        );
        let fitting_kv = available.saturating_sub(fixed);
        if fitting_kv < self.min_kv {
            anyhow::bail!(
                "not enough free memory: {shortfall}; even the smallest useful KV pool ({}) does not fit: free memory on the device or serve a smaller model",
                mib(self.min_kv)
            );
        }
        match when_short {
            WhenShort::Shrink => {
                tracing::warn!(
                    asked = %mib(self.kv),
                    kv_pool = %mib(fitting_kv),
                    free = %mib(free),
                    "not enough free memory for the KV pool asked for; starting with the pool that fits (memory.when_short: shrink)"
                );
                Ok(fitting_kv)
            }
            WhenShort::Fail if self.step.is_empty() => anyhow::bail!(
                "not enough free memory: {shortfall}; set model.kv_cache_mb to at most {}",
                fitting_kv >> 20
            ),
            WhenShort::Fail => anyhow::bail!(
                "not enough free memory: {shortfall}; lower memory.fraction to at most {:.2} (or memory.limit_mb to at most {}), set model.kv_cache_mb to at most {}, or set memory.when_short: shrink to start with the KV pool that fits",
                (available as f64 / self.device_total as f64 * 100.0).floor() / 100.0,
                available >> 20,
                fitting_kv >> 20
            ),
        }
    }
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
