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
use crate::device::{Device, Pick, Picks, Prefix};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Forward {
    Group { rows: usize, width: usize },
    Chunk { tokens: usize },
    Decode { rows: usize },
}

#[derive(Clone)]
struct Fake(Arc<FakeState>);

struct FakeState {
    pool: KvPool,
    forwards: Mutex<Vec<Forward>>,
    /// Forwards (by index) that run out of memory.
    fail_at: Mutex<Vec<usize>>,
}

impl Fake {
    fn new(blocks: usize) -> Self {
        Self(Arc::new(FakeState {
            pool: KvPool::new(blocks, 16, 1),
            forwards: Mutex::new(Vec::new()),
            fail_at: Mutex::new(Vec::new()),
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

    fn turn(&self) {}

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
        assert_eq!(batch.len(), rows.len(), "a KV row per row");
        let picks = rows
            .iter()
            .zip(batch.iter_mut())
            .map(|(r, at)| {
                *at += 1;
                token(&r.request().prompt, *at)
            })
            .collect();
        Ok(FakePicks(picks))
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

struct Harness {
    scheduler: Scheduler<Fake>,
    tx: Sender<Msg>,
    fake: Fake,
    stats: Arc<Stats>,
    submitted: u32,
}

struct Sent {
    id: RequestId,
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
    let (tx, rx) = crossbeam_channel::unbounded();
    let fake = Fake::new(blocks);
    let stats = Arc::new(Stats::default());
    let limits = StepLimits {
        max_batch: 32,
        prefill: PrefillBudget::from(chunk),
    };
    Harness {
        scheduler: Scheduler::new(fake.clone(), limits, pipeline, rx, stats.clone()),
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
        let (id, cancel) = (request.id, request.cancel.clone());
        let (events, stream) = event_channel();
        self.stats.queued.fetch_add(1, Ordering::AcqRel);
        let waiting = Waiting {
            request,
            blocks,
            events,
        };
        self.tx.send(Msg::Submit(Box::new(waiting))).unwrap();
        Sent {
            id,
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
    let mut h = harness(64, 1000, true);
    let mut running = h.submit(10, 1000);
    h.step();
    let mut prefilling = h.submit(500, 10);
    h.step();
    let mut waiting = h.submit(500, 10);
    h.step();
    assert_eq!(running.read().tokens.len(), 3);
    assert_eq!(h.scheduler.catching_up.len(), 1, "one prompt mid-prefill");
    assert!(!h.scheduler.waiting.is_empty(), "one waiting");
    h.tx.send(Msg::Cancel(running.id)).unwrap();
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
    for pipeline in [true, false] {
        let mut h = harness(32, 1000, pipeline);
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
            .filter(|f| matches!(f, Forward::Chunk { .. }))
            .count();
        assert!(recomputed >= 4, "{:?}", h.forwards_since(before));
        h.all_back();
    }
}
