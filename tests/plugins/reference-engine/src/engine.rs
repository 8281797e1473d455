//! The `Engine` face: admission checks, a job queue to the worker thread,
//! cancellation by id, and a load snapshot.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use engine_core::{
    CancelToken, Capabilities, Engine, EngineContext, EngineError, EngineLoad, EventSender,
    GenerateRequest, Refusal, RequestId,
};
use runtime::SharedModel;

use crate::options::{Fault, Options};
use crate::worker::{self, Job};

/// What the engine and its worker thread both see.
#[derive(Default)]
pub struct State {
    pub active: AtomicUsize,
    pub queued: AtomicUsize,
    pub kv_blocks: AtomicUsize,
    pub stopping: AtomicBool,
    pub worker_alive: AtomicBool,
    /// Cancel handles of queued and running requests, by id.
    pub cancels: Mutex<HashMap<RequestId, CancelToken>>,
}

pub struct ReferenceEngine {
    name: String,
    options: Options,
    shared: Arc<SharedModel>,
    state: Arc<State>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl ReferenceEngine {
    pub fn start(ctx: EngineContext) -> Result<Self, String> {
        let options = Options::from_yaml(&ctx.config)?;
        let shared = SharedModel::from_context(&ctx)?;
        let state = Arc::new(State::default());
        let (tx, rx) = mpsc::channel();
        state.worker_alive.store(true, Ordering::Release);
        let handle = std::thread::Builder::new()
            .name(format!("engine-{}", ctx.name))
            .spawn({
                let (shared, state, options) = (shared.clone(), state.clone(), options.clone());
                move || worker::run(shared, state, rx, options)
            })
            .map_err(|e| format!("cannot start worker thread: {e}"))?;
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
            jobs: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(handle)),
        })
    }

    fn admit(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        if self.state.stopping.load(Ordering::Acquire) {
            return Err(EngineError::ShuttingDown);
        }
        if !self.state.worker_alive.load(Ordering::Acquire) {
            return Err(Refusal::NotReady.into());
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
        let id = req.id;
        self.state
            .cancels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, req.cancel.clone());
        self.state.queued.fetch_add(1, Ordering::AcqRel);
        let sent = match &*self.jobs.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(jobs) => jobs.send(Job { req, events: tx }).is_ok(),
            None => false,
        };
        if !sent {
            self.state.queued.fetch_sub(1, Ordering::AcqRel);
            self.state
                .cancels
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
            return Err(EngineError::ShuttingDown);
        }
        Ok(())
    }

    fn cancel(&self, id: RequestId) {
        if let Some(token) = self
            .state
            .cancels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
        {
            token.cancel();
        }
    }

    fn load(&self) -> EngineLoad {
        EngineLoad {
            active: self.state.active.load(Ordering::Acquire),
            queued: self.state.queued.load(Ordering::Acquire),
            kv_blocks_held: self.state.kv_blocks.load(Ordering::Acquire),
            healthy: self.state.worker_alive.load(Ordering::Acquire)
                && !self.state.stopping.load(Ordering::Acquire),
            accept_rate: None,
            expected_speedup: None,
        }
    }

    fn shutdown(&self) {
        self.state.stopping.store(true, Ordering::Release);
        for token in self
            .state
            .cancels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            token.cancel();
        }
        // Closing the queue ends the worker's loop once the current job stops.
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(handle) = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = handle.join();
        }
    }
}

impl Drop for ReferenceEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
