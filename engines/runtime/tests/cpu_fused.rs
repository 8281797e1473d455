//! The CPU's one-node RoPE, RMSNorm and attention
//! (`mlx-sys/native/cpu_fused.cpp`) against MLX's own `fast::rope` /
//! `fast::rms_norm` / `fast::scaled_dot_product_attention`, which on the
//! CPU run as their composed fallbacks: every shape the models use
//! (partial rotary dims, one offset or one per row, custom frequencies, a
//! position scale, strided views as the stacked projections and the cache
//! hand over; decode, batched and prefill attention, GQA, masks).

use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::ops::indexing::{Ellipsis, TryIndexOp};
use mlx_rs::{fast, ops, random, Array};
use runtime::cpu_fused::{self, KeysSeen};
use runtime::packed::CpuKernel;

fn close(got: &Array, want: &Array, what: &str) {
    // The same float32 angles (the inverse frequencies come from MLX's own
    // ops), cos and sin from two libraries, sums in another order: a few
    // units in the last place of the largest value.
    close_within(4.0, got, want, what)
}

/// Within `ulps` units in the last place of `want`'s largest value.
fn close_within(ulps: f32, got: &Array, want: &Array, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}");
    let diff = ops::abs(&got.subtract(want).unwrap())
        .unwrap()
        .max(None)
        .unwrap();
    let scale = ops::abs(want).unwrap().max(None).unwrap();
    let (diff, scale) = (diff.item_cast::<f32>(), scale.item_cast::<f32>());
    assert!(
        diff <= ulps * f32::EPSILON * scale.max(1.0),
        "{what}: max |diff| {diff} (scale {scale})"
    );
}

fn normal(shape: &[i32], seed: u64) -> Array {
    random::seed(seed).unwrap();
    random::normal::<f32>(shape, None, None, None).unwrap()
}

#[test]
fn the_fused_nodes_run_here() {
    // The CI machine is a CPU: the nodes must be the ones under test.
    assert!(
        cpu_fused::enabled(),
        "the CPU nodes are not built or not enabled"
    );
}

#[test]
fn rope_matches_mlx() {
    let freqs: Vec<f32> = (0..16)
        .map(|i| 10000f32.powf(i as f32 / 16.0) * 1.5)
        .collect();
    let freqs = Array::from_slice(&freqs, &[16]);
    for (b, n, t, d, dims) in [
        (1, 9, 1, 64, 64),
        (3, 4, 7, 64, 64),
        (2, 2, 33, 128, 64),
        (1, 3, 5, 48, 32),
    ] {
        let x = normal(&[b, n, t, d], (b * n * t * d) as u64);
        let offsets = [
            Array::from_int(0),
            Array::from_int(977),
            Array::from_slice(&(0..b).map(|r| 13 * r + 100).collect::<Vec<_>>(), &[b]),
        ];
        for offset in &offsets {
            for (base, scale, freqs) in [
                (Some(10000f32), 1.0f32, None),
                (Some(500000.0), 0.25, None),
                (None, 1.0, Some(&freqs)),
            ] {
                if freqs.is_some() && dims != 32 {
                    continue;
                }
                assert!(cpu_fused::takes_rope(&x));
                let want = fast::rope_dynamic(&x, dims, false, base, scale, offset, freqs).unwrap();
                let inv = cpu_fused::inverse_frequencies(dims, base, freqs).unwrap();
                let got = cpu_fused::rope(&x, dims, scale, offset, &inv).unwrap();
                close(&got, &want, &format!("rope {b}x{n}x{t}x{d} dims {dims} offset {offset:?} base {base:?} scale {scale}"));
            }
        }
        // A strided view: [B, T, N, D] transposed to [B, N, T, D], as the
        // projections' output is split into heads.
        let bt = normal(&[b, t, n, d], 7)
            .transpose_axes(&[0, 2, 1, 3])
            .unwrap();
        let want =
            fast::rope_dynamic(&bt, dims, false, Some(10000.0), 1.0, &offsets[1], None).unwrap();
        let inv = cpu_fused::inverse_frequencies(dims, Some(10000.0), None).unwrap();
        let got = cpu_fused::rope(&bt, dims, 1.0, &offsets[1], &inv).unwrap();
        close(&got, &want, "rope of a transposed view");
    }
}

