//! The whole scheduler loop on a fake forward: no model, milliseconds.
//! Each sequence's k-th generated token is a function of its prompt and
//! its position `prompt + k`, as a real greedy model's would be, so a run
//! disturbed by chunking, preemption or pipelining must stream exactly the
//! tokens of an undisturbed one. KV blocks are the runtime's real pool;
//! streams are real event channels.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crossbeam_channel::Sender;
use engine_core::event::{event_channel, EventStream};
use engine_core::{CancelToken, Event, FinishReason, GenerateRequest, Grammar};
use runtime::{KvCache, KvPool};

use super::*;
use crate::admit::PrefillBudget;
use crate::device::{Chunk, Device, MixedPicks, Pick, Picks, Prefix};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Forward {
    Group {
        rows: usize,
        width: usize,
    },
    Chunk {
        tokens: usize,
    },
    Decode {
        rows: usize,
    },
    /// A mixed forward: the batch's decode rows and each chunk's tokens.
    Mixed {
        rows: usize,
        chunks: Vec<usize>,
    },
}

#[derive(Clone)]
struct Fake(Arc<FakeState>);

struct FakeState {
    pool: KvPool,
    forwards: Mutex<Vec<Forward>>,
    /// Forwards (by index) that run out of memory.
    fail_at: Mutex<Vec<usize>>,
    /// Whether it runs prompt chunks and decode rows in one forward.
    mixes: bool,
    /// Device turns taken: one a step.
    turns: std::sync::atomic::AtomicUsize,
}

impl Fake {
    fn new(blocks: usize, mixes: bool) -> Self {
        Self(Arc::new(FakeState {
            pool: KvPool::new(blocks, 16, 1),
            forwards: Mutex::new(Vec::new()),
            fail_at: Mutex::new(Vec::new()),
            mixes,
            turns: Default::default(),
        }))
    }

    fn run(&self, forward: Forward) -> anyhow::Result<()> {
        let mut forwards = self.0.forwards.lock().unwrap();
        if self.0.fail_at.lock().unwrap().contains(&forwards.len()) {
            forwards.push(forward);
            anyhow::bail!("fake forward: out of memory");
        }
        forwards.push(forward);
        Ok(())
    }

    fn forwards(&self) -> Vec<Forward> {
        self.0.forwards.lock().unwrap().clone()
    }
}

/// The pick after a sequence's KV holds `at` tokens.
fn token(prompt: &[u32], at: usize) -> u32 {
    ((prompt[0] as usize * 7919 + at * 31) % 997) as u32 + 1
}

fn expected(prompt: &[u32], max_tokens: u32) -> Vec<u32> {
    (0..max_tokens as usize)
        .map(|k| token(prompt, prompt.len() + k))
        .collect()
}

struct FakePicks(Vec<u32>);

impl Picks for FakePicks {
    fn rows(&self) -> usize {
        self.0.len()
    }

    fn keep(self, keep: &[usize]) -> anyhow::Result<Option<Self>> {
        let kept: Vec<u32> = keep
            .iter()
            .filter_map(|&i| self.0.get(i).copied())
            .collect();
        Ok((!kept.is_empty()).then_some(FakePicks(kept)))
    }
}

impl Device for Fake {
    /// Per row, the tokens its KV holds.
    type Kv = Vec<usize>;
    type Picks = FakePicks;
    type Turn<'a> = ();

    fn turn(&self) {
        self.0.turns.fetch_add(1, Ordering::AcqRel);
    }

    fn pool(&self) -> &KvPool {
        &self.0.pool
    }

    fn vocab(&self) -> i32 {
        1000
    }

    fn grammar(&self, _: &Grammar) -> Result<grammar::Constraint, String> {
        Err("the fake forward has no grammars".into())
    }

    fn release_memory(&self) {}

    fn new_kv(&self) -> Vec<usize> {
        vec![0]
    }

