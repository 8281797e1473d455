//! One greedy request streamed over HTTP through the gateway, on the fast
//! path and on the batched engine, against the runtime's raw model loop on
//! the same generated model, in one run:
//!
//!     cargo bench -p e2e-tests --bench single_stream [-- --prompt 128 --gen 256 --reps 3]
//!
//! Decode tok/s over HTTP = (tokens - 1) / (time from the first streamed
//! token to the last), best of `reps`, after one warm-up request.

use std::path::{Path, PathBuf};
use std::time::Instant;

use e2e_tests::{build, Gateway, SseStream};
use fixtures::model::{write_model, TinySpec};
use runtime::{generate, Family, LoadedModel};
use serde_json::{json, Value};

fn arg(name: &str, default: usize) -> usize {
    let argv: Vec<String> = std::env::args().collect();
    argv.windows(2)
        .find(|w| w[0] == name)
        .map(|w| w[1].parse().expect("number"))
        .unwrap_or(default)
}

/// The bench shape with a vocabulary the tokenizer's corpus fills with real
/// text tokens: a random model then streams visible text, not reserved
/// special tokens that decode to nothing.
fn spec() -> TinySpec {
    TinySpec {
        vocab: 1536,
        ..TinySpec::bench(Family::Qwen3)
    }
}

fn model_dir() -> PathBuf {
    let dir = build::workspace_root().join("target/bench-models/qwen3-bench-text");
    if !dir.join("model.safetensors").exists() {
        write_model(&dir, &spec()).expect("write bench model");
    }
    dir
}

fn config(model: &Path, default: &str) -> String {
    format!(
        r#"model: {{ path: "{}", kv_cache_mb: 2048 }}
engines:
  batched: {{ kind: batched }}
  fastpath: {{ kind: fastpath }}
policy:
  default: {default}
  fallback: [batched]
"#,
        model.display()
    )
}

/// Streams one completion; returns (engine, decode tok/s, tokens).
fn stream_once(gw: &Gateway, prompt: &[u32], gen: usize) -> (String, f64, usize) {
    let body = json!({
        "model": "qwen3-bench-text", "prompt": prompt, "max_tokens": gen, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true}
    });
    let mut s = SseStream::open(gw.addr, "/v1/completions", &body);
    assert_eq!(s.status, 200);
    let engine = s
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("x-engine"))
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let (mut first, mut last, mut tokens) = (None, None, 0usize);
    while let Some(data) = s.next_event() {
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&data).expect("json chunk");
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
        }
        if v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            let now = Instant::now();
            first.get_or_insert(now);
            last = Some(now);
        }
    }
    let (Some(first), Some(last)) = (first, last) else {
        panic!("{engine}: no text streamed ({tokens} tokens)");
    };
    let secs = (last - first).as_secs_f64();
    (engine, (tokens.saturating_sub(1)) as f64 / secs, tokens)
}

fn main() {
    let (prompt_len, gen, reps) = (arg("--prompt", 128), arg("--gen", 256), arg("--reps", 3));
    let dir = model_dir();
    let loaded = LoadedModel::load(&dir, None).expect("load");
    let vocab = loaded.vocab_size() as u32;
    let prompt: Vec<u32> = (0..prompt_len as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let mut raw = 0f64;
    for rep in 0..=reps {
        let run = generate::greedy(&loaded.model, &prompt, gen, &[], |_| true).unwrap();
        if rep > 0 {
            raw = raw.max((run.tokens.len() - 1) as f64 / run.decode_time.as_secs_f64());
        }
    }
    drop(loaded);
    println!("model: qwen3 bench shape, vocab 1536 ({:.0}M parameters); prompt {prompt_len} tokens, {gen} generated; best of {reps}", spec().parameters() as f64 / 1e6);
    println!("raw model loop (runtime::generate::greedy): {raw:.1} tok/s decode");
    for default in ["fastpath", "batched"] {
        let gw = Gateway::start(&config(&dir, default));
        let _ = stream_once(&gw, &prompt, 16);
        let mut best = (String::new(), 0f64, 0usize);
        for _ in 0..reps {
            let r = stream_once(&gw, &prompt, gen);
            if r.1 > best.1 {
                best = r;
            }
        }
        println!(
            "HTTP streaming via {:<9} {:.1} tok/s decode ({} tokens): {:.1}% of the raw loop",
            best.0,
            best.1,
            best.2,
            100.0 * best.1 / raw
        );
    }
}
