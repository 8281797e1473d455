//! The scheduler thread: the executor of [`plan`]'s steps. Each iteration:
//! take in new work, drop cancelled rows, plan the step under one token
//! budget ([`plan::plan`]), start what it admits (waiting requests that
//! have KV blocks, or a preempted row), then run it: the batch's decode
//! step and the prompt chunks of the sequences catching up in one mixed
//! forward where the device takes them ([`Scheduler::mixed`]), else a
//! padded group's forward or each chunk's, then one decode step for the
//! whole batch. The budget bounds the inter-token
//! latency of running rows while long prompts arrive. When nothing runs
//! and the queue's front waits for KV blocks other engines hold, the
//! thread sleeps on the pool until they come back
//! ([`Scheduler::wait_while_stalled`]). The forwards are a
//! [`Device`]'s: the model's on MLX ([`crate::device::Mlx`]), or a fake
//! one that drives this whole loop in the tests.
//!
//! Decode is pipelined (as mlx-lm's `BatchGenerator`): step n+1 is built on
//! step n's tokens still on the device and queued before the host reads
//! them, so the device never waits for the host between tokens
//! ([`Scheduler::decode`]). Rows that finish with step n ride along in step
//! n+1 (its token for them is dropped unread); rows that join or leave
//! change the batch from the next step queued.
//!
//! A step that runs out of device memory fails no request by itself: its
//! rows give up their KV and wait to be recomputed from their tokens
//! ([`Scheduler::recover_from_oom`]), as vLLM's recompute preemption, with
//! fewer rows at once. Retries are bounded and back off: when memory does
//! not come back, the newest rows end with 503 and the oldest go on.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::TryRecvError;
use engine_core::{FinishReason, GenerateRequest, StreamError, TokenEvent};
use runtime::handover::Handover;
use runtime::memory;
use runtime::sequence::{Prefill, Sequence};
use runtime::worker::{self, Cancels, Receiver};

use crate::admit::Candidate;
use crate::config::StepLimits;
use crate::device::{Chunk, Device, Pick, Picks, Prefix};
use crate::plan::{self, Admit, RowCap, StepPlan};
use crate::queue::{WaitQueue, Waiting};
use crate::row::{Active, Row};

/// What reaches the scheduler through the engine's worker
/// (`runtime::worker::Worker`): a request to queue, or a running sequence
/// another engine hands over.
pub enum Job {
    Submit(Box<Waiting>),
    Adopt(Box<Handover>),
}

impl worker::Job for Job {
    fn request(&self) -> &GenerateRequest {
        match self {
            Job::Submit(w) => &w.request,
            Job::Adopt(h) => &h.request,
        }
    }
}

impl worker::Adopt for Job {
    fn adopt(handover: Handover) -> Self {
        Job::Adopt(Box::new(handover))
    }

    fn into_handover(self) -> Option<Handover> {
        match self {
            Job::Adopt(h) => Some(*h),
            Job::Submit(_) => None,
        }
    }
}

/// Figures the engine reports in `load()`, written by the scheduler.
#[derive(Default)]
pub struct Stats {
    /// Rows admitted and not yet ended (each [`Active`] counts itself).
    pub active: AtomicUsize,
    /// Submitted and not yet admitted (in the channel or the wait queue);
    /// `submit` bounds it by `max_queue`, so the wait queue needs no bound
    /// of its own.
    pub queued: AtomicUsize,
    pub kv_blocks: AtomicUsize,
}

