//! A mixed forward ([`Model::forward_mixed`]) computes what separate
//! forwards do: a decode batch and prompt chunks of other sequences share
//! one stream of rows, each attending only to its own cache. Sequences
//! arrive staggered (two decoding, two more prompts prefilled in chunks
//! beside them, joining the batch as they finish), and every sequence's
//! greedy tokens and logits equal its run alone. A wrong position, mask or
//! row split changes them. On every attention family's layout (sliding
//! windows past the window, q/k norms), a quantized KV cache, and paged KV.

use fixtures::model::{random_prompt, write_model, TinySpec};
use fixtures::reference::{argmax, logit_rows, worst_difference};
use mlx_rs::Array;
use runtime::generate::{prefill, tokens_array};
use runtime::model::{Logits, Segment};
use runtime::paged::PagePool;
use runtime::{Family, KvCache, KvQuant, LoadedModel, Model};

const STEPS: usize = 10;
const CHUNK: usize = 7;

/// A sequence's greedy run alone: its tokens and each pick's logits.
fn alone(m: &Model, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = m.new_cache(1);
    let mut logits = prefill(m, &mut cache, prompt, 64).unwrap();
    let (mut tokens, mut all) = (Vec::new(), Vec::new());
    for _ in 0..STEPS {
        let row = logit_rows(&logits).remove(0);
        tokens.push(argmax(&row));
        all.push(row);
        let next = tokens_array(&[*tokens.last().unwrap()]);
        logits = m.forward(&next, &mut cache, Logits::Last).unwrap();
    }
    (tokens, all)
}

struct Seq {
    prompt: Vec<u32>,
    done: usize,
    cache: Option<KvCache>,
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

/// The staggered run: the first two prompts prefilled alone and joined
/// into the batch, then every step one mixed forward of the batch's decode
/// rows and a chunk of each prompt still catching up (the others start
/// one and two steps later); a prompt that completes takes its first pick
/// from the same forward and joins the batch.
fn staggered(m: &Model, prompts: &[Vec<u32>], new_cache: &dyn Fn() -> KvCache) -> Vec<Seq> {
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .map(|p| Seq {
            prompt: p.clone(),
            done: 0,
            cache: None,
            tokens: Vec::new(),
            logits: Vec::new(),
        })
        .collect();
    let mut batch: Option<KvCache> = None;
    // Indices of `seqs` in the batch's row order.
    let mut order: Vec<usize> = Vec::new();
    for (i, s) in seqs.iter_mut().enumerate().take(2) {
        let mut cache = new_cache();
        let logits = prefill(m, &mut cache, &s.prompt, 64).unwrap();
        let row = logit_rows(&logits).remove(0);
        s.tokens.push(argmax(&row));
        s.logits.push(row);
        s.done = s.prompt.len();
        batch = Some(KvCache::join(batch, cache).unwrap());
        order.push(i);
    }
    let mut step = 0;
    while seqs.iter().any(|s| s.tokens.len() < STEPS) {
        step += 1;
        let inputs: Vec<i32> = order
            .iter()
            .map(|&i| *seqs[i].tokens.last().unwrap() as i32)
            .collect();
        // Prompts 3 and 4 arrive at steps 1 and 2.
        let catching: Vec<usize> = (2..seqs.len())
            .filter(|&i| step > i - 1 && seqs[i].done < seqs[i].prompt.len())
            .collect();
        let mut chunk_caches: Vec<(usize, KvCache, usize)> = catching
            .iter()
            .map(|&i| {
                let s = &mut seqs[i];
                let cache = s.cache.take().unwrap_or_else(new_cache);
                let end = (s.done + CHUNK).min(s.prompt.len());
                (i, cache, end)
            })
            .collect();
        let mut segments = Vec::new();
        if let Some(b) = batch.as_mut() {
            segments.push(Segment {
                tokens: Array::from_slice(&inputs, &[inputs.len() as i32, 1]),
                cache: b,
                logits: true,
            });
        }
        for (i, cache, end) in chunk_caches.iter_mut() {
            let s = &seqs[*i];
            segments.push(Segment {
                tokens: tokens_array(&s.prompt[s.done..*end]),
                cache,
                logits: *end == s.prompt.len(),
            });
        }
        let mut out = m.forward_mixed(&mut segments).unwrap().into_iter();
        drop(segments);
        if !order.is_empty() {
            let decoded = logit_rows(&out.next().unwrap().expect("the batch's logits"));
            for (&i, row) in order.iter().zip(decoded) {
                if seqs[i].tokens.len() < STEPS {
                    seqs[i].tokens.push(argmax(&row));
                    seqs[i].logits.push(row);
                }
            }
        }
        for ((i, cache, end), logits) in chunk_caches.into_iter().zip(out) {
            let s = &mut seqs[i];
            s.done = end;
            match logits {
                None => s.cache = Some(cache),
                Some(l) => {
                    let row = logit_rows(&l).remove(0);
                    s.tokens.push(argmax(&row));
                    s.logits.push(row);
                    batch = Some(KvCache::join(batch.take(), cache).unwrap());
                    order.push(i);
                }
            }
        }
    }
    seqs
}

/// Float32 logits of the same tokens through other groupings of rows: the
/// products' sums round apart by a few ulps (BLAS kernels block by rows).
const TOLERANCE: f32 = 1e-4;

/// With 8-bit keys and values a product's last-ulp difference can move a
/// value across a code boundary: one code step of a key (its group's range
/// over 255) shifts a score by a few 1e-4 at these models' scales, so a
/// logit by about as much (7.2e-4 seen with OpenBLAS's SkylakeX kernels,
/// none with its Haswell ones).
const QUANTIZED_TOLERANCE: f32 = 5e-3;

fn check(name: &str, m: &Model, new_cache: &dyn Fn() -> KvCache) {
    check_within(name, m, new_cache, TOLERANCE)
}

fn check_within(name: &str, m: &Model, new_cache: &dyn Fn() -> KvCache, tolerance: f32) {
    assert!(m.mixes(), "{name}");
    // Two past Gemma's window (24), one chunked across it.
    let prompts: Vec<Vec<u32>> = [(1, 30), (2, 5), (3, 33), (4, 12)]
        .iter()
        .map(|&(seed, len)| random_prompt(seed, len, 500))
        .collect();
    let forwards = m.forwards();
    let mixed = staggered(m, &prompts, new_cache);
    assert!(
        m.forwards() - forwards < 12 + 2 * 3,
        "{name}: the chunks ran beside the decode steps"
    );
    for (k, s) in mixed.iter().enumerate() {
        let (tokens, logits) = alone(m, &s.prompt);
        assert_eq!(s.tokens, tokens, "{name}: sequence {k}'s tokens");
        let worst = worst_difference(&s.logits, &logits);
        assert!(
            worst < tolerance,
            "{name}: sequence {k}'s logits off by {worst}"
        );
    }
}

fn model(spec: &TinySpec, kv: Option<KvQuant>) -> (tempfile::TempDir, LoadedModel) {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), spec).unwrap();
    let mut model = LoadedModel::load(dir.path(), None).unwrap();
    model.model.set_kv_quant(kv).unwrap();
    (dir, model)
}