#[test]
fn rms_norm_matches_mlx() {
    for shape in [
        vec![1, 1, 576],
        vec![3, 5, 576],
        vec![2, 7, 9, 64],
        vec![4, 33],
    ] {
        let x = normal(&shape, shape.iter().product::<i32>() as u64);
        let d = *shape.last().unwrap();
        let w = normal(&[d], 3);
        for weight in [Some(&w), None] {
            let want = fast::rms_norm(&x, weight, 1e-5).unwrap();
            let got = cpu_fused::rms_norm(&x, weight, 1e-5).unwrap();
            close(
                &got,
                &want,
                &format!("rms_norm {shape:?} weight {}", weight.is_some()),
            );
        }
    }
    // A strided view (the last axis not the fastest).
    let x = normal(&[64, 6], 11).transpose_axes(&[1, 0]).unwrap();
    let w = normal(&[64], 12);
    let want = fast::rms_norm(&x, Some(&w), 1e-6).unwrap();
    close(
        &cpu_fused::rms_norm(&x, Some(&w), 1e-6).unwrap(),
        &want,
        "rms_norm of a transposed view",
    );
}

#[test]
fn other_dtypes_keep_mlx_ops() {
    let x = normal(&[1, 2, 3, 64], 5)
        .as_dtype(mlx_rs::Dtype::Bfloat16)
        .unwrap();
    assert!(!cpu_fused::takes_rope(&x));
    let w = Array::ones::<f32>(&[64])
        .unwrap()
        .as_dtype(mlx_rs::Dtype::Bfloat16)
        .unwrap();
    let got = cpu_fused::rms_norm(&x, Some(&w), 1e-5).unwrap();
    assert_eq!(got.dtype(), mlx_rs::Dtype::Bfloat16);
}

/// Attention's inputs: q `[b, h, n, d]` as the projections hand it over
/// (heads transposed out of `[b, n, h, d]`), k and v `[b, kvh, t, d]`
/// views of a cache with room for more columns, as the cache hands them.
fn attention_inputs(b: i32, h: i32, kvh: i32, n: i32, t: i32, d: i32) -> [Array; 3] {
    let seed = (b * h * kvh * n * t * d) as u64;
    let q = normal(&[b, n, h, d], seed)
        .transpose_axes(&[0, 2, 1, 3])
        .unwrap();
    let cache = |s| {
        normal(&[b, kvh, t + 5, d], s)
            .try_index((.., .., ..t))
            .unwrap()
    };
    [q, cache(seed + 1), cache(seed + 2)]
}

/// MLX's own attention over the keys `seen` says: the reference.
fn mlx_attention(q: &Array, k: &Array, v: &Array, scale: f32, seen: &KeysSeen) -> Array {
    match seen {
        KeysSeen::All => fast::scaled_dot_product_attention(q, k, v, scale, None, None),
        KeysSeen::Causal => fast::scaled_dot_product_attention(
            q,
            k,
            v,
            scale,
            ScaledDotProductAttentionMask::Causal,
            None,
        ),
        KeysSeen::Mask(m) => fast::scaled_dot_product_attention(q, k, v, scale, m, None),
    }
    .unwrap()
}

