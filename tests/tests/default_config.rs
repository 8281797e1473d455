//! The repository's config.yaml with the real engines (`batched`,
//! `fastpath`, loaded from the build's plugin directory): requests route as
//! the measurements suggest, and a disconnect returns the batched engine's
//! KV blocks to the pool.

use std::time::Duration;

use e2e_tests::build::workspace_root;
use e2e_tests::http::SseStream;
use e2e_tests::{models, Gateway, MODEL};
use serde_json::{json, Map, Value};

fn start() -> Gateway {
    let text = std::fs::read_to_string(workspace_root().join("config.yaml")).expect("config.yaml");
    assert!(text.contains("path: models/tiny-qwen3"));
    Gateway::start(&text.replace("path: models/tiny-qwen3", "path: \"{model}\""))
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
fn default_policy_routes_with_the_real_engines() {
    let gw = start();
    let h = gw.get("/health");
    assert_eq!(h.status, 200, "{}", h.text());
    assert_eq!(
        route(&gw, &chat(json!({}))),
        ("fastpath".into(), "alone-and-greedy".into())
    );
    assert_eq!(
        route(&gw, &chat(json!({"temperature": 0.8}))),
        ("batched".into(), "sampled".into())
    );
    let tools =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    assert_eq!(
        route(&gw, &chat(json!({"tools": tools}))),
        ("batched".into(), "tools-need-batched".into())
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

    // Streaming through the fast path has the same wire shape.
    assert!(
        gw.wait_for(Duration::from_secs(10), |gw| gw.health()["kv_pool"]
            ["allocated_blocks"]
            == 0)
    );
    let r = gw.post("/v1/chat/completions", &chat(json!({"stream": true})));
    assert_eq!(r.header("x-engine"), Some("fastpath"));
    let events = r.sse_data();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
}

#[test]
fn disconnect_returns_the_batched_engines_kv_blocks() {
    let gw = start();
    let mut stream = SseStream::open(
        gw.addr,
        "/v1/chat/completions",
        &long_stream(json!({"temperature": 0.7})),
    );
    assert_eq!(stream.status, 200);
    assert_eq!(
        stream
            .headers
            .iter()
            .find(|(k, _)| k == "x-engine")
            .map(|(_, v)| v.as_str()),
        Some("batched")
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
