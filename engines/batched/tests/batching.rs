//! The batched engine against plain greedy decoding of each request alone,
//! on a generated model: mixed prompt lengths, requests joining mid-flight,
//! cancellation, KV accounting, validation and the prefix cache.

use std::sync::Arc;
use std::time::Duration;

use batched::{BatchedConfig, BatchedEngine};
use engine_core::{
    Engine, EngineError, Event, EventStream, Finish, FinishReason, GenerateRequest, SamplingParams,
    TokenEvent,
};
use fixtures::model::{random_prompt, write_model, TinySpec};
use runtime::paged::KvLayout;
use runtime::{generate, Family, KvPool, LoadedModel, SharedModel};

fn setup(
    pool_blocks: usize,
    cfg: BatchedConfig,
) -> (tempfile::TempDir, Arc<SharedModel>, BatchedEngine) {
    setup_as(pool_blocks, cfg, KvLayout::Contiguous)
}

fn setup_as(
    pool_blocks: usize,
    cfg: BatchedConfig,
    layout: KvLayout,
) -> (tempfile::TempDir, Arc<SharedModel>, BatchedEngine) {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &TinySpec::tiny(Family::Qwen3)).unwrap();
    let model = LoadedModel::load(dir.path(), Some("tiny")).unwrap();
    let bytes = model.model.config.kv_bytes_per_token(4, None);
    let pool = KvPool::new(pool_blocks, 16, bytes * 16);
    let shared = Arc::new(SharedModel::with_layout(model, pool, 16, layout).unwrap());
    let engine = BatchedEngine::new("batched".into(), shared.clone(), cfg);
    (dir, shared, engine)
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    random_prompt(seed, len, 500)
}

fn request(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest::new(prompt, max_tokens)
}

fn collect(mut stream: EventStream) -> (Vec<u32>, Finish) {
    let mut tokens = Vec::new();
    loop {
        match stream
            .blocking_recv()
            .expect("stream ended without Finished")
        {
            Event::Token(t) => tokens.push(t.id),
            Event::Finished(f) => return (tokens, f),
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
}

fn alone(shared: &SharedModel, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    generate::greedy(&shared.model.model, prompt, max_tokens, &[], |_| true)
        .unwrap()
        .tokens
}

#[test]
fn batch_output_equals_each_request_alone() {
    batch_equals_alone(BatchedConfig {
        prefill_chunk: Some(8),
        ..Default::default()
    });
}

/// The GPU's grouping on the CPU: wide groups whose widths are padded to
/// multiples of 32 give the same tokens.
#[test]
fn wide_groups_padded_to_repeating_widths_equal_each_request_alone() {
    batch_equals_alone(BatchedConfig {
        prefill_chunk: Some(64),
        prefill_group_tokens: Some(512),
        prefill_width_multiple: Some(32),
        ..Default::default()
    });
}

fn batch_equals_alone(cfg: BatchedConfig) {
    let (_dir, shared, engine) = setup(1024, cfg);
    let prompts: Vec<Vec<u32>> = [3usize, 40, 11, 25, 1]
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(i as u64 + 1, n))
        .collect();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| engine.submit(request(p.clone(), 24)).unwrap())
        .collect();
    for (p, s) in prompts.iter().zip(streams) {
        let (tokens, finish) = collect(s);
        assert_eq!(
            tokens,
            alone(&shared, p, 24),
            "prompt of {} tokens",
            p.len()
        );
        assert_eq!(finish.reason, FinishReason::Length);
        assert_eq!(finish.completion_tokens, 24);
        assert_eq!(finish.prompt_tokens, p.len() as u32);
    }
    assert_eq!(shared.kv_pool.allocated(), 0, "every KV block returned");
}

#[test]
fn requests_joining_mid_flight_match_alone() {
    let (_dir, shared, engine) = setup(
        1024,
        BatchedConfig {
            prefill_chunk: Some(16),
            ..Default::default()
        },
    );
    let first = prompt(7, 9);
    let mut s1 = engine.submit(request(first.clone(), 40)).unwrap();
    // Let the first request decode a few tokens before others arrive.
    let mut head = Vec::new();
    while head.len() < 5 {
        match s1.blocking_recv().unwrap() {
            Event::Token(t) => head.push(t.id),
            other => panic!("unexpected {other:?}"),
        }
    }
    let later: Vec<Vec<u32>> = vec![prompt(8, 30), prompt(9, 2), prompt(10, 17)];
    let streams: Vec<_> = later
        .iter()
        .map(|p| engine.submit(request(p.clone(), 20)).unwrap())
        .collect();
    let (rest, _) = collect(s1);
    head.extend(rest);
    assert_eq!(head, alone(&shared, &first, 40));
    for (p, s) in later.iter().zip(streams) {
        assert_eq!(collect(s).0, alone(&shared, p, 20));
    }
    assert_eq!(shared.kv_pool.allocated(), 0);
}

