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

    fn admit(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        if !self.worker.is_alive() {
            return Err(EngineError::ShuttingDown);
        }
        if req.prompt.is_empty() {
            return Err(EngineError::Invalid("the prompt is empty".into()));
        }
        let window = self.shared.model.context_window();
        let total = req.prompt.len() + req.max_tokens as usize;
        if total > window {
            return Err(EngineError::Invalid(format!(
                "prompt ({} tokens) plus max_tokens ({}) exceeds the context window of {window} tokens",
                req.prompt.len(),
                req.max_tokens
            )));
        }
        let pool = &self.shared.kv_pool;
        pool.check_fits(pool.blocks_for(total))
            .map_err(|e| EngineError::Invalid(e.to_string()))?;
        if self.state.queued.load(Ordering::Acquire) >= self.options.max_queue {
            return Err(EngineError::Overloaded("the engine's queue is full".into()));
        }
        Ok(())
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
        self.admit(&req)?;
        self.state.queued.fetch_add(1, Ordering::AcqRel);
        self.worker.send(Job { req, events: tx }).inspect_err(|_| {
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
