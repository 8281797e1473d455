//! Where a speculative engine's time goes against the fast path, on a real
//! checkpoint and one prompt, one request at a time:
//!
//!     cargo bench -p speculative --bench plain_round -- --model DIR [--gen 48 --reps 3 --dtype auto --text PROMPT | --json-schema]
//!
//! First the cost of a verify of `k` drafts (`k + 1` positions in one
//! forward) relative to a decode step, median of 7. Then decode tok/s
//! (after the first token), interleaved per rep: the runtime's pipelined
//! loop (`DecodeStream`), the same steps unpipelined as a speculative
//! round takes them (one forward, read, next), the fast path engine, a
//! speculative engine whose draft source never proposes (every round a
//! plain step) and one with prompt lookup (adaptive, the default). Every
//! run's tokens are checked against the pipelined loop's. `--json-schema`:
//! the record prompt under its JSON Schema (real_text's `json (schema)`),
//! the engines only, checked against the fast path's tokens.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use engine_core::{Engine, GenerateRequest, Grammar};
use mlx_rs::transforms::eval;
use runtime::generate::{self, tokens_array, DecodeStream};
use runtime::model::{Logits, Tapped, Taps};
use runtime::{ComputeDtype, KvCache, KvPool, LoadedModel, Model, SharedModel};
use speculative::engine::DraftPlan;
use speculative::{DraftSource, DraftState, PromptLookup, Proposal, SpecEngine, SpecSettings};

/// A draft source with nothing to propose, ever.
struct Nothing;

impl DraftSource for Nothing {
    fn taps(&self) -> Taps {
        Taps::default()
    }
    fn max_draft(&self) -> usize {
        8
    }
    fn start(&self) -> Box<dyn DraftState> {
        Box::new(Nothing)
    }
}

impl DraftState for Nothing {
    fn observe(&mut self, _: &Model, _: &Tapped, _: std::ops::Range<i32>) -> anyhow::Result<()> {
        Ok(())
    }
    fn propose(&mut self, _: &Model, _: &KvCache, _: &[u32], _: usize) -> anyhow::Result<Proposal> {
        Ok(Proposal::None)
    }
}

/// A request's prompt, and the grammar and stop tokens of a constrained one.
struct Prompt {
    ids: Vec<u32>,
    grammar: Option<Grammar>,
    stop_tokens: Vec<u32>,
}

/// Tokens and decode seconds after the first token.
fn engine_run(engine: &dyn Engine, prompt: &Prompt, gen: usize) -> (Vec<u32>, f64) {
    let mut request = GenerateRequest::new(prompt.ids.clone(), gen as u32);
    request.grammar = prompt.grammar.clone();
    request.stop_tokens = prompt.stop_tokens.clone();
    let out = common::stream(engine, request);
    if let Some(s) = out.spec.filter(|s| s.drafted > 0) {
        println!(
            "  {}: accepted {}/{} drafted",
            engine.name(),
            s.accepted,
            s.drafted
        );
    }
    (out.tokens, out.decode_seconds)
}

fn pipelined(model: &Model, prompt: &[u32], gen: usize) -> (Vec<u32>, f64) {
    let mut s = DecodeStream::start(model, prompt).unwrap();
    let mut out = vec![s.next_token(true).unwrap()];
    let t = Instant::now();
    for i in 1..gen {
        out.push(s.next_token(i + 1 < gen).unwrap());
    }
    (out, t.elapsed().as_secs_f64())
}

/// Plain steps as `Sequence::round` takes them: forward the newest token,
/// wait for its successor, read it.
fn unpipelined(model: &Model, prompt: &[u32], gen: usize) -> (Vec<u32>, f64) {
    let mut cache = model.new_cache(1);
    let logits = generate::prefill(model, &mut cache, prompt, 512).unwrap();
    let mut token = generate::argmax_tokens(&logits).unwrap();
    eval([&token]).unwrap();
    let mut out = vec![token.item_exact::<i32>() as u32];
    let t = Instant::now();
    for _ in 1..gen {
        let input = tokens_array(&out[out.len() - 1..]);
        let tapped = model
            .forward_tapped(&input, &mut cache, Logits::All, &Taps::default())
            .unwrap();
        token = generate::argmax_tokens(&tapped.logits).unwrap();
        eval([&token]).unwrap();
        out.push(token.item_exact::<i32>() as u32);
    }
    (out, t.elapsed().as_secs_f64())
}

