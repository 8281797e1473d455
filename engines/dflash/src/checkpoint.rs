//! A DFlash drafter's `config.json`, checked against the target it will
//! draft for before any weight is read.

use std::path::Path;

use anyhow::{bail, ensure, Context};
use runtime::ModelConfig;
use serde::Deserialize;

pub const ARCHITECTURE: &str = "DFlashDraftModel";

#[derive(Debug, Clone)]
pub struct DflashConfig {
    pub hidden_size: i32,
    pub num_layers: i32,
    pub num_heads: i32,
    pub num_kv_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub block_size: usize,
    /// Per layer: its sliding window, `None` for full attention.
    pub windows: Vec<Option<i32>>,
    pub target_layer_ids: Vec<usize>,
    pub mask_token_id: u32,
    pub quantization: Option<runtime::config::Quantization>,
}

#[derive(Deserialize)]
struct Raw {
    hidden_size: i32,
    num_hidden_layers: i32,
    num_attention_heads: i32,
    num_key_value_heads: Option<i32>,
    head_dim: Option<i32>,
    vocab_size: i32,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    block_size: Option<usize>,
    num_target_layers: Option<i32>,
    #[serde(default)]
    layer_types: Vec<String>,
    sliding_window: Option<i32>,
    dflash_config: Option<DflashSection>,
    // Some exports put these at the top level.
    target_layer_ids: Option<Vec<usize>>,
    mask_token_id: Option<u32>,
    quantization: Option<runtime::config::Quantization>,
}

#[derive(Deserialize)]
struct DflashSection {
    target_layer_ids: Option<Vec<usize>>,
    mask_token_id: Option<u32>,
    // Variants the reference has and this drafter does not.
    causal: Option<bool>,
    draft_window_size: Option<i32>,
    attention_sink_bias: Option<bool>,
}

impl DflashConfig {
    /// Reads `dir/config.json` and checks it fits `target`.
    pub fn load(dir: &Path, target: &ModelConfig) -> anyhow::Result<Self> {
        let value = speculative::checkpoint::read_config(dir, ARCHITECTURE, "DFlash drafter")?;
        let raw: Raw = serde_json::from_value(value)
            .with_context(|| format!("drafter checkpoint {}: config.json", dir.display()))?;
        Self::check(raw, target).with_context(|| format!("drafter checkpoint {}", dir.display()))
    }

    fn check(raw: Raw, target: &ModelConfig) -> anyhow::Result<Self> {
        ensure!(
            raw.vocab_size == target.vocab_size,
            "the drafter's vocabulary ({}) differs from the target's ({}): it was trained for another model",
            raw.vocab_size,
            target.vocab_size
        );
        ensure!(
            raw.hidden_size == target.hidden_size,
            "the drafter's hidden size ({}) differs from the target's ({}): it was trained for another model",
            raw.hidden_size,
            target.hidden_size
        );
        if let Some(n) = raw.num_target_layers {
            ensure!(
                n == target.num_layers,
                "the drafter was trained for a target with {n} layers; this one has {}",
                target.num_layers
            );
        }
        let windows =
            speculative::checkpoint::sliding_layers(&raw.layer_types, raw.num_hidden_layers)?
                .into_iter()
                .map(|sliding| match (sliding, raw.sliding_window) {
                    (false, _) => Ok(None),
                    // It keeps `window - 2` earlier context positions.
                    (true, Some(w)) if w >= 3 => Ok(Some(w)),
                    (true, Some(w)) => bail!("sliding_window {w} is too small"),
                    (true, None) => bail!("sliding_attention layers but no sliding_window"),
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
        let section = raw.dflash_config;
        if let Some(s) = &section {
            ensure!(
                s.causal != Some(true),
                "dflash_config.causal (block-causal drafting) is not supported"
            );
            ensure!(
                s.draft_window_size.is_none_or(|w| w <= 0),
                "dflash_config.draft_window_size (a windowed drafter cache) is not supported"
            );
            ensure!(
                s.attention_sink_bias != Some(true),
                "dflash_config.attention_sink_bias is not supported"
            );
        }
        let target_layer_ids = section
            .as_ref()
            .and_then(|s| s.target_layer_ids.clone())
            .or(raw.target_layer_ids)
            .context("config.json names no target_layer_ids")?;
        let mask_token_id = section
            .as_ref()
            .and_then(|s| s.mask_token_id)
            .or(raw.mask_token_id)
            .context("config.json names no mask_token_id")?;
        ensure!(!target_layer_ids.is_empty(), "target_layer_ids is empty");
        let mut sorted = target_layer_ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        ensure!(
            sorted == target_layer_ids,
            "target_layer_ids must be ascending and distinct: {target_layer_ids:?}"
        );
        if let Some(&bad) = target_layer_ids
            .iter()
            .find(|&&l| l as i32 >= target.num_layers)
        {
            bail!(
                "target layer {bad} does not exist (the target has {} layers)",
                target.num_layers
            );
        }
        ensure!(
            (mask_token_id as i32) < target.vocab_size,
            "mask_token_id {mask_token_id} is outside the vocabulary"
        );
        let block_size = raw.block_size.unwrap_or(16);
        ensure!(block_size >= 2, "block_size must be at least 2");
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        ensure!(
            num_kv_heads > 0 && raw.num_attention_heads % num_kv_heads == 0,
            "num_attention_heads must be a multiple of num_key_value_heads"
        );
        Ok(Self {
            hidden_size: raw.hidden_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim: raw
                .head_dim
                .unwrap_or(raw.hidden_size / raw.num_attention_heads),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: raw.rope_theta.unwrap_or(1_000_000.0),
            block_size,
            windows,
            target_layer_ids,
            mask_token_id,
            quantization: raw.quantization,
        })
    }

    /// Bytes of drafter K+V per context token (its cache holds the
    /// projected target context), at `elem` bytes per value.
    pub fn kv_bytes_per_token(&self, elem: usize) -> usize {
        2 * (self.num_layers * self.num_kv_heads * self.head_dim) as usize * elem
    }
}
