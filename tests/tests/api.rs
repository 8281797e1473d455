//! The OpenAI API over real HTTP against the built gateway binary with the
//! reference engine plugin and a generated tiny Qwen3 model.

use e2e_tests::http::{self, SseStream};
use e2e_tests::{basic_config, Gateway, MODEL};
use serde_json::{json, Value};

fn chat_body(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something nice."}],
        "max_tokens": 8,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn assert_usage(usage: &Value) {
    let p = usage["prompt_tokens"].as_u64().unwrap();
    let c = usage["completion_tokens"].as_u64().unwrap();
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), p + c, "{usage}");
    assert!(p > 0);
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"].is_u64(),
        "{usage}"
    );
}

#[test]
fn chat_completion_non_streaming() {
    let gw = Gateway::start(&basic_config(""));
    let r = http::request(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-request-id", "client-id-1")],
        chat_body(json!({})).to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-engine"), Some("ref"));
    assert_eq!(r.header("x-route-rule"), Some("default"));
    assert_eq!(r.header("x-request-id"), Some("client-id-1"));
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["model"], MODEL);
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(choice["message"]["content"].is_string());
    assert!(
        ["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()),
        "{v}"
    );
    assert_usage(&v["usage"]);
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 8);

    // A generated request id when the client sends none.
    let r = gw.post("/v1/chat/completions", &chat_body(json!({})));
    assert!(r
        .header("x-request-id")
        .is_some_and(|id| id.starts_with("req-")));
}

#[test]
fn chat_completion_streaming_shape() {
    let gw = Gateway::start(&basic_config(""));
    let whole = gw
        .post("/v1/chat/completions", &chat_body(json!({})))
        .json();
    let r = gw.post(
        "/v1/chat/completions",
        &chat_body(json!({"stream": true, "stream_options": {"include_usage": true}})),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("x-engine"), Some("ref"));
    assert_eq!(r.header("x-route-rule"), Some("default"));
    let events = r.sse_data();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks = http::json_chunks(&events);
    assert!(chunks.len() >= 3, "{chunks:?}");
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert_eq!(c["model"], MODEL);
        assert!(c["created"].is_u64());
    }
    // First: the role. Last: usage with no choices. Before it: the finish.
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[0]["choices"][0]["finish_reason"].is_null());
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_usage(&usage["usage"]);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["delta"], json!({}));
    assert_eq!(
        finish["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    let middle = &chunks[1..chunks.len() - 2];
    let mut content = String::new();
    for c in middle {
        assert!(c["choices"][0]["finish_reason"].is_null());
        assert!(c["usage"].is_null(), "usage is null until the end: {c}");
        let delta = c["choices"][0]["delta"].as_object().unwrap();
        assert!(delta.get("role").is_none());
        if let Some(t) = delta.get("content") {
            content.push_str(t.as_str().unwrap());
        }
    }
    assert_eq!(
        content,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(
        usage["usage"]["completion_tokens"],
        whole["usage"]["completion_tokens"]
    );

    // Without include_usage: no usage chunk, no usage keys.
    let r = gw.post("/v1/chat/completions", &chat_body(json!({"stream": true})));
    let events = r.sse_data();
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(last["choices"][0]["finish_reason"].is_string(), "{last}");
    assert!(last.get("usage").is_none());
}

#[test]
fn completions_streaming_and_not() {
    let gw = Gateway::start(&basic_config(""));
    let body = json!({"model": MODEL, "prompt": "The answer is", "max_tokens": 6});
    let r = gw.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-engine"), Some("ref"));
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    assert_eq!(v["choices"][0]["index"], 0);
    assert_usage(&v["usage"]);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = gw.post("/v1/completions", &streamed).sse_data();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks = http::json_chunks(&events);
    let joined: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(joined, text);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        v["choices"][0]["finish_reason"]
    );
    assert_eq!(chunks.last().unwrap()["usage"], v["usage"]);

    // echo + logprobs, and token-id prompts.
    let r = gw.post("/v1/completions", &json!({"model": MODEL, "prompt": "The answer is", "max_tokens": 4, "echo": true, "logprobs": 2}));
    let v = r.json();
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(t.starts_with("The answer is"), "{t}");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4, "{lp}");
    assert!(lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|x| x.as_f64().unwrap() <= 0.0));
    assert!(lp["top_logprobs"][0].as_object().unwrap().len() <= 2);
    let r = gw.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [10, 20, 30], "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["prompt_tokens"], 3);
}

#[test]
fn chat_logprobs() {
    let gw = Gateway::start(&basic_config(""));
    let v = gw
        .post(
            "/v1/chat/completions",
            &chat_body(json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 4})),
        )
        .json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for entry in content {
        assert!(entry["token"].is_string() && entry["logprob"].as_f64().unwrap() <= 0.0);
        assert!(entry["bytes"].is_array());
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert!(
            (top[0]["logprob"].as_f64().unwrap() - entry["logprob"].as_f64().unwrap()).abs() < 1e-4
        );
    }
}

