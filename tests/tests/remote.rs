//! The remote engine against real upstreams on loopback: two instances of
//! this gateway (the same generated model as the front gateway, so the
//! tokenizers agree) and `mlx_lm.server`. Checks that answers through the
//! fleet equal direct ones token for token, that load spreads over both
//! upstreams, that requests sharing a long prefix stay on one upstream,
//! that killing an upstream loses and duplicates nothing, and that a dead
//! pool falls back to the local engine.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use e2e_tests::http::{self, SseStream};
use e2e_tests::{build::workspace_root, models, Gateway, BATCHED_UPSTREAM, MODEL};
use serde_json::{json, Value};

/// A front gateway: a local batched engine and a `fleet` of upstreams;
/// the fleet serves everything, the local engine is the fallback.
fn front(upstreams: &[String], extra: &str) -> String {
    format!(
        r#"model: {{ path: "{{model}}", kv_cache_mb: 64 }}
engines:
  local: {{ kind: batched }}
  fleet:
    kind: remote
    upstreams: [{}]
    health_interval_ms: 200
{extra}
policy:
  default: fleet
  fallback: [local]
"#,
        upstreams.join(", ")
    )
}

fn url(gw: &Gateway) -> String {
    format!("\"http://{}\"", gw.addr)
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

/// Text and completion tokens of a successful completion.
fn answer(gw: &Gateway, body: &Value) -> (String, u64) {
    let r = gw.post("/v1/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    (
        v["choices"][0]["text"].as_str().unwrap().to_owned(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

/// Generations an upstream gateway finished normally (stop or length).
fn finished(gw: &Gateway) -> f64 {
    let text = gw.get("/metrics").text();
    text.lines()
        .filter(|l| l.starts_with("gateway_generations_total{"))
        .filter(|l| l.contains("finish=\"stop\"") || l.contains("finish=\"length\""))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// How a streamed request through the front ended.
#[derive(Debug)]
enum Streamed {
    Complete(String),
    /// An error event; `after_tokens` when text had already arrived.
    Failed {
        after_tokens: bool,
        message: String,
    },
}

fn stream(addr: SocketAddr, body: &Value) -> Streamed {
    stream_counting(addr, body, &AtomicUsize::new(0))
}

/// `started` counts streams that have received their first event.
fn stream_counting(addr: SocketAddr, body: &Value, started: &AtomicUsize) -> Streamed {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let mut s = SseStream::open(addr, "/v1/completions", &body);
    assert_eq!(s.status, 200);
    let mut text = String::new();
    let mut finished = false;
    let mut counted = false;
    while let Some(event) = s.next_event() {
        if event == "[DONE]" {
            break;
        }
        if !counted {
            counted = true;
            started.fetch_add(1, Ordering::AcqRel);
        }
        let v: Value = serde_json::from_str(&event).unwrap();
        if let Some(e) = v.get("error") {
            return Streamed::Failed {
                after_tokens: !text.is_empty(),
                message: e["message"].as_str().unwrap_or_default().to_owned(),
            };
        }
        if let Some(choice) = v["choices"].get(0) {
            text.push_str(choice["text"].as_str().unwrap_or_default());
            finished |= !choice["finish_reason"].is_null();
        }
    }
    assert!(finished, "stream ended without a finish reason: {text:?}");
    Streamed::Complete(text)
}

#[test]
fn fleet_matches_direct_answers_and_spreads_load() {
    let a = Gateway::start(BATCHED_UPSTREAM);
    let b = Gateway::start(BATCHED_UPSTREAM);
    let f = Gateway::start(&front(
        &[url(&a), url(&b)],
        "    affinity_prefix_tokens: 24",
    ));
    let health = f.health();
    assert_eq!(health["status"], "ok", "{health}");

    // Token for token: the same text and count as asking an upstream.
    let prompt = "the quick brown fox";
    let direct = answer(&a, &completion(prompt, 16));
    let r = f.post("/v1/completions", &completion(prompt, 16));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-engine"), Some("fleet"));
    let v = r.json();
    assert_eq!(
        (
            v["choices"][0]["text"].as_str().unwrap().to_owned(),
            v["usage"]["completion_tokens"].as_u64().unwrap()
        ),
        direct
    );
    assert_eq!(
        v["usage"]["prompt_tokens"],
        json!(direct_prompt_tokens(&a, prompt))
    );

    // A token-id prompt and the ids extension on an upstream.
    let ids = a.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": true}),
    );
    let token_ids = ids.json()["choices"][0]["token_ids"].clone();
    assert_eq!(
        token_ids.as_array().map(Vec::len),
        Some(4),
        "{}",
        ids.text()
    );

    // Streaming through the fleet.
    match stream(f.addr, &completion(prompt, 16)) {
        Streamed::Complete(text) => assert_eq!(text, direct.0),
        other => panic!("{other:?}"),
    }

    // Chat: the template and text stages run in the front gateway.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12, "temperature": 0});
    let via = f.post("/v1/chat/completions", &chat);
    let own = a.post("/v1/chat/completions", &chat);
    assert_eq!(via.status, 200, "{}", via.text());
    assert_eq!(
        via.json()["choices"][0]["message"],
        own.json()["choices"][0]["message"]
    );

    // Concurrent requests spread over both upstreams; each ran once.
    let before = (finished(&a), finished(&b));
    let prompts: Vec<String> = (0..8).map(|i| format!("story number {i} begins")).collect();
    let expected: Vec<(String, u64)> = prompts
        .iter()
        .map(|p| answer(&b, &completion(p, 24)))
        .collect();
    let before_b = finished(&b);
    std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(|| answer(&f, &completion(p, 24))))
            .collect();
        for (h, want) in handles.into_iter().zip(&expected) {
            assert_eq!(&h.join().unwrap(), want);
        }
    });
    let (da, db) = (finished(&a) - before.0, finished(&b) - before_b);
    assert_eq!(
        da + db,
        8.0,
        "every request ran exactly once: a {da}, b {db}"
    );
    assert!(da >= 1.0 && db >= 1.0, "load spread: a {da}, b {db}");

    // A client that goes away stops the upstream's generation too.
    let cancelled = |gw: &Gateway| {
        let text = gw.get("/metrics").text();
        text.lines()
            .filter(|l| {
                l.starts_with("gateway_generations_total{") && l.contains("finish=\"cancelled\"")
            })
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>()
    };
    let before = cancelled(&a) + cancelled(&b);
    let mut long = completion(prompt, 4000);
    long["stream"] = json!(true);
    let mut s = SseStream::open(f.addr, "/v1/completions", &long);
    assert!(s.next_event().is_some());
    s.disconnect();
    let stopped = f.wait_for(Duration::from_secs(10), |_| {
        cancelled(&a) + cancelled(&b) == before + 1.0
    });
    assert!(stopped, "the upstream generation was not cancelled");

    // Prefix affinity: a long shared prefix keeps requests on one upstream.
    let system = "you are a careful assistant who answers every question about the weather in short plain sentences without any lists or tables and always in english please";
    let (a0, b0) = (finished(&a), finished(&b));
    for i in 0..6 {
        answer(&f, &completion(&format!("{system} question {i}"), 4));
    }
    let (da, db) = (finished(&a) - a0, finished(&b) - b0);
    assert!(
        (da, db) == (6.0, 0.0) || (da, db) == (0.0, 6.0),
        "affinity: a {da}, b {db}"
    );
}

fn direct_prompt_tokens(gw: &Gateway, prompt: &str) -> u64 {
    gw.post("/v1/completions", &completion(prompt, 1)).json()["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap()
}

#[test]
fn killing_an_upstream_loses_and_duplicates_nothing() {
    let a = Gateway::start(BATCHED_UPSTREAM);
    let b = Gateway::start(BATCHED_UPSTREAM);
    let f = Gateway::start(&front(&[url(&a), url(&b)], "    affinity_prefix_tokens: 0"));
    let body = completion("once upon a time", 48);
    let expected = answer(&b, &body).0;

    // Kill one upstream once most streams are under way on both (split
    // four and four: least outstanding).
    let started = AtomicUsize::new(0);
    let outcomes: Vec<Streamed> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| s.spawn(|| stream_counting(f.addr, &body, &started)))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        while started.load(Ordering::Acquire) < 6 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(a);
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut complete = 0;
    for outcome in &outcomes {
        match outcome {
            // A request never shows repeated or missing tokens.
            Streamed::Complete(text) => {
                assert_eq!(text, &expected);
                complete += 1;
            }
            // Only a stream already under way on the killed upstream may
            // fail; one that had not started was retried elsewhere.
            Streamed::Failed {
                after_tokens,
                message,
            } => {
                assert!(
                    *after_tokens || message.contains("after the response started"),
                    "{message}\n{}",
                    f.logs()
                );
                assert!(!message.contains("req-"), "{message}");
            }
        }
    }
    eprintln!(
        "after the kill: {complete} of {} streams complete",
        outcomes.len()
    );
    assert!(complete >= 3, "{outcomes:?}");

    // Right after the kill: every request succeeds, each ran once on b.
    let before = finished(&b);
    for _ in 0..6 {
        assert_eq!(answer(&f, &body).0, expected);
    }
    assert_eq!(finished(&b) - before, 6.0);
    assert!(f.logs().contains("upstream unhealthy"), "{}", f.logs());
    assert_eq!(f.health()["status"], "ok");

    // The whole pool down: the engine refuses and the local engine serves.
    drop(b);
    let refused = f.wait_for(Duration::from_secs(5), |f| {
        f.health()["engines"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "fleet" && e["status"] == "unhealthy")
    });
    assert!(refused, "{}", f.health());
    let r = f.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-engine"), Some("local"));
    assert_eq!(r.json()["choices"][0]["text"], json!(expected));
}

#[test]
fn a_pool_that_never_came_up_falls_back() {
    let dead = free_port();
    let f = Gateway::start(&front(&[format!("\"http://127.0.0.1:{dead}\"")], ""));
    let r = f.post("/v1/completions", &completion("hello", 3));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-engine"), Some("local"));
    assert_eq!(f.health()["status"], "degraded");
}

#[test]
fn refuses_an_upstream_serving_another_model() {
    let other = models::write("other-model", &runtime_spec());
    let cfg = BATCHED_UPSTREAM.replace("{model}", &other.path.display().to_string());
    let a = Gateway::start(&cfg);
    let f = Gateway::start(&front(&[url(&a)], ""));
    let refused = f.wait_for(Duration::from_secs(5), |f| {
        f.logs()
            .contains("every upstream must serve this gateway's model")
    });
    assert!(refused, "{}", f.logs());
    let r = f.post("/v1/completions", &completion("hello", 3));
    assert_eq!(r.header("x-engine"), Some("local"));
}

fn runtime_spec() -> fixtures::model::TinySpec {
    fixtures::model::TinySpec::tiny(runtime::Family::Qwen3)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `python -m mlx_lm.server` on the model, killed on drop.
struct MlxLmServer {
    child: Child,
    addr: SocketAddr,
    _hf_home: tempfile::TempDir,
}

impl MlxLmServer {
    fn start(model: &Path) -> MlxLmServer {
        let port = free_port();
        // Its /v1/models scans the Hugging Face cache, which must exist.
        let hf_home = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(hf_home.path().join("hub")).unwrap();
        let child = Command::new(fixtures::reference::python())
            .args(["-m", "mlx_lm.server", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .arg("--model")
            .arg(model)
            .env("HF_HOME", hf_home.path())
            .env("HF_HUB_OFFLINE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start mlx_lm.server");
        let server = MlxLmServer {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            _hf_home: hf_home,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(server.addr).is_ok()
                && http::get(server.addr, "/health").status == 200
            {
                return server;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("mlx_lm.server did not come up on {}", server.addr);
    }
}

impl Drop for MlxLmServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn mlx_lm_server_as_an_upstream() {
    let model = models::tiny_qwen3().canonicalize().unwrap();
    let mlx = MlxLmServer::start(&model);
    let a = Gateway::start(BATCHED_UPSTREAM);
    let f = Gateway::start(&front(
        &[format!(
            "{{ url: \"http://{}\", protocol: text }}",
            mlx.addr
        )],
        "",
    ));
    assert_eq!(f.health()["status"], "ok", "{}", f.logs());
    let prompt = "the quick brown fox";
    let direct = answer(&a, &completion(prompt, 16)).0;
    let r = f.post("/v1/completions", &completion(prompt, 16));
    assert_eq!(r.status, 200, "{}\n{}", r.text(), f.logs());
    assert_eq!(r.header("x-engine"), Some("fleet"));
    assert_eq!(r.json()["choices"][0]["text"], json!(direct));
    match stream(f.addr, &completion(prompt, 16)) {
        Streamed::Complete(text) => assert_eq!(text, direct),
        other => panic!("{other:?}"),
    }
    // What a text-only upstream cannot carry goes to the local engine.
    let mut logprobs = completion(prompt, 4);
    logprobs["logprobs"] = json!(1);
    let r = f.post("/v1/completions", &logprobs);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-engine"), Some("local"));
}

/// docs/fleet.yaml, with its upstreams pointed at `upstreams` (the third,
/// text-protocol one at a port where nothing listens) and `overflow` as
/// the KV pressure above which requests go to the fleet.
fn documented_config(upstreams: [&Gateway; 2], overflow: &str) -> String {
    let text = std::fs::read_to_string(workspace_root().join("docs/fleet.yaml")).unwrap();
    let replaced = text
        .replace("path: models/tiny-qwen3", "path: \"{model}\"")
        .replace("kv_cache_mb: 1024", "kv_cache_mb: 64")
        .replace(
            "http://10.0.0.2:8000",
            &format!("http://{}", upstreams[0].addr),
        )
        .replace(
            "http://10.0.0.3:8000",
            &format!("http://{}", upstreams[1].addr),
        )
        .replace(
            "http://10.0.0.4:8080",
            &format!("http://127.0.0.1:{}", free_port()),
        )
        .replace(
            "kv_pressure: { gt: 0.85 }",
            &format!("kv_pressure: {{ {overflow} }}"),
        );
    assert_ne!(text, replaced);
    replaced
}

#[test]
fn the_documented_fleet_config_serves() {
    let a = Gateway::start(BATCHED_UPSTREAM);
    let b = Gateway::start(BATCHED_UPSTREAM);
    let body = completion("the quick brown fox", 8);
    let expected = answer(&a, &body).0;

    let f = Gateway::start(&documented_config([&a, &b], "gt: 0.85"));
    let health = f.health();
    let fleet = health["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "fleet")
        .cloned()
        .unwrap();
    assert_eq!(fleet["status"], "ready", "{health}");
    let r = f.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        (r.header("x-engine"), r.header("x-route-rule")),
        (Some("fastpath"), Some("alone-and-greedy"))
    );
    assert_eq!(r.json()["choices"][0]["text"], json!(expected));
    drop(f);

    // The same policy with the overflow rule always true: the fleet serves.
    let f = Gateway::start(&documented_config([&a, &b], "gte: 0.0"));
    let r = f.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        (r.header("x-engine"), r.header("x-route-rule")),
        (Some("fleet"), Some("overflow-to-fleet"))
    );
    assert_eq!(r.json()["choices"][0]["text"], json!(expected));
}
