//! The GPU's fused kernels ([`runtime::gpu_fused`]) against the MLX ops
//! they replace, on a device:
//!
//!     cargo run --release -p runtime --example fused_check -- [--model DIR --gen 48]
//!
//! First each kernel on random operands, in bfloat16 and float32 (the
//! products in bfloat16 and float16, 1-16 rows, the normed ones 1-4): one
//! position a row and several, per-row positions up to 4,096, RoPE by
//! base and by frequencies. Each line gives the largest difference and
//! how many elements differ at all (a rounding of the sum of squares in
//! another order may move a bfloat16 result by one step). Then, with
//! `--model`, greedy tokens and logits of single steps and of blocks of 8
//! (a verify) with the kernels against without them, of single steps
//! with the norms folded into the products against without, and over a
//! paged cache of single steps with the heads made in attention's kernel
//! against the heads kernel and attention apart, in one process.

use std::path::PathBuf;

use fixtures::args::flag;
use fixtures::reference::{argmax, equal_prefix, logit_rows, worst_difference};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::transforms::eval;
use mlx_rs::{fast, ops, Array, Dtype};
use runtime::cache::Offsets;
use runtime::generate::{prefill, tokens_array};
use runtime::gpu_fused::{self, HeadsSpec, RopeSpec};
use runtime::model::Logits;
use runtime::paged::PagePool;
use runtime::{ComputeDtype, KvCache, LoadedModel, Model};

fn random(shape: &[i32], dtype: Dtype, seed: u64) -> Array {
    mlx_rs::random::seed(seed).unwrap();
    mlx_rs::random::normal::<f32>(shape, None, None, None)
        .unwrap()
        .as_dtype(dtype)
        .unwrap()
}

/// (largest absolute difference, elements that differ, elements).
fn compare(got: &Array, want: &Array) -> (f32, usize, usize) {
    assert_eq!(got.shape(), want.shape(), "shapes");
    // Flattened: a copy, row-contiguous whatever the operand's strides.
    let flat = |x: &Array| x.as_dtype(Dtype::Float32).unwrap().reshape(&[-1]).unwrap();
    let (g, w) = (flat(got), flat(want));
    eval([&g, &w]).unwrap();
    let (g, w) = (g.as_slice::<f32>(), w.as_slice::<f32>());
    let mut worst = 0f32;
    let mut differ = 0;
    for (a, b) in g.iter().zip(w) {
        let d = (a - b).abs();
        worst = worst.max(if d.is_nan() { f32::INFINITY } else { d });
        differ += (a != b) as usize;
    }
    (worst, differ, g.len())
}

fn line(what: &str, got: &Array, want: &Array) {
    let (worst, differ, all) = compare(got, want);
    println!("{what}: largest difference {worst:.3e}, {differ} of {all} elements differ");
}

