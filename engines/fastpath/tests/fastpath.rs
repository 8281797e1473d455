//! The fast path: what it declares it serves, plain greedy output, sampled
//! output equal to the batched engine's for the same seed, handover to the
//! batched engine mid-stream (token for token, also between engines that
//! reach the shared model only through the plugin boundary's C tables),
//! cancellation and the shutdown fence.

use std::sync::Arc;

use batched::{BatchedConfig, BatchedEngine};
use engine_core::plugin::SharedHandle;
use engine_core::{
    Engine, EngineContext, EngineError, Event, EventStream, Finish, FinishReason, GenerateRequest,
    Refusal, SamplingParams, Unsupported,
};
use fastpath::FastpathEngine;
use fixtures::model::{random_prompt, write_model, TinySpec};
use runtime::{generate, Family, KvPool, LoadedModel, SharedModel};

struct Setup {
    _dir: tempfile::TempDir,
    shared: Arc<SharedModel>,
    fast: FastpathEngine,
    batched: BatchedEngine,
}

fn host_model() -> (tempfile::TempDir, Arc<SharedModel>) {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &TinySpec::tiny(Family::Llama)).unwrap();
    let model = LoadedModel::load(dir.path(), Some("tiny")).unwrap();
    let bytes = model.model.config.kv_bytes_per_token(4, None);
    let shared = Arc::new(SharedModel::new(model, KvPool::new(4096, 16, bytes * 16)));
    (dir, shared)
}

fn setup() -> Setup {
    let (dir, shared) = host_model();
    let batched = BatchedEngine::new("batched".into(), shared.clone(), BatchedConfig::default());
    let fast = FastpathEngine::new("fastpath".into(), shared.clone());
    Setup {
        _dir: dir,
        shared,
        fast,
        batched,
    }
}

/// Both engines built as plugins build theirs: each over its own
/// `SharedModel` view of the host's exported C tables (weights as mlx-c
/// handles, the host's KV ledger, device lock and handover slot).
fn setup_apart() -> Setup {
    let (dir, shared) = host_model();
    let tables = shared.export();
    let ctx = |name: &str| EngineContext {
        name: name.into(),
        config: serde_yaml::Value::Null,
        config_dir: dir.path().to_owned(),
        model: Some(shared.facts()),
        // SAFETY: the tables live for the process.
        shared: unsafe { SharedHandle::from_ptr(tables) },
    };
    let batched = BatchedEngine::from_context(ctx("batched")).unwrap();
    let fast = FastpathEngine::from_context(ctx("fastpath")).unwrap();
    Setup {
        _dir: dir,
        shared,
        fast,
        batched,
    }
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    random_prompt(seed, len, 500)
}

fn alone(shared: &SharedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    generate::greedy(&shared.model.model, prompt, n, &[], |_| true)
        .unwrap()
        .tokens
}

fn next_token(s: &mut EventStream) -> u32 {
    match s.blocking_recv() {
        Some(Event::Token(t)) => t.id,
        other => panic!("expected a token, got {other:?}"),
    }
}

fn rest(mut s: EventStream) -> (Vec<u32>, Finish) {
    let mut tokens = Vec::new();
    loop {
        match s.blocking_recv().expect("stream ended without Finished") {
            Event::Token(t) => tokens.push(t.id),
            Event::Finished(f) => return (tokens, f),
            Event::Error(e) => panic!("{e}"),
        }
    }
}

fn refusal(r: Result<EventStream, EngineError>) -> EngineError {
    r.map(|_| ()).expect_err("expected a refusal")
}

#[test]
fn serves_plain_greedy_like_the_raw_loop() {
    let s = setup();
    let p = prompt(1, 20);
    let (tokens, finish) = rest(s.fast.submit(GenerateRequest::new(p.clone(), 32)).unwrap());
    assert_eq!(tokens, alone(&s.shared, &p, 32));
    assert_eq!(
        (finish.reason, finish.completion_tokens),
        (FinishReason::Length, 32)
    );
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(s.shared.kv_pool.allocated(), 0);
    assert_eq!(s.fast.load().active, 0);
}

