//! Load for the tests under faults (`load_faults.rs`, `storm.rs`): client
//! threads sending requests drawn by a seeded generator, a fifth of them
//! leaving at a random point, and a tally of how every request ended. Each
//! test decides which endings it excuses.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::http::{self, SseStream};

/// A small deterministic generator (splitmix64), so a failing run can be
/// replayed from its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

/// Draws one request: its path and body (the body's `stream` decides how
/// it is read).
pub type Draw = fn(&mut Rng) -> (&'static str, Value);

/// An error answer or event: its HTTP status (200 for an event in a
/// stream), `error.code` and whether `Retry-After` came with it.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub status: u16,
    pub code: String,
    pub retry_after: bool,
    pub body: String,
}

#[derive(Debug, Default)]
pub struct Tally {
    pub statuses: BTreeMap<u16, usize>,
    /// Read to a clean end: a finish reason, and `[DONE]` when streamed.
    pub completed: usize,
    /// Left on purpose by the client.
    pub disconnected: usize,
    /// Error answers (non-200 statuses).
    pub refused: Vec<Refusal>,
    /// Streams that ended with one typed error event and `[DONE]`.
    pub stream_errors: Vec<Refusal>,
    /// Anything else: a stream cut without `[DONE]`, without a finish
    /// reason or error, with events after its error, or a 200 answer
    /// without a finish reason.
    pub broken: Vec<String>,
}

impl Tally {
    pub fn total(&self) -> usize {
        self.completed
            + self.disconnected
            + self.refused.len()
            + self.stream_errors.len()
            + self.broken.len()
    }
}

fn typed_error(status: u16, body: &str, retry_after: bool) -> Option<Refusal> {
    let v: Value = serde_json::from_str(body).ok()?;
    let error = v.get("error")?;
    error["type"].as_str().filter(|t| !t.is_empty())?;
    error["message"].as_str()?;
    Some(Refusal {
        status,
        code: error["code"].as_str().unwrap_or_default().to_owned(),
        retry_after,
        body: body.to_owned(),
    })
}

/// How a streamed response's events end.
#[derive(Debug)]
pub enum StreamEnd {
    Clean,
    Error(Refusal),
    Broken(String),
}

/// Reads a stream to its end, or leaves it after `leave_after` events
/// (`None` returned).
pub fn read_stream(s: &mut SseStream, leave_after: Option<u64>) -> Option<StreamEnd> {
    let mut seen = 0;
    let mut finished = false;
    let mut error: Option<Refusal> = None;
    loop {
        if leave_after == Some(seen) {
            return None;
        }
        let Some(event) = s.next_event() else {
            return Some(StreamEnd::Broken(format!(
                "the stream ended without [DONE] after {seen} events"
            )));
        };
        if event == "[DONE]" {
            break;
        }
        seen += 1;
        if let Some(e) = &error {
            return Some(StreamEnd::Broken(format!(
                "an event after the error {}: {event}",
                e.body
            )));
        }
        match typed_error(200, &event, false) {
            Some(e) => error = Some(e),
            None => {
                let v: Value = match serde_json::from_str(&event) {
                    Ok(v) => v,
                    Err(_) => return Some(StreamEnd::Broken(format!("not JSON: {event}"))),
                };
                if v.get("error").is_some() {
                    return Some(StreamEnd::Broken(format!("an untyped error: {event}")));
                }
                finished |= v["choices"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|c| !c["finish_reason"].is_null()));
            }
        }
    }
    if s.next_event().is_some() {
        return Some(StreamEnd::Broken("events after [DONE]".into()));
    }
    Some(match (error, finished) {
        (Some(e), _) => StreamEnd::Error(e),
        (None, true) => StreamEnd::Clean,
        (None, false) => StreamEnd::Broken("no finish reason before [DONE]".into()),
    })
}

/// One client request drawn by `draw`; a fifth of the clients leave at a
/// random point (before the answer, mid-stream, or while a plain response
/// is computed).
pub fn one_request(addr: SocketAddr, rng: &mut Rng, draw: Draw, tally: &Mutex<Tally>) {
    let (path, body) = draw(rng);
    let stream = body["stream"].as_bool().unwrap_or(false);
    let leave = rng.below(5) == 0;
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
        let retry_after = s
            .headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("retry-after"));
        *tally.lock().unwrap().statuses.entry(status).or_default() += 1;
        if status != 200 {
            let body = String::from_utf8_lossy(&s.body()).into_owned();
            let mut t = tally.lock().unwrap();
            match typed_error(status, &body, retry_after) {
                Some(r) => t.refused.push(r),
                None => t
                    .broken
                    .push(format!("{status} without a typed error: {body}")),
            }
            return;
        }
        let leave_after = leave.then(|| rng.below(6));
        let end = read_stream(&mut s, leave_after);
        let mut t = tally.lock().unwrap();
        match end {
            None => {
                s.disconnect();
                t.disconnected += 1;
            }
            Some(StreamEnd::Clean) => t.completed += 1,
            Some(StreamEnd::Error(e)) => t.stream_errors.push(e),
            Some(StreamEnd::Broken(why)) => t.broken.push(why),
        }
    } else {
        let r = http::post_json(addr, path, &body);
        let mut t = tally.lock().unwrap();
        *t.statuses.entry(r.status).or_default() += 1;
        if r.status == 200 {
            let finished = r.json()["choices"]
                .as_array()
                .is_some_and(|c| !c.is_empty() && c.iter().all(|c| !c["finish_reason"].is_null()));
            if finished {
                t.completed += 1;
            } else {
                t.broken
                    .push(format!("200 without a finish reason: {}", r.text()));
            }
        } else {
            let retry_after = r.header("retry-after").is_some();
            match typed_error(r.status, &r.text(), retry_after) {
                Some(e) => t.refused.push(e),
                None => t
                    .broken
                    .push(format!("{} without a typed error: {}", r.status, r.text())),
            }
        }
    }
}

/// `requests` requests from `concurrency` client threads; `progress`
/// counts the requests started (for a test that acts mid-run). The tally
/// and the wall time.
pub fn run(
    addr: SocketAddr,
    requests: usize,
    concurrency: usize,
    seed: u64,
    draw: Draw,
    progress: &Arc<AtomicUsize>,
) -> (Tally, Duration) {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let t = Instant::now();
    let clients: Vec<_> = (0..concurrency)
        .map(|c| {
            let (next, tally) = (progress.clone(), tally.clone());
            std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || {
                    let mut rng = Rng(seed ^ ((c as u64) << 20));
                    while next.fetch_add(1, Ordering::Relaxed) < requests {
                        one_request(addr, &mut rng, draw, &tally);
                    }
                })
                .expect("spawn a client")
        })
        .collect();
    for c in clients {
        c.join().expect("a client thread panicked");
    }
    let tally = std::mem::take(&mut *tally.lock().unwrap());
    (tally, t.elapsed())
}

/// No request active or queued in any engine, and every KV block back.
pub fn idle(health: &Value) -> bool {
    health["kv_pool"]["allocated_blocks"] == 0
        && health["engines"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["active"] == 0 && e["queued"] == 0)
}
