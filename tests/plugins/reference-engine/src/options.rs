//! The engine's own section of config.yaml.

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Options {
    /// Read by the host to pick the plugin; repeated here so the section
    /// parses as a whole.
    pub kind: Option<String>,
    pub max_queue: usize,
    pub greedy_only: bool,
    pub tools: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            kind: None,
            max_queue: 64,
            greedy_only: false,
            tools: true,
        }
    }
}

impl Options {
    pub fn from_yaml(section: &serde_yaml::Value) -> Result<Self, String> {
        if section.is_null() {
            return Ok(Self::default());
        }
        Options::deserialize(section.clone()).map_err(|e| format!("invalid options: {e}"))
    }
}
