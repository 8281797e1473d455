//! Writes small random-weight models in exactly the Hugging Face layout
//! (`config.json`, `generation_config.json`, `model.safetensors`, and a real
//! trained tokenizer from `text::tiny`), optionally MLX group-quantized.
//! Tests, benchmarks and the default config run on these.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, Context};
use mlx_rs::{ops, random, Array, Dtype};
use serde_json::json;

use crate::config::Family;
use crate::tiny_gemma4::{self, Gemma4Shape};

#[derive(Debug, Clone)]
pub struct TinySpec {
    pub family: Family,
    pub hidden: i32,
    pub layers: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub intermediate: i32,
    pub vocab: i32,
    pub dtype: Dtype,
    /// MLX affine quantization of every linear and embedding (4 or 8 bits).
    pub quant_bits: Option<i32>,
    pub group_size: i32,
    /// Gemma 3 only: sliding-window size and how often a global layer comes.
    pub sliding_window: i32,
    pub sliding_window_pattern: i32,
    /// `max_position_embeddings`: the context window servers enforce.
    pub context: i32,
    pub seed: u64,
    /// Gemma 4 only: which of the family's features the model has.
    pub gemma4: Option<Gemma4Shape>,
}

impl TinySpec {
    /// A few hundred thousand parameters: fast enough for every test.
    pub fn tiny(family: Family) -> Self {
        Self {
            family,
            hidden: 64,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            intermediate: 128,
            vocab: 512,
            dtype: Dtype::Float32,
            quant_bits: None,
            group_size: 32,
            sliding_window: 24,
            sliding_window_pattern: 2,
            context: 32768,
            seed: 0,
            gemma4: (family == Family::Gemma4).then(|| Gemma4Shape::moe_26b(4)),
        }
    }

    /// About 100M parameters in the shape of a small Qwen3: the benchmark
    /// model on a CPU.
    pub fn bench(family: Family) -> Self {
        Self {
            family,
            hidden: 768,
            layers: 12,
            heads: 12,
            kv_heads: 4,
            head_dim: 64,
            intermediate: 3072,
            vocab: 4096,
            dtype: Dtype::Float32,
            quant_bits: None,
            group_size: 64,
            sliding_window: 512,
            sliding_window_pattern: 6,
            context: 32768,
            seed: 0,
            gemma4: (family == Family::Gemma4).then(|| Gemma4Shape::moe_26b(12)),
        }
    }

    /// The shape of Qwen3-4B (36 layers, 2560 hidden, GQA 32/8, head 128)
    /// in bf16: a real-size model for the GPU.
    pub fn qwen3_4b() -> Self {
        Self {
            family: Family::Qwen3,
            hidden: 2560,
            layers: 36,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 9728,
            vocab: 151_936,
            dtype: Dtype::Bfloat16,
            quant_bits: None,
            group_size: 64,
            sliding_window: 512,
            sliding_window_pattern: 6,
            context: 32768,
            seed: 0,
            gemma4: None,
        }
    }

    /// A tiny Gemma 4 of the given shape.
    pub fn gemma4(shape: Gemma4Shape) -> Self {
        Self {
            layers: shape.full_attention.len() as i32,
            gemma4: Some(shape),
            ..Self::tiny(Family::Gemma4)
        }
    }

    pub fn parameters(&self) -> i64 {
        let (h, i, v) = (
            self.hidden as i64,
            self.intermediate as i64,
            self.vocab as i64,
        );
        let q = (self.heads * self.head_dim) as i64;
        let kv = (self.kv_heads * self.head_dim) as i64;
        let per_layer = h * q * 2 + h * kv * 2 + 3 * h * i;
        self.layers as i64 * per_layer + v * h
    }
}

/// A deterministic pseudo-random prompt of `len` ids below `vocab`, for
/// tests and benchmarks on generated models.
pub fn random_prompt(seed: u64, len: usize, vocab: u32) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

/// Writes the model into `dir` (created if needed).
pub fn write_model(dir: &Path, spec: &TinySpec) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tok = text::tiny::write_tokenizer(dir, spec.family.tokenizer(), spec.vocab as usize)?;
    anyhow::ensure!(
        tok.vocab_size as i32 == spec.vocab,
        "tokenizer has {} ids, wanted {}",
        tok.vocab_size,
        spec.vocab
    );

    let weights = random_weights(spec)?;
    let weights = match &spec.gemma4 {
        Some(g) => tiny_gemma4::apply_layout(g, spec.layers, weights)?,
        None => weights,
    };
    let weights = match spec.quant_bits {
        Some(bits) => quantize(weights, spec.group_size, bits)?,
        None => weights,
    };
    let mut metadata = HashMap::new();
    metadata.insert("format".to_string(), "mlx".to_string());
    Array::save_safetensors(
        weights.iter().map(|(n, a)| (n, a)),
        &metadata,
        dir.join("model.safetensors"),
    )
    .map_err(|e| anyhow!("writing model.safetensors: {e}"))?;

    let eos: serde_json::Value = if tok.eos_token_ids.len() == 1 {
        json!(tok.eos_token_ids[0])
    } else {
        json!(tok.eos_token_ids)
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config_json(spec, &tok, &eos))?,
    )?;
    let mut generation = json!({ "eos_token_id": eos, "do_sample": false });
    if let Some(bos) = tok.bos_token_id {
        generation["bos_token_id"] = json!(bos);
    }
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_string_pretty(&generation)?,
    )?;
    Ok(())
}

