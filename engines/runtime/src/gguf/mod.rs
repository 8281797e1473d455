//! GGUF checkpoints (llama.cpp's single-file format): the model config,
//! weights, tokenizer and chat template all come from one file.
//!
//! Tensors get their Hugging Face names, and what llama.cpp's converter
//! changed is undone: Llama's q/k projections have their rows permuted for
//! its interleaved RoPE, and Gemma's norm weights carry the `+1` the runtime
//! adds itself. See [`blocks`] for how tensor types map onto MLX.

pub mod blocks;
pub mod file;

use std::path::Path;

use anyhow::{anyhow, bail, Context};
use serde_json::json;

pub use file::{GgufError, GgufFile, TensorInfo, TensorType, Value};

use crate::config::{Family, ModelConfig};
use crate::weights::Weights;

/// Everything a GGUF file holds, in the runtime's terms.
pub struct GgufCheckpoint {
    pub config: ModelConfig,
    pub weights: Weights,
    pub vocab: text::gguf::GgufVocab,
    /// The sampling its metadata recommends (`general.sampling.*`).
    pub sampling: engine_core::SamplingDefaults,
}

/// The architectures served (`general.architecture`).
const ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3", "gemma3"];

pub fn load(path: &Path) -> anyhow::Result<GgufCheckpoint> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = GgufFile::parse(bytes).with_context(|| format!("reading {}", path.display()))?;
    let config = config(&file).with_context(|| format!("model config of {}", path.display()))?;
    let weights = weights(&file, &config, path)
        .with_context(|| format!("loading the tensors of {}", path.display()))?;
    Ok(GgufCheckpoint {
        vocab: vocab(&file),
        sampling: crate::generation_config::from_gguf(&file),
        config,
        weights,
    })
}

fn arch(file: &GgufFile) -> anyhow::Result<&str> {
    let arch = file
        .get("general.architecture")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("no general.architecture"))?;
    if !ARCHITECTURES.contains(&arch) {
        bail!(
            "GGUF architecture `{arch}` is not served (supported: {})",
            ARCHITECTURES.join(", ")
        );
    }
    Ok(arch)
}

/// The `config.json` a Hugging Face checkpoint of this model would have.
fn config(file: &GgufFile) -> anyhow::Result<ModelConfig> {
    let arch = arch(file)?;
    let key = |k: &str| format!("{arch}.{k}");
    let uint = |k: &str| file.get(&key(k)).and_then(Value::as_u64);
    let float = |k: &str| file.get(&key(k)).and_then(Value::as_f64);
    let need = |k: &str| uint(k).ok_or_else(|| anyhow!("metadata `{}` missing", key(k)));
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let head_dim = uint("attention.key_length").unwrap_or(hidden / heads.max(1));
    if let Some(rot) = uint("rope.dimension_count") {
        if rot != head_dim {
            bail!("partial rotary embeddings ({rot} of {head_dim} dimensions) are not supported");
        }
    }
    if file.tensor("rope_freqs.weight").is_some() {
        bail!("`rope_freqs.weight` (per-frequency RoPE factors, Llama 3.1 style) is not supported");
    }
    let vocab_size = match uint("vocab_size") {
        Some(v) => v,
        None => file
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .map(|t| t.len() as u64)
            .ok_or_else(|| anyhow!("neither `{}` nor a token list", key("vocab_size")))?,
    };
    let model_type = match arch {
        "gemma3" => "gemma3_text",
        other => other,
    };
    let mut raw = json!({
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length")?,
        "num_hidden_layers": need("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": uint("attention.head_count_kv").unwrap_or(heads),
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "tie_word_embeddings": file.tensor("output.weight").is_none(),
        "attention_bias": file.tensor("blk.0.attn_q.bias").is_some(),
    });
    let obj = raw.as_object_mut().expect("object");
    if let Some(eps) = float("attention.layer_norm_rms_epsilon") {
        obj.insert("rms_norm_eps".into(), json!(eps));
    }
    if let Some(theta) = float("rope.freq_base") {
        obj.insert("rope_theta".into(), json!(theta));
    }
    if let Some(ctx) = uint("context_length") {
        obj.insert("max_position_embeddings".into(), json!(ctx));
    }
    if let Some(window) = uint("attention.sliding_window") {
        obj.insert("sliding_window".into(), json!(window));
    }
    match file.get(&key("rope.scaling.type")).and_then(Value::as_str) {
        None | Some("none") => {}
        Some("linear") => {
            let factor = float("rope.scaling.factor").unwrap_or(1.0);
            obj.insert(
                "rope_scaling".into(),
                json!({"rope_type": "linear", "factor": factor}),
            );
        }
        Some(other) => bail!("RoPE scaling `{other}` is not supported (linear is)"),
    }
    if let Some(eos) = file
        .get("tokenizer.ggml.eos_token_id")
        .and_then(Value::as_u64)
    {
        obj.insert("eos_token_id".into(), json!(eos));
    }
    ModelConfig::from_json(raw)
}

/// The tokenizer metadata of `file`.
pub fn vocab(file: &GgufFile) -> text::gguf::GgufVocab {
    let get = |k: &str| file.get(&format!("tokenizer.ggml.{k}"));
    let strings = |k: &str| -> Vec<String> {
        get(k)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let id = |k: &str| {
        get(k)
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
    };
    text::gguf::GgufVocab {
        model: get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        pre: get("pre").and_then(Value::as_str).map(str::to_owned),
        tokens: strings("tokens"),
        token_types: get("token_type")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|v| v.as_u64().and_then(|t| i64::try_from(t).ok()).unwrap_or(-1))
                    .collect()
            })
            .unwrap_or_default(),
        scores: get("scores")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|v| v.as_f64().unwrap_or(f64::NAN)).collect())
            .unwrap_or_default(),
        merges: strings("merges"),
        bos_token_id: id("bos_token_id"),
        eos_token_id: id("eos_token_id"),
        eot_token_id: id("eot_token_id"),
        padding_token_id: id("padding_token_id"),
        unknown_token_id: id("unknown_token_id"),
        add_bos_token: get("add_bos_token").and_then(Value::as_bool),
        add_space_prefix: get("add_space_prefix").and_then(Value::as_bool),
        chat_template: file
            .get("tokenizer.chat_template")
            .and_then(Value::as_str)
            .map(str::to_owned),
    }
}

