//! Harness for the end-to-end tests: builds the gateway and the test
//! plugins (one cargo invocation, so they share one build of the runtime
//! crate), writes generated tiny models, starts the real `gateway` binary on
//! a free port, and talks to it over plain HTTP/1.1.

pub mod build;
pub mod gateway;
pub mod http;
pub mod models;

pub use build::{binaries, Binaries};
pub use gateway::Gateway;
pub use http::{Response, SseStream};

/// The served name of the tiny model (its directory name).
pub const MODEL: &str = "tiny-qwen3";

/// A gateway with one reference engine `ref` and a default-only policy.
/// Extra YAML lines go under `server:`.
pub fn basic_config(server: &str) -> String {
    format!(
        r#"model: {{ path: "{{model}}", kv_cache_mb: 64 }}
server:
  policy_reload_ms: 100
{server}
plugins: ["{{reference}}"]
engines:
  ref: {{ kind: reference }}
policy:
  default: ref
"#
    )
}