#[test]
fn stop_tokens_end_a_row_without_streaming_the_stop() {
    let (_dir, shared, engine) = setup(1024, BatchedConfig::default());
    let p = prompt(3, 12);
    let reference = alone(&shared, &p, 16);
    let stop = reference[5];
    let first_stop = reference.iter().position(|&t| t == stop).unwrap();
    let mut req = request(p, 16);
    req.stop_tokens = vec![stop];
    let (tokens, finish) = collect(engine.submit(req).unwrap());
    assert_eq!(tokens, reference[..first_stop]);
    assert_eq!(finish.reason, FinishReason::Stop);
    assert_eq!(finish.completion_tokens as usize, first_stop);
}

#[test]
fn cancellation_is_billing_safe_and_frees_kv() {
    let (_dir, shared, engine) = setup(1024, BatchedConfig::default());
    let req = request(
        prompt(4, 10),
        10_000.min(shared.model.context_window() as u32 - 20),
    );
    let cancel = req.cancel.clone();
    let mut s = engine.submit(req).unwrap();
    let mut got = 0;
    while got < 3 {
        if let Event::Token(_) = s.blocking_recv().unwrap() {
            got += 1;
        }
    }
    cancel.cancel();
    loop {
        match s.blocking_recv().unwrap() {
            Event::Token(_) => got += 1,
            Event::Finished(f) => {
                assert_eq!(f.reason, FinishReason::Cancelled);
                assert_eq!(
                    f.completion_tokens, got,
                    "cancelled requests report what they streamed"
                );
                break;
            }
            Event::Error(e) => panic!("{e}"),
        }
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(shared.kv_pool.allocated(), 0);
    // A dropped stream (client gone) frees its blocks too.
    let s = engine.submit(request(prompt(5, 10), 5000)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(s);
    for _ in 0..100 {
        if shared.kv_pool.allocated() == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(shared.kv_pool.allocated(), 0);
    assert_eq!(engine.load().active, 0);
}

#[test]
fn invalid_requests_get_clear_errors() {
    let (_dir, shared, engine) = setup(8, BatchedConfig::default());
    let cases: Vec<(GenerateRequest, &str)> = vec![
        (request(vec![], 4), "prompt is empty"),
        (request(vec![1, 2], 0), "max_tokens must be at least 1"),
        (request(vec![1, 99_999], 4), "outside the vocabulary"),
        (
            request(vec![1; 10], shared.model.context_window() as u32),
            "exceeds the context window",
        ),
        (request(vec![1; 10], 8 * 16), "KV blocks"),
    ];
    for (req, want) in cases {
        let id = req.id;
        match engine.submit(req) {
            Err(EngineError::Invalid(msg)) => {
                assert!(msg.contains(want), "{msg:?} should mention {want:?}");
                assert!(
                    msg.contains(&id.to_string()),
                    "{msg:?} should name the request"
                );
            }
            other => panic!(
                "expected an invalid-request error, got {:?}",
                other.map(|_| ())
            ),
        }
    }
    assert_eq!(shared.kv_pool.allocated(), 0);
}

#[test]
fn requests_wait_for_kv_blocks_then_run() {
    // Room for one request of 10 + 30 tokens at a time (3 blocks of 16).
    let (_dir, shared, engine) = setup(3, BatchedConfig::default());
    let prompts = [prompt(11, 10), prompt(12, 10), prompt(13, 10)];
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| engine.submit(request(p.clone(), 30)).unwrap())
        .collect();
    for (p, s) in prompts.iter().zip(streams) {
        assert_eq!(collect(s).0, alone(&shared, p, 30));
    }
    assert_eq!(shared.kv_pool.allocated(), 0);
}

#[test]
fn full_queue_is_overloaded() {
    let (_dir, _shared, engine) = setup(
        3,
        BatchedConfig {
            max_queue: 1,
            ..Default::default()
        },
    );
    let _a = engine.submit(request(prompt(1, 10), 30)).unwrap();
    let mut refused = false;
    let mut keep = Vec::new();
    for i in 0..4 {
        match engine.submit(request(prompt(2 + i, 10), 30)) {
            Ok(s) => keep.push(s),
            Err(EngineError::Overloaded(_)) => refused = true,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(refused, "a full queue refuses new requests");
}

#[test]
fn sampling_is_per_row_and_seeded() {
    let (_dir, shared, engine) = setup(1024, BatchedConfig::default());
    let p = prompt(21, 12);
    let sampled = |seed| {
        let mut r = request(p.clone(), 16);
        // A hot temperature: the random tiny model is very peaked.
        r.sampling = SamplingParams {
            temperature: 8.0,
            top_p: 0.99,
            top_k: 400,
            min_p: 0.001,
            seed: Some(seed),
            ..Default::default()
        };
        r
    };
    // A greedy row and two sampled rows in one batch.
    let g = engine.submit(request(p.clone(), 16)).unwrap();
    let a = engine.submit(sampled(5)).unwrap();
    let b = engine.submit(sampled(5)).unwrap();
    let c = engine.submit(sampled(6)).unwrap();
    assert_eq!(
        collect(g).0,
        alone(&shared, &p, 16),
        "greedy rows are unaffected by sampled neighbours"
    );
    let (a, b, c) = (collect(a).0, collect(b).0, collect(c).0);
    assert_eq!(a, b, "same seed, same output");
    assert_ne!(a, c, "different seeds differ");
    // Truncation down to one candidate is greedy whatever the temperature.
    for truncate in [
        SamplingParams {
            temperature: 8.0,
            top_k: 1,
            seed: Some(1),
            ..Default::default()
        },
        SamplingParams {
            temperature: 8.0,
            top_p: 1e-6,
            seed: Some(2),
            ..Default::default()
        },
        SamplingParams {
            temperature: 8.0,
            min_p: 0.999_999,
            seed: Some(3),
            ..Default::default()
        },
    ] {
        let mut r = request(p.clone(), 16);
        r.sampling = truncate.clone();
        assert_eq!(
            collect(engine.submit(r).unwrap()).0,
            alone(&shared, &p, 16),
            "{truncate:?}"
        );
    }
}

#[test]
fn penalties_and_logit_bias_change_greedy_output() {
    let (_dir, shared, engine) = setup(1024, BatchedConfig::default());
    let p = prompt(31, 8);
    let plain = alone(&shared, &p, 12);
    let mut biased = request(p.clone(), 12);
    biased.sampling.logit_bias = vec![(plain[0], -1000.0)];
    let (tokens, _) = collect(engine.submit(biased).unwrap());
    assert!(!tokens.contains(&plain[0]), "a banned token never appears");
    let mut penalised = request(p.clone(), 12);
    penalised.sampling.frequency_penalty = 2.0;
    penalised.sampling.presence_penalty = 2.0;
    let (tokens, _) = collect(engine.submit(penalised).unwrap());
    let distinct: std::collections::HashSet<_> = tokens.iter().collect();
    let plain_distinct: std::collections::HashSet<_> = plain.iter().collect();
    assert!(
        distinct.len() >= plain_distinct.len(),
        "penalties do not make output more repetitive"
    );
}

#[test]
fn logprobs_are_reported_when_asked() {
    let (_dir, _shared, engine) = setup(1024, BatchedConfig::default());
    let mut r = request(prompt(41, 8), 4);
    r.sampling.logprobs = true;
    r.sampling.top_logprobs = 3;
    let mut s = engine.submit(r).unwrap();
    let mut n = 0;
    while let Some(ev) = s.blocking_recv() {
        if let Event::Token(t) = ev {
            let lp = t.logprob.expect("logprob present");
            assert!(lp <= 0.0);
            assert_eq!(t.top_logprobs.len(), 3);
            assert_eq!(
                t.top_logprobs[0].0, t.id,
                "greedy picks the most likely token"
            );
            assert!((t.top_logprobs[0].1 - lp).abs() < 1e-5);
            n += 1;
        }
    }
    assert_eq!(n, 4);
}

#[test]
fn prefix_cache_reuses_within_a_scope_only() {
    let (_dir, shared, engine) = setup(1024, BatchedConfig::default());
    let system = prompt(51, 40);
    let with = |tail: u64, scope: &str| {
        let mut p = system.clone();
        p.extend(prompt(tail, 5));
        let mut r = request(p, 8);
        r.cache_scope = Some(scope.into());
        r
    };
    let first = with(52, "tenant-a");
    collect(engine.submit(first).unwrap());
    let second = with(53, "tenant-a");
    let expected = alone(&shared, &second.prompt, 8);
    let (tokens, finish) = collect(engine.submit(second).unwrap());
    assert_eq!(finish.cached_tokens, 32, "two 16-token blocks reused");
    assert_eq!(tokens, expected, "reused KV gives the same tokens");
    let (_, other) = collect(engine.submit(with(54, "tenant-b")).unwrap());
    assert_eq!(other.cached_tokens, 0, "no reuse across scopes");
}

#[test]
fn shutdown_cancels_in_flight_work() {
    let (_dir, shared, engine) = setup(1024, BatchedConfig::default());
    let mut s = engine.submit(request(prompt(61, 10), 5000)).unwrap();
    assert!(matches!(s.blocking_recv(), Some(Event::Token(_))));
    engine.shutdown();
    let mut last = None;
    while let Some(ev) = s.blocking_recv() {
        last = Some(ev);
    }
    assert!(matches!(
        last,
        Some(Event::Finished(Finish {
            reason: FinishReason::Cancelled,
            ..
        }))
    ));
    assert_eq!(shared.kv_pool.allocated(), 0);
    assert!(matches!(
        engine.submit(request(vec![1], 1)),
        Err(EngineError::ShuttingDown)
    ));
}

#[test]
fn prompts_arriving_together_share_one_padded_prefill() {
    let (_dir, shared, engine) = setup(
        1024,
        BatchedConfig {
            prefill_chunk: Some(256),
            ..Default::default()
        },
    );
    let prompts: Vec<Vec<u32>> = [7usize, 19, 2, 33, 12, 5]
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(100 + i as u64, n))
        .collect();
    // One row stops on its very first token, inside the group.
    let first_of_third = alone(&shared, &prompts[2], 1)[0];
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = request(p.clone(), 12);
            if i == 2 {
                r.stop_tokens = vec![first_of_third];
            }
            engine.submit(r).unwrap()
        })
        .collect();
    for (i, (p, s)) in prompts.iter().zip(streams).enumerate() {
        let (tokens, finish) = collect(s);
        if i == 2 {
            assert!(tokens.is_empty());
            assert_eq!(finish.reason, FinishReason::Stop);
        } else {
            assert_eq!(tokens, alone(&shared, p, 12), "prompt {i}");
        }
    }
    assert_eq!(shared.kv_pool.allocated(), 0);
}

/// What a client sees of one request: each token with its logprobs, and
/// the final event.
#[derive(Debug)]
struct Seen {
    tokens: Vec<TokenEvent>,
    finish: Finish,
}

impl Seen {
    fn ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.id).collect()
    }
}

