//! The engine's own section of config.yaml.

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatchedConfig {
    /// Plugin kind; read by the host.
    pub kind: Option<String>,
    /// Most sequences decoded together.
    pub max_batch: usize,
    /// Requests waiting for a batch slot or KV blocks; beyond this, new
    /// requests are refused as overloaded.
    pub max_queue: usize,
    /// Prompt tokens prefilled per scheduler step: bounds how long a long
    /// prompt can stall the decode of running rows.
    pub prefill_chunk: usize,
}

impl Default for BatchedConfig {
    fn default() -> Self {
        Self {
            kind: None,
            max_batch: 32,
            max_queue: 256,
            prefill_chunk: 256,
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
        if cfg.max_batch == 0 || cfg.prefill_chunk == 0 {
            return Err(
                "batched engine config: max_batch and prefill_chunk must be at least 1".into(),
            );
        }
        Ok(cfg)
    }
}
