//! `config.json` of a Hugging Face model directory, for the families we run.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use anyhow::{bail, Context};
use serde::Deserialize;

/// The model families the runtime runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Family {
    pub const ALL: [Family; 4] = [Family::Llama, Family::Qwen2, Family::Qwen3, Family::Gemma3];

    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Family {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        Family::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown model family {s:?} (expected llama, qwen2, qwen3 or gemma3)"
                )
            })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Quantization {
    pub group_size: i32,
    pub bits: i32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (Gemma 3 global layers).
    Linear {
        factor: f32,
    },
    /// Llama 3.1 frequency smoothing.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub family: Family,
    pub model_type: String,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_layers: i32,
    pub num_heads: i32,
    pub num_kv_heads: i32,
    pub head_dim: i32,
    pub vocab_size: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: i32,
    /// Bias on q/k/v projections (Qwen2, some Llamas).
    pub attention_bias: bool,
    /// Gemma 3: sliding-window attention on all but every `pattern`-th layer.
    pub sliding_window: Option<i32>,
    pub sliding_window_pattern: i32,
    pub rope_local_theta: f32,
    pub query_pre_attn_scalar: Option<f32>,
    pub eos_token_id: Vec<u32>,
    pub quantization: Option<Quantization>,
}

#[derive(Deserialize)]
struct Raw {
    model_type: String,
    hidden_size: i32,
    intermediate_size: i32,
    num_hidden_layers: i32,
    num_attention_heads: i32,
    num_key_value_heads: Option<i32>,
    head_dim: Option<i32>,
    vocab_size: i32,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    rope_scaling: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<i32>,
    attention_bias: Option<bool>,
    sliding_window: Option<i32>,
    sliding_window_pattern: Option<i32>,
    rope_local_base_freq: Option<f32>,
    query_pre_attn_scalar: Option<f32>,
    eos_token_id: Option<serde_json::Value>,
    quantization: Option<Quantization>,
    text_config: Option<serde_json::Value>,
}

/// `eos_token_id` may be an int, a list of ints, or absent.
pub fn token_ids(value: Option<&serde_json::Value>) -> Vec<u32> {
    match value {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    }
}

impl ModelConfig {
    pub fn from_dir(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let mut value: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        // Multimodal Gemma 3 checkpoints nest the text model's fields.
        if let Some(text_config) = value.get("text_config").cloned() {
            if value.get("hidden_size").is_none() {
                if let (Some(obj), serde_json::Value::Object(inner)) =
                    (value.as_object_mut(), text_config)
                {
                    for (k, v) in inner {
                        obj.entry(k).or_insert(v);
                    }
                }
            }
        }
        Self::from_json(value).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_json(value: serde_json::Value) -> anyhow::Result<Self> {
        let raw: Raw = serde_json::from_value(value)?;
        let _ = &raw.text_config;
        let family = match raw.model_type.as_str() {
            "llama" | "mistral" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "gemma3_text" | "gemma3" => Family::Gemma3,
            other => bail!(
                "unsupported model_type `{other}` (supported: llama, qwen2, qwen3, gemma3_text)"
            ),
        };
        let gemma = family == Family::Gemma3;
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        let rope_scaling = parse_rope_scaling(raw.rope_scaling.as_ref())?;
        Ok(Self {
            family,
            model_type: raw.model_type,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads: raw.num_key_value_heads.unwrap_or(raw.num_attention_heads),
            head_dim,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(if gemma { 1e-6 } else { 1e-5 }),
            rope_theta: raw
                .rope_theta
                .unwrap_or(if gemma { 1_000_000.0 } else { 10_000.0 }),
            rope_scaling,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(gemma),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(32768),
            attention_bias: raw.attention_bias.unwrap_or(family == Family::Qwen2),
            sliding_window: if gemma {
                Some(raw.sliding_window.unwrap_or(512))
            } else {
                None
            },
            sliding_window_pattern: raw.sliding_window_pattern.unwrap_or(6),
            rope_local_theta: raw.rope_local_base_freq.unwrap_or(10_000.0),
            query_pre_attn_scalar: if gemma {
                Some(raw.query_pre_attn_scalar.unwrap_or(head_dim as f32))
            } else {
                None
            },
            eos_token_id: token_ids(raw.eos_token_id.as_ref()),
            quantization: raw.quantization,
        })
    }

    /// Gemma 3 uses sliding-window attention except on every
    /// `sliding_window_pattern`-th layer.
    pub fn layer_window(&self, layer: i32) -> Option<i32> {
        let window = self.sliding_window?;
        let global = (layer + 1) % self.sliding_window_pattern == 0;
        (!global).then_some(window)
    }

    pub fn has_qk_norm(&self) -> bool {
        matches!(self.family, Family::Qwen3 | Family::Gemma3)
    }

    /// Bytes of K+V per token across all layers at the given element size.
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.num_layers as usize
            * self.num_kv_heads as usize
            * self.head_dim as usize
            * elem_bytes
    }
}

fn parse_rope_scaling(value: Option<&serde_json::Value>) -> anyhow::Result<RopeScaling> {
    let Some(obj) = value.and_then(|v| v.as_object()) else {
        return Ok(RopeScaling::None);
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let num = |k: &str, d: f32| {
        obj.get(k)
            .and_then(|v| v.as_f64())
            .map(|v| v as f32)
            .unwrap_or(d)
    };
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor", 1.0),
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor", 1.0),
            low_freq_factor: num("low_freq_factor", 1.0),
            high_freq_factor: num("high_freq_factor", 4.0),
            original_max_position_embeddings: num("original_max_position_embeddings", 8192.0),
        },
        other => bail!("unsupported rope_scaling type `{other}` (supported: linear, llama3)"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn family_names_round_trip() {
        for f in Family::ALL {
            assert_eq!(f.to_string().parse::<Family>().unwrap(), f);
        }
        let err = "mistral".parse::<Family>().unwrap_err().to_string();
        assert!(err.contains("mistral"), "{err}");
    }
}
