//! Time of one decode step's packed products on the CPU, without the rest
//! of the step: the default model's shapes (30 layers of q/k/v stacked
//! 960x576, o 576x576, gate/up stacked 3072x576 and down 576x1536, 4-bit
//! group 32 with fp16 scales as GGUF's Q4_1; the 8-bit head 49152x576),
//! each layer's weights distinct so they stream from memory as a step's
//! do. Random weights: only the time is read. Best of `--reps` steps of
//! `--rows` rows each, the layers' products and the head apart.
//!
//!     GATEWAY_CPU_THREADS=1 cargo run --release -p runtime --example step_products -- \
//!         [--rows 1,2,3] [--reps 30]
//!
//! One thread (`GATEWAY_CPU_THREADS=1`) reads the kernel's own speed; the
//! default reads it with the pool. Compare builds by alternating whole
//! processes.

use std::time::Instant;

use mlx_rs::{ops, Array, Dtype};
use runtime::packed;

struct Packed {
    w: Array,
    s: Array,
    b: Array,
    bits: i32,
}

fn packed(out: i32, inp: i32, bits: i32) -> anyhow::Result<Packed> {
    let dense = mlx_rs::random::normal::<f32>(&[out, inp], None, None, None)?;
    let (w, s, b) = ops::quantize(&dense, 32, bits)?;
    let (s, b) = (s.as_dtype(Dtype::Float16)?, b.as_dtype(Dtype::Float16)?);
    mlx_rs::transforms::eval([&w, &s, &b])?;
    Ok(Packed { w, s, b, bits })
}

fn bytes(p: &Packed) -> usize {
    p.w.nbytes() + p.s.nbytes() + p.b.nbytes()
}

/// Best time in ms of `reps` evaluations of every product of `weights`,
/// each on the row(s) of `xs` as wide as its input.
fn best_ms(reps: usize, xs: &[Array], weights: &[Packed]) -> anyhow::Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..reps + 1 {
        let start = Instant::now();
        let ys = weights
            .iter()
            .map(|p| {
                let k = p.w.dim(1) * 32 / p.bits;
                let x = xs
                    .iter()
                    .find(|x| x.dim(-1) == k)
                    .expect("an input as wide");
                packed::matmul(x, &p.w, &p.s, &p.b, 32, p.bits)
            })
            .collect::<Result<Vec<_>, _>>()?;
        mlx_rs::transforms::eval(&ys)?;
        best = best.min(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok(best)
}

fn main() -> anyhow::Result<()> {
    let rows: Vec<i32> = fixtures::args::list("--rows", "1,2,3")?;
    let reps: usize = fixtures::args::flag("--reps", "30").parse()?;
    let mut layers = Vec::new();
    for _ in 0..30 {
        for (out, inp) in [(960, 576), (576, 576), (3072, 576), (576, 1536)] {
            layers.push(packed(out, inp, 4)?);
        }
    }
    let head = [packed(49152, 576, 8)?];
    let mb = |ps: &[Packed]| ps.iter().map(bytes).sum::<usize>() as f64 / 1e6;
    println!(
        "kernel {:?}, GATEWAY_CPU_THREADS {}; layers {:.1} MB, head {:.1} MB",
        packed::CpuKernel::chosen(),
        std::env::var("GATEWAY_CPU_THREADS").unwrap_or_else(|_| "unset".into()),
        mb(&layers),
        mb(&head)
    );
    println!("rows | layers ms (GB/s) | head ms (GB/s)");
    for &m in &rows {
        let xs = [576, 1536].map(|k| mlx_rs::random::normal::<f32>(&[m, k], None, None, None));
        let xs = xs.into_iter().collect::<Result<Vec<_>, _>>()?;
        mlx_rs::transforms::eval(&xs)?;
        let l = best_ms(reps, &xs, &layers)?;
        let h = best_ms(reps, &xs, &head)?;
        println!(
            "{m} | {l:.3} ({:.1}) | {h:.3} ({:.1})",
            mb(&layers) / l,
            mb(&head) / h
        );
    }
    Ok(())
}