#[test]
fn declares_what_it_cannot_serve_and_refuses_what_is_invalid() {
    let s = setup();
    // What it cannot serve is declared, for the router to apply
    // (engine_core::Capabilities::accepts); the engine does not re-check.
    let caps = s.fast.capabilities();
    for sampling in sampling_cases() {
        let mut req = GenerateRequest::new(vec![1, 2, 3], 4);
        req.sampling = sampling;
        assert_eq!(caps.accepts(&req.needs(0)), Ok(()), "{:?}", req.sampling);
    }
    let mut logprobs = GenerateRequest::new(vec![1, 2, 3], 4);
    logprobs.sampling.logprobs = true;
    assert_eq!(caps.accepts(&logprobs.needs(0)), Err(Unsupported::Logprobs));
    let mut tools = GenerateRequest::new(vec![1, 2, 3], 4);
    tools.has_tools = true;
    assert_eq!(caps.accepts(&tools.needs(0)), Err(Unsupported::Tools));
    let plain = GenerateRequest::new(vec![1, 2, 3], 4);
    assert_eq!(caps.accepts(&plain.needs(0)), Ok(()));
    assert_eq!(caps.accepts(&plain.needs(1)), Err(Unsupported::NotAlone));

    assert!(matches!(
        refusal(s.fast.submit(GenerateRequest::new(vec![], 4))),
        EngineError::Invalid(_)
    ));
    assert!(matches!(
        refusal(s.fast.submit(GenerateRequest::new(vec![1], 0))),
        EngineError::Invalid(_)
    ));
    let window = s.shared.model.context_window() as u32;
    assert!(matches!(
        refusal(s.fast.submit(GenerateRequest::new(vec![1; 8], window))),
        EngineError::Invalid(_)
    ));

    // Its one slot: a second request that reaches it past the router while
    // one runs is refused as busy.
    let mut a = s
        .fast
        .submit(GenerateRequest::new(prompt(2, 8), 2000))
        .unwrap();
    next_token(&mut a);
    assert_eq!(
        refusal(s.fast.submit(GenerateRequest::new(vec![1, 2], 4))),
        EngineError::Refused(Refusal::Busy)
    );
    drop(a);
}

/// Seeded sampling of every kind: temperature alone, with truncation, with
/// a logit bias (all decoded ahead), and with penalties (one step at a
/// time: each pick counts the token before it).
fn sampling_cases() -> Vec<SamplingParams> {
    let seeded = |seed| SamplingParams {
        temperature: 0.9,
        seed: Some(seed),
        ..Default::default()
    };
    vec![
        seeded(1),
        SamplingParams {
            top_k: 40,
            top_p: 0.9,
            min_p: 0.02,
            ..seeded(2)
        },
        // The tiny model's argmax here is token 87 at every step.
        SamplingParams {
            logit_bias: vec![(87, -100.0), (7, 2.0)],
            ..seeded(3)
        },
        SamplingParams {
            presence_penalty: 0.6,
            repetition_penalty: 1.2,
            ..seeded(4)
        },
    ]
}

fn sampled(prompt: Vec<u32>, n: u32, sampling: &SamplingParams) -> GenerateRequest {
    let mut req = GenerateRequest::new(prompt, n);
    req.sampling = sampling.clone();
    req
}

