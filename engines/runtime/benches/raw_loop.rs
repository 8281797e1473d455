//! The raw model loop, ours against mlx-lm's, on the same generated ~100M
//! parameter model, side by side in one run:
//!
//!     cargo bench -p runtime --bench raw_loop [-- --family qwen3 --prompt 512 --gen 256 --reps 3]
//!
//! or on a real checkpoint, ours in a chosen compute dtype (default auto):
//!
//!     cargo bench -p runtime --bench raw_loop -- --model DIR [--dtype float32]
//!
//! `--batch B` times B equal-length rows decoded together instead (ours
//! and mlx-lm's model each stepping the batch and reading its tokens every
//! step): the model's batched step cost, without an engine around it.
//!
//! `--ours-only` skips the peers (for pairing runs with farm-bench).
//! `--paged` steps rows over a paged KV pool (read by the ragged kernel on
//! the GPU), `--gather` then gathers each layer's columns for MLX's own
//! attention instead, and `--stepwise` steps a contiguous cache the same
//! way (every step read): the three compare what a single sequence's step
//! costs in each layout. `--paged --pipelined` decodes one sequence as the
//! fast path does (each step queued before the last is read) over a paged
//! pool, to set beside the default run's contiguous cache; `--batch B
//! --pipelined` steps B rows that way (either layout).
//! mlx-lm runs as pip installs it (the wheel's reference BLAS) and with
//! Debian's OpenBLAS preloaded, which is what our build links; on a real
//! checkpoint each both as loaded and cast to fp32.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use fixtures::model::{write_model, TinySpec};
use runtime::generate;
use runtime::{ComputeDtype, Family, LoadedModel};

struct Args {
    family: Family,
    model: Option<PathBuf>,
    dtype: ComputeDtype,
    prompt: usize,
    gen: usize,
    reps: usize,
    batch: usize,
    ours_only: bool,
    /// Step rows (read every step) over a contiguous or paged cache.
    stepwise: bool,
    paged: bool,
    gather: bool,
    pipelined: bool,
    /// Blocks in the paged pool (at least what the rows need): a server's
    /// pool is as large as its memory budget allows.
    pool_blocks: usize,
}

fn args() -> Args {
    let mut a = Args {
        family: Family::Qwen3,
        model: None,
        dtype: ComputeDtype::Auto,
        prompt: 512,
        gen: 256,
        reps: 3,
        batch: 1,
        ours_only: false,
        stepwise: false,
        paged: false,
        gather: false,
        pipelined: false,
        pool_blocks: 0,
    };
    let argv: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < argv.len() {
        let value = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--ours-only" | "--stepwise" | "--paged" | "--gather" | "--pipelined" => {
                match argv[i].as_str() {
                    "--ours-only" => a.ours_only = true,
                    "--stepwise" => a.stepwise = true,
                    "--paged" => a.paged = true,
                    "--pipelined" => a.pipelined = true,
                    _ => a.gather = true,
                }
                i += 1;
                continue;
            }
            "--family" => a.family = value.parse().expect("family"),
            "--model" => a.model = Some(value.into()),
            "--dtype" => a.dtype = value.parse().expect("compute dtype"),
            "--prompt" => a.prompt = value.parse().expect("prompt length"),
            "--gen" => a.gen = value.parse().expect("tokens to generate"),
            "--reps" => a.reps = value.parse().expect("repetitions"),
            "--batch" => a.batch = value.parse().expect("rows"),
            "--pool-blocks" => a.pool_blocks = value.parse().expect("blocks"),
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    a
}

