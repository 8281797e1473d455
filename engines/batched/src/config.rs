//! The engine's own section of config.yaml.

use serde::Deserialize;

use crate::admit::PrefillBudget;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatchedConfig {
    /// Plugin kind; read by the host.
    pub kind: Option<String>,
    /// Most sequences decoded together: 32 by default, and with a memory
    /// budget as many as its measured step holds (`memory.step_tokens`).
    pub max_batch: Option<usize>,
    /// Requests waiting for a batch slot or KV blocks; beyond this, new
    /// requests are refused as overloaded.
    pub max_queue: usize,
    /// Prompt tokens prefilled per scheduler step: bounds how long a long
    /// prompt can stall the decode of running rows.
    pub prefill_chunk: usize,
    /// Pipelined decode: each step is queued on the device before the
    /// previous step's tokens are read, so the device does not wait for
    /// the host between tokens (docs/batching.md). The same tokens either
    /// way; `false` reads every step before queuing the next.
    pub pipeline: bool,
}

impl Default for BatchedConfig {
    fn default() -> Self {
        Self {
            kind: None,
            max_batch: None,
            max_queue: 256,
            prefill_chunk: 256,
            pipeline: true,
        }
    }
}

impl BatchedConfig {
    pub fn from_yaml(section: &serde_yaml::Value) -> Result<Self, String> {
        if section.is_null() {
            return Ok(Self::default());
        }
        let cfg: Self = serde_yaml::from_value(section.clone())
            .map_err(|e| format!("batched engine config: {e}"))?;
        if cfg.max_batch == Some(0) || cfg.prefill_chunk == 0 {
            return Err(
                "batched engine config: max_batch and prefill_chunk must be at least 1".into(),
            );
        }
        Ok(cfg)
    }

    /// The limits under a measured step of `step_tokens` tokens (`None`:
    /// no memory budget), for a model with recurrent layers when `hybrid`.
    pub fn limits(&self, step_tokens: Option<usize>, hybrid: bool) -> StepLimits {
        let within = |n: usize| step_tokens.map_or(n, |s| n.min(s.max(1)));
        let prefill_chunk = within(self.prefill_chunk);
        // A recurrent layer's prefill is a loop over positions, so a group
        // costs about what its longest prompt does: hybrid models group
        // wide (what the budget's step holds), others within one chunk.
        let group_tokens = match hybrid {
            true => within(HYBRID_GROUP_TOKENS).max(prefill_chunk),
            false => prefill_chunk,
        };
        StepLimits {
            max_batch: within(self.max_batch.or(step_tokens).unwrap_or(DEFAULT_MAX_BATCH)),
            prefill: PrefillBudget {
                chunk: prefill_chunk,
                group_tokens,
            },
        }
    }
}

/// Without a memory budget, the most sequences decoded together.
const DEFAULT_MAX_BATCH: usize = 32;

/// Without a memory budget, the padded tokens of a hybrid model's group.
const HYBRID_GROUP_TOKENS: usize = 4096;

/// What one forward may hold, after the memory budget: no forward (a
/// decode step of every row, a prefill chunk, a padded group) exceeds the
/// step whose activations were measured at startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLimits {
    pub max_batch: usize,
    pub prefill: PrefillBudget,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memory_budget_bounds_every_forward_by_its_measured_step() {
        let cfg = BatchedConfig::default();
        let limits = |c: &BatchedConfig, s| {
            let l = c.limits(s, false);
            assert_eq!(l.prefill.group_tokens, l.prefill.chunk);
            (l.max_batch, l.prefill.chunk)
        };
        assert_eq!(limits(&cfg, None), (32, 256));
        // Rows up to the step, and no chunk above it.
        assert_eq!(limits(&cfg, Some(512)), (512, 256));
        assert_eq!(limits(&cfg, Some(64)), (64, 64));
        let set = BatchedConfig {
            max_batch: Some(8),
            prefill_chunk: 1024,
            ..cfg.clone()
        };
        assert_eq!(limits(&set, None), (8, 1024));
        assert_eq!(limits(&set, Some(512)), (8, 512));
        // A hybrid model groups wide, within the step.
        assert_eq!(cfg.limits(None, true).prefill.group_tokens, 4096);
        assert_eq!(cfg.limits(Some(2048), true).prefill.group_tokens, 2048);
    }
}
