//! The packed-weight product kernel (`mlx-sys/native/packed_matmul.cpp`)
//! on every instruction-set path this CPU runs, against a reference that
//! unpacks MLX's layout itself and sums in f64, and against MLX's own
//! `quantized_matmul`: odd sizes, every group size, 4 and 8 bits, 1 to 64
//! rows. The kernel reads fp16 scales and biases; the references read the
//! same values in fp32, so fp16 adds no error of its own here.

use mlx_rs::{ops, Array, Dtype};
use runtime::packed::{self, Activations, CpuKernel};

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    fixtures::model::xorshift(seed)
        .take(n)
        .map(|s| (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect()
}

/// Packed weights with fp32 scales and biases that fp16 holds exactly (as
/// GGUF's), for the references, and the same in fp16, as the loader keeps
/// them for the kernel.
struct Packed {
    w: Array,
    scales: Array,
    biases: Array,
    half_scales: Array,
    half_biases: Array,
}

fn quantize(out: i32, inp: i32, group: i32, bits: i32, seed: u64) -> Packed {
    let dense = Array::from_slice(&values((out * inp) as usize, seed), &[out, inp]);
    let (w, scales, biases) = ops::quantize(&dense, group, bits).unwrap();
    let half = |a: &Array| a.as_dtype(Dtype::Float16).unwrap();
    let (half_scales, half_biases) = (half(&scales), half(&biases));
    let wide = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
    Packed {
        w,
        scales: wide(&half_scales),
        biases: wide(&half_biases),
        half_scales,
        half_biases,
    }
}

/// `x @ dequantize(w)^T` from the packed bits: element `i` of a row sits in
/// word `i * bits / 32` at bit `(i * bits) % 32`, and is `scale * q + bias`
/// of its group. Returns the product and, per element, the sum of the
/// terms' magnitudes (the scale of fp32 rounding).
fn reference(x: &[f32], m: usize, p: &Packed, group: usize, bits: usize) -> (Vec<f64>, Vec<f64>) {
    let n = p.w.dim(0) as usize;
    let words = p.w.dim(1) as usize;
    let k = words * 32 / bits;
    let w = p.w.as_slice::<u32>();
    let s = p.scales.as_slice::<f32>();
    let b = p.biases.as_slice::<f32>();
    let groups = k / group;
    let (mut y, mut mag) = (vec![0f64; m * n], vec![0f64; m * n]);
    for o in 0..n {
        let row: Vec<f64> = (0..k)
            .map(|i| {
                let bit = i * bits;
                let q = (w[o * words + bit / 32] >> (bit % 32)) & ((1u32 << bits) - 1);
                let g = o * groups + i / group;
                s[g] as f64 * q as f64 + b[g] as f64
            })
            .collect();
        for r in 0..m {
            for (i, wv) in row.iter().enumerate() {
                let t = wv * x[r * k + i] as f64;
                y[r * n + o] += t;
                mag[r * n + o] += t.abs();
            }
        }
    }
    (y, mag)
}

fn assert_matches(got: &Array, want: &[f64], mag: &[f64], what: &str) {
    let got = got.as_slice::<f32>();
    assert_eq!(got.len(), want.len(), "{what}: size");
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        // fp32 sums of k terms in any order: a few ulps of the magnitudes.
        let tol = 1e-5 * m + 1e-6;
        assert!(
            (*g as f64 - w).abs() <= tol,
            "{what}: element {i} is {g}, the reference {w} (tolerance {tol})"
        );
    }
}

fn kernels() -> Vec<CpuKernel> {
    let runnable = CpuKernel::runnable();
    assert!(
        runnable.contains(&CpuKernel::Scalar),
        "the packed kernel is not built (mlx-sys on Linux builds it)"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            assert!(
                runnable.contains(&CpuKernel::Avx2),
                "AVX2 not offered on an AVX2 CPU"
            );
        }
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
            assert!(
                runnable.contains(&CpuKernel::Avx512),
                "AVX-512 not offered on an AVX-512 CPU"
            );
        }
    }
    runnable
}

/// One product of the shape sweep, with its f64 reference.
struct Case<'a> {
    bits: i32,
    group: i32,
    m: i32,
    inp: i32,
    out: i32,
    p: &'a Packed,
    xs: Vec<f32>,
    x: Array,
    want: Vec<f64>,
    mag: Vec<f64>,
}

impl Case<'_> {
    fn what(&self) -> String {
        let (bits, group, m, inp, out) = (self.bits, self.group, self.m, self.inp, self.out);
        format!("bits {bits}, group {group}, {m}x{inp} @ {out}x{inp}^T")
    }

    /// The product with fp16 scales and biases, as the loader keeps them.
    fn run(&self, kernel: CpuKernel, activations: Activations) -> Array {
        let p = self.p;
        self.run_with(kernel, activations, &p.half_scales, &p.half_biases)
    }

    fn run_with(
        &self,
        kernel: CpuKernel,
        activations: Activations,
        scales: &Array,
        biases: &Array,
    ) -> Array {
        let (p, group, bits) = (self.p, self.group, self.bits);
        packed::matmul_with(
            Some(kernel),
            activations,
            &self.x,
            &p.w,
            scales,
            biases,
            group,
            bits,
        )
        .unwrap()
    }
}

