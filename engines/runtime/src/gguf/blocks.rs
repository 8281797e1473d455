//! GGML tensor data to MLX arrays.
//!
//! Q4_0, Q4_1 and Q8_0 are affine quantization over 32-element blocks, the
//! same arithmetic as MLX's group quantization with `group_size = 32`, so
//! they load as MLX quantized weights without loss:
//!
//! | ggml  | block value      | MLX bits | MLX scale | MLX bias   | MLX q      |
//! |-------|------------------|----------|-----------|------------|------------|
//! | Q4_0  | d * (q - 8)      | 4        | d         | -8 d       | q          |
//! | Q4_1  | d * q + m        | 4        | d         | m          | q          |
//! | Q8_0  | d * q (q signed) | 8        | d         | -128 d     | q + 128    |
//!
//! (`-8 d` and `-128 d` are exact in float16: powers of two.) The K-quants
//! (Q4_K, Q5_K, Q6_K) nest 6- or 8-bit sub-block scales inside 256-element
//! super-blocks, which MLX's one-level groups cannot hold; they are
//! dequantized at load to float16 (the precision of their block scales),
//! and so is Q5_0 (`d * (q - 16)`, its fifth bits apart from the nibbles),
//! which llama.cpp's K-quant mixes use for rows that are not a multiple of
//! 256 (Gemma 3 270M's 640).

use half::f16;
use mlx_rs::Array;

use super::file::{TensorInfo, TensorType};
use crate::config::Quantization;

/// A tensor ready for the model: dense, or MLX group-quantized.
pub enum Loaded {
    Dense(Array),
    Quantized {
        weight: Array,
        scales: Array,
        biases: Array,
        quantization: Quantization,
    },
}

const GROUP: usize = 32;

/// Converts one tensor's bytes (rows already in the order the model wants).
pub fn load(info: &TensorInfo, bytes: &[u8]) -> Loaded {
    let shape: Vec<i32> = info.shape.iter().map(|&d| d as i32).collect();
    match info.ty {
        TensorType::F32 => Loaded::Dense(Array::from_slice(
            &le_words(bytes, f32::from_le_bytes),
            &shape,
        )),
        TensorType::F16 => Loaded::Dense(Array::from_slice(
            &le_halves(bytes, f16::from_le_bytes),
            &shape,
        )),
        TensorType::Bf16 => Loaded::Dense(Array::from_slice(
            &le_halves(bytes, half::bf16::from_le_bytes),
            &shape,
        )),
        TensorType::Q4_0 | TensorType::Q4_1 | TensorType::Q8_0 => affine(info, bytes, &shape),
        TensorType::Q5_0 | TensorType::Q4K | TensorType::Q5K | TensorType::Q6K => {
            let (per_block, block_bytes) = info.ty.block();
            let mut out = Vec::with_capacity(bytes.len() / block_bytes * per_block);
            for block in bytes.chunks_exact(block_bytes) {
                let values: &[f32] = match info.ty {
                    TensorType::Q5_0 => &q5_0(block),
                    TensorType::Q4K => &q4_k(block),
                    TensorType::Q5K => &q5_k(block),
                    _ => &q6_k(block),
                };
                out.extend(values.iter().map(|&v| f16::from_f32(v)));
            }
            Loaded::Dense(Array::from_slice(&out, &shape))
        }
    }
}

