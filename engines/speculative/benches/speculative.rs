//! Speculative engines against the fast path (and the batched engine) on a
//! generated target with random-weight drafters:
//!
//!     cargo bench -p speculative --bench speculative [-- --preset bench|qwen3-4b|qwen35|qwen35-4b
//!         --levels 1,2,4 --prompt 128 --gen 64 --rounds 2 --block 8 --mtp-k 3 --head-k 2 --reps 2]
//!
//! The Qwen 3.5 presets (hybrid, bench-sized or Qwen3.5-4B-shaped) ship a
//! one-layer MTP head in the checkpoint: their `mtp-head` row is the mtp
//! engine with `draft: checkpoint`, `head-k` drafts every round.
//!
//! (A real checkpoint on real prompts, per prompt type: the `real_text`
//! bench.)
//!
//! A random drafter is almost never right, so this measures what a round
//! costs, not what a trained drafter gains; the `agree-*` rows draft the
//! target's own greedy continuation (every draft accepted, blocks of
//! dflash's size and of mtp's k), the most the verify machinery gives: per engine and concurrency it
//! reports aggregate output tok/s, the ratio to the fast path (which serves
//! one request at a time, so its rate is the same at every level), the
//! acceptance rate, tokens per target forward, and the break-even
//! acceptance rate: the share of drafted tokens that must be accepted for a
//! round (draft + verify of k+1 tokens) to pay for itself against plain
//! decoding, `(t_round / t_token - 1) / k`, from decode-only timings at c=1.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use batched::{BatchedConfig, BatchedEngine};
use engine_core::{Engine, Event, GenerateRequest, SpecStats};
use fastpath::FastpathEngine;
use fixtures::model::{write_model, TinySpec};
use fixtures::qwen::QwenShape;
use fixtures::reference::equal_prefix;
use runtime::{Family, KvPool, LoadedModel, SharedModel};
use speculative::engine::DraftPlan;
use speculative::{DraftSource, Replay, SpecEngine, SpecSettings};

struct Args {
    preset: String,
    levels: Vec<usize>,
    prompt: usize,
    gen: usize,
    rounds: usize,
    block: usize,
    mtp_k: usize,
    /// Drafts per round of the checkpoint's own MTP head (Qwen 3.5 presets).
    head_k: usize,
    /// Sweeps run, interleaved; each cell keeps its best (machines here are
    /// shared and noisy).
    reps: usize,
}

fn args() -> Args {
    let mut a = Args {
        preset: "bench".into(),
        levels: vec![1, 2, 4],
        prompt: 128,
        gen: 64,
        rounds: 2,
        block: 8,
        mtp_k: 3,
        head_k: 2,
        reps: 2,
    };
    let argv: Vec<String> = std::env::args().collect();
    for w in argv.windows(2) {
        let v = &w[1];
        match w[0].as_str() {
            "--preset" => a.preset = v.clone(),
            "--levels" => a.levels = v.split(',').map(|x| x.parse().expect("level")).collect(),
            "--prompt" => a.prompt = v.parse().expect("prompt"),
            "--gen" => a.gen = v.parse().expect("gen"),
            "--rounds" => a.rounds = v.parse().expect("rounds"),
            "--block" => a.block = v.parse().expect("block"),
            "--mtp-k" => a.mtp_k = v.parse().expect("mtp-k"),
            "--head-k" => a.head_k = v.parse().expect("head-k"),
            "--reps" => a.reps = v.parse().expect("reps"),
            _ => {}
        }
    }
    a
}

