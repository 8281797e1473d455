//! The `Engine` face of the fast path: one slot, one worker thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use engine_core::{
    Capabilities, Engine, EngineContext, EngineError, EngineLoad, EventSender, GenerateRequest,
    Refusal, RequestId,
};
use runtime::worker::Worker;
use runtime::SharedModel;

use crate::worker::{self, Job, Outcome, Slot};

pub struct FastpathEngine {
    name: String,
    shared: Arc<SharedModel>,
    /// Set while a request holds the slot (from submit until its loop
    /// ends, before its final event).
    busy: Arc<AtomicBool>,
    handovers: Arc<AtomicU64>,
    worker: Worker<Job>,
}

impl FastpathEngine {
    pub fn from_context(ctx: EngineContext) -> Result<Self, String> {
        let shared = SharedModel::from_context(&ctx)?;
        Ok(Self::new(ctx.name, shared))
    }

    pub fn new(name: String, shared: Arc<SharedModel>) -> Self {
        let handovers = Arc::new(AtomicU64::new(0));
        let worker = Worker::<Job>::spawn(&name, {
            let (shared, handovers) = (shared.clone(), handovers.clone());
            move |jobs, cancels| {
                for job in jobs {
                    let id = job.request.id;
                    match worker::run(&shared, job) {
                        Outcome::Finished(reason) => tracing::debug!(request = %id, ?reason, "fast path request finished"),
                        Outcome::HandedOver => {
                            handovers.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(request = %id, "fast path handed its sequence to the batched engine")
                        }
                        Outcome::Failed => {}
                    }
                    cancels.remove(id);
                }
            }
        })
        .expect("spawn the fast path worker");
        tracing::info!(engine = %name, "fast path engine ready");
        Self {
            name,
            shared,
            busy: Arc::new(AtomicBool::new(false)),
            handovers,
            worker,
        }
    }

    /// Sequences handed to the batched engine so far.
    pub fn handovers(&self) -> u64 {
        self.handovers.load(Ordering::Relaxed)
    }
}

impl Engine for FastpathEngine {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            greedy_only: false,
            tools: false,
            images: false,
            grammar: true,
            logprobs: false,
            // It runs one request at the speed of the raw loop, holding the
            // device, and hands it to the batched engine when others arrive.
            exclusive: true,
        }
    }

    fn submit_to(&self, request: GenerateRequest, events: EventSender) -> Result<(), EngineError> {
        runtime::admission::check_request(&request, &self.shared.model)?;
        // The one slot. The router keeps others away while it is taken;
        // this stops what reaches the engine past the router (the host's
        // probe, a request whose client stopped it while its last step
        // runs) from queueing behind it.
        let slot = Slot::take(&self.busy).ok_or(Refusal::Busy)?;
        // Reserved at the byte rate of the model's cache (`model.kv_cache`).
        let reservation = runtime::admission::reserve(
            &self.shared.kv_pool,
            &request,
            request.prompt.len() + request.max_tokens as usize,
            self.shared.model.model.kv_bytes_per_token(),
        )?;
        self.worker.send(Job {
            request,
            reservation,
            events,
            slot,
        })
    }

    fn cancel(&self, id: RequestId) {
        self.worker.cancel(id);
    }

    fn load(&self) -> EngineLoad {
        EngineLoad {
            active: usize::from(self.busy.load(Ordering::Acquire)),
            queued: 0,
            kv_blocks_held: 0,
            healthy: self.worker.is_alive(),
            accept_rate: None,
            expected_speedup: None,
        }
    }

    /// Cancels the in-flight request and waits for its loop to end before
    /// returning, so no memory it uses is freed under it.
    fn shutdown(&self) {
        self.worker.shutdown();
    }
}
