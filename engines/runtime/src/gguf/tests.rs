//! GGUF reading: block formats against ggml's arithmetic, bad files, and
//! generated models written the way llama.cpp's converter writes them
//! (renamed, Llama q/k rows permuted, Gemma norms `+1`) loading to the same
//! logits as their Hugging Face directories.

use std::path::Path;

use half::f16;
use mlx_rs::{ops, Array, Dtype};

use super::blocks::{self, reference_affine, Loaded};
use super::file::{GgufFile, TensorInfo, TensorType};
use crate::config::Family;
use crate::generate::prefill;
use crate::tiny::{write_model, TinySpec};
use crate::LoadedModel;

/// Metadata values a test writes.
pub enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
}

/// A minimal GGUF v3 writer: metadata, then tensors of raw bytes given with
/// their GGUF type id and row-major shape.
pub fn write_gguf(meta: &[(&str, Meta)], tensors: &[(String, u32, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    let string = |out: &mut Vec<u8>, s: &str| {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    };
    out.extend(b"GGUF");
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        string(&mut out, key);
        match value {
            Meta::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::Str(s) => {
                out.extend(8u32.to_le_bytes());
                string(&mut out, s);
            }
            Meta::Strs(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for s in items {
                    string(&mut out, s);
                }
            }
        }
    }
    let mut offset = 0u64;
    for (name, ty, shape, data) in tensors {
        string(&mut out, name);
        out.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            out.extend((*d as u64).to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    out.resize(out.len().div_ceil(32) * 32, 0);
    for (_, _, _, data) in tensors {
        out.extend(data);
        out.resize(out.len().div_ceil(32) * 32, 0);
    }
    out
}

/// Deterministic bytes for block payloads.
fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect()
}

/// Random blocks of `ty` with sane float16 scales (and Q4_1 mins).
fn random_blocks(ty: TensorType, blocks: usize, seed: u64) -> Vec<u8> {
    let (_, size) = ty.block();
    let mut out = noise(seed, blocks * size);
    for (i, block) in out.chunks_exact_mut(size).enumerate() {
        let d = f16::from_f32(0.01 + 0.001 * (i % 7) as f32);
        block[..2].copy_from_slice(&d.to_le_bytes());
        if ty == TensorType::Q4_1 {
            let m = f16::from_f32(-0.05 * (i % 3) as f32);
            block[2..4].copy_from_slice(&m.to_le_bytes());
        }
    }
    out
}

fn info(name: &str, ty: TensorType, shape: Vec<usize>, len: usize) -> TensorInfo {
    TensorInfo {
        name: name.into(),
        shape,
        ty,
        start: 0,
        len,
    }
}

#[test]
fn affine_blocks_load_as_mlx_quantized_without_loss() {
    for (ty, bits) in [(TensorType::Q4_0, 4), (TensorType::Q4_1, 4), (TensorType::Q8_0, 8)] {
        let (rows, cols) = (3, 96);
        let bytes = random_blocks(ty, rows * cols / 32, bits as u64);
        let Loaded::Quantized {
            weight,
            scales,
            biases,
            quantization,
        } = blocks::load(&info("w", ty, vec![rows, cols], bytes.len()), &bytes)
        else {
            panic!("{ty:?} loads quantized");
        };
        assert_eq!((quantization.group_size, quantization.bits), (32, bits));
        assert_eq!(weight.shape(), &[rows as i32, (cols * bits as usize / 32) as i32]);
        let got = ops::dequantize(&weight, &scales, &biases, 32, bits)
            .unwrap()
            .as_dtype(Dtype::Float32)
            .unwrap();
        let got: &[f32] = got.as_slice();
        let (_, size) = ty.block();
        let want: Vec<f32> = bytes
            .chunks_exact(size)
            .flat_map(|b| reference_affine(ty, b))
            .collect();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // MLX computes scale * q + bias in float16: within its rounding.
            assert!((g - w).abs() <= 1e-3 * w.abs().max(1.0) * 2.0, "{ty:?}[{i}]: {g} vs {w}");
        }
    }
}

/// ggml's layout for K-quants, written from the block definitions: every
/// element equals d * scale * q - dmin * min for a hand-built block.
#[test]
fn k_quants_dequantize_by_their_block_layout() {
    // Q4_K: all sub-block scales 2, mins 1 (6-bit packed), nibbles 5 / 9.
    let mut b = vec![0u8; 144];
    b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
    b[2..4].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
    for j in 0..4 {
        b[4 + j] = 2; // scales 0..4
        b[8 + j] = 1; // mins 0..4
        b[12 + j] = 2 | (1 << 4); // scales/mins 4..8, low bits
    }
    for q in &mut b[16..144] {
        *q = 5 | (9 << 4);
    }
    let Loaded::Dense(a) = blocks::load(&info("k", TensorType::Q4K, vec![256], 144), &b) else {
        panic!("dense");
    };
    let a = a.as_dtype(Dtype::Float32).unwrap();
    let v: &[f32] = a.as_slice();
    for chunk in 0..4 {
        assert_eq!(v[chunk * 64], 0.5 * 2.0 * 5.0 - 0.25);
        assert_eq!(v[chunk * 64 + 32], 0.5 * 2.0 * 9.0 - 0.25);
    }
    // Q6_K: scales 3 for every sub-block, every 6-bit value 40 (minus 32 = 8).
    let mut b = vec![0u8; 210];
    for q in &mut b[0..128] {
        *q = 8 | (8 << 4); // low nibbles 8
    }
    for q in &mut b[128..192] {
        *q = 0b10_10_10_10; // high pairs 2: 2 << 4 | 8 = 40
    }
    for s in &mut b[192..208] {
        *s = 3;
    }
    b[208..210].copy_from_slice(&f16::from_f32(0.125).to_le_bytes());
    let Loaded::Dense(a) = blocks::load(&info("k", TensorType::Q6K, vec![256], 210), &b) else {
        panic!("dense");
    };
    let a = a.as_dtype(Dtype::Float32).unwrap();
    assert!(a.as_slice::<f32>().iter().all(|&x| x == 0.125 * 3.0 * 8.0));
}

fn tiny_gguf_meta(arch: &str) -> Vec<(&'static str, Meta)> {
    vec![("general.architecture", Meta::Str(arch.into()))]
}

#[test]
fn bad_files_are_clear_errors() {
    let tensor = ("token_embd.weight".to_string(), 0, vec![4, 8], vec![0u8; 128]);
    let good = write_gguf(&tiny_gguf_meta("llama"), std::slice::from_ref(&tensor));
    assert!(GgufFile::parse(good.clone()).is_ok());
    // Cut anywhere: an error, never a panic.
    for cut in [0, 3, 10, 30, 60, good.len() - 200, good.len() - 1] {
        let err = GgufFile::parse(good[..cut].to_vec()).err().unwrap().to_string();
        assert!(err.contains("truncated") || err.contains("magic"), "cut {cut}: {err}");
    }
    let err = GgufFile::parse(b"PK\x03\x04 not a gguf".to_vec()).err().unwrap().to_string();
    assert!(err.contains("not a GGUF file"), "{err}");
    // A tensor type this runtime does not load is named with its tensor.
    let iq = write_gguf(&tiny_gguf_meta("llama"), &[("blk.0.attn_q.weight".into(), 19, vec![4, 256], vec![0; 200])]);
    let err = GgufFile::parse(iq).err().unwrap().to_string();
    assert!(err.contains("blk.0.attn_q.weight") && err.contains("IQ1_S"), "{err}");
    // An architecture the runtime does not serve fails at load, named.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, write_gguf(&tiny_gguf_meta("mamba"), &[tensor])).unwrap();
    let err = format!("{:#}", LoadedModel::load(&path, None).err().unwrap());
    assert!(err.contains("`mamba`") && err.contains("m.gguf"), "{err}");
}

/// What llama.cpp's converter writes for a Hugging Face tensor name.
fn gguf_name(hf: &str, family: Family) -> String {
    let globals = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = globals.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, part) = rest.split_once('.').unwrap();
    let (stem, suffix) = part.rsplit_once('.').unwrap();
    let gemma = family == Family::Gemma3;
    let g = match stem {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "post_attention_layernorm" if gemma => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{layer}.{g}.{suffix}")
}

/// The converter's RoPE permutation of q/k rows.
fn permute(a: &Array, heads: i32) -> Array {
    let shape = a.shape().to_vec();
    let rows = shape[0];
    let mut split = vec![heads, 2, rows / heads / 2];
    split.extend(&shape[1..]);
    a.reshape(&split).unwrap().swap_axes(1, 2).unwrap().reshape(&shape).unwrap()
}

/// Writes `dir`'s generated model as llama.cpp's converter would (float32),
/// next to its tokenizer.json.
fn convert(dir: &Path, family: Family) -> std::path::PathBuf {
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let arch = family.to_string();
    let u = |k: &str| Meta::U32(config[k].as_u64().unwrap() as u32);
    let f = |k: &str| Meta::F32(config[k].as_f64().unwrap() as f32);
    let key = |k: &str| -> &'static str { Box::leak(format!("{arch}.{k}").into_boxed_str()) };
    let head_dim = config["head_dim"].as_u64().unwrap_or(
        config["hidden_size"].as_u64().unwrap() / config["num_attention_heads"].as_u64().unwrap(),
    ) as u32;
    let mut meta = vec![
        ("general.architecture", Meta::Str(arch.clone())),
        (key("embedding_length"), u("hidden_size")),
        (key("feed_forward_length"), u("intermediate_size")),
        (key("block_count"), u("num_hidden_layers")),
        (key("attention.head_count"), u("num_attention_heads")),
        (key("attention.head_count_kv"), u("num_key_value_heads")),
        (key("attention.key_length"), Meta::U32(head_dim)),
        (key("rope.dimension_count"), Meta::U32(head_dim)),
        (key("context_length"), u("max_position_embeddings")),
        (key("vocab_size"), u("vocab_size")),
        (key("attention.layer_norm_rms_epsilon"), f("rms_norm_eps")),
        (key("rope.freq_base"), f("rope_theta")),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(vec![])),
    ];
    if family == Family::Gemma3 {
        meta.push((key("attention.sliding_window"), u("sliding_window")));
    }
    let eos = &config["eos_token_id"];
    let eos = eos.as_u64().or_else(|| eos[0].as_u64()).unwrap();
    meta.push(("tokenizer.ggml.eos_token_id", Meta::U32(eos as u32)));
    let weights = Array::load_safetensors(dir.join("model.safetensors")).unwrap();
    let mut names: Vec<_> = weights.keys().cloned().collect();
    names.sort();
    let heads = |k: &str| config[k].as_i64().unwrap() as i32;
    let tensors: Vec<_> = names
        .iter()
        .map(|name| {
            let mut a = weights[name].as_dtype(Dtype::Float32).unwrap();
            if family == Family::Llama && name.contains("q_proj") {
                a = permute(&a, heads("num_attention_heads"));
            } else if family == Family::Llama && name.contains("k_proj") {
                a = permute(&a, heads("num_key_value_heads"));
            }
            if family == Family::Gemma3 && name.ends_with("norm.weight") {
                a = a.add(Array::from_f32(1.0)).unwrap();
            }
            a.eval().unwrap();
            let shape: Vec<usize> = a.shape().iter().map(|&d| d as usize).collect();
            let bytes: Vec<u8> = a.as_slice::<f32>().iter().flat_map(|v| v.to_le_bytes()).collect();
            (gguf_name(name, family), 0u32, shape, bytes)
        })
        .collect();
    let out = dir.join("gguf");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(dir.join("tokenizer.json"), out.join("tokenizer.json")).unwrap();
    std::fs::copy(dir.join("tokenizer_config.json"), out.join("tokenizer_config.json")).unwrap();
    let file = out.join("tiny.gguf");
    std::fs::write(&file, write_gguf(&meta, &tensors)).unwrap();
    file
}

