//! What every drafter checkpoint loader does first: find the directory and
//! its `config.json`, and check it is the kind of drafter the engine runs.

use std::path::Path;

use anyhow::{ensure, Context};

/// Reads `dir/config.json`, requiring `architecture` among its
/// `architectures` (`kind` names the drafter in the message).
pub fn read_config(
    dir: &Path,
    architecture: &str,
    kind: &str,
) -> anyhow::Result<serde_json::Value> {
    ensure!(
        dir.is_dir(),
        "drafter checkpoint {} does not exist",
        dir.display()
    );
    let text = std::fs::read_to_string(dir.join("config.json"))
        .with_context(|| format!("drafter checkpoint {}: no config.json", dir.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("drafter checkpoint {}: config.json", dir.display()))?;
    let found: Vec<String> = value
        .get("architectures")
        .and_then(|a| serde_json::from_value(a.clone()).ok())
        .unwrap_or_default();
    ensure!(
        found.iter().any(|a| a == architecture),
        "{} is not a {kind}: architectures {found:?} (expected {architecture})",
        dir.display()
    );
    Ok(value)
}
