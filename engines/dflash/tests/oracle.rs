//! The DFlash drafter against the reference: on the same generated weights
//! (a Qwen3 target with a drafter in the published `DFlashDraftModel`
//! layout, and Gemma 4 targets with drafters whose layers but the last
//! attend within a sliding window), our drafter drafts the tokens mlx-vlm's
//! `qwen3_dflash` / `gemma4_dflash` drafters draft bound to mlx-lm's target
//! (scripts/dflash_oracle.py), round after round: after rounds whose drafts
//! were all rejected, some accepted and all accepted, with a chunked
//! prefill, the sliding layers' context running past their window; every
//! round's logits are within 1e-3 of the reference's (fp32). A drafter
//! variant the reference has and we do not fails at load. A checkpoint
//! written by scripts/train_dflash.py (two training steps on a tiny Llama
//! target) drafts the same way.

use std::path::Path;

use dflash::Dflash;
use fixtures::dflash::{write_drafter, TinyDflash};
use fixtures::gemma4::Gemma4Shape;
use fixtures::model::{greedy_at, load_model, write_model, TinySpec};
use fixtures::reference::{assert_rounds_match, DraftRound};
use mlx_rs::transforms::eval;
use mlx_rs::{Array, Dtype};
use runtime::generate::tokens_array;
use runtime::model::{Logits, Model};
use runtime::Family;
use speculative::{DraftSource, DraftState, Proposal};

/// Drafts accepted per round (whatever the target says), capped at k.
const ACCEPT: [usize; 10] = [0, 1, 7, 0, 2, 7, 7, 0, 3, 0];
const PREFILL_CHUNK: usize = 5;
const K: usize = 7;

/// Drafts, committed tokens and the drafter's logits of one round.
type Round = DraftRound;

fn reference(target: &Path, drafter: &Path, prompt: &[u32], gemma4: bool) -> Vec<Round> {
    let req = serde_json::json!({ "model": target, "drafter": drafter, "prompt": prompt,
        "draft_tokens": K, "accept": ACCEPT, "gemma4": gemma4 });
    fixtures::reference::draft_rounds(&fixtures::reference::run("dflash_oracle.py", &req))
}

/// The reference's rounds through our target and draft state: a chunked
/// prefill, then each round K drafts, one verify forward, the forced
/// acceptance and the rollback of the rest.
fn ours(model: &Model, drafter: &Path, prompt: &[u32]) -> Vec<Round> {
    let source = Dflash::load(drafter, model, Some(K)).unwrap();
    let taps = source.taps();
    let mut state = source.state(true);
    let mut cache = model.new_cache(1);
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
        let Proposal::Lazy(d) = state.propose(model, &cache, &history, K).unwrap() else {
            panic!("the drafter proposed nothing");
        };
        let l = state
            .last_logits()
            .unwrap()
            .as_dtype(Dtype::Float32)
            .unwrap();
        eval([&d, &l]).unwrap();
        let drafts: Vec<u32> = d.as_slice::<i32>().iter().map(|&t| t as u32).collect();
        assert_eq!(drafts.len(), K);
        let v = l.dim(2) as usize;
        let l = l.as_slice::<f32>().chunks(v).map(<[f32]>::to_vec).collect();
        let mut input = vec![*history.last().unwrap()];
        input.extend(&drafts);
        let out = model
            .forward_tapped(&tokens_array(&input), &mut cache, Logits::All, &taps)
            .unwrap();
        let a = forced.min(K);
        let bonus = greedy_at(&out.logits, a as i32);
        cache.truncate((K - a) as i32).unwrap();
        state.observe(model, &out, 0..a as i32 + 1).unwrap();
        let mut committed = drafts[..a].to_vec();
        committed.push(bonus);
        history.extend(&committed);
        rounds.push((drafts, committed, l));
    }
    rounds
}

fn check(spec: TinySpec, drafter_spec: TinyDflash, gemma4: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let (target, drafter) = (tmp.path().join("target"), tmp.path().join("drafter"));
    write_model(&target, &spec).unwrap();
    write_drafter(&target, &drafter, &drafter_spec).unwrap();
    compare(&target, &drafter, &spec, gemma4, 4);
}

/// Our drafter's rounds against the reference's on the checkpoint at
/// `drafter` for the target at `target`; the drafts take at least
/// `distinct` values (the logits are compared whatever they are).
fn compare(target: &Path, drafter: &Path, spec: &TinySpec, gemma4: bool, distinct: usize) {
    let model = load_model(target);
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 11) % spec.vocab as u32).collect();
    let theirs = reference(target, drafter, &prompt, gemma4);
    let mine = ours(&model, drafter, &prompt);
    assert_eq!(mine.len(), ACCEPT.len());
    let seen: std::collections::HashSet<_> = mine.iter().flat_map(|r| &r.0).collect();
    assert!(seen.len() >= distinct, "the drafts hardly vary: {seen:?}");
    assert_rounds_match(&mine, &theirs, 1e-3, "dflash");
}

