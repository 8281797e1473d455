//! The ragged attention kernels against their reference, on a GPU (issue
//! 18): for each case, the kernel's output, over a contiguous cache and
//! over a paged one whose blocks are scattered through the pool, against
//! MLX's attention under the same mask (`mask::ragged_mask`), computed in
//! float32; then greedy decoding of a padded batch with the kernels (both
//! layouts) against the same decoding with mask arrays, token for token.
//! Exits non-zero on any mismatch.
//!
//!     cargo run --release -p runtime --example ragged_check

use mlx_rs::fast::scaled_dot_product_attention;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, random, Array, Dtype};

use fixtures::model::{random_prompt, write_model, TinySpec};
use runtime::cache::LayerView;
use runtime::mask::{ragged_mask, set_ragged_attention, RaggedAttention};
use runtime::paged::PagePool;
use runtime::slices::slice;
use runtime::{generate, ragged, Family, KvCache, LoadedModel};

struct Case {
    rows: i32,
    heads: i32,
    kv_heads: i32,
    queries: i32,
    total: i32,
    dim: i32,
    window: Option<i32>,
    dtype: Dtype,
}

/// A pool whose free blocks are handed out in a scrambled order, so rows'
/// tables are neither contiguous nor ascending.
fn scrambled_pool(layers: usize, blocks: usize, block: usize, seed: u64) -> PagePool {
    let pool = PagePool::new(layers, blocks, block).unwrap();
    let mut all: Vec<_> = (0..blocks)
        .map(|_| Some(pool.allocate().unwrap()))
        .collect();
    let mut order: Vec<usize> = (0..blocks).collect();
    order.sort_by_key(|&i| (i as u64 * 2654435761 + seed) % 1009);
    for i in order {
        all[i] = None;
    }
    pool
}

/// Max |kernel - reference| over the real queries, for the contiguous
/// cache, the paged one, and the paged one written as the pool's rows
/// (`KvCache::update_rows`) with the output as merged rows.
fn check(c: &Case, seed: u64) -> (f32, f32, f32) {
    let normal = |shape: &[i32], part: u64| {
        let key = random::key(seed * 3 + part).unwrap();
        random::normal::<f32>(shape, None, None, &key)
            .unwrap()
            .as_dtype(c.dtype)
            .unwrap()
    };
    // Queries as attention gets them (a transposed projection), keys and
    // values as strided views of a larger cache buffer.
    let q = normal(&[c.rows, c.queries, c.heads, c.dim], 0)
        .transpose_axes(&[0, 2, 1, 3])
        .unwrap();
    let capacity = c.total + 37;
    let kbuf = normal(&[c.rows, c.kv_heads, capacity, c.dim], 1);
    let vbuf = normal(&[c.rows, c.kv_heads, capacity, c.dim], 2);
    let view = |b: &Array| slice(b, &[0, 0, 0, 0], &[c.rows, c.kv_heads, c.total, c.dim]).unwrap();
    let (k, v) = (view(&kbuf), view(&vbuf));
    // Row starts anywhere in the past, one row unpadded; with a window,
    // also rows whose start is past some queries (padding queries).
    let past = c.total - c.queries;
    let starts: Vec<i32> = (0..c.rows)
        .map(|r| {
            if r == 0 {
                0
            } else {
                (r * 7919 + seed as i32) % (past + 2).max(1)
            }
        })
        .collect();
    let scale = 1.0 / (c.dim as f32).sqrt();
    let meta = ragged::meta(&starts, c.window, c.total);
    let ours = ragged::attention(&q, &k, &v, scale, &meta, None).unwrap();
    let pool = scrambled_pool(1, (c.rows * (c.total / 16 + 2)) as usize, 16, seed);
    let mut cache = KvCache::paged(&pool, vec![None], starts.clone());
    // The paged kernel over a paged cache's view of layer 0.
    let paged_attention = |view: LayerView, merged: Option<&[i32]>| {
        let LayerView::Paged {
            keys,
            values,
            written,
            read,
        } = view
        else {
            panic!("a paged cache gives a paged view")
        };
        ragged::paged_attention(
            &q,
            &keys,
            &values,
            scale,
            &meta,
            &read,
            written.as_ref(),
            merged,
        )
        .unwrap()
    };
    let paged = paged_attention(cache.update(0, k.clone(), v.clone()).unwrap(), None);
    let rows_pool = scrambled_pool(1, (c.rows * (c.total / 16 + 2)) as usize, 16, seed + 1);
    let mut rows_cache = KvCache::paged(&rows_pool, vec![None], starts.clone());
    let as_rows = |x: &Array| {
        x.transpose_axes(&[0, 2, 1, 3])
            .unwrap()
            .reshape(&[c.rows * c.total, 1, c.kv_heads, c.dim])
            .unwrap()
    };
    let merged_shape = [c.rows * c.queries, c.heads * c.dim];
    let rows_view = rows_cache
        .update_rows(0, as_rows(&k), as_rows(&v), c.total)
        .unwrap();
    let merged = paged_attention(rows_view, Some(&merged_shape))
        .reshape(&[c.rows, c.queries, c.heads, c.dim])
        .unwrap()
        .transpose_axes(&[0, 2, 1, 3])
        .unwrap();
    let f = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
    let mask = ragged_mask(&starts, c.queries, c.total, c.window);
    // On the CPU: the GPU's float32 matmuls (TF32) are further off than
    // the kernel.
    let reference = mlx_rs::with_stream(&mlx_rs::Stream::cpu(), || {
        scaled_dot_product_attention(&f(&q), &f(&k), &f(&v), scale, &mask, None).unwrap()
    });
    // A padding query's output is the padding's (the paged cache keeps
    // no padding keys): only real queries are compared.
    let real: Vec<bool> = starts
        .iter()
        .flat_map(|&s| (0..c.queries).map(move |i| past + i >= s))
        .collect();
    let real = Array::from_slice(&real, &[c.rows, 1, c.queries, 1]);
    let diff = |out: &Array| {
        let d = ops::abs(&f(out).subtract(&reference).unwrap()).unwrap();
        let d = ops::select(&real, &d, &Array::from_f32(0.0))
            .unwrap()
            .max(None)
            .unwrap();
        eval([&d]).unwrap();
        d.item_cast::<f32>()
    };
    (diff(&ours), diff(&paged), diff(&merged))
}