/// Median seconds of a forward over `k + 1` positions (then rolled back).
fn verify_seconds(model: &Model, cache: &mut KvCache, k: usize) -> f64 {
    let ids: Vec<u32> = (0..=k as u32).map(|i| 200 + i).collect();
    let mut times: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            let out = model
                .forward_tapped(&tokens_array(&ids), cache, Logits::All, &Taps::default())
                .unwrap();
            let greedy = mlx_rs::ops::indexing::argmax_axis(&out.logits, -1, None).unwrap();
            eval([&greedy]).unwrap();
            cache.truncate(k as i32 + 1).unwrap();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[3]
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let arg = |k: &str, default: &str| {
        argv.windows(2)
            .find(|w| w[0] == k)
            .map_or(default.to_string(), |w| w[1].clone())
    };
    let dir = PathBuf::from(arg("--model", ""));
    assert!(!dir.as_os_str().is_empty(), "--model DIR is required");
    let gen: usize = arg("--gen", "48").parse().expect("gen");
    let reps: usize = arg("--reps", "3").parse().expect("reps");
    let dtype: ComputeDtype = arg("--dtype", "auto").parse().expect("compute dtype");
    let schema = argv.iter().any(|a| a == "--json-schema");
    let text = match schema {
        true => common::RECORD.to_string(),
        false => arg("--text", "Write a short paragraph describing a quiet harbour town at dawn, from the point of view of a fisherman who has lived there all his life."),
    };
    let loaded = LoadedModel::load_as(&dir, None, dtype).expect("load");
    let bytes = loaded.model.kv_bytes_per_token();
    let shared = Arc::new(SharedModel::new(
        loaded,
        KvPool::with_budget(1 << 30, 16, bytes),
    ));
    let model = &shared.model.model;
    let messages = [serde_json::json!({"role": "user", "content": text})];
    let options = text::template::RenderOptions::default().with_generation_prompt();
    let template = shared.model.template.as_ref().expect("a chat template");
    let rendered = template.render(&messages, &options).expect("render");
    let prompt = shared
        .model
        .tokenizer
        .encode_chat(&rendered)
        .expect("encode");
    // A constrained answer ends where its grammar does.
    let request = Prompt {
        ids: prompt.clone(),
        grammar: schema.then(common::record_schema),
        stop_tokens: match schema {
            true => shared.model.stop_tokens.clone(),
            false => Vec::new(),
        },
    };

    let spec = |name: &str, plan: DraftPlan| {
        SpecEngine::new(
            name.into(),
            shared.clone(),
            SpecSettings::defaults(4, None),
            plan,
        )
        .expect("engine")
    };
    let fast = fastpath::FastpathEngine::new("fastpath".into(), shared.clone());
    let nothing = spec(
        "no drafts",
        DraftPlan {
            max_draft: 8,
            kv_bytes_per_token: 0,
            loader: Box::new(|_| Ok(Arc::new(Nothing) as Arc<dyn DraftSource>)),
        },
    );
    let lookup = spec(
        "prompt lookup",
        DraftPlan::prompt_lookup(PromptLookup::default()),
    );

    let mut cache = model.new_cache(1);
    eval([&generate::prefill(model, &mut cache, &prompt, 512).unwrap()]).unwrap();
    let step = verify_seconds(model, &mut cache, 0);
    let costs: Vec<String> = [1, 2, 4, 8, 15]
        .iter()
        .map(|&k| format!("k={k} {:.2}x", verify_seconds(model, &mut cache, k) / step))
        .collect();
    println!(
        "decode step {:.1} ms; verify of k drafts: {}",
        step * 1e3,
        costs.join(", ")
    );

    // Warm-up.
    pipelined(model, &prompt, 4);
    unpipelined(model, &prompt, 4);
    for e in [&fast as &dyn Engine, &nothing, &lookup] {
        engine_run(e, &request, 4);
    }
    let rate = |n: usize, t: f64| n.saturating_sub(1) as f64 / t;
    for _ in 0..reps {
        // The loops take no grammar: a constrained run checks the engines
        // against the fast path's tokens.
        let (mut reference, mut line) = (None, String::new());
        if !schema {
            let (tokens, t0) = pipelined(model, &prompt, gen);
            line += &format!("pipelined loop {:.2}, ", rate(tokens.len(), t0));
            let (unpiped, t) = unpipelined(model, &prompt, gen);
            assert_eq!(unpiped, tokens);
            line += &format!("unpipelined {:.2}, ", rate(tokens.len(), t));
            reference = Some(tokens);
        }
        for e in [&fast as &dyn Engine, &nothing, &lookup] {
            let (tokens, t) = engine_run(e, &request, gen);
            let reference = reference.get_or_insert_with(|| tokens.clone());
            assert_eq!(&tokens, reference, "{}", e.name());
            line += &format!("{} {:.2}, ", e.name(), rate(tokens.len(), t));
        }
        println!("{}tok/s", line);
    }
}
