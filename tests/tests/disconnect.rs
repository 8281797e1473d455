//! A client that goes away mid-stream cancels its request in the engine at
//! once, and its KV blocks return to the shared pool; a request that runs
//! past the timeout is cancelled the same way.

use std::time::{Duration, Instant};

use e2e_tests::http::SseStream;
use e2e_tests::{basic_config, models, Gateway, MODEL};
use serde_json::{json, Map, Value};

/// A generation that will not end on its own for a long while: every stop
/// token is biased away.
fn endless(stream: bool) -> Value {
    let bias: Map<String, Value> = models::stop_token_ids(models::tiny_qwen3())
        .iter()
        .map(|id| (id.to_string(), json!(-100)))
        .collect();
    json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 20000, "stream": stream, "logit_bias": bias})
}

fn pool_allocated(gw: &Gateway) -> u64 {
    gw.health()["kv_pool"]["allocated_blocks"].as_u64().unwrap()
}

fn engine_active(gw: &Gateway) -> u64 {
    gw.health()["engines"][0]["active"].as_u64().unwrap()
}

#[test]
fn disconnect_mid_stream_cancels_and_frees_kv() {
    let gw = Gateway::start(&basic_config(""));
    assert_eq!(pool_allocated(&gw), 0);
    let mut stream = SseStream::open(gw.addr, "/v1/chat/completions", &endless(true));
    assert_eq!(stream.status, 200);
    for _ in 0..5 {
        assert!(stream.next_event().is_some());
    }
    // Prompt + 20000 tokens are reserved while it runs.
    let held = pool_allocated(&gw);
    assert!(held >= 20000 / 16, "held {held}");
    assert_eq!(engine_active(&gw), 1);
    let metric_blocks = gw.metric("gateway_kv_blocks_allocated", &[]).unwrap();
    assert_eq!(metric_blocks as u64, held);

    let gone = Instant::now();
    stream.disconnect();
    assert!(
        gw.wait_for(Duration::from_secs(5), |gw| pool_allocated(gw) == 0
            && engine_active(gw) == 0),
        "KV still held after the client left: {}",
        gw.health()
    );
    // Far sooner than the 20000 tokens would take.
    assert!(gone.elapsed() < Duration::from_secs(5));
    assert!(
        gw.metric("gateway_generations_total", &[("finish", "cancelled")])
            .unwrap()
            >= 1.0
    );
    assert!(gw.logs().contains("client went away"));
    // The engine is free for the next request.
    let r = gw.post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(r.status, 200);
}

#[test]
fn timeout_cancels_and_frees_kv() {
    let gw = Gateway::start(&basic_config("  request_timeout_s: 0.5"));
    let started = Instant::now();
    let r = gw.post("/v1/chat/completions", &endless(false));
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "timeout");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        gw.wait_for(Duration::from_secs(5), |gw| pool_allocated(gw) == 0
            && engine_active(gw) == 0)
    );
}
