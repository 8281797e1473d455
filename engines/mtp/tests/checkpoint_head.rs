//! `draft: checkpoint` against the reference: on the same generated Qwen 3.5
//! weights (dense and MoE, with `mtp.*` in Hugging Face's layout), the
//! checkpoint's own MTP head drafts the tokens mlx-vlm's `qwen3_5_mtp`
//! drafter drafts bound to mlx-lm's target (scripts/qwen35_mtp_oracle.py),
//! round after round: after rounds whose drafts were all rejected, some
//! accepted and all accepted, with a chunked prefill; its logits over a
//! prompt are within 1e-3 of the reference's (fp32). And a checkpoint
//! whose head is missing or incomplete fails at load, saying so.

use std::path::Path;

use fixtures::model::{greedy_at, load_model, write_model, TinySpec};
use fixtures::qwen::QwenShape;
use fixtures::reference::{float_rows, token_ids};
use mlx_rs::transforms::eval;
use mlx_rs::Array;
use mtp::CheckpointHead;
use runtime::generate::tokens_array;
use runtime::model::{Logits, Model, MtpHead, Taps};
use speculative::{DraftSource, Proposal};

/// Drafts accepted per round (whatever the target says), capped at k.
const ACCEPT: [usize; 9] = [0, 1, 3, 0, 2, 3, 3, 0, 1];
const PREFILL_CHUNK: usize = 5;

/// Drafts and committed tokens of one round.
type Round = (Vec<u32>, Vec<u32>);

/// The reference's rounds, and its head's logits over the prompt.
fn reference(dir: &Path, prompt: &[u32], k: usize) -> (Vec<Round>, Vec<Vec<f32>>) {
    let req =
        serde_json::json!({ "model": dir, "prompt": prompt, "draft_tokens": k, "accept": ACCEPT });
    let v = fixtures::reference::run("qwen35_mtp_oracle.py", &req);
    let rounds = v["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (token_ids(&r["drafts"]), token_ids(&r["committed"])))
        .collect();
    (rounds, float_rows(&v["prompt_logits"]))
}

/// Our head's float32 logits `[L, V]` over the prompt: each prompt
/// position's target hidden state beside the token after it (the target's
/// greedy token after the last).
fn prompt_logits(model: &Model, dir: &Path, prompt: &[u32]) -> Vec<Vec<f32>> {
    let head = MtpHead::load(model, dir)
        .unwrap()
        .expect("the checkpoint has a head");
    let taps = Taps {
        layers: Vec::new(),
        final_hidden: true,
    };
    let out = model
        .forward_tapped(
            &tokens_array(prompt),
            &mut model.new_cache(1),
            Logits::Last,
            &taps,
        )
        .unwrap();
    let mut next = prompt[1..].to_vec();
    next.push(greedy_at(&out.logits, 0));
    let h = head
        .forward(
            model,
            &tokens_array(&next),
            out.final_hidden.as_ref().unwrap(),
            &mut head.new_cache(),
            0,
        )
        .unwrap();
    let logits = model.logits(&h).unwrap();
    eval([&logits]).unwrap();
    let v = logits.dim(2) as usize;
    logits
        .as_slice::<f32>()
        .chunks(v)
        .map(<[f32]>::to_vec)
        .collect()
}

/// The rounds the reference runs, through our target and draft state: a
/// chunked prefill, then each round k drafts, one verify forward, the
/// forced acceptance and the rollback of the rest.
fn ours(model: &Model, dir: &Path, prompt: &[u32], k: usize) -> Vec<Round> {
    let source = CheckpointHead::load(model, dir, k).unwrap();
    let taps = source.taps();
    let mut state = source.start();
    let mut cache = model.new_cache(1);
    cache.keep_steps(true);
    let mut logits = None;
    for chunk in prompt.chunks(PREFILL_CHUNK) {
        let out = model
            .forward_tapped(&tokens_array(chunk), &mut cache, Logits::Last, &taps)
            .unwrap();
        state.observe(model, &out, 0..chunk.len() as i32).unwrap();
        logits = Some(out.logits);
    }
    let mut history = prompt.to_vec();
    history.push(greedy_at(&logits.unwrap(), 0));
    let mut rounds = Vec::new();
    for forced in ACCEPT {
        let Proposal::Lazy(d) = state.propose(model, &cache, &history, k).unwrap() else {
            panic!("the MTP head proposed nothing");
        };
        eval([&d]).unwrap();
        let drafts: Vec<u32> = d.as_slice::<i32>().iter().map(|&t| t as u32).collect();
        assert_eq!(drafts.len(), k);
        let mut input = vec![*history.last().unwrap()];
        input.extend(&drafts);
        let out = model
            .forward_tapped(&tokens_array(&input), &mut cache, Logits::All, &taps)
            .unwrap();
        let a = forced.min(k);
        let bonus = greedy_at(&out.logits, a as i32);
        cache.truncate((k - a) as i32).unwrap();
        state.observe(model, &out, 0..a as i32 + 1).unwrap();
        let mut committed = drafts[..a].to_vec();
        committed.push(bonus);
        history.extend(&committed);
        rounds.push((drafts, committed));
    }
    rounds
}

fn check(shape: QwenShape, ks: &[usize]) {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinySpec::qwen(shape);
    write_model(tmp.path(), &spec).unwrap();
    let model = load_model(tmp.path());
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 11) % spec.vocab as u32).collect();
    for &k in ks {
        let (theirs, their_logits) = reference(tmp.path(), &prompt, k);
        let my_logits = prompt_logits(&model, tmp.path(), &prompt);
        assert_eq!(my_logits.len(), prompt.len());
        let sizes = |l: &[Vec<f32>]| l.iter().map(Vec::len).collect::<Vec<_>>();
        assert_eq!(sizes(&my_logits), sizes(&their_logits));
        let worst = fixtures::reference::worst_difference(&my_logits, &their_logits);
        assert!(worst < 1e-3, "the head's logits differ by {worst}");
        let mine = ours(&model, tmp.path(), &prompt, k);
        assert_eq!(mine.len(), ACCEPT.len());
        eprintln!("k = {k}: {mine:?}");
        for (r, (m, t)) in mine.iter().zip(&theirs).enumerate() {
            assert_eq!(
                m, t,
                "k = {k}, round {r}: (drafts, committed) differ from mlx-vlm's"
            );
        }
    }
}

