//! Fault isolation: a plugin engine that panics (in `submit` or on its
//! worker thread) or fails with an internal error fails only its own
//! request (a clear 500; a 503 to retry when the engine's worker died under
//! it), is shown unhealthy in /health and /metrics,
//! and gets no more work: the next request falls back to a healthy engine
//! and the gateway stays up with every KV block back in the pool. A single
//! request's error event fails that request only.

use std::time::Duration;

use e2e_tests::http::SseStream;
use e2e_tests::{Gateway, MODEL};
use serde_json::{json, Value};

fn config(fault: &str) -> String {
    format!(
        r#"model: {{ path: "{{model}}", kv_cache_mb: 64 }}
plugins: ["{{reference}}"]
engines:
  flaky: {{ kind: reference, fault: {fault} }}
  steady: {{ kind: reference }}
policy:
  default: flaky
  fallback: [steady]
"#
    )
}

fn body(stream: bool) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": stream})
}

/// A streamed request read to its end: the status and every event.
fn stream(gw: &Gateway) -> (u16, Vec<String>) {
    let mut stream = SseStream::open(gw.addr, "/v1/chat/completions", &body(true));
    let events = std::iter::from_fn(|| stream.next_event()).collect();
    (stream.status, events)
}

/// Failed requests counted against the flaky engine.
fn request_errors(gw: &Gateway) -> Option<f64> {
    gw.metric(
        "gateway_engine_faults_total",
        &[("engine", "flaky"), ("kind", "request_error")],
    )
}

