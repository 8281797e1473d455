//! Gemma 4 shapes for generated checkpoints: which of the family's features
//! a tiny model has, its tensors under Hugging Face's names, and the two
//! published layouts (Hugging Face, text-only or multimodal, and
//! mlx-community's MLX conversions).

use mlx_rs::Array;
use serde_json::json;

use crate::tiny::TinySpec;

/// How the checkpoint names and stores its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `Gemma4ForCausalLM`: `model.layers.*`, experts as `gate_up_proj` and
    /// `down_proj` tensors.
    HfText,
    /// `Gemma4ForConditionalGeneration`: `model.language_model.*` under a
    /// `gemma4` config with a `text_config`.
    HfMultimodal,
    /// mlx-community conversions: `language_model.model.*`, experts split
    /// into `switch_glu.{gate,up,down}_proj`, the projections of KV-shared
    /// layers dropped, optionally quantized (routers at 8 bits).
    Mlx,
}

#[derive(Debug, Clone)]
pub struct Gemma4Shape {
    /// Per layer: full attention (else sliding).
    pub full_attention: Vec<bool>,
    pub global_head_dim: i32,
    pub global_kv_heads: Option<i32>,
    pub k_eq_v: bool,
    pub kv_shared_layers: i32,
    /// Width of the per-layer input embeddings.
    pub per_layer_input: Option<i32>,
    pub double_wide_mlp: bool,
    pub softcap: Option<f32>,
    /// Experts, experts per token, expert MLP width.
    pub moe: Option<(i32, i32, i32)>,
    pub partial_rotary: f32,
    pub layout: Layout,
}

impl Gemma4Shape {
    /// E2B/E4B-like: per-layer inputs, the last layers sharing keys and
    /// values (with double-wide MLPs), logit softcapping.
    pub fn e2b(layers: i32) -> Self {
        Self {
            full_attention: pattern(layers, 3),
            global_head_dim: 32,
            global_kv_heads: None,
            k_eq_v: false,
            kv_shared_layers: 2,
            per_layer_input: Some(16),
            double_wide_mlp: true,
            softcap: Some(30.0),
            moe: None,
            partial_rotary: 0.25,
            layout: Layout::HfText,
        }
    }

    /// 31B-like dense: full-attention layers with values equal to keys and
    /// their own KV head count, wider global heads.
    pub fn dense_31b(layers: i32) -> Self {
        Self {
            full_attention: pattern(layers, 3),
            global_head_dim: 32,
            global_kv_heads: Some(1),
            k_eq_v: true,
            kv_shared_layers: 0,
            per_layer_input: None,
            double_wide_mlp: false,
            softcap: Some(30.0),
            moe: None,
            partial_rotary: 0.25,
            layout: Layout::HfMultimodal,
        }
    }

    /// 26B-A4B-like: a sparse expert block beside every dense MLP.
    pub fn moe_26b(layers: i32) -> Self {
        Self {
            moe: Some((8, 2, 64)),
            layout: Layout::Mlx,
            ..Self::dense_31b(layers)
        }
    }
}

/// `every - 1` sliding layers, then a full one, the last layer full.
fn pattern(layers: i32, every: i32) -> Vec<bool> {
    (0..layers)
        .map(|i| (i + 1) % every == 0 || i == layers - 1)
        .collect()
}

