//! `config.json` of a Hugging Face model directory, for the families we run.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use anyhow::{bail, Context};
use serde::Deserialize;
use text::reasoning::ReasoningFormat;
use text::tools::ToolFormat;

use crate::kv_quant::KvQuant;

/// The model families the runtime runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
    Gemma4,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::Gemma3,
        Family::Gemma4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
            Family::Gemma4 => "gemma4",
        }
    }
}

impl Family {
    /// How the family marks reasoning in its output.
    pub fn reasoning_format(self) -> ReasoningFormat {
        match self {
            Family::Qwen3 => ReasoningFormat::Think,
            Family::Gemma3 | Family::Gemma4 => ReasoningFormat::GemmaChannel,
            Family::Llama | Family::Qwen2 => ReasoningFormat::None,
        }
    }

    /// How the family writes tool calls.
    pub fn tool_format(self) -> ToolFormat {
        match self {
            Family::Qwen2 | Family::Qwen3 => ToolFormat::Hermes,
            Family::Llama => ToolFormat::Llama3Json,
            Family::Gemma3 | Family::Gemma4 => ToolFormat::Gemma,
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
                    "unknown model family {s:?} (expected llama, qwen2, qwen3, gemma3 or gemma4)"
                )
            })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Quantization {
    pub group_size: i32,
    pub bits: i32,
}

/// Bit widths of MLX's affine quantization (`mx.quantize`).
const AFFINE_BITS: [i32; 6] = [2, 3, 4, 5, 6, 8];

/// Module path (canonical weight naming, no `.weight`) to the layer's own
/// quantization, `None` where it stays unquantized: mlx-lm writes these
/// for layers a model's `quant_predicate` treats differently, like Gemma
/// 4's routers.
pub type QuantizationOverrides = HashMap<String, Option<Quantization>>;

/// The `quantization` block of an MLX checkpoint: the default for every
/// quantized layer and the per-layer overrides.
fn parse_quantization(
    value: Option<&serde_json::Value>,
) -> anyhow::Result<(Option<Quantization>, QuantizationOverrides)> {
    let Some(obj) = value.and_then(|v| v.as_object()) else {
        return Ok((None, HashMap::new()));
    };
    if let Some(mode) = obj.get("mode").and_then(|m| m.as_str()) {
        if mode != "affine" {
            bail!("quantization mode `{mode}` is not supported (only MLX affine)");
        }
    }
    let spec = |v: &serde_json::Value| -> anyhow::Result<Quantization> {
        let q: Quantization =
            serde_json::from_value(v.clone()).with_context(|| format!("quantization entry {v}"))?;
        if !AFFINE_BITS.contains(&q.bits) || q.group_size <= 0 {
            bail!(
                    "quantization with {} bits, group size {} is not supported (bits: 2, 3, 4, 5, 6, 8)",
                    q.bits,
                    q.group_size
                );
        }
        Ok(q)
    };
    let default = match (obj.get("bits"), obj.get("group_size")) {
        (None, None) => None,
        _ => Some(spec(&serde_json::Value::Object(obj.clone()))?),
    };
    let mut overrides = HashMap::new();
    for (path, v) in obj {
        let q = match v {
            serde_json::Value::Object(_) => Some(spec(v)?),
            serde_json::Value::Bool(false) => None,
            _ => continue,
        };
        let weight = crate::weights::canonical_name(&format!("{path}.weight"));
        overrides.insert(weight.trim_end_matches(".weight").to_string(), q);
    }
    Ok((default, overrides))
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (Gemma 3 global layers).
    Linear {
        factor: f32,
    },
    /// Gemma 4 full-attention layers: only the first `rotated` of the head's
    /// dimensions turn, at the frequencies a rotation over the whole head
    /// would give them (times `factor`); the rest pass through.
    Proportional {
        rotated_fraction: f32,
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
    pub quantization_overrides: QuantizationOverrides,
    pub gemma4: Option<Gemma4Config>,
    /// Qwen's sparse expert blocks in place of the MLP (`qwen3_moe`,
    /// `qwen3_5_moe`).
    pub sparse_moe: Option<SparseMoeConfig>,
    /// Qwen 3.5's hybrid decoder: Gated DeltaNet layers between gated
    /// full-attention ones (`qwen3_5`, `qwen3_5_moe`).
    pub hybrid: Option<HybridConfig>,
}

/// Qwen's sparse MoE block: a router over `num_experts`, the top `top_k`
/// experts per token, optionally a gated shared expert beside them.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseMoeConfig {
    pub num_experts: i32,
    pub top_k: i32,
    pub intermediate: i32,
    /// Renormalise the top-k router probabilities to sum to one.
    pub norm_topk_prob: bool,
    /// Width of the shared expert (Qwen 3.5 MoE), `None` without one.
    pub shared_intermediate: Option<i32>,
    /// Per layer: experts (`true`) or the dense MLP (`mlp_only_layers`,
    /// `decoder_sparse_step`).
    pub sparse: Vec<bool>,
}

