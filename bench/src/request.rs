//! The JSON body of one streamed request, for either endpoint.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::prompts::Prompt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `/v1/completions` with a text prompt (no chat template).
    Completions,
    /// `/v1/chat/completions` with one user message.
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// What every request of a run shares.
#[derive(Debug, Clone)]
pub struct RequestShape {
    pub endpoint: Endpoint,
    /// `None`: the field is left out (the server's default model).
    pub model: Option<String>,
    pub max_tokens: u32,
    pub temperature: f64,
    /// Ask for exactly `max_tokens` (vLLM's and our `ignore_eos`; servers
    /// that do not know it ignore it).
    pub ignore_eos: bool,
    /// Send a prompt's `tools` (chat only).
    pub tools: bool,
    /// The sampling seed of prompt index 0 (`seed` is this + the index);
    /// `None`: no seed.
    pub seeds: Option<u64>,
}

impl RequestShape {
    /// The body for the sweep's prompt `index`.
    pub fn body(&self, index: usize, prompt: &Prompt, max_tokens: u32) -> Value {
        let mut body = json!({
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        match self.endpoint {
            Endpoint::Completions => body["prompt"] = json!(prompt.prompt),
            Endpoint::Chat => {
                body["messages"] = json!([{"role": "user", "content": prompt.prompt}]);
                if let Some(tools) = prompt.tools.as_ref().filter(|_| self.tools) {
                    body["tools"] = tools.clone();
                }
            }
        }
        if let Some(model) = &self.model {
            body["model"] = json!(model);
        }
        if self.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        if let Some(base) = self.seeds {
            body["seed"] = json!(base.wrapping_add(index as u64));
        }
        body
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_for_each_endpoint() {
        let prompt = Prompt {
            kind: "tool_call".into(),
            prompt: "weather?".into(),
            tools: Some(json!([{"type": "function"}])),
        };
        let mut shape = RequestShape {
            endpoint: Endpoint::Chat,
            model: Some("m".into()),
            max_tokens: 16,
            temperature: 0.0,
            ignore_eos: true,
            tools: true,
            seeds: None,
        };
        let b = shape.body(0, &prompt, 16);
        assert_eq!(b["messages"][0]["content"], "weather?");
        assert_eq!(b["tools"][0]["type"], "function");
        assert_eq!(
            (b["model"].as_str(), b["ignore_eos"].as_bool()),
            (Some("m"), Some(true))
        );
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert!(b.get("seed").is_none());
        shape.tools = false;
        shape.model = None;
        shape.ignore_eos = false;
        let b = shape.body(1, &prompt, 4);
        assert!(
            b.get("tools").is_none() && b.get("model").is_none() && b.get("ignore_eos").is_none()
        );
        shape.endpoint = Endpoint::Completions;
        shape.seeds = Some(10);
        let b = shape.body(7, &prompt, 4);
        assert_eq!(b["seed"].as_u64(), Some(17));
        assert_eq!(
            (b["prompt"].as_str(), b["max_tokens"].as_u64()),
            (Some("weather?"), Some(4))
        );
        assert!(b.get("messages").is_none());
    }
}
