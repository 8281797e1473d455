//! A fault storm (docs/reliability.md, "Fault storm"), on the CPU over
//! loopback: a front gateway with local engines (batched, fast path) and a
//! `remote` engine over two upstream gateways takes requests at high
//! concurrency (chat and completions, streamed or not, greedy and sampled,
//! tools, structured outputs, a fifth of the clients leaving early) while
//! faults land together: out-of-memory failures in bursts (some longer
//! than the batched engine's retries, so rows are shed), a panic in the
//! middle of a batch, and one upstream killed with SIGKILL and restarted.
//! Then SIGTERM with streams under way.
//!
//! Required: every request ends cleanly (a finish reason, and `[DONE]`
//! when streamed) or with one typed error (a stream: one error event, then
//! `[DONE]`); no 5xx but 503 with Retry-After, no 4xx but 429; nothing
//! hangs; every KV block back; resident memory within 15% of its level
//! after warm-up rounds (until it grows less than 3% in one); the process
//! exits 0.
//!
//! `STORM_REQUESTS` (default 200) at `STORM_CONCURRENCY` (default 32) size
//! it; `scripts/storm` runs it at full size (2,000 at 256). Figures are
//! printed (run with `--nocapture`); `STORM_LOG=path` keeps the front
//! gateway's log.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e_tests::http::SseStream;
use e2e_tests::load::{self, idle, read_stream, Rng, StreamEnd, Tally};
use e2e_tests::{Gateway, BATCHED_UPSTREAM, MODEL};
use runtime::inject::{OOM_ENV, PANIC_ON_ENV};
use serde_json::{json, Value};

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Longer answers go to the fleet (which takes no structured outputs: the
/// batched engine serves those); a lone greedy request to the fast path.
fn front(upstreams: &[String]) -> String {
    format!(
        r#"model: {{ path: "{{model}}", kv_cache_mb: 256 }}
server:
  engine_probe_s: 0.5
  shutdown_grace_s: 2
engines:
  batched: {{ kind: batched, max_batch: 32 }}
  fastpath: {{ kind: fastpath }}
  fleet:
    kind: remote
    upstreams: [{}]
    health_interval_ms: 200
policy:
  default: batched
  fallback: [fleet]
  rules:
    - name: tools-need-batched
      when: {{ has_tools: true }}
      route: batched
    - name: long-to-the-fleet
      when: {{ max_tokens: {{ gte: 20 }} }}
      route: fleet
      fallback: [batched]
    - name: alone-and-greedy
      when: {{ greedy: true, total_active: {{ eq: 0 }} }}
      route: fastpath
"#,
        upstreams.join(", ")
    )
}

fn draw(rng: &mut Rng) -> (&'static str, Value) {
    let words = [
        "alpha", "river", "stone", "cloud", "seven", "amber", "json", "code",
    ];
    let prompt: Vec<&str> = (0..1 + rng.below(40)).map(|_| *rng.pick(&words)).collect();
    let prompt = prompt.join(" ");
    let chat = json!([{"role": "user", "content": prompt}]);
    let (path, mut body) = match rng.below(10) {
        0..=4 => ("/v1/chat/completions", json!({"messages": chat})),
        5..=6 => ("/v1/completions", json!({"prompt": prompt})),
        7 => (
            "/v1/chat/completions",
            json!({"messages": chat, "tools": [{"type": "function", "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
            }}]}),
        ),
        _ => (
            "/v1/chat/completions",
            json!({"messages": chat, "response_format": {"type": "json_schema", "json_schema": {
                "name": "answer",
                "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
            }}}),
        ),
    };
    body["model"] = json!(MODEL);
    body["max_tokens"] = json!(4 + rng.below(28));
    body["stream"] = json!(rng.below(2) == 0);
    if rng.below(3) == 0 {
        body["temperature"] = json!(0.8);
        body["seed"] = json!(rng.below(1000));
    } else {
        body["temperature"] = json!(0);
    }
    (path, body)
}