impl Stats {
    /// One request left the queue. Saturating: a scheduler restarted after
    /// a panic starts the count again from zero.
    pub fn dequeued(&self) {
        let _ = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// Whether it has work, running or waiting: the moment an exclusive
    /// engine hands its sequence over.
    pub fn busy(&self) -> bool {
        self.queued.load(Ordering::Acquire) > 0 || self.active.load(Ordering::Acquire) > 0
    }

    /// After a scheduler panicked: what it held is lost.
    pub fn reset(&self) {
        self.active.store(0, Ordering::Release);
        self.kv_blocks.store(0, Ordering::Release);
        self.queued.store(0, Ordering::Release);
    }
}

struct Prefilling<Kv> {
    row: Row,
    cache: Kv,
    /// What the prefill computes: the prompt, or for a preempted row its
    /// whole context (see [`Row::context`]).
    tokens: Vec<u32>,
    /// How far it is.
    at: Prefill,
}

pub struct Scheduler<D: Device> {
    device: D,
    limits: StepLimits,
    /// Pipelined decode (`pipeline` in the engine's config).
    pipeline: bool,
    rx: Receiver<Job>,
    /// The worker's cancel handles: each request leaves them when it ends.
    cancels: Cancels,
    stats: Arc<Stats>,
    waiting: WaitQueue,
    /// Sequences being prefilled chunk by chunk, oldest first.
    catching_up: Vec<Prefilling<D::Kv>>,
    /// Short prompts admitted together, prefilled in one padded forward.
    group: Vec<Row>,
    rows: Vec<Row>,
    batch: Option<D::Kv>,
    /// The decode step queued and not yet read (pipelined decode): the
    /// next tokens of the first `pending.rows` rows.
    pending: Option<D::Picks>,
    /// Rows that gave up their KV when a step ran out of memory, oldest
    /// first; they rejoin before anything new is admitted.
    preempted: VecDeque<Row>,
    /// Rows allowed in the batch since memory ran out; `None`: `max_batch`.
    row_cap: Option<RowCap>,
    /// Steps in a row that ran out of memory (see
    /// [`Scheduler::recover_from_oom`]); a step that succeeds ends the run.
    oom_streak: u32,
    /// Where this step's time went, for the step log.
    times: StepTimes,
    /// When the previous step started.
    last_step: Option<Instant>,
}

impl<D: Device> Scheduler<D> {
    pub fn new(
        device: D,
        limits: StepLimits,
        pipeline: bool,
        rx: Receiver<Job>,
        cancels: Cancels,
        stats: Arc<Stats>,
    ) -> Self {
        Self {
            waiting: WaitQueue::default(),
            device,
            limits,
            pipeline,
            rx,
            cancels,
            stats,
            catching_up: Vec::new(),
            group: Vec::new(),
            rows: Vec::new(),
            batch: None,
            pending: None,
            preempted: VecDeque::new(),
            row_cap: None,
            oom_streak: 0,
            times: StepTimes::default(),
            last_step: None,
        }
    }

    /// Runs until the worker's channel closes (shutdown), then cancels
    /// what it holds.
    pub fn run(mut self) {
        while self.intake() {
            self.iteration();
            self.wait_while_stalled();
        }
        self.cancel_everything();
        self.publish();
    }

    /// One step, after the intake: drop cancelled rows, plan, start what
    /// the plan admits, run it.
    fn iteration(&mut self) {
        self.drop_cancelled();
        let plan = self.plan();
        let chunks = self.admit(plan);
        // Published before stepping: an exclusive engine holding the
        // device must see this work to hand over and let it run.
        self.publish();
        let started = Instant::now();
        let period = self.last_step.replace(started).map(|t| started - t);
        let (rows, group, prefill) = (self.rows.len(), self.group.len(), self.catching_up.len());
        self.times = StepTimes::default();
        let result = self.step(&chunks);
        // Per step, for finding where a slow batch spends its time
        // (`RUST_LOG=batched=debug`; through the gateway `plugin=debug`).
        tracing::debug!(
            rows,
            group,
            prefill,
            columns = self.batch.as_ref().map_or(0, |b| self.device.columns(b)),
            ms = ms(started.elapsed()),
            built_ms = ms(self.times.built),
            launched_ms = ms(self.times.launched),
            waited_ms = ms(self.times.waited),
            period_ms = period.map_or(0.0, ms),
            "step"
        );
        match result {
            Ok(()) => self.oom_streak = 0,
            Err(e) if memory::is_out_of_memory(&e) => self.recover_from_oom(&e),
            Err(e) => {
                tracing::error!(error = %e, "batched step failed; failing its requests");
                self.fail_all(&format!("engine step failed: {e}"));
            }
        }
        self.publish();
    }

