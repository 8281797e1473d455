//! Quantized KV cache (`model.kv_cache: {bits, group_size}`): full-attention
//! layers keep keys and values in MLX's affine format (packed uint32 codes,
//! one scale and one bias per group of `group_size` values), quantized as
//! they are appended, and attend through MLX's quantized matmul, as
//! mlx-lm's `QuantizedKVCache` with `kv_bits` / `kv_group_size` does.

use std::fmt;
use std::str::FromStr;

use mlx_rs::{ops, Array, Dtype};
use serde::Deserialize;

type R<T> = Result<T, mlx_rs::error::Exception>;

/// Bit widths a KV cache may use.
pub const BITS: [i32; 2] = [8, 4];
/// Group sizes a KV cache may use.
pub const GROUP_SIZES: [i32; 3] = [32, 64, 128];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvQuant {
    pub bits: i32,
    #[serde(default = "default_group_size")]
    pub group_size: i32,
}

fn default_group_size() -> i32 {
    64
}

impl KvQuant {
    /// The settings this build supports, naming the one that is not.
    pub fn check(&self) -> Result<(), String> {
        if !BITS.contains(&self.bits) {
            return Err(format!(
                "model.kv_cache.bits = {} is not supported (8 or 4)",
                self.bits
            ));
        }
        if !GROUP_SIZES.contains(&self.group_size) {
            return Err(format!(
                "model.kv_cache.group_size = {} is not supported (32, 64 or 128)",
                self.group_size
            ));
        }
        Ok(())
    }

    /// Whether heads of `head_dim` values split into whole groups.
    pub fn fits(&self, head_dim: i32) -> Result<(), String> {
        if head_dim % self.group_size != 0 {
            return Err(format!(
                "model.kv_cache.group_size = {} does not divide the model's head size {head_dim}",
                self.group_size
            ));
        }
        Ok(())
    }

    /// Bytes one token's keys or values take in one head of `head_dim`:
    /// the packed codes plus a scale and a bias per group, in the
    /// activations' dtype of `elem_bytes`.
    pub fn bytes_per_head(&self, head_dim: usize, elem_bytes: usize) -> usize {
        let groups = head_dim / self.group_size as usize;
        head_dim * self.bits as usize / 8 + 2 * groups * elem_bytes
    }

    /// `x` (`[..., head_dim]`) as `[codes, scales, biases]`.
    pub fn quantize(&self, x: &Array) -> R<[Array; 3]> {
        let (w, s, b) = ops::quantize(x, self.group_size, self.bits)?;
        Ok([w, s, b])
    }

    /// `[..., head_dim]` values back from their quantized form.
    pub fn dequantize(&self, q: &[Array]) -> R<Array> {
        ops::dequantize(&q[0], &q[1], &q[2], self.group_size, self.bits)
    }

    /// Scaled dot-product attention of `queries` (`[B, heads, L, D]`) over
    /// quantized keys and values (`[codes, scales, biases]`, each `[B,
    /// kv_heads, T, _]`). `mask` is boolean (true = attend), broadcastable
    /// to `[B, 1, L, T]`; masked scores get the dtype's most negative value,
    /// so padding and the future get no weight.
    pub fn attention(
        &self,
        queries: &Array,
        keys: &[Array],
        values: &[Array],
        scale: f32,
        mask: Option<&Array>,
    ) -> R<Array> {
        let q = queries.shape().to_vec();
        let (b, heads, l, d) = (q[0], q[1], q[2], q[3]);
        let kv_heads = keys[0].dim(1);
        let repeats = heads / kv_heads;
        let mut queries = queries.multiply(Array::from_f32(scale).as_dtype(queries.dtype())?)?;
        let grouped = |parts: &[Array]| -> R<Vec<Array>> {
            parts
                .iter()
                .map(|p| match repeats {
                    1 => Ok(p.clone()),
                    _ => p.expand_dims(-3),
                })
                .collect()
        };
        let (keys, values) = (grouped(keys)?, grouped(values)?);
        if repeats > 1 {
            queries = queries.reshape(&[b, kv_heads, repeats, l, d])?;
        }
        let (g, bits) = (self.group_size, self.bits);
        let mut scores =
            ops::quantized_matmul(&queries, &keys[0], &keys[1], &keys[2], true, g, bits)?;
        if let Some(mask) = mask {
            let mask = match repeats > 1 && mask.ndim() > 3 {
                true => mask.expand_dims(-3)?,
                false => mask.clone(),
            };
            let fill = Array::from_f32(most_negative(scores.dtype())).as_dtype(scores.dtype())?;
            scores = ops::select(&mask, &scores, &fill)?;
        }
        let weights = ops::softmax_axis(&scores, -1, true)?;
        let out =
            ops::quantized_matmul(&weights, &values[0], &values[1], &values[2], false, g, bits)?;
        match repeats {
            1 => Ok(out),
            _ => out.reshape(&[b, heads, l, d]),
        }
    }
}

