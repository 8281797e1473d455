//! Quantized KV cache (`model.kv_cache`) against the model's dtype, side by
//! side in one run on a generated Qwen3 model:
//!
//!     cargo bench -p batched --bench kv_cache [-- --preset small|bench|qwen3-4b
//!         --kv-mb 4 --prompt 64 --gen 32 --levels 1,16 --rounds 3]
//!
//! Per setting: KV bytes per token (the pool's rate, and the bytes a
//! cache really holds after a prefill), the largest concurrency served
//! without queueing at a fixed pool budget (`--kv-mb`; 64 requests of
//! prompt + gen tokens submitted at once, peak running count), and the
//! batched engine's decode tok/s at each level (aggregate, and per
//! request from inter-token gaps), plus the raw loop at c=1: the settings
//! take turns for `--rounds` rounds (3) after a warm-up, and the table has medians.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use batched::{BatchedConfig, BatchedEngine};
use engine_core::{Engine, Event, GenerateRequest};
use fixtures::model::{write_model, TinySpec};
use runtime::{generate, Family, KvPool, KvQuant, LoadedModel, SharedModel};

struct Args {
    preset: String,
    kv_mb: usize,
    prompt: usize,
    gen: usize,
    levels: Vec<usize>,
    /// Timed rounds after the warm-up; each figure is their median.
    rounds: usize,
}

fn args() -> Args {
    let mut a = Args {
        preset: "small".into(),
        kv_mb: 4,
        prompt: 64,
        gen: 32,
        levels: vec![1, 16],
        rounds: 3,
    };
    let argv: Vec<String> = std::env::args().collect();
    for w in argv.windows(2) {
        match w[0].as_str() {
            "--preset" => a.preset = w[1].clone(),
            "--kv-mb" => a.kv_mb = w[1].parse().expect("kv-mb"),
            "--prompt" => a.prompt = w[1].parse().expect("prompt"),
            "--gen" => a.gen = w[1].parse().expect("gen"),
            "--rounds" => a.rounds = w[1].parse().expect("rounds"),
            "--levels" => a.levels = w[1].split(',').map(|x| x.parse().expect("level")).collect(),
            _ => {}
        }
    }
    a
}

/// `small`: 8 layers, hidden 256, 4 KV heads of 64 (~10M parameters);
/// `bench`: the ~100M-parameter Qwen3 shape of the other benchmarks;
/// `qwen3-4b`: Qwen3-4B's shape in bf16 (for the GPU).
fn model_dir(preset: &str) -> PathBuf {
    let spec = match preset {
        "bench" => TinySpec::bench(Family::Qwen3),
        "qwen3-4b" => TinySpec::qwen3_4b(),
        _ => TinySpec {
            hidden: 256,
            layers: 8,
            heads: 8,
            kv_heads: 4,
            head_dim: 64,
            intermediate: 768,
            vocab: 4096,
            ..TinySpec::tiny(Family::Qwen3)
        },
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(format!("target/bench-models/qwen3-kv-{preset}"));
    if !dir.join("model.safetensors").exists() {
        write_model(&dir, &spec).expect("write bench model");
    }
    dir
}

fn prompt(seed: usize, len: usize, vocab: u32) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104_729 + 13) as u32) % vocab)
        .collect()
}

/// Inter-token gaps (ms) of one streamed request.
fn run_one(engine: &dyn Engine, req: GenerateRequest) -> Vec<f64> {
    let mut stream = engine.submit(req).expect("submit");
    let (mut last, mut gaps) = (None::<Instant>, Vec::new());
    while let Some(ev) = stream.blocking_recv() {
        match ev {
            Event::Token(_) => {
                let now = Instant::now();
                if let Some(t) = last {
                    gaps.push((now - t).as_secs_f64() * 1e3);
                }
                last = Some(now);
            }
            Event::Finished(_) => break,
            Event::Error(e) => panic!("{e}"),
        }
    }
    gaps
}

/// `c` requests at once: aggregate output tok/s and mean per-request
/// decode tok/s.
fn level(engine: &Arc<dyn Engine>, c: usize, a: &Args, vocab: u32) -> (f64, f64) {
    let start = Instant::now();
    let handles: Vec<_> = (0..c)
        .map(|i| {
            let (engine, p) = (engine.clone(), prompt(i, a.prompt, vocab));
            let gen = a.gen as u32;
            std::thread::spawn(move || run_one(engine.as_ref(), GenerateRequest::new(p, gen)))
        })
        .collect();
    let gaps: Vec<f64> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let total = (c * a.gen) as f64 / start.elapsed().as_secs_f64();
    (total, 1e3 / (gaps.iter().sum::<f64>() / gaps.len() as f64))
}

