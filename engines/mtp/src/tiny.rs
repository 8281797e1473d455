//! Random-weight assistant drafters in the Gemma 4 assistant layout, made
//! for a given target: what the tests and benchmarks draft with.

use std::path::Path;

use anyhow::Context;
use runtime::tiny::{declared_dtype, dtype_name, RandomTensors};
use runtime::ModelConfig;
use serde_json::json;

#[derive(Debug, Clone)]
pub struct TinyAssistant {
    pub hidden: i32,
    pub layers: i32,
    pub seed: u64,
}

impl Default for TinyAssistant {
    fn default() -> Self {
        Self {
            hidden: 64,
            layers: 2,
            seed: 11,
        }
    }
}

pub fn write_drafter(target_dir: &Path, out: &Path, spec: &TinyAssistant) -> anyhow::Result<()> {
    let t = ModelConfig::from_dir(target_dir)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let (h, backbone) = (spec.hidden, t.hidden_size);
    // Layers meet the target's last sliding and last full layers with keys
    // and values of their own (Gemma 4 sizes their heads differently).
    let owner = |full: bool| {
        (0..t.num_layers)
            .rev()
            .map(|i| t.layer(i))
            .find(|l| l.kv_source.is_none() && l.window.is_none() == full)
            .unwrap_or_else(|| t.layer(t.num_layers - 1))
    };
    let (sliding, full) = (owner(false), owner(true));
    let heads = sliding.kv_heads.max(full.kv_heads) * 2;
    let inter = h * 2;
    let dtype = declared_dtype(target_dir);
    let mut w = RandomTensors::new(spec.seed, dtype)?;
    let std = 0.05;
    w.normal("pre_projection.weight", &[h, 2 * backbone], std, 0.0)?;
    w.normal("post_projection.weight", &[backbone, h], std, 0.0)?;
    w.normal("model.embed_tokens.weight", &[t.vocab_size, h], 1.0, 0.0)?;
    w.normal("model.norm.weight", &[h], 0.02, 1.0)?;
    let mut layer_types = Vec::new();
    for i in 0..spec.layers {
        let p = format!("model.layers.{i}");
        // Gemma 4's pattern: sliding layers, the last one global.
        let is_full = i + 1 == spec.layers;
        let hd = if is_full {
            full.head_dim
        } else {
            sliding.head_dim
        };
        w.normal(
            format!("{p}.self_attn.q_proj.weight"),
            &[heads * hd, h],
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
        w.normal(format!("{p}.mlp.gate_proj.weight"), &[inter, h], std, 0.0)?;
        w.normal(format!("{p}.mlp.up_proj.weight"), &[inter, h], std, 0.0)?;
        w.normal(format!("{p}.mlp.down_proj.weight"), &[h, inter], std, 0.0)?;
        for n in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            w.normal(format!("{p}.{n}.weight"), &[h], 0.02, 1.0)?;
        }
        w.normal(format!("{p}.layer_scalar"), &[1], 0.0, 1.0)?;
        layer_types.push(if is_full {
            "full_attention"
        } else {
            "sliding_attention"
        });
    }
    w.save(&out.join("model.safetensors"))?;
    let config = json!({
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": backbone,
        "use_ordered_embeddings": false,
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": h,
            "intermediate_size": inter,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": heads,
            "num_key_value_heads": t.num_kv_heads,
            "head_dim": sliding.head_dim,
            "global_head_dim": full.head_dim,
            "vocab_size": t.vocab_size,
            "rms_norm_eps": 1e-6,
            "layer_types": layer_types,
            "query_pre_attn_scalar": sliding.head_dim,
            "max_position_embeddings": t.max_position_embeddings,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        "torch_dtype": dtype_name(dtype),
    });
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    Ok(())
}