#[test]
fn converted_generated_models_match_their_safetensors() {
    for family in [Family::Llama, Family::Qwen2, Family::Qwen3, Family::Gemma3] {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = TinySpec::tiny(family);
        // GGUF has no field for these: llama.cpp fixes Gemma 3's global
        // layer period at 6 and reads Llama 3.1's RoPE factors from a
        // tensor this runtime refuses.
        spec.sliding_window_pattern = 6;
        spec.layers = 6;
        write_model(dir.path(), &spec).unwrap();
        let cfg_path = dir.path().join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
        cfg["rope_scaling"] = serde_json::Value::Null;
        std::fs::write(&cfg_path, cfg.to_string()).unwrap();
        let file = convert(dir.path(), family);

        let hf = LoadedModel::load(dir.path(), None).unwrap();
        let gguf = LoadedModel::load(&file, None).unwrap();
        assert_eq!(gguf.name, "tiny");
        assert_eq!(gguf.stop_tokens, hf.stop_tokens, "{family}");
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 500).collect();
        let logits = |m: &LoadedModel| {
            let mut cache = m.model.new_cache(1);
            let l = prefill(&m.model, &mut cache, &prompt, 512).unwrap().as_dtype(Dtype::Float32).unwrap();
            l.eval().unwrap();
            l.as_slice::<f32>().to_vec()
        };
        let (a, b) = (logits(&hf), logits(&gguf));
        let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-4, "{family}: max logit difference {diff}");
    }
}
