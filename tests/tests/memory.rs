//! Device memory (docs/reliability.md, "Memory"): a batched step that runs
//! out of memory fails no request (its rows are recomputed from their
//! tokens, every output equal to an undisturbed run, the engine still in
//! routing, every KV block back); memory that does not come back ends the
//! newest requests with 503 after bounded retries while the oldest finish
//! unchanged; a `memory:` budget is divided at startup and shown in
//! /health and /metrics; a budget that cannot hold the model, or that the
//! device has not free, fails at startup with the figures and the setting
//! to change, or with `when_short: shrink` starts with a smaller KV pool.

use std::time::Duration;

use e2e_tests::http::SseStream;
use e2e_tests::{Gateway, MODEL};
use runtime::inject::{FREE_MEMORY_ENV, OOM_BURST_ENV, OOM_ENV, PANIC_ENV};
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
    // The first four forwards fail: the lone request, then each of its
    // three recomputations.
    let gw = Gateway::start_with_env(BATCHED, &[(OOM_ENV, "1-4")]);
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

/// How a streamed completion ended.
#[derive(Debug, PartialEq)]
enum Ending {
    /// Its text, finish reason and completion tokens (usage).
    Complete(String, String, u64),
    /// One typed error event (its code), then `[DONE]`.
    Failed(String),
}

/// Reads a streamed completion to its end; anything but a clean end or one
/// error event then `[DONE]` fails the test.
fn read_to_end(mut s: SseStream, mut text: String) -> Ending {
    let mut finish = None;
    let mut usage = None;
    let mut errors = Vec::new();
    loop {
        let event = s.next_event().expect("the stream ended without [DONE]");
        if event == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&event).unwrap();
        if let Some(e) = v.get("error") {
            errors.push(e["code"].as_str().unwrap_or_default().to_owned());
            continue;
        }
        assert!(errors.is_empty(), "an event after the error: {event}");
        if let Some(choice) = v["choices"].get(0) {
            text.push_str(choice["text"].as_str().unwrap_or_default());
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish = Some(reason.to_owned());
            }
        }
        if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
            usage = Some(u);
        }
    }
    assert!(s.next_event().is_none(), "events after [DONE]");
    match (errors.as_slice(), finish) {
        ([], Some(reason)) => Ending::Complete(text, reason, usage.expect("usage")),
        ([code], None) => Ending::Failed(code.clone()),
        (errors, finish) => panic!("not one clean ending: {errors:?}, {finish:?}, {text:?}"),
    }
}

fn long_stream(i: usize) -> Value {
    json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 300, "ignore_eos": true,
           "temperature": 0, "stream": true, "stream_options": {"include_usage": true}})
}

