//! GGML tensor data to MLX arrays.
//!
//! Every quantized type this runtime reads loads as MLX affine group
//! quantization, `scale * q + bias` over groups of 32 consecutive elements
//! of a row, with unsigned 4- or 8-bit codes packed into `uint32` words:
//!
//! | ggml  | block value                         | MLX bits | MLX scale   | MLX bias     | MLX q        | error |
//! |-------|-------------------------------------|----------|-------------|--------------|--------------|-------|
//! | Q4_0  | d * (q - 8)                         | 4        | d           | -8 d         | q            | 0 |
//! | Q4_1  | d * q + m                           | 4        | d           | m            | q            | 0 |
//! | Q8_0  | d * q (q signed)                    | 8        | d           | -128 d       | q + 128      | 0 |
//! | Q5_0  | d * (q - 16)                        | 8        | d           | -16 d        | q (0..31)    | 0 |
//! | Q4_K  | d * s * q - dmin * m, per 32        | 4        | d * s       | -dmin * m    | q            | 0 |
//! | Q5_K  | as Q4_K, q 0..31                    | 8        | d * s       | -dmin * m    | q            | 0 |
//! | Q6_K  | d * s * (q - 32), s signed, per 16  | 8        | see [`q6_k`]| see [`q6_k`] | see [`q6_k`] | 0 on a common grid, else at most half a step |
//!
//! The K-quants' sub-block scales `s` and mins `m` are 6-bit (Q6_K's 8-bit
//! signed) multiples of the super-block's fp16 `d` and `dmin`, so each
//! Q4_K/Q5_K sub-block of 32 is one MLX group whose scale and bias are
//! exact in fp32. Scales and biases stay fp16 where every one of the
//! tensor's is exact in fp16 (Q4_0, Q4_1, Q8_0 and Q5_0: the file's own
//! `d` and powers of two times it), and are fp32 otherwise (the K-quants:
//! `d * s` takes up to 17 significant bits). MLX groups cannot be 16 wide
//! (its `quantize`/`dequantize` take 32, 64 and 128), so Q6_K's two
//! sub-blocks of 16 share a group of 32.

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
    let read: fn(&[u8], &mut Groups) = match info.ty {
        TensorType::F32 => {
            return Loaded::Dense(Array::from_slice(
                &le_words(bytes, f32::from_le_bytes),
                &shape,
            ))
        }
        TensorType::F16 => {
            return Loaded::Dense(Array::from_slice(
                &le_halves(bytes, f16::from_le_bytes),
                &shape,
            ))
        }
        TensorType::Bf16 => {
            return Loaded::Dense(Array::from_slice(
                &le_halves(bytes, half::bf16::from_le_bytes),
                &shape,
            ))
        }
        TensorType::Q4_0 => q4_0,
        TensorType::Q4_1 => q4_1,
        TensorType::Q8_0 => q8_0,
        TensorType::Q5_0 => q5_0,
        TensorType::Q4K => q4_k,
        TensorType::Q5K => q5_k,
        TensorType::Q6K => q6_k,
    };
    let bits = match info.ty {
        TensorType::Q4_0 | TensorType::Q4_1 | TensorType::Q4K => 4,
        _ => 8,
    };
    let (_, block_bytes) = info.ty.block();
    let mut groups = Groups::new(bits, bytes.len() / block_bytes * info.ty.block().0);
    for block in bytes.chunks_exact(block_bytes) {
        read(block, &mut groups);
    }
    groups.finish(&shape)
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

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// MLX affine groups of 32 being built: codes packed into `uint32` words
/// (element `k` of a word at bit `k * bits`), scales and biases in fp32
/// until the tensor is whole.
struct Groups {
    bits: usize,
    words: Vec<u32>,
    scales: Vec<f32>,
    biases: Vec<f32>,
}

impl Groups {
    fn new(bits: usize, elements: usize) -> Groups {
        Groups {
            bits,
            words: Vec::with_capacity(elements * bits / 32),
            scales: Vec::with_capacity(elements / GROUP),
            biases: Vec::with_capacity(elements / GROUP),
        }
    }