/// A sampled request draws on the fast path what the batched engine draws
/// for it with the same seed (the draw is a function of the seed, its
/// index and the logits), whether decoded ahead or one step at a time; a
/// high temperature makes the draws differ from the greedy tokens.
#[test]
fn serves_sampled_requests_as_the_batched_engine_draws_them() {
    let s = setup();
    for (i, sampling) in sampling_cases().iter().enumerate() {
        let p = prompt(40 + i as u64, 12);
        let (fast, finish) = rest(s.fast.submit(sampled(p.clone(), 40, sampling)).unwrap());
        let (batched, _) = rest(s.batched.submit(sampled(p.clone(), 40, sampling)).unwrap());
        assert_eq!(fast, batched, "{sampling:?}");
        assert_ne!(
            fast,
            alone(&s.shared, &p, 40),
            "{sampling:?}: drew the argmax"
        );
        assert_eq!(
            (finish.reason, finish.completion_tokens),
            (FinishReason::Length, 40)
        );
        if let Some(&(banned, _)) = sampling.logit_bias.iter().find(|b| b.1 < 0.0) {
            assert!(!fast.contains(&banned), "a token biased by -100 was drawn");
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(s.shared.kv_pool.allocated(), 0);
}

/// A sampled sequence handed over mid-stream goes on with the draws it
/// would have made alone: its whole stream equals the batched engine's for
/// the same seed, decoded ahead or one step at a time (penalties).
#[test]
fn hands_over_a_sampled_sequence_with_its_draws() {
    let s = setup();
    for (i, sampling) in sampling_cases().iter().enumerate() {
        let first = prompt(60 + i as u64, 15);
        let handovers = s.fast.handovers();
        let other = GenerateRequest::new(prompt(70 + i as u64, 9), 40);
        let (stream, _, _) = handed_over(&s, sampled(first.clone(), 300, sampling), 5, other);
        assert_eq!(s.fast.handovers(), handovers + 1, "{sampling:?}: moved");
        let (alone, _) = rest(s.batched.submit(sampled(first, 300, sampling)).unwrap());
        assert_eq!(stream, alone, "{sampling:?}");
    }
}

#[test]
fn hands_over_to_batched_without_a_seam() {
    hand_over(setup());
}

#[test]
fn hands_over_across_the_plugin_boundary() {
    hand_over(setup_apart());
}

/// `req` on the fast path, `other` sent to the batched engine after its
/// first `head` tokens (the fast path then hands its sequence over): the
/// whole stream of `req`, its finish, and `other`'s tokens.
fn handed_over(
    s: &Setup,
    req: GenerateRequest,
    head: usize,
    other: GenerateRequest,
) -> (Vec<u32>, Finish, Vec<u32>) {
    let mut a = s.fast.submit(req).unwrap();
    let mut stream: Vec<u32> = (0..head).map(|_| next_token(&mut a)).collect();
    let b = s.batched.submit(other).unwrap();
    let (tail, finish) = rest(a);
    stream.extend(tail);
    (stream, finish, rest(b).0)
}

fn hand_over(s: Setup) {
    let first = prompt(3, 15);
    let second = prompt(4, 9);
    let (head, finish, other) = handed_over(
        &s,
        GenerateRequest::new(first.clone(), 300),
        6,
        GenerateRequest::new(second.clone(), 20),
    );
    assert_eq!(
        s.fast.handovers(),
        1,
        "the sequence moved to the batched engine"
    );
    assert_eq!(
        head,
        alone(&s.shared, &first, 300),
        "one uninterrupted stream, plain greedy tokens"
    );
    assert_eq!(
        (finish.reason, finish.completion_tokens),
        (FinishReason::Length, 300)
    );
    assert_eq!(other, alone(&s.shared, &second, 20));
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(
        s.shared.kv_pool.allocated(),
        0,
        "the handed-over reservation returned too"
    );
    assert_eq!(s.fast.load().active, 0, "the fast path is free again");
}

#[test]
fn cancellation_reports_streamed_tokens() {
    let s = setup();
    let req = GenerateRequest::new(prompt(5, 10), 3000);
    let cancel = req.cancel.clone();
    let mut stream = s.fast.submit(req).unwrap();
    for _ in 0..4 {
        next_token(&mut stream);
    }
    cancel.cancel();
    let (more, finish) = rest(stream);
    assert_eq!(finish.reason, FinishReason::Cancelled);
    assert_eq!(
        finish.completion_tokens as usize,
        4 + more.len(),
        "billing-safe count"
    );
}

#[test]
fn shutdown_cancels_then_awaits_the_request() {
    let s = setup();
    let mut stream = s
        .fast
        .submit(GenerateRequest::new(prompt(6, 10), 3000))
        .unwrap();
    next_token(&mut stream);
    s.fast.shutdown();
    // The loop has ended by the time shutdown returns: the stream is closed.
    let mut last = None;
    while let Ok(ev) = stream.try_recv() {
        last = Some(ev);
    }
    assert!(
        matches!(
            last,
            Some(Event::Finished(Finish {
                reason: FinishReason::Cancelled,
                ..
            }))
        ),
        "{last:?}"
    );
    assert_eq!(s.shared.kv_pool.allocated(), 0);
    assert_eq!(
        refusal(s.fast.submit(GenerateRequest::new(vec![1, 2], 2))),
        EngineError::ShuttingDown
    );
    let _ = &s.batched;
}

#[test]
fn handover_right_after_the_first_tokens_while_batched_admits() {
    let s = setup();
    for round in 0..5 {
        let first = prompt(100 + round, 128);
        let mut a = s
            .fast
            .submit(GenerateRequest::new(first.clone(), 200))
            .unwrap();
        let mut head: Vec<u32> = (0..2).map(|_| next_token(&mut a)).collect();
        let second = prompt(200 + round, 128);
        let b = s
            .batched
            .submit(GenerateRequest::new(second.clone(), 16))
            .unwrap();
        let (tb, _) = rest(b);
        let (tail, _) = rest(a);
        head.extend(tail);
        assert_eq!(tb, alone(&s.shared, &second, 16));
        assert_eq!(head, alone(&s.shared, &first, 200));
    }
}

/// The fast path frees its slot before its final event, so the next
/// request can start while the gateway still holds the previous one's
/// guard. Cancelling the previous request then (its client left, a stop
/// string matched) must not touch the new one.
#[test]
fn cancelling_a_finished_request_leaves_the_next_one_alone() {
    let s = setup();
    let first = GenerateRequest::new(prompt(7, 10), 3);
    let first_id = first.id;
    let (_, finish) = rest(s.fast.submit(first).unwrap());
    assert_eq!(finish.reason, FinishReason::Length);
    // The slot is free: the next request starts before the guard of the
    // first one is dropped.
    // Long enough to be running still when the cancel arrives.
    let mut b = s
        .fast
        .submit(GenerateRequest::new(prompt(8, 10), 2000))
        .unwrap();
    next_token(&mut b);
    s.fast.cancel(first_id);
    let (tail, finish) = rest(b);
    assert_eq!(
        (finish.reason, finish.completion_tokens),
        (FinishReason::Length, 2000),
        "the second request was cancelled"
    );
    assert_eq!(tail.len(), 1999);
}

/// A growing chat alternating between the engines, each built over the
/// host's C tables as plugins are: every turn starts from the KV the one
/// before published (its prompt and its answer) in the one shared prefix
/// cache, and answers exactly as a cold run does.
#[test]
fn a_chats_next_turn_reuses_the_last_turns_kv_on_either_engine() {
    let s = setup_apart();
    let mut history = prompt(81, 37);
    for (turn, engine) in [&s.fast as &dyn Engine, &s.batched, &s.fast]
        .into_iter()
        .enumerate()
    {
        let mut req = GenerateRequest::new(history.clone(), 12);
        req.cache_scope = Some("user-1".into());
        let (tokens, finish) = rest(engine.submit(req).unwrap());
        assert_eq!(tokens, alone(&s.shared, &history, 12), "turn {turn}");
        if turn > 0 {
            // Everything before this turn's new tokens, block-aligned.
            let expected = (history.len() - 5) / 16 * 16;
            assert!(
                finish.cached_tokens as usize >= expected.min(16),
                "turn {turn}: {} cached of {}",
                finish.cached_tokens,
                history.len()
            );
        }
        // The next turn: this answer and a new message.
        history.extend(&tokens);
        history.extend(prompt(90 + turn as u64, 5));
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Another scope finds nothing.
    let mut req = GenerateRequest::new(history.clone(), 2);
    req.cache_scope = Some("user-2".into());
    let (_, finish) = rest(s.fast.submit(req).unwrap());
    assert_eq!(finish.cached_tokens, 0);
}