#[test]
fn attention_matches_mlx_on_every_path() {
    let kernels = CpuKernel::runnable();
    assert!(kernels.contains(&CpuKernel::Scalar));
    // (rows, heads, kv heads, queries, keys, head width): decode steps over
    // short and long contexts, batched rows, a verify's block, prefill
    // chunks with and without a cached prefix (long enough that threads
    // take them; the default model's 249-token chunk at the prompt's start
    // and after 747 positions), GQA ratios 1 to 8, head widths the
    // families use and odd ones. Blocks of 4 and more queries take the
    // lanes (16 a vector on AVX-512, 8 elsewhere) over tiles of 64 keys:
    // counts of queries and keys that fill neither, and 3 queries, which
    // take a dot product per key.
    let shapes = [
        (1, 9, 3, 249, 249, 64),
        (1, 9, 3, 249, 996, 64),
        (1, 4, 1, 70, 133, 128),
        (2, 8, 4, 4, 67, 64),
        (1, 9, 3, 1, 1, 64),
        (1, 9, 3, 1, 300, 64),
        (1, 9, 3, 1, 2000, 64),
        (4, 8, 2, 1, 77, 128),
        (16, 9, 3, 1, 40, 64),
        (2, 4, 1, 8, 50, 256),
        (1, 8, 8, 5, 5, 80),
        (1, 16, 2, 13, 29, 96),
        (1, 9, 3, 64, 64, 64),
        (1, 9, 3, 64, 1000, 64),
        (1, 4, 1, 300, 300, 256),
        (2, 6, 2, 3, 17, 20),
    ];
    for (b, h, kvh, n, t, d) in shapes {
        let [q, k, v] = attention_inputs(b, h, kvh, n, t, d);
        let scale = 1.0 / (d as f32).sqrt();
        // Left padding per row and a sliding window, as a padded batch
        // and Gemma 3's sliding layers get them.
        let starts: Vec<i32> = (0..b).map(|r| (r * 7) % t.max(1)).collect();
        let ragged = runtime::mask::ragged_mask(&starts, n, t, None);
        let windowed = runtime::mask::ragged_mask(&starts, n, t, Some(t.clamp(1, 24)));
        let cases: Vec<(&str, KeysSeen)> = vec![
            ("all keys", KeysSeen::All),
            ("causal", KeysSeen::Causal),
            ("ragged mask", KeysSeen::Mask(ragged)),
            ("windowed mask", KeysSeen::Mask(windowed)),
        ];
        for (what, seen) in &cases {
            let want = mlx_attention(&q, &k, &v, scale, seen);
            assert!(cpu_fused::takes_attention(&q, &k, &v, seen));
            for &kernel in &kernels {
                let got = cpu_fused::attention(&q, &k, &v, scale, seen, Some(kernel)).unwrap();
                // A weighted mean of the values: the same float32 scores
                // summed in another order, exp a polynomial within about 1
                // unit in the last place (the libm's within 0.5), the
                // online softmax's rescaling of a block's sums by exp of
                // the change in its maximum (one more rounding each time
                // it grows), and the division after the sum rather than
                // before it. Each is a few units of the weights, which sum
                // to 1, so of the largest value, whatever the number of
                // keys: 16 is twice the most a query-at-a-time kernel
                // showed here (8: 300 keys of width 256).
                close_within(
                    16.0,
                    &got,
                    &want,
                    &format!("{what}, {b}x{h}/{kvh} heads, {n} of {t} keys, width {d}, {kernel:?}"),
                );
            }
        }
    }
}

#[test]
fn attention_reads_keys_whose_features_are_apart() {
    // k and v as transposed views (each feature of a key a row apart), so
    // every path reads them through their strides, not as adjacent floats.
    let (b, h, kvh, n, t, d) = (1, 4, 2, 20, 90, 64);
    let [q, _, _] = attention_inputs(b, h, kvh, n, t, d);
    let apart = |s| {
        normal(&[b, kvh, d, t], s)
            .transpose_axes(&[0, 1, 3, 2])
            .unwrap()
    };
    let (k, v) = (apart(11), apart(12));
    let scale = 0.125;
    let want = mlx_attention(&q, &k, &v, scale, &KeysSeen::Causal);
    for kernel in CpuKernel::runnable() {
        for queries in [1, n] {
            let q = q.try_index((.., .., (n - queries)..)).unwrap();
            let want = want.try_index((.., .., (n - queries)..)).unwrap();
            let got =
                cpu_fused::attention(&q, &k, &v, scale, &KeysSeen::Causal, Some(kernel)).unwrap();
            close_within(16.0, &got, &want, &format!("{queries} queries, {kernel:?}"));
        }
    }
}

#[test]
fn attention_output_reads_as_heads_side_by_side() {
    // The node lays heads out as `[B, n, H, D]` behind its `[B, H, n, D]`
    // shape; the output projection's transpose and reshape must read it
    // right, as must any op that reads it as it is.
    let [q, k, v] = attention_inputs(2, 4, 2, 3, 9, 64);
    let got = cpu_fused::attention(&q, &k, &v, 0.125, &KeysSeen::Causal, None).unwrap();
    let want = mlx_attention(&q, &k, &v, 0.125, &KeysSeen::Causal);
    let flat = |a: &Array| {
        a.transpose_axes(&[0, 2, 1, 3])
            .unwrap()
            .reshape(&[2, 3, 4 * 64])
            .unwrap()
    };
    close_within(16.0, &flat(&got), &flat(&want), "as heads side by side");
    close_within(
        16.0,
        &got.add(Array::from_f32(1.0)).unwrap(),
        &want.add(Array::from_f32(1.0)).unwrap(),
        "as it is",
    );
}

