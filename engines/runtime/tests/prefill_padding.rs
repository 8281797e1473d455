//! A prefill padded at its end (as on a GPU, so forward shapes repeat)
//! gives the unpadded prefill's logits and leaves the same cache: greedy
//! steps after it give the same tokens and logits. A hybrid model is not
//! padded (its recurrent state would run through the padding).

use fixtures::model::{random_prompt, write_model, TinySpec};
use fixtures::qwen::QwenShape;
use mlx_rs::transforms::eval;
use mlx_rs::{Array, Dtype};
use runtime::generate::{argmax_tokens, padded_width, prefill_padded};
use runtime::model::Logits;
use runtime::{Family, LoadedModel, Model};

fn values(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).unwrap();
    eval([&a]).unwrap();
    a.as_slice::<f32>().to_vec()
}

/// The prefill's logits, then 8 greedy steps' tokens and logits.
fn run(m: &Model, prompt: &[u32], multiple: usize) -> (i32, Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = m.new_cache(1);
    let mut logits = prefill_padded(m, &mut cache, prompt, 64, multiple).unwrap();
    let len = cache.len();
    let (mut tokens, mut all) = (Vec::new(), Vec::new());
    for _ in 0..8 {
        all.push(values(&logits));
        let next = argmax_tokens(&logits).unwrap();
        eval([&next]).unwrap();
        tokens.push(next.as_slice::<i32>()[0] as u32);
        logits = m.forward(&next, &mut cache, Logits::Last).unwrap();
    }
    (len, tokens, all)
}

#[test]
fn a_prefill_padded_at_its_end_equals_the_unpadded_one() {
    let specs = [
        TinySpec::tiny(Family::Qwen3),
        // Sliding-window layers, prompts past the window.
        TinySpec::tiny(Family::Gemma3),
        TinySpec::qwen(QwenShape::qwen35()),
    ];
    for spec in specs {
        let dir = tempfile::tempdir().unwrap();
        write_model(dir.path(), &spec).unwrap();
        let model = LoadedModel::load(dir.path(), None).unwrap();
        let m = &model.model;
        // One chunk, a width already a multiple, and a full chunk of 64
        // followed by a padded one.
        for len in [5, 37, 64, 70] {
            // The last chunk is padded, except a full one or a hybrid's.
            let last = (len - 1) % 64 + 1;
            let width = padded_width(last, 64, 32, m.is_hybrid());
            assert_eq!(width > last, !m.is_hybrid() && last % 32 != 0, "{len}");
            let prompt = random_prompt(len as u64, len, 500);
            let (plain_len, plain, plain_logits) = run(m, &prompt, 1);
            let (padded_len, padded, padded_logits) = run(m, &prompt, 32);
            assert_eq!(plain_len, len as i32);
            assert_eq!(padded_len, plain_len, "the padding's keys are dropped");
            assert_eq!(padded, plain, "{len}-token prompt");
            let worst = fixtures::reference::worst_difference(&plain_logits, &padded_logits);
            assert!(worst < 1e-4, "{len}-token prompt: logits off by {worst}");
        }
    }
}
