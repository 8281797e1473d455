//! The `Engine` face of the fast path: one slot, one worker thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use engine_core::{
    CancelToken, Capabilities, Engine, EngineContext, EngineError, EngineLoad, EventSender,
    GenerateRequest, Refusal, RequestId,
};
use parking_lot::Mutex;
use runtime::SharedModel;

use crate::worker::{self, Job, Outcome};

pub struct FastpathEngine {
    name: String,
    shared: Arc<SharedModel>,
    /// Set while a request owns the slot (from submit until its loop ends).
    busy: Arc<AtomicBool>,
    handovers: Arc<AtomicU64>,
    /// The request that last took the slot. It may have ended already (the
    /// slot is freed before its final event), so cancellation matches ids.
    running: Mutex<Option<(RequestId, CancelToken)>>,
    tx: Mutex<Option<Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl FastpathEngine {
    pub fn from_context(ctx: EngineContext) -> Result<Self, String> {
        let shared = SharedModel::from_context(&ctx)?;
        Ok(Self::new(ctx.name, shared))
    }

    pub fn new(name: String, shared: Arc<SharedModel>) -> Self {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let busy = Arc::new(AtomicBool::new(false));
        let worker_shared = shared.clone();
        let worker_busy = busy.clone();
        let handovers = Arc::new(AtomicU64::new(0));
        let worker_handovers = handovers.clone();
        let thread = std::thread::Builder::new()
            .name(format!("{name}-worker"))
            .spawn(move || {
                for job in rx {
                    let id = job.request.id;
                    match worker::run(&worker_shared, job, &worker_busy) {
                        Outcome::Finished(reason) => tracing::debug!(request = %id, ?reason, "fast path request finished"),
                        Outcome::HandedOver => {
                            worker_handovers.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(request = %id, "fast path handed its sequence to the batched engine")
                        }
                        Outcome::Failed => {}
                    }
                }
            })
            .expect("spawn the fast path worker");
        tracing::info!(engine = %name, "fast path engine ready");
        Self {
            name,
            shared,
            busy,
            handovers,
            running: Mutex::new(None),
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
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
            greedy_only: true,
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
        let tx = self.tx.lock().clone().ok_or(EngineError::ShuttingDown)?;
        // The one slot. The router keeps others away while it is taken;
        // this stops what reaches the engine past the router (the host's
        // probe, a request whose client stopped it while its last step
        // runs) from queueing behind it.
        if self
            .busy
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(Refusal::Busy.into());
        }
        // Reserved at the byte rate of the model's cache (`model.kv_cache`).
        let reservation = runtime::admission::reserve(
            &self.shared.kv_pool,
            &request,
            request.prompt.len() + request.max_tokens as usize,
            self.shared.model.model.kv_bytes_per_token(),
        )
        .inspect_err(|_| self.busy.store(false, Ordering::Release))?;
        *self.running.lock() = Some((request.id, request.cancel.clone()));
        if tx
            .send(Job {
                request,
                reservation,
                events,
            })
            .is_err()
        {
            self.busy.store(false, Ordering::Release);
            return Err(EngineError::ShuttingDown);
        }
        Ok(())
    }

    fn cancel(&self, id: RequestId) {
        if let Some((running, c)) = self.running.lock().as_ref() {
            if *running == id {
                c.cancel();
            }
        }
    }

    fn load(&self) -> EngineLoad {
        let active = usize::from(self.busy.load(Ordering::Acquire));
        EngineLoad {
            active,
            queued: 0,
            kv_blocks_held: 0,
            healthy: self
                .thread
                .lock()
                .as_ref()
                .is_some_and(|t| !t.is_finished()),
            accept_rate: None,
            expected_speedup: None,
        }
    }

    /// Cancels the in-flight request and waits for its loop to end before
    /// returning, so no memory it uses is freed under it.
    fn shutdown(&self) {
        self.tx.lock().take();
        if let Some((_, c)) = self.running.lock().as_ref() {
            c.cancel();
        }
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for FastpathEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