fn seen(stream: &mut EventStream, mut tokens: Vec<TokenEvent>) -> Seen {
    loop {
        match stream
            .blocking_recv()
            .expect("stream ended without Finished")
        {
            Event::Token(t) => tokens.push(t),
            Event::Finished(finish) => return Seen { tokens, finish },
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
}

fn first_tokens(stream: &mut EventStream, n: usize) -> Vec<TokenEvent> {
    (0..n)
        .map(|_| match stream.blocking_recv().unwrap() {
            Event::Token(t) => t,
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

/// Equal token for token; logprobs equal up to float noise (the batch
/// around a row may differ by a step between the modes).
fn assert_same(a: &Seen, b: &Seen, what: &str) {
    assert_eq!(a.ids(), b.ids(), "{what}");
    assert_eq!(a.finish, b.finish, "{what}");
    for (x, y) in a.tokens.iter().zip(&b.tokens) {
        let close = |p: f32, q: f32| (p - q).abs() < 1e-4;
        assert_eq!(x.logprob.is_some(), y.logprob.is_some(), "{what}");
        if let (Some(p), Some(q)) = (x.logprob, y.logprob) {
            assert!(close(p, q), "{what}: logprob {p} vs {q}");
        }
        assert_eq!(x.top_logprobs.len(), y.top_logprobs.len(), "{what}");
        for (&(i, p), &(j, q)) in x.top_logprobs.iter().zip(&y.top_logprobs) {
            assert!(i == j && close(p, q), "{what}: top {i}:{p} vs {j}:{q}");
        }
    }
}

/// One long greedy row decoding, then rows joining mid-stream that stop on
/// a stop token, end at a small `max_tokens`, sample with a seed and report
/// logprobs, start from a prefix-cache hit and get cancelled; once they
/// are done, a row with penalties (the batch steps unpipelined while it
/// runs, then pipelined again). Returns what each request saw, in the
/// order below (the cancelled one last).
fn mixed_traffic(shared: &SharedModel, engine: &BatchedEngine) -> Vec<Seen> {
    let system = prompt(71, 40);
    let with_tail = |tail: u64| {
        let mut p = system.clone();
        p.extend(prompt(tail, 5));
        let mut r = request(p, 10);
        r.cache_scope = Some("tenant".into());
        r
    };
    // Its prompt and answer go into the prefix cache before it ends.
    let warm = seen(&mut engine.submit(with_tail(72)).unwrap(), Vec::new());
    let long = prompt(73, 9);
    let mut long_stream = engine.submit(request(long, 80)).unwrap();
    let long_head = first_tokens(&mut long_stream, 5);

    let stopped = prompt(74, 13);
    let mut stopped = request(stopped.clone(), 30);
    stopped.stop_tokens = vec![alone(shared, &stopped.prompt, 30)[6]];
    let short = request(prompt(75, 4), 3);
    let mut sampled = request(prompt(76, 11), 20);
    sampled.sampling = SamplingParams {
        temperature: 8.0,
        top_p: 0.99,
        top_k: 400,
        seed: Some(9),
        logprobs: true,
        top_logprobs: 2,
        ..Default::default()
    };
    let mut greedy_logprobs = request(prompt(77, 6), 12);
    greedy_logprobs.sampling.logprobs = true;
    greedy_logprobs.sampling.top_logprobs = 3;
    let hit = with_tail(79);
    let cancelled = request(prompt(80, 8), 200);
    let cancel = cancelled.cancel.clone();

    let mut streams: Vec<EventStream> = [stopped, short, sampled, greedy_logprobs, hit]
        .into_iter()
        .map(|r| engine.submit(r).unwrap())
        .collect();
    let mut cancelled_stream = engine.submit(cancelled).unwrap();
    let cancelled_head = first_tokens(&mut cancelled_stream, 4);
    cancel.cancel();

    let mut joined: Vec<Seen> = streams.iter_mut().map(|s| seen(s, Vec::new())).collect();
    let cancelled = seen(&mut cancelled_stream, cancelled_head);
    let mut penalised = request(prompt(78, 7), 6);
    penalised.sampling.frequency_penalty = 1.5;
    let penalised = seen(&mut engine.submit(penalised).unwrap(), Vec::new());
    let long = seen(&mut long_stream, long_head);
    joined.push(penalised);
    let mut out = vec![warm, long];
    out.extend(joined);
    out.push(cancelled);
    out
}

#[test]
fn pipelined_decode_equals_unpipelined_decode_and_paged_equals_contiguous() {
    let run = |pipeline: bool, layout: KvLayout| {
        let (dir, shared, engine) = setup_as(
            1024,
            BatchedConfig {
                pipeline,
                prefill_chunk: Some(16),
                ..Default::default()
            },
            layout,
        );
        let seen = mixed_traffic(&shared, &engine);
        // Blocks go back just after a row's final event, and the prefix
        // cache's when a sequence wants every block.
        let pool_free = || {
            drop(shared.kv_pool.try_reserve(shared.kv_pool.total()));
            shared.pages().is_none_or(|p| p.free_blocks() == p.usable())
        };
        for _ in 0..100 {
            if shared.kv_pool.allocated() == 0 && pool_free() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            shared.kv_pool.allocated(),
            0,
            "pipeline {pipeline}, {layout:?}: KV leaked"
        );
        assert!(pool_free(), "pool blocks leaked: {:?}", shared.pages());
        assert_eq!(engine.load().active, 0);
        (dir, shared, seen)
    };
    let (_d1, shared, piped) = run(true, KvLayout::Contiguous);
    let (_d2, _, plain) = run(false, KvLayout::Contiguous);
    let (_d3, _, paged) = run(true, KvLayout::Paged);
    let names = [
        "warm-up",
        "long",
        "stopped",
        "short",
        "sampled",
        "logprobs",
        "hit",
        "penalised",
    ];
    for (i, name) in names.iter().enumerate() {
        assert_same(&piped[i], &plain[i], name);
        assert_same(&paged[i], &piped[i], name);
    }
    // And greedy rows as each alone.
    let long = prompt(73, 9);
    assert_eq!(piped[1].ids(), alone(&shared, &long, 80));
    let stopped = &piped[2];
    assert_eq!(stopped.finish.reason, FinishReason::Stop);
    assert_eq!(
        stopped.ids(),
        alone(&shared, &prompt(74, 13), 30)[..stopped.tokens.len()]
    );
    assert!(stopped.tokens.len() <= 6, "ends at its stop token");
    assert_eq!(piped[3].ids(), alone(&shared, &prompt(75, 4), 3));
    assert_eq!(piped[3].finish.reason, FinishReason::Length);
    assert_eq!(piped[5].ids(), alone(&shared, &prompt(77, 6), 12));
    assert_eq!(piped[6].finish.cached_tokens, 32, "a prefix-cache hit");
    // The cancelled row: a prefix of its answer, billed as streamed, in
    // both modes (how far it got depends on timing).
    for s in [&piped[8], &plain[8], &paged[8]] {
        assert_eq!(s.finish.reason, FinishReason::Cancelled);
        assert_eq!(s.finish.completion_tokens as usize, s.tokens.len());
        let reference = alone(&shared, &prompt(80, 8), s.tokens.len());
        assert_eq!(s.ids(), reference);
    }
}

/// Prompts arriving one after another while rows decode are prefilled in
/// chunks inside the decode rows' forwards (one forward a step), and every
/// request's greedy tokens equal its run alone: a wrong position, mask or
/// row of the mixed forward changes them. On a generated Qwen3 and on the
/// default GGUF.
#[test]
fn staggered_prompts_chunked_into_the_decode_forwards_match_alone() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &TinySpec::tiny(Family::Qwen3)).unwrap();
    let tiny = LoadedModel::load(dir.path(), Some("tiny")).unwrap();
    let gguf = fixtures::reference::default_gguf();
    let smollm = LoadedModel::load_as(&gguf, None, runtime::ComputeDtype::Auto).unwrap();
    for model in [tiny, smollm] {
        staggered_match_alone(model);
    }
}

fn staggered_match_alone(model: LoadedModel) {
    let bytes = model.model.config.kv_bytes_per_token(4, None);
    let pool = KvPool::new(256, 16, bytes * 16);
    let shared = Arc::new(SharedModel::with_layout(model, pool, 16, KvLayout::Contiguous).unwrap());
    let cfg = BatchedConfig {
        prefill_chunk: Some(16),
        ..Default::default()
    };
    let engine = BatchedEngine::new("batched".into(), shared.clone(), cfg);
    let vocab = shared.model.vocab_size() as u32;
    let first = random_prompt(21, 9, vocab.min(500));
    let forwards = shared.model.model.forwards();
    let mut s1 = engine.submit(request(first.clone(), 60)).unwrap();
    let mut head = first_tokens(&mut s1, 3);
    let later: Vec<Vec<u32>> = [(22, 60), (23, 45)]
        .iter()
        .map(|&(seed, len)| random_prompt(seed, len, vocab.min(500)))
        .collect();
    let mut streams = Vec::new();
    for p in &later {
        streams.push(engine.submit(request(p.clone(), 20)).unwrap());
        head.extend(first_tokens(&mut s1, 2));
    }
    let (rest, _) = collect(s1);
    let ids: Vec<u32> = head.iter().map(|t| t.id).chain(rest).collect();
    // One forward a step: the first request's 60 (its prompt's, then one
    // per token), a few more around pipelining. Separate chunk forwards
    // would add the later prompts' 8 chunks.
    let ran = shared.model.model.forwards() - forwards;
    assert!(ran <= 64, "{ran} forwards");
    assert_eq!(ids, alone(&shared, &first, 60));
    for (p, s) in later.iter().zip(streams) {
        assert_eq!(
            collect(s).0,
            alone(&shared, p, 20),
            "{}-token prompt",
            p.len()
        );
    }
    assert_eq!(shared.kv_pool.allocated(), 0);
}