fn config_json(
    spec: &TinySpec,
    tok: &text::tiny::TinyTokenizerInfo,
    eos: &serde_json::Value,
) -> serde_json::Value {
    let dtype = match spec.dtype {
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Float16 => "float16",
        _ => "float32",
    };
    let mut c = json!({
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.context,
        "tie_word_embeddings": true,
        "torch_dtype": dtype,
        "eos_token_id": eos,
    });
    if let Some(bos) = tok.bos_token_id {
        c["bos_token_id"] = json!(bos);
    }
    let extra = match spec.family {
        Family::Llama => json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_bias": false, "mlp_bias": false,
            "hidden_act": "silu",
            "rope_scaling": { "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192 },
        }),
        Family::Qwen2 => json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        }),
        Family::Qwen3 => json!({
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": false, "hidden_act": "silu",
        }),
        Family::Gemma3 => json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": spec.head_dim, "sliding_window": spec.sliding_window,
            "sliding_window_pattern": spec.sliding_window_pattern,
            "hidden_activation": "gelu_pytorch_tanh", "rope_scaling": null,
        }),
        Family::Gemma4 => {
            let g = spec
                .gemma4
                .as_ref()
                .expect("a Gemma 4 spec has a Gemma 4 shape");
            tiny_gemma4::text_config(spec, g)
        }
    };
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    if spec.family == Family::Qwen2 {
        // Qwen2 derives head_dim from hidden / heads.
        c.as_object_mut().unwrap().remove("head_dim");
    }
    if let Some(bits) = spec.quant_bits {
        c["quantization"] = json!({ "group_size": spec.group_size, "bits": bits });
        if let Some(g) = &spec.gemma4 {
            // mlx-lm records layers quantized differently by their module path.
            let prefix = match tiny_gemma4::nested(g) {
                true => "language_model.model",
                false => "model",
            };
            for l in 0..spec.layers {
                if g.moe.is_some() {
                    let (gs, b) = tiny_gemma4::quant_override("router.proj.weight").unwrap();
                    c["quantization"][format!("{prefix}.layers.{l}.router.proj")] =
                        json!({ "group_size": gs, "bits": b });
                }
            }
        }
    }
    if let Some(g) = &spec.gemma4 {
        if tiny_gemma4::nested(g) {
            let mut text = c.clone();
            for k in ["architectures", "torch_dtype", "quantization"] {
                text.as_object_mut().unwrap().remove(k);
            }
            let mut outer = json!({
                "architectures": ["Gemma4ForConditionalGeneration"],
                "model_type": "gemma4",
                "text_config": text,
                "vocab_size": spec.vocab,
                "torch_dtype": c["torch_dtype"],
                "eos_token_id": c["eos_token_id"],
                "tie_word_embeddings": true,
                // The towers the text model is served without.
                "vision_config": { "model_type": "gemma4_vision" },
            });
            if let Some(q) = c.get("quantization") {
                outer["quantization"] = q.clone();
            }
            return outer;
        }
        c["architectures"] = json!(["Gemma4ForCausalLM"]);
    }
    c
}