/// Out-of-memory bursts every 150 forwards of each engine, alternately of
/// 2 failures (recovered by retries) and 5 (past the retries: rows shed).
fn oom_bursts() -> String {
    (1..400)
        .map(|i| {
            let from = i * 150;
            format!("{from}-{}", from + if i % 2 == 0 { 1 } else { 4 })
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn url(gw: &Gateway) -> String {
    format!("\"http://{}\"", gw.addr)
}

/// Error codes by count.
fn codes<'a>(refusals: impl Iterator<Item = &'a load::Refusal>) -> BTreeMap<String, usize> {
    let mut codes = BTreeMap::new();
    for r in refusals {
        *codes.entry(format!("{} {}", r.status, r.code)).or_default() += 1;
    }
    codes
}

#[test]
fn a_fault_storm_loses_nothing_and_the_server_stops_cleanly() {
    let requests = env_usize("STORM_REQUESTS", 200);
    let concurrency = env_usize("STORM_CONCURRENCY", 32);
    let a = Gateway::start(BATCHED_UPSTREAM);
    let b = Gateway::start(BATCHED_UPSTREAM);
    let a_port = a.addr.port();
    let upstreams = [url(&a), url(&b)];
    // The batched engine's next step panics once this file exists.
    let dir = tempfile::tempdir().unwrap();
    let arm_panic = dir.path().join("panic-now");
    let panic_at = format!("batched-worker:{}", arm_panic.display());
    let mut gw = Gateway::start_with_env(
        &front(&upstreams),
        &[
            (OOM_ENV, &oom_bursts()),
            (PANIC_ON_ENV, &panic_at),
            // A panic's backtrace would load the debug build's debug
            // information (tens of MB, once): no growth under load, but it
            // would hide any in the resident-memory check.
            ("RUST_BACKTRACE", "0"),
        ],
    );

    // Warm-up at the same mix until resident memory grows less than 3% in
    // a round: MLX's allocator keeps buffers for every batch shape it
    // meets. That level is the baseline.
    let mut rss_start = 0;
    for round in 0..8 {
        let (warm, _) = load::run(
            gw.addr,
            requests,
            concurrency,
            7 + round,
            draw,
            &Arc::new(AtomicUsize::new(0)),
        );
        assert!(warm.broken.is_empty(), "warm-up: {:#?}", warm.broken);
        assert!(
            gw.wait_for(Duration::from_secs(30), |g| idle(&g.health())),
            "{}",
            gw.health()
        );
        let rss = gw.rss_bytes();
        println!("warm-up round {round}: RSS {:.1} MB", rss as f64 / 1e6);
        let settled = rss_start > 0 && (rss as f64) < rss_start as f64 * 1.03;
        rss_start = rss_start.max(rss);
        if settled {
            break;
        }
    }

    // The storm: a panic mid-batch from 20%, an upstream killed at 30%
    // and back at 50%.
    let progress = Arc::new(AtomicUsize::new(0));
    let (tally, elapsed, a) = std::thread::scope(|s| {
        let load = s.spawn(|| load::run(gw.addr, requests, concurrency, 0x5EED, draw, &progress));
        let wait_for = |share: f64| {
            while progress.load(Ordering::Relaxed) < (requests as f64 * share) as usize
                && !load.is_finished()
            {
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        wait_for(0.2);
        std::fs::write(&arm_panic, b"").unwrap();
        wait_for(0.3);
        drop(a); // SIGKILL
        let killed = Instant::now();
        wait_for(0.5);
        // Down for at least a health interval or two, whatever the pace.
        std::thread::sleep(Duration::from_millis(500).saturating_sub(killed.elapsed()));
        let a = Gateway::try_start_on(BATCHED_UPSTREAM, &[], a_port)
            .unwrap_or_else(|e| panic!("the upstream did not restart: {}", e.logs));
        let (tally, elapsed): (Tally, Duration) = load.join().expect("the load panicked");
        (tally, elapsed, a)
    });

    let settled = gw.wait_for(Duration::from_secs(30), |g| idle(&g.health()));
    let health = gw.health();
    let rss_end = gw.rss_bytes();
    let growth = rss_end as f64 / rss_start as f64 - 1.0;
    let logs = gw.logs();
    if let Ok(path) = std::env::var("STORM_LOG") {
        std::fs::write(path, &logs).expect("write the front gateway's log");
    }
    println!(
        "storm: {requests} requests at concurrency {concurrency} in {:.1}s ({:.0} req/s); \
         completed {}, left on purpose {}, error answers {:?}, stream error events {:?}, \
         broken {}; statuses {:?}; over the whole run (warm-up included): out-of-memory \
         steps {}, requests ended by them {}, scheduler panics {}, upstream failures mid-stream {}; \
         RSS {:.1} MB after warm-up -> {:.1} MB after ({:+.1}%); KV blocks after: {}",
        elapsed.as_secs_f64(),
        requests as f64 / elapsed.as_secs_f64(),
        tally.completed,
        tally.disconnected,
        codes(tally.refused.iter()),
        codes(tally.stream_errors.iter()),
        tally.broken.len(),
        tally.statuses,
        logs.matches("ran out of memory").count(),
        logs.matches("server is out of memory").count(),
        logs.matches("the worker panicked").count(),
        logs.matches("upstream failed mid-stream").count(),
        rss_start as f64 / 1e6,
        rss_end as f64 / 1e6,
        growth * 100.0,
        health["kv_pool"]["allocated_blocks"],
    );
    assert!(tally.broken.is_empty(), "{:#?}", tally.broken);
    assert_eq!(tally.total(), requests);
    for r in &tally.refused {
        let retry = r.status == 429 || (r.status == 503 && r.retry_after);
        assert!(
            retry,
            "an answer other than a 503 or 429 with Retry-After: {r:?}"
        );
    }
    // The faults happened.
    assert!(logs.contains("ran out of memory"), "no out-of-memory step");
    assert!(logs.contains("the worker panicked"), "no panic mid-batch");
    assert!(
        logs.contains("upstream unhealthy"),
        "the upstream's death went unseen"
    );
    assert!(settled, "engines did not settle: {health}");
    assert_eq!(health["kv_pool"]["allocated_blocks"], 0, "{health}");
    for upstream in [&a, &b] {
        assert!(upstream.wait_for(Duration::from_secs(30), |g| idle(&g.health())));
    }
    assert!(growth < 0.15, "resident memory grew {:.1}%", growth * 100.0);

    // SIGTERM with streams under way: each ends cleanly or with one typed
    // error event, and the process exits 0.
    let long = json!({"model": MODEL, "prompt": "once upon a time", "max_tokens": 400,
                      "ignore_eos": true, "temperature": 0, "stream": true});
    let started = AtomicUsize::new(0);
    let ends: Vec<StreamEnd> = std::thread::scope(|s| {
        let readers: Vec<_> = (0..8)
            .map(|_| {
                let (gw, long, started) = (&gw, &long, &started);
                s.spawn(move || {
                    let mut stream = SseStream::open(gw.addr, "/v1/completions", long);
                    assert_eq!(stream.status, 200);
                    let first = stream.next_event().expect("a first event");
                    started.fetch_add(1, Ordering::AcqRel);
                    assert!(!first.contains("\"error\""), "{first}");
                    read_stream(&mut stream, None).expect("read to the end")
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while started.load(Ordering::Acquire) < 8 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        gw.terminate();
        readers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for end in &ends {
        assert!(
            matches!(end, StreamEnd::Clean | StreamEnd::Error(_)),
            "{end:?}"
        );
    }
    let status = gw
        .wait_exit(Duration::from_secs(30))
        .expect("the gateway did not exit");
    assert!(status.success(), "exit status {status}:\n{}", gw.logs());
}
