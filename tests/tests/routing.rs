//! Routing: policy rules pick the engine (and say so in headers and
//! metrics), refusals fall back along the chain, the policy file reloads
//! without a restart, and the global queue answers 429 when full.

use std::time::Duration;

use e2e_tests::gateway::metric_value;
use e2e_tests::http::SseStream;
use e2e_tests::{models, Gateway, MODEL};
use serde_json::{json, Value};

fn two_engines(policy: &str) -> String {
    format!(
        r#"model: {{ path: "{{model}}", kv_cache_mb: 64 }}
server: {{ policy_reload_ms: 50 }}
plugins: ["{{reference}}"]
engines:
  a: {{ kind: reference }}
  b: {{ kind: reference }}
  fast: {{ kind: reference, greedy_only: true, tools: false }}
{policy}"#
    )
}

fn greedy() -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
}

fn sampled() -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0.9, "seed": 1})
}

fn route(gw: &Gateway, body: &Value) -> (String, String) {
    let r = gw.post("/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    (
        r.header("x-engine").unwrap().to_owned(),
        r.header("x-route-rule").unwrap().to_owned(),
    )
}

const POLICY_V1: &str = r#"policy:
  default: a
  rules:
    - name: tools-need-a
      when: { has_tools: true }
      route: a
    - name: greedy-to-b
      when: { greedy: true }
      route: b
"#;

const POLICY_V2: &str = r#"policy:
  default: b
  rules:
    - name: greedy-to-a
      when: { greedy: true, total_active: { eq: 0 } }
      route: a
"#;

#[test]
fn rules_route_and_headers_name_engine_and_rule() {
    let gw = Gateway::start(&two_engines(POLICY_V1));
    assert_eq!(route(&gw, &greedy()), ("b".into(), "greedy-to-b".into()));
    assert_eq!(route(&gw, &sampled()), ("a".into(), "default".into()));
    // Greedy with logprobs is not plain greedy: the policy and the engines
    // agree on it (one definition), so it is not sent where it is refused.
    let mut with_logprobs = greedy();
    with_logprobs["logprobs"] = json!(true);
    assert_eq!(route(&gw, &with_logprobs), ("a".into(), "default".into()));
    let mut tools = greedy();
    tools["tools"] =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    assert_eq!(route(&gw, &tools), ("a".into(), "tools-need-a".into()));
    let r = gw.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    );
    assert_eq!(
        (r.header("x-engine"), r.header("x-route-rule")),
        (Some("b"), Some("greedy-to-b"))
    );
    let text = gw.get("/metrics").text();
    assert!(
        metric_value(
            &text,
            "gateway_routes_total",
            &[("engine", "b"), ("rule", "greedy-to-b")]
        )
        .unwrap()
            >= 2.0
    );
    assert_eq!(
        metric_value(
            &text,
            "gateway_routes_total",
            &[("engine", "a"), ("rule", "tools-need-a")]
        ),
        Some(1.0)
    );
}

