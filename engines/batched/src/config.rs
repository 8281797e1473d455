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
    /// Tokens per scheduler step: the decode rows' first, prompt chunks
    /// the rest (at least half; `plan::prompt_tokens`). Bounds how long
    /// long prompts can stall the decode of running rows. Default: 256 on
    /// the CPU, where a step's cost grows with its tokens; 2048 on the
    /// GPU, where a 2,048-token chunk costs a few 256-token ones and the
    /// queue of long prompts, not the stall, sets their time to first
    /// token (docs/batching.md); within the memory budget's step.
    pub prefill_chunk: Option<usize>,
    /// Padded prompt tokens of short prompts prefilled together in one
    /// forward (like vLLM's `max_num_batched_tokens`). Default: 2048 on
    /// the GPU, where a wide forward costs little more than a narrow one;
    /// `prefill_chunk` on the CPU; 4096 for hybrid models.
    pub prefill_group_tokens: Option<usize>,
    /// A group's prefill width is its longest prompt rounded up to a
    /// multiple of this (left padding), so forward shapes repeat. Default:
    /// 32 on the GPU, 1 on the CPU (where padding is paid per token).
    pub prefill_width_multiple: Option<usize>,
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
            prefill_chunk: None,
            prefill_group_tokens: None,
            prefill_width_multiple: None,
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
        let zero = [
            cfg.max_batch,
            cfg.prefill_chunk,
            cfg.prefill_group_tokens,
            cfg.prefill_width_multiple,
        ];
        if zero.contains(&Some(0)) {
            return Err(
                "batched engine config: max_batch, prefill_chunk, prefill_group_tokens \
                 and prefill_width_multiple must be at least 1"
                    .into(),
            );
        }
        Ok(cfg)
    }

    /// The limits under a measured step of `step_tokens` tokens (`None`:
    /// no memory budget), for a model with recurrent layers when `hybrid`,
    /// computing on a GPU when `gpu`.
    pub fn limits(&self, step_tokens: Option<usize>, hybrid: bool, gpu: bool) -> StepLimits {
        let within = |n: usize| step_tokens.map_or(n, |s| n.min(s.max(1)));
        let prefill_chunk = within(self.prefill_chunk.unwrap_or(match gpu {
            true => GPU_PREFILL_CHUNK,
            false => CPU_PREFILL_CHUNK,
        }));
        // A recurrent layer's prefill is a loop over positions, so a group
        // costs about what its longest prompt does: hybrid models group
        // wide. On the GPU a forward of 2048 tokens costs a few narrow
        // ones; on the CPU the cost is per token, so groups stay within a
        // chunk (their stall on running rows is the chunk's).
        let group_tokens = match (self.prefill_group_tokens, hybrid, gpu) {
            (Some(n), _, _) => n,
            (None, true, _) => HYBRID_GROUP_TOKENS,
            (None, false, true) => GPU_GROUP_TOKENS,
            (None, false, false) => prefill_chunk,
        };
        StepLimits {
            max_batch: within(self.max_batch.or(step_tokens).unwrap_or(DEFAULT_MAX_BATCH)),
            prefill: PrefillBudget {
                chunk: prefill_chunk,
                group_tokens: within(group_tokens).max(prefill_chunk),
                width_multiple: self
                    .prefill_width_multiple
                    .unwrap_or(runtime::generate::shape_multiple(gpu)),
            },
        }
    }
}

/// Without a memory budget, the most sequences decoded together.
const DEFAULT_MAX_BATCH: usize = 32;

/// Prompt tokens a step takes by default on the CPU.
const CPU_PREFILL_CHUNK: usize = 256;

/// Prompt tokens a step takes by default on the GPU.
const GPU_PREFILL_CHUNK: usize = 2048;

/// Without a memory budget, the padded tokens of a hybrid model's group.
const HYBRID_GROUP_TOKENS: usize = 4096;

/// Without a memory budget, the padded tokens of a group on the GPU.
const GPU_GROUP_TOKENS: usize = 2048;

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
            let l = c.limits(s, false, false);
            assert_eq!(l.prefill.group_tokens, l.prefill.chunk);
            assert_eq!(l.prefill.width_multiple, 1);
            (l.max_batch, l.prefill.chunk)
        };
        assert_eq!(limits(&cfg, None), (32, 256));
        // Rows up to the step, and no chunk above it.
        assert_eq!(limits(&cfg, Some(512)), (512, 256));
        assert_eq!(limits(&cfg, Some(64)), (64, 64));
        let set = BatchedConfig {
            max_batch: Some(8),
            prefill_chunk: Some(1024),
            ..cfg.clone()
        };
        assert_eq!(limits(&set, None), (8, 1024));
        assert_eq!(limits(&set, Some(512)), (8, 512));
        // A hybrid model groups wide, within the step.
        assert_eq!(cfg.limits(None, true, false).prefill.group_tokens, 4096);
        assert_eq!(
            cfg.limits(Some(2048), true, false).prefill.group_tokens,
            2048
        );
    }

    #[test]
    fn on_the_gpu_groups_are_wide_and_their_widths_repeat() {
        let cfg = BatchedConfig::default();
        let gpu = cfg.limits(None, false, true).prefill;
        assert_eq!(
            (gpu.chunk, gpu.group_tokens, gpu.width_multiple),
            (2048, 2048, 32)
        );
        let budget = cfg.limits(Some(512), false, true).prefill;
        assert_eq!((budget.chunk, budget.group_tokens), (512, 512));
        let set = BatchedConfig {
            prefill_group_tokens: Some(3072),
            ..cfg.clone()
        };
        assert_eq!(set.limits(None, false, false).prefill.group_tokens, 3072);
        assert_eq!(set.limits(None, true, true).prefill.group_tokens, 3072);
        for zero in [
            "prefill_chunk: 0",
            "prefill_group_tokens: 0",
            "prefill_width_multiple: 0",
        ] {
            let zero = serde_yaml::from_str(zero).unwrap();
            assert!(BatchedConfig::from_yaml(&zero).is_err());
        }
    }
}