/// Qwen 3.5's layer mix and the geometry of its Gated DeltaNet layers.
#[derive(Debug, Clone, PartialEq)]
pub struct HybridConfig {
    /// Per layer: gated full attention (`true`) or Gated DeltaNet.
    pub full_attention: Vec<bool>,
    pub key_heads: i32,
    pub value_heads: i32,
    pub key_head_dim: i32,
    pub value_head_dim: i32,
    /// Width of the causal depthwise convolution over q, k and v.
    pub conv_kernel: i32,
    /// Head dimensions the full-attention layers rotate (partial rope).
    pub rotary_dims: i32,
    /// Decoder layers of the checkpoint's multi-token-prediction head
    /// (`mtp_num_hidden_layers`, weights under `mtp.*`; 0: none).
    pub mtp_layers: i32,
}

impl HybridConfig {
    /// Channels of the convolution: q, k and v side by side.
    pub fn conv_dim(&self) -> i32 {
        2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim
    }

    /// Elements of one sequence's recurrent state in one linear layer: the
    /// convolution's last `conv_kernel - 1` inputs and the `[value_heads,
    /// value_head_dim, key_head_dim]` delta-rule state.
    pub fn state_elements(&self) -> (usize, usize) {
        let conv = (self.conv_kernel - 1) as usize * self.conv_dim() as usize;
        let ssm = (self.value_heads * self.value_head_dim * self.key_head_dim) as usize;
        (conv, ssm)
    }
}

/// What Gemma 4 adds to the decoder (`gemma4_text`, or a `gemma4`
/// checkpoint's `text_config`).
#[derive(Debug, Clone)]
pub struct Gemma4Config {
    /// Per layer: full attention (`true`) or sliding (`layer_types`).
    pub full_attention: Vec<bool>,
    /// Head size of the full-attention layers (sliding ones use `head_dim`).
    pub global_head_dim: i32,
    /// KV heads of full-attention layers whose values are their keys.
    pub global_kv_heads: Option<i32>,
    /// Full-attention layers compute no values: V is K before its norms.
    pub attention_k_eq_v: bool,
    /// The last this many layers compute no keys or values of their own;
    /// each reads those of the last earlier layer of its attention kind.
    pub num_kv_shared_layers: i32,
    /// Per-layer input embeddings (E2B/E4B): width per layer and the
    /// vocabulary of their table.
    pub per_layer_input: Option<(i32, i32)>,
    /// KV-shared layers have MLPs twice `intermediate_size` wide.
    pub double_wide_mlp: bool,
    pub final_logit_softcapping: Option<f32>,
    pub moe: Option<MoeConfig>,
    /// Rope base and scaling of full and sliding layers (`rope_parameters`).
    pub rope_full: (f32, RopeScaling),
    pub rope_sliding: (f32, RopeScaling),
}

