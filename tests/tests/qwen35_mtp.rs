//! The mtp engine drafting with the Qwen 3.5 checkpoint's own MTP head
//! (`draft: checkpoint`, no drafter directory) behind the gateway: on
//! generated qwen3_5 and qwen3_5_moe models with `mtp.*` weights its greedy
//! answers over HTTP equal the fast path's token for token, drafts are
//! verified, accepted and rejected (rolling the recurrent states and the
//! head's own keys and values back), and the startup log says the head was
//! found. On a checkpoint without the head the engine fails at startup and
//! /health says why.

use e2e_tests::{models, Gateway};
use fixtures::model::TinySpec;
use fixtures::qwen::QwenShape;
use serde_json::json;
use std::time::Duration;

fn wait_idle(gw: &Gateway) {
    let idle = |g: &Gateway| g.metric("gateway_kv_blocks_allocated", &[]) == Some(0.0);
    assert!(
        gw.wait_for(Duration::from_secs(10), idle),
        "KV blocks stay allocated"
    );
}

/// The engine that answered, the token ids, and the usage.
fn complete(
    gw: &Gateway,
    name: &str,
    prompt: &[u32],
    max_tokens: u32,
) -> (String, Vec<u64>, serde_json::Value) {
    let r = gw.post(
        "/v1/completions",
        &json!({"model": name, "prompt": prompt, "max_tokens": max_tokens,
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

fn lossless_with_the_checkpoint_head(name: &str, shape: QwenShape) {
    let model = models::write(name, &TinySpec::qwen(shape.with_mtp(1)));
    // `mtp` sizes its drafts by measured acceptance; `mtp-full` verifies
    // three drafts every round.
    let config = format!(
        r#"model: {{ path: "{}", kv_cache_mb: 64, kv_block_size: 16 }}
engines:
  fastpath: {{ kind: fastpath }}
  mtp: {{ kind: mtp, draft: checkpoint }}
  mtp-full: {{ kind: mtp, draft: checkpoint, draft_tokens: 3, adaptive: false }}
policy:
  default: fastpath
  rules:
    - {{ name: to-mtp, when: {{ max_tokens: 31 }}, route: mtp }}
    - {{ name: to-mtp-full, when: {{ max_tokens: 33 }}, route: mtp-full }}
"#,
        model.path.display(),
    );
    let gw = Gateway::start(&config);
    assert!(
        gw.logs()
            .contains("drafting with the checkpoint's MTP head"),
        "the startup log does not say the MTP head was found"
    );
    let prompts: Vec<Vec<u32>> = vec![
        vec![5, 9, 14],
        fixtures::model::random_prompt(3, 40, 500),
        [4u32, 8, 15, 16, 23, 42].repeat(5),
        vec![7; 24],
    ];
    let (mut accepted, mut rejected) = (0, 0);
    for prompt in &prompts {
        wait_idle(&gw);
        let (engine, greedy, _) = complete(&gw, name, prompt, 40);
        assert_eq!(engine, "fastpath");
        for (engine_name, max_tokens) in [("mtp", 31), ("mtp-full", 33)] {
            let (engine, ids, usage) = complete(&gw, name, prompt, max_tokens);
            assert_eq!(engine, engine_name);
            assert_eq!(
                ids,
                greedy[..max_tokens as usize],
                "{engine_name} on {prompt:?}"
            );
            let details = &usage["completion_tokens_details"];
            accepted += details["accepted_prediction_tokens"].as_u64().unwrap();
            rejected += details["rejected_prediction_tokens"].as_u64().unwrap();
        }
    }
    eprintln!("{name}: {accepted} drafts accepted, {rejected} rejected");
    assert!(rejected > 0, "no draft was rejected");
    assert!(accepted > 0, "no draft was accepted");
    wait_idle(&gw);
}

#[test]
fn checkpoint_head_is_lossless_on_qwen35() {
    lossless_with_the_checkpoint_head("tiny-qwen35-mtp", QwenShape::qwen35());
}

#[test]
fn checkpoint_head_is_lossless_on_qwen35_moe() {
    lossless_with_the_checkpoint_head("tiny-qwen35-moe-mtp", QwenShape::qwen35_moe());
}

#[test]
fn a_checkpoint_without_a_head_fails_the_engine_and_health_says_why() {
    let model = models::write("tiny-qwen35-no-mtp", &TinySpec::qwen(QwenShape::qwen35()));
    let config = format!(
        r#"model: {{ path: "{}", kv_cache_mb: 64 }}
engines:
  fastpath: {{ kind: fastpath }}
  mtp: {{ kind: mtp, draft: checkpoint }}
policy:
  default: fastpath
"#,
        model.path.display(),
    );
    let gw = Gateway::start(&config);
    let health = gw.health();
    let mtp = health["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "mtp")
        .expect("the mtp engine is listed")
        .clone();
    assert_eq!(mtp["status"], "failed", "{health}");
    assert!(
        mtp["error"].as_str().unwrap().contains("MTP head"),
        "{health}"
    );
    // The others serve.
    let (engine, ids, _) = complete(&gw, "tiny-qwen35-no-mtp", &[5, 9, 14], 8);
    assert_eq!((engine.as_str(), ids.len()), ("fastpath", 8));
}
