//! Graceful shutdown on SIGTERM: the listener closes at once, new work is
//! refused, running streams finish within the grace period (or are ended
//! cleanly when it runs out), and the process exits with success.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use e2e_tests::http::SseStream;
use e2e_tests::{Gateway, MODEL};
use serde_json::{json, Value};

fn config(grace_s: f64, token_delay_ms: u64) -> String {
    format!(
        r#"model: {{ path: "{{model}}", kv_cache_mb: 64 }}
server: {{ shutdown_grace_s: {grace_s} }}
plugins: ["{{reference}}"]
engines:
  ref: {{ kind: reference, token_delay_ms: {token_delay_ms} }}
policy:
  default: ref
"#
    )
}

fn stream(gw: &Gateway, max_tokens: u32) -> SseStream {
    let body =
        json!({"model": MODEL, "prompt": "hello there", "max_tokens": max_tokens, "stream": true});
    let mut s = SseStream::open(gw.addr, "/v1/completions", &body);
    assert_eq!(s.status, 200);
    // The first token has arrived: the request is running.
    assert!(s.next_event().is_some());
    s
}

fn rest(mut s: SseStream) -> Vec<Value> {
    let mut events = Vec::new();
    while let Some(e) = s.next_event() {
        if e == "[DONE]" {
            return events;
        }
        events.push(serde_json::from_str(&e).unwrap());
    }
    panic!("the stream ended without [DONE]: {events:?}");
}

fn refuses_connections(gw: &Gateway) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if TcpStream::connect_timeout(&gw.addr, Duration::from_millis(200)).is_err() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn sigterm_lets_running_streams_finish() {
    let mut gw = Gateway::start(&config(30.0, 20));
    let running = stream(&gw, 60);
    gw.terminate();
    assert!(refuses_connections(&gw), "still accepting after SIGTERM");
    let events = rest(running);
    let last = events.last().unwrap();
    assert!(last.get("error").is_none(), "{last}");
    let reason = last["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(reason == "length" || reason == "stop", "{last}");
    let status = gw.wait_exit(Duration::from_secs(20)).expect("did not exit");
    assert!(status.success(), "{status:?}\n{}", gw.logs());
    assert!(gw.logs().contains("stopped"), "{}", gw.logs());
}

#[test]
fn sigterm_ends_streams_still_running_after_the_grace_period() {
    let mut gw = Gateway::start(&config(0.3, 50));
    let running = stream(&gw, 2000);
    let t = Instant::now();
    gw.terminate();
    let events = rest(running);
    let error = &events.last().unwrap()["error"];
    assert_eq!(error["code"], "request_interrupted", "{events:?}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let status = gw.wait_exit(Duration::from_secs(20)).expect("did not exit");
    assert!(status.success(), "{status:?}\n{}", gw.logs());
}
