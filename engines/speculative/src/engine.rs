//! The `Engine` face of a speculative engine: admission (a concurrency cap, KV reserved for target and drafter
//! together) and one worker thread that runs a draft-and-verify round of
//! all its sequences per turn, verified together in one forward, under the
//! shared device lock.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use engine_core::event::EventSender;
use engine_core::{
    Capabilities, Engine, EngineContext, EngineError, EngineLoad, GenerateRequest, Refusal,
    RequestId, StreamError,
};
use runtime::sequence;
use runtime::worker::{self, Cancels, Receiver};
use runtime::{memory, LoadedModel, Reservation, SharedModel};

use crate::adaptive::RoundCost;
use crate::config::SpecSettings;
use crate::decode::{Batch, Sequence};
use crate::draft::DraftSource;
use crate::ngram::PromptLookup;
use crate::window::AcceptWindow;

/// Builds the draft source; runs at construction, or on the first request
/// with `lazy_drafter: true`.
pub type SourceLoader =
    Box<dyn FnOnce(&LoadedModel) -> anyhow::Result<Arc<dyn DraftSource>> + Send>;

/// The draft source and what admission needs to know before it is loaded.
pub struct DraftPlan {
    pub loader: SourceLoader,
    /// Tokens proposed per round at most (KV is reserved for the overshoot).
    pub max_draft: usize,
    /// Drafter KV bytes per token, from its config (reserved from the
    /// shared pool together with the target's).
    pub kv_bytes_per_token: usize,
}

impl DraftPlan {
    /// Prompt lookup: no weights, no drafter KV.
    pub fn prompt_lookup(lookup: PromptLookup) -> Self {
        Self {
            max_draft: lookup.draft_tokens,
            kv_bytes_per_token: 0,
            loader: Box::new(move |_| Ok(Arc::new(lookup) as Arc<dyn DraftSource>)),
        }
    }
}

/// A speculative plugin's constructor: `new_engine` over the shared model
/// and the engine's section of the config, parsed over `defaults`.
pub fn from_context(
    ctx: EngineContext,
    kind: &str,
    defaults: SpecSettings,
    new_engine: fn(String, Arc<SharedModel>, SpecSettings) -> Result<SpecEngine, String>,
) -> Result<SpecEngine, String> {
    let shared = SharedModel::from_context(&ctx)?;
    let settings = SpecSettings::from_yaml(kind, &ctx.config, &ctx.config_dir, defaults)?;
    new_engine(ctx.name, shared, settings)
}

struct Job {
    request: GenerateRequest,
    ticket: Ticket,
    reservation: Reservation,
    events: EventSender,
}

impl worker::Job for Job {
    fn request(&self) -> &GenerateRequest {
        &self.request
    }
}

/// A request's admission: its place under the concurrency cap, in the
/// engine's KV count and among the cancellable requests, given back when
/// dropped (its KV blocks travel apart, as they may be handed over).
struct Ticket {
    state: Arc<Shared>,
    cancels: Cancels,
    id: RequestId,
    blocks: usize,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.cancels.remove(self.id);
        self.state
            .kv_blocks
            .fetch_sub(self.blocks, Ordering::AcqRel);
        self.state.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// State the engine face and its worker share. std locks only: plugins
/// do not share parking_lot's global tables.
struct Shared {
    in_flight: AtomicUsize,
    kv_blocks: AtomicUsize,
    window: Mutex<AcceptWindow>,
    /// Why the drafter could not be loaded (lazy load); the engine then
    /// refuses work so the router uses the others.
    failed: Mutex<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct SpecEngine {
    name: String,
    shared: Arc<SharedModel>,
    settings: SpecSettings,
    max_draft: usize,
    kv_bytes_per_token: usize,
    state: Arc<Shared>,
    worker: worker::Worker<Job>,
}

enum Source {
    Ready(Arc<dyn DraftSource>),
    Pending(SourceLoader),
    Failed(String),
}

impl SpecEngine {
    /// Loads the drafter now unless `settings.lazy_drafter`; a drafter that
    /// fails to load fails the engine (the gateway serves with the others).
    pub fn new(
        name: String,
        shared: Arc<SharedModel>,
        settings: SpecSettings,
        plan: DraftPlan,
    ) -> Result<Self, String> {
        let source = if settings.lazy_drafter {
            Source::Pending(plan.loader)
        } else {
            Source::Ready((plan.loader)(&shared.model).map_err(|e| format!("{name}: {e:#}"))?)
        };
        let state = Arc::new(Shared {
            in_flight: AtomicUsize::new(0),
            kv_blocks: AtomicUsize::new(0),
            window: Mutex::new(AcceptWindow::new(
                settings.accept_window.rounds,
                settings.window_age(),
                settings.accept_window.min_drafted,
            )),
            failed: Mutex::new(None),
        });
        let rounds = Worker {
            shared: shared.clone(),
            state: state.clone(),
            max_batch: settings.max_batch,
            adaptive: settings.adaptive,
            hand_over: settings.hand_over,
            costs: HashMap::new(),
            source,
            name: name.clone(),
        };
        let worker = worker::Worker::spawn(&name, move |jobs, _| rounds.run(jobs))?;
        tracing::info!(engine = %name, lazy = settings.lazy_drafter, max_draft = plan.max_draft, "speculative engine ready");
        Ok(Self {
            name,
            shared,
            kv_bytes_per_token: plan.kv_bytes_per_token,
            max_draft: plan.max_draft,
            settings,
            state,
            worker,
        })
    }
}

impl Engine for SpecEngine {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            greedy_only: false,
            tools: true,
            // The drafters read text positions only.
            images: false,
            // Drafts are verified under the grammar's masks.
            grammar: true,
            // Committed tokens are streamed without their log-probabilities.
            logprobs: false,
            exclusive: false,
        }
    }

