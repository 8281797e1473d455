//! Writes a small random-weight Gemma 3 vision-language model in the Hugging
//! Face `Gemma3ForConditionalGeneration` layout that mlx-vlm loads:
//! `language_model.*`, `vision_tower.vision_model.*` (patch embedding in
//! PyTorch's `[out, in, kh, kw]`), `multi_modal_projector.*`, a nested
//! `config.json`, `preprocessor_config.json` / `processor_config.json`, and
//! the tiny Gemma tokenizer with the image tokens added after its vocabulary
//! (`<start_of_image>`, `<end_of_image>`, `<image_soft_token>`).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, Context};
use mlx_rs::{ops, random, Array, Dtype};
use serde_json::{json, Value};

use crate::config::Family;
use crate::tiny::{write_model, TinySpec};

pub const BOI: &str = "<start_of_image>";
pub const EOI: &str = "<end_of_image>";
pub const IMAGE_TOKEN: &str = "<image_soft_token>";

#[derive(Debug, Clone)]
pub struct TinyVisionSpec {
    pub text: TinySpec,
    pub hidden: i32,
    pub layers: i32,
    pub heads: i32,
    pub intermediate: i32,
    pub patch: i32,
    pub image_size: i32,
    pub tokens_per_image: i32,
}

impl TinyVisionSpec {
    /// 56-pixel images in 7-pixel patches (an 8x8 grid) pooled to 16 soft
    /// tokens: tiny, but every stage (conv, pooling, projection) does work.
    pub fn tiny() -> Self {
        Self {
            text: TinySpec::tiny(Family::Gemma3),
            hidden: 32,
            layers: 2,
            heads: 2,
            intermediate: 64,
            patch: 7,
            image_size: 56,
            tokens_per_image: 16,
        }
    }
}

pub fn write_vision_model(dir: &Path, spec: &TinyVisionSpec) -> anyhow::Result<()> {
    anyhow::ensure!(
        spec.text.family == Family::Gemma3 && spec.text.quant_bits.is_none(),
        "vision models are written as unquantized Gemma 3"
    );
    write_model(dir, &spec.text)?;
    let text_vocab = spec.text.vocab;
    let ids = [
        text_vocab as u32,
        text_vocab as u32 + 1,
        text_vocab as u32 + 2,
    ];
    add_image_tokens(dir, ids)?;
    rewrite_weights(dir, spec, text_vocab + 3)?;
    rewrite_config(dir, spec, ids)?;
    let pre = json!({
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_convert_rgb": null,
        "do_normalize": true,
        "do_pan_and_scan": null,
        "do_rescale": true,
        "do_resize": true,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_seq_length": spec.tokens_per_image,
        "resample": 2,
        "rescale_factor": 1.0 / 255.0,
        "size": { "height": spec.image_size, "width": spec.image_size },
    });
    write_json(dir, "preprocessor_config.json", &pre)?;
    write_json(
        dir,
        "processor_config.json",
        &json!({ "image_seq_length": spec.tokens_per_image, "processor_class": "Gemma3Processor" }),
    )
}

