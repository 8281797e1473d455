//! MLX through our Linux mlx-sys on whatever device is the default (the GPU
//! with the mlx-cuda-13 wheel): a matmul checked against the CPU, its bf16
//! throughput, and a generated model's greedy decode on the GPU checked
//! token for token against the CPU.
//!
//!     cargo run --release -p runtime --example gpu_smoke

use std::time::Instant;

use fixtures::model::{write_model, TinySpec};
use mlx_rs::transforms::eval;
use mlx_rs::{random, Device, Dtype, Stream};
use runtime::{generate, Family, LoadedModel};

fn main() -> anyhow::Result<()> {
    let device = Device::default();
    println!(
        "default device: {device:?}; BLAS: {}",
        mlx_sys::blas_backend()
    );

    let a = random::normal::<f32>(&[512, 512], None, None, &random::key(1)?)?;
    let b = random::normal::<f32>(&[512, 512], None, None, &random::key(2)?)?;
    let on_device = a.matmul(&b)?;
    let on_cpu = mlx_rs::with_stream(&Stream::new_with_device(&Device::cpu()), || a.matmul(&b))?;
    let diff = on_device
        .subtract(&on_cpu)?
        .abs()?
        .max(None)?
        .item_cast::<f32>();
    let scale = on_cpu.abs()?.max(None)?.item_cast::<f32>();
    // GPUs may run f32 matmuls in TF32 (10-bit mantissa): compare relatively.
    println!(
        "matmul 512x512 f32: max |device - cpu| = {diff:.2e} (relative {:.1e})",
        diff / scale
    );
    anyhow::ensure!(diff / scale < 5e-3, "device matmul disagrees with the CPU");

    let n = if format!("{device:?}").contains("gpu") {
        8192
    } else {
        1024
    };
    let x =
        random::normal::<f32>(&[n, n], None, None, &random::key(3)?)?.as_dtype(Dtype::Bfloat16)?;
    eval([&x])?;
    let _ = x.matmul(&x)?.sum(None)?.item_cast::<f32>();
    let start = Instant::now();
    let reps = 10;
    for _ in 0..reps {
        eval([&x.matmul(&x)?])?;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "bf16 {n}x{n}x{n} matmul: {:.1} TFLOP/s",
        reps as f64 * 2.0 * (n as f64).powi(3) / secs / 1e12
    );

    let dir = tempfile_dir()?;
    write_model(&dir, &TinySpec::tiny(Family::Qwen3))?;
    let model = LoadedModel::load(&dir, Some("tiny-qwen3"))?;
    let prompt: Vec<u32> = (1..40).collect();
    let gpu = generate::greedy(&model.model, &prompt, 48, &[], |_| true)?;
    let cpu = mlx_rs::with_stream(&Stream::new_with_device(&Device::cpu()), || {
        generate::greedy(&model.model, &prompt, 48, &[], |_| true)
    })?;
    println!("greedy on {device:?}: {:?}...", &gpu.tokens[..12]);
    anyhow::ensure!(
        gpu.tokens == cpu.tokens,
        "device and CPU greedy tokens differ"
    );
    println!(
        "model forward + greedy decode on {device:?} matches the CPU token for token (48 tokens)"
    );

    // A left-padded batch of mixed prompt lengths (and Gemma 3's sliding
    // window): per-row decode attention on the GPU, masks on the CPU.
    for family in [Family::Qwen3, Family::Gemma3] {
        let dir = tempfile_dir()?.join(family.to_string());
        write_model(&dir, &TinySpec::tiny(family))?;
        let model = LoadedModel::load(&dir, None)?;
        let prompts: Vec<Vec<u32>> = [5u32, 31, 12]
            .iter()
            .map(|&n| (1..=n).map(|i| (i * 37) % 500).collect())
            .collect();
        let gpu = generate::greedy_batch(&model.model, &prompts, 40, &[])?;
        let cpu = mlx_rs::with_stream(&Stream::new_with_device(&Device::cpu()), || {
            generate::greedy_batch(&model.model, &prompts, 40, &[])
        })?;
        anyhow::ensure!(
            gpu == cpu,
            "{family}: padded batch differs between device and CPU"
        );
        println!("{family}: padded batch of 3 (5, 31, 12 tokens) x 40 tokens matches the CPU");
    }
    Ok(())
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("gpu-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