    fn columns(&self, kv: &Vec<usize>) -> usize {
        kv.iter().copied().max().unwrap_or(0)
    }

    fn adopted(&self, _: KvCache) -> anyhow::Result<Vec<usize>> {
        anyhow::bail!("the fake forward takes no handovers")
    }

    fn join(&self, batch: Option<Vec<usize>>, part: Vec<usize>) -> anyhow::Result<Vec<usize>> {
        Ok([batch.unwrap_or_default(), part].concat())
    }

    fn select_rows(&self, kv: &mut Vec<usize>, keep: &[usize]) -> anyhow::Result<()> {
        *kv = keep.iter().map(|&i| kv[i]).collect();
        Ok(())
    }

    fn lookup(&self, _: Option<&str>, _: &[u32]) -> Option<Prefix<Vec<usize>>> {
        None
    }

    fn has_hit(&self, _: Option<&str>, _: &[u32]) -> bool {
        false
    }

    fn wants(&self, _: usize) -> bool {
        false
    }

    fn snapshot_at(&self, _: usize) -> Option<usize> {
        None
    }

    fn keep(&self, _: Option<&str>, _: &[u32], _: &Vec<usize>, _: Option<usize>) {}

    fn prefill_group(
        &self,
        rows: &mut [Row],
        width: usize,
    ) -> anyhow::Result<(Vec<usize>, FakePicks)> {
        self.run(Forward::Group {
            rows: rows.len(),
            width,
        })?;
        let kv = rows.iter().map(|r| r.request().prompt.len()).collect();
        let picks = rows
            .iter()
            .map(|r| token(&r.request().prompt, r.request().prompt.len()))
            .collect();
        Ok((kv, FakePicks(picks)))
    }

    fn prefill(
        &self,
        row: &mut Row,
        kv: &mut Vec<usize>,
        tokens: &[u32],
        start: usize,
        pick: bool,
    ) -> anyhow::Result<Option<FakePicks>> {
        self.run(Forward::Chunk {
            tokens: tokens.len(),
        })?;
        assert_eq!(kv[0], start, "chunks follow each other");
        kv[0] += tokens.len();
        Ok(pick.then(|| FakePicks(vec![token(&row.request().prompt, kv[0])])))
    }

    fn decode(
        &self,
        batch: &mut Vec<usize>,
        rows: &mut [Row],
        _: Option<&FakePicks>,
    ) -> anyhow::Result<FakePicks> {
        self.run(Forward::Decode { rows: rows.len() })?;
        Ok(decode_picks(batch, rows))
    }

    fn mixes(&self, _: &Row) -> bool {
        self.0.mixes
    }