    /// One group: element `i` is `scale * codes[i] + bias`.
    fn push(&mut self, codes: &[u8; GROUP], scale: f32, bias: f32) {
        let bits = self.bits;
        for word in codes.chunks_exact(32 / bits) {
            self.words.push(
                word.iter()
                    .enumerate()
                    .fold(0u32, |acc, (k, &c)| acc | (c as u32) << (k * bits)),
            );
        }
        self.scales.push(scale);
        self.biases.push(bias);
    }

    /// The MLX arrays of a tensor of `shape`: scales and biases in fp16
    /// where all of them are exact in it, else in fp32.
    fn finish(self, shape: &[i32]) -> Loaded {
        let (lead, last) = shape.split_at(shape.len() - 1);
        let with_last = |n: usize| -> Vec<i32> { lead.iter().copied().chain([n as i32]).collect() };
        let row = last[0] as usize;
        let fits_half = |v: &[f32]| v.iter().all(|&x| f16::from_f32(x).to_f32() == x);
        let (scales, biases) = if fits_half(&self.scales) && fits_half(&self.biases) {
            let half = |v: &[f32]| -> Vec<f16> { v.iter().map(|&x| f16::from_f32(x)).collect() };
            (
                Array::from_slice(&half(&self.scales), &with_last(row / GROUP)),
                Array::from_slice(&half(&self.biases), &with_last(row / GROUP)),
            )
        } else {
            (
                Array::from_slice(&self.scales, &with_last(row / GROUP)),
                Array::from_slice(&self.biases, &with_last(row / GROUP)),
            )
        };
        Loaded::Quantized {
            weight: Array::from_slice(&self.words, &with_last(row * self.bits / 32)),
            scales,
            biases,
            quantization: Quantization {
                group_size: GROUP as i32,
                bits: self.bits as i32,
            },
        }
    }
}

/// 16 bytes of nibbles as ggml's 32-element blocks order them: element `j`
/// in the low nibble of byte `j`, element `j + 16` in its high nibble.
fn split_nibbles(qs: &[u8]) -> [u8; GROUP] {
    let mut codes = [0u8; GROUP];
    for (j, &q) in qs[..16].iter().enumerate() {
        codes[j] = q & 0x0f;
        codes[j + 16] = q >> 4;
    }
    codes
}

/// Q4_0: d (f16), 16 bytes of nibbles; values `d * (q - 8)`.
fn q4_0(b: &[u8], out: &mut Groups) {
    let d = half_at(b, 0);
    out.push(&split_nibbles(&b[2..18]), d, -8.0 * d);
}

/// Q4_1: d, m (f16), 16 bytes of nibbles; values `d * q + m`.
fn q4_1(b: &[u8], out: &mut Groups) {
    out.push(&split_nibbles(&b[4..20]), half_at(b, 0), half_at(b, 2));
}

/// Q8_0: d (f16), 32 signed bytes; values `d * q`.
fn q8_0(b: &[u8], out: &mut Groups) {
    let d = half_at(b, 0);
    let mut codes = [0u8; GROUP];
    for (c, &q) in codes.iter_mut().zip(&b[2..34]) {
        *c = q ^ 0x80; // i8 q to q + 128
    }
    out.push(&codes, d, -128.0 * d);
}

/// Q5_0: d (f16), 32 fifth bits (little-endian u32, bit `j` for element
/// `j`), 16 bytes of nibbles; values `d * (q - 16)`.
fn q5_0(b: &[u8], out: &mut Groups) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let mut codes = split_nibbles(&b[6..22]);
    for (j, c) in codes.iter_mut().enumerate() {
        *c |= (((qh >> j) & 1) << 4) as u8;
    }
    out.push(&codes, d, -16.0 * d);
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

/// Q4_K: d, dmin (f16), 12 bytes of packed 6-bit scales and mins, 128
/// bytes of nibbles: sub-block `2c` in the low nibbles of bytes
/// `32c..32c + 32`, sub-block `2c + 1` in their high ones.
fn q4_k(b: &[u8], out: &mut Groups) {
    k_quant(b, &b[16..144], None, out);
}