/// A sparse mixture-of-experts block beside the dense MLP (26B-A4B).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    pub num_experts: i32,
    pub top_k: i32,
    pub intermediate: i32,
}

/// One decoder layer's geometry, whatever the family.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpec {
    /// Sliding-window size, `None` for full attention.
    pub window: Option<i32>,
    pub head_dim: i32,
    pub kv_heads: i32,
    pub rope_base: f32,
    pub rope_scaling: RopeScaling,
    /// Values are the keys (no `v_proj`).
    pub k_eq_v: bool,
    /// The earlier layer whose keys and values this layer attends to
    /// instead of computing its own.
    pub kv_source: Option<usize>,
    pub intermediate: i32,
    /// Head dimensions rope rotates (the rest pass through).
    pub rotary_dims: i32,
    /// A Gated DeltaNet layer (recurrent state, no keys or values).
    pub linear: bool,
    /// Qwen 3.5's attention: q_proj also gives a sigmoid gate on the output.
    pub gated_attention: bool,
    /// Experts in place of the MLP.
    pub sparse_moe: bool,
}

#[derive(Deserialize)]
struct Raw {
    model_type: String,
    hidden_size: i32,
    intermediate_size: Option<i32>,
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
    quantization: Option<serde_json::Value>,
    // Gemma 4.
    layer_types: Option<Vec<String>>,
    global_head_dim: Option<i32>,
    num_global_key_value_heads: Option<i32>,
    attention_k_eq_v: Option<bool>,
    num_kv_shared_layers: Option<i32>,
    /// Absent means the default width, `null` no per-layer inputs.
    #[serde(default, deserialize_with = "present")]
    hidden_size_per_layer_input: Option<Option<i32>>,
    vocab_size_per_layer_input: Option<i32>,
    use_double_wide_mlp: Option<bool>,
    final_logit_softcapping: Option<f32>,
    enable_moe_block: Option<bool>,
    num_experts: Option<i32>,
    top_k_experts: Option<i32>,
    moe_intermediate_size: Option<i32>,
    rope_parameters: Option<serde_json::Value>,
    // Qwen3 MoE and Qwen 3.5.
    num_experts_per_tok: Option<i32>,
    decoder_sparse_step: Option<i32>,
    mlp_only_layers: Option<Vec<i32>>,
    norm_topk_prob: Option<bool>,
    shared_expert_intermediate_size: Option<i32>,
    linear_num_value_heads: Option<i32>,
    linear_num_key_heads: Option<i32>,
    linear_key_head_dim: Option<i32>,
    linear_value_head_dim: Option<i32>,
    linear_conv_kernel_dim: Option<i32>,
    full_attention_interval: Option<i32>,
    mtp_num_hidden_layers: Option<i32>,
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
        let family = match raw.model_type.as_str() {
            "llama" | "mistral" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" | "qwen3_moe" | "qwen3_5" | "qwen3_5_text" | "qwen3_5_moe"
            | "qwen3_5_moe_text" => Family::Qwen3,
            "gemma3_text" | "gemma3" => Family::Gemma3,
            "gemma4_text" | "gemma4" => Family::Gemma4,
            other => bail!(
                "unsupported model_type `{other}` (supported: llama, mistral, qwen2, qwen3, qwen3_moe, qwen3_5, qwen3_5_moe, gemma3, gemma3_text, gemma4, gemma4_text)"
            ),
        };
        let qwen35 = raw.model_type.starts_with("qwen3_5");
        let gemma = matches!(family, Family::Gemma3 | Family::Gemma4);
        let (quantization, quantization_overrides) = parse_quantization(raw.quantization.as_ref())?;
        let gemma4 = if family == Family::Gemma4 {
            Some(gemma4_config(&raw)?)
        } else {
            None
        };
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        let hybrid = match qwen35 {
            true => Some(hybrid_config(&raw, head_dim)?),
            false => None,
        };
        let sparse_moe = match raw.model_type.as_str() {
            "qwen3_moe" => Some(sparse_moe_config(&raw, false)?),
            _ if qwen35 && raw.num_experts.unwrap_or(0) > 0 => Some(sparse_moe_config(&raw, true)?),
            _ => None,
        };
        let intermediate_size = match (raw.intermediate_size, &sparse_moe) {
            (Some(i), _) => i,
            // Every layer sparse: no dense MLP needs the width.
            (None, Some(m)) if m.sparse.iter().all(|&s| s) => 0,
            _ => bail!("intermediate_size is missing"),
        };
        // Qwen 3.5 nests its rope settings in `rope_parameters`.
        let qwen35_rope = raw.rope_parameters.as_ref().filter(|_| qwen35);
        let rope_theta = qwen35_rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(|v| v.as_f64())
            .map(|v| v as f32)
            .or(raw.rope_theta);
        let rope_scaling = match qwen35_rope {
            Some(r) => parse_rope_scaling(Some(r))?,
            None => parse_rope_scaling(raw.rope_scaling.as_ref())?,
        };
        Ok(Self {
            family,
            model_type: raw.model_type,
            hidden_size: raw.hidden_size,
            intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads: raw.num_key_value_heads.unwrap_or(raw.num_attention_heads),
            head_dim,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw
                .rms_norm_eps
                .unwrap_or(if gemma || qwen35 { 1e-6 } else { 1e-5 }),
            rope_theta: rope_theta.unwrap_or(match () {
                _ if gemma => 1_000_000.0,
                _ if qwen35 => 100_000.0,
                _ => 10_000.0,
            }),
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
            quantization,
            quantization_overrides,
            gemma4,
            sparse_moe,
            hybrid,
        })
    }

    /// Gemma 3 uses sliding-window attention except on every
    /// `sliding_window_pattern`-th layer; Gemma 4 lists each layer's kind.
    pub fn layer_window(&self, layer: i32) -> Option<i32> {
        let window = self.sliding_window?;
        let global = match &self.gemma4 {
            Some(g) => g.full_attention[layer as usize],
            None => (layer + 1) % self.sliding_window_pattern == 0,
        };
        (!global).then_some(window)
    }

    /// Layer `layer`'s attention and MLP geometry.
    pub fn layer(&self, layer: i32) -> LayerSpec {
        let window = self.layer_window(layer);
        let Some(g) = &self.gemma4 else {
            let (rope_base, rope_scaling) = if window.is_some() {
                (self.rope_local_theta, RopeScaling::None)
            } else {
                (self.rope_theta, self.rope_scaling.clone())
            };
            let hybrid = self.hybrid.as_ref();
            return LayerSpec {
                window,
                head_dim: self.head_dim,
                kv_heads: self.num_kv_heads,
                rope_base,
                rope_scaling,
                k_eq_v: false,
                kv_source: None,
                intermediate: self.intermediate_size,
                rotary_dims: hybrid.map_or(self.head_dim, |h| h.rotary_dims),
                linear: hybrid.is_some_and(|h| !h.full_attention[layer as usize]),
                gated_attention: hybrid.is_some(),
                sparse_moe: self
                    .sparse_moe
                    .as_ref()
                    .is_some_and(|m| m.sparse[layer as usize]),
            };
        };
        let i = layer as usize;
        let full = g.full_attention[i];
        let k_eq_v = g.attention_k_eq_v && full;
        let first_shared = (self.num_layers - g.num_kv_shared_layers) as usize;
        let kv_source = (g.num_kv_shared_layers > 0 && i >= first_shared).then(|| {
            (0..first_shared)
                .rev()
                .find(|&j| g.full_attention[j] == full)
                .expect("checked when the config was read")
        });
        let (rope_base, rope_scaling) = if full {
            g.rope_full.clone()
        } else {
            g.rope_sliding.clone()
        };
        LayerSpec {
            window,
            head_dim: if full {
                g.global_head_dim
            } else {
                self.head_dim
            },
            kv_heads: match g.global_kv_heads {
                Some(n) if k_eq_v => n,
                _ => self.num_kv_heads,
            },
            rope_base,
            rope_scaling,
            k_eq_v,
            kv_source,
            intermediate: self.intermediate_size
                * if g.double_wide_mlp && kv_source.is_some() {
                    2
                } else {
                    1
                },
            rotary_dims: if full {
                g.global_head_dim
            } else {
                self.head_dim
            },
            linear: false,
            gated_attention: false,
            sparse_moe: false,
        }
    }

    pub fn has_qk_norm(&self) -> bool {
        matches!(self.family, Family::Qwen3 | Family::Gemma3 | Family::Gemma4)
    }

    /// Softmax scale of attention scores.
    pub fn attention_scale(&self, head_dim: i32) -> f32 {
        if self.family == Family::Gemma4 {
            // q and k are RMS-normed instead.
            return 1.0;
        }
        self.query_pre_attn_scalar
            .unwrap_or(head_dim as f32)
            .powf(-0.5)
    }

    /// The quantization of the layer whose weights are `{prefix}.*`.
    pub fn quant_for(&self, prefix: &str) -> Option<Quantization> {
        self.quantization_overrides
            .get(prefix)
            .copied()
            .unwrap_or(self.quantization)
    }

    /// How layer `layer` stores its keys and values under `model.kv_cache`
    /// = `kv`: quantized in full-attention layers that compute their own;
    /// sliding-window layers keep the activations' dtype (they hold at most
    /// a window, and mlx-lm quantizes none of them either).
    pub fn kv_quant_for(&self, layer: i32, kv: Option<KvQuant>) -> Option<KvQuant> {
        let spec = self.layer(layer);
        kv.filter(|_| spec.window.is_none() && spec.kv_source.is_none())
    }

    /// Bytes of K+V per token across all layers at the given element size,
    /// with `model.kv_cache` = `kv`: layers that read another layer's keys
    /// and values hold none, nor do linear-attention layers (their state
    /// does not grow with length).
    pub fn kv_bytes_per_token(&self, elem_bytes: usize, kv: Option<KvQuant>) -> usize {
        (0..self.num_layers)
            .filter(|&i| self.layer(i).kv_source.is_none() && !self.layer(i).linear)
            .map(|i| {
                let l = self.layer(i);
                let per_head = match self.kv_quant_for(i, kv) {
                    Some(q) => q.bytes_per_head(l.head_dim as usize, elem_bytes),
                    None => l.head_dim as usize * elem_bytes,
                };
                2 * l.kv_heads as usize * per_head
            })
            .sum()
    }

    /// Bytes of one sequence's recurrent state across the linear-attention
    /// layers: the convolution inputs at the given element size, the
    /// delta-rule state in float32. Constant in the sequence's length.
    pub fn state_bytes_per_sequence(&self, elem_bytes: usize) -> usize {
        let Some(h) = &self.hybrid else { return 0 };
        let (conv, ssm) = h.state_elements();
        let linear = h.full_attention.iter().filter(|&&f| !f).count();
        linear * (conv * elem_bytes + ssm * 4)
    }
}

