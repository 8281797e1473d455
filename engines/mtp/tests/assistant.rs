//! The assistant drafter against the reference: on the same generated
//! weights (a Gemma 4 target, E2B-like with KV-shared layers and 26B-A4B-
//! like with experts, and an assistant in the published
//! `Gemma4AssistantForCausalLM` layout made for it), our drafter drafts the
//! tokens mlx-vlm's `gemma4_assistant` drafts bound to mlx-lm's target
//! (scripts/gemma4_assistant_oracle.py), round after round: after rounds
//! whose drafts were all rejected, some accepted and all accepted, with a
//! chunked prefill, and past the target's sliding window (24 positions);
//! every draft step's logits are within 1e-3 of the reference's (fp32).
//! The E2B-like case also runs with the centroid-masked head
//! (`use_ordered_embeddings`), whose unscored tokens get the reference's
//! value, the smallest scored logit minus one.

use std::path::Path;

use fixtures::gemma4::Gemma4Shape;
use fixtures::model::{greedy_at, load_model, write_model, TinySpec};
use fixtures::mtp::{write_drafter, MaskedHead, TinyAssistant};
use fixtures::reference::{assert_rounds_match, DraftRound};
use mlx_rs::transforms::eval;
use mlx_rs::Array;
use mtp::{Assistant, AssistantConfig};
use runtime::config::ModelConfig;
use runtime::generate::tokens_array;
use runtime::model::{Logits, Model};
use runtime::slices::slice;
use speculative::{DraftSource, Proposal};

/// Drafts accepted per round (whatever the target says), capped at k.
const ACCEPT: [usize; 12] = [0, 1, 3, 0, 2, 3, 3, 0, 1, 3, 3, 0];
const PREFILL_CHUNK: usize = 5;

/// Drafts, committed tokens and each draft step's logits of one round.
type Round = DraftRound;

fn reference(target: &Path, drafter: &Path, prompt: &[u32], k: usize) -> Vec<Round> {
    let req = serde_json::json!({ "model": target, "drafter": drafter, "prompt": prompt,
        "draft_tokens": k, "accept": ACCEPT });
    let v = fixtures::reference::run("gemma4_assistant_oracle.py", &req);
    fixtures::reference::draft_rounds(&v)
}

/// Row `row` of a `[1, L, H]` hidden state, as `[1, 1, H]`.
fn row(h: &Array, row: i32) -> Array {
    slice(h, &[0, row, 0], &[1, row + 1, h.dim(2)]).unwrap()
}

/// The reference's rounds through our target and draft state: a chunked
/// prefill, then each round k drafts (the engine's own `propose`), one
/// verify forward, the forced acceptance and the rollback of the rest.
fn ours(model: &Model, drafter: &Path, prompt: &[u32], k: usize) -> Vec<Round> {
    let source = Assistant::load(drafter, model, k).unwrap();
    let taps = source.taps();
    let mut state = source.start();
    let mut cache = model.new_cache(1);
    let mut last = None;
    for chunk in prompt.chunks(PREFILL_CHUNK) {
        let out = model
            .forward_tapped(&tokens_array(chunk), &mut cache, Logits::Last, &taps)
            .unwrap();
        state.observe(model, &out, 0..chunk.len() as i32).unwrap();
        last = Some(out);
    }
    let out = last.unwrap();
    let h = out.final_hidden.unwrap();
    let mut hidden = row(&h, h.dim(1) - 1);
    let mut history = prompt.to_vec();
    history.push(greedy_at(&out.logits, 0));
    let mut rounds = Vec::new();
    for forced in ACCEPT {
        let newest = *history.last().unwrap();
        let Proposal::Lazy(d) = state.propose(model, &cache, &history, k).unwrap() else {
            panic!("the assistant proposed nothing");
        };
        let (_, logits) = source
            .draft_with_logits(model, &cache, &hidden, newest, k)
            .unwrap();
        eval(logits.iter().chain([&d])).unwrap();
        let drafts: Vec<u32> = d.as_slice::<i32>().iter().map(|&t| t as u32).collect();
        assert_eq!(drafts.len(), k);
        let logits = logits
            .iter()
            .map(|l| l.as_slice::<f32>().to_vec())
            .collect();
        let mut input = vec![newest];
        input.extend(&drafts);
        let out = model
            .forward_tapped(&tokens_array(&input), &mut cache, Logits::All, &taps)
            .unwrap();
        let a = forced.min(k);
        let bonus = greedy_at(&out.logits, a as i32);
        cache.truncate((k - a) as i32).unwrap();
        state.observe(model, &out, 0..a as i32 + 1).unwrap();
        hidden = row(out.final_hidden.as_ref().unwrap(), a as i32);
        let mut committed = drafts[..a].to_vec();
        committed.push(bonus);
        history.extend(&committed);
        rounds.push((drafts, committed, logits));
    }
    rounds
}