#[test]
fn dense_head_drafts_what_mlx_vlm_drafts() {
    check(QwenShape::qwen35().with_mtp(1), &[3, 1]);
}

#[test]
fn two_layer_head_drafts_what_mlx_vlm_drafts() {
    check(QwenShape::qwen35().with_mtp(2), &[3]);
}

#[test]
fn moe_head_drafts_what_mlx_vlm_drafts() {
    check(QwenShape::qwen35_moe().with_mtp(1), &[3]);
}

#[test]
fn missing_incomplete_or_misshapen_heads_fail_at_load() {
    let tmp = tempfile::tempdir().unwrap();
    write_model(tmp.path(), &TinySpec::qwen(QwenShape::qwen35())).unwrap();
    let err = CheckpointHead::load(&load_model(tmp.path()), tmp.path(), 2)
        .err()
        .expect("a checkpoint without mtp.* has no head");
    assert!(format!("{err:#}").contains("no MTP head"), "{err:#}");

    let tmp = tempfile::tempdir().unwrap();
    write_model(tmp.path(), &TinySpec::qwen(QwenShape::qwen35().with_mtp(1))).unwrap();
    let file = tmp.path().join("model.safetensors");
    let original: Vec<(String, Array)> = Array::load_safetensors(&file)
        .unwrap()
        .into_iter()
        .collect();
    // Read before the file is rewritten (loading is lazy).
    eval(original.iter().map(|(_, a)| a)).unwrap();
    let rewrite = |edit: &dyn Fn(&str, &Array) -> Option<Array>| {
        let tensors: Vec<(String, Array)> = original
            .iter()
            .filter_map(|(n, a)| edit(n, a).map(|a| (n.clone(), a)))
            .collect();
        Array::save_safetensors(tensors.iter().map(|(n, a)| (n, a)), None, &file).unwrap();
        let err = CheckpointHead::load(&load_model(tmp.path()), tmp.path(), 2)
            .err()
            .expect("a broken head fails");
        format!("{err:#}")
    };
    let missing = "mtp.layers.0.self_attn.k_proj.weight";
    let msg = rewrite(&|n, a| (n != missing).then(|| a.clone()));
    assert!(msg.contains(missing) && msg.contains("MTP head"), "{msg}");
    let misshapen = "mtp.fc.weight";
    let msg = rewrite(&|n, a| {
        Some(match n == misshapen {
            true => a.transpose().unwrap(),
            false => a.clone(),
        })
    });
    assert!(
        msg.contains(misshapen) && msg.contains("model.safetensors"),
        "{msg}"
    );
}