#[test]
fn models_health_and_paths_without_v1() {
    let gw = Gateway::start(&basic_config(""));
    for path in ["/v1/models", "/models"] {
        let v = gw.get(path).json();
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][0]["id"], MODEL);
        assert_eq!(v["data"][0]["object"], "model");
    }
    assert_eq!(gw.get(&format!("/v1/models/{MODEL}")).json()["id"], MODEL);
    let r = gw.get("/v1/models/nope");
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");

    let h = gw.get("/health");
    assert_eq!(h.status, 200);
    let v = h.json();
    assert_eq!(v["status"], "ok");
    assert_eq!(v["engines"][0]["name"], "ref");
    assert_eq!(v["engines"][0]["status"], "ready");
    assert!(v["kv_pool"]["total_blocks"].as_u64().unwrap() > 0);
    assert_eq!(v["kv_pool"]["allocated_blocks"], 0);

    let body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    assert_eq!(gw.post("/chat/completions", &body).status, 200);
    assert_eq!(
        gw.post(
            "/completions",
            &json!({"model": MODEL, "prompt": "hi", "max_tokens": 2})
        )
        .status,
        200
    );
}

#[test]
fn metrics_count_requests_routes_tokens_and_engine_health() {
    let gw = Gateway::start(&basic_config(""));
    assert_eq!(
        gw.post("/v1/chat/completions", &chat_body(json!({})))
            .status,
        200
    );
    let r = gw.get("/metrics");
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    let text = r.text();
    let m =
        |name: &str, labels: &[(&str, &str)]| e2e_tests::gateway::metric_value(&text, name, labels);
    assert!(
        m(
            "gateway_requests_total",
            &[("engine", "ref"), ("rule", "default"), ("status", "200")]
        )
        .unwrap()
            >= 1.0,
        "{text}"
    );
    assert!(
        m(
            "gateway_routes_total",
            &[("engine", "ref"), ("rule", "default")]
        )
        .unwrap()
            >= 1.0
    );
    assert!(m("gateway_completion_tokens_total", &[("engine", "ref")]).unwrap() >= 1.0);
    assert!(m("gateway_prompt_tokens_total", &[("engine", "ref")]).unwrap() >= 1.0);
    assert_eq!(m("gateway_engine_healthy", &[("engine", "ref")]), Some(1.0));
    assert!(m("gateway_kv_blocks_total", &[]).unwrap() > 0.0);
    assert!(
        text.contains("gateway_time_to_first_token_seconds_bucket"),
        "{text}"
    );
    assert!(text.contains("gateway_request_duration_seconds_bucket"));
    assert!(
        m(
            "gateway_generations_total",
            &[("engine", "ref"), ("rule", "default")]
        )
        .unwrap()
            >= 1.0
    );
}

fn assert_error(r: &http::Response, status: u16, kind: &str, param: Option<&str>) {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
    if let Some(p) = param {
        assert_eq!(v["error"]["param"], p, "{v}");
    }
}

/// Picks a stop string that spans the boundary between two generated
/// tokens, from a greedy run that reports its tokens.
fn spanning_stop(tokens: &[String]) -> Option<String> {
    tokens.windows(2).find_map(|w| {
        let (a, b) = (&w[0], &w[1]);
        let last = a.chars().last()?;
        let first = b.chars().next()?;
        (last.is_ascii_graphic() && first.is_ascii_graphic() || last == ' ' || first == ' ')
            .then(|| format!("{last}{first}"))
    })
}

#[test]
fn stop_strings_across_tokens_never_leak() {
    let gw = Gateway::start(&basic_config(""));
    let base = json!({"model": MODEL, "prompt": "The answer is", "max_tokens": 16, "logprobs": 0});
    let full = gw.post("/v1/completions", &base).json();
    let text = full["choices"][0]["text"].as_str().unwrap().to_owned();
    let tokens: Vec<String> = full["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_owned())
        .collect();
    let stop =
        spanning_stop(&tokens).unwrap_or_else(|| panic!("no usable token boundary in {tokens:?}"));
    let cut = text.find(&stop).expect("stop occurs in the text");
    let expected = &text[..cut];

    let mut with_stop = base.clone();
    with_stop["stop"] = json!([stop.clone(), "never-matches-zzz"]);
    let v = gw.post("/v1/completions", &with_stop).json();
    assert_eq!(
        v["choices"][0]["text"], expected,
        "stop {stop:?} in {text:?}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    with_stop["stream"] = json!(true);
    let events = gw.post("/v1/completions", &with_stop).sse_data();
    let chunks = http::json_chunks(&events);
    let joined: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(joined, expected);
    assert!(!joined.contains(&stop));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );

    // The same tokens without logprobs (the engine's plain greedy path).
    let plain = gw
        .post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "The answer is", "max_tokens": 16, "stop": stop}),
        )
        .json();
    assert_eq!(plain["choices"][0]["text"], expected);
}

