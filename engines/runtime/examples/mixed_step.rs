//! Time of one scheduler step on the CPU: `--rows` decode rows (each with a
//! `--context`-token cache) and a `--chunk`-token prompt chunk, as one
//! mixed forward (`Model::forward_mixed`) against the chunk's forward and
//! the batch's decode forward one after the other. Alternated, the median
//! of `--reps` each; the chunk starts a fresh sequence every time.
//!
//!     cargo run --release -p runtime --example mixed_step -- \
//!         [--model models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf] \
//!         [--rows 7] [--context 300] [--chunk 249] [--reps 10]

use std::time::Instant;

use mlx_rs::transforms::eval;
use mlx_rs::Array;
use runtime::generate::{prefill, tokens_array};
use runtime::model::{Logits, Segment};
use runtime::{ComputeDtype, KvCache, LoadedModel};

fn main() -> anyhow::Result<()> {
    use fixtures::args::flag;
    let path = flag(
        "--model",
        "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
    );
    let rows: usize = flag("--rows", "7").parse()?;
    let context: usize = flag("--context", "300").parse()?;
    let chunk: usize = flag("--chunk", "249").parse()?;
    let reps: usize = flag("--reps", "10").parse()?;
    let loaded = LoadedModel::load_as(std::path::Path::new(&path), None, ComputeDtype::Auto)?;
    let m = &loaded.model;
    let prompt = |seed: u64, n: usize| fixtures::model::random_prompt(seed, n, 10_000);
    let mut batch: Option<KvCache> = None;
    for r in 0..rows {
        let mut cache = m.new_cache(1);
        eval([&prefill(
            m,
            &mut cache,
            &prompt(r as u64 + 1, context),
            256,
        )?])?;
        batch = Some(KvCache::join(batch, cache)?);
    }
    let mut batch = batch.expect("--rows above 0");
    let inputs = Array::from_slice(&vec![17i32; rows], &[rows as i32, 1]);
    let chunk_tokens = prompt(999, chunk);
    let (mut mixed, mut separate) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let run_mixed = |batch: &mut KvCache| -> anyhow::Result<f64> {
            let mut fresh = m.new_cache(1);
            let start = Instant::now();
            let mut segments = [
                Segment {
                    tokens: inputs.clone(),
                    cache: batch,
                    logits: true,
                },
                Segment {
                    tokens: tokens_array(&chunk_tokens),
                    cache: &mut fresh,
                    logits: true,
                },
            ];
            let logits = m.forward_mixed(&mut segments)?;
            eval(logits.iter().flatten())?;
            Ok(start.elapsed().as_secs_f64() * 1e3)
        };
        let run_separate = |batch: &mut KvCache| -> anyhow::Result<f64> {
            let mut fresh = m.new_cache(1);
            let start = Instant::now();
            let first = m.forward(&tokens_array(&chunk_tokens), &mut fresh, Logits::Last)?;
            eval([&first])?;
            let next = m.forward(&inputs, batch, Logits::Last)?;
            eval([&next])?;
            Ok(start.elapsed().as_secs_f64() * 1e3)
        };
        let (a, b) = if rep % 2 == 0 {
            let a = run_mixed(&mut batch)?;
            (a, run_separate(&mut batch)?)
        } else {
            let b = run_separate(&mut batch)?;
            (run_mixed(&mut batch)?, b)
        };
        // The first pair warms up.
        if rep > 0 {
            mixed.push(a);
            separate.push(b);
        }
    }
    let median = |mut t: Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let (mixed, separate) = (median(mixed), median(separate));
    println!(
        "rows {rows} x context {context} + chunk {chunk}: mixed {mixed:.1} ms, separate {separate:.1} ms, mixed / separate {:.2}",
        mixed / separate
    );
    Ok(())
}
