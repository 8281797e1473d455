//! Time of one product with packed 4-bit weights on the CPU by row count:
//! the project's kernel (`runtime::packed`) against dequantizing the
//! weights and multiplying by BLAS (what a prefill chunk cost before the
//! kernel took every row count). Shapes of SmolLM2-135M's linears (group
//! 32, fp16 scales as GGUF's Q4_1), the median of `--reps` calls each.
//!
//!     cargo run --release -p runtime --example packed_rows -- \
//!         [--rows 1,16,64,256,512] [--reps 20]
//!
//! Compare builds of the kernel by alternating whole processes.

use std::time::Instant;

use mlx_rs::{ops, Array, Dtype};
use runtime::packed;

fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let rows: Vec<i32> = fixtures::args::list("--rows", "1,16,64,256,512")?;
    let reps: usize = fixtures::args::flag("--reps", "20").parse()?;
    let (group, bits) = (32, 4);
    println!("out x in | rows | kernel ms | dequantize+BLAS ms | ratio");
    for (out, inp) in [(1536, 576), (576, 1536), (576, 576)] {
        let dense = mlx_rs::random::normal::<f32>(&[out, inp], None, None, None)?;
        let (w, s, b) = ops::quantize(&dense, group, bits)?;
        let (s, b) = (s.as_dtype(Dtype::Float16)?, b.as_dtype(Dtype::Float16)?);
        mlx_rs::transforms::eval([&w, &s, &b])?;
        for &m in &rows {
            let x = mlx_rs::random::normal::<f32>(&[m, inp], None, None, None)?;
            x.eval()?;
            let ours = median_ms(reps, || {
                packed::matmul(&x, &w, &s, &b, group, bits)
                    .unwrap()
                    .eval()
                    .unwrap();
            });
            let blas = median_ms(reps, || {
                // In fp32, as the layers' fallback widens the scales first.
                let (s, b) = (
                    s.as_dtype(Dtype::Float32).unwrap(),
                    b.as_dtype(Dtype::Float32).unwrap(),
                );
                let wd: Array = ops::dequantize(&w, &s, &b, group, bits).unwrap();
                x.matmul(wd.t()).unwrap().eval().unwrap();
            });
            println!(
                "{out} x {inp} | {m} | {ours:.3} | {blas:.3} | {:.2}",
                blas / ours
            );
        }
    }
    Ok(())
}
