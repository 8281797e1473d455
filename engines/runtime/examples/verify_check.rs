//! Whether a verify forward (several new tokens in one forward, as the
//! speculative engines run it) gives what single decode steps give on this
//! device, on a real checkpoint, and whether that depends on the thread:
//!
//!     cargo run --release -p runtime --example verify_check -- --model DIR [--gen 48 --dtype auto]
//!
//! First the reference: greedy tokens and their logits from single,
//! unpipelined steps on the main thread. Then, teacher-forced on those
//! tokens, forwards of blocks of `k` (1, 2, 4, 8) new tokens after the
//! prompt: each block's argmax at every position must be the reference's
//! next token. Then the same on a thread of its own (as engines run). Each
//! line gives the first position that differs and the largest logit
//! difference against the reference.

use std::path::PathBuf;

use fixtures::args::flag;
use fixtures::reference::{argmax, equal_prefix, logit_rows, worst_difference};
use runtime::generate::{prefill, tokens_array};
use runtime::model::Logits;
use runtime::{ComputeDtype, LoadedModel, Model};

const PROMPT: &str = "Here is a Python function:\n\ndef add(a, b):\n    return a + b\n\nRename `add` to `plus` and return the complete function.";

/// Greedy tokens by single steps, with each step's logits.
fn reference(model: &Model, prompt: &[u32], gen: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = model.new_cache(1);
    let mut logits = prefill(model, &mut cache, prompt, 512).unwrap();
    let (mut tokens, mut all) = (Vec::new(), Vec::new());
    for _ in 0..gen {
        let row = logit_rows(&logits).remove(0);
        let t = argmax(&row);
        tokens.push(t);
        all.push(row);
        logits = model
            .forward(&tokens_array(&[t]), &mut cache, Logits::Last)
            .unwrap();
    }
    (tokens, all)
}

/// Teacher-forced blocks of `k` new tokens: (first position whose argmax
/// differs from the reference, worst logit difference).
fn blocks(
    model: &Model,
    prompt: &[u32],
    tokens: &[u32],
    want: &[Vec<f32>],
    k: usize,
) -> (Option<usize>, f32) {
    let mut cache = model.new_cache(1);
    let first = prefill(model, &mut cache, prompt, 512).unwrap();
    let mut got = logit_rows(&first);
    let mut at = 0;
    // Each block feeds tokens[at..at + k] and predicts tokens[at + 1..=at + k].
    while at + k < tokens.len() {
        let logits = model
            .forward(&tokens_array(&tokens[at..at + k]), &mut cache, Logits::All)
            .unwrap();
        got.extend(logit_rows(&logits));
        at += k;
    }
    got.truncate(want.len());
    let first_bad = (0..got.len()).find(|&i| argmax(&got[i]) != tokens[i]);
    (first_bad, worst_difference(&got, want))
}

fn report(label: &str, model: &Model, prompt: &[u32], tokens: &[u32], want: &[Vec<f32>]) {
    for k in [1, 2, 4, 8] {
        let (bad, worst) = blocks(model, prompt, tokens, want, k);
        let verdict = match bad {
            None => "argmax equal".to_string(),
            Some(i) => format!("argmax differs from position {i}"),
        };
        println!("{label}, blocks of {k}: {verdict}; worst logit difference {worst:.3e}");
    }
}

fn main() {
    runtime::cuda_env::apply_defaults();
    let dir = PathBuf::from(flag("--model", ""));
    assert!(!dir.as_os_str().is_empty(), "--model DIR is required");
    let gen: usize = flag("--gen", "48").parse().expect("gen");
    let dtype: ComputeDtype = flag("--dtype", "auto").parse().expect("dtype");
    let loaded = LoadedModel::load_as(&dir, None, dtype).expect("load");
    let rendered = loaded
        .template
        .as_ref()
        .expect("a chat template")
        .render(
            &[serde_json::json!({"role": "user", "content": PROMPT})],
            &text::template::RenderOptions::default().with_generation_prompt(),
        )
        .expect("render");
    let prompt = loaded.tokenizer.encode_chat(&rendered).expect("encode");
    let model = &loaded.model;
    println!(
        "model {} ({:?}), prompt {} tokens, on gpu: {}",
        dir.display(),
        model.dtype(),
        prompt.len(),
        runtime::mask::on_gpu()
    );
    let (tokens, want) = reference(model, &prompt, gen);
    println!("reference: {:?}", loaded.tokenizer.decode(&tokens, false));
    report("main thread", model, &prompt, &tokens, &want);
    // `LoadedModel` is what engines share across threads.
    let shared = &loaded;
    std::thread::scope(|s| {
        s.spawn(|| {
            let model = &shared.model;
            let (again, _) = reference(model, &prompt, gen);
            let same = equal_prefix(&again, &tokens);
            println!("own thread, single steps: {same} of {gen} tokens equal the main thread's");
            report("own thread", model, &prompt, &tokens, &want);
        });
    });
}
