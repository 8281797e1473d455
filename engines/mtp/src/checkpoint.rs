//! An assistant drafter's `config.json`, checked against its target.

use std::path::Path;

use anyhow::{ensure, Context};
use runtime::ModelConfig;
use serde::Deserialize;

pub const ARCHITECTURE: &str = "Gemma4AssistantForCausalLM";

#[derive(Debug, Clone)]
pub struct AssistantConfig {
    pub backbone_hidden_size: i32,
    pub hidden_size: i32,
    pub num_heads: i32,
    /// Head size of sliding layers, and of full ones without
    /// `global_head_dim`.
    pub head_dim: i32,
    pub global_head_dim: Option<i32>,
    pub rms_norm_eps: f32,
    /// `sliding_attention` or not, per layer.
    pub sliding: Vec<bool>,
    /// The window of its sliding layers, when declared.
    pub sliding_window: Option<i32>,
    pub vocab_size: i32,
    /// The centroid-masked output head, when `use_ordered_embeddings`.
    pub ordered_embeddings: Option<OrderedEmbeddings>,
    pub quantization: Option<runtime::config::Quantization>,
}

/// The masked head's clusters: `vocab_size / num_centroids` tokens each,
/// of which the `top_k` best-scoring clusters' are scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrderedEmbeddings {
    pub num_centroids: i32,
    pub top_k: i32,
}

#[derive(Deserialize)]
struct Raw {
    backbone_hidden_size: i32,
    #[serde(default)]
    use_ordered_embeddings: bool,
    // The reference's defaults (mlx-vlm's Gemma4AssistantConfig).
    #[serde(default = "default_num_centroids")]
    num_centroids: i32,
    #[serde(default = "default_top_k")]
    centroid_intermediate_top_k: i32,
    text_config: RawText,
    quantization: Option<runtime::config::Quantization>,
}

fn default_num_centroids() -> i32 {
    2048
}

fn default_top_k() -> i32 {
    32
}

#[derive(Deserialize)]
struct RawText {
    hidden_size: i32,
    num_hidden_layers: i32,
    num_attention_heads: i32,
    head_dim: i32,
    global_head_dim: Option<i32>,
    vocab_size: i32,
    rms_norm_eps: Option<f32>,
    #[serde(default)]
    layer_types: Vec<String>,
    sliding_window: Option<i32>,
    rope_parameters: Option<serde_json::Value>,
}

impl AssistantConfig {
    /// Head size of a sliding or full layer.
    pub fn layer_head_dim(&self, sliding: bool) -> i32 {
        match (sliding, self.global_head_dim) {
            (false, Some(g)) => g,
            _ => self.head_dim,
        }
    }

    pub fn load(dir: &Path, target: &ModelConfig) -> anyhow::Result<Self> {
        let value = speculative::checkpoint::read_config(
            dir,
            ARCHITECTURE,
            "Gemma-4-style assistant drafter",
        )?;
        let raw: Raw = serde_json::from_value(value)
            .with_context(|| format!("drafter checkpoint {}: config.json", dir.display()))?;
        Self::check(raw, target).with_context(|| format!("drafter checkpoint {}", dir.display()))
    }

    fn check(raw: Raw, target: &ModelConfig) -> anyhow::Result<Self> {
        let t = raw.text_config;
        ensure!(
            t.vocab_size == target.vocab_size,
            "the drafter's vocabulary ({}) differs from the target's ({}): it was trained for another model",
            t.vocab_size,
            target.vocab_size
        );
        ensure!(
            raw.backbone_hidden_size == target.hidden_size,
            "the drafter's backbone_hidden_size ({}) differs from the target's hidden size ({})",
            raw.backbone_hidden_size,
            target.hidden_size
        );
        let ordered_embeddings = if raw.use_ordered_embeddings {
            let (c, k) = (raw.num_centroids, raw.centroid_intermediate_top_k);
            ensure!(
                c > 0 && t.vocab_size % c == 0,
                "num_centroids ({c}) must divide text_config.vocab_size ({}) into equal clusters",
                t.vocab_size
            );
            ensure!(
                (1..=c).contains(&k),
                "centroid_intermediate_top_k ({k}) must be between 1 and num_centroids ({c})"
            );
            Some(OrderedEmbeddings {
                num_centroids: c,
                top_k: k,
            })
        } else {
            None
        };
        let sliding = speculative::checkpoint::sliding_layers(&t.layer_types, t.num_hidden_layers)?;
        // Drafts rotate with the target layer's rope (they attend into its
        // keys), so a drafter declaring another rope is refused.
        if let (Some(g), Some(declared)) = (&target.gemma4, t.rope_parameters.as_ref()) {
            for (full, kind, theirs) in [
                (true, "full_attention", &g.rope_full),
                (false, "sliding_attention", &g.rope_sliding),
            ] {
                let ours = runtime::config::gemma4_rope(Some(declared), full)
                    .context("text_config.rope_parameters")?;
                ensure!(
                    &ours == theirs,
                    "text_config.rope_parameters.{kind} ({ours:?}) differs from the target's ({theirs:?}): the drafter attends into the target's keys with the target's rope"
                );
            }
        }
        Ok(Self {
            backbone_hidden_size: raw.backbone_hidden_size,
            hidden_size: t.hidden_size,
            num_heads: t.num_attention_heads,
            head_dim: t.head_dim,
            global_head_dim: t.global_head_dim,
            rms_norm_eps: t.rms_norm_eps.unwrap_or(1e-6),
            sliding,
            sliding_window: t.sliding_window,
            vocab_size: t.vocab_size,
            ordered_embeddings,
            quantization: raw.quantization,
        })
    }
}
