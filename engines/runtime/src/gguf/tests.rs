//! GGML blocks against ggml's arithmetic (files and whole models:
//! tests/gguf_convert.rs).

use half::f16;
use mlx_rs::{ops, Dtype};

use super::blocks::{self, reference_affine, Loaded};
use super::file::{TensorInfo, TensorType};

/// Deterministic bytes for block payloads.
fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect()
}

/// Random blocks of `ty` with sane float16 scales (and Q4_1 mins).
fn random_blocks(ty: TensorType, blocks: usize, seed: u64) -> Vec<u8> {
    let (_, size) = ty.block();
    let mut out = noise(seed, blocks * size);
    for (i, block) in out.chunks_exact_mut(size).enumerate() {
        let d = f16::from_f32(0.01 + 0.001 * (i % 7) as f32);
        block[..2].copy_from_slice(&d.to_le_bytes());
        if ty == TensorType::Q4_1 {
            let m = f16::from_f32(-0.05 * (i % 3) as f32);
            block[2..4].copy_from_slice(&m.to_le_bytes());
        }
    }
    out
}

/// A quantized tensor's values, through MLX's `dequantize` in fp32.
fn dequantized(loaded: Loaded) -> Vec<f32> {
    let Loaded::Quantized {
        weight,
        scales,
        biases,
        quantization: q,
    } = loaded
    else {
        panic!("loads quantized");
    };
    let (s, b) = (
        scales.as_dtype(Dtype::Float32).unwrap(),
        biases.as_dtype(Dtype::Float32).unwrap(),
    );
    let a = ops::dequantize(&weight, &s, &b, q.group_size, q.bits).unwrap();
    a.as_slice::<f32>().to_vec()
}

fn info(name: &str, ty: TensorType, shape: Vec<usize>, len: usize) -> TensorInfo {
    TensorInfo {
        name: name.into(),
        shape,
        ty,
        start: 0,
        len,
    }
}

#[test]
fn affine_blocks_load_as_mlx_quantized_without_loss() {
    for (ty, bits) in [
        (TensorType::Q4_0, 4),
        (TensorType::Q4_1, 4),
        (TensorType::Q8_0, 8),
    ] {
        let (rows, cols) = (3, 96);
        let bytes = random_blocks(ty, rows * cols / 32, bits as u64);
        let Loaded::Quantized {
            weight,
            scales,
            biases,
            quantization,
        } = blocks::load(&info("w", ty, vec![rows, cols], bytes.len()), &bytes)
        else {
            panic!("{ty:?} loads quantized");
        };
        assert_eq!((quantization.group_size, quantization.bits), (32, bits));
        assert_eq!(
            weight.shape(),
            &[rows as i32, (cols * bits as usize / 32) as i32]
        );
        let got = ops::dequantize(&weight, &scales, &biases, 32, bits)
            .unwrap()
            .as_dtype(Dtype::Float32)
            .unwrap();
        let got: &[f32] = got.as_slice();
        let (_, size) = ty.block();
        let want: Vec<f32> = bytes
            .chunks_exact(size)
            .flat_map(|b| reference_affine(ty, b))
            .collect();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // MLX computes scale * q + bias in float16: within its rounding.
            assert!(
                (g - w).abs() <= 1e-3 * w.abs().max(1.0) * 2.0,
                "{ty:?}[{i}]: {g} vs {w}"
            );
        }
    }
}

/// ggml's layout for K-quants, written from the block definitions: every
/// element equals d * scale * q - dmin * min for a hand-built block.
#[test]
fn k_quants_dequantize_by_their_block_layout() {
    // Q4_K: all sub-block scales 2, mins 1 (6-bit packed), nibbles 5 / 9.
    let mut b = vec![0u8; 144];
    b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
    b[2..4].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
    for j in 0..4 {
        b[4 + j] = 2; // scales 0..4
        b[8 + j] = 1; // mins 0..4
        b[12 + j] = 2 | (1 << 4); // scales/mins 4..8, low bits
    }
    for q in &mut b[16..144] {
        *q = 5 | (9 << 4);
    }
    let v = dequantized(blocks::load(
        &info("k", TensorType::Q4K, vec![1, 256], 144),
        &b,
    ));
    for chunk in 0..4 {
        assert_eq!(v[chunk * 64], 0.5 * 2.0 * 5.0 - 0.25);
        assert_eq!(v[chunk * 64 + 32], 0.5 * 2.0 * 9.0 - 0.25);
    }
    // Q6_K: scales 3 for every sub-block, every 6-bit value 40 (minus 32 = 8).
    let mut b = vec![0u8; 210];
    for q in &mut b[0..128] {
        *q = 8 | (8 << 4); // low nibbles 8
    }
    for q in &mut b[128..192] {
        *q = 0b10_10_10_10; // high pairs 2: 2 << 4 | 8 = 40
    }
    for s in &mut b[192..208] {
        *s = 3;
    }
    b[208..210].copy_from_slice(&f16::from_f32(0.125).to_le_bytes());
    let v = dequantized(blocks::load(
        &info("k", TensorType::Q6K, vec![1, 256], 210),
        &b,
    ));
    assert!(v.iter().all(|&x| x == 0.125 * 3.0 * 8.0));
}

/// Q5_0 from ggml's block definition: codes chosen per element, packed
/// (low nibbles, element `j + 16` in the high nibble, fifth bits in `qh`),
/// read back as d * (code - 16).
#[test]
fn q5_0_dequantizes_by_its_block_layout() {
    let codes: Vec<u32> = (0..32).map(|j| (j * 7 + 3) % 32).collect();
    let d = 0.375f32;
    let mut b = vec![0u8; 22];
    b[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    let qh = codes
        .iter()
        .enumerate()
        .fold(0u32, |acc, (j, &c)| acc | (c >> 4) << j);
    b[2..6].copy_from_slice(&qh.to_le_bytes());
    for j in 0..16 {
        b[6 + j] = (codes[j] & 0x0f) as u8 | ((codes[j + 16] & 0x0f) as u8) << 4;
    }
    let v = dequantized(blocks::load(
        &info("q", TensorType::Q5_0, vec![1, 32], 22),
        &b,
    ));
    let want: Vec<f32> = codes.iter().map(|&c| d * (c as f32 - 16.0)).collect();
    assert_eq!(v, want);
}
