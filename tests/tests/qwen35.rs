//! Generated hybrid and MoE Qwen models behind the gateway. Qwen 3.5 (Gated
//! DeltaNet layers with recurrent states between gated attention layers,
//! here the MoE variant with a shared expert): every engine's greedy answer
//! over HTTP equals the fast path's token for token, through chunked
//! prefill, a prefix-cache hit on an exact block-boundary snapshot,
//! speculative rounds whose rejected drafts roll the recurrent state back,
//! concurrent (batched) requests, and a fast-path stream handed over to the
//! batched engine mid-generation, recurrent states and all.
//! Qwen3 MoE: the batched engine and the fast path agree.
//! The mtp engine drafting with the checkpoint's own MTP head
//! (`draft: checkpoint`, no drafter directory) on qwen3_5 and qwen3_5_moe
//! models with `mtp.*` weights: the fast path's answers token for token,
//! drafts accepted and rejected (rolling back the recurrent states and the
//! head's own keys and values), the startup log saying the head was found;
//! without the head the engine fails at startup and /health says why.

use e2e_tests::http::SseStream;
use e2e_tests::{models, Gateway};
use fixtures::model::TinySpec;
use fixtures::qwen::{QwenLayout, QwenShape};
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

#[test]
fn every_engine_answers_like_the_fast_path_on_a_qwen35_moe_model() {
    const NAME: &str = "tiny-qwen35-moe";
    let model = models::write(NAME, &TinySpec::qwen(QwenShape::qwen35_moe()));
    let dflash = models::drafter("dflash", &model.path);
    // Prefill chunks of 8 tokens: long prompts cross several chunks and
    // the 16-token block boundaries the prefix cache snapshots at.
    let config = format!(
        r#"model: {{ path: "{}", kv_cache_mb: 64, kv_block_size: 16 }}
engines:
  batched: {{ kind: batched, prefill_chunk: 8 }}
  fastpath: {{ kind: fastpath }}
  dflash: {{ kind: dflash, drafter: "{}" }}
  lookup: {{ kind: mtp, draft: ngram }}
policy:
  default: batched
  rules:
    - {{ name: to-dflash, when: {{ max_tokens: 31 }}, route: dflash }}
    - {{ name: to-lookup, when: {{ max_tokens: 33 }}, route: lookup }}
    - {{ name: to-fastpath, when: {{ max_tokens: 34 }}, route: fastpath }}
    - {{ name: long-fastpath, when: {{ max_tokens: 400 }}, route: fastpath }}
"#,
        model.path.display(),
        dflash.path.display(),
    );
    let gw = Gateway::start(&config);
    let long: Vec<u32> = fixtures::model::random_prompt(3, 40, 500);
    // A repeating prompt: prompt lookup drafts from it, and the random
    // model rejects most drafts.
    let repeating: Vec<u32> = [4u32, 8, 15, 16, 23, 42].repeat(5);
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 14], long.clone(), repeating, vec![7; 24]];
    let mut oracle = Vec::new();
    let mut rejected = 0;
    for prompt in &prompts {
        wait_idle(&gw);
        let (engine, greedy, _) = complete(&gw, NAME, prompt, 34);
        assert_eq!(engine, "fastpath");
        for (name, max_tokens) in [("dflash", 31), ("lookup", 33), ("batched", 30)] {
            let (engine, ids, usage) = complete(&gw, NAME, prompt, max_tokens);
            assert_eq!(engine, name);
            assert_eq!(ids, greedy[..max_tokens as usize], "{name} on {prompt:?}");
            if prompt == &long {
                // The fast path kept a snapshot at the last block boundary
                // (32) of the 40-token prompt; every engine resumes from it.
                assert_eq!(
                    usage["prompt_tokens_details"]["cached_tokens"], 32,
                    "{name} did not reuse the snapshot"
                );
            }
            rejected += usage["completion_tokens_details"]["rejected_prediction_tokens"]
                .as_u64()
                .unwrap_or(0);
        }
        oracle.push(greedy);
    }
    // Speculative rounds did reject drafts, rolling the states back.
    assert!(rejected > 0, "no draft was rejected");
    // The long prompt again on the fast path: its snapshot is reused whole.
    let (_, again, usage) = complete(&gw, NAME, &long, 34);
    assert_eq!(again, oracle[1]);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 32,
        "the block-boundary snapshot was not reused"
    );
    // A fast-path stream handed over mid-generation (its recurrent states
    // cross the plugin boundary) while all prompts arrive at once, batched
    // (rows join and leave with their states): each answer is as alone.
    wait_idle(&gw);
    let long_run = json!({"model": NAME, "prompt": long, "max_tokens": 400, "ignore_eos": true});
    let r = gw.post("/v1/completions", &long_run);
    assert_eq!(r.header("x-engine"), Some("fastpath"));
    let alone = r.json()["choices"][0]["text"].as_str().unwrap().to_owned();
    wait_idle(&gw);
    let mut body = long_run.clone();
    body["stream"] = json!(true);
    let mut stream = SseStream::open(gw.addr, "/v1/completions", &body);
    assert_eq!(stream.status, 200);
    let mut text = String::new();
    let mut take = |data: &str| {
        if data != "[DONE]" {
            let chunk: serde_json::Value = serde_json::from_str(data).unwrap();
            text.push_str(chunk["choices"][0]["text"].as_str().unwrap_or(""));
        }
    };
    take(&stream.next_event().expect("a first event"));
    let answers: Vec<Vec<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(|| complete(&gw, NAME, p, 30).1))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, a) in answers.iter().enumerate() {
        assert_eq!(a, &oracle[i][..30], "prompt {i} in a batch");
    }
    while let Some(data) = stream.next_event() {
        take(&data);
    }
    assert_eq!(text, alone, "the handed-over stream");
    assert!(
        gw.logged("handed its sequence to the batched engine"),
        "no handover happened"
    );
    wait_idle(&gw);
}

