//! `model.kv_cache` (quantized full-attention KV) behind the gateway, over
//! HTTP, with every local engine as a plugin: they give the same greedy
//! tokens (batched rows joining, leaving and padded, prefix-cache hits,
//! speculative rollback, a fast-path sequence handed to the batched
//! engine); the shared pool counts blocks at their quantized size; bad
//! settings stop the gateway at startup, naming them.

use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use e2e_tests::http::{json_chunks, post_json, SseStream};
use e2e_tests::models::{self, ModelDir};
use e2e_tests::Gateway;
use fixtures::model::TinySpec;
use runtime::model::Logits;
use runtime::{generate, Family, KvQuant, LoadedModel};
use serde_json::{json, Value};

const NAME: &str = "tiny-qwen3-h32";

/// The tiny Qwen3 with heads of 32 (quantization groups are 32 or wider).
fn model() -> &'static Path {
    static MODEL: OnceLock<ModelDir> = OnceLock::new();
    let spec = TinySpec {
        head_dim: 32,
        ..TinySpec::tiny(Family::Qwen3)
    };
    &MODEL.get_or_init(|| models::write(NAME, &spec)).path
}

/// `max_tokens` picks the engine; everything else goes to `batched`.
fn config(model_line: &str) -> String {
    static MTP: OnceLock<ModelDir> = OnceLock::new();
    static DFLASH: OnceLock<ModelDir> = OnceLock::new();
    let mtp = MTP.get_or_init(|| models::drafter("mtp", model()));
    let dflash = DFLASH.get_or_init(|| models::drafter("dflash", model()));
    format!(
        r#"model: {{ path: "{}", {model_line} }}
engines:
  batched: {{ kind: batched }}
  fastpath: {{ kind: fastpath }}
  mtp: {{ kind: mtp, drafter: "{}" }}
  lookup: {{ kind: mtp, draft: ngram }}
  dflash: {{ kind: dflash, drafter: "{}" }}
policy:
  default: batched
  rules:
    - {{ name: to-dflash, when: {{ max_tokens: 31 }}, route: dflash }}
    - {{ name: to-mtp, when: {{ max_tokens: 32 }}, route: mtp }}
    - {{ name: to-lookup, when: {{ max_tokens: 33 }}, route: lookup }}
    - {{ name: to-fastpath, when: {{ max_tokens: {{ gte: 34 }} }}, route: fastpath }}
"#,
        model().display(),
        mtp.path.display(),
        dflash.path.display()
    )
}

const KV: &str = "kv_cache_mb: 4, kv_cache: { bits: 4, group_size: 32 }";

/// The five highest log-probabilities of the first token after `prompt`,
/// from the runtime's own forward pass with the KV quantized with `kv`.
fn runtime_top_logprobs(kv: Option<KvQuant>, prompt: &[u32]) -> Vec<f64> {
    let mut m = LoadedModel::load(model(), None).unwrap();
    m.model.set_kv_quant(kv).unwrap();
    let mut cache = m.model.new_cache(1);
    let logits = m
        .model
        .forward(&generate::tokens_array(prompt), &mut cache, Logits::Last)
        .unwrap();
    let logits: Vec<f64> = logits.as_slice::<f32>().iter().map(|&x| x as f64).collect();
    let max = logits.iter().copied().fold(f64::MIN, f64::max);
    let norm = max + logits.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    let mut lps: Vec<f64> = logits.iter().map(|x| x - norm).collect();
    lps.sort_by(|a, b| b.total_cmp(a));
    lps.truncate(5);
    lps
}

/// Greedy tokens of the runtime's own loop on the model, its KV quantized
/// with `kv`: what every engine must answer.
fn runtime_greedy(kv: Option<KvQuant>, prompt: &[u32], n: usize) -> Vec<u64> {
    let mut m = LoadedModel::load(model(), None).unwrap();
    m.model.set_kv_quant(kv).unwrap();
    let run = generate::greedy(&m.model, prompt, n, &[], |_| true).unwrap();
    run.tokens.into_iter().map(u64::from).collect()
}

fn body(prompt: &[u32], max_tokens: u32) -> Value {
    json!({"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
           "ignore_eos": true, "return_token_ids": true})
}

/// The engine that answered, the token ids, the usage.
fn complete(gw: &Gateway, prompt: &[u32], max_tokens: u32) -> (String, Vec<u64>, Value) {
    read(gw.post("/v1/completions", &body(prompt, max_tokens)))
}

fn read(r: e2e_tests::Response) -> (String, Vec<u64>, Value) {
    assert_eq!(r.status, 200, "{}", r.text());
    let engine = r.header("x-engine").unwrap().to_owned();
    let body = r.json();
    let ids = body["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    (engine, ids, body["usage"].clone())
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 131 + i * 17) % 500 + 3)
        .collect()
}

