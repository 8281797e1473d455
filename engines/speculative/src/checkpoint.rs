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

/// Which of a drafter's `layers` layers use sliding-window attention, from
/// its `layer_types` (`sliding_attention` or `full_attention`; an empty
/// list means every layer is full).
pub fn sliding_layers(layer_types: &[String], layers: i32) -> anyhow::Result<Vec<bool>> {
    if layer_types.is_empty() {
        return Ok(vec![false; layers.max(0) as usize]);
    }
    ensure!(
        layer_types.len() == layers as usize,
        "layer_types has {} entries for {layers} layers",
        layer_types.len()
    );
    layer_types
        .iter()
        .map(|t| match t.as_str() {
            "sliding_attention" => Ok(true),
            "full_attention" => Ok(false),
            other => anyhow::bail!("drafter layer type `{other}` is not supported"),
        })
        .collect()
}
