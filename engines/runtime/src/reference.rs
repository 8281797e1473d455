//! Runs the reference implementations (Python mlx-lm and mlx-vlm, installed
//! by `scripts/setup` into `.mlx/venv`) for the oracle tests: a script from
//! `scripts/` reads one JSON request on stdin and prints one JSON answer.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The repository root (tests run from their crate's directory).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Sends `request` to `scripts/<script>` under the project's venv Python and
/// returns its answer. Panics with a pointer to `scripts/setup` when the
/// venv is missing, and when the script fails (its stderr is inherited).
pub fn run(script: &str, request: &serde_json::Value) -> serde_json::Value {
    let root = repo_root();
    let python = root.join(".mlx/venv/bin/python");
    assert!(
        python.exists(),
        "{} missing: run scripts/setup (it installs the reference implementations)",
        python.display()
    );
    let mut child = Command::new(python)
        .arg(root.join("scripts").join(script))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("start {script}: {e}"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(request.to_string().as_bytes())
        .expect("write the request");
    let out = child.wait_with_output().expect("wait for the reference");
    assert!(out.status.success(), "{script} failed");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{script} answered: {e}"))
}

/// The default model scripts/setup fetches (SmolLM2-135M-Instruct, Q4_1
/// GGUF): the real-text tests' model. Panics with a pointer to
/// scripts/setup when it is missing.
pub fn default_gguf() -> PathBuf {
    let path = repo_root().join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} missing: run scripts/setup (it fetches the default model)",
        path.display()
    );
    path
}

/// Chat conversations the real-text tests run (short answers, mixed kinds).
pub fn chat_prompts() -> Vec<serde_json::Value> {
    use serde_json::json;
    vec![
        json!([{"role": "user", "content": "What is the capital of France?"}]),
        json!([{"role": "user", "content": "Write a Python function that returns the square of a number."}]),
        json!([{"role": "system", "content": "You are a concise assistant."},
               {"role": "user", "content": "Give me three tips for staying healthy."}]),
        json!([{"role": "user", "content": "Hi!"},
               {"role": "assistant", "content": "Hello! How can I help you today?"},
               {"role": "user", "content": "Tell me a fun fact about octopuses."}]),
    ]
}