/// Our rounds and the reference's for each k, after checking they match.
fn check(
    shape: Gemma4Shape,
    assistant: &TinyAssistant,
    ks: &[usize],
) -> Vec<(Vec<Round>, Vec<Round>)> {
    let tmp = tempfile::tempdir().unwrap();
    let (target, drafter) = (tmp.path().join("target"), tmp.path().join("drafter"));
    let spec = TinySpec::gemma4(shape);
    write_model(&target, &spec).unwrap();
    write_drafter(&target, &drafter, assistant).unwrap();
    let model = load_model(&target);
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 11) % spec.vocab as u32).collect();
    let mut all = Vec::new();
    for &k in ks {
        let theirs = reference(&target, &drafter, &prompt, k);
        let mine = ours(&model, &drafter, &prompt, k);
        assert_eq!(mine.len(), ACCEPT.len());
        let end = prompt.len() + mine.iter().map(|r| r.1.len()).sum::<usize>();
        assert!(
            end > spec.sliding_window as usize + 8,
            "the rounds must run past the sliding window"
        );
        assert_rounds_match(&mine, &theirs, 1e-3, &format!("k = {k}"));
        all.push((mine, theirs));
    }
    all
}

#[test]
fn e2b_like_assistant_drafts_what_mlx_vlm_drafts() {
    check(Gemma4Shape::e2b(6), &TinyAssistant::default(), &[3, 1]);
}

/// The masked head on the E2B-like target: 32 clusters of 16 tokens, the
/// best 4 scored. Its drafts must differ from the dense head's on the same
/// other weights somewhere, or the case could not tell the heads apart.
#[test]
fn e2b_like_assistant_with_the_masked_head_drafts_what_mlx_vlm_drafts() {
    let head = MaskedHead {
        num_centroids: 32,
        top_k: 4,
    };
    let masked = TinyAssistant {
        masked_head: Some(head),
        ..TinyAssistant::default()
    };
    let (mine, theirs) = check(Gemma4Shape::e2b(6), &masked, &[3]).remove(0);
    let (_, dense) = check(Gemma4Shape::e2b(6), &TinyAssistant::default(), &[3]).remove(0);
    assert!(
        theirs.iter().zip(&dense).any(|(m, d)| m.0 != d.0),
        "the masked and the dense head drafted alike: the case shows nothing"
    );
    // The unscored tokens: the same ones, all at the row's minimum.
    let unscored = |row: &[f32]| -> Vec<usize> {
        let min = row.iter().copied().fold(f32::INFINITY, f32::min);
        (0..row.len()).filter(|&i| row[i] == min).collect()
    };
    for (m, t) in mine.iter().zip(&theirs) {
        for (a, b) in m.2.iter().zip(&t.2) {
            let vocab = b.len();
            let scored = vocab / head.num_centroids as usize * head.top_k as usize;
            let (a, b) = (unscored(a), unscored(b));
            assert_eq!(b.len(), vocab - scored, "the reference's unscored tokens");
            assert_eq!(a, b, "the unscored tokens differ from the reference's");
        }
    }
}

#[test]
fn moe_26b_like_assistant_drafts_what_mlx_vlm_drafts() {
    check(Gemma4Shape::moe_26b(4), &TinyAssistant::default(), &[3]);
}

#[test]
fn dense_31b_like_assistant_drafts_what_mlx_vlm_drafts() {
    check(Gemma4Shape::dense_31b(4), &TinyAssistant::default(), &[2]);
}

