//! Harness for the end-to-end tests: builds the gateway and the test
//! plugins (one cargo invocation, so they share one build of the runtime
//! crate), writes generated tiny models, starts the real `gateway` binary on
//! a free port, and talks to it over plain HTTP/1.1.

pub mod build;
pub mod gateway;
pub mod http;
pub mod load;
pub mod models;

pub use build::{binaries, Binaries};
pub use gateway::Gateway;
pub use http::{Response, SseStream};

/// The served name of the tiny model (its directory name).
pub const MODEL: &str = "tiny-qwen3";

/// The model lines of the repository's config.yaml.
pub const DEFAULT_MODEL_PATH: &str = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_NAME: &str = "smollm2-135m-instruct";

/// config.yaml's text with its model replaced by the one at `model`, served
/// under its directory name.
pub fn with_model(config: &str, model: &std::path::Path) -> String {
    let path_line = format!("path: {DEFAULT_MODEL_PATH}");
    let name_line = format!("name: {DEFAULT_MODEL_NAME}");
    assert!(
        config.contains(&path_line) && config.contains(&name_line),
        "config.yaml no longer names the default model as the tests expect"
    );
    let name = model.file_name().unwrap().to_string_lossy();
    config
        .replace(&path_line, &format!("path: \"{}\"", model.display()))
        .replace(&name_line, &format!("name: {name}"))
}

/// config.yaml on the generated tiny model (fast; the routing and engine
/// tests need no real text).
pub fn default_config_on_tiny_model() -> String {
    let text =
        std::fs::read_to_string(build::workspace_root().join("config.yaml")).expect("config.yaml");
    with_model(&text, &models::tiny_qwen3())
}

/// An upstream for the `remote` engine's tests: this gateway with the
/// batched engine alone.
pub const BATCHED_UPSTREAM: &str = r#"model: { path: "{model}", kv_cache_mb: 64 }
engines:
  batched: { kind: batched }
policy:
  default: batched
"#;

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