#[test]
fn policy_reloads_when_the_file_changes_and_bad_edits_are_kept_out() {
    let gw = Gateway::start(&two_engines(POLICY_V1));
    assert_eq!(route(&gw, &greedy()), ("b".into(), "greedy-to-b".into()));
    let config = std::fs::read_to_string(gw.config_path()).unwrap();
    std::fs::write(gw.config_path(), config.replace(POLICY_V1, POLICY_V2)).unwrap();
    let switched = gw.wait_for(Duration::from_secs(10), |gw| {
        route(gw, &greedy()) == ("a".into(), "greedy-to-a".into())
    });
    assert!(switched, "the new policy never took effect:\n{}", gw.logs());
    assert_eq!(route(&gw, &sampled()), ("b".into(), "default".into()));

    // A policy naming an engine that is not loaded is rejected; the old one stays.
    let bad = POLICY_V2.replace("route: a", "route: nowhere");
    std::fs::write(gw.config_path(), config.replace(POLICY_V1, &bad)).unwrap();
    // The reload may first catch the file half written (rejected too, for
    // its syntax): wait for the rejection that names the engine.
    assert!(gw.wait_for(Duration::from_secs(10), |gw| {
        let logs = gw.logs();
        logs.contains("routing policy rejected") && logs.contains("nowhere")
    }));
    assert_eq!(route(&gw, &greedy()), ("a".into(), "greedy-to-a".into()));

    // GET /v1/policy: the section in force, its hash, the hits since it
    // loaded, and the refused reload.
    let status = gw.get("/v1/policy").json();
    assert_eq!(status["policy"]["default"], "b", "{status}");
    assert_eq!(status["hash"].as_str().unwrap().len(), 16, "{status}");
    assert!(status["loaded_at"].as_u64().unwrap() > 0, "{status}");
    let rules = status["rules"].as_array().unwrap();
    let names: Vec<&str> = rules.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["greedy-to-a", "default"], "{status}");
    assert!(
        rules[0]["hits"].as_u64().unwrap() >= 2 && rules[1]["hits"] == 1,
        "{status}"
    );
    assert_eq!(
        (&rules[0]["route"], &rules[1]["route"]),
        (&json!("a"), &json!("b"))
    );
    let rejected = &status["last_rejected"];
    assert!(
        rejected["error"].as_str().unwrap().contains("nowhere"),
        "{status}"
    );
    assert!(rejected["at"].as_u64().unwrap() >= status["loaded_at"].as_u64().unwrap());
}

#[test]
fn the_policy_status_is_behind_the_api_keys() {
    let config = two_engines(POLICY_V1).replace(
        "server: { policy_reload_ms: 50 }",
        "server: { policy_reload_ms: 50, api_keys: [sk-policy] }",
    );
    let gw = Gateway::start(&config);
    assert_eq!(gw.get("/v1/policy").status, 401);
    let r = e2e_tests::http::request(
        gw.addr,
        "GET",
        "/v1/policy",
        &[("authorization", "Bearer sk-policy")],
        b"",
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["last_rejected"].is_null());
}