/// Every width and group size, odd output counts (the AVX-512 spans take
/// columns 4 and 16 at a time, so these leave them lone columns and
/// partial panels), inputs of 1, 3, 5, 19 and 32 groups (the AVX-512
/// spans widen scales 16 groups at a time: whole sets and a tail), 1 to 64
/// rows (each row count of the AVX-512 4-bit span up to 4, and of a block
/// of the AVX-512 span for many rows, which takes them 16 at a time: 17,
/// 19 and 33 leave it a block of 1 or 3) and 130.
fn each_case(mut check: impl FnMut(&Case)) {
    for bits in [4, 8] {
        for group in [32, 64, 128] {
            for (out, groups_in) in [(1, 1), (7, 3), (33, 5), (97, 1), (5, 19), (3, 32)] {
                let inp = group * groups_in;
                let seed = (bits * 1000 + group * 10 + out) as u64;
                let p = quantize(out, inp, group, bits, seed);
                for m in (1..=17).chain([19, 33, 64, 130]) {
                    let xs = values((m * inp) as usize, seed + m as u64);
                    let x = Array::from_slice(&xs, &[m, inp]);
                    let (want, mag) = reference(&xs, m as usize, &p, group as usize, bits as usize);
                    let p = &p;
                    check(&Case {
                        bits,
                        group,
                        m,
                        inp,
                        out,
                        p,
                        xs,
                        x,
                        want,
                        mag,
                    });
                }
            }
        }
    }
}

#[test]
fn every_path_equals_the_reference_and_mlx_over_many_shapes() {
    let kernels = kernels();
    let mut cases = 0;
    each_case(|c| {
        let what = c.what();
        let mlx = ops::quantized_matmul(
            &c.x,
            &c.p.w,
            &c.p.scales,
            &c.p.biases,
            true,
            c.group,
            c.bits,
        )
        .unwrap();
        assert_matches(&mlx, &c.want, &c.mag, &format!("{what}, MLX"));
        for &kernel in &kernels {
            let y = c.run(kernel, Activations::Float32);
            assert_eq!(y.shape(), &[c.m, c.out]);
            assert_matches(&y, &c.want, &c.mag, &format!("{what}, {}", kernel.name()));
            // fp32 scales and biases of the same values: the same sums.
            for activations in [Activations::Float32, Activations::Int8] {
                let y = c.run(kernel, activations);
                let wide = c.run_with(kernel, activations, &c.p.scales, &c.p.biases);
                assert_eq!(
                    y.as_slice::<f32>(),
                    wide.as_slice::<f32>(),
                    "{what}, {}, {}: fp16 and fp32 scales differ",
                    kernel.name(),
                    activations.name()
                );
            }
            cases += 1;
        }
    });
    assert!(cases >= 2 * 3 * 6 * 21, "{cases} cases run");
}

/// How far the int8 path may be from the exact product: each activation is
/// rounded to a multiple of its block's `d = max|x| / 127` (blocks of 32),
/// so it moves by at most `d / 2` (plus `d * 1e-4` for computing `x * 127 /
/// max|x|` in fp32), and its weight's `scale * q` part multiplies that
/// error (the `bias` part meets the exact sum of its group). Per element:
/// `sum_i |scale_i * q_i| * d_i * (1/2 + 1e-4)`.
fn int8_bound(x: &[f32], m: usize, p: &Packed, group: usize, bits: usize) -> Vec<f64> {
    let n = p.w.dim(0) as usize;
    let words = p.w.dim(1) as usize;
    let k = words * 32 / bits;
    let w = p.w.as_slice::<u32>();
    let s = p.scales.as_slice::<f32>();
    let d: Vec<f64> = x
        .chunks(32)
        .map(|b| b.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0)
        .collect();
    let mut bound = vec![0f64; m * n];
    for o in 0..n {
        for r in 0..m {
            bound[r * n + o] = (0..k)
                .map(|i| {
                    let bit = i * bits;
                    let q = (w[o * words + bit / 32] >> (bit % 32)) & ((1u32 << bits) - 1);
                    let sq = (s[o * (k / group) + i / group] as f64 * q as f64).abs();
                    sq * d[(r * k + i) / 32] * (0.5 + 1e-4)
                })
                .sum();
        }
    }
    bound
}

