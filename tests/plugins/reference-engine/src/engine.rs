//! The `Engine` face: admission checks, a job queue to the worker thread
//! (`runtime::worker`: cancellation by id, which wakes a request waiting
//! for KV blocks, and shutdown), and a load snapshot.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use engine_core::{
    Capabilities, Engine, EngineContext, EngineError, EngineLoad, EventSender, GenerateRequest,
    RequestId,
};
use runtime::worker::Worker;
use runtime::SharedModel;

use crate::options::{Fault, Options};
use crate::worker::{self, Job};

/// What the engine and its worker thread both see.
#[derive(Default)]
pub struct State {
    pub active: AtomicUsize,
    pub queued: AtomicUsize,
    pub kv_blocks: AtomicUsize,
}

pub struct ReferenceEngine {
    name: String,
    options: Options,
    shared: Arc<SharedModel>,
    state: Arc<State>,
    worker: Worker<Job>,
}

impl ReferenceEngine {
    pub fn start(ctx: EngineContext) -> Result<Self, String> {
        let options = Options::from_yaml(&ctx.config)?;
        let shared = SharedModel::from_context(&ctx)?;
        let state = Arc::new(State::default());
        let worker = Worker::spawn(&ctx.name, {
            let (shared, state, options) = (shared.clone(), state.clone(), options.clone());
            move |jobs, cancels| worker::run(shared, state, jobs, cancels, options)
        })?
        // A request waiting for KV blocks sees its cancellation at once.
        .waking({
            let pool = shared.kv_pool.clone();
            move || pool.wake()
        });
        tracing::info!(
            engine = %ctx.name,
            model = %shared.model.name,
            max_queue = options.max_queue,
            "reference engine ready"
        );
        Ok(Self {
            name: ctx.name,
            options,
            shared,
            state,
            worker,
        })
    }

    /// The KV blocks `req` will wait for, once the runtime's checks pass and
    /// a place in the queue is taken.
    fn admit(&self, req: &GenerateRequest) -> Result<usize, EngineError> {
        if !self.worker.is_alive() {
            return Err(EngineError::ShuttingDown);
        }
        let blocks = runtime::admission::check_queued(req, &self.shared)?;
        if !runtime::admission::take_slot(&self.state.queued, self.options.max_queue) {
            return Err(EngineError::Overloaded("the engine's queue is full".into()));
        }
        Ok(blocks)
    }
}

impl Engine for ReferenceEngine {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            greedy_only: self.options.greedy_only,
            tools: self.options.tools,
            images: false,
            grammar: false,
            logprobs: true,
            exclusive: false,
        }
    }

    fn submit_to(&self, req: GenerateRequest, tx: EventSender) -> Result<(), EngineError> {
        match self.options.fault {
            Some(Fault::PanicOnSubmit) => panic!("injected fault: panic on submit"),
            Some(Fault::ErrorOnSubmit) => {
                return Err(EngineError::Internal("injected fault".into()))
            }
            _ => {}
        }
        let blocks = self.admit(&req)?;
        let job = Job {
            req,
            blocks,
            events: tx,
        };
        self.worker.send(job).inspect_err(|_| {
            self.state.queued.fetch_sub(1, Ordering::AcqRel);
        })
    }

    fn cancel(&self, id: RequestId) {
        self.worker.cancel(id);
    }

    fn load(&self) -> EngineLoad {
        EngineLoad {
            active: self.state.active.load(Ordering::Acquire),
            queued: self.state.queued.load(Ordering::Acquire),
            kv_blocks_held: self.state.kv_blocks.load(Ordering::Acquire),
            healthy: self.worker.is_alive(),
            accept_rate: None,
            expected_speedup: None,
        }
    }

    fn shutdown(&self) {
        self.worker.shutdown();
    }
}