fn flaky_health(gw: &Gateway) -> Value {
    let health = gw.health();
    health["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "flaky")
        .cloned()
        .unwrap()
}

/// `status` is what the faulted request gets: 500 for the engine's own
/// failure, 503 `request_interrupted` with Retry-After when its worker
/// died under it (the request was fine; a retry is served elsewhere).
fn check(fault: &str, expected_kind: &str, status: u16) {
    let gw = Gateway::start(&config(fault));
    let r = gw.post("/v1/chat/completions", &body(false));
    assert_eq!(r.status, status, "{fault}: {}", r.text());
    let error = &r.json()["error"];
    assert_eq!(error["type"], "server_error", "{fault}: {error}");
    let message = error["message"].as_str().unwrap();
    if status == 503 {
        assert_eq!(error["code"], "request_interrupted", "{fault}: {error}");
        assert!(r.header("retry-after").is_some(), "{fault}: no Retry-After");
    } else {
        assert!(
            message.contains("engine") || message.contains("injected"),
            "{fault}: unclear message {message:?}"
        );
    }

    // Out of service, and said so.
    let flaky = flaky_health(&gw);
    assert_eq!(flaky["status"], "unhealthy", "{fault}: {flaky}");
    assert_eq!(flaky["fault"]["kind"], expected_kind, "{fault}: {flaky}");
    assert_eq!(gw.get("/health").status, 503);
    assert_eq!(
        gw.metric("gateway_engine_healthy", &[("engine", "flaky")]),
        Some(0.0)
    );
    assert_eq!(
        gw.metric(
            "gateway_engine_faults_total",
            &[("engine", "flaky"), ("kind", expected_kind)]
        ),
        Some(1.0)
    );

    // The next requests, plain and streamed, go to the healthy engine.
    for _ in 0..2 {
        let r = gw.post("/v1/chat/completions", &body(false));
        assert_eq!(r.status, 200, "{fault}: {}", r.text());
        assert_eq!(r.header("x-engine"), Some("steady"));
    }
    let (status, events) = stream(&gw);
    assert_eq!(status, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(gw.health()["kv_pool"]["allocated_blocks"], 0, "{fault}");
}

#[test]
fn a_worker_panic_fails_only_its_request() {
    check("panic_in_worker", "lost_stream", 503);
}

/// A benched engine is probed and returns to routing once it serves.
#[test]
fn an_engine_benched_by_a_panic_returns_when_it_serves_again() {
    let config = config("panic_in_worker")
        .replace(
            "fault: panic_in_worker",
            "fault: panic_in_worker, fault_requests: 1",
        )
        .replace("plugins:", "server: { engine_probe_s: 0.2 }\nplugins:");
    let gw = Gateway::start(&config);
    let r = gw.post("/v1/chat/completions", &body(false));
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(
        gw.wait_for(Duration::from_secs(20), |gw| flaky_health(gw)["status"]
            == "ready"),
        "still benched: {}",
        flaky_health(&gw)
    );
    assert!(gw.logs().contains("back in routing"));
    let r = gw.post("/v1/chat/completions", &body(false));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-engine"), Some("flaky"), "routed to it again");
    assert_eq!(gw.health()["kv_pool"]["allocated_blocks"], 0);
}

#[test]
fn a_panic_in_submit_fails_only_its_request() {
    check("panic_on_submit", "panic", 500);
}

#[test]
fn an_engine_error_benches_the_engine() {
    check("error_on_submit", "error", 500);
}

#[test]
fn a_request_error_fails_only_that_request() {
    let gw = Gateway::start(&config("error_in_stream"));
    for _ in 0..2 {
        let r = gw.post("/v1/chat/completions", &body(false));
        assert_eq!(r.status, 500, "{}", r.text());
        assert_eq!(r.json()["error"]["type"], "server_error");
        assert_eq!(r.header("x-engine"), Some("flaky"), "still routed to it");
    }
    assert_eq!(flaky_health(&gw)["status"], "ready");
    assert_eq!(request_errors(&gw), Some(2.0));
    assert_eq!(gw.health()["kv_pool"]["allocated_blocks"], 0);
}

/// An engine that runs out of capacity after accepting a request answers
/// 503 `server_overloaded` with Retry-After (streamed: the same error as
/// an event), and that is no fault of the engine's.
#[test]
fn an_overload_after_admission_is_a_503_to_retry() {
    let gw = Gateway::start(&config("overload_in_stream"));
    let r = gw.post("/v1/chat/completions", &body(false));
    assert_eq!(r.status, 503, "{}", r.text());
    let error = &r.json()["error"];
    assert_eq!(error["code"], "server_overloaded", "{error}");
    assert_eq!(error["type"], "server_error", "{error}");
    assert!(r.header("retry-after").is_some(), "no Retry-After");
    let (status, events) = stream(&gw);
    let codes: Vec<Value> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v.get("error").map(|e| e["code"].clone()))
        .collect();
    if status == 200 {
        assert_eq!(codes, vec![json!("server_overloaded")], "{events:?}");
    } else {
        assert_eq!(status, 503, "{events:?}");
    }
    assert_eq!(flaky_health(&gw)["status"], "ready");
    assert_eq!(request_errors(&gw).unwrap_or(0.0), 0.0, "not a fault");
    assert_eq!(gw.health()["kv_pool"]["allocated_blocks"], 0);
}

/// An engine that finds the request's input invalid after accepting it
/// answers 400, not 500.
#[test]
fn invalid_input_found_by_the_engine_is_a_400() {
    let gw = Gateway::start(&config("invalid_in_stream"));
    let r = gw.post("/v1/chat/completions", &body(false));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    assert_eq!(flaky_health(&gw)["status"], "ready");
}

/// A streamed request whose engine dies ends with an error event and
/// `[DONE]` rather than hanging.
#[test]
fn a_stream_whose_engine_dies_ends_cleanly() {
    let gw = Gateway::start(&config("panic_in_worker"));
    let (status, events) = stream(&gw);
    if status == 200 {
        let error = events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find(|v| v.get("error").is_some())
            .unwrap_or_else(|| panic!("no error event in {events:?}"));
        assert_eq!(error["error"]["type"], "server_error");
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    } else {
        assert_eq!(status, 503, "{events:?}");
    }
    assert_eq!(gw.health()["kv_pool"]["allocated_blocks"], 0);
    let r = gw.post("/v1/chat/completions", &body(false));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// With every engine on its route that could serve it benched, a request
/// is told to retry (they come back once probed).
#[test]
fn a_request_whose_engines_are_benched_is_told_to_retry() {
    let config = config("panic_in_worker").replace("fallback: [steady]", "fallback: []");
    let gw = Gateway::start(&config);
    let r = gw.post("/v1/chat/completions", &body(false));
    assert_eq!(
        r.json()["error"]["code"],
        "request_interrupted",
        "{}",
        r.text()
    );
    let r = gw.post("/v1/chat/completions", &body(false));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        r.json()["error"]["code"],
        "engine_unavailable",
        "{}",
        r.text()
    );
    assert!(r.header("retry-after").is_some(), "no Retry-After");
}
