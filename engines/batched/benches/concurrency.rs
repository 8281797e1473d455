//! Engine-level serving benchmark on a generated model:
//!
//!     cargo bench -p batched --bench concurrency [-- --preset bench|qwen3-4b
//!         --levels 1,2,4,8,16 --prompt 128 --gen 64 --rounds 2 --pipeline on|off|both
//!         --no-stall]
//!
//! For each concurrency level c, c clients each send `rounds` requests back
//! to back; reports aggregate output tok/s, TTFT and inter-token latency
//! p50/p99, with the batched engine's pipelined decode on (its default),
//! off, or both one after the other on the same model (`--pipeline`).
//! Also: the raw model loop and the fast path engine at c=1 (the
//! baseline the batched engine is held to), and the inter-token latency of
//! running rows while a long prompt is prefilled, with and without chunking
//! (not with `--no-stall`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use batched::{BatchedConfig, BatchedEngine};
use engine_core::{Engine, Event, GenerateRequest};
use fastpath::FastpathEngine;
use fixtures::model::{write_model, TinySpec};
use runtime::{generate, Family, KvPool, LoadedModel, SharedModel};

struct Args {
    preset: String,
    levels: Vec<usize>,
    prompt: usize,
    gen: usize,
    rounds: usize,
    /// The batched engine's `pipeline` settings to measure, in order.
    pipeline: Vec<bool>,
    stall: bool,
}

fn args() -> Args {
    let mut a = Args {
        preset: "bench".into(),
        levels: vec![1, 2, 4, 8, 16],
        prompt: 128,
        gen: 64,
        rounds: 2,
        pipeline: vec![true],
        stall: true,
    };
    let argv: Vec<String> = std::env::args().collect();
    a.stall = !argv.iter().any(|x| x == "--no-stall");
    for w in argv.windows(2) {
        match w[0].as_str() {
            "--preset" => a.preset = w[1].clone(),
            "--levels" => a.levels = w[1].split(',').map(|x| x.parse().expect("level")).collect(),
            "--prompt" => a.prompt = w[1].parse().expect("prompt"),
            "--gen" => a.gen = w[1].parse().expect("gen"),
            "--rounds" => a.rounds = w[1].parse().expect("rounds"),
            "--pipeline" => {
                a.pipeline = match w[1].as_str() {
                    "on" => vec![true],
                    "off" => vec![false],
                    "both" => vec![true, false],
                    other => panic!("--pipeline on|off|both, not {other}"),
                }
            }
            _ => {}
        }
    }
    a
}

fn model_dir(preset: &str) -> PathBuf {
    let spec = match preset {
        "qwen3-4b" => TinySpec::qwen3_4b(),
        _ => TinySpec::bench(Family::Qwen3),
    };
    // REPO_ROOT overrides the build-time path (the binary also runs on the
    // GPU machine, from another checkout).
    let root = std::env::var_os("REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    let dir = root.join(format!("target/bench-models/qwen3-{preset}"));
    if !dir.join("model.safetensors").exists() {
        eprintln!(
            "writing the {preset} model ({:.0}M parameters)...",
            spec.parameters() as f64 / 1e6
        );
        write_model(&dir, &spec).expect("write bench model");
    }
    dir
}

fn prompt(seed: usize, len: usize, vocab: u32) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104_729 + 13) as u32) % vocab)
        .collect()
}

