//! Speculative engines with prompt lookup against the fast path, on a real
//! checkpoint and real prompts, one request at a time, per prompt type:
//!
//!     cargo bench -p speculative --bench real_text -- --model DIR [--drafter DIR --gen 128 --reps 2 --per-kind 1 --prefix-entries 16 --no-fixed --only KIND --levels 1,2,4]
//!
//! Prompt types: the bundled mixed set (`bench/prompts/mixed.jsonl`; tool
//! calls left out, they need the gateway's tool rendering) and two that
//! quote their input (`edit`, `extract`), and one whose answer a JSON
//! Schema constrains (`json (schema)`: a record copied into JSON, the
//! grammar verified with each draft). Engines: the fast path, `dflash`
//! and `mtp` with `draft: ngram` (3/1/8, adaptive sizing, the default), and
//! `dflash` with `adaptive: false` (every round verifies the full block of
//! 8: the fixed-k behaviour; `--no-fixed` leaves the fixed-k engines out); with `--drafter`, `dflash` with that trained
//! DFlash checkpoint, adaptive and fixed (every round drafts the full
//! block). Each cell: decode tok/s (after the first token), its ratio to
//! the fast path on the same prompts, accepted / drafted, the acceptance
//! length (tokens committed per decode round: accepted drafts + the
//! target's own) and tokens per target forward (prefill included); engines
//! interleaved per prompt,
//! each keeping its best of `reps`. Every engine's tokens are checked
//! against the fast path's.
//!
//! `--levels` adds a second table: per prompt type and concurrency `c`,
//! `c` clients sending that prompt at once to the batched engine and the
//! prompt-lookup engines (and to the fast path, which serves one at a
//! time, one after another), as aggregate tok/s over the wall time
//! (prefill included), every client's tokens checked against the fast
//! path's.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::time::Instant;

use batched::{BatchedConfig, BatchedEngine};
use common::{record_schema, RECORD};
use engine_core::{Engine, GenerateRequest, Grammar, SpecStats};
use fastpath::FastpathEngine;
use fixtures::reference::equal_prefix;
use runtime::{ComputeDtype, KvPool, LoadedModel, SharedModel};
use speculative::SpecSettings;

const EDIT: &str = "Here is a Python function:\n\n```python\ndef summarize(orders):\n    total = 0\n    count = 0\n    for order in orders:\n        if order.status == \"paid\":\n            total += order.amount\n            count += 1\n    average = total / count if count else 0\n    return {\"total\": total, \"count\": count, \"average\": average}\n```\n\nRename the variable `total` to `paid_total` everywhere and return the complete updated function in a code block.";

const EXTRACT: &str = "Here is a configuration file:\n\n```\nserver.host = 0.0.0.0\nserver.port = 8080\nserver.read_timeout = 30s\ndatabase.url = postgres://db:5432/shop\ndatabase.pool_size = 16\ndatabase.connect_timeout = 5s\ncache.enabled = true\ncache.ttl = 600s\n```\n\nCopy out, unchanged and in a code block, every line of this file that starts with `server.` or `database.`.";

struct Args {
    model: PathBuf,
    /// A trained DFlash drafter for the model.
    drafter: Option<PathBuf>,
    dtype: ComputeDtype,
    gen: usize,
    reps: usize,
    per_kind: usize,
    /// Prefixes the engines share (0: none, each prefills alone).
    prefix_entries: usize,
    fixed: bool,
    /// Concurrency levels of the second table (none: no second table).
    levels: Vec<usize>,
    /// Only the prompt types whose name contains this.
    only: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        model: PathBuf::new(),
        drafter: None,
        dtype: ComputeDtype::Auto,
        gen: 128,
        reps: 2,
        per_kind: 1,
        prefix_entries: runtime::shared::DEFAULT_PREFIX_CACHE_ENTRIES,
        fixed: !std::env::args().any(|a| a == "--no-fixed"),
        levels: Vec::new(),
        only: None,
    };
    let argv: Vec<String> = std::env::args().collect();
    for w in argv.windows(2) {
        let v = &w[1];
        match w[0].as_str() {
            "--model" => a.model = v.into(),
            "--drafter" => a.drafter = Some(v.into()),
            "--dtype" => a.dtype = v.parse().expect("compute dtype"),
            "--gen" => a.gen = v.parse().expect("gen"),
            "--reps" => a.reps = v.parse().expect("reps"),
            "--per-kind" => a.per_kind = v.parse().expect("per-kind"),
            "--prefix-entries" => a.prefix_entries = v.parse().expect("prefix-entries"),
            "--levels" => a.levels = v.split(',').map(|c| c.parse().expect("level")).collect(),
            "--only" => a.only = Some(v.clone()),
            _ => {}
        }
    }
    assert!(
        !a.model.as_os_str().is_empty(),
        "--model DIR (a real checkpoint) is required"
    );
    a
}