#[test]
fn memory_that_does_not_come_back_ends_the_newest_and_the_oldest_finish_unchanged() {
    const ROWS: usize = 6;
    let reference = Gateway::start(BATCHED);
    let expected: Vec<Ending> = (0..ROWS)
        .map(|i| {
            read_to_end(
                SseStream::open(reference.addr, "/v1/completions", &long_stream(i)),
                String::new(),
            )
        })
        .collect();
    drop(reference);
    // Once all six rows decode together, that step and the next three
    // fail (its three retries, each recomputing the oldest row), then one
    // more: memory is not coming back.
    let gw = Gateway::start_with_env(BATCHED, &[(OOM_BURST_ENV, &format!("{ROWS}:5"))]);
    let endings: Vec<Ending> = std::thread::scope(|scope| {
        let mut readers = Vec::new();
        // One after another, each once the one before streams: their ages
        // are their order.
        for i in 0..ROWS {
            let mut s = SseStream::open(gw.addr, "/v1/completions", &long_stream(i));
            assert_eq!(s.status, 200);
            let first: Value = serde_json::from_str(&s.next_event().unwrap()).unwrap();
            let text = first["choices"][0]["text"].as_str().unwrap().to_owned();
            readers.push(scope.spawn(move || read_to_end(s, text)));
        }
        readers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let logs = gw.logs();
    assert_eq!(
        logs.matches("ran out of memory").count(),
        5,
        "the retries are bounded:\n{logs}"
    );
    // The newest half ended at the fourth failure in a row, the newest
    // of the rest at the fifth; the oldest two finished as undisturbed.
    for (i, (ending, expected)) in endings.iter().zip(&expected).enumerate() {
        if i < 2 {
            assert_eq!(ending, expected, "row {i}");
        } else {
            assert_eq!(
                ending,
                &Ending::Failed("server_overloaded".into()),
                "row {i}"
            );
        }
    }
    // Recomputed tokens are not billed again: the survivors' usage above
    // equals the undisturbed run's, and the counter holds only theirs.
    let billed: u64 = expected[..2]
        .iter()
        .map(|e| match e {
            Ending::Complete(_, _, tokens) => *tokens,
            Ending::Failed(_) => unreachable!(),
        })
        .sum();
    assert_eq!(
        gw.metric("gateway_completion_tokens_total", &[("engine", "batched")]),
        Some(billed as f64)
    );
    // A transient fault does not bench the engine.
    let engine = batched_health(&gw);
    assert_eq!(engine["status"], "ready", "{engine}");
    assert_eq!(
        gw.metric("gateway_engine_faults_total", &[("engine", "batched")]),
        None
    );
    assert!(
        gw.wait_for(Duration::from_secs(5), |gw| gw.health()["kv_pool"]
            ["allocated_blocks"]
            == 0)
    );
    // It serves as before.
    let again = read_to_end(
        SseStream::open(gw.addr, "/v1/completions", &long_stream(3)),
        String::new(),
    );
    assert_eq!(again, expected[3]);
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

/// The tiny model's config without a KV size: the budget decides it.
fn budgeted(memory: &str) -> String {
    BATCHED.replace(
        "model: { path: \"{model}\", kv_cache_mb: 64 }",
        &format!("model: {{ path: \"{{model}}\" }}\nmemory: {memory}"),
    )
}

#[test]
fn a_start_the_device_has_not_memory_for_fails_with_the_figures() {
    // The whole machine's memory: more than is free.
    let Err(e) = Gateway::try_start(&budgeted("{ fraction: 1.0, step_tokens: 64 }"), &[]) else {
        panic!("started with a budget of the whole machine");
    };
    for part in [
        "not enough free memory",
        "the weights (",
        "the activations of a 64-token step (",
        "is free to this process",
        "lower memory.fraction to at most 0.",
        "memory.when_short: shrink",
    ] {
        assert!(e.logs.contains(part), "{part}: {}", e.logs);
    }
    // A free figure of 200 MiB (the test hook): the message gives it.
    let Err(e) = Gateway::try_start(
        &budgeted("{ limit_mb: 2048, step_tokens: 64 }"),
        &[(FREE_MEMORY_ENV, "200")],
    ) else {
        panic!("started with 2048 MiB budgeted and 200 MiB free");
    };
    assert!(
        e.logs.contains("(200 MiB free besides the weights"),
        "{}",
        e.logs
    );
    assert!(
        e.logs.contains("set model.kv_cache_mb to at most"),
        "{}",
        e.logs
    );
    // Without a budget, the KV pool asked for is checked the same way.
    let huge_pool = BATCHED.replace("kv_cache_mb: 64", "kv_cache_mb: 100000000");
    let Err(e) = Gateway::try_start(&huge_pool, &[]) else {
        panic!("started with a 100 TB KV pool");
    };
    assert!(e.logs.contains("not enough free memory"), "{}", e.logs);
    assert!(
        e.logs.contains("set model.kv_cache_mb to at most"),
        "{}",
        e.logs
    );
}

#[test]
fn a_start_short_of_memory_can_shrink_the_pool_and_says_so() {
    let config = budgeted("{ limit_mb: 2048, step_tokens: 64, when_short: shrink }");
    let gw = Gateway::start_with_env(&config, &[(FREE_MEMORY_ENV, "200")]);
    assert!(
        gw.logged("starting with the pool that fits"),
        "{}",
        gw.logs()
    );
    let health = gw.health();
    let memory = &health["memory"];
    let budget = &memory["budget"];
    let bytes = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("{health}"));
    assert_eq!(memory["device_free"], json!(200u64 << 20), "{health}");
    assert_eq!(budget["device_free"], json!(200u64 << 20), "{health}");
    assert_eq!(budget["shrunk"], true, "{health}");
    // The weights are loaded: the pool is what is free less one step.
    let (weights, activations) = (bytes(&budget["weights"]), bytes(&budget["activations"]));
    assert_eq!(
        bytes(&budget["kv_pool"]),
        (200 << 20) - activations,
        "{health}"
    );
    assert_eq!(
        bytes(&budget["budget"]),
        weights + activations + bytes(&budget["kv_pool"])
    );
    assert_eq!(
        memory["mlx"]["limit"], budget["budget"],
        "MLX keeps the smaller budget"
    );
    // The pool's blocks fill the shrunken share, not the 2048 MiB asked.
    let pool = &health["kv_pool"];
    let block_bytes = bytes(&pool["bytes_per_block"]);
    let pool_bytes = bytes(&pool["total_blocks"]) * block_bytes;
    assert!(
        pool_bytes > 0 && pool_bytes <= bytes(&budget["kv_pool"]),
        "{health}"
    );
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 4});
    assert_eq!(gw.post("/v1/completions", &body).status, 200);
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
    // Lost with the scheduler: to be retried.
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "request_interrupted");
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
