//! What one ragged attention launch costs on the GPU beside MLX's own
//! attention on the same rows (fused with no mask for one row, with the
//! ragged mask as an array for several): `--queries` queries a row (1, a
//! decode step, by default) over `total` keys, the Qwen3-4B shape's
//! heads, bf16. Microseconds per call, averaged over 200 calls queued
//! together. With more than one query, also what MLX's first call of the
//! shape takes (it builds a cuDNN graph for each new shape).
//!
//!     cargo run --release -p runtime --example ragged_time [-- --total 256 --queries 64]

use std::time::Instant;

use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::transforms::eval;
use mlx_rs::{random, Array, Dtype};
use runtime::mask::ragged_mask;
use runtime::ragged;

fn time(f: impl Fn() -> Array) -> f64 {
    let warm: Vec<Array> = (0..10).map(|_| f()).collect();
    eval(&warm).unwrap();
    let start = Instant::now();
    let outs: Vec<Array> = (0..200).map(|_| f()).collect();
    eval(&outs).unwrap();
    start.elapsed().as_secs_f64() * 1e6 / 200.0
}

fn main() {
    runtime::cuda_env::apply_defaults();
    let flag = |name: &str, default: &str| -> i32 {
        fixtures::args::flag(name, default)
            .parse()
            .expect("a number")
    };
    let total = flag("--total", "256");
    let n = flag("--queries", "1");
    let (heads, kv_heads, dim) = (32, 8, 128);
    let scale = 1.0 / (dim as f32).sqrt();
    println!(
        "{n} queries a row over {total} keys, {heads}/{kv_heads} heads of {dim}, bf16; us per call"
    );
    for rows in [1, 4, 16, 64] {
        let normal = |shape: &[i32], seed: u64| {
            let key = random::key(seed).unwrap();
            random::normal::<f32>(shape, None, None, &key)
                .unwrap()
                .as_dtype(Dtype::Bfloat16)
                .unwrap()
        };
        let q = normal(&[rows, heads, n, dim], 1);
        let k = normal(&[rows, kv_heads, total, dim], 2);
        let v = normal(&[rows, kv_heads, total, dim], 3);
        eval([&q, &k, &v]).unwrap();
        let starts = vec![0; rows as usize];
        let meta = ragged::meta(&starts, None, total);
        let mask = ragged_mask(&starts, n, total, None);
        let first = Instant::now();
        let m = ScaledDotProductAttentionMask::Array(&mask);
        eval([&scaled_dot_product_attention(&q, &k, &v, scale, m, None).unwrap()]).unwrap();
        let first = first.elapsed().as_secs_f64() * 1e3;
        let kernel = time(|| ragged::attention(&q, &k, &v, scale, &meta, None).unwrap());
        // One query sees every key; several see the keys up to their own.
        let fused = time(|| {
            let causal = match n {
                1 => None,
                _ => Some(ScaledDotProductAttentionMask::Causal),
            };
            scaled_dot_product_attention(&q, &k, &v, scale, causal, None).unwrap()
        });
        let masked = time(|| {
            let m = ScaledDotProductAttentionMask::Array(&mask);
            scaled_dot_product_attention(&q, &k, &v, scale, m, None).unwrap()
        });
        let plain = if n == 1 { "no mask" } else { "causal" };
        println!(
            "rows {rows:3}: ragged kernel {kernel:7.1}  MLX, {plain} {fused:7.1}  MLX, mask array {masked:7.1} (first call {first:.0} ms)"
        );
    }
}