/// Qwen 3.5's layer kinds (`layer_types`, else every
/// `full_attention_interval`-th layer full) and Gated DeltaNet geometry.
fn hybrid_config(raw: &Raw, head_dim: i32) -> anyhow::Result<HybridConfig> {
    let n = raw.num_hidden_layers as usize;
    let interval = raw.full_attention_interval.unwrap_or(4).max(1) as usize;
    let full_attention: Vec<bool> = match &raw.layer_types {
        Some(types) => {
            if types.len() != n {
                bail!(
                    "layer_types lists {} layers, num_hidden_layers is {n}",
                    types.len()
                );
            }
            types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "full_attention" => Ok(true),
                    "linear_attention" => Ok(false),
                    other => bail!(
                        "unsupported layer type `{other}` of layer {i} in layer_types (supported: linear_attention, full_attention)"
                    ),
                })
                .collect::<anyhow::Result<_>>()?
        }
        None => (0..n).map(|i| (i + 1) % interval == 0).collect(),
    };
    let need =
        |v: Option<i32>, name: &str| v.with_context(|| format!("a Qwen 3.5 config needs {name}"));
    let key_heads = need(raw.linear_num_key_heads, "linear_num_key_heads")?;
    let value_heads = need(raw.linear_num_value_heads, "linear_num_value_heads")?;
    if key_heads <= 0 || value_heads % key_heads != 0 {
        bail!("linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads {key_heads}");
    }
    let partial = raw
        .rope_parameters
        .as_ref()
        .and_then(|r| r.get("partial_rotary_factor"))
        .and_then(|v| v.as_f64())
        .unwrap_or(0.25);
    Ok(HybridConfig {
        full_attention,
        key_heads,
        value_heads,
        key_head_dim: need(raw.linear_key_head_dim, "linear_key_head_dim")?,
        value_head_dim: need(raw.linear_value_head_dim, "linear_value_head_dim")?,
        conv_kernel: raw.linear_conv_kernel_dim.unwrap_or(4),
        rotary_dims: (head_dim as f64 * partial) as i32,
        mtp_layers: raw.mtp_num_hidden_layers.unwrap_or(0).max(0),
    })
}

