//! Load with faults, on loopback against the repository's config.yaml and
//! the real engines: many requests at high concurrency (mixed streaming,
//! greedy and sampled), a fifth of the clients disconnecting at a random
//! point (before the answer, mid-stream, or while a plain response is being
//! computed). Afterwards nothing may be lost: every KV block is back in
//! the pool, no request is active or queued, resident memory is within 10%
//! of its steady state after warm-up, and every request either completed,
//! was left on purpose, or was turned away deliberately: 429 from the
//! gateway's queue or 503 `server_overloaded`. Any other error status, and
//! any stream that carries an error event, is a failure.
//!
//! `LOAD_REQUESTS` (default 5000), `LOAD_CONCURRENCY` (default 64) and
//! `LOAD_WARMUP` (requests per warm-up round, default a fifth of the
//! requests, at most 1000; rounds repeat until resident memory grows less
//! than 3% in one) size it; the figures are printed (run with
//! `--nocapture`).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use e2e_tests::build::workspace_root;
use e2e_tests::http::{self, SseStream};
use e2e_tests::{Gateway, MODEL};
use serde_json::{json, Value};

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn start() -> Gateway {
    let text = std::fs::read_to_string(workspace_root().join("config.yaml")).expect("config.yaml");
    Gateway::start(&text.replace("path: models/tiny-qwen3", "path: \"{model}\""))
}

/// A small deterministic generator (splitmix64), so a failing run can be
/// replayed from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn body(rng: &mut Rng, stream: bool) -> Value {
    let words = [
        "alpha", "beta", "gamma", "delta", "story", "code", "json", "math",
    ];
    let prompt: Vec<&str> = (0..1 + rng.below(40))
        .map(|_| words[rng.below(words.len() as u64) as usize])
        .collect();
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt.join(" ")}],
        "max_tokens": 4 + rng.below(24),
        "stream": stream,
    });
    if rng.below(3) == 0 {
        body["temperature"] = json!(0.8);
        body["seed"] = json!(rng.below(1000));
    }
    body
}

#[derive(Default)]
struct Tally {
    statuses: BTreeMap<u16, usize>,
    completed: usize,
    disconnected: usize,
    /// Turned away on purpose (429, 503 `server_overloaded`).
    excused: usize,
    /// Every other error status, and streams with an error event.
    failures: Vec<String>,
    broken_streams: usize,
}

impl Tally {
    /// Records a response that is not a 200.
    fn refused(&mut self, status: u16, body: &[u8]) {
        let error: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let code = error["error"]["code"].as_str().unwrap_or_default();
        if status == 429 || (status == 503 && code == "server_overloaded") {
            self.excused += 1;
        } else {
            self.failures.push(format!("{status} {error}"));
        }
    }
}

/// One client request; `None` status means the client left on purpose.
fn one_request(addr: std::net::SocketAddr, rng: &mut Rng, tally: &Mutex<Tally>) {
    let stream = rng.below(4) != 0;
    let leave = rng.below(5) == 0;
    let body = body(rng, stream);
    let path = "/v1/chat/completions";
    if leave && !stream {
        // Send the request and hang up while it is being computed.
        if let Ok(mut s) = TcpStream::connect(addr) {
            let text = body.to_string();
            let _ = write!(
                s,
                "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                text.len()
            );
            std::thread::sleep(Duration::from_millis(rng.below(20)));
            let _ = s.shutdown(Shutdown::Both);
        }
        tally.lock().unwrap().disconnected += 1;
        return;
    }
    if stream {
        let mut s = SseStream::open(addr, path, &body);
        let status = s.status;
        *tally.lock().unwrap().statuses.entry(status).or_default() += 1;
        if status != 200 {
            let body = s.body();
            tally.lock().unwrap().refused(status, &body);
            return;
        }
        let mut error = None;
        let stop_after = leave.then(|| rng.below(6));
        let mut seen = 0;
        loop {
            if stop_after == Some(seen) {
                s.disconnect();
                tally.lock().unwrap().disconnected += 1;
                return;
            }
            match s.next_event() {
                Some(e) if e == "[DONE]" => break,
                Some(e) if is_error_event(&e) => error = Some(e),
                Some(_) => seen += 1,
                None => {
                    tally.lock().unwrap().broken_streams += 1;
                    return;
                }
            }
        }
        let mut t = tally.lock().unwrap();
        match error {
            // Overload after the stream started is excused like a 503.
            Some(e) if e.contains("server_overloaded") => t.excused += 1,
            Some(e) => t.failures.push(format!("stream error event {e}")),
            None => t.completed += 1,
        }
    } else {
        let r = http::post_json(addr, path, &body);
        let mut t = tally.lock().unwrap();
        *t.statuses.entry(r.status).or_default() += 1;
        if r.status == 200 {
            t.completed += 1;
        } else {
            t.refused(r.status, &r.body);
        }
    }
}

