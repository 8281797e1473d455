//! Prefix reuse on every engine, over HTTP: a growing greedy chat's turns
//! after the first start from the KV its earlier turns left in the shared
//! prefix cache (`usage.prompt_tokens_details.cached_tokens` > 0) on the
//! default policy (a lone greedy chat goes to the fast path), on the
//! speculative engines, and on a server whose KV is paged, and answer
//! exactly as a gateway without the cache does. Also: the fast path is free the moment a batched request's last
//! byte arrives (no 503 on a route without fallback).

use e2e_tests::{default_config_on_tiny_model, Gateway, MODEL};
use serde_json::{json, Value};

/// A growing chat of `turns` user messages, each answer kept: per turn,
/// the answer, the cached prompt tokens and the engine.
fn chat(
    gw: &Gateway,
    turns: usize,
    max_tokens: impl Fn(usize) -> u32,
) -> Vec<(String, u64, String)> {
    let mut messages = Vec::new();
    let mut out = Vec::new();
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": format!(
            "Turn {turn}: tell me something about the number {turn}, in a few plain words please."
        )}));
        let r = gw.post(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": messages, "temperature": 0,
                    "max_tokens": max_tokens(turn)}),
        );
        assert_eq!(r.status, 200, "turn {turn}: {}", r.text());
        let engine = r.header("x-engine").unwrap_or_default().to_owned();
        let body = r.json();
        let answer = body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        messages.push(json!({"role": "assistant", "content": answer}));
        out.push((answer, cached, engine));
    }
    out
}

/// The same chat on a gateway with the prefix cache (`warm`) and one
/// without (`cold`); turn `t` is served by one of `engines(t)`.
fn warm_and_cold(
    warm: &str,
    cold: &str,
    turns: usize,
    max_tokens: impl Fn(usize) -> u32,
    engines: impl Fn(usize) -> &'static [&'static str],
) {
    let paged = warm.contains("kv_layout: paged");
    let warm_gw = Gateway::start(warm);
    let warm = chat(&warm_gw, turns, &max_tokens);
    // The entries hold KV blocks of the shared pool, as cached blocks:
    // nothing is held by a sequence any more.
    let pool = warm_gw.health()["kv_pool"].clone();
    let cached = pool["prefix_cache_blocks"].as_u64().unwrap();
    assert!(cached > 0, "{pool}");
    assert_eq!(pool["allocated_blocks"], 0, "{pool}");
    // A paged server's blocks: the entries' only once the last sequence's
    // cache is dropped, just after its answer (each block they count at
    // most once: sequences shared theirs).
    let held = || warm_gw.health()["kv_pool"]["paged"]["blocks_held"].as_u64();
    if paged {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while held().is_some_and(|h| h > cached) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let held = held().expect("a paged server shows its pool");
        assert!(held > 0 && held <= cached, "{held} blocks held, {pool}");
    } else {
        assert_eq!(held(), None, "{pool}");
    }
    let cold = chat(&Gateway::start(cold), turns, &max_tokens);
    for (turn, ((answer, cached, served), (cold_answer, cold_cached, _))) in
        warm.iter().zip(&cold).enumerate()
    {
        assert!(
            engines(turn).contains(&served.as_str()),
            "turn {turn}: {served}"
        );
        assert_eq!(answer, cold_answer, "turn {turn}: reused KV, same answer");
        assert_eq!(*cold_cached, 0, "turn {turn}: the cache is off");
        if turn > 0 {
            assert!(*cached > 0, "turn {turn} reused nothing: {warm:?}");
        }
    }
}

#[test]
fn a_growing_greedy_chat_reuses_its_prefix_on_the_default_policy() {
    let warm = default_config_on_tiny_model();
    let cold = warm.replace("prefix_cache_entries: 16", "prefix_cache_entries: 0");
    assert_ne!(warm, cold, "config.yaml names prefix_cache_entries");
    // Alone and greedy: prompt lookup while its drafts are accepted, then
    // the fast path; both reuse the prefix.
    warm_and_cold(&warm, &cold, 4, |_| 12, |_| &["lookup", "fastpath"]);
}

#[test]
fn a_growing_greedy_chat_reuses_its_prefix_on_the_speculative_engines() {
    for (kind, drafter) in [("dflash", "{dflash_drafter}"), ("mtp", "{mtp_drafter}")] {
        let config = |entries: usize| {
            format!(
                r#"model: {{ path: "{{model}}", kv_cache_mb: 64, prefix_cache_entries: {entries} }}
engines:
  spec: {{ kind: {kind}, drafter: "{drafter}" }}
policy: {{ default: spec }}
"#
            )
        };
        warm_and_cold(&config(16), &config(0), 3, |_| 12, |_| &["spec"]);
    }
}

/// A server whose KV is paged: the turns alternate between the fast path
/// and the batched engine (two plugins), each starting from the entry the
/// other left, whose blocks it shares (in the one pool, through the C
/// boundary) instead of copying; the answers equal a contiguous server's
/// without the cache. Then the speculative engines on a paged server.
#[test]
fn a_growing_greedy_chat_reuses_its_prefix_across_engines_on_a_paged_server() {
    let config = |layout: &str, entries: usize, engines: &str, policy: &str| {
        format!(
            r#"model: {{ path: "{{model}}", kv_cache_mb: 64, prefix_cache_entries: {entries}, kv_layout: {layout} }}
engines:
{engines}
policy:
{policy}
"#
        )
    };
    let engines = "  batched: { kind: batched }\n  fastpath: { kind: fastpath }";
    let policy = "  default: batched\n  rules:\n    - { name: short, when: { max_tokens: 12 }, route: fastpath }";
    warm_and_cold(
        &config("paged", 16, engines, policy),
        &config("contiguous", 0, engines, policy),
        4,
        |turn| 12 + (turn % 2) as u32,
        |turn| [&["fastpath"], &["batched"]][turn % 2],
    );
    for (kind, drafter) in [("dflash", "{dflash_drafter}"), ("mtp", "{mtp_drafter}")] {
        let engines = format!("  spec: {{ kind: {kind}, drafter: \"{drafter}\" }}");
        warm_and_cold(
            &config("paged", 16, &engines, "  default: spec"),
            &config("contiguous", 0, &engines, "  default: spec"),
            3,
            |_| 12,
            |_| &["spec"],
        );
    }
}