/// The repository root; `REPO_ROOT` overrides the build-time path (the
/// binary also runs on the GPU machine, from another checkout).
fn root() -> PathBuf {
    std::env::var_os("REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// The Python with mlx-lm: `MLX_PYTHON`, else the setup's venv.
fn python() -> PathBuf {
    std::env::var_os("MLX_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".mlx/venv/bin/python"))
}

fn ours(dir: &Path, a: &Args) -> (f64, f64) {
    let loaded = LoadedModel::load_as(dir, None, a.dtype).expect("load the bench model");
    let vocab = loaded.vocab_size() as u32;
    let prompt: Vec<u32> = (0..a.prompt as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let (mut prefill, mut decode) = (0f64, 0f64);
    if a.batch > 1 || a.stepwise || a.paged {
        if a.gather {
            runtime::mask::set_ragged_attention(runtime::mask::RaggedAttention::Never);
        }
        let pool = a.paged.then(|| {
            let m = &loaded.model;
            let needed = a.batch * (a.prompt + a.gen).div_ceil(16) + 1;
            let blocks = a.pool_blocks.max(needed);
            runtime::paged::PagePool::new(m.num_layers(), blocks, 16).unwrap()
        });
        if let (Some(pool), true, 1, false) = (&pool, a.pipelined, a.batch, a.stepwise) {
            for rep in 0..=a.reps {
                let (p, d) = pipelined_rates(&loaded.model, pool, &prompt, a.gen);
                if rep > 0 {
                    prefill = prefill.max(p);
                    decode = decode.max(d);
                }
            }
            return (prefill, decode);
        }
        // Rows differ (each token shifted by its row) but are equally long.
        let prompts: Vec<Vec<u32>> = (0..a.batch as u32)
            .map(|r| prompt.iter().map(|&t| (t + r) % vocab).collect())
            .collect();
        for rep in 0..=a.reps {
            let (p, d) =
                batch_step_rates(&loaded.model, pool.as_ref(), &prompts, a.gen, a.pipelined);
            if rep > 0 {
                prefill = prefill.max(p);
                decode = decode.max(d);
            }
        }
        return (prefill, decode);
    }
    for rep in 0..=a.reps {
        let start = Instant::now();
        let run = generate::greedy(&loaded.model, &prompt, a.gen, &[], |_| true).unwrap();
        let _ = start;
        if rep == 0 {
            continue; // warm-up
        }
        prefill = prefill.max(a.prompt as f64 / run.prefill_time.as_secs_f64());
        decode = decode.max((run.tokens.len() - 1) as f64 / run.decode_time.as_secs_f64());
    }
    (prefill, decode)
}

/// Prompt tokens per second, and decode tokens per second of one sequence
/// over `pool` with each step queued before the last one's token is read.
fn pipelined_rates(
    model: &runtime::model::Model,
    pool: &runtime::paged::PagePool,
    prompt: &[u32],
    gen: usize,
) -> (f64, f64) {
    let start = Instant::now();
    let cache = model.new_paged_cache(pool, vec![0]);
    let mut stream = generate::DecodeStream::resume(model, cache, prompt, 256).unwrap();
    stream.next_token(true).unwrap();
    let prefill = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for _ in 2..gen {
        stream.next_token(true).unwrap();
    }
    stream.next_token(false).unwrap();
    (
        prompt.len() as f64 / prefill,
        (gen - 1) as f64 / start.elapsed().as_secs_f64(),
    )
}

/// Prompt tokens per second of one batched prefill, and tokens per second
/// (all rows) of `gen` batched greedy decode steps, each step's tokens read;
/// `pipelined`, each step queued before the previous step's are read (as
/// the batched engine decodes), so the step costs the more of its host work
/// and its device work, not their sum.
fn batch_step_rates(
    model: &runtime::model::Model,
    pool: Option<&runtime::paged::PagePool>,
    prompts: &[Vec<u32>],
    gen: usize,
    pipelined: bool,
) -> (f64, f64) {
    use mlx_rs::transforms::{async_eval, eval};
    use runtime::model::Logits;
    let (ids, pads) = generate::left_padded(prompts.iter().map(Vec::as_slice), 0);
    let mut cache = match pool {
        Some(pool) => model.new_paged_cache(pool, pads),
        None => model.new_padded_cache(pads),
    };
    let start = Instant::now();
    let logits = model.forward(&ids, &mut cache, Logits::Last).unwrap();
    let mut current = generate::argmax_tokens(&logits).unwrap();
    eval([&current]).unwrap();
    let prefill = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let (mut building, mut launching, mut waiting) = Default::default();
    for _ in 1..gen {
        let t = Instant::now();
        let logits = model.forward(&current, &mut cache, Logits::Last).unwrap();
        let next = generate::argmax_tokens(&logits).unwrap();
        building += t.elapsed();
        let t = Instant::now();
        if pipelined {
            async_eval([&next]).unwrap();
        } else {
            eval([&next]).unwrap();
        }
        launching += t.elapsed();
        let t = Instant::now();
        let _ = current.as_slice::<i32>();
        waiting += t.elapsed();
        current = next;
    }
    let _ = current.as_slice::<i32>();
    let rows = prompts.len() as f64;
    let per_step = |d: std::time::Duration| d.as_secs_f64() * 1e3 / (gen - 1) as f64;
    println!(
        "graph building: {:.3} ms per step, launching {:.3} ms, waiting {:.3} ms",
        per_step(building),
        per_step(launching),
        per_step(waiting)
    );
    (
        rows * prompts[0].len() as f64 / prefill,
        rows * (gen - 1) as f64 / start.elapsed().as_secs_f64(),
    )
}

fn mlx_lm(dir: &Path, a: &Args, preload: Option<&str>, cast: Option<&str>) -> (f64, f64) {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("scripts/bench_mlx_lm.py"))
        .arg(dir)
        .args([a.prompt.to_string(), a.gen.to_string(), a.reps.to_string()])
        .args(["--batch".to_string(), a.batch.to_string()])
        .args(cast);
    if let Some(lib) = preload {
        cmd.env("LD_PRELOAD", lib);
    }
    let out = cmd.output().expect("run mlx-lm");
    assert!(
        out.status.success(),
        "mlx-lm bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        v["prefill_tps"].as_f64().unwrap(),
        v["decode_tps"].as_f64().unwrap(),
    )
}

fn main() {
    runtime::cuda_env::apply_defaults();
    let a = args();
    let dir = match &a.model {
        Some(dir) => {
            println!("model: {}", dir.display());
            dir.clone()
        }
        None => generated_model(&a),
    };
    println!(
        "{} row(s) of {}-token prompts, {} generated; best of {}; device {:?}; ours in compute dtype {:?}",
        a.batch,
        a.prompt,
        a.gen,
        a.reps,
        mlx_rs::Device::default(),
        a.dtype
    );
    println!("BLAS (ours): {}", mlx_sys::blas_backend());
    let openblas = [
        "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
        "/usr/lib64/libopenblas.so.0",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists());
    let ours = ours(&dir, &a);
    if a.ours_only {
        println!(
            "ours decode tok/s {:.2} prefill tok/s {:.1}",
            ours.1, ours.0
        );
        return;
    }
    // On the CPU a real checkpoint's mlx-lm also runs cast to fp32, its
    // fastest CPU form, and with OpenBLAS; on a GPU it runs as loaded.
    let cpu = runtime::compute::on_cpu();
    let openblas = openblas.filter(|_| cpu);
    let casts: &[Option<&str>] = if a.model.is_some() && cpu {
        &[None, Some("float32")]
    } else {
        &[None]
    };
    let mut peers = Vec::new();
    for &cast in casts {
        let dtype = cast.map_or(String::new(), |c| format!(", {c}"));
        peers.push((
            format!("mlx-lm (pip install{dtype})"),
            mlx_lm(&dir, &a, None, cast),
        ));
        if let Some(lib) = openblas {
            peers.push((
                format!("mlx-lm (OpenBLAS preloaded{dtype})"),
                mlx_lm(&dir, &a, Some(lib), cast),
            ));
        }
    }
    println!("{:<40} {:>13} {:>12}", "", "prefill tok/s", "decode tok/s");
    println!(
        "{:<40} {:>13.1} {:>12.1}",
        if a.batch > 1 || a.stepwise || a.paged {
            "ours (batched model step)"
        } else {
            "ours (runtime::generate::greedy)"
        },
        ours.0,
        ours.1
    );
    for (name, p) in &peers {
        println!("{name:<40} {:>13.1} {:>12.1}", p.0, p.1);
    }
    for (name, p) in &peers {
        println!(
            "ratio ours / {name}: prefill {:.2}x, decode {:.2}x",
            ours.0 / p.0,
            ours.1 / p.1
        );
    }
}

/// The generated bench model of `--family` (written once).
fn generated_model(a: &Args) -> PathBuf {
    let spec = match std::env::var("BENCH_PRESET").as_deref() {
        Ok("qwen3-4b") => TinySpec::qwen3_4b(),
        _ => TinySpec::bench(a.family),
    };
    let dir = root().join(format!(
        "target/bench-models/{}-{}",
        a.family,
        std::env::var("BENCH_PRESET").unwrap_or("bench".into())
    ));
    if !dir.join("model.safetensors").exists() {
        write_model(&dir, &spec).expect("write the bench model");
    }
    println!(
        "model: {} shape, {:.0}M parameters, {:?}",
        a.family,
        spec.parameters() as f64 / 1e6,
        spec.dtype
    );
    dir
}