/// The most negative finite value of a floating-point dtype.
fn most_negative(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Float16 => -65504.0,
        _ => f32::MIN,
    }
}

/// `bits:group_size`, the form the setting crosses the plugin boundary in.
impl fmt::Display for KvQuant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.bits, self.group_size)
    }
}

impl FromStr for KvQuant {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("bad KV cache setting {s:?} (expected bits:group_size)");
        let (bits, group) = s.split_once(':').ok_or_else(bad)?;
        let q = KvQuant {
            bits: bits.parse().map_err(|_| bad())?,
            group_size: group.parse().map_err(|_| bad())?,
        };
        q.check()?;
        Ok(q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_and_round_trip() {
        for bits in BITS {
            for group_size in GROUP_SIZES {
                let q = KvQuant { bits, group_size };
                assert_eq!(q.check(), Ok(()));
                assert_eq!(q.to_string().parse::<KvQuant>(), Ok(q));
            }
        }
        let e = KvQuant {
            bits: 3,
            group_size: 64,
        }
        .check()
        .unwrap_err();
        assert!(e.contains("model.kv_cache.bits = 3"), "{e}");
        let e = KvQuant {
            bits: 8,
            group_size: 48,
        }
        .check()
        .unwrap_err();
        assert!(e.contains("model.kv_cache.group_size = 48"), "{e}");
        assert!("8".parse::<KvQuant>().is_err());
    }

    #[test]
    fn bytes_count_codes_scales_and_biases() {
        // 128 values at 8 bits: 128 bytes of codes, 2 groups of fp16 scale
        // and bias: 8 bytes.
        let q = KvQuant {
            bits: 8,
            group_size: 64,
        };
        assert_eq!(q.bytes_per_head(128, 2), 136);
        let q = KvQuant {
            bits: 4,
            group_size: 32,
        };
        assert_eq!(q.bytes_per_head(64, 4), 32 + 16);
    }

    /// A masked position gets no weight however large its score would be:
    /// the fill is the dtype's most negative value, not a small constant.
    #[test]
    fn masked_keys_get_no_attention() {
        let q = KvQuant {
            bits: 8,
            group_size: 32,
        };
        let d = 32;
        // Two keys: the second (masked) one aligned with the query and huge.
        let query = Array::from_slice(&vec![1.0f32; d], &[1, 1, 1, d as i32]);
        let mut keys = vec![0.0f32; d];
        keys.extend(vec![100.0f32; d]);
        let keys = Array::from_slice(&keys, &[1, 1, 2, d as i32]);
        let mut values = vec![1.0f32; d];
        values.extend(vec![-50.0f32; d]);
        let values = Array::from_slice(&values, &[1, 1, 2, d as i32]);
        let mask = Array::from_slice(&[true, false], &[1, 1, 1, 2]);
        let out = q
            .attention(
                &query,
                &q.quantize(&keys).unwrap(),
                &q.quantize(&values).unwrap(),
                1.0,
                Some(&mask),
            )
            .unwrap();
        let out = out.as_slice::<f32>();
        assert!(out.iter().all(|&x| (x - 1.0).abs() < 1e-2), "{out:?}");
    }
}
