//! The speculative engines as plugins behind the gateway, over HTTP: their
//! answers equal the fast path's plain greedy answers token for token (one
//! client, and four at once), the
//! usage and metrics carry the draft accounting, the acceptance rate routes
//! work away from a drafter that does not pay, and a drafter that cannot
//! load leaves the gateway serving with the other engines. The repository's
//! config.yaml sends a request alone to prompt lookup, greedy or sampled,
//! which answers as a batched-only gateway does (a seed gives the same
//! text), and hands its sequence to the batched engine when others come.

use std::time::Duration;

use e2e_tests::http::SseStream;
use e2e_tests::{models, Gateway, MODEL};
use serde_json::{json, Value};

/// `max_tokens` picks the engine, so one gateway serves every engine and
/// the fast path's answer is the oracle (longer, so the others are prefixes).
const CONFIG: &str = r#"model: { path: "{model}", kv_cache_mb: 64 }
engines:
  batched: { kind: batched }
  fastpath: { kind: fastpath }
  dflash: { kind: dflash, drafter: "{dflash_drafter}" }
  mtp: { kind: mtp, drafter: "{mtp_drafter}", accept_window: { min_drafted: 1 } }
  lookup: { kind: mtp, draft: ngram }
policy:
  default: batched
  rules:
    - { name: to-dflash, when: { max_tokens: 31 }, route: dflash }
    - { name: to-mtp, when: { max_tokens: 32 }, route: mtp }
    - { name: to-lookup, when: { max_tokens: 33 }, route: lookup }
    - { name: to-fastpath, when: { max_tokens: 34 }, route: fastpath }
"#;

fn complete(gw: &Gateway, prompt: &[u32], max_tokens: u32) -> (String, Vec<u64>, Value) {
    let r = gw.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": true, "return_token_ids": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let engine = r.header("x-engine").unwrap().to_owned();
    let body = r.json();
    let ids = body["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    (engine, ids, body["usage"].clone())
}

#[test]
fn speculative_engines_answer_exactly_like_plain_greedy() {
    let gw = Gateway::start(CONFIG);
    let prompts: [&[u32]; 3] = [
        &[5, 9, 14],
        &[100, 3, 47, 300, 2, 8, 77, 12, 9, 41, 5],
        &[7; 24],
    ];
    for prompt in prompts {
        let (engine, greedy, usage) = complete(&gw, prompt, 34);
        assert_eq!(engine, "fastpath");
        assert!(usage.get("speculative").is_none(), "{usage}");
        for (name, max_tokens) in [("dflash", 31), ("mtp", 32), ("lookup", 33)] {
            let (engine, ids, usage) = complete(&gw, prompt, max_tokens);
            assert_eq!(engine, name);
            assert_eq!(ids, greedy[..max_tokens as usize], "{name} on {prompt:?}");
            let spec = &usage["speculative"];
            let drafted = spec["drafted_tokens"].as_u64().unwrap();
            let accepted = spec["accepted_tokens"].as_u64().unwrap();
            let forwards = spec["target_forwards"].as_u64().unwrap();
            assert!(accepted <= drafted, "{usage}");
            assert_eq!(forwards + accepted, max_tokens as u64, "{usage}");
            let details = &usage["completion_tokens_details"];
            assert_eq!(details["accepted_prediction_tokens"], accepted, "{usage}");
            assert_eq!(
                details["rejected_prediction_tokens"],
                drafted - accepted,
                "{usage}"
            );
            let per_forward = spec["tokens_per_target_forward"].as_f64().unwrap();
            assert!((per_forward - max_tokens as f64 / forwards as f64).abs() < 1e-3);
        }
    }
    // The repeated prompt is where prompt lookup shines.
    let (_, _, usage) = complete(&gw, &[7; 24], 33);
    assert!(
        usage["speculative"]["accepted_tokens"].as_u64().unwrap() > 0,
        "{usage}"
    );

    let drafted = gw.metric("gateway_spec_drafted_tokens_total", &[("engine", "dflash")]);
    assert!(drafted.unwrap() > 0.0);
    assert!(
        gw.metric(
            "gateway_spec_accepted_tokens_total",
            &[("engine", "lookup")]
        )
        .unwrap()
            > 0.0
    );
    // mtp's window reports a rate from its first drafted token
    // (`min_drafted: 1`); by default it waits for 16.
    let rate = gw
        .metric("gateway_engine_accept_rate", &[("engine", "mtp")])
        .unwrap();
    assert!((0.0..=1.0).contains(&rate));
    // Speed over plain decoding: positive, and a random drafter cannot
    // make the engine several times faster.
    let speedup = gw
        .metric("gateway_engine_speedup", &[("engine", "mtp")])
        .unwrap();
    assert!(speedup > 0.0 && speedup < 3.0, "{speedup}");
    assert_eq!(gw.metric("gateway_kv_blocks_allocated", &[]), Some(0.0));
}

/// Clients at once on each speculative engine: their sequences are
/// verified together in one forward per round, rows keeping different
/// numbers of drafts (the repeated prompt's lookup drafts are accepted,
/// the others' mostly not), and every answer is still the fast path's.
#[test]
fn concurrent_requests_verified_together_answer_like_plain_greedy() {
    let gw = Gateway::start(CONFIG);
    let prompts: Vec<Vec<u32>> = vec![
        vec![5, 9, 14],
        vec![7; 24],
        vec![100, 3, 47, 300, 2, 8, 77, 12, 9, 41, 5],
        [11, 12, 13, 14].repeat(5),
    ];
    let oracle: Vec<Vec<u64>> = prompts.iter().map(|p| complete(&gw, p, 34).1).collect();
    for (name, max_tokens) in [("dflash", 31), ("mtp", 32), ("lookup", 33)] {
        let answers: Vec<(String, Vec<u64>)> = std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .map(|p| s.spawn(|| complete(&gw, p, max_tokens)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    let (engine, ids, _) = h.join().unwrap();
                    (engine, ids)
                })
                .collect()
        });
        for (i, (engine, ids)) in answers.iter().enumerate() {
            assert_eq!(engine, name);
            assert_eq!(
                ids,
                &oracle[i][..max_tokens as usize],
                "{name}, prompt {i} of 4 at once"
            );
        }
    }
    assert_eq!(gw.metric("gateway_kv_blocks_allocated", &[]), Some(0.0));
}