fn root() -> PathBuf {
    std::env::var_os("REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// (kind, prompt text, grammar): `per_kind` of each kind of the mixed set,
/// then the quoting prompts and the constrained one.
fn prompts(per_kind: usize) -> Vec<(String, String, Option<Grammar>)> {
    let file = root().join("bench/prompts/mixed.jsonl");
    let text = std::fs::read_to_string(&file).expect("read the mixed prompt set");
    let mut taken: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).expect("prompt line");
        let kind = v["kind"].as_str().unwrap_or_default().to_string();
        if kind == "tool_call" {
            continue;
        }
        let n = taken.entry(kind.clone()).or_default();
        if *n < per_kind {
            *n += 1;
            let prompt = v["prompt"].as_str().unwrap_or_default().to_string();
            out.push((kind, prompt, None));
        }
    }
    out.push(("edit (quotes)".into(), EDIT.into(), None));
    out.push(("extract (quotes)".into(), EXTRACT.into(), None));
    out.push(("json (schema)".into(), RECORD.into(), Some(record_schema())));
    out
}

struct Prompt {
    ids: Vec<u32>,
    grammar: Option<Grammar>,
    stop_tokens: Vec<u32>,
}

#[derive(Default, Clone, Copy)]
struct Run {
    decode_tokens: usize,
    decode_seconds: f64,
    spec: SpecStats,
}

fn one(engine: &dyn Engine, prompt: &Prompt, gen: usize) -> (Vec<u32>, Run) {
    let mut request = GenerateRequest::new(prompt.ids.clone(), gen as u32);
    request.grammar = prompt.grammar.clone();
    request.stop_tokens = prompt.stop_tokens.clone();
    let out = common::stream(engine, request);
    let run = Run {
        decode_tokens: out.decode_tokens(),
        decode_seconds: out.decode_seconds,
        spec: out.spec.unwrap_or_default(),
    };
    (out.tokens, run)
}