/// Which layers of a Qwen MoE are sparse, and their experts' geometry.
/// Qwen 3.5 (`qwen35`) has experts, with a shared one, on every layer.
fn sparse_moe_config(raw: &Raw, qwen35: bool) -> anyhow::Result<SparseMoeConfig> {
    let shared_expert = qwen35;
    let need =
        |v: Option<i32>, name: &str| v.with_context(|| format!("a Qwen MoE config needs {name}"));
    let num_experts = need(raw.num_experts, "num_experts")?;
    let step = raw.decoder_sparse_step.unwrap_or(1).max(1);
    let dense_only = raw.mlp_only_layers.clone().unwrap_or_default();
    let sparse = (0..raw.num_hidden_layers)
        .map(|i| qwen35 || (!dense_only.contains(&i) && num_experts > 0 && (i + 1) % step == 0))
        .collect();
    Ok(SparseMoeConfig {
        num_experts,
        top_k: need(raw.num_experts_per_tok, "num_experts_per_tok")?,
        intermediate: need(raw.moe_intermediate_size, "moe_intermediate_size")?,
        // qwen3_moe's norm_topk_prob has no default in mlx-lm; Qwen 3.5's
        // defaults to true.
        norm_topk_prob: raw.norm_topk_prob.unwrap_or(shared_expert),
        shared_intermediate: match shared_expert {
            true => Some(need(
                raw.shared_expert_intermediate_size,
                "shared_expert_intermediate_size",
            )?),
            false => None,
        },
        sparse,
    })
}