#[test]
fn streams_and_stop_strings_match_the_fast_path() {
    let gw = Gateway::start(CONFIG);
    let chat = |max_tokens: u32, extra: Value| {
        let mut body = json!({"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Tell me a story about a fox."}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = gw.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        (r.header("x-engine").unwrap().to_owned(), r)
    };
    let (_, r) = chat(34, json!({}));
    let full = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    // A stop string from the middle of the fast path's answer.
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    let stop: String = chars[8..11].iter().collect();
    let before = &full[..full.find(&stop).unwrap()];
    for max_tokens in [31, 32] {
        let (engine, r) = chat(max_tokens, json!({"stop": [stop]}));
        let body = r.json();
        assert_eq!(body["choices"][0]["message"]["content"], before, "{engine}");
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
        // Streamed: the same text, then usage with the draft accounting.
        let (engine, r) = chat(
            max_tokens,
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        );
        let chunks = e2e_tests::http::json_chunks(&r.sse_data());
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert!(
            full.starts_with(&text) && !text.is_empty(),
            "{engine}: {text:?} vs {full:?}"
        );
        let usage = &chunks.last().unwrap()["usage"];
        assert_eq!(usage["completion_tokens"], max_tokens, "{usage}");
        assert!(
            usage["speculative"]["target_forwards"].as_u64().unwrap() >= 1,
            "{usage}"
        );
    }
}

#[test]
fn a_low_acceptance_rate_routes_work_elsewhere() {
    // `adaptive: false`: every round drafts a full block, so one request
    // drafts the 16 tokens the window needs before it reports a rate.
    let gw = Gateway::start(
        r#"model: { path: "{model}", kv_cache_mb: 64 }
engines:
  batched: { kind: batched }
  dflash: { kind: dflash, drafter: "{dflash_drafter}", adaptive: false }
policy:
  default: batched
  rules:
    - name: speculate-while-it-pays
      when: { greedy: true, not: { engine_accept_rate.dflash: { lt: 0.5 } } }
      route: dflash
"#,
    );
    let body =
        json!({"model": MODEL, "prompt": [11, 12, 13, 14], "max_tokens": 24, "ignore_eos": true});
    let first = gw.post("/v1/completions", &body);
    assert_eq!(
        first.header("x-engine"),
        Some("dflash"),
        "unknown rate: speculate"
    );
    let drafted = gw
        .metric("gateway_spec_drafted_tokens_total", &[("engine", "dflash")])
        .unwrap();
    assert!(drafted >= 16.0, "{drafted}");
    // A random drafter is rarely right.
    let rate = gw
        .metric("gateway_engine_accept_rate", &[("engine", "dflash")])
        .unwrap();
    assert!(rate < 0.5, "{rate}");
    let next = gw.post("/v1/completions", &body);
    assert_eq!(next.status, 200);
    assert_eq!(next.header("x-engine"), Some("batched"));
    assert_eq!(next.header("x-route-rule"), Some("default"));
    assert_eq!(
        next.json()["choices"][0]["text"],
        first.json()["choices"][0]["text"]
    );
}

#[test]
fn a_drafter_that_cannot_load_leaves_the_other_engines_serving() {
    let gw = Gateway::start(
        r#"model: { path: "{model}", kv_cache_mb: 64 }
engines:
  batched: { kind: batched }
  dflash: { kind: dflash, drafter: "no/such/drafter" }
  mtp: { kind: mtp, drafter: "{dflash_drafter}" }
policy:
  default: dflash
  fallback: [mtp, batched]
"#,
    );
    let health = gw.health();
    let engines = health["engines"].as_array().unwrap();
    let failed = |name: &str| {
        engines
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {health}"))
            .clone()
    };
    let dflash = failed("dflash");
    assert_eq!(dflash["status"], "failed", "{health}");
    assert!(
        dflash["error"].as_str().unwrap().contains("does not exist"),
        "{health}"
    );
    let mtp = failed("mtp");
    assert_eq!(mtp["status"], "failed");
    assert!(
        mtp["error"]
            .as_str()
            .unwrap()
            .contains("not a Gemma-4-style assistant drafter"),
        "{health}"
    );
    let r = gw.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-engine"), Some("batched"));
}

/// The oracle for the default config: every request to the batched engine.
const BATCHED_ONLY: &str = r#"model: { path: "{model}", kv_cache_mb: 64 }
engines:
  batched: { kind: batched }
policy: { default: batched }
"#;

/// A prompt that quotes itself (prompt lookup's case), and a bias that
/// keeps the tiny model off tokens 255 and 5 (where it puts almost all
/// its mass) and off its stop tokens, so sampled texts differ by seed.
fn quoting(extra: Value) -> Value {
    let prompt: Vec<u32> = [100, 3, 47, 300, 2, 8, 77, 12, 9, 41, 5].repeat(3);
    let mut bias = serde_json::Map::new();
    for id in models::stop_token_ids(models::tiny_qwen3())
        .into_iter()
        .chain([255, 5])
    {
        bias.insert(id.to_string(), json!(-100));
    }
    let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 24,
        "return_token_ids": true, "logit_bias": bias});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn answer(gw: &Gateway, body: &Value) -> (String, String, Value) {
    let r = gw.post("/v1/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    let engine = r.header("x-engine").unwrap().to_owned();
    let rule = r.header("x-route-rule").unwrap().to_owned();
    (engine, rule, r.json())
}

#[test]
fn the_default_config_speculates_alone_and_answers_like_the_batched_engine() {
    let gw = Gateway::start(&e2e_tests::default_config_on_tiny_model());
    let oracle = Gateway::start(BATCHED_ONLY);
    let sampled = quoting(json!({"temperature": 1.5, "top_p": 0.95, "seed": 7}));
    // Nothing drafted yet: the acceptance rate is unknown, so it speculates.
    let (engine, rule, body) = answer(&gw, &sampled);
    assert_eq!(
        (engine.as_str(), rule.as_str()),
        ("lookup", "speculate-while-it-pays")
    );
    let want = answer(&oracle, &sampled).2;
    assert_eq!(
        body["choices"][0]["token_ids"],
        want["choices"][0]["token_ids"]
    );
    assert!(
        body["usage"]["speculative"]["target_forwards"]
            .as_u64()
            .unwrap()
            >= 1
    );
    // Other seeds, other texts (the biased tiny model repeats one token
    // with most of its mass, so a seed may draw the same text); the same
    // seed, the same text.
    let differs = (8..16).any(|seed| {
        let other = answer(&gw, &quoting(json!({"temperature": 1.5, "seed": seed}))).2;
        other["choices"][0]["token_ids"] != want["choices"][0]["token_ids"]
    });
    assert!(differs, "seeds 8..16 all drew seed 7's text");
    // Prompt lookup while its drafts are accepted, else the batched
    // engine; the same seed's text either way.
    let (engine, _, again) = answer(&gw, &sampled);
    assert!(engine == "lookup" || engine == "batched", "{engine}");
    assert_eq!(
        again["choices"][0]["token_ids"],
        want["choices"][0]["token_ids"]
    );
    // Greedy: prompt lookup while its drafts are accepted, else the fast
    // path; the same answer either way.
    let greedy = quoting(json!({"temperature": 0}));
    let (engine, _, body) = answer(&gw, &greedy);
    assert!(engine == "lookup" || engine == "fastpath", "{engine}");
    assert_eq!(
        body["choices"][0]["token_ids"],
        answer(&oracle, &greedy).2["choices"][0]["token_ids"]
    );
    let drafted = gw
        .metric("gateway_spec_drafted_tokens_total", &[("engine", "lookup")])
        .unwrap();
    assert!(drafted > 0.0, "prompt lookup drafted");
}

/// A seeded sampled stream alone on prompt lookup moves to the batched
/// engine when other requests arrive (the batched engine then has work of
/// its own) and its whole text is still the batched engine's for that
/// seed: the batched engine goes on with the keys and penalty counts of
/// the tokens already drawn.
#[test]
fn the_default_configs_lookup_hands_a_sampled_stream_to_the_batched_engine() {
    let gw = Gateway::start(&e2e_tests::default_config_on_tiny_model());
    let oracle = Gateway::start(BATCHED_ONLY);
    let body = quoting(json!({"temperature": 1.5, "seed": 3, "max_tokens": 400,
        "frequency_penalty": 0.3}));
    let want = answer(&oracle, &body).2["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let mut stream = SseStream::open(gw.addr, "/v1/completions", &streamed);
    assert_eq!(stream.status, 200);
    let engine = stream.headers.iter().find(|(k, _)| k == "x-engine");
    assert_eq!(engine.map(|(_, v)| v.as_str()), Some("lookup"));
    let mut text = String::new();
    let mut take = |data: String| {
        let chunk: Value = serde_json::from_str(&data).unwrap();
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
    };
    take(stream.next_event().unwrap());
    let addr = gw.addr;
    let others = std::thread::spawn(move || {
        (0..2)
            .map(|_| {
                let body = json!({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 64,
                    "ignore_eos": true});
                let r = e2e_tests::http::post_json(addr, "/v1/completions", &body);
                (r.status, r.header("x-engine").map(str::to_owned))
            })
            .collect::<Vec<_>>()
    });
    while let Some(data) = stream.next_event() {
        if data == "[DONE]" {
            break;
        }
        take(data);
    }
    for (status, engine) in others.join().unwrap() {
        assert_eq!((status, engine.as_deref()), (200, Some("batched")));
    }
    assert_eq!(text, want, "the seed's text across the handover");
    assert!(
        gw.logged("handed its sequences to the batched engine"),
        "a handover happened"
    );
    assert!(
        gw.wait_for(Duration::from_secs(10), |gw| gw.health()["kv_pool"]
            ["allocated_blocks"]
            == 0)
    );
}