/// A route without fallback to the fast path, right after a batched
/// request: the batched engine must count the request gone before its
/// final event, or the fast path refuses as busy (503).
#[test]
fn the_fast_path_is_free_as_soon_as_a_batched_request_ends() {
    let gw = Gateway::start(
        r#"model: { path: "{model}", kv_cache_mb: 64 }
engines:
  batched: { kind: batched }
  fastpath: { kind: fastpath }
policy:
  default: batched
  rules:
    - { name: to-fastpath, when: { max_tokens: 3 }, route: fastpath }
"#,
    );
    let body = |max_tokens: u32| -> Value {
        json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens,
               "temperature": 0})
    };
    for round in 0..25 {
        let r = gw.post("/v1/completions", &body(2));
        assert_eq!(r.status, 200, "round {round}: {}", r.text());
        assert_eq!(r.header("x-engine"), Some("batched"));
        let r = gw.post("/v1/completions", &body(3));
        assert_eq!(r.status, 200, "round {round}: {}", r.text());
        assert_eq!(r.header("x-engine"), Some("fastpath"));
    }
}

/// `thinking_budget` on a generated model whose chat template opens the
/// think block in the prompt (random weights never close it): reasoning
/// stops after the budget, the gateway closes the block for the model
/// (newline and `</think>`, counted as reasoning, with no logprob: not
/// sampled), and the answer follows in a continuation that starts from the
/// first leg's cached KV. The reasoning is the unbudgeted run's, cut at
/// the budget; the usage counts it all, streamed or not.
#[test]
fn thinking_budget_closes_the_think_block_and_the_answer_follows() {
    let model = e2e_tests::models::tiny_qwen3_thinking();
    let gw = Gateway::start(&format!(
        r#"model: {{ path: "{}", kv_cache_mb: 64 }}
engines:
  batched: {{ kind: batched }}
  fastpath: {{ kind: fastpath }}
policy: {{ default: fastpath, fallback: [batched] }}
"#,
        model.display()
    ));
    let ask = |extra: Value| -> Value {
        let mut body = json!({"model": MODEL, "temperature": 0, "max_tokens": 24, "ignore_eos": true,
            "messages": [{"role": "user", "content": "Think first, then answer: what is two and two?"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = gw.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        if body["stream"] == json!(true) {
            let chunks = e2e_tests::http::json_chunks(&r.sse_data());
            let text = |field: &str| -> String {
                chunks
                    .iter()
                    .filter_map(|c| c["choices"][0]["delta"][field].as_str())
                    .collect()
            };
            json!({"message": {"reasoning_content": text("reasoning_content"), "content": text("content")},
                   "usage": chunks.last().unwrap()["usage"].clone()})
        } else {
            let v = r.json();
            json!({"message": v["choices"][0]["message"].clone(), "usage": v["usage"].clone(),
                   "logprobs": v["choices"][0]["logprobs"].clone()})
        }
    };
    // The tokens (logprobs ask for the batched engine, still greedy).
    let tokens = |v: &Value| -> Vec<(String, Value)> {
        v["logprobs"]["content"]
            .as_array()
            .unwrap_or_else(|| panic!("{v}"))
            .iter()
            .map(|t| {
                (
                    t["token"].as_str().unwrap().to_owned(),
                    t["logprob"].clone(),
                )
            })
            .collect()
    };
    let free = ask(json!({"logprobs": true}));
    assert_eq!(
        free["usage"]["completion_tokens_details"]["reasoning_tokens"], 24,
        "the model never closes the block itself: {free}"
    );
    let budget = 6;
    let cut = ask(json!({"logprobs": true, "thinking_budget": budget}));
    let usage = &cut["usage"];
    assert_eq!(usage["completion_tokens"], 24, "{cut}");
    // The budget's tokens, then the forced newline and closing tag.
    assert_eq!(
        usage["completion_tokens_details"]["reasoning_tokens"],
        budget + 2,
        "{cut}"
    );
    let (free, cut) = (tokens(&free), tokens(&cut));
    assert_eq!(cut.len(), 24);
    assert_eq!(cut[..6], free[..6], "the reasoning up to the budget");
    assert_eq!(
        cut[6..8],
        [
            ("\n".to_owned(), Value::Null),
            ("</think>".to_owned(), Value::Null)
        ],
        "forced, not sampled"
    );
    assert!(
        cut[8..].iter().all(|(_, lp)| lp.is_number()),
        "the answer is the model's"
    );
    // The fast path (plain greedy) the same way, streamed or not.
    let whole = ask(json!({"thinking_budget": budget}));
    let streamed = ask(json!({"thinking_budget": budget, "stream": true,
        "stream_options": {"include_usage": true}}));
    for v in [&whole, &streamed] {
        let details = &v["usage"]["completion_tokens_details"];
        assert_eq!(details["reasoning_tokens"], budget + 2, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");
    }
    assert_eq!(streamed["message"]["content"], whole["message"]["content"]);
}