    fn submit_to(&self, request: GenerateRequest, events: EventSender) -> Result<(), EngineError> {
        runtime::admission::check_request(&request, &self.shared.model)?;
        if lock(&self.state.failed).is_some() {
            return Err(Refusal::NotReady.into());
        }
        if !self.worker.is_alive() {
            return Err(EngineError::ShuttingDown);
        }
        if !runtime::admission::take_slot(&self.state.in_flight, self.settings.max_concurrent) {
            return Err(Refusal::Busy.into());
        }
        // The verify forward writes up to max_draft positions past the
        // last committed token before rolling back.
        let tokens = request.prompt.len() + request.max_tokens as usize + self.max_draft + 1;
        let per_token = self.shared.model.model.kv_bytes_per_token() + self.kv_bytes_per_token;
        let reservation =
            runtime::admission::reserve(&self.shared.kv_pool, &request, tokens, per_token)
                .inspect_err(|_| {
                    self.state.in_flight.fetch_sub(1, Ordering::AcqRel);
                })?;
        let blocks = reservation.blocks();
        self.state.kv_blocks.fetch_add(blocks, Ordering::AcqRel);
        let ticket = Ticket {
            state: self.state.clone(),
            cancels: self.worker.cancels().clone(),
            id: request.id,
            blocks,
        };
        // A send to a stopped worker drops the job (and its ticket).
        self.worker.send(Job {
            request,
            ticket,
            reservation,
            events,
        })
    }

    fn cancel(&self, id: RequestId) {
        self.worker.cancel(id);
    }

    fn load(&self) -> EngineLoad {
        let alive = self.worker.is_alive();
        let mut window = lock(&self.state.window);
        EngineLoad {
            active: self.state.in_flight.load(Ordering::Acquire),
            queued: 0,
            kv_blocks_held: self.state.kv_blocks.load(Ordering::Acquire),
            healthy: alive && lock(&self.state.failed).is_none(),
            accept_rate: window.rate(),
            expected_speedup: window.speedup(),
        }
    }

    /// Cancels everything in flight and waits for the worker to stop.
    fn shutdown(&self) {
        self.worker.shutdown();
    }
}

struct Worker {
    shared: Arc<SharedModel>,
    state: Arc<Shared>,
    max_batch: Option<usize>,
    adaptive: bool,
    hand_over: bool,
    /// What rounds cost on this engine, by tokens drafted, per number of
    /// sequences verified together (a wider batch costs more per round).
    costs: HashMap<usize, RoundCost>,
    source: Source,
    name: String,
}

impl Worker {
    fn run(mut self, rx: Receiver<Job>) {
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut batch = Batch::default();
        loop {
            if batch.is_empty() && waiting.is_empty() {
                match rx.recv() {
                    Ok(job) => waiting.push_back(job),
                    Err(_) => break,
                }
            }
            waiting.extend(rx.try_iter());
            // One prefill per turn, so running sequences keep streaming.
            if let Some(job) = waiting.pop_front() {
                let seq = self.start(job).filter(|s| !s.is_finished());
                if let Some(seq) = seq {
                    let _device = self.shared.lock_device();
                    if let Err((mut seq, e)) = batch.join(seq) {
                        tracing::error!(engine = %self.name, error = %e, "joining the batch failed");
                        seq.fail(memory::failed_step(&e));
                    }
                }
            }
            batch
                .seqs_mut()
                .iter_mut()
                .for_each(Sequence::check_cancelled);
            self.retire(&mut batch);
            self.hand_over(&mut batch);
            if !batch.is_empty() {
                self.round(&mut batch);
                self.retire(&mut batch);
            }
        }
    }

