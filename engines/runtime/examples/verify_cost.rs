//! What a speculative verify forward of L tokens costs against one decode
//! step, synchronously (as a draft-and-verify round runs) and pipelined (as
//! the fast path runs). Each verify keeps one token, so the context grows
//! by one per round as in a real sequence; on a GPU both attention paths
//! are timed (the ragged attention kernel, the default, and MLX's causal
//! attention):
//!
//!     cargo run --release -p runtime --example verify_cost [-- --preset qwen3-4b]

use std::path::{Path, PathBuf};
use std::time::Instant;

use fixtures::model::{random_prompt, write_model, TinySpec};
use mlx_rs::transforms::eval;
use runtime::generate::{argmax_tokens, prefill, tokens_array, DecodeStream};
use runtime::mask::{set_ragged_attention, RaggedAttention};
use runtime::model::Logits;
use runtime::{Family, LoadedModel};

fn main() {
    runtime::cuda_env::apply_defaults();
    let preset = std::env::args()
        .skip_while(|a| a != "--preset")
        .nth(1)
        .unwrap_or("bench".into());
    let spec = match preset.as_str() {
        "qwen3-4b" => TinySpec::qwen3_4b(),
        _ => TinySpec::bench(Family::Qwen3),
    };
    let root = std::env::var_os("REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    let dir = root.join(format!("target/bench-models/qwen3-{preset}"));
    if !dir.join("model.safetensors").exists() {
        write_model(&dir, &spec).expect("write model");
    }
    let model = LoadedModel::load(&dir, None).expect("load");
    let m = &model.model;
    let prompt = random_prompt(1, 128, 1000);
    let steps = 32;

    let mut stream = DecodeStream::start(m, &prompt).unwrap();
    stream.next_token(true).unwrap();
    let t = Instant::now();
    for _ in 0..steps {
        stream.next_token(true).unwrap();
    }
    let pipelined = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
    println!("pipelined decode step: {pipelined:.2} ms");

    let modes: &[(&str, RaggedAttention)] = if runtime::mask::on_gpu() {
        &[
            ("ragged kernel", RaggedAttention::Auto),
            ("causal", RaggedAttention::Never),
        ]
    } else {
        &[("causal", RaggedAttention::Auto)]
    };
    for &(label, mode) in modes {
        set_ragged_attention(mode);
        for l in [1usize, 2, 4, 8] {
            let mut cache = m.new_cache(1);
            prefill(m, &mut cache, &prompt, 512).unwrap();
            eval(&cache.state()).unwrap();
            let input = tokens_array(&random_prompt(2, l, 1000));
            let mut time = || {
                let logits = m.forward(&input, &mut cache, Logits::All).unwrap();
                let tokens = argmax_tokens(&logits.reshape(&[l as i32, 1, -1]).unwrap()).unwrap();
                eval([&tokens]).unwrap();
                let _ = tokens.as_slice::<i32>()[0];
                cache.truncate(l as i32 - 1).unwrap();
            };
            time();
            let t = Instant::now();
            for _ in 0..steps {
                time();
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
            println!(
                "{label}: synchronous forward of {l}: {ms:.2} ms ({:.2}x a pipelined step)",
                ms / pipelined
            );
        }
    }
}