/// The target (written once under target/bench-models) and its drafters.
fn models(a: &Args) -> (PathBuf, PathBuf, PathBuf) {
    let spec = match a.preset.as_str() {
        "qwen3-4b" => TinySpec::qwen3_4b(),
        "qwen35" => TinySpec {
            qwen: Some(QwenShape::qwen35().with_mtp(1)),
            ..TinySpec::bench(Family::Qwen3)
        },
        "qwen35-4b" => TinySpec {
            qwen: Some(QwenShape::qwen35_4b().with_mtp(1)),
            ..TinySpec::qwen35_4b()
        },
        _ => TinySpec::bench(Family::Qwen3),
    };
    // REPO_ROOT overrides the build-time path (the binary also runs on the
    // GPU machine, from another checkout).
    let root = std::env::var_os("REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    let dir = root.join(format!("target/bench-models/qwen3-{}", a.preset));
    if !dir.join("model.safetensors").exists() {
        eprintln!(
            "writing the {} model ({:.0}M parameters)...",
            a.preset,
            spec.parameters() as f64 / 1e6
        );
        write_model(&dir, &spec).expect("write bench model");
    }
    let dflash = dir.with_file_name(format!("qwen3-{}-dflash-b{}", a.preset, a.block));
    if !dflash.join("model.safetensors").exists() {
        let spec = fixtures::dflash::TinyDflash {
            layers: 2,
            block_size: a.block,
            seed: 7,
            ..fixtures::dflash::TinyDflash::default()
        };
        fixtures::dflash::write_drafter(&dir, &dflash, &spec).expect("write dflash drafter");
    }
    let mtp = dir.with_file_name(format!("qwen3-{}-mtp", a.preset));
    if !mtp.join("model.safetensors").exists() {
        let spec = fixtures::mtp::TinyAssistant {
            hidden: 256,
            layers: 2,
            seed: 11,
            ..fixtures::mtp::TinyAssistant::default()
        };
        fixtures::mtp::write_drafter(&dir, &mtp, &spec).expect("write mtp drafter");
    }
    (dir, dflash, mtp)
}

fn prompt(seed: usize, len: usize, vocab: u32) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104_729 + 13) as u32) % vocab)
        .collect()
}

#[derive(Default, Clone, Copy)]
struct Run {
    /// Requests served (prefills: not decode rounds).
    requests: usize,
    tokens: usize,
    seconds: f64,
    /// Decode-only (after each request's first token).
    decode_tokens: usize,
    decode_seconds: f64,
    spec: SpecStats,
}

impl Run {
    /// Adds another run's counts (not its wall time).
    fn add(&mut self, other: &Run) {
        self.requests += other.requests;
        self.tokens += other.tokens;
        self.decode_tokens += other.decode_tokens;
        self.decode_seconds += other.decode_seconds;
        self.spec.drafted += other.spec.drafted;
        self.spec.accepted += other.spec.accepted;
        self.spec.target_forwards += other.spec.target_forwards;
    }
}

fn one(engine: &dyn Engine, req: GenerateRequest) -> Run {
    let out = common::stream(engine, req);
    Run {
        requests: 1,
        tokens: out.tokens.len(),
        decode_tokens: out.decode_tokens(),
        decode_seconds: out.decode_seconds,
        spec: out.spec.unwrap_or_default(),
        ..Run::default()
    }
}

/// One client's requests: prompt ids.
type Work = Vec<Vec<u32>>;

/// Each client's requests at concurrency `c`: `rounds` synthetic prompts
/// each.
fn work(c: usize, a: &Args, vocab: u32) -> Vec<Work> {
    (0..c)
        .map(|id| {
            (0..a.rounds)
                .map(|r| prompt(id * 31 + r, a.prompt, vocab))
                .collect()
        })
        .collect()
}

/// The clients, each sending its requests back to back. The fast path
/// serves one at a time, so its clients run one after another.
fn level(engine: Arc<dyn Engine>, clients: Vec<Work>, gen: usize, serial: bool) -> Run {
    let start = Instant::now();
    let runs: Vec<Run> = common::clients(clients.len(), serial, |i| {
        clients[i]
            .iter()
            .map(|ids| {
                one(
                    engine.as_ref(),
                    GenerateRequest::new(ids.clone(), gen as u32),
                )
            })
            .collect::<Vec<_>>()
    })
    .into_iter()
    .flatten()
    .collect();
    let mut all = Run {
        seconds: start.elapsed().as_secs_f64(),
        ..Run::default()
    };
    for r in &runs {
        all.add(r);
    }
    all
}