fn check_heads(dtype: Dtype, l: i32, freqs: bool) {
    let (b, h, hkv, d) = (3, 8, 2, 128);
    let width = (h + 2 * hkv) * d;
    let qkv = random(&[b * l, width], dtype, 1);
    let qw = random(&[d], dtype, 2)
        .multiply(Array::from_f32(0.3).as_dtype(dtype).unwrap())
        .unwrap();
    let kw = random(&[d], dtype, 3);
    let eps = 1e-6;
    let base = 1_000_000.0f32;
    let freq_values: Vec<f32> = (0..d / 2)
        .map(|i| 4.0 * base.powf(2.0 * i as f32 / d as f32))
        .collect();
    let freq_array = Array::from_slice(&freq_values, &[d / 2]);
    let rope = RopeSpec {
        dims: d,
        base: (!freqs).then_some(base),
        scale: 1.0,
        freqs: freqs.then_some(&freq_array),
    };
    let positions = [7i32, 100, 4096];
    let offsets = Offsets::PerRow(Array::from_slice(&positions, &[b]));
    let spec = HeadsSpec {
        heads: h,
        kv_heads: hkv,
        head_dim: d,
        norms: Some((&qw, &kw, eps)),
        rope,
    };
    assert!(
        gpu_fused::takes_heads(dtype, &spec),
        "the kernel takes this layer"
    );
    let (q, k, v) = gpu_fused::heads(&qkv, (b, l), &spec, &offsets, false).unwrap();
    // The pool's rows layout: the same values, `[B * L, 1, kv_heads, D]`.
    let (_, k_rows, v_rows) = gpu_fused::heads(&qkv, (b, l), &spec, &offsets, true).unwrap();
    let as_rows = |x: &Array| {
        x.transpose_axes(&[0, 2, 1, 3])
            .unwrap()
            .reshape(&[b * l, 1, hkv, d])
            .unwrap()
    };
    // MLX's ops, as the model runs them without the kernel.
    let part = |from: i32, n: i32| {
        qkv.try_index((.., from * d..(from + n) * d))
            .unwrap()
            .reshape(&[b, l, n, d])
            .unwrap()
    };
    let offs = Array::from_slice(&positions, &[b]);
    let turn = |x: Array| x.transpose_axes(&[0, 2, 1, 3]).unwrap();
    let rotate = |x: Array| {
        fast::rope_dynamic(
            &x,
            d,
            false,
            (!freqs).then_some(base),
            1.0,
            &offs,
            freqs.then_some(&freq_array),
        )
        .unwrap()
    };
    let want_q = rotate(turn(fast::rms_norm(&part(0, h), Some(&qw), eps).unwrap()));
    let want_k = rotate(turn(fast::rms_norm(&part(h, hkv), Some(&kw), eps).unwrap()));
    let want_v = turn(part(h + hkv, hkv));
    let label = format!(
        "heads {dtype:?}, {l} positions a row, rope by {}",
        if freqs { "frequencies" } else { "base" }
    );
    line(&format!("{label}, q"), &q, &want_q);
    line(&format!("{label}, k"), &k, &want_k);
    line(&format!("{label}, v"), &v, &want_v);
    line(&format!("{label}, k as rows"), &k_rows, &as_rows(&want_k));
    line(&format!("{label}, v as rows"), &v_rows, &as_rows(&want_v));
}

fn check_gated(dtype: Dtype) {
    let (rows, n) = (5, 9728);
    let gu = random(&[rows, 2 * n], dtype, 4)
        .multiply(Array::from_f32(4.0).as_dtype(dtype).unwrap())
        .unwrap();
    let got = gpu_fused::gated(&gu).unwrap();
    let parts = ops::split_equal(&gu, 2, -1).unwrap();
    gpu_fused::set_enabled(false);
    let want = runtime::activations::gated(&parts[0], &parts[1], false).unwrap();
    gpu_fused::set_enabled(true);
    line(&format!("gated {dtype:?}"), &got, &want);
}

fn check_add_norm(dtype: Dtype) {
    let (rows, n) = (5, 2560);
    let x = random(&[rows, n], dtype, 5);
    let r = random(&[rows, n], dtype, 6);
    let w = random(&[n], dtype, 7);
    let (h, y) = gpu_fused::add_rms_norm(&x, &r, &w, 1e-6)
        .expect("the kernel takes it")
        .unwrap();
    let want_h = x.add(&r).unwrap();
    let want_y = fast::rms_norm(&want_h, Some(&w), 1e-6).unwrap();
    line(&format!("add + rms_norm {dtype:?}, sum"), &h, &want_h);
    line(&format!("add + rms_norm {dtype:?}, norm"), &y, &want_y);
}

/// A product by our kernel against MLX's (for the stacked gate/up
/// weight, `gated`: against MLX's product and [`gpu_fused::gated`] after
/// it); MLX's product also against a float32 product of the same operands,
/// the error a rounding costs.
fn check_product(dtype: Dtype, rows: i32, (k, f): (i32, i32), gated: bool) {
    let x = random(&[rows, k], dtype, 8);
    let n = if gated { 2 * f } else { f };
    let w = random(&[n, k], dtype, 9)
        .multiply(Array::from_f32(0.05).as_dtype(dtype).unwrap())
        .unwrap();
    let wt = w.t();
    assert!(
        gpu_fused::takes_product(&x, &wt, gated),
        "the kernel takes {rows} x {k} x {n}"
    );
    let got = gpu_fused::product(&x, &wt, gated).unwrap();
    let product = x.matmul(&wt).unwrap();
    let want = match gated {
        true => gpu_fused::gated(&product).unwrap(),
        false => product.clone(),
    };
    let exact = x
        .as_dtype(Dtype::Float32)
        .unwrap()
        .matmul(&wt.as_dtype(Dtype::Float32).unwrap())
        .unwrap();
    let (mlx, _, _) = compare(&product, &exact);
    let (worst, differ, all) = compare(&got, &want);
    let kind = if gated { "gated product" } else { "product" };
    println!(
        "{kind} {dtype:?} {rows} x {k} x {n}: against MLX's {worst:.3e}, {differ} of {all} differ (MLX's product against float32 {mlx:.3e})"
    );
}