#[test]
fn int8_activations_stay_within_their_rounding_on_every_path() {
    let kernels = kernels();
    let mut cases = 0;
    each_case(|c| {
        let (m, group, bits) = (c.m as usize, c.group as usize, c.bits as usize);
        let bound = int8_bound(&c.xs, m, c.p, group, bits);
        let what = format!("int8, {}", c.what());
        let (want, mag) = (&c.want, &c.mag);
        let scalar = c.run(CpuKernel::Scalar, Activations::Int8);
        // The rounding shows: the int8 path is not the fp32 one.
        let fp32 = c.run(CpuKernel::Scalar, Activations::Float32);
        assert_ne!(scalar.as_slice::<f32>(), fp32.as_slice::<f32>(), "{what}");
        for &kernel in &kernels {
            let y = c.run(kernel, Activations::Int8);
            assert_eq!(y.shape(), &[c.m, c.out]);
            let got = y.as_slice::<f32>();
            for (i, g) in got.iter().enumerate() {
                let tol = bound[i] + 1e-5 * mag[i] + 1e-6;
                assert!(
                    (*g as f64 - want[i]).abs() <= tol,
                    "{what}, {}: element {i} is {g}, the reference {} (bound {tol})",
                    kernel.name(),
                    want[i]
                );
                // Integer sums are exact: every path agrees with
                // the scalar one to fp32 rounding.
                let s = scalar.as_slice::<f32>()[i] as f64;
                assert!(
                    (*g as f64 - s).abs() <= 1e-5 * mag[i] + 1e-6,
                    "{what}, {}: element {i} is {g}, the scalar path's {s}",
                    kernel.name()
                );
            }
            cases += 1;
        }
    });
    assert!(cases >= 2 * 3 * 6 * 21, "{cases} cases run");
}

#[test]
fn batched_strided_and_half_precision_inputs() {
    let (group, bits, out, inp) = (64, 4, 19, 192);
    let p = quantize(out, inp, group, bits, 7);
    let xs = values((2 * 3 * inp) as usize, 8);
    let (want, mag) = reference(&xs, 6, &p, group as usize, bits as usize);
    let x = Array::from_slice(&xs, &[2, 3, inp]);
    for kernel in kernels() {
        // Leading axes are rows; fp32 scales and biases are cast to fp16
        // in the graph.
        let y = packed::matmul_with(
            Some(kernel),
            Activations::Float32,
            &x,
            &p.w,
            &p.scales,
            &p.biases,
            group,
            bits,
        )
        .unwrap();
        assert_eq!(y.shape(), &[2, 3, out]);
        assert_matches(&y, &want, &mag, &format!("batched, {}", kernel.name()));
        // A transposed view is read through its strides.
        let view = x.transpose_axes(&[1, 0, 2]).unwrap();
        let y = packed::matmul_with(
            Some(kernel),
            Activations::Float32,
            &view,
            &p.w,
            &p.scales,
            &p.biases,
            group,
            bits,
        )
        .unwrap()
        .transpose_axes(&[1, 0, 2])
        .unwrap();
        let y = y.contiguous().unwrap();
        assert_matches(&y, &want, &mag, &format!("strided, {}", kernel.name()));
    }
    // bf16 activations and scales (as a bf16 checkpoint's): the scales cast
    // to fp16 (exact: 8 significant bits in range), the product computed in
    // fp32 and returned in bf16 (MLX's own bf16 product sums in lower
    // precision, so the reference is ours on the bf16-rounded inputs).
    let bf16 = |a: &Array| a.as_dtype(Dtype::Bfloat16).unwrap();
    let widened = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
    let (hx, hs, hb) = (bf16(&x), bf16(&p.scales), bf16(&p.biases));
    let y = packed::matmul(&hx, &p.w, &hs, &hb, group, bits).unwrap();
    assert_eq!(y.dtype(), Dtype::Bfloat16);
    let rounded = Packed {
        w: p.w.clone(),
        scales: widened(&hs),
        biases: widened(&hb),
        half_scales: hs.as_dtype(Dtype::Float16).unwrap(),
        half_biases: hb.as_dtype(Dtype::Float16).unwrap(),
    };
    let hxs = widened(&hx).as_slice::<f32>().to_vec();
    let (want, mag) = reference(&hxs, 6, &rounded, group as usize, bits as usize);
    let got = widened(&y);
    for (i, (g, w)) in got.as_slice::<f32>().iter().zip(&want).enumerate() {
        // bf16 keeps 8 significant bits: half an ulp of the result.
        let tol = w.abs() / 256.0 + 1e-5 * mag[i] + 1e-6;
        assert!(
            (*g as f64 - w).abs() <= tol,
            "bf16: element {i} is {g}, the reference {w}"
        );
    }
}

#[test]
fn unsupported_layouts_are_errors_not_crashes() {
    let p = quantize(8, 64, 32, 4, 3);
    let x = Array::from_slice(&values(64, 4), &[1, 64]);
    let three_bit = packed::matmul(&x, &p.w, &p.scales, &p.biases, 32, 3).unwrap_err();
    assert!(three_bit.what().contains("bits"), "{}", three_bit.what());
    let narrow = Array::from_slice(&values(32, 4), &[1, 32]);
    let mismatch = packed::matmul(&narrow, &p.w, &p.scales, &p.biases, 32, 4).unwrap_err();
    assert!(mismatch.what().contains("features"), "{}", mismatch.what());
    let groups = packed::matmul(&x, &p.w, &p.scales, &p.biases, 64, 4).unwrap_err();
    assert!(groups.what().contains("scales"), "{}", groups.what());
    assert!(packed::supports(4, 64) && packed::supports(8, 128) && !packed::supports(3, 64));
}