fn random_weights(spec: &TinySpec) -> anyhow::Result<Vec<(String, Array)>> {
    let mut key = random::key(spec.seed)?;
    let mut out = Vec::new();
    let mut add = |name: String, shape: &[i32], std: f32, mean: f32| -> anyhow::Result<()> {
        let (next, k) = random::split(&key, 2)?;
        key = next;
        let w = random::normal::<f32>(shape, mean, std, &k)?.as_dtype(spec.dtype)?;
        out.push((name, w));
        Ok(())
    };
    if let Some(g) = &spec.gemma4 {
        for (name, shape, std, mean) in tiny_gemma4::tensors(spec, g) {
            add(name, &shape, std, mean)?;
        }
        return Ok(out);
    }
    let (h, i) = (spec.hidden, spec.intermediate);
    let q = spec.heads * spec.head_dim;
    let kv = spec.kv_heads * spec.head_dim;
    let gemma = spec.family == Family::Gemma3;
    // Gemma stores norm weights as offsets from 1.
    let norm_mean = if gemma { 0.0 } else { 1.0 };
    let lin = |fan_in: i32| (fan_in as f32).powf(-0.5);
    add(
        "model.embed_tokens.weight".into(),
        &[spec.vocab, h],
        1.0,
        0.0,
    )?;
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.self_attn.q_proj.weight"), &[q, h], lin(h), 0.0)?;
        add(
            format!("{p}.self_attn.k_proj.weight"),
            &[kv, h],
            lin(h),
            0.0,
        )?;
        add(
            format!("{p}.self_attn.v_proj.weight"),
            &[kv, h],
            lin(h),
            0.0,
        )?;
        add(format!("{p}.self_attn.o_proj.weight"), &[h, q], lin(q), 0.0)?;
        if spec.family == Family::Qwen2 {
            add(format!("{p}.self_attn.q_proj.bias"), &[q], 0.1, 0.0)?;
            add(format!("{p}.self_attn.k_proj.bias"), &[kv], 0.1, 0.0)?;
            add(format!("{p}.self_attn.v_proj.bias"), &[kv], 0.1, 0.0)?;
        }
        if matches!(spec.family, Family::Qwen3 | Family::Gemma3) {
            add(
                format!("{p}.self_attn.q_norm.weight"),
                &[spec.head_dim],
                0.1,
                norm_mean,
            )?;
            add(
                format!("{p}.self_attn.k_norm.weight"),
                &[spec.head_dim],
                0.1,
                norm_mean,
            )?;
        }
        add(format!("{p}.mlp.gate_proj.weight"), &[i, h], lin(h), 0.0)?;
        add(format!("{p}.mlp.up_proj.weight"), &[i, h], lin(h), 0.0)?;
        add(format!("{p}.mlp.down_proj.weight"), &[h, i], lin(i), 0.0)?;
        add(format!("{p}.input_layernorm.weight"), &[h], 0.1, norm_mean)?;
        add(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            0.1,
            norm_mean,
        )?;
        if gemma {
            add(
                format!("{p}.pre_feedforward_layernorm.weight"),
                &[h],
                0.1,
                norm_mean,
            )?;
            add(
                format!("{p}.post_feedforward_layernorm.weight"),
                &[h],
                0.1,
                norm_mean,
            )?;
        }
    }
    add("model.norm.weight".into(), &[h], 0.1, norm_mean)?;
    Ok(out)
}

/// MLX's layout for a quantized layer: `weight` (packed uint32), `scales`,
/// `biases`. Norms and biases stay in floating point.
fn quantize(
    weights: Vec<(String, Array)>,
    group_size: i32,
    bits: i32,
) -> anyhow::Result<Vec<(String, Array)>> {
    let mut out = Vec::new();
    for (name, w) in weights {
        // mlx-lm quantizes every linear and embedding layer (2-D weights;
        // 3-D for stacked experts) whose inputs split into groups.
        let (group_size, bits) = tiny_gemma4::quant_override(&name).unwrap_or((group_size, bits));
        let quantizable = name.ends_with(".weight") && w.ndim() >= 2;
        if quantizable && w.dim(-1) % group_size == 0 {
            let (q, scales, biases) = ops::quantize(&w, group_size, bits)?;
            let base = name.trim_end_matches(".weight");
            out.push((format!("{base}.scales"), scales));
            out.push((format!("{base}.biases"), biases));
            out.push((name, q));
        } else {
            out.push((name, w));
        }
    }
    Ok(out)
}

/// Named random tensors written as one safetensors file: the drafter
/// checkpoints tests generate beside a tiny target.
pub struct RandomTensors {
    key: Array,
    dtype: Dtype,
    tensors: Vec<(String, Array)>,
}

impl RandomTensors {
    pub fn new(seed: u64, dtype: Dtype) -> anyhow::Result<Self> {
        Ok(Self {
            key: random::key(seed)?,
            dtype,
            tensors: Vec::new(),
        })
    }

    /// Normal(`mean`, `std`) values.
    pub fn normal(
        &mut self,
        name: impl Into<String>,
        shape: &[i32],
        std: f32,
        mean: f32,
    ) -> anyhow::Result<()> {
        let (next, k) = random::split(&self.key, 2)?;
        self.key = next;
        let w = random::normal::<f32>(shape, mean, std, &k)?.as_dtype(self.dtype)?;
        self.tensors.push((name.into(), w));
        Ok(())
    }

    pub fn save(self, path: &Path) -> anyhow::Result<()> {
        let mut metadata = HashMap::new();
        metadata.insert("format".to_string(), "pt".to_string());
        Array::save_safetensors(self.tensors.iter().map(|(n, a)| (n, a)), &metadata, path)
            .map_err(|e| anyhow!("writing {}: {e}", path.display()))
    }
}

/// The dtype a model directory's config declares (`torch_dtype`), float32
/// when it names none.
pub fn declared_dtype(dir: &Path) -> Dtype {
    let dtype = std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("torch_dtype")?.as_str().map(str::to_string));
    match dtype.as_deref() {
        Some("bfloat16") => Dtype::Bfloat16,
        Some("float16") => Dtype::Float16,
        _ => Dtype::Float32,
    }
}

/// The config name of a dtype (`torch_dtype`).
pub fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Float16 => "float16",
        _ => "float32",
    }
}