/// The norm folded into a product ([`gpu_fused::normed_product`]) against
/// MLX's chain (the add, `rms_norm`, the product and, `gated`, the
/// activation) and against our kernels' chain ([`gpu_fused::add_rms_norm`]
/// then [`gpu_fused::product`]); `add`: a residual to add first.
fn check_normed_product(dtype: Dtype, rows: i32, (k, f): (i32, i32), gated: bool, add: bool) {
    let x = random(&[rows, k], dtype, 10);
    let r = random(&[rows, k], dtype, 11);
    let nw = random(&[k], dtype, 12);
    let n = if gated { 2 * f } else { f };
    let wt = random(&[n, k], dtype, 13)
        .multiply(Array::from_f32(0.05).as_dtype(dtype).unwrap())
        .unwrap()
        .t();
    let eps = 1e-6;
    let (h, got) = gpu_fused::normed_product(&x, add.then_some(&r), (&nw, eps), &wt, gated)
        .unwrap_or_else(|| panic!("the kernel takes {rows} x {k} x {n}"))
        .unwrap();
    let want_h = if add { x.add(&r).unwrap() } else { x.clone() };
    let normed = fast::rms_norm(&want_h, Some(&nw), eps).unwrap();
    let product = normed.matmul(&wt).unwrap();
    let want = match gated {
        true => gpu_fused::gated(&product).unwrap(),
        false => product,
    };
    let ours = match add {
        true => {
            gpu_fused::add_rms_norm(&x, &r, &nw, eps)
                .unwrap()
                .unwrap()
                .1
        }
        false => normed,
    };
    let ours = match rows > 1 || gated {
        true => gpu_fused::product(&ours, &wt, gated).unwrap(),
        false => want.clone(),
    };
    let (worst, differ, all) = compare(&got, &want);
    let (own, own_differ, _) = compare(&got, &ours);
    let (sum, _, _) = compare(&h, &want_h);
    let kind = match (gated, add) {
        (true, true) => "add + norm + gated product",
        (true, false) => "norm + gated product",
        (false, true) => "add + norm + product",
        (false, false) => "norm + product",
    };
    println!(
        "{kind} {dtype:?} {rows} x {k} x {n}: against MLX's {worst:.3e}, {differ} of {all} differ; against our kernels' chain {own:.3e}, {own_differ} differ; sum {sum:.1e}"
    );
}

/// Greedy tokens and logits, one token a forward (`k` = 1) or teacher
/// forced on `forced` in blocks of `k`.
fn run(
    model: &Model,
    prompt: &[u32],
    gen: usize,
    k: usize,
    forced: &[u32],
) -> (Vec<u32>, Vec<Vec<f32>>) {
    run_on(model, model.new_cache(1), prompt, gen, k, forced)
}

/// [`run`] on `cache`.
fn run_on(
    model: &Model,
    mut cache: KvCache,
    prompt: &[u32],
    gen: usize,
    k: usize,
    forced: &[u32],
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let first = prefill(model, &mut cache, prompt, 512).unwrap();
    let mut all = logit_rows(&first);
    let mut tokens = vec![argmax(&all[0])];
    while all.len() < gen {
        let feed = match k {
            1 => vec![*tokens.last().unwrap()],
            _ => forced[all.len() - 1..(all.len() - 1 + k).min(forced.len())].to_vec(),
        };
        if feed.is_empty() {
            break;
        }
        let logits = model
            .forward(&tokens_array(&feed), &mut cache, Logits::All)
            .unwrap();
        for row in logit_rows(&logits) {
            tokens.push(argmax(&row));
            all.push(row);
        }
    }
    all.truncate(gen);
    tokens.truncate(gen);
    (tokens, all)
}