/// The assistant attends into the target's keys with the target's rope, so
/// a drafter that declares another rope fails at load, naming the field.
#[test]
fn an_assistant_with_another_rope_fails_at_load() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, drafter) = (tmp.path().join("target"), tmp.path().join("drafter"));
    write_model(&target, &TinySpec::gemma4(Gemma4Shape::e2b(6))).unwrap();
    write_drafter(&target, &drafter, &TinyAssistant::default()).unwrap();
    let target_config = ModelConfig::from_dir(&target).unwrap();
    AssistantConfig::load(&drafter, &target_config).expect("the target's own rope loads");
    let path = drafter.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["text_config"]["rope_parameters"]["sliding_attention"]["rope_theta"] = 500.0.into();
    std::fs::write(&path, config.to_string()).unwrap();
    let e = format!(
        "{:#}",
        AssistantConfig::load(&drafter, &target_config).unwrap_err()
    );
    assert!(
        e.contains("rope_parameters.sliding_attention") && e.contains("differs from the target's"),
        "{e}"
    );
}

/// A masked head that is missing, misshapen or holds ids outside the
/// vocabulary, or clusters that do not split the vocabulary, fail at load
/// naming the tensor (and its file) or the config field.
#[test]
fn a_broken_masked_head_fails_at_load() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, drafter) = (tmp.path().join("target"), tmp.path().join("drafter"));
    write_model(&target, &TinySpec::gemma4(Gemma4Shape::e2b(6))).unwrap();
    let spec = TinyAssistant {
        masked_head: Some(MaskedHead {
            num_centroids: 32,
            top_k: 4,
        }),
        ..TinyAssistant::default()
    };
    write_drafter(&target, &drafter, &spec).unwrap();
    let model = load_model(&target);
    Assistant::load(&drafter, &model, 3).expect("the generated head loads");
    let file = drafter.join("model.safetensors");
    let original: Vec<(String, Array)> = Array::load_safetensors(&file)
        .unwrap()
        .into_iter()
        .collect();
    // Read before the file is rewritten (loading is lazy).
    eval(original.iter().map(|(_, a)| a)).unwrap();
    let load = |edit: &dyn Fn(&str, &Array) -> Option<Array>| {
        let tensors: Vec<(String, Array)> = original
            .iter()
            .filter_map(|(n, a)| edit(n, a).map(|a| (n.clone(), a)))
            .collect();
        Array::save_safetensors(tensors.iter().map(|(n, a)| (n, a)), None, &file).unwrap();
        let err = Assistant::load(&drafter, &model, 3)
            .err()
            .expect("a broken head fails");
        format!("{err:#}")
    };
    let (centroids, ordering) = (
        "masked_embedding.centroids.weight",
        "masked_embedding.token_ordering",
    );
    let vocab = model.config.vocab_size;
    let cases: [(&dyn Fn(&str, &Array) -> Option<Array>, &str, &str); 4] = [
        (
            &|n, a| (n != ordering).then(|| a.clone()),
            ordering,
            "missing",
        ),
        (
            &|n, a| {
                Some(match n == centroids {
                    true => slice(a, &[0, 0], &[31, a.dim(1)]).unwrap(),
                    false => a.clone(),
                })
            },
            centroids,
            "[31, 64]",
        ),
        (
            &|n, a| {
                Some(match n == ordering {
                    true => slice(a, &[0], &[vocab - 1]).unwrap(),
                    false => a.clone(),
                })
            },
            ordering,
            "has shape",
        ),
        (
            &|n, a| {
                Some(match n == ordering {
                    true => a
                        .add(Array::from_int(1).as_dtype(a.dtype()).unwrap())
                        .unwrap(),
                    false => a.clone(),
                })
            },
            ordering,
            "outside the vocabulary",
        ),
    ];
    for (edit, name, what) in cases {
        let msg = load(edit);
        assert!(
            msg.contains(name) && msg.contains(what) && msg.contains("drafter"),
            "{msg}"
        );
        if what != "missing" {
            assert!(msg.contains(&file.display().to_string()), "{msg}");
        }
    }
    let original_config = std::fs::read_to_string(drafter.join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&original_config).unwrap();
    config["num_centroids"] = 30.into();
    std::fs::write(drafter.join("config.json"), config.to_string()).unwrap();
    let e = format!(
        "{:#}",
        AssistantConfig::load(&drafter, &model.config).unwrap_err()
    );
    assert!(e.contains("num_centroids (30)"), "{e}");
}