/// Q5_K: as Q4_K with 32 bytes of fifth bits (`qh`) before the nibbles:
/// bit `j` of byte `l` is element `l` of sub-block `j`'s.
fn q5_k(b: &[u8], out: &mut Groups) {
    k_quant(b, &b[48..176], Some(&b[16..48]), out);
}

/// The sub-blocks of a Q4_K or Q5_K super-block: 32 values `d * s * q -
/// dmin * m`, one group each.
fn k_quant(b: &[u8], qs: &[u8], qh: Option<&[u8]>, out: &mut Groups) {
    let (d, dmin, scales) = (half_at(b, 0), half_at(b, 2), &b[4..16]);
    for (chunk, q) in qs.chunks_exact(32).enumerate() {
        for (sub, shift) in [(2 * chunk, 0), (2 * chunk + 1, 4)] {
            let (s, m) = scale_min_k4(sub, scales);
            let mut codes = [0u8; GROUP];
            for (l, c) in codes.iter_mut().enumerate() {
                *c = (q[l] >> shift) & 0x0f;
                if let Some(qh) = qh {
                    *c |= ((qh[l] >> sub) & 1) << 4;
                }
            }
            out.push(&codes, d * s, -(dmin * m));
        }
    }
}

/// Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed 8-bit
/// sub-block scales, then d (f16); values `d * s * (q - 32)` with one `s`
/// per 16 elements.
///
/// Two sub-blocks with scales `s1`, `s2` make one group of 32. Their
/// values are integer multiples of `d * g` with `g = gcd(s1, s2)`; where
/// those multiples span at most 255 (as when `s1 = s2`, or one is twice
/// the other) the group is scale `d * g`, bias `d * g * lo` and codes
/// `v / g - lo`, exactly. Otherwise the group spans its smallest to its
/// largest value in 255 steps and each value rounds to the nearest: off by
/// at most half a step, `(max - min) / 510`, a quarter of the error
/// Q6_K's own rounding allows in the sub-block with the larger scale.
fn q6_k(b: &[u8], out: &mut Groups) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    // Element `e` of a half (128) has 4 low bits from `ql`, 2 high bits from
    // `qh`, and scale `sc[e / 16]`.
    let mut v = [0i32; 256];
    for half in 0..2 {
        let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
        let y = &mut v[128 * half..];
        for l in 0..32 {
            y[l] = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            y[l + 32] = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            y[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            y[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
        }
    }
    for (group, pair) in v.chunks_exact_mut(GROUP).zip(sc.chunks_exact(2)) {
        let (s1, s2) = (pair[0] as i8 as i32, pair[1] as i8 as i32);
        let g = gcd(s1.unsigned_abs(), s2.unsigned_abs()).max(1) as i32;
        // The values in units of `d * g`.
        for (i, x) in group.iter_mut().enumerate() {
            *x *= if i < 16 { s1 / g } else { s2 / g };
        }
        let lo = *group.iter().min().expect("32 values");
        let hi = *group.iter().max().expect("32 values");
        let mut codes = [0u8; GROUP];
        if hi - lo <= 255 {
            for (c, &x) in codes.iter_mut().zip(group.iter()) {
                *c = (x - lo) as u8;
            }
            let step = d * g as f32;
            out.push(&codes, step, step * lo as f32);
        } else {
            let step = (hi - lo) as f32 / 255.0;
            for (c, &x) in codes.iter_mut().zip(group.iter()) {
                *c = ((x - lo) as f32 / step).round().min(255.0) as u8;
            }
            out.push(&codes, d * g as f32 * step, d * (g * lo) as f32);
        }
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// ggml's reference dequantization of the affine types, for tests.
#[cfg(test)]
pub fn reference_affine(ty: TensorType, block: &[u8]) -> [f32; 32] {
    let d = half_at(block, 0);
    let mut out = [0f32; 32];
    match ty {
        TensorType::Q8_0 => {
            for (o, &q) in out.iter_mut().zip(&block[2..34]) {
                *o = d * (q as i8) as f32;
            }
        }
        TensorType::Q4_0 | TensorType::Q4_1 => {
            let (m, qs) = if ty == TensorType::Q4_1 {
                (half_at(block, 2), &block[4..20])
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