fn main() {
    runtime::cuda_env::apply_defaults();
    println!("on gpu: {}", runtime::mask::on_gpu());
    for dtype in [Dtype::Bfloat16, Dtype::Float32] {
        for l in [1, 5] {
            check_heads(dtype, l, false);
        }
        check_heads(dtype, 1, true);
        check_gated(dtype);
        check_add_norm(dtype);
    }
    for dtype in [Dtype::Bfloat16, Dtype::Float16] {
        for rows in [1, 3, 4, 8, 16] {
            for shape in [(2560, 9728), (96, 48)] {
                check_product(dtype, rows, shape, true);
            }
            // A plain product of one row stays MLX's (`takes_product`).
            for shape in [(2560, 6144), (4096, 2560), (9728, 2560), (96, 64)] {
                if rows > 1 {
                    check_product(dtype, rows, shape, false);
                }
            }
            // The norm goes into the product up to 4 rows (`normed_product`).
            if rows <= 4 {
                check_normed_product(dtype, rows, (2560, 6144), false, true);
                check_normed_product(dtype, rows, (2560, 6144), false, false);
                check_normed_product(dtype, rows, (2560, 9728), true, true);
                check_normed_product(dtype, rows, (96, 48), true, true);
            }
        }
    }
    let dir = flag("--model", "");
    if dir.is_empty() {
        return;
    }
    let gen: usize = flag("--gen", "48").parse().expect("gen");
    let loaded =
        LoadedModel::load_as(&PathBuf::from(&dir), None, ComputeDtype::Auto).expect("load");
    let prompt = loaded
        .tokenizer
        .encode("Here is a Python function that adds two numbers:", true)
        .expect("encode");
    let model = &loaded.model;
    gpu_fused::set_enabled(false);
    let (want_tokens, want) = run(model, &prompt, gen, 1, &[]);
    gpu_fused::set_enabled(true);
    let (tokens, got) = run(model, &prompt, gen, 1, &[]);
    let same = equal_prefix(&tokens, &want_tokens);
    println!(
        "model {dir} ({:?}): single steps with the kernels, {same} of {gen} greedy tokens equal; worst logit difference {:.3e}",
        model.dtype(),
        worst_difference(&got, &want)
    );
    let (tokens, got) = run(model, &prompt, gen, 8, &want_tokens);
    let same = equal_prefix(&tokens, &want_tokens);
    println!(
        "blocks of 8 with the kernels, teacher forced: {same} of {gen} argmaxes equal; worst logit difference {:.3e}",
        worst_difference(&got, &want)
    );
    gpu_fused::set_normed(false);
    let (unnormed_tokens, unnormed) = run(model, &prompt, gen, 1, &[]);
    gpu_fused::set_normed(true);
    let (tokens, got) = run(model, &prompt, gen, 1, &[]);
    println!(
        "single steps with the norms in the products against without: {} of {gen} greedy tokens equal; worst logit difference {:.3e}",
        equal_prefix(&tokens, &unnormed_tokens),
        worst_difference(&got, &unnormed)
    );
    // Over a paged cache, the heads made in attention's kernel against the
    // heads kernel and attention apart: the same arithmetic, so the same
    // logits, at a short context (a block a query head) and a long one
    // (each query's keys split over blocks).
    let long: Vec<u32> = prompt.iter().cycle().take(1500).copied().collect();
    let pool = PagePool::new(model.num_layers(), 160, 16).expect("pool");
    for (what, prompt) in [("short", &prompt), ("1,500-token", &long)] {
        let [(apart_tokens, apart), (tokens, got)] = [false, true].map(|on| {
            runtime::ragged::set_heads_in_attention(on);
            run_on(
                model,
                model.new_paged_cache(&pool, vec![0]),
                prompt,
                gen,
                1,
                &[],
            )
        });
        println!(
            "paged, {what} prompt: single steps with the heads in attention against apart: {} of {gen} greedy tokens equal; worst logit difference {:.3e}",
            equal_prefix(&tokens, &apart_tokens),
            worst_difference(&got, &apart)
        );
    }
}
