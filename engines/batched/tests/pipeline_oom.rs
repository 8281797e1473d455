//! Pipelined decode through out-of-memory recovery: steps that fail (by
//! `GATEWAY_INJECT_OOM`, counted in model forwards of this process) while
//! a decode step is queued and unread fail no request, and every output
//! equals an undisturbed unpipelined run token for token (greedy and
//! seeded), with every KV block back (the disturbed run's server is paged:
//! its pool's blocks too). Its own test binary: the injection
//! plan is read once per process, at the first forward.

use std::sync::Arc;

use batched::{BatchedConfig, BatchedEngine};
use engine_core::{Engine, Event, EventStream, Finish, FinishReason, GenerateRequest};
use fixtures::model::{random_prompt, write_model, TinySpec};
use runtime::inject::OOM_ENV;
use runtime::paged::KvLayout;
use runtime::{generate, Family, KvPool, LoadedModel, SharedModel};

fn engine(shared: &Arc<SharedModel>, pipeline: bool) -> BatchedEngine {
    let cfg = BatchedConfig {
        pipeline,
        prefill_chunk: Some(8),
        max_batch: Some(8),
        ..Default::default()
    };
    BatchedEngine::new(format!("pipeline-{pipeline}"), shared.clone(), cfg)
}

fn collect(mut stream: EventStream) -> (Vec<u32>, Finish) {
    let mut tokens = Vec::new();
    loop {
        match stream.blocking_recv().expect("stream ended") {
            Event::Token(t) => tokens.push(t.id),
            Event::Finished(f) => return (tokens, f),
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
}

/// Six requests of different lengths at once (grouped and chunked
/// prefills), one of them sampled with a seed; what each saw.
fn run(engine: &BatchedEngine) -> Vec<(Vec<u32>, FinishReason, u32)> {
    let streams: Vec<_> = (0..6u64)
        .map(|i| {
            let mut r = GenerateRequest::new(
                random_prompt(i + 1, 3 + 7 * i as usize, 500),
                14 + 3 * i as u32,
            );
            if i == 2 {
                r.sampling.temperature = 1.0;
                r.sampling.seed = Some(17);
            }
            engine.submit(r).unwrap()
        })
        .collect();
    streams
        .into_iter()
        .map(|s| {
            let (tokens, f) = collect(s);
            (tokens, f.reason, f.completion_tokens)
        })
        .collect()
}

#[test]
fn pipelined_decode_recovers_from_out_of_memory_with_the_same_tokens() {
    // The first run makes far more than 20 forwards (its longest request
    // alone decodes 29 tokens), so each of these fails in it: group and
    // chunked prefills, decode steps with a step queued, recomputations.
    std::env::set_var(OOM_ENV, "3,7,12,20");
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &TinySpec::tiny(Family::Qwen3)).unwrap();
    let shared_as = |layout| {
        let model = LoadedModel::load(dir.path(), Some("tiny")).unwrap();
        let bytes = model.model.config.kv_bytes_per_token(4, None);
        let pool = KvPool::new(1024, 16, bytes * 16);
        Arc::new(SharedModel::with_layout(model, pool, 16, layout).unwrap())
    };

    let paged = shared_as(KvLayout::Paged);
    let disturbed = run(&engine(&paged, true));
    assert_eq!(paged.kv_pool.allocated(), 0, "KV leaked through recovery");
    // Blocks go back just after a row's final event.
    let pool = paged.pages().expect("a paged server");
    for _ in 0..100 {
        // The prefix cache's blocks come back for a sequence wanting all.
        drop(paged.kv_pool.try_reserve(paged.kv_pool.total()));
        if pool.free_blocks() == pool.usable() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(
        pool.free_blocks(),
        pool.usable(),
        "blocks leaked through recovery"
    );
    let shared = shared_as(KvLayout::Contiguous);
    let undisturbed = run(&engine(&shared, false));
    assert_eq!(disturbed, undisturbed);
    for (i, (tokens, reason, n)) in disturbed.iter().enumerate() {
        assert_eq!((*reason, *n as usize), (FinishReason::Length, tokens.len()));
        if i != 2 {
            let p = random_prompt(i as u64 + 1, 3 + 7 * i, 500);
            let alone = generate::greedy(&shared.model.model, &p, tokens.len(), &[], |_| true);
            assert_eq!(tokens, &alone.unwrap().tokens, "request {i}");
        }
    }
    assert_eq!(shared.kv_pool.allocated(), 0);
}