#[derive(Default)]
struct Samples {
    ttft: Vec<f64>,
    itl: Vec<f64>,
    tokens: usize,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// One request, streamed: TTFT and every inter-token gap, in ms.
fn run_one(engine: &dyn Engine, req: GenerateRequest, out: &mut Samples) {
    let start = Instant::now();
    let mut stream = engine.submit(req).expect("submit");
    let mut last = None::<Instant>;
    while let Some(ev) = stream.blocking_recv() {
        match ev {
            Event::Token(_) => {
                let now = Instant::now();
                match last {
                    None => out.ttft.push((now - start).as_secs_f64() * 1e3),
                    Some(t) => out.itl.push((now - t).as_secs_f64() * 1e3),
                }
                last = Some(now);
                out.tokens += 1;
            }
            Event::Finished(_) => break,
            Event::Error(e) => panic!("{e}"),
        }
    }
}

/// `salt` varies the prompts (the prefix cache outlives an engine: a sweep
/// after another must not reuse its prompts).
fn level(engine: Arc<dyn Engine>, c: usize, a: &Args, vocab: u32, salt: usize) -> (f64, Samples) {
    let start = Instant::now();
    let handles: Vec<_> = (0..c)
        .map(|client| {
            let engine = engine.clone();
            let (p, g, rounds) = (a.prompt, a.gen, a.rounds);
            std::thread::spawn(move || {
                let mut s = Samples::default();
                for r in 0..rounds {
                    run_one(
                        engine.as_ref(),
                        GenerateRequest::new(prompt(salt + client * 31 + r, p, vocab), g as u32),
                        &mut s,
                    );
                }
                s
            })
        })
        .collect();
    let mut all = Samples::default();
    for h in handles {
        let s = h.join().unwrap();
        all.ttft.extend(s.ttft);
        all.itl.extend(s.itl);
        all.tokens += s.tokens;
    }
    (all.tokens as f64 / start.elapsed().as_secs_f64(), all)
}

/// Worst and p99 inter-token gap of 4 running rows while a long prompt is
/// prefilled.
fn long_prompt_stall(
    shared: &Arc<SharedModel>,
    chunk: usize,
    long: usize,
    vocab: u32,
) -> (f64, f64) {
    let engine = Arc::new(BatchedEngine::new(
        format!("stall-{chunk}"),
        shared.clone(),
        BatchedConfig {
            prefill_chunk: Some(chunk),
            ..Default::default()
        },
    ));
    let runners: Vec<_> = (0..4)
        .map(|i| {
            let e = engine.clone();
            std::thread::spawn(move || {
                let mut s = Samples::default();
                run_one(
                    e.as_ref(),
                    GenerateRequest::new(prompt(900 + i, 32, vocab), 96),
                    &mut s,
                );
                s
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut long_s = Samples::default();
    run_one(
        engine.as_ref(),
        GenerateRequest::new(prompt(999, long, vocab), 4),
        &mut long_s,
    );
    let mut itl: Vec<f64> = runners
        .into_iter()
        .flat_map(|h| h.join().unwrap().itl)
        .collect();
    let worst = itl.iter().copied().fold(0.0, f64::max);
    (worst, pct(&mut itl, 0.99))
}

/// The concurrency levels on a batched engine with `pipeline` as given.
fn sweep(
    shared: &Arc<SharedModel>,
    pipeline: bool,
    a: &Args,
    vocab: u32,
    raw_tps: f64,
    salt: usize,
) {
    let engine: Arc<dyn Engine> = Arc::new(BatchedEngine::new(
        format!("batched-pipeline-{pipeline}"),
        shared.clone(),
        BatchedConfig {
            pipeline,
            ..Default::default()
        },
    ));
    let p = prompt(1, a.prompt, vocab);
    let mut s = Samples::default();
    run_one(engine.as_ref(), GenerateRequest::new(p, 8), &mut s); // warm-up
    let mode = if pipeline { "on" } else { "off" };
    println!("\nbatched engine, pipelined decode {mode}:");
    println!("\n| c | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |");
    println!("|---|---|---|---|---|---|");
    let mut c1 = None;
    let mut last = 0.0;
    for &c in &a.levels {
        let (tps, mut s) = level(engine.clone(), c, a, vocab, salt);
        if c == 1 {
            c1 = Some(1e3 / (s.itl.iter().sum::<f64>() / s.itl.len() as f64));
        }
        last = tps;
        println!(
            "| {c} | {tps:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
            pct(&mut s.ttft, 0.5),
            pct(&mut s.ttft, 0.99),
            pct(&mut s.itl, 0.5),
            pct(&mut s.itl, 0.99)
        );
    }
    if let Some(b1) = c1 {
        println!(
            "batched engine (pipeline {mode}) at c=1: {b1:.1} tok/s decode ({:.1}% of raw)",
            100.0 * b1 / raw_tps
        );
        let top = a.levels.last().copied().unwrap_or(1);
        println!("aggregate at c={top} over c=1 decode: {:.2}x", last / b1);
    }
}

fn main() {
    runtime::cuda_env::apply_defaults();
    let a = args();
    let dir = model_dir(&a.preset);
    let model = LoadedModel::load(&dir, None).expect("load");
    let vocab = model.vocab_size() as u32;
    let bytes = model.model.config.kv_bytes_per_token(4, None);
    let shared = Arc::new(SharedModel::new(
        model,
        KvPool::new(1 << 16, 16, bytes * 16),
    ));
    println!(
        "device: {:?}; BLAS: {}",
        mlx_rs::Device::default(),
        mlx_sys::blas_backend()
    );
    println!(
        "model: qwen3 {} preset; prompt {} tokens, {} generated per request",
        a.preset, a.prompt, a.gen
    );

    // Baselines at c=1: the raw loop and the fast path engine.
    let p = prompt(1, a.prompt, vocab);
    let _ = generate::greedy(&shared.model.model, &p, 8, &[], |_| true);
    let raw = generate::greedy(&shared.model.model, &p, a.gen, &[], |_| true).unwrap();
    let raw_tps = (raw.tokens.len() - 1) as f64 / raw.decode_time.as_secs_f64();
    let fast = FastpathEngine::new("fastpath".into(), shared.clone());
    // Warm-up: the worker thread's first request compiles its kernels.
    run_one(
        &fast,
        GenerateRequest::new(p.clone(), 8),
        &mut Samples::default(),
    );
    let mut fs = Samples::default();
    run_one(
        &fast,
        GenerateRequest::new(p.clone(), a.gen as u32),
        &mut fs,
    );
    let fast_decode = 1e3 / (fs.itl.iter().sum::<f64>() / fs.itl.len() as f64);
    drop(fast);

    println!("\nsingle-request decode tok/s: raw loop {raw_tps:.1}, fast path engine {fast_decode:.1} ({:.1}% of raw)", 100.0 * fast_decode / raw_tps);
    for (i, &pipeline) in a.pipeline.iter().enumerate() {
        sweep(&shared, pipeline, &a, vocab, raw_tps, 100_000 * (i + 1));
    }
    if !a.stall {
        return;
    }
    let long = (a.prompt * 8).max(1024);
    let (worst_chunked, p99_chunked) = long_prompt_stall(&shared, 256, long, vocab);
    let (worst_whole, p99_whole) = long_prompt_stall(&shared, long, long, vocab);
    println!(
        "ITL of 4 running rows while a {long}-token prompt arrives: chunked prefill (256/step) worst {worst_chunked:.1} ms, p99 {p99_chunked:.1} ms; unchunked worst {worst_whole:.1} ms, p99 {p99_whole:.1} ms"
    );
}