fn main() {
    runtime::cuda_env::apply_defaults();
    let a = args();
    let (target, dflash_dir, mtp_dir) = models(&a);
    let model = LoadedModel::load(&target, Some("bench")).expect("load model");
    let vocab = model.vocab_size() as u32;
    let bytes = model.model.kv_bytes_per_token();
    let shared = Arc::new(SharedModel::new(
        model,
        KvPool::with_budget(4 << 30, 16, bytes),
    ));
    let settings = |yaml: String, max_batch: Option<usize>| {
        let section: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        SpecSettings::from_yaml(
            "bench",
            &section,
            Path::new("/"),
            SpecSettings::defaults(16, max_batch),
        )
        .unwrap()
    };
    let spec = |e: Result<SpecEngine, String>| Arc::new(e.expect("engine")) as Arc<dyn Engine>;
    let mut engines: Vec<(&str, Arc<dyn Engine>)> = vec![
        (
            "fastpath",
            Arc::new(FastpathEngine::new("fastpath".into(), shared.clone())),
        ),
        (
            "batched",
            Arc::new(BatchedEngine::new(
                "batched".into(),
                shared.clone(),
                BatchedConfig::default(),
            )),
        ),
    ];
    engines.push((
        "dflash",
        spec(dflash::new_engine(
            "dflash".into(),
            shared.clone(),
            settings(
                format!(
                    "{{ drafter: {}, max_concurrent: 16 }}",
                    dflash_dir.display()
                ),
                None,
            ),
        )),
    ));
    engines.push((
        "mtp",
        spec(mtp::new_engine(
            "mtp".into(),
            shared.clone(),
            settings(
                format!(
                    "{{ drafter: {}, max_concurrent: 16, draft_tokens: {} }}",
                    mtp_dir.display(),
                    a.mtp_k
                ),
                None,
            ),
        )),
    ));
    let has_head = shared
        .model
        .model
        .config
        .hybrid
        .as_ref()
        .is_some_and(|h| h.mtp_layers > 0);
    if has_head {
        engines.push((
            "mtp-head",
            spec(mtp::new_engine(
                "mtp-head".into(),
                shared.clone(),
                settings(
                    format!(
                        "{{ draft: checkpoint, max_concurrent: 16, draft_tokens: {}, adaptive: false }}",
                        a.head_k
                    ),
                    Some(2),
                ),
            )),
        ));
    }
    engines.push((
        "lookup",
        spec(dflash::new_engine(
            "lookup".into(),
            shared.clone(),
            settings("{ draft: ngram, max_concurrent: 16 }".into(), None),
        )),
    ));
    // A drafter that always agrees (the target's own greedy continuation
    // of every prompt the levels send), at dflash's block and mtp's k:
    // what the verify machinery gives when every draft is accepted.
    let mut continuations = HashMap::new();
    for &c in &a.levels {
        for p in work(c, &a, vocab).into_iter().flatten() {
            if !continuations.contains_key(&p) {
                let greedy =
                    runtime::generate::greedy(&shared.model.model, &p, a.gen, &[], |_| true)
                        .expect("greedy reference");
                continuations.insert(p, greedy.tokens);
            }
        }
    }
    for (name, k) in [("agree-block", a.block), ("agree-mtp-k", a.mtp_k)] {
        let replay = Arc::new(Replay::new(continuations.clone(), k));
        engines.push((
            name,
            spec(SpecEngine::new(
                name.into(),
                shared.clone(),
                settings("{ draft: ngram, max_concurrent: 16 }".into(), None),
                DraftPlan {
                    max_draft: k,
                    kv_bytes_per_token: 0,
                    loader: Box::new(move |_| Ok(replay as Arc<dyn DraftSource>)),
                },
            )),
        ));
    }
    // Warm up every engine's graphs once, and check each answers like the
    // fast path on this device (numerics differ between a verify of k+1
    // tokens and one-token steps only at near-ties).
    let check = prompt(999, a.prompt, vocab);
    let mut reference = Vec::new();
    for (name, e) in &engines {
        let mut stream = e
            .submit(GenerateRequest::new(check.clone(), a.gen as u32))
            .expect("submit");
        let mut ids = Vec::new();
        while let Some(Event::Token(t)) = stream.blocking_recv() {
            ids.push(t.id);
        }
        if *name == "fastpath" {
            reference = ids;
        } else {
            let same = equal_prefix(&ids, &reference);
            println!(
                "{name}: {same} of {} tokens equal the fast path's{}",
                reference.len(),
                if same == reference.len() {
                    ""
                } else {
                    " (diverged)"
                }
            );
        }
    }
    // Every (level, engine) cell keeps the fastest of `reps` interleaved runs.
    let mut best: Vec<Vec<Run>> = vec![vec![Run::default(); engines.len()]; a.levels.len()];
    for _ in 0..a.reps {
        for (li, &c) in a.levels.iter().enumerate() {
            for (ei, (name, engine)) in engines.iter().enumerate() {
                let clients = work(c, &a, vocab);
                let run = level(engine.clone(), clients, a.gen, *name == "fastpath");
                let cell = &mut best[li][ei];
                if cell.seconds == 0.0 || run.seconds < cell.seconds {
                    *cell = run;
                }
            }
        }
    }
    println!(
        "target {} ({}), prompt {} tokens, {} requests per client, {} generated, dflash block {}, mtp k {}, head k {}, best of {}, blas {}",
        a.preset, target.display(), a.prompt, a.rounds, a.gen, a.block, a.mtp_k, a.head_k, a.reps, mlx_sys::blas_backend()
    );
    println!();
    println!("| engine | c | tok/s | vs fastpath | vs batched | accepted/drafted | tokens/target forward | break-even acceptance |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut t_token = f64::NAN;
    for (li, &c) in a.levels.iter().enumerate() {
        let mut base = (0.0, 0.0);
        for (ei, (name, _)) in engines.iter().enumerate() {
            let run = best[li][ei];
            let tps = run.tokens as f64 / run.seconds;
            match *name {
                "fastpath" => {
                    base.0 = tps;
                    t_token = run.decode_seconds / run.decode_tokens.max(1) as f64;
                }
                "batched" => base.1 = tps,
                _ => {}
            }
            let (rate, per_forward, break_even) = spec_columns(&run, (c == 1).then_some(t_token));
            let vs_batched = if base.1 > 0.0 {
                format!("{:.2}x", tps / base.1)
            } else {
                String::new()
            };
            println!(
                "| {name} | {c} | {tps:.1} | {:.2}x | {vs_batched} | {rate} | {per_forward} | {break_even} |",
                tps / base.0
            );
        }
    }
}

/// Acceptance, tokens per target forward and (given the fast path's
/// decode time per token) the break-even acceptance of one run.
fn spec_columns(run: &Run, t_token: Option<f64>) -> (String, String, String) {
    let s = run.spec;
    if s.target_forwards == 0 {
        return ("".into(), "1.00".into(), "".into());
    }
    // Decode rounds only: each request's prefill is not a round.
    let rounds = s.target_forwards.saturating_sub(run.requests as u64).max(1);
    let k = s.drafted as f64 / rounds as f64;
    let t_round = run.decode_seconds / rounds as f64;
    let break_even = match t_token {
        Some(t) if k > 0.0 => format!("{:.2}", ((t_round / t) - 1.0) / k),
        _ => String::new(),
    };
    (
        format!("{:.3}", s.accepted as f64 / s.drafted.max(1) as f64),
        format!("{:.2}", run.tokens as f64 / s.target_forwards as f64),
        break_even,
    )
}