fn read_json(dir: &Path, name: &str) -> anyhow::Result<Value> {
    let path = dir.join(name);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

fn write_json(dir: &Path, name: &str, value: &Value) -> anyhow::Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(value)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// The three image tokens as special added tokens after the text vocabulary,
/// and the tokenizer attributes Gemma 3's processor reads.
fn add_image_tokens(dir: &Path, ids: [u32; 3]) -> anyhow::Result<()> {
    let tokens = [BOI, EOI, IMAGE_TOKEN];
    let entry = |content: &str| {
        json!({
            "content": content, "lstrip": false, "normalized": false,
            "rstrip": false, "single_word": false, "special": true,
        })
    };
    let mut tokenizer = read_json(dir, "tokenizer.json")?;
    let added = tokenizer["added_tokens"]
        .as_array_mut()
        .ok_or_else(|| anyhow!("tokenizer.json has no added_tokens"))?;
    for (id, content) in ids.iter().zip(tokens) {
        let mut e = entry(content);
        e["id"] = json!(id);
        added.push(e);
    }
    write_json(dir, "tokenizer.json", &tokenizer)?;

    let mut config = read_json(dir, "tokenizer_config.json")?;
    for (id, content) in ids.iter().zip(tokens) {
        config["added_tokens_decoder"][id.to_string()] = entry(content);
    }
    config["boi_token"] = json!(BOI);
    config["eoi_token"] = json!(EOI);
    config["image_token"] = json!(IMAGE_TOKEN);
    config["extra_special_tokens"] =
        json!({ "boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_TOKEN });
    config["processor_class"] = json!("Gemma3Processor");
    write_json(dir, "tokenizer_config.json", &config)
}

/// Prefixes the text weights with `language_model.`, grows the embedding
/// table by the image tokens' rows, and adds the tower and projector.
fn rewrite_weights(dir: &Path, spec: &TinyVisionSpec, vocab: i32) -> anyhow::Result<()> {
    let path = dir.join("model.safetensors");
    let text =
        Array::load_safetensors(&path).map_err(|e| anyhow!("loading {}: {e}", path.display()))?;
    let dtype = spec.text.dtype;
    let mut key = random::key(spec.text.seed.wrapping_add(0x5EED))?;
    let mut normal = |shape: &[i32], mean: f32, std: f32| -> anyhow::Result<Array> {
        let (next, k) = random::split(&key, 2)?;
        key = next;
        Ok(random::normal::<f32>(shape, mean, std, &k)?.as_dtype(dtype)?)
    };
    let mut out: Vec<(String, Array)> = Vec::new();
    for (name, array) in text {
        let array = match name.as_str() {
            // Embeddings at a twentieth of the usual scale: Gemma
            // multiplies them by sqrt(hidden) and ties them to the output,
            // so at full scale the input token dominates the residual
            // stream and greedy decoding repeats it; smaller, the layers
            // (and the image) steer the output and logprobs stay informative.
            "model.embed_tokens.weight" => {
                let extra = normal(&[vocab - array.dim(0), array.dim(1)], 0.0, 1.0)?;
                ops::concatenate(&[array, extra], 0)?.multiply(Array::from_f32(0.05))?
            }
            _ => array,
        };
        out.push((format!("language_model.{name}"), array));
    }
    let (d, i, c, p) = (spec.hidden, spec.intermediate, 3, spec.patch);
    let t = "vision_tower.vision_model";
    let lin = |fan_in: i32| (fan_in as f32).powf(-0.5);
    out.push((
        format!("{t}.embeddings.patch_embedding.weight"),
        normal(&[d, c, p, p], 0.0, lin(c * p * p))?,
    ));
    out.push((
        format!("{t}.embeddings.patch_embedding.bias"),
        normal(&[d], 0.0, 0.1)?,
    ));
    let positions = (spec.image_size / spec.patch).pow(2);
    out.push((
        format!("{t}.embeddings.position_embedding.weight"),
        normal(&[positions, d], 0.0, 0.5)?,
    ));
    for l in 0..spec.layers {
        let q = format!("{t}.encoder.layers.{l}");
        for (name, shape, std) in [
            ("self_attn.q_proj", [d, d], lin(d)),
            ("self_attn.k_proj", [d, d], lin(d)),
            ("self_attn.v_proj", [d, d], lin(d)),
            ("self_attn.out_proj", [d, d], lin(d)),
            ("mlp.fc1", [i, d], lin(d)),
            ("mlp.fc2", [d, i], lin(i)),
        ] {
            out.push((format!("{q}.{name}.weight"), normal(&shape, 0.0, std)?));
            out.push((format!("{q}.{name}.bias"), normal(&[shape[0]], 0.0, 0.1)?));
        }
        for norm in ["layer_norm1", "layer_norm2"] {
            out.push((format!("{q}.{norm}.weight"), normal(&[d], 1.0, 0.1)?));
            out.push((format!("{q}.{norm}.bias"), normal(&[d], 0.0, 0.1)?));
        }
    }
    out.push((
        format!("{t}.post_layernorm.weight"),
        normal(&[d], 1.0, 0.1)?,
    ));
    out.push((format!("{t}.post_layernorm.bias"), normal(&[d], 0.0, 0.1)?));
    let m = "multi_modal_projector";
    out.push((
        format!("{m}.mm_soft_emb_norm.weight"),
        normal(&[d], 0.0, 0.1)?,
    ));
    out.push((
        format!("{m}.mm_input_projection_weight"),
        normal(&[d, spec.text.hidden], 0.0, 4.0)?,
    ));
    // Loaded arrays read the file lazily: materialise them before the file
    // is overwritten.
    mlx_rs::transforms::eval(out.iter().map(|(_, a)| a))?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    Array::save_safetensors(out.iter().map(|(n, a)| (n, a)), &metadata, &path)
        .map_err(|e| anyhow!("writing {}: {e}", path.display()))
}

/// `Gemma3ForConditionalGeneration`'s config: the text model's fields under
/// `text_config`, the tower's under `vision_config`, the image token ids on
/// top.
fn rewrite_config(dir: &Path, spec: &TinyVisionSpec, ids: [u32; 3]) -> anyhow::Result<()> {
    let mut text = read_json(dir, "config.json")?;
    let eos = text["eos_token_id"].clone();
    let obj = text.as_object_mut().expect("config.json is an object");
    for key in [
        "architectures",
        "eos_token_id",
        "bos_token_id",
        "torch_dtype",
    ] {
        obj.remove(key);
    }
    obj.insert("model_type".into(), json!("gemma3_text"));
    obj.insert("vocab_size".into(), json!(spec.text.vocab + 3));
    // mlx-vlm reads these names for the global rope base and the soft
    // token count.
    obj.insert("rope_global_base_freq".into(), text_rope(obj));
    obj.insert("mm_tokens_per_image".into(), json!(spec.tokens_per_image));
    let dtype = match spec.text.dtype {
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Float16 => "float16",
        _ => "float32",
    };
    let config = json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "boi_token_index": ids[0],
        "eoi_token_index": ids[1],
        "image_token_index": ids[2],
        "mm_tokens_per_image": spec.tokens_per_image,
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "patch_size": spec.patch,
            "image_size": spec.image_size,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
            "vision_use_head": false,
        },
    });
    write_json(dir, "config.json", &config)
}

fn text_rope(obj: &serde_json::Map<String, Value>) -> Value {
    obj.get("rope_theta").cloned().unwrap_or(json!(1_000_000.0))
}