#[test]
fn api_keys_guard_the_api_but_not_health() {
    let gw = Gateway::start_with_env(
        &basic_config("  api_keys: [sk-file]\n  api_keys_env: E2E_GATEWAY_KEYS"),
        &[("E2E_GATEWAY_KEYS", "sk-env-1,sk-env-2")],
    );
    let body = chat_body(json!({"max_tokens": 2})).to_string();
    let r = http::request(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        body.as_bytes(),
    );
    assert_error(&r, 401, "authentication_error", None);
    let r = http::request(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sk-wrong")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 401);
    for key in ["sk-file", "sk-env-2"] {
        let auth = format!("Bearer {key}");
        let r = http::request(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &[("Authorization", &auth)],
            body.as_bytes(),
        );
        assert_eq!(r.status, 200, "{key}: {}", r.text());
    }
    assert_eq!(gw.get("/v1/models").status, 401);
    assert_eq!(gw.get("/health").status, 200);
    assert_eq!(gw.get("/metrics").status, 200);
}

#[test]
fn tools_and_tool_messages_are_rendered() {
    let gw = Gateway::start(&basic_config(""));
    let plain = gw
        .post("/v1/chat/completions", &chat_body(json!({"max_tokens": 1})))
        .json();
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather by city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let round_trip = json!({
        "model": MODEL,
        "max_tokens": 1,
        "tools": tools,
        "messages": [
            {"role": "user", "content": "Say something nice."},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"}
        ]
    });
    let r = gw.post("/v1/chat/completions", &round_trip);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    // The tool definitions, the call and its result all reached the prompt.
    assert!(
        v["usage"]["prompt_tokens"].as_u64().unwrap()
            > plain["usage"]["prompt_tokens"].as_u64().unwrap() + 40
    );
    assert_eq!(r.header("x-engine"), Some("ref"));

    let mut none = round_trip.clone();
    none["tool_choice"] = json!("none");
    assert_eq!(gw.post("/v1/chat/completions", &none).status, 200);
    // json_object is a grammar (tests/tests/structured.rs); the reference
    // engine applies none, so this route has no engine for it.
    let mut json_mode = chat_body(json!({"max_tokens": 2}));
    json_mode["response_format"] = json!({"type": "json_object"});
    let r = gw.post("/v1/chat/completions", &json_mode);
    assert_eq!(r.status, 503, "{}", r.text());
    json_mode["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "x"}});
    assert_error(
        &gw.post("/v1/chat/completions", &json_mode),
        400,
        "invalid_request_error",
        Some("response_format.json_schema.schema"),
    );
    let thinking = chat_body(
        json!({"max_tokens": 2, "enable_thinking": false, "chat_template_kwargs": {"enable_thinking": false}}),
    );
    assert_eq!(gw.post("/v1/chat/completions", &thinking).status, 200);
}

#[test]
fn sampled_requests_are_reproducible_with_a_seed() {
    let gw = Gateway::start(&basic_config(""));
    let body = chat_body(
        json!({"temperature": 1.5, "top_p": 0.95, "top_k": 50, "seed": 11, "max_tokens": 12,
        "presence_penalty": 0.5, "frequency_penalty": 0.2, "repetition_penalty": 1.1, "logit_bias": {"5": 3}}),
    );
    let a = gw.post("/v1/chat/completions", &body).json();
    let b = gw.post("/v1/chat/completions", &body).json();
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    let stream = SseStream::open(
        gw.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": true, "max_tokens": 2}),
    );
    assert_eq!(stream.status, 200);
}

#[test]
fn ignore_eos_generates_through_end_of_sequence() {
    let gw = Gateway::start(&basic_config(""));
    let eos = e2e_tests::models::stop_token_ids(e2e_tests::models::tiny_qwen3())[0];
    // A +100 bias makes end-of-sequence the first token every time.
    let body = |ignore_eos: bool| {
        json!({"model": MODEL, "prompt": "The answer is", "max_tokens": 5,
               "logit_bias": {eos.to_string(): 100}, "ignore_eos": ignore_eos})
    };
    let stopped = gw.post("/v1/completions", &body(false)).json();
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop", "{stopped}");
    assert!(stopped["usage"]["completion_tokens"].as_u64().unwrap() <= 1);
    let full = gw.post("/v1/completions", &body(true)).json();
    assert_eq!(full["choices"][0]["finish_reason"], "length", "{full}");
    assert_eq!(full["usage"]["completion_tokens"], 5, "{full}");
}