#[test]
fn a_mixed_forward_equals_separate_forwards_for_staggered_sequences() {
    for family in [Family::Llama, Family::Qwen3, Family::Gemma3] {
        let (_dir, loaded) = model(&TinySpec::tiny(family), None);
        let m = &loaded.model;
        check(&format!("{family:?}"), m, &|| m.new_cache(1));
    }
}

#[test]
fn a_mixed_forward_over_quantized_and_paged_kv_equals_separate_forwards() {
    let quant = KvQuant {
        bits: 8,
        group_size: 32,
    };
    let spec = TinySpec {
        head_dim: 32,
        ..TinySpec::tiny(Family::Qwen3)
    };
    let (_dir, loaded) = model(&spec, Some(quant));
    let m = &loaded.model;
    check_within(
        "qwen3, 8-bit KV",
        m,
        &|| m.new_cache(1),
        QUANTIZED_TOLERANCE,
    );
    let (_dir, loaded) = model(&TinySpec::tiny(Family::Qwen3), None);
    let m = &loaded.model;
    let pool = PagePool::new(m.config.num_layers as usize, 200, 16).unwrap();
    check("qwen3, paged", m, &|| m.new_paged_cache(&pool, vec![0]));
}

#[test]
fn a_hybrid_model_does_not_mix() {
    let (_dir, loaded) = model(&TinySpec::qwen(fixtures::qwen::QwenShape::qwen35()), None);
    assert!(!loaded.model.mixes());
}

#[test]
fn the_default_gguf_mixed_equals_separate_forwards() {
    let gguf = fixtures::reference::default_gguf();
    let loaded = LoadedModel::load_as(&gguf, None, runtime::ComputeDtype::Auto).unwrap();
    let m = &loaded.model;
    check("smollm2 gguf", m, &|| m.new_cache(1));
}
