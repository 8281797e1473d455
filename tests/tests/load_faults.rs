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
//! than 3% in two rounds in a row, at most eight) size it; the figures are
//! printed (run with `--nocapture`).

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use e2e_tests::load::{self, idle, Refusal, Rng, Tally};
use e2e_tests::{Gateway, MODEL};
use serde_json::{json, Value};

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn start() -> Gateway {
    Gateway::start(&e2e_tests::default_config_on_tiny_model())
}

/// A chat request with a random prompt and length; a quarter not
/// streamed, a third sampled.
fn draw(rng: &mut Rng) -> (&'static str, Value) {
    let words = [
        "alpha", "beta", "gamma", "delta", "story", "code", "json", "math",
    ];
    let stream = rng.below(4) != 0;
    let prompt: Vec<&str> = (0..1 + rng.below(40)).map(|_| *rng.pick(&words)).collect();
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
    ("/v1/chat/completions", body)
}

/// Turned away on purpose: 429 from the gateway's queue, 503
/// `server_overloaded` (overload after the stream started included).
fn excused(r: &Refusal) -> bool {
    r.status == 429 || r.code == "server_overloaded"
}

fn run_load(
    addr: std::net::SocketAddr,
    requests: usize,
    concurrency: usize,
    seed: u64,
) -> (Tally, Duration) {
    load::run(
        addr,
        requests,
        concurrency,
        seed,
        draw,
        &Arc::new(AtomicUsize::new(0)),
    )
}

/// Where the gateway's resident memory is: its heap, mapped files (code)
/// and what MLX holds (live arrays, cached buffers), so a run that grew
/// says which part did.
fn memory(gw: &Gateway) -> String {
    let mb = |b: u64| b as f64 / 1e6;
    let mlx = &gw.health()["memory"]["mlx"];
    format!(
        "RSS {:.1} MB: heap {:.1}, files {:.1}; MLX active {:.1}, cached {:.1}",
        mb(gw.rss_bytes()),
        mb(gw.status_bytes("RssAnon")),
        mb(gw.status_bytes("RssFile")),
        mb(mlx["active"].as_u64().unwrap_or(0)),
        mb(mlx["cache"].as_u64().unwrap_or(0)),
    )
}

#[test]
fn load_with_disconnects_loses_nothing() {
    let requests = env_usize("LOAD_REQUESTS", 5000);
    let concurrency = env_usize("LOAD_CONCURRENCY", 64);
    let gw = start();
    // Warm-up at the same shape until resident memory stops growing: MLX
    // compiles kernels and its allocator keeps buffers for every batch
    // shape it meets, and the heap's size varies by a few percent from
    // round to round, so one round that happens to stay low does not
    // settle it: two rounds in a row must. The highest figure met is the
    // baseline.
    let warm_up = env_usize("LOAD_WARMUP", (requests / 5).clamp(concurrency, 1000));
    let mut rss_start = 0;
    let mut calm_rounds = 0;
    for round in 0..8 {
        let (tally, _) = run_load(gw.addr, warm_up, concurrency, 7 + round);
        assert!(gw.wait_for(Duration::from_secs(30), |g| idle(&g.health())));
        let rss = gw.rss_bytes();
        println!(
            "warm-up round {round}: completed {}, turned away {}; {}",
            tally.completed,
            tally.refused.len() + tally.stream_errors.len(),
            memory(&gw)
        );
        calm_rounds = match rss_start > 0 && (rss as f64) < rss_start as f64 * 1.03 {
            true => calm_rounds + 1,
            false => 0,
        };
        rss_start = rss_start.max(rss);
        if calm_rounds == 2 {
            break;
        }
    }

    let (tally, elapsed) = run_load(gw.addr, requests, concurrency, 0x5EED);

    // Everything settles: cancelled work stops, blocks come back.
    let settled = gw.wait_for(Duration::from_secs(30), |g| idle(&g.health()));
    let health = gw.health();
    let rss_end = gw.rss_bytes();
    let growth = rss_end as f64 / rss_start as f64 - 1.0;
    let turned_away: Vec<&Refusal> = tally.refused.iter().chain(&tally.stream_errors).collect();
    let failures: Vec<&&Refusal> = turned_away.iter().filter(|r| !excused(r)).collect();
    println!(
        "load: {requests} requests at concurrency {concurrency} in {:.1}s ({:.0} req/s); \
         completed {}, disconnected on purpose {}, turned away {}, statuses {:?}, \
         failures {}, broken streams {}; \
         RSS {:.1} MB after warm-up -> {:.1} MB after ({:+.1}%: {}); KV blocks allocated after: {}",
        elapsed.as_secs_f64(),
        requests as f64 / elapsed.as_secs_f64(),
        tally.completed,
        tally.disconnected,
        turned_away.len() - failures.len(),
        tally.statuses,
        failures.len(),
        tally.broken.len(),
        rss_start as f64 / 1e6,
        rss_end as f64 / 1e6,
        growth * 100.0,
        memory(&gw),
        health["kv_pool"]["allocated_blocks"],
    );
    assert!(settled, "engines did not settle: {health}");
    assert_eq!(health["kv_pool"]["allocated_blocks"], 0, "{health}");
    assert_eq!(health["status"], "ok", "{health}");
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(tally.broken.is_empty(), "{:#?}", tally.broken);
    assert_eq!(tally.total(), requests);
    assert!(growth < 0.10, "resident memory grew {:.1}%", growth * 100.0);
}