#[test]
fn qwen3_drafter_drafts_what_mlx_vlm_drafts() {
    check(
        TinySpec::tiny(Family::Qwen3),
        spread(TinyDflash::default()),
        false,
    );
}

/// A window of 10 keeps 8 earlier context positions: the prompt alone (13)
/// runs past it, and the rounds' contexts (1 to 8 positions) come to it
/// from both sides.
fn sliding() -> TinyDflash {
    spread(TinyDflash {
        layers: 3,
        sliding_window: Some(10),
        ..TinyDflash::default()
    })
}

/// Gemma scales its embeddings up (by 8 here): wider still.
fn gemma(spec: TinyDflash) -> TinyDflash {
    TinyDflash { std: 1.0, ..spec }
}

/// Weights wide enough that the drafts vary (not only the mask token).
fn spread(spec: TinyDflash) -> TinyDflash {
    TinyDflash { std: 0.3, ..spec }
}

#[test]
fn gemma4_e2b_sliding_drafter_drafts_what_mlx_vlm_drafts() {
    check(
        TinySpec::gemma4(Gemma4Shape::e2b(6)),
        gemma(sliding()),
        true,
    );
}

#[test]
fn gemma4_moe_sliding_drafter_drafts_what_mlx_vlm_drafts() {
    check(
        TinySpec::gemma4(Gemma4Shape::moe_26b(4)),
        gemma(sliding()),
        true,
    );
}

/// The training script's checkpoint (its own check compares the script's
/// drafter with mlx-vlm's on it, `--check-reference`) loads here and
/// drafts what mlx-vlm's drafter drafts.
#[test]
fn trained_checkpoint_drafts_what_mlx_vlm_drafts() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, drafter) = (tmp.path().join("target"), tmp.path().join("drafter"));
    let spec = TinySpec::tiny(Family::Llama);
    write_model(&target, &spec).unwrap();
    // Token ids stand in for rendered chats: the script tokenizes only
    // when no --prompt-ids file exists.
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|p| (0..10 + p).map(|i| (i * 29 + p * 7 + 3) % 500).collect())
        .collect();
    let ids = tmp.path().join("prompts.json");
    let set = serde_json::json!({"prompts": prompts, "stops": [0], "mask_token_id": 511});
    std::fs::write(&ids, set.to_string()).unwrap();
    let status = std::process::Command::new(fixtures::reference::python())
        .arg(fixtures::reference::repo_root().join("scripts/train_dflash.py"))
        .args([
            "--model",
            target.to_str().unwrap(),
            "--out",
            drafter.to_str().unwrap(),
        ])
        .args([
            "--prompt-ids",
            ids.to_str().unwrap(),
            "--prompts",
            "4",
            "--held-out",
            "2",
        ])
        .args([
            "--gen", "12", "--steps", "8", "--lr", "0.05", "--layers", "2", "--block", "8",
        ])
        .args([
            "--batch",
            "2",
            "--anchors",
            "4",
            "--minutes",
            "5",
            "--check-reference",
        ])
        .status()
        .expect("run scripts/train_dflash.py");
    assert!(status.success(), "train_dflash.py failed");
    // Trained on a random target's repetitive answers, it may draft one
    // favourite token: its logits are what this compares.
    compare(&target, &drafter, &spec, false, 1);
}

#[test]
fn drafter_variants_we_do_not_run_fail_at_load() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, drafter) = (tmp.path().join("target"), tmp.path().join("drafter"));
    write_model(&target, &TinySpec::tiny(Family::Qwen3)).unwrap();
    write_drafter(&target, &drafter, &sliding()).unwrap();
    let model = load_model(&target);
    let file = drafter.join("config.json");
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let fails = |edit: &dyn Fn(&mut serde_json::Value), expect: &str| {
        let mut c = original.clone();
        edit(&mut c);
        std::fs::write(&file, c.to_string()).unwrap();
        let err = format!("{:#}", Dflash::load(&drafter, &model, None).err().unwrap());
        assert!(err.contains(expect), "{err}");
    };
    fails(
        &|c| c["dflash_config"]["causal"] = true.into(),
        "dflash_config.causal",
    );
    fails(
        &|c| c["dflash_config"]["draft_window_size"] = 64.into(),
        "draft_window_size",
    );
    fails(
        &|c| {
            c.as_object_mut()
                .unwrap()
                .remove("sliding_window")
                .map(drop)
                .unwrap()
        },
        "no sliding_window",
    );
    let missing = "layers.0.self_attn.k_proj.weight";
    std::fs::write(&file, original.to_string()).unwrap();
    let weights = drafter.join("model.safetensors");
    let kept: Vec<(String, Array)> = Array::load_safetensors(&weights)
        .unwrap()
        .into_iter()
        .filter(|(n, _)| n != missing)
        .collect();
    eval(kept.iter().map(|(_, a)| a)).unwrap();
    Array::save_safetensors(kept.iter().map(|(n, a)| (n, a)), None, &weights).unwrap();
    let err = format!("{:#}", Dflash::load(&drafter, &model, None).err().unwrap());
    assert!(err.contains(missing), "{err}");
}
