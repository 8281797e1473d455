//! A generated Gemma 4 MoE model (26B-A4B-like: experts beside every MLP,
//! K=V global layers with their own head size, sliding layers with a
//! 24-token window) behind the gateway: every engine's greedy answer over
//! HTTP equals the fast path's token for token, with prompts longer than the
//! window, prefix-cache hits past the window (every engine starting from
//! the KV another engine left in the shared prefix cache) and concurrent
//! (batched) requests.

use e2e_tests::{models, Gateway};
use fixtures::model::TinySpec;
use runtime::Family;
use serde_json::json;
use std::time::Duration;

const NAME: &str = "tiny-gemma4";

/// Until the previous request's KV blocks are back: an engine returns them
/// just after its last event, and the fast path serves only an idle pool.
fn wait_idle(gw: &Gateway) {
    let idle = |g: &Gateway| g.metric("gateway_kv_blocks_allocated", &[]) == Some(0.0);
    assert!(
        gw.wait_for(Duration::from_secs(10), idle),
        "KV blocks stay allocated"
    );
}

/// The engine, the generated ids and the cached prompt tokens.
fn complete(gw: &Gateway, prompt: &[u32], max_tokens: u32) -> (String, Vec<u64>, u64) {
    let r = gw.post(
        "/v1/completions",
        &json!({"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
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
    let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    (engine, ids, cached)
}

#[test]
fn every_engine_answers_like_the_fast_path_on_a_gemma4_moe_model() {
    let model = models::write(NAME, &TinySpec::tiny(Family::Gemma4));
    let dflash = models::drafter("dflash", &model.path);
    let mtp = models::drafter("mtp", &model.path);
    let config = format!(
        r#"model: {{ path: "{}", kv_cache_mb: 64 }}
engines:
  batched: {{ kind: batched }}
  fastpath: {{ kind: fastpath }}
  dflash: {{ kind: dflash, drafter: "{}" }}
  mtp: {{ kind: mtp, drafter: "{}" }}
  lookup: {{ kind: mtp, draft: ngram }}
policy:
  default: batched
  rules:
    - {{ name: to-dflash, when: {{ max_tokens: 31 }}, route: dflash }}
    - {{ name: to-mtp, when: {{ max_tokens: 32 }}, route: mtp }}
    - {{ name: to-lookup, when: {{ max_tokens: 33 }}, route: lookup }}
    - {{ name: to-fastpath, when: {{ max_tokens: 34 }}, route: fastpath }}
"#,
        model.path.display(),
        dflash.path.display(),
        mtp.path.display()
    );
    let gw = Gateway::start(&config);
    let long: Vec<u32> = fixtures::model::random_prompt(3, 40, 500);
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 14], long.clone(), vec![7; 24]];
    let mut oracle = Vec::new();
    for prompt in &prompts {
        wait_idle(&gw);
        let (engine, greedy, cached) = complete(&gw, prompt, 34);
        assert_eq!((engine.as_str(), cached), ("fastpath", 0), "a cold start");
        for (name, max_tokens) in [("dflash", 31), ("mtp", 32), ("lookup", 33), ("batched", 30)] {
            let (engine, ids, cached) = complete(&gw, prompt, max_tokens);
            assert_eq!(engine, name);
            assert_eq!(ids, greedy[..max_tokens as usize], "{name} on {prompt:?}");
            if prompt.len() > 32 {
                // Two 16-token blocks: past the 24-token window.
                assert_eq!(cached, 32, "{name} reused the fast path's prefix");
            }
        }
        oracle.push(greedy);
    }
    // The long prompt again shares its block-aligned prefix with the
    // cached one; then all prompts at once, batched in one forward.
    let (_, again, _) = complete(&gw, &long, 30);
    assert_eq!(again, oracle[1][..30]);
    let answers: Vec<Vec<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(|| complete(&gw, p, 30).1))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, a) in answers.iter().enumerate() {
        assert_eq!(a, &oracle[i][..30], "prompt {i} in a batch");
    }
    wait_idle(&gw);
}
