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
    /// A fault to inject into every request, for the gateway's
    /// fault-isolation tests.
    pub fault: Option<Fault>,
    /// Inject `fault` into only this many first requests (0: every one).
    pub fault_requests: u32,
    /// A pause after each token, so tests can catch requests mid-stream.
    pub token_delay_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// `submit` panics.
    PanicOnSubmit,
    /// The worker thread panics while serving the request (its event
    /// stream is dropped without a final event).
    PanicInWorker,
    /// `submit` answers with an internal error.
    ErrorOnSubmit,
    /// The request ends with an internal `Error` event.
    ErrorInStream,
    /// The request ends with an overload `Error` event (capacity lost
    /// after admission).
    OverloadInStream,
    /// The request ends with an invalid-input `Error` event.
    InvalidInStream,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            kind: None,
            max_queue: 64,
            greedy_only: false,
            tools: true,
            fault: None,
            fault_requests: 0,
            token_delay_ms: 0,
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