#[test]
fn attention_refuses_what_it_does_not_take() {
    let [q, k, v] = attention_inputs(1, 4, 2, 2, 5, 64);
    // Half precision and additive masks stay with MLX's ops.
    let half = q.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
    assert!(!cpu_fused::takes_attention(&half, &k, &v, &KeysSeen::All));
    let additive = Array::zeros::<f32>(&[1, 1, 2, 5]).unwrap();
    assert!(!cpu_fused::takes_attention(
        &q,
        &k,
        &v,
        &KeysSeen::Mask(additive)
    ));
    // Shapes that do not fit are errors, not crashes.
    let odd_heads = normal(&[1, 3, 5, 64], 1);
    let err =
        cpu_fused::attention(&q, &odd_heads, &odd_heads, 1.0, &KeysSeen::All, None).unwrap_err();
    assert!(err.to_string().contains("multiple of kv heads"), "{err}");
    let wide_mask = Array::ones::<bool>(&[1, 1, 2, 6]).unwrap();
    let err = cpu_fused::attention(&q, &k, &v, 1.0, &KeysSeen::Mask(wide_mask), None).unwrap_err();
    assert!(err.to_string().contains("broadcast"), "{err}");
}

#[test]
fn gated_activation_matches_mlx() {
    for (shape, inter) in [
        (vec![1, 1], 1536),
        (vec![3, 7], 64),
        (vec![16], 96),
        (vec![2, 5], 13),
    ] {
        let mut full = shape.clone();
        full.push(2 * inter);
        let gu = normal(&full, inter as u64)
            .multiply(Array::from_f32(3.0))
            .unwrap();
        let gate = gu.try_index((Ellipsis, ..inter)).unwrap();
        let up = gu.try_index((Ellipsis, inter..)).unwrap();
        for gelu in [false, true] {
            let want = runtime::activations::gated(&gate, &up, gelu).unwrap();
            let got = cpu_fused::gated_halves(&gu, gelu).unwrap();
            // exp or tanh from another library and the product in another
            // order: a few units in the last place.
            close(&got, &want, &format!("gated {full:?} gelu {gelu}"));
        }
    }
    // A strided view (the features not the fastest axis).
    let gu = normal(&[128, 3], 9).transpose_axes(&[1, 0]).unwrap();
    let want = runtime::activations::gated(
        &gu.try_index((Ellipsis, ..64)).unwrap(),
        &gu.try_index((Ellipsis, 64..)).unwrap(),
        false,
    )
    .unwrap();
    close(
        &cpu_fused::gated_halves(&gu, false).unwrap(),
        &want,
        "gated of a transposed view",
    );
}

#[test]
fn add_and_rms_norm_match_mlx() {
    for shape in [
        vec![1, 1, 576],
        vec![3, 5, 576],
        vec![16, 1, 64],
        vec![4, 33],
    ] {
        let x = normal(&shape, 21);
        let r = normal(&shape, 22);
        let d = *shape.last().unwrap();
        let w = normal(&[d], 23);
        let (h, y) = cpu_fused::add_rms_norm(&x, &r, &w, 1e-5).unwrap();
        let want_h = x.add(&r).unwrap();
        close_within(0.0, &h, &want_h, &format!("add {shape:?}"));
        let want = fast::rms_norm(&want_h, Some(&w), 1e-5).unwrap();
        close(&y, &want, &format!("add + rms_norm {shape:?}"));
    }
    // A strided residual (the features not the fastest axis).
    let x = normal(&[64, 6], 24).transpose_axes(&[1, 0]).unwrap();
    let r = normal(&[6, 64], 25);
    let w = normal(&[64], 26);
    let (h, y) = cpu_fused::add_rms_norm(&x, &r, &w, 1e-6).unwrap();
    let want_h = x.add(&r).unwrap();
    close_within(0.0, &h, &want_h, "add of a transposed view");
    let want = fast::rms_norm(&want_h, Some(&w), 1e-6).unwrap();
    close(&y, &want, "add + rms_norm of a transposed view");
}