/// The `config.json` fields of the text model.
pub fn text_config(spec: &TinySpec, g: &Gemma4Shape) -> serde_json::Value {
    let types: Vec<&str> = g
        .full_attention
        .iter()
        .map(|&f| {
            if f {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    let (experts, top_k, moe_inter) = g
        .moe
        .map_or((None, None, None), |(e, k, i)| (Some(e), Some(k), Some(i)));
    json!({
        "model_type": "gemma4_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "sliding_window": spec.sliding_window,
        "layer_types": types,
        "global_head_dim": g.global_head_dim,
        "num_global_key_value_heads": g.global_kv_heads,
        "attention_k_eq_v": g.k_eq_v,
        "num_kv_shared_layers": g.kv_shared_layers,
        "hidden_size_per_layer_input": g.per_layer_input.unwrap_or(0),
        "vocab_size_per_layer_input": spec.vocab,
        "use_double_wide_mlp": g.double_wide_mlp,
        "final_logit_softcapping": g.softcap,
        "enable_moe_block": g.moe.is_some(),
        "num_experts": experts,
        "top_k_experts": top_k,
        "moe_intermediate_size": moe_inter,
        "rope_parameters": {
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": g.partial_rotary,
                "rope_theta": 1_000_000.0,
            },
            "sliding_attention": { "rope_type": "default", "rope_theta": 10_000.0 },
        },
    })
}

/// Whether the config nests the text model (`gemma4` + `text_config`).
pub fn nested(g: &Gemma4Shape) -> bool {
    g.layout != Layout::HfText
}

/// Random tensors under Hugging Face's text-model names (`model.*`), in
/// the order they are drawn.
pub fn tensors(spec: &TinySpec, g: &Gemma4Shape) -> Vec<(String, Vec<i32>, f32, f32)> {
    let h = spec.hidden;
    let n = spec.layers;
    let lin = |fan_in: i32| (fan_in as f32).powf(-0.5);
    let mut out: Vec<(String, Vec<i32>, f32, f32)> = Vec::new();
    let mut add = |name: String, shape: &[i32], std: f32, mean: f32| {
        out.push((name, shape.to_vec(), std, mean))
    };
    add(
        "model.embed_tokens.weight".into(),
        &[spec.vocab, h],
        1.0,
        0.0,
    );
    let first_shared = n - g.kv_shared_layers;
    for l in 0..n {
        let p = format!("model.layers.{l}");
        let full = g.full_attention[l as usize];
        let hd = if full {
            g.global_head_dim
        } else {
            spec.head_dim
        };
        let k_eq_v = g.k_eq_v && full;
        let kvh = match g.global_kv_heads {
            Some(k) if k_eq_v => k,
            _ => spec.kv_heads,
        };
        let (q, kv) = (spec.heads * hd, kvh * hd);
        add(format!("{p}.self_attn.q_proj.weight"), &[q, h], lin(h), 0.0);
        // Hugging Face checkpoints keep these on KV-shared layers too.
        add(
            format!("{p}.self_attn.k_proj.weight"),
            &[kv, h],
            lin(h),
            0.0,
        );
        if !k_eq_v {
            add(
                format!("{p}.self_attn.v_proj.weight"),
                &[kv, h],
                lin(h),
                0.0,
            );
        }
        add(format!("{p}.self_attn.o_proj.weight"), &[h, q], lin(q), 0.0);
        add(format!("{p}.self_attn.q_norm.weight"), &[hd], 0.1, 1.0);
        add(format!("{p}.self_attn.k_norm.weight"), &[hd], 0.1, 1.0);
        let wide = g.double_wide_mlp && l >= first_shared && g.kv_shared_layers > 0;
        let i = spec.intermediate * if wide { 2 } else { 1 };
        add(format!("{p}.mlp.gate_proj.weight"), &[i, h], lin(h), 0.0);
        add(format!("{p}.mlp.up_proj.weight"), &[i, h], lin(h), 0.0);
        add(format!("{p}.mlp.down_proj.weight"), &[h, i], lin(i), 0.0);
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            add(format!("{p}.{norm}.weight"), &[h], 0.1, 1.0);
        }
        if let Some((e, _, mi)) = g.moe {
            add(format!("{p}.router.proj.weight"), &[e, h], lin(h), 0.0);
            add(format!("{p}.router.scale"), &[h], 0.1, 1.0);
            add(format!("{p}.router.per_expert_scale"), &[e], 0.1, 1.0);
            add(
                format!("{p}.experts.gate_up_proj"),
                &[e, 2 * mi, h],
                lin(h),
                0.0,
            );
            add(format!("{p}.experts.down_proj"), &[e, h, mi], lin(mi), 0.0);
            for norm in [
                "post_feedforward_layernorm_1",
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_2",
            ] {
                add(format!("{p}.{norm}.weight"), &[h], 0.1, 1.0);
            }
        }
        if let Some(w) = g.per_layer_input {
            add(
                format!("{p}.per_layer_input_gate.weight"),
                &[w, h],
                lin(h),
                0.0,
            );
            add(
                format!("{p}.per_layer_projection.weight"),
                &[h, w],
                lin(w),
                0.0,
            );
            add(
                format!("{p}.post_per_layer_input_norm.weight"),
                &[h],
                0.1,
                1.0,
            );
        }
        add(format!("{p}.layer_scalar"), &[1], 0.1, 1.0);
    }
    if let Some(w) = g.per_layer_input {
        add(
            "model.embed_tokens_per_layer.weight".into(),
            &[spec.vocab, n * w],
            1.0,
            0.0,
        );
        add(
            "model.per_layer_model_projection.weight".into(),
            &[n * w, h],
            lin(h),
            0.0,
        );
        add(
            "model.per_layer_projection_norm.weight".into(),
            &[w],
            0.1,
            1.0,
        );
    }
    add("model.norm.weight".into(), &[h], 0.1, 1.0);
    out
}

/// Renames (and for MLX, splits and drops) Hugging Face text-model tensors
/// into the checkpoint's layout.
pub fn apply_layout(
    g: &Gemma4Shape,
    layers: i32,
    weights: Vec<(String, Array)>,
) -> anyhow::Result<Vec<(String, Array)>> {
    let first_shared = layers - g.kv_shared_layers;
    let mut out = Vec::new();
    if let Some(name) = vision_tensor(g) {
        out.push((name.to_string(), Array::zeros::<f32>(&[8, 12])?));
    }
    for (name, w) in weights {
        let rest = name.strip_prefix("model.").unwrap_or(&name).to_string();
        match g.layout {
            Layout::HfText => out.push((name, w)),
            Layout::HfMultimodal => out.push((format!("model.language_model.{rest}"), w)),
            Layout::Mlx => {
                let layer: Option<i32> = rest
                    .strip_prefix("layers.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|i| i.parse().ok());
                let shared = layer.is_some_and(|l| l >= first_shared && g.kv_shared_layers > 0);
                let kv_part = [
                    ".self_attn.k_proj",
                    ".self_attn.v_proj",
                    ".self_attn.k_norm",
                ]
                .iter()
                .any(|p| rest.contains(p));
                if shared && kv_part {
                    continue;
                }
                let full = format!("language_model.model.{rest}");
                if let Some(base) = full.strip_suffix(".experts.gate_up_proj") {
                    let halves = mlx_rs::ops::split_equal(&w, 2, 1)?;
                    out.push((
                        format!("{base}.experts.switch_glu.gate_proj.weight"),
                        halves[0].clone(),
                    ));
                    out.push((
                        format!("{base}.experts.switch_glu.up_proj.weight"),
                        halves[1].clone(),
                    ));
                } else if let Some(base) = full.strip_suffix(".experts.down_proj") {
                    out.push((format!("{base}.experts.switch_glu.down_proj.weight"), w));
                } else {
                    out.push((full, w));
                }
            }
        }
    }
    Ok(out)
}

/// A stand-in for the vision tower's tensors of a multimodal checkpoint
/// (never loaded: the text model serves without it), in the layout's
/// naming, `None` for text-only checkpoints.
pub fn vision_tensor(g: &Gemma4Shape) -> Option<&'static str> {
    match g.layout {
        Layout::HfText => None,
        Layout::HfMultimodal => Some("model.vision_tower.patch_embedder.input_proj.weight"),
        Layout::Mlx => Some("vision_tower.patch_embedder.input_proj.weight"),
    }
}

/// mlx-lm's Gemma 4 `quant_predicate`: routers at 8 bits in groups of 64.
pub fn quant_override(name: &str) -> Option<(i32, i32)> {
    name.ends_with("router.proj.weight").then_some((64, 8))
}