/// llama.cpp's tensor names to Hugging Face's, per family.
fn hf_name(name: &str, family: Family) -> Option<String> {
    let (stem, suffix) = name.rsplit_once('.')?;
    let global = match stem {
        "token_embd" => Some("model.embed_tokens"),
        "output_norm" => Some("model.norm"),
        "output" => Some("lm_head"),
        _ => None,
    };
    if let Some(g) = global {
        return Some(format!("{g}.{suffix}"));
    }
    let rest = stem.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: u32 = layer.parse().ok()?;
    let gemma = family == Family::Gemma3;
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        // Gemma's sandwich: llama.cpp's ffn_norm is the pre-MLP norm.
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" => "post_attention_layernorm",
        "post_ffw_norm" => "post_feedforward_layernorm",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

fn weights(file: &GgufFile, config: &ModelConfig, path: &Path) -> anyhow::Result<Weights> {
    let family = config.family;
    let mut weights = Weights::from_gguf(path);
    for info in &file.tensors {
        let name = hf_name(&info.name, family)
            .ok_or_else(|| anyhow!("tensor `{}` has no place in a {family} model", info.name))?;
        let mut bytes = std::borrow::Cow::Borrowed(file.bytes(info));
        // llama.cpp's Llama converter interleaves the two rotary halves of
        // every q and k head; put the rows back.
        if family == Family::Llama {
            let heads = if name.contains("q_proj") {
                Some(config.num_heads)
            } else if name.contains("k_proj") {
                Some(config.num_kv_heads)
            } else {
                None
            };
            if let Some(heads) = heads {
                bytes = unpermute_rows(info, &bytes, heads as usize)
                    .with_context(|| format!("tensor `{}`", info.name))?
                    .into();
            }
        }
        let prefix = name.strip_suffix(".weight").unwrap_or(&name).to_owned();
        match blocks::load(info, &bytes) {
            blocks::Loaded::Dense(mut array) => {
                // llama.cpp's Gemma converter stores `1 + w`; the model adds
                // the one itself.
                if family == Family::Gemma3 && name.ends_with("norm.weight") {
                    array = array.subtract(mlx_rs::Array::from_f32(1.0))?;
                }
                weights.insert(name, array);
            }
            blocks::Loaded::Quantized {
                weight,
                scales,
                biases,
                quantization,
            } => {
                weights.insert(format!("{prefix}.scales"), scales);
                weights.insert(format!("{prefix}.biases"), biases);
                weights.insert(name, weight);
                weights.set_quantization(prefix, quantization);
            }
        }
    }
    Ok(weights)
}

/// Inverse of the converter's `reshape(heads, 2, d/2, ..).swapaxes(1, 2)`
/// on the rows of a q or k projection (weight or bias): HF row
/// `h*d + j*d/2 + i` is stored at `h*d + 2i + j`.
fn unpermute_rows(info: &TensorInfo, bytes: &[u8], heads: usize) -> anyhow::Result<Vec<u8>> {
    // A bias is one element per row.
    let rows = if info.shape.len() == 1 {
        info.shape[0]
    } else {
        info.rows()
    };
    if heads == 0 || rows % (2 * heads) != 0 {
        bail!("{rows} rows do not split into {heads} heads of two rotary halves");
    }
    let (d, elem) = (rows / heads, bytes.len() / rows);
    let mut out = Vec::with_capacity(bytes.len());
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..d / 2 {
                let src = (h * d + 2 * i + j) * elem;
                out.extend_from_slice(&bytes[src..src + elem]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