/// `Some(value)` for a key that is present, even as `null`.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

fn gemma4_config(raw: &Raw) -> anyhow::Result<Gemma4Config> {
    let n = raw.num_hidden_layers as usize;
    let full_attention: Vec<bool> = match &raw.layer_types {
        Some(types) => {
            if types.len() != n {
                bail!(
                    "layer_types lists {} layers, num_hidden_layers is {n}",
                    types.len()
                );
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(true),
                    "sliding_attention" => Ok(false),
                    other => bail!("unsupported layer type `{other}` in layer_types"),
                })
                .collect::<anyhow::Result<_>>()?
        }
        None => {
            let pattern = raw.sliding_window_pattern.unwrap_or(6);
            (0..n).map(|i| (i + 1) % pattern as usize == 0).collect()
        }
    };
    let shared = raw.num_kv_shared_layers.unwrap_or(0);
    if shared < 0 || shared >= raw.num_hidden_layers {
        bail!("num_kv_shared_layers {shared} leaves no layer computing keys and values");
    }
    let first_shared = n - shared as usize;
    for kind in [true, false] {
        let used = full_attention[first_shared..].contains(&kind);
        if used && !full_attention[..first_shared].contains(&kind) {
            bail!("KV-shared layers of a kind no earlier layer computes keys and values for");
        }
    }
    let moe = match raw.enable_moe_block.unwrap_or(false) {
        false => None,
        true => {
            let need = |v: Option<i32>, name: &str| {
                v.with_context(|| format!("enable_moe_block is set but {name} is missing"))
            };
            Some(MoeConfig {
                num_experts: need(raw.num_experts, "num_experts")?,
                top_k: need(raw.top_k_experts, "top_k_experts")?,
                intermediate: need(raw.moe_intermediate_size, "moe_intermediate_size")?,
            })
        }
    };
    let per_layer_width = raw
        .hidden_size_per_layer_input
        .unwrap_or(Some(256))
        .unwrap_or(0);
    Ok(Gemma4Config {
        full_attention,
        global_head_dim: raw.global_head_dim.unwrap_or(512),
        global_kv_heads: raw.num_global_key_value_heads,
        attention_k_eq_v: raw.attention_k_eq_v.unwrap_or(false),
        num_kv_shared_layers: shared,
        per_layer_input: (per_layer_width > 0).then(|| {
            (
                per_layer_width,
                raw.vocab_size_per_layer_input.unwrap_or(raw.vocab_size),
            )
        }),
        double_wide_mlp: raw.use_double_wide_mlp.unwrap_or(false),
        final_logit_softcapping: raw.final_logit_softcapping,
        moe,
        rope_full: gemma4_rope(raw.rope_parameters.as_ref(), true)?,
        rope_sliding: gemma4_rope(raw.rope_parameters.as_ref(), false)?,
    })
}