#[test]
fn batched_and_fast_path_agree_on_a_qwen3_moe_model() {
    const NAME: &str = "tiny-qwen3-moe";
    let model = models::write(NAME, &TinySpec::qwen(QwenShape::qwen3_moe()));
    let config = format!(
        r#"model: {{ path: "{}", kv_cache_mb: 64 }}
engines:
  batched: {{ kind: batched }}
  fastpath: {{ kind: fastpath }}
policy:
  default: batched
  rules:
    - {{ name: to-fastpath, when: {{ max_tokens: 34 }}, route: fastpath }}
"#,
        model.path.display(),
    );
    let gw = Gateway::start(&config);
    for prompt in [
        vec![5u32, 9, 14],
        fixtures::model::random_prompt(4, 40, 500),
    ] {
        wait_idle(&gw);
        let (engine, greedy, _) = complete(&gw, NAME, &prompt, 34);
        assert_eq!(engine, "fastpath");
        let (engine, ids, _) = complete(&gw, NAME, &prompt, 30);
        assert_eq!(engine, "batched");
        assert_eq!(ids, greedy[..30]);
    }
}

/// The fast path's answers from `draft: checkpoint` on a model of `shape`
/// with a one-layer MTP head.
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
        gw.logged("drafting with the checkpoint's MTP head"),
        "the startup log does not say the MTP head was found"
    );
    let prompts: Vec<Vec<u32>> = vec![
        vec![5, 9, 14],
        fixtures::model::random_prompt(3, 40, 500),
        [4u32, 8, 15, 16, 23, 42].repeat(5),
        vec![7; 24],
    ];
    let (mut accepted, mut rejected, mut cached) = (0, 0, 0);
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
            cached += usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
        }
    }
    eprintln!("{name}: {accepted} drafts accepted, {rejected} rejected");
    assert!(rejected > 0, "no draft was rejected");
    // The longer prompts resumed from the fast path's prefix snapshots:
    // the head then starts after the cached prefix.
    assert!(cached > 0, "no prefix-cache hit");
    // On random weights the head rarely agrees with the target: the
    // fixed-size engine's drafts (deterministic) include an accepted one.
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

/// A checkpoint without the head: one whose config declares none, and an
/// MLX conversion (mlx-lm keeps `mtp_num_hidden_layers` but drops `mtp.*`).
#[test]
fn a_checkpoint_without_a_head_fails_the_engine_and_health_says_why() {
    let mlx = QwenShape {
        layout: QwenLayout::Mlx,
        ..QwenShape::qwen35().with_mtp(1)
    };
    for (name, shape, why) in [
        ("tiny-qwen35-no-mtp", QwenShape::qwen35(), "declares none"),
        ("tiny-qwen35-mlx-no-mtp", mlx, "no `mtp.*` weights"),
    ] {
        let model = models::write(name, &TinySpec::qwen(shape));
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
        let error = mtp["error"].as_str().unwrap();
        assert!(
            error.contains("MTP head") && error.contains(why),
            "{health}"
        );
        // The others serve.
        let (engine, ids, _) = complete(&gw, name, &[5, 9, 14], 8);
        assert_eq!((engine.as_str(), ids.len()), ("fastpath", 8));
    }
}
