//! Random-weight DFlash drafters in the published checkpoint layout, made
//! for a given target: what the tests and benchmarks draft with.

use std::path::Path;

use anyhow::Context;
use runtime::tiny::{declared_dtype, dtype_name, RandomTensors};
use runtime::ModelConfig;
use serde_json::json;

#[derive(Debug, Clone)]
pub struct TinyDflash {
    pub layers: i32,
    pub block_size: usize,
    pub seed: u64,
}

impl Default for TinyDflash {
    fn default() -> Self {
        Self {
            layers: 2,
            block_size: 8,
            seed: 7,
        }
    }
}

/// Target layers a drafter with `n` layers reads: spread evenly from the
/// second layer to the third-to-last (as the published drafters are).
pub fn target_layer_ids(target_layers: i32, n: i32) -> Vec<usize> {
    let (lo, hi) = (1.min(target_layers - 1), (target_layers - 3).max(1));
    let mut ids: Vec<usize> = (0..n)
        .map(|i| {
            let t = if n == 1 {
                0.5
            } else {
                i as f32 / (n - 1) as f32
            };
            (lo as f32 + t * (hi - lo) as f32).round() as usize
        })
        .collect();
    ids.dedup();
    ids
}

/// Writes a drafter for the target model at `target_dir` into `out`.
pub fn write_drafter(target_dir: &Path, out: &Path, spec: &TinyDflash) -> anyhow::Result<()> {
    let t = ModelConfig::from_dir(target_dir)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let ids = target_layer_ids(t.num_layers, spec.layers.max(1));
    let (h, hd) = (t.hidden_size, t.head_dim);
    let (heads, kv) = (t.num_heads, t.num_kv_heads);
    let dtype = declared_dtype(target_dir);
    let mut w = RandomTensors::new(spec.seed, dtype)?;
    let std = 0.02;
    w.normal("fc.weight", &[h, h * ids.len() as i32], std, 0.0)?;
    w.normal("hidden_norm.weight", &[h], 0.02, 1.0)?;
    w.normal("norm.weight", &[h], 0.02, 1.0)?;
    for i in 0..spec.layers {
        let p = format!("layers.{i}");
        w.normal(
            format!("{p}.self_attn.q_proj.weight"),
            &[heads * hd, h],
            std,
            0.0,
        )?;
        w.normal(
            format!("{p}.self_attn.k_proj.weight"),
            &[kv * hd, h],
            std,
            0.0,
        )?;
        w.normal(
            format!("{p}.self_attn.v_proj.weight"),
            &[kv * hd, h],
            std,
            0.0,
        )?;
        w.normal(
            format!("{p}.self_attn.o_proj.weight"),
            &[h, heads * hd],
            std,
            0.0,
        )?;
        w.normal(format!("{p}.self_attn.q_norm.weight"), &[hd], 0.02, 1.0)?;
        w.normal(format!("{p}.self_attn.k_norm.weight"), &[hd], 0.02, 1.0)?;
        w.normal(
            format!("{p}.mlp.gate_proj.weight"),
            &[t.intermediate_size, h],
            std,
            0.0,
        )?;
        w.normal(
            format!("{p}.mlp.up_proj.weight"),
            &[t.intermediate_size, h],
            std,
            0.0,
        )?;
        w.normal(
            format!("{p}.mlp.down_proj.weight"),
            &[h, t.intermediate_size],
            std,
            0.0,
        )?;
        w.normal(format!("{p}.input_layernorm.weight"), &[h], 0.02, 1.0)?;
        w.normal(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            0.02,
            1.0,
        )?;
    }
    w.save(&out.join("model.safetensors"))?;
    let config = json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": h,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "vocab_size": t.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": t.rope_theta,
        "max_position_embeddings": t.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "tie_word_embeddings": false,
        "block_size": spec.block_size,
        "num_target_layers": t.num_layers,
        "layer_types": vec!["full_attention"; spec.layers as usize],
        "dflash_config": {
            "mask_token_id": t.vocab_size - 1,
            "target_layer_ids": ids,
        },
        "torch_dtype": dtype_name(dtype),
    });
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ids_spread_and_stay_inside_the_target() {
        assert_eq!(target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(target_layer_ids(4, 2), vec![1]);
        assert_eq!(target_layer_ids(12, 1), vec![5]);
        assert!(target_layer_ids(2, 3).iter().all(|&l| l < 2));
    }
}