fn main() {
    runtime::cuda_env::apply_defaults();
    assert!(runtime::mask::on_gpu(), "ragged_check runs on a GPU");
    let mut failed = 0;
    let mut seed = 1;
    for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
        let tol = if dtype == Dtype::Float32 { 1e-4 } else { 2e-2 };
        for &(dim, heads, kv_heads) in &[(64, 8, 8), (128, 32, 8), (256, 8, 2), (512, 16, 2)] {
            for &(rows, queries, total, window) in &[
                (1, 1, 1, None),
                (1, 8, 300, None),
                (3, 1, 129, None),
                (16, 1, 700, None),
                (4, 16, 64, None),
                (5, 4, 520, Some(128)),
                (2, 16, 40, Some(8)),
                (3, 64, 100, None),
                (2, 200, 260, Some(128)),
                (1, 256, 256, None),
                // Split over blocks: one row or a verify at long contexts.
                (1, 1, 2000, None),
                (1, 1, 4100, Some(1024)),
                (2, 1, 3000, None),
                (1, 8, 2000, None),
                (16, 1, 2100, None),
            ] {
                let case = Case {
                    rows,
                    heads,
                    kv_heads,
                    queries,
                    total,
                    dim,
                    window,
                    dtype,
                };
                seed += 1;
                let (diff, paged, as_rows) = check(&case, seed);
                let ok = diff <= tol && paged <= tol && as_rows <= tol;
                failed += usize::from(!ok);
                println!(
                    "{} {dtype:?} D={dim} heads {heads}/{kv_heads} rows {rows} queries {queries} keys {total} window {window:?}: max |diff| {diff:.2e}, paged {paged:.2e}, paged rows {as_rows:.2e}",
                    if ok { "ok  " } else { "FAIL" }
                );
            }
        }
    }

    // Greedy decoding of a padded batch: the kernel's tokens against the
    // mask arrays'.
    let dir = std::env::temp_dir().join("ragged-check-model");
    write_model(&dir, &TinySpec::tiny(Family::Qwen3)).expect("write model");
    let model = LoadedModel::load(&dir, None).expect("load");
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| random_prompt(i, 3 + 5 * i as usize, 256))
        .collect();
    let pool = scrambled_pool(model.model.config.num_layers as usize, 256, 16, 7);
    let run = |mode, pool| {
        set_ragged_attention(mode);
        let out = generate::greedy_batch_in(&model.model, pool, &prompts, 24, &[]).unwrap();
        set_ragged_attention(RaggedAttention::Auto);
        out
    };
    let masked = run(RaggedAttention::Never, None);
    for (layout, pool) in [("contiguous", None), ("paged", Some(&pool))] {
        let same = run(RaggedAttention::Auto, pool) == masked;
        failed += usize::from(!same);
        println!(
            "{} greedy padded batch of {} rows, 24 steps: kernel tokens ({layout} cache) {} mask-array tokens",
            if same { "ok  " } else { "FAIL" },
            prompts.len(),
            if same { "equal" } else { "differ from" }
        );
    }
    // One unpadded sequence: its decode steps' mask is none, which the
    // paged cache still reads with the kernel.
    let one = &prompts[5..];
    let plain = generate::greedy_batch_in(&model.model, None, one, 24, &[]).unwrap();
    let same = generate::greedy_batch_in(&model.model, Some(&pool), one, 24, &[]).unwrap() == plain;
    failed += usize::from(!same);
    println!(
        "{} greedy single sequence, 24 steps: paged kernel tokens {} contiguous tokens",
        if same { "ok  " } else { "FAIL" },
        if same { "equal" } else { "differ from" }
    );
    if failed > 0 {
        eprintln!("{failed} checks failed");
        std::process::exit(1);
    }
}
