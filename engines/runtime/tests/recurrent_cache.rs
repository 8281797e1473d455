//! A hybrid model's cache (Qwen 3.5: recurrent states beside keys and
//! values) through the operations the engines use: a speculative rollback
//! within the last forward, and rows merged, selected and extracted. Each
//! must give the logits of recomputing the same sequence from scratch.

use fixtures::model::{random_prompt, write_model, TinySpec};
use fixtures::qwen::QwenShape;
use mlx_rs::Array;
use runtime::config::ModelConfig;
use runtime::generate::{prefill, tokens_array};
use runtime::model::{Logits, Model};
use runtime::weights::Weights;
use runtime::KvCache;

fn model() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &TinySpec::qwen(QwenShape::qwen35())).unwrap();
    let w = Weights::from_dir(dir.path()).unwrap();
    let m = Model::load(ModelConfig::from_dir(dir.path()).unwrap(), w).unwrap();
    (dir, m)
}

fn values(a: &Array) -> Vec<f32> {
    a.reshape(&[-1]).unwrap().as_slice::<f32>().to_vec()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Next-token logits after `tokens`, computed from an empty cache.
fn fresh(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache(1);
    values(&prefill(model, &mut cache, tokens, 64).unwrap())
}

#[test]
fn rollback_within_the_last_forward_restores_the_state() {
    let (_dir, model) = model();
    let prompt = random_prompt(1, 12, 512);
    let drafted = random_prompt(2, 5, 512);
    for accepted in [0usize, 2, 5] {
        let mut cache = model.new_cache(1);
        cache.keep_steps(true);
        prefill(&model, &mut cache, &prompt, 64).unwrap();
        // Verify 5 drafted tokens, keep `accepted` of them.
        model
            .forward(&tokens_array(&drafted), &mut cache, Logits::All)
            .unwrap();
        cache.truncate((drafted.len() - accepted) as i32).unwrap();
        let next = 7u32;
        let ours = model
            .forward(&tokens_array(&[next]), &mut cache, Logits::Last)
            .unwrap();
        let mut seq = prompt.clone();
        seq.extend(&drafted[..accepted]);
        seq.push(next);
        let d = max_diff(&values(&ours), &fresh(&model, &seq));
        assert!(d < 1e-4, "accepted {accepted}: logits differ by {d}");
    }
}

#[test]
fn rollback_beyond_the_last_forward_is_refused() {
    let (_dir, model) = model();
    let mut cache = model.new_cache(1);
    prefill(&model, &mut cache, &random_prompt(3, 9, 512), 64).unwrap();
    // Steps not kept: no rollback at all.
    assert!(cache.truncate(1).is_err());
    cache.keep_steps(true);
    model
        .forward(&tokens_array(&[1, 2]), &mut cache, Logits::Last)
        .unwrap();
    let err = cache.truncate(3).unwrap_err().to_string();
    assert!(err.contains("3 positions"), "{err}");
}

#[test]
fn rows_merged_selected_and_extracted_keep_their_states() {
    let (_dir, model) = model();
    let prompts = [random_prompt(4, 6, 512), random_prompt(5, 19, 512)];
    let parts: Vec<KvCache> = prompts
        .iter()
        .map(|p| {
            let mut c = model.new_cache(1);
            prefill(&model, &mut c, p, 64).unwrap();
            c
        })
        .collect();
    let mut batch = KvCache::merge(parts).unwrap();
    let step = Array::from_slice(&[11i32, 13], &[2, 1]);
    let logits = model.forward(&step, &mut batch, Logits::Last).unwrap();
    for (row, (p, t)) in prompts.iter().zip([11u32, 13]).enumerate() {
        let mut seq = p.clone();
        seq.push(t);
        let got = values(&logits.take_axis(Array::from_int(row as i32), 0).unwrap());
        let d = max_diff(&got, &fresh(&model, &seq));
        assert!(d < 1e-4, "merged row {row}: logits differ by {d}");
    }
    // The second row alone, selected and extracted, decodes on.
    let mut alone = batch.extract_row(1).unwrap();
    batch.select_rows(&[1]).unwrap();
    let mut seq = prompts[1].clone();
    seq.extend([13, 17]);
    for cache in [&mut alone, &mut batch] {
        let got = model
            .forward(&tokens_array(&[17]), cache, Logits::Last)
            .unwrap();
        let d = max_diff(&values(&got), &fresh(&model, &seq));
        assert!(d < 1e-4, "selected/extracted row: logits differ by {d}");
    }
}