fn main() {
    runtime::cuda_env::apply_defaults();
    let a = args();
    let model = LoadedModel::load_as(&a.model, Some("bench"), a.dtype).expect("load model");
    let bytes = model.model.kv_bytes_per_token();
    let encoded: Vec<(String, Prompt)> = prompts(a.per_kind)
        .into_iter()
        .filter(|(kind, ..)| a.only.as_ref().is_none_or(|o| kind.contains(o.as_str())))
        .map(|(kind, text, grammar)| {
            let messages = [serde_json::json!({"role": "user", "content": text})];
            let options = text::template::RenderOptions::default().with_generation_prompt();
            let rendered = model
                .template
                .as_ref()
                .expect("the checkpoint has a chat template")
                .render(&messages, &options)
                .expect("render");
            let ids = model.tokenizer.encode_chat(&rendered).expect("encode");
            // A constrained answer ends where its grammar does.
            let stop_tokens = match grammar {
                Some(_) => model.stop_tokens.clone(),
                None => Vec::new(),
            };
            let prompt = Prompt {
                ids,
                grammar,
                stop_tokens,
            };
            (kind, prompt)
        })
        .collect();
    let dtype = model.model.dtype();
    let shared = Arc::new(SharedModel::with_prefix_cache(
        model,
        KvPool::with_budget(1 << 30, 16, bytes),
        a.prefix_entries,
    ));
    let settings = |yaml: &str, max_batch: Option<usize>| {
        let section: serde_yaml::Value = serde_yaml::from_str(yaml).unwrap();
        SpecSettings::from_yaml(
            "bench",
            &section,
            Path::new("/"),
            SpecSettings::defaults(4, max_batch),
        )
        .unwrap()
    };
    let ngram = "{ draft: ngram, ngram: { max_ngram: 3, min_ngram: 1, draft_tokens: 8 } }";
    let fixed =
        "{ draft: ngram, adaptive: false, ngram: { max_ngram: 3, min_ngram: 1, draft_tokens: 8 } }";
    let spec = |e: Result<speculative::SpecEngine, String>| {
        Arc::new(e.expect("engine")) as Arc<dyn Engine>
    };
    let mut engines: Vec<(&str, Arc<dyn Engine>)> = vec![
        (
            "fastpath",
            Arc::new(FastpathEngine::new("fastpath".into(), shared.clone())),
        ),
        (
            "dflash ngram",
            spec(dflash::new_engine(
                "dflash".into(),
                shared.clone(),
                settings(ngram, None),
            )),
        ),
        (
            "mtp ngram",
            spec(mtp::new_engine(
                "mtp".into(),
                shared.clone(),
                settings(ngram, Some(2)),
            )),
        ),
    ];
    if a.fixed {
        engines.push((
            "dflash ngram, fixed k=8",
            spec(dflash::new_engine(
                "dflash-fixed".into(),
                shared.clone(),
                settings(fixed, None),
            )),
        ));
    }
    if let Some(dir) = &a.drafter {
        let dir = dir.canonicalize().expect("the drafter directory");
        let trained =
            |fixed: bool| format!("{{ drafter: {}, adaptive: {} }}", dir.display(), !fixed);
        engines.push((
            "dflash drafter",
            spec(dflash::new_engine(
                "dflash-drafter".into(),
                shared.clone(),
                settings(&trained(false), None),
            )),
        ));
        if a.fixed {
            engines.push((
                "dflash drafter, fixed k",
                spec(dflash::new_engine(
                    "dflash-drafter-fixed".into(),
                    shared.clone(),
                    settings(&trained(true), None),
                )),
            ));
        }
    }
    // Warm-up: every engine's graphs once.
    for (_, e) in &engines {
        one(e.as_ref(), &encoded[0].1, 8);
    }
    // best[prompt][engine]
    let mut best = vec![vec![Run::default(); engines.len()]; encoded.len()];
    // The fast path's tokens per prompt, what every other run must give.
    let mut references = vec![Vec::new(); encoded.len()];
    for _ in 0..a.reps {
        for (pi, (kind, prompt)) in encoded.iter().enumerate() {
            for (ei, (name, e)) in engines.iter().enumerate() {
                let (ids, run) = one(e.as_ref(), prompt, a.gen);
                if ei == 0 {
                    references[pi] = ids;
                } else {
                    check(kind, name, &ids, &references[pi]);
                }
                let cell = &mut best[pi][ei];
                let rate = |r: &Run| r.decode_tokens as f64 / r.decode_seconds.max(1e-9);
                if cell.decode_seconds == 0.0 || rate(&run) > rate(cell) {
                    *cell = run;
                }
            }
        }
    }
    println!(
        "model {} ({dtype:?}), {} generated, best of {}, one request at a time, blas {}",
        a.model.display(),
        a.gen,
        a.reps,
        mlx_sys::blas_backend()
    );
    println!();
    println!("| prompt type | engine | decode tok/s | vs fastpath | accepted/drafted | acceptance length | tokens/target forward |");
    println!("|---|---|---|---|---|---|---|");
    // Prompts of one kind are summed.
    let mut kinds: Vec<&str> = Vec::new();
    for (kind, _) in &encoded {
        if !kinds.contains(&kind.as_str()) {
            kinds.push(kind);
        }
    }
    for kind in kinds {
        let rows: Vec<usize> = (0..encoded.len())
            .filter(|&p| encoded[p].0 == kind)
            .collect();
        let sum = |ei: usize| {
            rows.iter().fold(Run::default(), |mut acc, &p| {
                let r = best[p][ei];
                acc.decode_tokens += r.decode_tokens;
                acc.decode_seconds += r.decode_seconds;
                acc.spec.drafted += r.spec.drafted;
                acc.spec.accepted += r.spec.accepted;
                acc.spec.target_forwards += r.spec.target_forwards;
                acc
            })
        };
        let base = sum(0);
        let base_tps = base.decode_tokens as f64 / base.decode_seconds;
        for (ei, (name, _)) in engines.iter().enumerate() {
            let r = sum(ei);
            let tps = r.decode_tokens as f64 / r.decode_seconds;
            let (rate, length, per_forward) = if ei == 0 {
                (String::new(), "1.00".to_string(), "1.00".to_string())
            } else {
                // Each request's first forward is its prefill.
                let rounds = r.spec.target_forwards.saturating_sub(rows.len() as u64);
                (
                    format!("{}/{}", r.spec.accepted, r.spec.drafted),
                    format!("{:.2}", r.decode_tokens as f64 / rounds.max(1) as f64),
                    format!(
                        "{:.2}",
                        (r.decode_tokens + rows.len()) as f64
                            / r.spec.target_forwards.max(1) as f64
                    ),
                )
            };
            println!(
                "| {kind} | {name} | {tps:.2} | {:.2}x | {rate} | {length} | {per_forward} |",
                tps / base_tps
            );
        }
    }
    if a.levels.is_empty() {
        return;
    }
    let batched: Arc<dyn Engine> = Arc::new(BatchedEngine::new(
        "batched".into(),
        shared.clone(),
        BatchedConfig::default(),
    ));
    one(batched.as_ref(), &encoded[0].1, 8);
    // (name, engine, serves one request at a time)
    let concurrent: Vec<(&str, Arc<dyn Engine>, bool)> = vec![
        ("fastpath", engines[0].1.clone(), true),
        ("batched", batched, false),
        (engines[1].0, engines[1].1.clone(), false),
        (engines[2].0, engines[2].1.clone(), false),
    ];
    println!();
    println!("| prompt type | c | engine | tok/s, all clients | vs fastpath | vs batched | accepted/drafted |");
    println!("|---|---|---|---|---|---|---|");
    for &c in &a.levels {
        for (pi, (kind, prompt)) in encoded.iter().enumerate() {
            let mut rates = Vec::new();
            for (name, engine, serial) in &concurrent {
                let mut fastest: Option<(f64, SpecStats)> = None;
                for _ in 0..a.reps {
                    let (outputs, seconds, spec) = clients(engine, prompt, a.gen, c, *serial);
                    for ids in &outputs {
                        check(kind, name, ids, &references[pi]);
                    }
                    let tokens: usize = outputs.iter().map(Vec::len).sum();
                    let rate = tokens as f64 / seconds;
                    if fastest.is_none_or(|(r, _)| rate > r) {
                        fastest = Some((rate, spec));
                    }
                }
                rates.push(fastest.expect("reps >= 1"));
            }
            for (i, (name, _, _)) in concurrent.iter().enumerate() {
                let (rate, spec) = rates[i];
                let drafts = match i {
                    0 | 1 => String::new(),
                    _ => format!("{}/{}", spec.accepted, spec.drafted),
                };
                println!(
                    "| {kind} | {c} | {name} | {rate:.2} | {:.2}x | {:.2}x | {drafts} |",
                    rate / rates[0].0,
                    rate / rates[1].0
                );
            }
        }
    }
}

/// Reports a run whose tokens left the fast path's.
fn check(kind: &str, engine: &str, ids: &[u32], reference: &[u32]) {
    if ids != reference {
        let same = equal_prefix(&ids, reference);
        println!("{kind}: {engine} diverged from the fast path after {same} tokens");
    }
}

/// `c` clients sending `prompt` at once (one after another when
/// `serial`): each client's tokens, the wall seconds, and the summed
/// speculation counts.
fn clients(
    engine: &Arc<dyn Engine>,
    prompt: &Prompt,
    gen: usize,
    c: usize,
    serial: bool,
) -> (Vec<Vec<u32>>, f64, SpecStats) {
    let start = Instant::now();
    let runs = common::clients(c, serial, |_| one(engine.as_ref(), prompt, gen));
    let seconds = start.elapsed().as_secs_f64();
    let mut spec = SpecStats::default();
    for (_, r) in &runs {
        spec.drafted += r.spec.drafted;
        spec.accepted += r.spec.accepted;
        spec.target_forwards += r.spec.target_forwards;
    }
    (
        runs.into_iter().map(|(ids, _)| ids).collect(),
        seconds,
        spec,
    )
}