/// The values of `a` as bits, so equal means equal to the bit.
fn bits(a: &Array) -> Vec<u32> {
    let a = a.add(Array::from_f32(0.0)).unwrap();
    a.as_slice::<f32>().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn heads_equal_the_unfused_nodes() {
    use runtime::cache::Offsets;
    use runtime::gpu_fused::{HeadsSpec, RopeSpec};
    // (rows, positions, heads, kv heads, head width, rotated dims): the
    // default model's decode step, batched rows, a prefill chunk, GQA 1 to
    // 8, partial rotary dims, odd widths.
    let shapes = [
        (1, 1, 9, 3, 64, 64),
        (4, 1, 9, 3, 64, 64),
        (1, 7, 8, 1, 128, 64),
        (2, 5, 4, 4, 48, 48),
        (3, 2, 6, 2, 20, 12),
    ];
    for (b, l, h, kh, d, dims) in shapes {
        let width = (h + 2 * kh) * d;
        // The stacked product's rows, as a column slice of a wider array
        // (rows apart in memory) and as fresh [B * L, W] rows.
        let wide = normal(&[b * l, width + 6], (b * l * width) as u64)
            .try_index((.., 3..width + 3))
            .unwrap();
        let dense = normal(&[b * l, width], 31);
        let qw = normal(&[d], 32);
        let kw = normal(&[d], 33);
        let per_row = Array::from_slice(&(0..b).map(|r| 17 * r + 5).collect::<Vec<_>>(), &[b]);
        for qkv in [&wide, &dense] {
            for offsets in [
                Offsets::Scalar(0),
                Offsets::Scalar(300),
                Offsets::PerRow(per_row.clone()),
            ] {
                for norms in [None, Some((&qw, &kw, 1e-6f32))] {
                    let spec = HeadsSpec {
                        heads: h,
                        kv_heads: kh,
                        head_dim: d,
                        norms,
                        rope: RopeSpec {
                            dims,
                            base: Some(10000.0),
                            scale: 0.5,
                            freqs: None,
                        },
                    };
                    assert!(cpu_fused::takes_heads(mlx_rs::Dtype::Float32, &spec));
                    let inv = cpu_fused::inverse_frequencies(dims, Some(10000.0), None).unwrap();
                    let (q, k, v) = cpu_fused::heads(qkv, (b, l), &spec, &offsets, &inv).unwrap();
                    // The unfused chain: slice, split into heads, norm,
                    // rotate; and MLX's own ops for the same.
                    let part = |from: i32, n: i32| {
                        qkv.try_index((.., from * d..(from + n) * d))
                            .unwrap()
                            .reshape(&[b, l, n, d])
                            .unwrap()
                            .transpose_axes(&[0, 2, 1, 3])
                            .unwrap()
                    };
                    let offset = offsets.to_array();
                    let what = format!(
                        "{b}x{l} rows, {h}/{kh} heads of {d}, dims {dims}, norms {}",
                        norms.is_some()
                    );
                    for (got, from, n, w) in [(&q, 0, h, &qw), (&k, h, kh, &kw)] {
                        let x = part(from, n);
                        let (ours, mlx) = match norms {
                            Some((_, _, eps)) => (
                                cpu_fused::rms_norm(&x, Some(w), eps).unwrap(),
                                fast::rms_norm(&x, Some(w), eps).unwrap(),
                            ),
                            None => (x.clone(), x.clone()),
                        };
                        let want = cpu_fused::rope(&ours, dims, 0.5, &offset, &inv).unwrap();
                        assert_eq!(bits(got), bits(&want), "{what}: the unfused nodes");
                        let mlx = fast::rope_dynamic(
                            &mlx,
                            dims,
                            false,
                            Some(10000.0),
                            0.5,
                            &offset,
                            None,
                        )
                        .unwrap();
                        close_within(8.0, got, &mlx, &format!("{what}: MLX's ops"));
                    }
                    assert_eq!(bits(&v), bits(&part(h + kh, kh)), "{what}: values");
                }
            }
        }
    }
}

#[test]
fn heads_refuse_what_does_not_fit() {
    use runtime::cache::Offsets;
    use runtime::gpu_fused::{HeadsSpec, RopeSpec};
    let spec = |heads, norms| HeadsSpec {
        heads,
        kv_heads: 1,
        head_dim: 64,
        norms,
        rope: RopeSpec {
            dims: 64,
            base: Some(10000.0),
            scale: 1.0,
            freqs: None,
        },
    };
    let inv = cpu_fused::inverse_frequencies(64, Some(10000.0), None).unwrap();
    let qkv = normal(&[2, 4 * 64], 41);
    // 2 rows of 4 heads of 64 are not 2 rows of 3 + 2 heads.
    let err =
        cpu_fused::heads(&qkv, (2, 1), &spec(3, None), &Offsets::Scalar(0), &inv).unwrap_err();
    assert!(err.to_string().contains("rows of"), "{err}");
    let short = normal(&[32], 42);
    let err = cpu_fused::heads(
        &qkv,
        (2, 1),
        &spec(2, Some((&short, &short, 1e-6))),
        &Offsets::Scalar(0),
        &inv,
    )
    .unwrap_err();
    assert!(err.to_string().contains("[D]"), "{err}");
    // Half precision stays with MLX's ops.
    let half = normal(&[64], 43).as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
    assert!(!cpu_fused::takes_heads(
        mlx_rs::Dtype::Bfloat16,
        &spec(2, None)
    ));
    assert!(!cpu_fused::takes_heads(
        mlx_rs::Dtype::Float32,
        &spec(2, Some((&half, &half, 1e-6)))
    ));
}