    fn mixed(
        &self,
        batch: Option<&mut Vec<usize>>,
        rows: &mut [Row],
        _: Option<&FakePicks>,
        chunks: &mut [Chunk<'_, Vec<usize>>],
    ) -> anyhow::Result<MixedPicks<FakePicks>> {
        assert!(self.0.mixes);
        self.run(Forward::Mixed {
            rows: batch.as_ref().map_or(0, |_| rows.len()),
            chunks: chunks.iter().map(|c| c.tokens.len()).collect(),
        })?;
        let decode = batch.map(|b| decode_picks(b, rows));
        let chunks = chunks
            .iter_mut()
            .map(|c| {
                assert_eq!(c.kv[0], c.start, "chunks follow each other");
                c.kv[0] += c.tokens.len();
                c.pick
                    .then(|| FakePicks(vec![token(&c.row.request().prompt, c.kv[0])]))
            })
            .collect();
        Ok(MixedPicks { decode, chunks })
    }

    fn launch(&self, _: &FakePicks) -> anyhow::Result<()> {
        Ok(())
    }

    fn read(&self, rows: &[Row], picks: FakePicks) -> anyhow::Result<Vec<Pick>> {
        assert_eq!(rows.len(), picks.0.len());
        Ok(picks
            .0
            .into_iter()
            .map(|token| Pick {
                token,
                grammar_over: false,
                logprob: None,
                top_logprobs: Vec::new(),
            })
            .collect())
    }
}

/// One decode step's picks: each row's KV grows by one token.
fn decode_picks(batch: &mut [usize], rows: &[Row]) -> FakePicks {
    assert_eq!(batch.len(), rows.len(), "a KV row per row");
    let picks = rows
        .iter()
        .zip(batch.iter_mut())
        .map(|(r, at)| {
            *at += 1;
            token(&r.request().prompt, *at)
        })
        .collect();
    FakePicks(picks)
}

struct Harness {
    scheduler: Scheduler<Fake>,
    tx: Sender<Job>,
    fake: Fake,
    stats: Arc<Stats>,
    submitted: u32,
}

struct Sent {
    prompt: Vec<u32>,
    max_tokens: u32,
    cancel: CancelToken,
    stream: EventStream,
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
}

impl Sent {
    /// Reads what the stream holds so far.
    fn read(&mut self) -> &Self {
        while let Ok(event) = self.stream.try_recv() {
            match event {
                Event::Token(t) => self.tokens.push(t.id),
                Event::Finished(f) => self.finish = Some(f.reason),
                Event::Error(e) => panic!("stream error: {e}"),
            }
        }
        self
    }

    fn done_as_expected(&mut self) {
        let want = expected(&self.prompt, self.max_tokens);
        self.read();
        assert_eq!(self.tokens, want, "the tokens of an undisturbed run");
        assert_eq!(self.finish, Some(FinishReason::Length));
    }
}

fn harness(chunk: usize, blocks: usize, pipeline: bool) -> Harness {
    harness_of(Fake::new(blocks, false), chunk, pipeline)
}

/// A harness whose device runs prompt chunks beside the decode rows in one
/// forward.
fn mixing(chunk: usize, blocks: usize, pipeline: bool) -> Harness {
    harness_of(Fake::new(blocks, true), chunk, pipeline)
}

fn harness_of(fake: Fake, chunk: usize, pipeline: bool) -> Harness {
    let (tx, rx) = crossbeam_channel::unbounded();
    let stats = Arc::new(Stats::default());
    let limits = StepLimits {
        max_batch: 32,
        prefill: PrefillBudget::from(chunk),
    };
    Harness {
        scheduler: Scheduler::new(
            fake.clone(),
            limits,
            pipeline,
            rx,
            Cancels::default(),
            stats.clone(),
        ),
        tx,
        fake,
        stats,
        submitted: 0,
    }
}

impl Harness {
    fn submit(&mut self, prompt_len: usize, max_tokens: u32) -> Sent {
        self.submitted += 1;
        let prompt: Vec<u32> = (0..prompt_len as u32)
            .map(|i| (self.submitted * 101 + i * 7) % 500 + 1)
            .collect();
        let request = GenerateRequest::new(prompt.clone(), max_tokens);
        let blocks = self
            .fake
            .0
            .pool
            .blocks_for(prompt_len + max_tokens as usize);
        let cancel = request.cancel.clone();
        let (events, stream) = event_channel();
        self.stats.queued.fetch_add(1, Ordering::AcqRel);
        let waiting = Waiting {
            request,
            blocks,
            events,
            cancel_handle: None,
        };
        self.tx.send(Job::Submit(Box::new(waiting))).unwrap();
        Sent {
            prompt,
            max_tokens,
            cancel,
            stream,
            tokens: Vec::new(),
            finish: None,
        }
    }

    /// One iteration of the loop (never waiting for a message).
    fn step(&mut self) {
        if self.scheduler.idle() && self.tx.is_empty() {
            return;
        }
        assert!(self.scheduler.intake());
        self.scheduler.iteration();
    }

