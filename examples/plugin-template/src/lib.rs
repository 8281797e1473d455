//! `engine-template`: the smallest real engine plugin, kept as the starting
//! point for third-party authors (docs/plugins.md). One plain greedy request
//! at a time on its own thread, over the gateway's shared model: it takes
//! the shared device lock, reserves its KV blocks in the shared pool,
//! streams each token, and stops when cancelled or when its client leaves.
//!
//! ```yaml
//! plugins: [path/to/libengine_template.so]
//! engines:
//!   tmpl: { kind: template }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use engine_core::{
    CancelToken, Capabilities, Engine, EngineContext, EngineError, EngineLoad, Event, EventSender,
    Finish, FinishReason, GenerateRequest, RequestId, StreamError, TokenEvent,
};
use runtime::SharedModel;

struct Job {
    req: GenerateRequest,
    events: EventSender,
}

struct Template {
    name: String,
    shared: Arc<SharedModel>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    queued: Arc<AtomicUsize>,
    cancels: Arc<Mutex<HashMap<RequestId, CancelToken>>>,
}

fn create(ctx: EngineContext) -> Result<Box<dyn Engine>, String> {
    let shared = SharedModel::from_context(&ctx)?;
    let (tx, rx) = mpsc::channel::<Job>();
    let queued = Arc::new(AtomicUsize::new(0));
    let cancels = Arc::new(Mutex::new(HashMap::new()));
    let worker = (shared.clone(), queued.clone(), cancels.clone());
    std::thread::Builder::new()
        .name(format!("engine-{}", ctx.name))
        .spawn(move || {
            let (shared, queued, cancels) = worker;
            while let Ok(job) = rx.recv() {
                queued.fetch_sub(1, Ordering::AcqRel);
                let id = job.req.id;
                serve(&shared, job);
                cancels.lock().unwrap().remove(&id);
            }
        })
        .map_err(|e| format!("cannot start the worker thread: {e}"))?;
    tracing::info!(engine = %ctx.name, model = %shared.model.name, "template engine ready");
    Ok(Box::new(Template {
        name: ctx.name,
        shared,
        jobs: Mutex::new(Some(tx)),
        queued,
        cancels,
    }))
}

/// Generates one request start to finish; every stream ends with exactly
/// one `Finished` or `Error`.
fn serve(shared: &SharedModel, Job { req, events }: Job) {
    let pool = &shared.kv_pool;
    let blocks = pool.blocks_for(req.prompt.len() + req.max_tokens as usize);
    // Checked to fit at submit; wait while other engines hold the pool.
    let reservation = loop {
        if req.cancel.is_cancelled() || events.is_closed() {
            return;
        }
        match pool.try_reserve(blocks) {
            Ok(r) => break r,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(2)),
        }
    };
    let mut delivered = 0u32;
    let run = {
        let _device = shared.lock_device();
        runtime::generate::greedy(
            &shared.model.model,
            &req.prompt,
            req.max_tokens as usize,
            &req.stop_tokens,
            |id| {
                let token = Event::Token(TokenEvent {
                    id,
                    logprob: None,
                    top_logprobs: Vec::new(),
                });
                if events.send(token).is_err() {
                    return false;
                }
                delivered += 1;
                !req.cancel.is_cancelled()
            },
        )
    };
    drop(reservation);
    let event = match run {
        Ok(run) => Event::Finished(Finish {
            reason: if req.cancel.is_cancelled() || events.is_closed() {
                FinishReason::Cancelled
            } else if run.tokens.len() >= req.max_tokens as usize {
                FinishReason::Length
            } else {
                FinishReason::Stop
            },
            prompt_tokens: req.prompt.len() as u32,
            completion_tokens: delivered,
            cached_tokens: 0,
            spec: None,
        }),
        Err(e) => Event::Error(StreamError::Internal(format!("generation failed: {e}"))),
    };
    let _ = events.send(event);
}

impl Engine for Template {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        // Plain greedy text; no tools, images, grammars or logprobs.
        Capabilities {
            greedy_only: true,
            ..Capabilities::default()
        }
    }

    fn submit_to(&self, req: GenerateRequest, events: EventSender) -> Result<(), EngineError> {
        // What `capabilities` leaves out never arrives: the gateway applies
        // it. This checks only what the engine itself must hold true.
        runtime::admission::check_request(&req, &self.shared.model)?;
        let jobs = self.jobs.lock().unwrap();
        let jobs = jobs.as_ref().ok_or(EngineError::ShuttingDown)?;
        self.cancels
            .lock()
            .unwrap()
            .insert(req.id, req.cancel.clone());
        self.queued.fetch_add(1, Ordering::AcqRel);
        jobs.send(Job { req, events })
            .map_err(|_| EngineError::ShuttingDown)
    }

    fn cancel(&self, id: RequestId) {
        if let Some(token) = self.cancels.lock().unwrap().get(&id) {
            token.cancel();
        }
    }

    fn load(&self) -> EngineLoad {
        let in_flight = self.cancels.lock().unwrap().len();
        let queued = self.queued.load(Ordering::Acquire);
        EngineLoad {
            active: in_flight.saturating_sub(queued),
            queued,
            kv_blocks_held: 0,
            healthy: self.jobs.lock().unwrap().is_some(),
            // accept_rate and expected_speedup are for speculative engines.
            ..EngineLoad::default()
        }
    }

    fn shutdown(&self) {
        for token in self.cancels.lock().unwrap().values() {
            token.cancel();
        }
        // Closing the queue ends the worker once its request stops.
        self.jobs.lock().unwrap().take();
    }
}

runtime::export_engine!("template", create);