/// Submits 64 requests at once to an engine over a pool of `kv_mb`, and
/// returns the most that ran at the same time.
fn served_without_queueing(dir: &Path, kv: Option<KvQuant>, a: &Args, vocab: u32) -> usize {
    let shared = shared(dir, kv, a.kv_mb << 20);
    let engine: Arc<dyn Engine> = Arc::new(BatchedEngine::new(
        "peak".into(),
        shared,
        BatchedConfig {
            max_batch: Some(64),
            max_queue: 64,
            ..Default::default()
        },
    ));
    let streams: Vec<_> = (0..64)
        .map(|i| {
            engine
                .submit(GenerateRequest::new(
                    prompt(i, a.prompt, vocab),
                    a.gen as u32,
                ))
                .expect("submit")
        })
        .collect();
    let mut peak = 0;
    let deadline = Instant::now() + Duration::from_secs(600);
    while Instant::now() < deadline {
        let load = engine.load();
        peak = peak.max(load.active);
        if load.active == 0 && load.queued == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(streams);
    peak
}

fn shared(dir: &Path, kv: Option<KvQuant>, budget: usize) -> Arc<SharedModel> {
    let mut model = LoadedModel::load(dir, None).expect("load");
    model.model.set_kv_quant(kv).expect("kv setting");
    let per_token = model.model.kv_bytes_per_token();
    Arc::new(SharedModel::new(
        model,
        KvPool::with_budget(budget, 16, per_token),
    ))
}

fn main() {
    runtime::cuda_env::apply_defaults();
    let a = args();
    let dir = model_dir(&a.preset);
    let settings = [
        None,
        Some(KvQuant {
            bits: 8,
            group_size: 64,
        }),
        Some(KvQuant {
            bits: 4,
            group_size: 64,
        }),
    ];
    println!("BLAS: {}; model: qwen3 {} preset; prompt {} + gen {} tokens; pool {} MiB for the concurrency column",
        mlx_sys::blas_backend(), a.preset, a.prompt, a.gen, a.kv_mb);
    let mut header =
        "| KV cache | bytes/token (pool) | bytes/token (held) | served at once |".to_string();
    let mut rule = "|---|---|---|---|".to_string();
    header.push_str(" raw loop tok/s |");
    rule.push_str("---|");
    for c in &a.levels {
        header.push_str(&format!(" c={c} total tok/s | c={c} per-request tok/s |"));
        rule.push_str("---|---|");
    }
    println!("\n{header}\n{rule}");
    // Every setting's model and engine side by side; the timed runs take
    // turns, `--rounds` times, and each figure is the median, so load from
    // elsewhere on the machine falls on every setting alike.
    let runs: Vec<_> = settings
        .iter()
        .map(|&kv| {
            let shared = shared(&dir, kv, 1 << 30);
            let engine: Arc<dyn Engine> = Arc::new(BatchedEngine::new(
                "batched".into(),
                shared.clone(),
                BatchedConfig::default(),
            ));
            (kv, shared, engine)
        })
        .collect();
    let vocab = runs[0].1.model.vocab_size() as u32;
    let p = prompt(0, a.prompt, vocab);
    let mut timed = vec![vec![Vec::new(); 1 + 2 * a.levels.len()]; runs.len()];
    for round in 0..=a.rounds {
        eprintln!("round {round} of {} (0 warms up)", a.rounds);
        for (i, (_, shared, engine)) in runs.iter().enumerate() {
            let model = &shared.model.model;
            let raw = generate::greedy(model, &p, a.gen, &[], |_| true).unwrap();
            let mut figures = vec![(raw.tokens.len() - 1) as f64 / raw.decode_time.as_secs_f64()];
            for &c in &a.levels {
                let (total, per) = level(engine, c, &a, vocab);
                figures.extend([total, per]);
            }
            // Round 0 warms up.
            if round > 0 {
                for (t, f) in timed[i].iter_mut().zip(figures) {
                    t.push(f);
                }
            }
        }
    }
    for ((kv, shared, _), timed) in runs.iter().zip(timed) {
        let model = &shared.model.model;
        let mut cache = model.new_cache(1);
        generate::prefill(model, &mut cache, &p, 512).unwrap();
        mlx_rs::transforms::eval(&cache.state()).unwrap();
        // A cache holds whole 256-position steps.
        let held = cache.nbytes() / 256;
        let mut row = format!(
            "| {} | {} | {held} | {} |",
            kv.map_or("model dtype".to_string(), |q| format!(
                "{} bits, group {}",
                q.bits, q.group_size
            )),
            model.kv_bytes_per_token(),
            served_without_queueing(&dir, *kv, &a, vocab),
        );
        for mut t in timed {
            t.sort_by(f64::total_cmp);
            row.push_str(&format!(" {:.1} |", t[t.len() / 2]));
        }
        println!("{row}");
    }
}