#[test]
fn refusals_fall_back_along_the_chain() {
    let policy = r#"policy:
  default: fast
  fallback: [a]
"#;
    let gw = Gateway::start(&two_engines(policy));
    assert_eq!(route(&gw, &greedy()), ("fast".into(), "default".into()));
    // `fast` serves plain greedy only: a sampled request goes to the fallback.
    assert_eq!(route(&gw, &sampled()), ("a".into(), "default".into()));
    let mut tools = greedy();
    tools["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
    assert_eq!(route(&gw, &tools), ("a".into(), "default".into()));
    assert!(
        gw.metric("gateway_route_fallbacks_total", &[("from", "fast")])
            .unwrap()
            >= 2.0
    );

    // Without a fallback the request is refused with a clear reason.
    let policy = "policy:\n  default: fast\n";
    let gw = Gateway::start(&two_engines(policy));
    let r = gw.post("/v1/chat/completions", &sampled());
    assert_eq!(r.status, 503, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("plain greedy"), "{msg}");
}

#[test]
fn a_policy_naming_an_unloaded_engine_stops_startup() {
    let policy = "policy:\n  default: ghost\n";
    let err = match Gateway::try_start(&two_engines(policy), &[]) {
        Ok(_) => panic!("the gateway started with a policy naming an unloaded engine"),
        Err(e) => e,
    };
    assert!(!err.status.unwrap().success());
    assert!(err.logs.contains("ghost"), "{}", err.logs);
}

#[test]
fn full_queue_answers_429_with_retry_after() {
    let config = two_engines("policy:\n  default: a\n").replace(
        "server: { policy_reload_ms: 50 }",
        "server: { policy_reload_ms: 50, max_concurrent: 1, max_queued: 0 }",
    );
    let gw = Gateway::start(&config);
    let bias: serde_json::Map<String, Value> =
        models::stop_token_ids(e2e_tests::models::tiny_qwen3())
            .iter()
            .map(|id| (id.to_string(), json!(-100)))
            .collect();
    let long = json!({"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 20000,
        "stream": true, "logit_bias": bias});
    let mut stream = SseStream::open(gw.addr, "/v1/chat/completions", &long);
    assert_eq!(stream.status, 200);
    assert!(stream.next_event().is_some());
    let r = gw.post("/v1/chat/completions", &greedy());
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    let v = r.json();
    assert_eq!(v["error"]["type"], "rate_limit_error");
    // Nothing about other clients' requests in the message.
    let msg = v["error"]["message"].as_str().unwrap().to_lowercase();
    assert!(!msg.contains("active") && !msg.contains("engine"), "{msg}");
    stream.disconnect();
    // The slot frees when the stream ends.
    assert!(gw.wait_for(Duration::from_secs(10), |gw| gw
        .post("/v1/chat/completions", &greedy())
        .status
        == 200));
}

/// A checkpoint's `generation_config.json` sets what a request leaves out
/// (`model.generation_config: auto`, the default): a request without
/// sampling knobs samples as the file says (the same text as one that
/// gives those knobs itself, with the same seed) and routes as sampled; the
/// request's own `temperature: 0` wins (plain greedy again), and
/// `generation_config: none` ignores the file.
#[test]
fn a_checkpoints_generation_config_fills_in_the_sampling_a_request_leaves_out() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join(MODEL);
    let status = std::process::Command::new("cp")
        .arg("-r")
        .arg(models::tiny_qwen3())
        .arg(&model)
        .status()
        .unwrap();
    assert!(status.success());
    let file = model.join("generation_config.json");
    let mut config: Value = std::fs::read_to_string(&file)
        .ok()
        .map(|t| serde_json::from_str(&t).unwrap())
        .unwrap_or(json!({}));
    // Hot: the tiny random model is peaked, so only a high temperature
    // spreads its draws.
    config["do_sample"] = json!(true);
    config["temperature"] = json!(2.0);
    config["top_k"] = json!(40);
    std::fs::write(&file, config.to_string()).unwrap();
    let gateway = |setting: &str| {
        Gateway::start(&format!(
            r#"model: {{ path: "{}", kv_cache_mb: 64, generation_config: {setting} }}
engines:
  batched: {{ kind: batched }}
policy:
  default: batched
  rules:
    - {{ name: greedy, when: {{ greedy: true }}, route: batched }}
"#,
            model.display()
        ))
    };
    let body = |extra: Value| {
        let mut b = json!({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 16,
            "ignore_eos": true, "return_token_ids": true});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let ask = |gw: &Gateway, extra: Value| {
        let r = gw.post("/v1/completions", &body(extra));
        assert_eq!(r.status, 200, "{}", r.text());
        let rule = r.header("x-route-rule").unwrap().to_owned();
        (rule, r.json()["choices"][0]["token_ids"].clone())
    };
    // The tiny random model puts almost all its mass on two tokens; the
    // bias takes them away, so draws differ from greedy picks.
    let bias = json!({"255": -100, "7": -100});
    let gw = gateway("auto");
    let (rule, defaulted) = ask(&gw, json!({"seed": 4, "logit_bias": bias}));
    assert_eq!(rule, "default", "sampled, as the checkpoint says");
    let explicit = json!({"seed": 4, "logit_bias": bias, "temperature": 2.0, "top_k": 40});
    assert_eq!(ask(&gw, explicit).1, defaulted);
    let (_, greedy) = ask(
        &gw,
        json!({"seed": 4, "logit_bias": bias, "temperature": 0}),
    );
    assert_ne!(greedy, defaulted);
    let (rule, _) = ask(&gw, json!({"temperature": 0}));
    assert_eq!(rule, "greedy", "the request's own temperature wins");
    let off = gateway("none");
    assert_eq!(ask(&off, json!({})).0, "greedy");
    assert_eq!(ask(&off, json!({"seed": 4, "logit_bias": bias})).1, greedy);
}
