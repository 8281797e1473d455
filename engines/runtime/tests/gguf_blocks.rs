//! GGUF's quantized blocks as the loader turns them into MLX affine groups
//! (`engines/runtime/src/gguf/blocks.rs`): random blocks of every type,
//! dequantized from the groups they become, against llama.cpp's own Python
//! dequantization (`gguf.quants`, run by `scripts/ggml_dequantize.py`):
//! equal to fp32 rounding where the conversion is exact, and for Q6_K's
//! groups that have no common grid within the half step its docs state.
//! Then the packed kernel's products over those groups, on every
//! instruction-set path this CPU runs, against an f64 product of the same
//! values.

use half::f16;
use mlx_rs::{ops, Array, Dtype};
use runtime::gguf::blocks::{self, Loaded};
use runtime::gguf::{TensorInfo, TensorType};
use runtime::packed::{self, Activations, CpuKernel};

const ROWS: usize = 6;
const COLS: usize = 512;
const GROUP: usize = 32;

/// Deterministic bytes.
fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 32) as u8
        })
        .collect()
}

fn put(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// `ROWS x COLS` random blocks of `ty` with sane fp16 fields. Of Q6_K's
/// super-blocks, one in four has equal scales in each pair of sub-blocks
/// and one in four a pair's second scale twice the first (groups on a
/// common grid, converted exactly); the rest have random pairs.
fn random_blocks(ty: TensorType, seed: u64) -> Vec<u8> {
    let (per, size) = ty.block();
    let mut out = noise(seed, ROWS * COLS / per * size);
    for (i, b) in out.chunks_exact_mut(size).enumerate() {
        let d = 0.002 + 0.0007 * (i % 11) as f32;
        match ty {
            TensorType::Q6K => {
                put(b, 208, d);
                for j in 0..8 {
                    let s = b[192 + 2 * j] as i8 / 2;
                    match i % 4 {
                        0 => b[193 + 2 * j] = s as u8,
                        1 => b[193 + 2 * j] = (2 * s) as u8,
                        _ => {}
                    }
                    b[192 + 2 * j] = s as u8;
                }
            }
            TensorType::Q4K | TensorType::Q5K => {
                put(b, 0, d);
                put(b, 2, 0.001 + 0.0003 * (i % 5) as f32);
            }
            TensorType::Q4_1 => {
                put(b, 0, d);
                put(b, 2, -0.05 * (i % 3) as f32);
            }
            _ => put(b, 0, d),
        }
    }
    out
}

/// What gguf-py's `dequantize` makes of the blocks.
fn ggml_values(ty: &str, bytes: &[u8]) -> Vec<f32> {
    let dir = tempfile::tempdir().unwrap();
    let (data, out) = (dir.path().join("blocks"), dir.path().join("values"));
    std::fs::write(&data, bytes).unwrap();
    let answer = fixtures::reference::run(
        "ggml_dequantize.py",
        &serde_json::json!({"type": ty, "data": data, "rows": ROWS, "out": out}),
    );
    assert_eq!(answer["values"], ROWS * COLS);
    std::fs::read(&out)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn kernels() -> Vec<CpuKernel> {
    let runnable = CpuKernel::runnable();
    assert!(
        runnable.contains(&CpuKernel::Scalar),
        "the packed kernel is not built (mlx-sys on Linux builds it)"
    );
    runnable
}

#[test]
fn every_block_type_becomes_mlx_groups_with_ggml_values() {
    let f32_ = Dtype::Float32;
    for (ty, name, bits, scale_dtype) in [
        (TensorType::Q4_0, "Q4_0", 4, Dtype::Float16),
        (TensorType::Q4_1, "Q4_1", 4, Dtype::Float16),
        (TensorType::Q8_0, "Q8_0", 8, Dtype::Float16),
        (TensorType::Q5_0, "Q5_0", 8, Dtype::Float16),
        (TensorType::Q4K, "Q4_K", 4, Dtype::Float32),
        (TensorType::Q5K, "Q5_K", 8, Dtype::Float32),
        (TensorType::Q6K, "Q6_K", 8, Dtype::Float32),
    ] {
        let bytes = random_blocks(ty, bits as u64 + ty.block().1 as u64);
        let info = TensorInfo {
            name: "w".into(),
            shape: vec![ROWS, COLS],
            ty,
            start: 0,
            len: bytes.len(),
        };
        let Loaded::Quantized {
            weight,
            scales,
            biases,
            quantization: q,
        } = blocks::load(&info, &bytes)
        else {
            panic!("{name} loads quantized");
        };
        assert_eq!((q.group_size, q.bits), (GROUP as i32, bits), "{name}");
        assert_eq!(scales.dtype(), scale_dtype, "{name}: scales");
        assert_eq!(biases.dtype(), scale_dtype, "{name}: biases");
        let (s, b) = (scales.as_dtype(f32_).unwrap(), biases.as_dtype(f32_).unwrap());
        let ours = ops::dequantize(&weight, &s, &b, q.group_size, q.bits).unwrap();
        let ours = ours.as_slice::<f32>().to_vec();
        let want = ggml_values(name, &bytes);
        let bias = b.as_slice::<f32>();

        let (mut exact_groups, mut rounded_groups) = (0, 0);
        for (g, (got, want)) in ours.chunks(GROUP).zip(want.chunks(GROUP)).enumerate() {
            // `scale * q + bias` rounds once or twice in fp32, as ggml's
            // formulas do: two units in the last place of the larger term.
            let ulps = |w: f32| 2.0 * f32::EPSILON * w.abs().max(bias[g].abs());
            let err = |i: usize| (got[i] - want[i]).abs();
            if (0..GROUP).all(|i| err(i) <= ulps(want[i])) {
                exact_groups += 1;
                continue;
            }
            // Only Q6_K's groups without a common grid may round: to the
            // nearest of 256 steps from the group's least to its greatest.
            assert_eq!(ty, TensorType::Q6K, "{name} group {g}: {got:?} vs {want:?}");
            let lo = want.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = want.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let half_step = (hi - lo) / 510.0;
            for i in 0..GROUP {
                assert!(
                    err(i) <= half_step * (1.0 + 1e-5) + ulps(want[i]),
                    "{name} group {g} element {i}: {} vs {} (half a step {half_step})",
                    got[i],
                    want[i]
                );
            }
            // Q6_K's pairs with a common grid (the first half of every
            // four super-blocks) must not be among them.
            assert!((g / 8) % 4 >= 2, "{name} group {g} should be exact");
            rounded_groups += 1;
        }
        assert!(exact_groups > 0, "{name}: no group is exact");
        if ty == TensorType::Q6K {
            assert!(rounded_groups > 0, "Q6_K: the rounding branch is not exercised");
        }

        // The kernel over the groups as loaded (fp16 or fp32 scales).
        let n = ROWS;
        for kernel in kernels() {
            for m in [1usize, 3, 17] {
                let xs: Vec<f32> = noise(m as u64 * 31 + bits as u64, m * COLS)
                    .iter()
                    .map(|&v| v as f32 / 128.0 - 1.0)
                    .collect();
                let x = Array::from_slice(&xs, &[m as i32, COLS as i32]);
                let y = packed::matmul_with(
                    Some(kernel),
                    Activations::Float32,
                    &x,
                    &weight,
                    &scales,
                    &biases,
                    q.group_size,
                    q.bits,
                )
                .unwrap();
                y.eval().unwrap();
                let y = y.as_slice::<f32>();
                assert_eq!(y.len(), m * n);
                for r in 0..m {
                    for o in 0..n {
                        let (mut want, mut mag) = (0f64, 0f64);
                        for i in 0..COLS {
                            let t = ours[o * COLS + i] as f64 * xs[r * COLS + i] as f64;
                            want += t;
                            mag += t.abs();
                        }
                        let got = y[r * n + o] as f64;
                        let tol = 1e-5 * mag + 1e-6;
                        assert!(
                            (got - want).abs() <= tol,
                            "{name}, {}, {m} rows: [{r}, {o}] is {got}, the reference {want}",
                            kernel.name()
                        );
                    }
                }
            }
        }
    }
}