fn le_words<T>(bytes: &[u8], f: fn([u8; 4]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(4)
        .map(|c| f(c.try_into().expect("4 bytes")))
        .collect()
}

fn le_halves<T>(bytes: &[u8], f: fn([u8; 2]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(2)
        .map(|c| f(c.try_into().expect("2 bytes")))
        .collect()
}

fn half_at(b: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([b[at], b[at + 1]])
}

/// Q4_0 / Q4_1 / Q8_0 blocks to MLX's packed uint32 codes (element `k` of a
/// word at bit `k * bits`), scales and biases.
fn affine(info: &TensorInfo, bytes: &[u8], shape: &[i32]) -> Loaded {
    let (_, block_bytes) = info.ty.block();
    let bits = if info.ty == TensorType::Q8_0 { 8 } else { 4 };
    let blocks = bytes.len() / block_bytes;
    let mut words = Vec::with_capacity(blocks * GROUP * bits / 32);
    let mut scales = Vec::with_capacity(blocks);
    let mut biases = Vec::with_capacity(blocks);
    for block in bytes.chunks_exact(block_bytes) {
        let d = half_at(block, 0);
        let mut codes = [0u8; GROUP];
        match info.ty {
            TensorType::Q8_0 => {
                for (c, &q) in codes.iter_mut().zip(&block[2..34]) {
                    *c = q ^ 0x80; // i8 q to q + 128
                }
                scales.push(d);
                biases.push(f16::from_f32(-128.0 * d.to_f32()));
            }
            _ => {
                let (bias, qs) = if info.ty == TensorType::Q4_1 {
                    (half_at(block, 2), &block[4..20])
                } else {
                    (f16::from_f32(-8.0 * d.to_f32()), &block[2..18])
                };
                for (j, &q) in qs.iter().enumerate() {
                    codes[j] = q & 0x0f;
                    codes[j + 16] = q >> 4;
                }
                scales.push(d);
                biases.push(bias);
            }
        }
        let per_word = 32 / bits;
        for word in codes.chunks_exact(per_word) {
            words.push(
                word.iter()
                    .enumerate()
                    .fold(0u32, |acc, (k, &c)| acc | (c as u32) << (k * bits)),
            );
        }
    }
    let (lead, last) = shape.split_at(shape.len() - 1);
    let with_last = |n: usize| -> Vec<i32> { lead.iter().copied().chain([n as i32]).collect() };
    let row = last[0] as usize;
    Loaded::Quantized {
        weight: Array::from_slice(&words, &with_last(row * bits / 32)),
        scales: Array::from_slice(&scales, &with_last(row / GROUP)),
        biases: Array::from_slice(&biases, &with_last(row / GROUP)),
        quantization: Quantization {
            group_size: GROUP as i32,
            bits: bits as i32,
        },
    }
}

/// Q5_0: d (f16), 32 fifth bits (little-endian u32, bit `j` for element
/// `j`), 16 bytes of nibbles (element `j` low, `j + 16` high); values are
/// 5-bit minus 16.
fn q5_0(b: &[u8]) -> [f32; 32] {
    let d = half_at(b, 0).to_f32();
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let mut out = [0f32; 32];
    for (j, &q) in b[6..22].iter().enumerate() {
        let fifth = |k: usize| (((qh >> k) & 1) << 4) as i32;
        out[j] = d * ((q & 0x0f) as i32 + fifth(j) - 16) as f32;
        out[j + 16] = d * ((q >> 4) as i32 + fifth(j + 16) - 16) as f32;
    }
    out
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K / Q5_K super-block.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        (
            ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4)) as f32,
            ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as f32,
        )
    }
}

/// Q4_K: d, dmin (f16), 12 bytes of packed scales/mins, 128 bytes of nibbles.
fn q4_k(b: &[u8]) -> [f32; 256] {
    let (d, dmin) = (half_at(b, 0).to_f32(), half_at(b, 2).to_f32());
    let (scales, qs) = (&b[4..16], &b[16..144]);
    let mut out = [0f32; 256];
    for (chunk, q) in qs.chunks_exact(32).enumerate() {
        let (s1, m1) = scale_min_k4(2 * chunk, scales);
        let (s2, m2) = scale_min_k4(2 * chunk + 1, scales);
        for (l, &byte) in q.iter().enumerate() {
            out[chunk * 64 + l] = d * s1 * (byte & 0x0f) as f32 - dmin * m1;
            out[chunk * 64 + 32 + l] = d * s2 * (byte >> 4) as f32 - dmin * m2;
        }
    }
    out
}

/// Q5_K: as Q4_K plus one high bit per element in 32 bytes of `qh`.
fn q5_k(b: &[u8]) -> [f32; 256] {
    let (d, dmin) = (half_at(b, 0).to_f32(), half_at(b, 2).to_f32());
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    let mut out = [0f32; 256];
    for (chunk, q) in qs.chunks_exact(32).enumerate() {
        let (s1, m1) = scale_min_k4(2 * chunk, scales);
        let (s2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        for (l, &byte) in q.iter().enumerate() {
            let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            out[chunk * 64 + l] = d * s1 * ((byte & 0x0f) + hi1) as f32 - dmin * m1;
            out[chunk * 64 + 32 + l] = d * s2 * ((byte >> 4) + hi2) as f32 - dmin * m2;
        }
    }
    out
}

/// Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed 8-bit
/// sub-block scales, then d (f16); values are 6-bit minus 32.
fn q6_k(b: &[u8]) -> [f32; 256] {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208).to_f32();
    let mut out = [0f32; 256];
    for half in 0..2 {
        let (ql, qh, sc) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..]);
        let y = &mut out[128 * half..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * (sc[is + k] as i8) as f32;
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
    out
}

/// ggml's reference dequantization of the affine types, for tests.
#[cfg(test)]
pub fn reference_affine(ty: TensorType, block: &[u8]) -> [f32; 32] {
    let d = half_at(block, 0).to_f32();
    let mut out = [0f32; 32];
    match ty {
        TensorType::Q8_0 => {
            for (o, &q) in out.iter_mut().zip(&block[2..34]) {
                *o = d * (q as i8) as f32;
            }
        }
        TensorType::Q4_0 | TensorType::Q4_1 => {
            let (m, qs) = if ty == TensorType::Q4_1 {
                (half_at(block, 2).to_f32(), &block[4..20])
            } else {
                (0.0, &block[2..18])
            };
            let off = if ty == TensorType::Q4_0 { 8.0 } else { 0.0 };
            for (j, &q) in qs.iter().enumerate() {
                out[j] = d * ((q & 0x0f) as f32 - off) + m;
                out[j + 16] = d * ((q >> 4) as f32 - off) + m;
            }
        }
        _ => unreachable!("affine types only"),
    }
    out
}