    /// When nothing runs and the front of the queue waits for KV blocks
    /// other engines hold, sleeps until blocks come back, a job arrives
    /// or a request is cancelled (the worker wakes the pool at both)
    /// rather than planning the same empty step again.
    fn wait_while_stalled(&self) {
        let Some(front) = self.waiting.front().filter(|_| !self.running()) else {
            return;
        };
        let pool = self.device.pool();
        // Read before looking: whatever comes after it ends the wait.
        let seen = pool.releases();
        let free = pool.total().saturating_sub(pool.allocated());
        if front.blocks <= free
            || !self.rx.is_empty()
            || self.waiting.iter().any(Waiting::is_cancelled)
        {
            return;
        }
        pool.wait_release(seen);
    }

    /// Whether it holds started sequences (running, being prefilled or
    /// waiting to be recomputed).
    fn running(&self) -> bool {
        !(self.rows.is_empty()
            && self.catching_up.is_empty()
            && self.group.is_empty()
            && self.preempted.is_empty())
    }

    fn idle(&self) -> bool {
        !self.running() && self.waiting.is_empty()
    }

    /// Returns false when the channel is closed.
    fn intake(&mut self) -> bool {
        if self.idle() {
            match self.rx.recv() {
                Ok(msg) => self.handle(msg),
                Err(_) => return false,
            }
        }
        loop {
            match self.rx.try_recv() {
                Ok(msg) => self.handle(msg),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    fn handle(&mut self, job: Job) {
        match job {
            Job::Submit(mut w) => {
                w.cancel_handle = Some(self.cancels.guard(w.request.id));
                self.waiting.push(*w)
            }
            Job::Adopt(h) => self.adopt(*h),
        }
    }

    fn adopt(&mut self, h: Handover) {
        let cancel_handle = self.cancels.guard(h.request.id);
        let Some((mut seq, cache, last_token)) = Sequence::resume(h, self.device.vocab()) else {
            return;
        };
        seq.hold(cancel_handle);
        let row = Row::new(seq, Active::take(&self.stats), last_token);
        let joined = self
            .device
            .adopted(cache)
            .and_then(|cache| self.join_batch(vec![row], cache));
        if let Err(e) = joined {
            tracing::error!(error = %e, "adopting a handed-over sequence failed");
        }
    }

    fn join_batch(&mut self, rows: Vec<Row>, cache: D::Kv) -> anyhow::Result<()> {
        match self.device.join(self.batch.take(), cache) {
            Ok(b) => {
                self.batch = Some(b);
                self.rows.extend(rows);
                Ok(())
            }
            Err(e) => {
                for row in rows {
                    row.fail(StreamError::Internal(format!(
                        "internal error joining the batch: {e}"
                    )));
                }
                self.fail_all("internal error joining the batch");
                Err(e)
            }
        }
    }

    /// Keeps row `i`'s prompt and answer in the prefix cache, before its
    /// final event (the chat's next turn, sent the moment it arrives,
    /// starts from it). Runs under the device lock (decode steps).
    fn publish_row(&self, i: usize) {
        let (Some(batch), row) = (self.batch.as_ref(), &self.rows[i]) else {
            return;
        };
        if self.device.wants(row.seq.context_len()) {
            let scope = row.request().cache_scope.as_deref();
            self.device.keep(scope, &row.seq.context(), batch, Some(i));
        }
    }

    fn drop_cancelled(&mut self) {
        for w in self.waiting.drain_cancelled() {
            self.stats.dequeued();
            w.cancel();
        }
        let (gone, kept): (Vec<_>, Vec<_>) = self
            .catching_up
            .drain(..)
            .partition(|p| p.row.is_cancelled());
        self.catching_up = kept;
        for p in gone {
            p.row.finish(FinishReason::Cancelled);
        }
        let (gone, kept): (Vec<Row>, Vec<Row>) =
            self.preempted.drain(..).partition(Row::is_cancelled);
        self.preempted = kept.into();
        for row in gone {
            row.finish(FinishReason::Cancelled);
        }
        let cancelled: Vec<(usize, FinishReason)> = (0..self.rows.len())
            .filter(|&i| self.rows[i].is_cancelled())
            .map(|i| (i, FinishReason::Cancelled))
            .collect();
        if !cancelled.is_empty() {
            self.remove_rows(&cancelled);
        }
    }

    /// Takes finished rows out of the batch (and their KV out of the cache).
    fn remove_rows(&mut self, gone: &[(usize, FinishReason)]) {
        for &(i, reason) in gone {
            if reason != FinishReason::Cancelled {
                self.publish_row(i);
            }
        }
        let mut rows: Vec<Option<Row>> = self.rows.drain(..).map(Some).collect();
        for &(i, reason) in gone {
            if let Some(r) = rows[i].take() {
                r.finish(reason);
            }
        }
        let keep: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].is_some()).collect();
        self.rows = rows.into_iter().flatten().collect();
        // A queued step's tokens for the rows gone are never read.
        let pending = match self.pending.take() {
            Some(step) => step.keep(&keep),
            None => Ok(None),
        };
        self.row_cap = self
            .row_cap
            .take()
            .and_then(|cap| cap.rows_finished(gone.len(), self.limits.max_batch, Instant::now()));
        if self.rows.is_empty() {
            self.batch = None;
            return;
        }
        let selected = pending.and_then(|step| {
            self.pending = step;
            let device = &self.device;
            self.batch
                .as_mut()
                .map_or(Ok(()), |b| device.select_rows(b, &keep))
        });
        if let Err(e) = selected {
            tracing::error!(error = %e, "dropping rows from the batch failed");
            self.fail_all("internal error");
        }
    }

    /// This step's plan (see [`plan::plan`]).
    fn plan(&self) -> StepPlan {
        let row_limit = self.row_cap.as_ref().map_or(self.limits.max_batch, |c| {
            c.limit().min(self.limits.max_batch)
        });
        let catching_up: Vec<Prefill> = self.catching_up.iter().map(|p| p.at).collect();
        let preempted: Vec<usize> = self.preempted.iter().map(|r| r.seq.context_len()).collect();
        let device = &self.device;
        let pool = device.pool();
        let waiting = self.waiting.iter().map(|w| Candidate {
            prompt_len: w.request.prompt.len(),
            blocks: w.blocks,
            images: !w.request.images.is_empty(),
            prefix_hit: device.has_hit(w.request.cache_scope.as_deref(), &w.request.prompt),
        });
        let state = plan::State {
            decoding: self.rows.len(),
            catching_up: &catching_up,
            preempted: &preempted,
            waiting,
            free_blocks: pool.total().saturating_sub(pool.allocated()),
            row_limit,
        };
        plan::plan(state, self.limits.prefill)
    }

    /// Starts what the plan admits; returns the prompt tokens each
    /// sequence catching up computes this step (the plan's chunks, and the
    /// new one's).
    fn admit(&mut self, plan: StepPlan) -> Vec<usize> {
        let mut chunks = plan.chunks;
        let started = match plan.admit {
            None => return chunks,
            Some(Admit::Rejoin { tokens }) => {
                let row = self.preempted.pop_front().expect("a preempted row");
                let context = row.seq.context();
                let hit = self
                    .device
                    .lookup(row.request().cache_scope.as_deref(), &context);
                Some((row, hit, context, tokens))
            }
            Some(Admit::Chunked { tokens }) => self.take_next().map(|(row, hit)| {
                let prompt = row.request().prompt.clone();
                (row, hit, prompt, tokens)
            }),
            // Another engine may take blocks meanwhile: the group is what
            // could be reserved.
            Some(Admit::Group(n)) => {
                while self.group.len() < n {
                    let Some((row, _)) = self.take_next() else {
                        break;
                    };
                    self.group.push(row);
                }
                None
            }
        };
        if let Some((row, hit, tokens, chunk)) = started {
            let (cache, done) = hit.unwrap_or_else(|| (self.device.new_kv(), 0));
            let snapshot = self.device.snapshot_at(row.request().prompt.len());
            let at = Prefill::new(done, tokens.len(), snapshot);
            self.catching_up.push(Prefilling {
                row,
                cache,
                tokens,
                at,
            });
            chunks.push(chunk);
        }
        chunks
    }

    /// The next waiting request as a row with its KV reserved, and its
    /// prefix-cache hit; `None` when nothing waits or the pool is full.
    fn take_next(&mut self) -> Option<(Row, Option<Prefix<D::Kv>>)> {
        loop {
            let front = self.waiting.front()?;
            // When the pool is full, wait for running rows to return blocks.
            let reservation = self.device.pool().try_reserve(front.blocks).ok()?;
            let w = self.waiting.pop()?;
            // Counted active before it leaves the queue: never idle between.
            let active = Active::take(&self.stats);
            self.stats.dequeued();
            let device = &self.device;
            let Some(mut seq) =
                Sequence::start(w.request, w.events, reservation, device.vocab(), |g| {
                    device.grammar(g)
                })
            else {
                continue;
            };
            if let Some(handle) = w.cancel_handle {
                seq.hold(handle);
            }
            let hit = self
                .device
                .lookup(seq.request().cache_scope.as_deref(), &seq.request().prompt);
            let mut row = Row::new(seq, active, 0);
            row.seq
                .out
                .set_cached_tokens(hit.as_ref().map_or(0, |(_, n)| *n as u32));
            return Some((row, hit));
        }
    }

    /// Runs a planned step: the group's forward, `chunks[i]` prompt
    /// tokens of the `i`th sequence catching up, and a decode step.
    fn step(&mut self, chunks: &[usize]) -> anyhow::Result<()> {
        // A handle of its own: the turn lasts while the step changes `self`.
        let device = self.device.clone();
        let _turn = device.turn();
        // A padded group starts only in a step no chunk takes.
        debug_assert!(self.group.is_empty() || !self.mixes(chunks));
        let done = match self.mixes(chunks) {
            true => self.mixed(chunks),
            false => self
                .prefill_group()
                .and_then(|()| self.prefill_chunks(chunks))
                .and_then(|()| self.decode()),
        };
        if done.is_err() {
            // A step queued before the failure computed its tokens before
            // it: they are delivered, as unpipelined decoding read them
            // before the failing forward ran (the recovery then recomputes
            // from them, and seeded rows draw the same keys).
            if let Some(step) = self.pending.take() {
                if let Err(e) = self.land(step) {
                    tracing::warn!(error = %e, "reading the last queued step failed");
                }
            }
        }
        done
    }

    fn prefill_group(&mut self) -> anyhow::Result<()> {
        if self.group.is_empty() {
            return Ok(());
        }
        // The rows stay in the group until their first token is out: a
        // step that fails leaves them to the caller's recovery.
        let longest = self.group.iter().map(|r| r.request().prompt.len()).max();
        let width = self
            .limits
            .prefill
            .width(longest.unwrap_or(0), self.group.len());
        let (mut cache, picks) = self.device.prefill_group(&mut self.group, width)?;
        let picks = self.device.read(&self.group, picks)?;
        let finished = land(&mut self.group, picks)?;
        let rows = std::mem::take(&mut self.group);
        // Cached only now that the forward evaluated.
        for (i, row) in rows.iter().enumerate() {
            let prompt = &row.request().prompt;
            if self.device.wants(prompt.len()) {
                let scope = row.request().cache_scope.as_deref();
                self.device.keep(scope, prompt, &cache, Some(i));
            }
        }
        let keep: Vec<usize> = (0..rows.len())
            .filter(|i| !finished.iter().any(|(j, _)| j == i))
            .collect();
        let mut rows: Vec<Option<Row>> = rows.into_iter().map(Some).collect();
        for &(i, reason) in &finished {
            rows[i].take().unwrap().finish(reason);
        }
        if keep.is_empty() {
            return Ok(());
        }
        if !finished.is_empty() {
            self.device.select_rows(&mut cache, &keep)?;
        }
        self.join_batch(rows.into_iter().flatten().collect(), cache)
    }

    fn prefill_chunks(&mut self, chunks: &[usize]) -> anyhow::Result<()> {
        // A sequence that completes leaves `catching_up`: the next one
        // moves to its index.
        let mut i = 0;
        for &tokens in chunks {
            if tokens == 0 || !self.prefill_chunk(i, tokens)? {
                i += 1;
            }
        }
        Ok(())
    }

    /// Computes up to `tokens` more of sequence `i`'s prompt; returns
    /// whether it completed (joined the batch or finished).
    fn prefill_chunk(&mut self, i: usize, tokens: usize) -> anyhow::Result<bool> {
        let (end, pick) = self.chunk_span(i, tokens);
        let p = &mut self.catching_up[i];
        let chunk = &p.tokens[p.at.done..end];
        let picks = self
            .device
            .prefill(&mut p.row, &mut p.cache, chunk, p.at.done, pick)?;
        self.chunk_done(i, end, picks)
    }

    /// Where sequence `i`'s chunk of up to `tokens` ends (at a snapshot
    /// point where its KV is kept), and whether it ends with a pick.
    fn chunk_span(&self, i: usize, tokens: usize) -> (usize, bool) {
        let p = &self.catching_up[i];
        let end = p.at.chunk_end(p.row.request(), tokens);
        // A preempted row's next input is its newest token: no pick.
        let pick = end == p.at.target && p.row.seq.out.generated() == 0;
        (end, pick)
    }

    /// Sequence `i`'s KV now holds its tokens up to `end` (`picks`: its
    /// first pick, when the chunk ended its prompt): kept at a snapshot
    /// point; at the end of what it catches up, the sequence joins the
    /// batch or finishes. Returns whether it left `catching_up`.
    fn chunk_done(
        &mut self,
        i: usize,
        end: usize,
        picks: Option<D::Picks>,
    ) -> anyhow::Result<bool> {
        let p = &mut self.catching_up[i];
        let Some(picks) = picks else {
            if p.at.advance(end) {
                let scope = p.row.request().cache_scope.as_deref();
                let prompt = &p.row.request().prompt[..end];
                self.device.keep(scope, prompt, &p.cache, None);
            }
            if !p.at.is_done() {
                return Ok(false);
            }
            let p = self.catching_up.remove(i);
            return self.join_batch(vec![p.row], p.cache).map(|()| true);
        };
        let mut p = self.catching_up.remove(i);
        let row = std::slice::from_mut(&mut p.row);
        let finished = match self
            .device
            .read(row, picks)
            .and_then(|picks| land(row, picks))
        {
            Ok(finished) => finished,
            Err(e) => {
                // Back in place for the caller's recovery.
                self.catching_up.insert(i, p);
                return Err(e);
            }
        };
        let scope = p.row.request().cache_scope.as_deref();
        self.device
            .keep(scope, &p.row.request().prompt, &p.cache, None);
        match finished.first() {
            Some(&(_, reason)) => {
                p.row.finish(reason);
                Ok(true)
            }
            None => self.join_batch(vec![p.row], p.cache).map(|()| true),
        }
    }

    /// Whether the step's chunks run in one forward with the decode step
    /// ([`Scheduler::mixed`]): the device mixes every sequence with a
    /// chunk this step.
    fn mixes(&self, chunks: &[usize]) -> bool {
        let mut taking = chunks
            .iter()
            .zip(&self.catching_up)
            .filter(|(&t, _)| t > 0)
            .peekable();
        taking.peek().is_some() && taking.all(|(_, p)| self.device.mixes(&p.row))
    }

    /// The batch's decode step and the step's prompt chunks in one
    /// forward, whose picks are read together. Pipelining as
    /// [`Scheduler::decode`]: the decode rows' step is queued on the
    /// previous one's tokens; a chunk that ends its prompt is read in this
    /// step (its row joins the batch and decodes from the next).
    fn mixed(&mut self, chunks: &[usize]) -> anyhow::Result<()> {
        let pipelined = self.pipelined();
        self.land_unless_continued(pipelined)?;
        let spans: Vec<(usize, usize, bool)> = chunks
            .iter()
            .enumerate()
            .filter(|(_, &t)| t > 0)
            .map(|(i, &t)| {
                let (end, pick) = self.chunk_span(i, t);
                (i, end, pick)
            })
            .collect();
        let prev = self.pending.take();
        let mut parts: Vec<Chunk<'_, D::Kv>> = self
            .catching_up
            .iter_mut()
            .enumerate()
            .filter_map(|(i, p)| {
                let &(_, end, pick) = spans.iter().find(|s| s.0 == i)?;
                Some(Chunk {
                    row: &mut p.row,
                    kv: &mut p.cache,
                    tokens: &p.tokens[p.at.done..end],
                    start: p.at.done,
                    pick,
                })
            })
            .collect();
        let building = Instant::now();
        let batch = self.batch.as_mut();
        let built = self
            .device
            .mixed(batch, &mut self.rows, prev.as_ref(), &mut parts);
        drop(parts);
        self.times.built += building.elapsed();
        let picks = match built {
            Ok(picks) => picks,
            Err(e) => {
                // Read by `step`'s recovery.
                self.pending = prev;
                return Err(e);
            }
        };
        match picks.decode {
            Some(next) if pipelined => {
                let launching = Instant::now();
                self.device.launch(&next)?;
                self.times.launched += launching.elapsed();
                self.pending = Some(next);
                if let Some(prev) = prev {
                    self.land(prev)?;
                }
            }
            Some(next) => self.land(next)?,
            None => {}
        }
        // A sequence that completes leaves `catching_up`: the next one
        // moves to its index.
        let mut left = 0;
        for ((i, end, _), picks) in spans.into_iter().zip(picks.chunks) {
            if self.chunk_done(i - left, end, picks)? {
                left += 1;
            }
        }
        Ok(())
    }

    /// Whether the next step may be queued before the last is read: the
    /// engine pipelines and no row must be read first.
    fn pipelined(&self) -> bool {
        self.pipeline && self.rows.iter().all(|r| r.seq.pipelines())
    }

    /// Reads the queued step unless the next one continues it. Nothing is
    /// queued behind a step that ends every row by length, or once
    /// pipelining stopped (a constrained row joined).
    fn land_unless_continued(&mut self, pipelined: bool) -> anyhow::Result<()> {
        let rows = &self.rows;
        if let Some(step) = self
            .pending
            .take_if(|s| !pipelined || !continues_after(rows, s.rows()))
        {
            self.land(step)?;
        }
        Ok(())
    }

    /// One decode step of the batch. Pipelined, the step is built on the
    /// previous step's tokens still on the device and queued before they
    /// are read; the rows that finish with them are dropped from the step
    /// just queued, unread. A batch with a row that must be read before its
    /// next pick (see [`Row::pipelines`]) steps unpipelined: queue, read.
    fn decode(&mut self) -> anyhow::Result<()> {
        if self.batch.is_none() {
            return Ok(());
        }
        let pipelined = self.pipelined();
        self.land_unless_continued(pipelined)?;
        if self.batch.is_none() {
            return Ok(());
        }
        let prev = self.pending.take();
        let building = Instant::now();
        let batch = self.batch.as_mut().expect("a batch to step");
        let built = self.device.decode(batch, &mut self.rows, prev.as_ref());
        self.times.built += building.elapsed();
        let next = match built {
            Ok(next) => next,
            Err(e) => {
                // Read by `step`'s recovery.
                self.pending = prev;
                return Err(e);
            }
        };
        if !pipelined {
            return self.land(next);
        }
        let launching = Instant::now();
        self.device.launch(&next)?;
        self.times.launched += launching.elapsed();
        self.pending = Some(next);
        match prev {
            Some(prev) => self.land(prev),
            None => Ok(()),
        }
    }

    /// Reads a step's tokens and hands them to its rows; the rows that end
    /// leave the batch.
    fn land(&mut self, step: D::Picks) -> anyhow::Result<()> {
        let n = step.rows();
        let waiting = Instant::now();
        let picks = self.device.read(&self.rows[..n], step)?;
        self.times.waited += waiting.elapsed();
        let finished = land(&mut self.rows[..n], picks)?;
        if !finished.is_empty() {
            self.remove_rows(&finished);
        }
        Ok(())
    }

    /// Every admitted row: in the batch, being prefilled, or preempted.
    fn started(&self) -> impl Iterator<Item = &Row> {
        self.rows
            .iter()
            .chain(&self.group)
            .chain(self.catching_up.iter().map(|p| &p.row))
            .chain(&self.preempted)
    }

    /// Takes every admitted row out of the scheduler (the batch's KV goes
    /// with them), oldest first.
    fn take_started(&mut self) -> Vec<Row> {
        self.batch = None;
        self.pending = None;
        let mut rows: Vec<Row> = self.rows.drain(..).collect();
        rows.extend(self.catching_up.drain(..).map(|p| p.row));
        rows.append(&mut self.group);
        rows.extend(self.preempted.drain(..));
        rows
    }

    /// The figures `load()` reports that the scheduler counts (rows count
    /// themselves active).
    fn publish(&self) {
        let blocks: usize = self.started().map(|r| r.seq.blocks()).sum();
        self.stats.kv_blocks.store(blocks, Ordering::Release);
    }

    /// A step ran out of device memory. Its graph failed part way through
    /// writing the KV caches, so no row's KV can be trusted: MLX's cached
    /// buffers go back to the device, every row gives up its KV and waits
    /// (keeping its reservation and its stream) to be recomputed from its
    /// tokens, oldest first, with half the rows at once (see [`RowCap`];
    /// halved again by each failure in a row), after a pause that doubles
    /// with each failure in a row. Past [`plan::OOM_RETRIES`] failures in a row
    /// memory is not coming back: each further failure ends the newest
    /// half of the rows (rounded down, at least one) with 503, so the
    /// oldest go on and the run ends.
    fn recover_from_oom(&mut self, error: &anyhow::Error) {
        self.device.release_memory();
        self.oom_streak += 1;
        let mut rows = self.take_started();
        rows.sort_by_key(|r| r.request().id);
        let admitted = rows.len();
        let (shed, cap) = plan::after_oom(
            admitted,
            self.oom_streak,
            self.row_cap.take(),
            Instant::now(),
        );
        tracing::warn!(
            error = %error,
            rows = rows.len(),
            failures_in_a_row = self.oom_streak,
            ending = shed,
            "batched step ran out of memory; recomputing its rows with fewer at once"
        );
        for row in rows.drain(rows.len() - shed..) {
            row.fail(memory::failed_step(error));
        }
        self.row_cap = Some(cap);
        self.preempted = rows.into();
        std::thread::sleep(oom_backoff(self.oom_streak));
    }

    fn fail_all(&mut self, message: &str) {
        for r in self.take_started() {
            r.fail(StreamError::Internal(message.to_string()));
        }
    }

    fn cancel_everything(&mut self) {
        for w in self.waiting.drain() {
            self.stats.dequeued();
            w.cancel();
        }
        while let Ok(job) = self.rx.try_recv() {
            match job {
                Job::Submit(w) => {
                    self.stats.dequeued();
                    w.cancel();
                }
                Job::Adopt(h) => {
                    if let Some((mut seq, ..)) = Sequence::resume(*h, self.device.vocab()) {
                        seq.finish(FinishReason::Cancelled, None);
                    }
                }
            }
        }
        for r in self.take_started() {
            r.finish(FinishReason::Cancelled);
        }
    }
}

/// A step's decode time by phase: building the next step's graph,
/// launching it (MLX encodes its kernels on this thread), and waiting for
/// the device to finish the previous one. The rest is the host's own work.
#[derive(Default)]
struct StepTimes {
    built: Duration,
    launched: Duration,
    waited: Duration,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The pause after the `streak`-th failure in a row: 10 ms doubling, at
/// most a second (time for the memory's holder to let go).
fn oom_backoff(streak: u32) -> Duration {
    Duration::from_millis(10 << streak.saturating_sub(1).min(6)).min(Duration::from_secs(1))
}

/// Whether a row goes on after a step of the batch's first `picked` rows
/// is read, as far as the host knows before reading it: a row the step
/// does not cover, or one with more than one token left.
fn continues_after(rows: &[Row], picked: usize) -> bool {
    rows.len() > picked || rows[..picked].iter().any(|r| r.seq.tokens_left() > 1)
}

/// Hands each row its pick (see [`Sequence::accept`]); returns the rows
/// that finished.
fn land(rows: &mut [Row], picks: Vec<Pick>) -> anyhow::Result<Vec<(usize, FinishReason)>> {
    let mut finished = Vec::new();
    for (i, (row, pick)) in rows.iter_mut().zip(picks).enumerate() {
        let token = TokenEvent {
            id: pick.token,
            logprob: pick.logprob,
            top_logprobs: pick.top_logprobs,
        };
        row.last_token = pick.token;
        if let Some(reason) = row.seq.accept(token, pick.grammar_over)? {
            finished.push((i, reason));
        }
    }
    Ok(finished)
}

#[cfg(test)]
mod tests;