/// `requests` requests from `concurrency` client threads; the tally and
/// the wall time.
fn run_load(
    addr: std::net::SocketAddr,
    requests: usize,
    concurrency: usize,
    seed: u64,
) -> (Tally, Duration) {
    let next = Arc::new(AtomicUsize::new(0));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let t = Instant::now();
    let clients: Vec<_> = (0..concurrency)
        .map(|c| {
            let (next, tally) = (next.clone(), tally.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(seed ^ ((c as u64) << 20));
                while next.fetch_add(1, Ordering::Relaxed) < requests {
                    one_request(addr, &mut rng, &tally);
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let tally = std::mem::take(&mut *tally.lock().unwrap());
    (tally, t.elapsed())
}

#[test]
fn load_with_disconnects_loses_nothing() {
    let requests = env_usize("LOAD_REQUESTS", 5000);
    let concurrency = env_usize("LOAD_CONCURRENCY", 64);
    let gw = start();
    // Warm-up at the same shape until resident memory stops growing: MLX
    // compiles kernels and its allocator keeps buffers for every batch
    // shape it meets. That steady state is the baseline.
    let warm_up = env_usize("LOAD_WARMUP", (requests / 5).clamp(concurrency, 1000));
    let mut rss_start = 0;
    for round in 0..6 {
        run_load(gw.addr, warm_up, concurrency, 7 + round);
        assert!(gw.wait_for(Duration::from_secs(30), |g| idle(&g.health())));
        let rss = gw.rss_bytes();
        let settled = rss_start > 0 && (rss as f64) < rss_start as f64 * 1.03;
        rss_start = rss_start.max(rss);
        if settled {
            break;
        }
    }

    let (tally, elapsed) = run_load(gw.addr, requests, concurrency, 0x5EED);

    // Everything settles: cancelled work stops, blocks come back.
    let settled = gw.wait_for(Duration::from_secs(30), |g| idle(&g.health()));
    let health = gw.health();
    let rss_end = gw.rss_bytes();
    let growth = rss_end as f64 / rss_start as f64 - 1.0;
    println!(
        "load: {requests} requests at concurrency {concurrency} in {:.1}s ({:.0} req/s); \
         completed {}, disconnected on purpose {}, turned away {}, statuses {:?}, \
         failures {}, broken streams {}; \
         RSS {:.1} MB after warm-up -> {:.1} MB after ({:+.1}%); KV blocks allocated after: {}",
        elapsed.as_secs_f64(),
        requests as f64 / elapsed.as_secs_f64(),
        tally.completed,
        tally.disconnected,
        tally.excused,
        tally.statuses,
        tally.failures.len(),
        tally.broken_streams,
        rss_start as f64 / 1e6,
        rss_end as f64 / 1e6,
        growth * 100.0,
        health["kv_pool"]["allocated_blocks"],
    );
    assert!(settled, "engines did not settle: {health}");
    assert_eq!(health["kv_pool"]["allocated_blocks"], 0, "{health}");
    assert_eq!(health["status"], "ok", "{health}");
    assert!(tally.failures.is_empty(), "{:#?}", tally.failures);
    assert_eq!(tally.broken_streams, 0);
    assert_eq!(
        tally.completed + tally.disconnected + tally.excused,
        requests
    );
    assert!(growth < 0.10, "resident memory grew {:.1}%", growth * 100.0);
}

/// A stream's error event (`{"error": {...}}`) rather than a chunk.
fn is_error_event(data: &str) -> bool {
    serde_json::from_str::<Value>(data).is_ok_and(|v| v.get("error").is_some())
}

fn idle(health: &Value) -> bool {
    health["kv_pool"]["allocated_blocks"] == 0
        && health["engines"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["active"] == 0 && e["queued"] == 0)
}