    /// One round of every running sequence, verified in one forward.
    fn round(&mut self, batch: &mut Batch) {
        let speculate = self.max_batch.is_none_or(|m| batch.len() <= m);
        let cost = self.costs.entry(batch.len()).or_default();
        let result = {
            let _device = self.shared.lock_device();
            let started = Instant::now();
            batch
                .round(&self.shared.model.model, speculate, cost)
                .map(|rounds| (rounds, started.elapsed()))
        };
        match result {
            Ok((rounds, took)) => {
                // The batch's verify width is what its forward cost.
                let width = rounds.iter().map(|r| r.drafted).max().unwrap_or(0) as usize;
                cost.record(width, took);
                let decode = cost.decode_seconds(width, took);
                let mut window = lock(&self.state.window);
                for round in rounds {
                    window.record(round, took, decode);
                }
            }
            Err(e) => {
                tracing::error!(engine = %self.name, rows = batch.len(), error = %e, "speculative round failed");
                batch.fail(memory::failed_step(&e));
            }
        }
    }

    /// With `hand_over`, moves the running sequences to the batched engine
    /// once it has work of its own.
    fn hand_over(&self, batch: &mut Batch) {
        if !self.hand_over || batch.is_empty() {
            return;
        }
        let Some(sink) = self.shared.handover_sink().filter(|s| s.busy()) else {
            return;
        };
        let result = {
            let _device = self.shared.lock_device();
            batch.hand_over(&*sink)
        };
        match result {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(engine = %self.name, sequences = n, "handed its sequences to the batched engine")
            }
            Err(e) => {
                tracing::error!(engine = %self.name, error = %e, "handing over failed");
                batch.fail(memory::failed_step(&e));
            }
        }
    }

    /// Ends the batch's finished sequences (publishing their prefixes);
    /// the device lock is taken only when one has finished.
    fn retire(&self, batch: &mut Batch) {
        if !batch.any_finished() {
            return;
        }
        let result = {
            let _device = self.shared.lock_device();
            batch.retire()
        };
        if let Err(e) = result {
            tracing::error!(engine = %self.name, error = %e, "ending sequences failed");
            batch.fail(memory::failed_step(&e));
        }
    }

    /// Loads the drafter if still pending, starts the sequence, then
    /// prefills; `None` when it ended before (its stream ended too).
    fn start(&mut self, job: Job) -> Option<Sequence> {
        let source = self.source();
        let Job {
            request,
            ticket,
            reservation,
            events,
        } = job;
        let mut seq = sequence::Sequence::start_on(&self.shared, request, events, reservation)?;
        seq.hold(ticket);
        let source = match source {
            Ok(source) => source,
            Err(msg) => {
                seq.fail(StreamError::Internal(format!(
                    "the drafter could not be loaded: {msg}"
                )));
                return None;
            }
        };
        let mut seq = Sequence::new(seq, self.shared.clone(), &*source, self.adaptive);
        seq.check_cancelled();
        if !seq.is_finished() {
            let result = {
                let _device = self.shared.lock_device();
                seq.prefill(&self.shared.model.model)
            };
            if let Err(e) = result {
                tracing::error!(engine = %self.name, request = %seq.request().id, error = %e, "prefill failed");
                seq.fail(memory::failed_step(&e));
            }
        }
        Some(seq)
    }

    fn source(&mut self) -> Result<Arc<dyn DraftSource>, String> {
        let source = std::mem::replace(&mut self.source, Source::Failed(String::new()));
        self.source = match source {
            Source::Pending(loader) => {
                tracing::info!(engine = %self.name, "loading the drafter (lazy_drafter)");
                let loaded = {
                    let _device = self.shared.lock_device();
                    loader(&self.shared.model)
                };
                match loaded {
                    Ok(s) => Source::Ready(s),
                    Err(e) => {
                        let msg = format!("{e:#}");
                        tracing::error!(engine = %self.name, error = %msg, "drafter failed to load; engine out of service");
                        *lock(&self.state.failed) = Some(msg.clone());
                        Source::Failed(msg)
                    }
                }
            }
            other => other,
        };
        match &self.source {
            Source::Ready(s) => Ok(s.clone()),
            Source::Failed(msg) => Err(msg.clone()),
            Source::Pending(_) => unreachable!("resolved above"),
        }
    }
}
