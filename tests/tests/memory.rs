//! Device memory (docs/reliability.md, "Memory"): a batched step that runs
//! out of memory fails no request (its rows are recomputed from their
//! tokens, every output equal to an undisturbed run, the engine still in
//! routing, every KV block back); a `memory:` budget is divided at startup
//! and shown in /health and /metrics; a budget that cannot hold the model
//! fails at startup, naming the setting.

use std::time::Duration;

use e2e_tests::{Gateway, MODEL};
use runtime::inject::{OOM_ENV, PANIC_ENV};
use serde_json::{json, Value};

/// The batched engine alone, with small chunks so long prompts prefill
/// over several steps while short ones are grouped.
const BATCHED: &str = r#"model: { path: "{model}", kv_cache_mb: 64 }
engines:
  batched: { kind: batched, max_batch: 8, prefill_chunk: 16 }
policy: { default: batched }
"#;

fn prompt(i: usize) -> String {
    let words = ["alpha", "river", "stone", "cloud", "seven", "amber"];
    (0..4 + i * 7)
        .map(|j| words[(i + j) % words.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Greedy completions of six prompts of different lengths, sent at once;
/// each answer's text and finish reason, in prompt order.
fn run_together(gw: &Gateway) -> Vec<(String, String)> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..6)
            .map(|i| {
                s.spawn(move || {
                    let body = json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 12 + i as u32, "temperature": 0});
                    let r = gw.post("/v1/completions", &body);
                    assert_eq!(r.status, 200, "request {i}: {}\n{}", r.text(), gw.logs());
                    let choice = &r.json()["choices"][0];
                    (
                        choice["text"].as_str().unwrap().to_owned(),
                        choice["finish_reason"].as_str().unwrap().to_owned(),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn batched_health(gw: &Gateway) -> Value {
    gw.health()["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "batched")
        .cloned()
        .unwrap()
}

#[test]
fn a_step_out_of_memory_recomputes_its_rows_and_fails_nothing() {
    let reference = {
        let gw = Gateway::start(BATCHED);
        run_together(&gw)
    };
    // Failures in group prefills, chunked prefills, decode steps and
    // recomputations alike; pipelined decode (the default) and not.
    let unpipelined = BATCHED.replace(
        "prefill_chunk: 16 }",
        "prefill_chunk: 16, pipeline: false }",
    );
    assert_ne!(unpipelined, BATCHED);
    let gw = Gateway::start_with_env(&unpipelined, &[(OOM_ENV, "3,7,12,20")]);
    assert_eq!(
        run_together(&gw),
        reference,
        "unpipelined outputs differ from the undisturbed run"
    );
    assert_eq!(
        gw.health()["kv_pool"]["allocated_blocks"],
        0,
        "KV blocks leaked"
    );
    drop(gw);
    let gw = Gateway::start_with_env(BATCHED, &[(OOM_ENV, "3,7,12,20")]);
    let disturbed = run_together(&gw);
    let logs = gw.logs();
    assert!(
        logs.matches("ran out of memory").count() >= 3,
        "the injected failures did not happen:\n{logs}"
    );
    assert_eq!(
        disturbed, reference,
        "outputs differ from the undisturbed run"
    );
    let engine = batched_health(&gw);
    assert_eq!(engine["status"], "ready", "{engine}");
    assert!(engine.get("fault").is_none(), "{engine}");
    assert_eq!(
        gw.health()["kv_pool"]["allocated_blocks"],
        0,
        "KV blocks leaked"
    );
    assert_eq!(
        gw.metric("gateway_engine_faults_total", &[("engine", "batched")]),
        None,
        "a recovered step is no engine fault"
    );
    // And it goes on serving.
    assert_eq!(run_together(&gw), reference);
}

#[test]
fn a_request_that_alone_cannot_fit_gets_a_503_and_the_engine_stays() {
    // The first two forwards fail: the lone request, then its recomputation.
    let gw = Gateway::start_with_env(BATCHED, &[(OOM_ENV, "1,2")]);
    let body = json!({"model": MODEL, "prompt": "hello there", "max_tokens": 4, "temperature": 0});
    let r = gw.post("/v1/completions", &body);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        r.json()["error"]["code"],
        "server_overloaded",
        "{}",
        r.text()
    );
    assert!(r.header("retry-after").is_some());
    assert_eq!(batched_health(&gw)["status"], "ready");
    assert_eq!(gw.health()["kv_pool"]["allocated_blocks"], 0);
    let r = gw.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_memory_budget_is_divided_at_startup_and_reported() {
    let config = BATCHED
        .replace(
            "model: { path: \"{model}\", kv_cache_mb: 64 }",
            "model: { path: \"{model}\" }\nmemory: { limit_mb: 2048, step_tokens: 64 }",
        )
        .replace("max_batch: 8, prefill_chunk: 16", "prefill_chunk: 1024");
    let gw = Gateway::start(&config);
    // No forward exceeds the measured step: rows default to it, and the
    // configured chunk is cut to it.
    assert!(gw.logged("max_batch=64 prefill_chunk=64"), "{}", gw.logs());
    let health = gw.health();
    let budget = &health["memory"]["budget"];
    let bytes = |k: &str| {
        budget[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k}: {health}"))
    };
    assert_eq!(bytes("budget"), 2048 << 20);
    assert!(bytes("weights") > 0 && bytes("activations") > 0, "{budget}");
    assert_eq!(
        bytes("kv_pool"),
        bytes("budget") - bytes("weights") - bytes("activations")
    );
    assert!(bytes("device_total") >= bytes("budget"));
    // The pool was sized from it: its blocks fill the KV share.
    let pool = &health["kv_pool"];
    assert!(pool["total_blocks"].as_u64().unwrap() > 0);
    assert_eq!(health["memory"]["mlx"]["limit"].as_u64(), Some(2048 << 20));
    assert_eq!(
        gw.metric("gateway_memory_budget_bytes", &[("part", "budget")]),
        Some((2048u64 << 20) as f64)
    );
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 4});
    assert_eq!(gw.post("/v1/completions", &body).status, 200);
    assert!(
        gw.metric("gateway_memory_bytes", &[("kind", "peak")])
            .unwrap()
            > 0.0
    );
}

#[test]
fn a_budget_that_cannot_hold_the_model_fails_at_startup() {
    for (memory, names) in [
        ("{ limit_mb: 1 }", "memory.limit_mb"),
        ("{ fraction: 1.5 }", "memory.fraction"),
        ("{ fraction: 0.5, limit_mb: 100 }", "limit_mb"),
    ] {
        let config = BATCHED.replace("policy:", &format!("memory: {memory}\npolicy:"));
        let Err(e) = Gateway::try_start(&config, &[]) else {
            panic!("started with memory: {memory}");
        };
        assert!(e.logs.contains(names), "{memory}: {}", e.logs);
    }
}

#[test]
fn a_burst_stays_within_the_budget() {
    // The budget holds across a burst: MLX's cache stays under the
    // activation headroom and the peak under the budget.
    let config = BATCHED.replace(
        "model: { path: \"{model}\", kv_cache_mb: 64 }",
        "model: { path: \"{model}\", kv_cache_mb: 64 }\nmemory: { limit_mb: 2048, step_tokens: 64 }",
    );
    let gw = Gateway::start(&config);
    for _ in 0..2 {
        run_together(&gw);
    }
    let health = gw.health();
    let mlx = &health["memory"]["mlx"];
    let plan = &health["memory"]["budget"];
    assert!(mlx["peak"].as_u64() <= plan["budget"].as_u64(), "{health}");
    assert!(
        mlx["cache"].as_u64() <= plan["activations"].as_u64(),
        "{health}"
    );
    assert!(
        gw.wait_for(Duration::from_secs(5), |gw| gw.health()["kv_pool"]
            ["allocated_blocks"]
            == 0)
    );
}

#[test]
fn a_batched_engine_whose_scheduler_panicked_serves_again() {
    let config = BATCHED.replace("engines:", "server: { engine_probe_s: 0.2 }\nengines:");
    let gw = Gateway::start_with_env(&config, &[(PANIC_ENV, "2")]);
    let body = json!({"model": MODEL, "prompt": "hello there", "max_tokens": 4, "temperature": 0});
    let r = gw.post("/v1/completions", &body);
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(
        gw.wait_for(Duration::from_secs(20), |gw| batched_health(gw)["status"]
            == "ready"),
        "still benched: {}",
        batched_health(&gw)
    );
    let r = gw.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(gw.health()["kv_pool"]["allocated_blocks"], 0);
}