    fn run_to_end(&mut self) {
        for _ in 0..10_000 {
            if self.scheduler.idle() && self.tx.is_empty() {
                return;
            }
            self.step();
        }
        panic!("the loop did not drain");
    }

    fn forwards_since(&self, from: usize) -> Vec<Forward> {
        self.fake.forwards()[from..].to_vec()
    }

    fn all_back(&self) {
        assert_eq!(self.fake.0.pool.allocated(), 0, "every KV block back");
        assert_eq!(self.stats.active.load(Ordering::Acquire), 0);
    }
}

#[test]
fn requests_wait_for_kv_blocks_and_start_when_finished_rows_give_theirs_back() {
    // Room for two requests of 100 + 28 tokens (8 blocks each).
    let mut h = harness(256, 16, true);
    let mut sent: Vec<Sent> = (0..3).map(|_| h.submit(100, 28)).collect();
    h.step();
    assert_eq!(
        h.fake.forwards(),
        vec![
            Forward::Group {
                rows: 2,
                width: 100
            },
            Forward::Decode { rows: 2 }
        ],
        "the third waits for KV"
    );
    assert_eq!(h.fake.0.pool.allocated(), 16);
    // It starts once the others' blocks are back.
    while sent[2].read().tokens.is_empty() {
        h.step();
    }
    assert_eq!(sent[0].read().finish, Some(FinishReason::Length));
    assert_eq!(sent[1].read().finish, Some(FinishReason::Length));
    h.run_to_end();
    for s in &mut sent {
        s.done_as_expected();
    }
    h.all_back();
}

#[test]
fn a_long_prompt_is_chunked_beside_the_decode_steps_of_the_running_rows() {
    let mut h = harness(256, 1000, true);
    let mut running: Vec<Sent> = (0..7).map(|_| h.submit(20, 200)).collect();
    h.step();
    let mut long = h.submit(1000, 8);
    let from = h.fake.forwards().len();
    let mut steps = 0;
    while long.read().tokens.is_empty() {
        h.step();
        steps += 1;
        for r in &mut running {
            // The group's pick, then one a step.
            assert_eq!(r.read().tokens.len(), 1 + steps, "a token every step");
        }
    }
    // 249 prompt tokens a step beside the seven decode rows; the row joins
    // the batch the step its prompt is done.
    use Forward::*;
    let mut want = Vec::new();
    for _ in 0..4 {
        want.extend([Chunk { tokens: 249 }, Decode { rows: 7 }]);
    }
    want.extend([Chunk { tokens: 4 }, Decode { rows: 8 }]);
    assert_eq!(h.forwards_since(from), want);
    h.run_to_end();
    for s in running.iter_mut().chain([&mut long]) {
        s.done_as_expected();
    }
    h.all_back();
}

#[test]
fn the_next_prompt_starts_in_the_step_the_one_before_it_ends() {
    let mut h = harness(256, 1000, true);
    let mut first = h.submit(1000, 4);
    let mut second = h.submit(1000, 4);
    h.run_to_end();
    use Forward::*;
    assert_eq!(
        h.fake.forwards()[..6],
        [
            Chunk { tokens: 256 },
            Chunk { tokens: 256 },
            Chunk { tokens: 256 },
            Chunk { tokens: 232 },
            Chunk { tokens: 24 },
            Decode { rows: 1 },
        ]
    );
    first.done_as_expected();
    second.done_as_expected();
    h.all_back();
}

#[test]
fn cancelled_requests_end_waiting_mid_prefill_or_running_and_free_their_blocks() {
    for make in [harness, mixing] {
        cancelled_requests_end(make(64, 1000, true));
    }
}

fn cancelled_requests_end(mut h: Harness) {
    let mut running = h.submit(10, 1000);
    h.step();
    let mut prefilling = h.submit(500, 10);
    h.step();
    let mut waiting = h.submit(500, 10);
    h.step();
    assert_eq!(running.read().tokens.len(), 3);
    assert_eq!(h.scheduler.catching_up.len(), 1, "one prompt mid-prefill");
    assert!(!h.scheduler.waiting.is_empty(), "one waiting");
    running.cancel.cancel();
    prefilling.cancel.cancel();
    waiting.cancel.cancel();
    h.run_to_end();
    for s in [&mut running, &mut prefilling, &mut waiting] {
        assert_eq!(s.read().finish, Some(FinishReason::Cancelled));
    }
    assert!(prefilling.tokens.is_empty() && waiting.tokens.is_empty());
    h.all_back();
}

#[test]
fn pipelined_rows_leave_one_step_late_with_the_same_tokens() {
    let mut decodes = Vec::new();
    for pipeline in [true, false] {
        let mut h = harness(256, 1000, pipeline);
        let mut short = h.submit(8, 3);
        let mut long = h.submit(8, 6);
        h.run_to_end();
        short.done_as_expected();
        long.done_as_expected();
        h.all_back();
        let rows: Vec<usize> = h
            .fake
            .forwards()
            .iter()
            .filter_map(|f| match f {
                Forward::Decode { rows } => Some(*rows),
                _ => None,
            })
            .collect();
        decodes.push(rows);
    }
    // The group's forward gives each row its first token; the row of 3
    // ends with the second decode step and is still in the third,
    // pipelined (its token there is never streamed); the last row's final
    // step queues nothing behind it.
    assert_eq!(decodes[0], [2, 2, 2, 1, 1]);
    assert_eq!(decodes[1], [2, 2, 1, 1, 1]);
}

#[test]
fn rows_preempted_when_memory_runs_out_are_recomputed_with_the_same_tokens() {
    for (pipeline, make) in [
        (true, harness as fn(_, _, _) -> _),
        (false, harness),
        (true, mixing),
        (false, mixing),
    ] {
        let mut h = make(32, 1000, pipeline);
        let mut sent: Vec<Sent> = [8, 20, 100, 50].iter().map(|&n| h.submit(n, 40)).collect();
        for _ in 0..6 {
            h.step();
        }
        let before = h.fake.forwards().len();
        // The next forward and, after the first recovery, another fail.
        h.fake
            .0
            .fail_at
            .lock()
            .unwrap()
            .extend([before, before + 3]);
        let blocks = h.fake.0.pool.allocated();
        h.step();
        assert_eq!(h.scheduler.preempted.len(), 4, "every row gives its KV up");
        assert_eq!(h.fake.0.pool.allocated(), blocks, "and keeps its blocks");
        assert_eq!(h.scheduler.row_cap.unwrap().limit(), 2);
        h.run_to_end();
        for s in &mut sent {
            s.done_as_expected();
        }
        // Recomputed: a preempted row's context in chunks, without a pick.
        let recomputed = h
            .forwards_since(before)
            .iter()
            .map(|f| match f {
                Forward::Chunk { .. } => 1,
                Forward::Mixed { chunks, .. } => chunks.len(),
                _ => 0,
            })
            .sum::<usize>();
        assert!(recomputed >= 4, "{:?}", h.forwards_since(before));
        h.all_back();
    }
}

#[test]
fn a_long_prompt_is_chunked_into_the_decode_rows_forward() {
    for pipeline in [true, false] {
        let mut h = mixing(256, 1000, pipeline);
        let mut running: Vec<Sent> = (0..7).map(|_| h.submit(20, 200)).collect();
        h.step();
        let mut long = h.submit(1000, 8);
        let from = h.fake.forwards().len();
        let before = running[0].read().tokens.len();
        let mut steps = 0;
        while long.read().tokens.is_empty() {
            h.step();
            steps += 1;
            for r in &mut running {
                assert_eq!(r.read().tokens.len(), before + steps, "a token every step");
            }
        }
        // One forward a step: the seven decode rows and 249 prompt tokens;
        // the prompt's first pick comes out of the forward of its last
        // chunk, and the row decodes with the batch from the next step.
        let mixed = |tokens| Forward::Mixed {
            rows: 7,
            chunks: vec![tokens],
        };
        let mut want = vec![mixed(249); 4];
        want.push(mixed(4));
        assert_eq!(h.forwards_since(from), want);
        h.step();
        assert_eq!(h.fake.forwards().last(), Some(&Forward::Decode { rows: 8 }));
        // Read in this step, or (pipelined) in the next.
        assert_eq!(long.read().tokens.len(), if pipeline { 1 } else { 2 });
        h.run_to_end();
        for s in running.iter_mut().chain([&mut long]) {
            s.done_as_expected();
        }
        h.all_back();
    }
}

#[test]
fn a_mixed_step_admits_one_prompt_beside_the_end_of_another_and_the_decode_rows() {
    for pipeline in [true, false] {
        let mut h = mixing(64, 1000, pipeline);
        let mut running = h.submit(10, 30);
        h.step();
        let mut first = h.submit(100, 20);
        let mut second = h.submit(100, 20);
        let from = h.fake.forwards().len();
        h.step();
        h.step();
        use Forward::*;
        assert_eq!(
            h.forwards_since(from),
            [
                Mixed {
                    rows: 1,
                    chunks: vec![63]
                },
                // The first prompt's last 37 tokens and its pick, the
                // second's first 26, the running row's step: one forward.
                Mixed {
                    rows: 1,
                    chunks: vec![37, 26]
                },
            ]
        );
        assert_eq!(first.read().tokens.len(), 1, "picked in the mixed step");
        h.step();
        assert_eq!(
            h.fake.forwards().last(),
            Some(&Mixed {
                rows: 2,
                chunks: vec![62]
            })
        );
        h.run_to_end();
        for s in [&mut running, &mut first, &mut second] {
            s.done_as_expected();
        }
        h.all_back();
    }
}

#[test]
fn prompts_chunked_in_mixed_steps_wait_for_kv_blocks_until_rows_give_theirs_back() {
    // Room for two requests of 100 + 28 tokens (8 blocks each); chunks of
    // 64 tokens, so none starts in a padded group.
    let mut h = mixing(64, 16, true);
    let mut sent: Vec<Sent> = (0..3).map(|_| h.submit(100, 28)).collect();
    h.step();
    h.step();
    assert_eq!(h.fake.0.pool.allocated(), 16, "the third waits for KV");
    assert_eq!(h.scheduler.catching_up.len() + h.scheduler.rows.len(), 2);
    while sent[2].read().tokens.is_empty() {
        h.step();
    }
    assert_eq!(sent[0].read().finish, Some(FinishReason::Length));
    assert!(h
        .fake
        .forwards()
        .iter()
        .any(|f| matches!(f, Forward::Mixed { rows: 1.., chunks } if !chunks.is_empty())));
    h.run_to_end();
    for s in &mut sent {
        s.done_as_expected();
    }
    h.all_back();
}

#[test]
fn a_queue_stalled_on_kv_held_elsewhere_sleeps_until_blocks_come_back() {
    let mut h = harness(256, 16, true);
    let elsewhere = h.fake.0.pool.try_reserve(16).unwrap();
    let mut sent = h.submit(100, 4);
    let Harness {
        scheduler,
        tx,
        fake,
        ..
    } = h;
    let running = std::thread::spawn(move || scheduler.run());
    std::thread::sleep(std::time::Duration::from_millis(100));
    let turns = fake.0.turns.load(Ordering::Acquire);
    assert!(turns <= 2, "{turns} steps while nothing could start");
    drop(elsewhere);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while sent.read().finish.is_none() {
        assert!(std::time::Instant::now() < deadline, "never woken");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    drop(tx);
    running.join().unwrap();
    sent.done_as_expected();
    assert_eq!(fake.0.pool.allocated(), 0);
}
