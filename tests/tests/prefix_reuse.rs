//! Prefix reuse on every engine, over HTTP: a growing greedy chat's turns
//! after the first start from the KV its earlier turns left in the shared
//! prefix cache (`usage.prompt_tokens_details.cached_tokens` > 0) on the
//! default policy (a lone greedy chat goes to the fast path) and on the
//! speculative engines, and answer exactly as a gateway without the cache
//! does. Also: the fast path is free the moment a batched request's last
//! byte arrives (no 503 on a route without fallback).

use e2e_tests::{default_config_on_tiny_model, Gateway, MODEL};
use serde_json::{json, Value};

/// A growing chat of `turns` user messages, each answer kept: per turn,
/// the answer, the cached prompt tokens and the engine.
fn chat(gw: &Gateway, turns: usize, max_tokens: u32) -> Vec<(String, u64, String)> {
    let mut messages = Vec::new();
    let mut out = Vec::new();
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": format!(
            "Turn {turn}: tell me something about the number {turn}, in a few plain words please."
        )}));
        let r = gw.post(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": messages, "temperature": 0,
                    "max_tokens": max_tokens}),
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
/// without (`cold`).
fn warm_and_cold(warm: &str, cold: &str, turns: usize, max_tokens: u32, engine: &str) {
    let warm = chat(&Gateway::start(warm), turns, max_tokens);
    let cold = chat(&Gateway::start(cold), turns, max_tokens);
    for (turn, ((answer, cached, served), (cold_answer, cold_cached, _))) in
        warm.iter().zip(&cold).enumerate()
    {
        assert_eq!(served, engine, "turn {turn}");
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
    warm_and_cold(&warm, &cold, 4, 12, "fastpath");
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
        warm_and_cold(&config(16), &config(0), 3, 12, "spec");
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