#[test]
fn every_engine_gives_the_same_tokens_with_a_quantized_kv_cache() {
    let gw = Gateway::start(&config(KV));
    let prompts = [prompt(1, 3), prompt(2, 11), prompt(3, 40)];
    let kv = Some(KvQuant {
        bits: 4,
        group_size: 32,
    });
    // The plugins run the host's setting: the batched engine's first
    // top log-probabilities are the runtime's with the KV quantized, not
    // without.
    let mut b = body(&prompts[2], 30);
    b["logprobs"] = json!(5);
    let r = gw.post("/v1/completions", &b);
    assert_eq!(r.header("x-engine"), Some("batched"));
    // (Keyed by token text: tokens of the same text collapse into one.)
    let served: Vec<f64> = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let nearest =
        |x: f64, among: &[f64]| among.iter().map(|y| (x - y).abs()).fold(f64::MAX, f64::min);
    let (quantized, dense) = (
        runtime_top_logprobs(kv, &prompts[2]),
        runtime_top_logprobs(None, &prompts[2]),
    );
    assert!(
        served.iter().all(|&x| nearest(x, &quantized) < 1e-3),
        "{served:?} vs {quantized:?}"
    );
    assert!(
        served.iter().any(|&x| nearest(x, &dense) > 1e-2),
        "{served:?} is also the unquantized {dense:?}"
    );
    let mut greedy = Vec::new();
    for p in &prompts {
        let (engine, ids, _) = complete(&gw, p, 34);
        assert_eq!(engine, "fastpath");
        assert_eq!(ids, runtime_greedy(kv, p, 34), "fastpath on {p:?}");
        for (name, max_tokens) in [("batched", 30), ("dflash", 31), ("mtp", 32), ("lookup", 33)] {
            let (engine, got, _) = complete(&gw, p, max_tokens);
            assert_eq!(engine, name);
            assert_eq!(got, ids[..max_tokens as usize], "{name} on {p:?}");
        }
        greedy.push(ids);
    }
    // Batched rows join together, are padded to the longest prompt, and
    // leave at different steps: each still gets its answer alone.
    let addr = gw.addr;
    let handles: Vec<_> = prompts
        .iter()
        .zip([12, 30, 21])
        .map(|(p, n)| {
            let b = body(p, n);
            std::thread::spawn(move || read(post_json(addr, "/v1/completions", &b)))
        })
        .collect();
    for ((h, ids), n) in handles.into_iter().zip(&greedy).zip([12, 30, 21]) {
        let (engine, got, _) = h.join().unwrap();
        assert_eq!(engine, "batched");
        assert_eq!(got, ids[..n], "concurrent row");
    }
    // The speculative engines verify concurrent sequences in one forward
    // and roll each row of the quantized cache back on its own.
    for (name, n) in [("dflash", 31), ("lookup", 33)] {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let b = body(p, n);
                std::thread::spawn(move || read(post_json(addr, "/v1/completions", &b)))
            })
            .collect();
        for (h, ids) in handles.into_iter().zip(&greedy) {
            let (engine, got, _) = h.join().unwrap();
            assert_eq!(engine, name);
            assert_eq!(got, ids[..n as usize], "{name}, concurrent row");
        }
    }
    // The 40-token prompt's 32-token prefix is cached (quantized) and reused.
    let (_, again, usage) = complete(&gw, &prompts[2], 30);
    assert_eq!(again, greedy[2][..30]);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 32,
        "{usage}"
    );
    // The pool holds blocks of quantized size: per token, 4 layers x K and
    // V x 2 heads x (32 half-byte codes + fp32 scale and bias).
    let health = gw.health();
    let per_token = 4 * 2 * 2 * (16 + 8);
    assert_eq!(health["kv_pool"]["bytes_per_block"], 16 * per_token);
    assert_eq!(
        health["kv_pool"]["total_blocks"],
        (4 << 20) / (16 * per_token)
    );
    assert!(
        gw.wait_for(Duration::from_secs(10), |gw| gw.health()["kv_pool"]
            ["allocated_blocks"]
            == 0)
    );
}

/// A fast-path stream hands its quantized sequence to the batched engine
/// when others arrive, and the client gets exactly the answer it gets alone.
#[test]
fn a_handed_over_quantized_sequence_continues_exactly() {
    let gw = Gateway::start(&config(KV));
    let p = prompt(4, 9);
    let (engine, alone, _) = complete(&gw, &p, 400);
    assert_eq!(engine, "fastpath");
    let mut b = body(&p, 400);
    b["stream"] = json!(true);
    let mut stream = SseStream::open(gw.addr, "/v1/completions", &b);
    assert_eq!(stream.status, 200);
    let mut events = vec![stream.next_event().expect("a first token")];
    let addr = gw.addr;
    let others = std::thread::spawn(move || {
        for seed in 0..3 {
            let r = post_json(addr, "/v1/completions", &body(&prompt(seed, 5), 8));
            assert_eq!(r.status, 200);
        }
    });
    while let Some(data) = stream.next_event() {
        if data == "[DONE]" {
            break;
        }
        events.push(data);
    }
    others.join().unwrap();
    let ids: Vec<u64> = json_chunks(&events)
        .iter()
        .flat_map(|c| {
            c["choices"][0]["token_ids"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(ids, alone, "the streamed tokens");
    assert!(
        gw.logged("handed its sequence to the batched engine"),
        "a handover happened"
    );
}

#[test]
fn bad_kv_cache_settings_fail_at_startup_naming_them() {
    for (setting, named) in [
        ("{ bits: 3 }", "model.kv_cache.bits = 3"),
        (
            "{ bits: 8, group_size: 48 }",
            "model.kv_cache.group_size = 48",
        ),
        (
            "{ bits: 4, group_size: 64 }",
            "model.kv_cache.group_size = 64 does not divide the model's head size 32",
        ),
    ] {
        let line = format!("kv_cache_mb: 4, kv_cache: {setting}");
        let err = Gateway::try_start(&config(&line), &[])
            .err()
            .unwrap_or_else(|| panic!("{setting} started"));
        assert!(err.logs.contains(named), "{setting}: {}", err.logs);
    }
}