/// A Gemma 4 layer kind's rope base and scaling from `rope_parameters`
/// (keyed by `full_attention` / `sliding_attention`), with the family's
/// defaults for a kind it leaves out. Drafters bound to a Gemma 4 target
/// read theirs the same way to check they rotate as the target does.
pub fn gemma4_rope(
    rope_parameters: Option<&serde_json::Value>,
    full: bool,
) -> anyhow::Result<(f32, RopeScaling)> {
    let (kind, default_base, default) = match full {
        true => (
            "full_attention",
            1_000_000.0,
            RopeScaling::Proportional {
                rotated_fraction: 0.25,
                factor: 1.0,
            },
        ),
        false => ("sliding_attention", 10_000.0, RopeScaling::None),
    };
    let Some(p) = rope_parameters.and_then(|r| r.get(kind)) else {
        return Ok((default_base, default));
    };
    let base = p
        .get("rope_theta")
        .and_then(|v| v.as_f64())
        .map_or(default_base, |v| v as f32);
    Ok((base, parse_rope_scaling(Some(p))?))
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
        "proportional" => RopeScaling::Proportional {
            rotated_fraction: num("partial_rotary_factor", 1.0),
            factor: num("factor", 1.0),
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor", 1.0),
            low_freq_factor: num("low_freq_factor", 1.0),
            high_freq_factor: num("high_freq_factor", 4.0),
            original_max_position_embeddings: num("original_max_position_embeddings", 8192.0),
        },
        other => bail!(
            "unsupported rope_scaling type `{other}` (supported: linear, llama3, proportional)"
        ),
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

    #[test]
    fn formats_by_family() {
        assert_eq!(Family::Qwen3.tool_format(), ToolFormat::Hermes);
        assert_eq!(Family::Llama.tool_format(), ToolFormat::Llama3Json);
        assert_eq!(Family::Gemma3.tool_format(), ToolFormat::Gemma);
        assert_eq!(Family::Qwen3.reasoning_format(), ReasoningFormat::Think);
        assert_eq!(
            Family::Gemma3.reasoning_format(),
            ReasoningFormat::GemmaChannel
        );
        assert_eq!(Family::Llama.reasoning_format(), ReasoningFormat::None);
    }
}
