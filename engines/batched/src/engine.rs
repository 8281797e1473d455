//! The `Engine` face of the scheduler: its thread is a supervised
//! `runtime::worker::Worker` (a scheduler that panics is replaced over the
//! same channel), which is also the handover sink that adopts the fast
//! path's sequences.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use engine_core::{
    Capabilities, Engine, EngineContext, EngineError, EngineLoad, EventSender, GenerateRequest,
    RequestId,
};
use runtime::worker::Worker;
use runtime::SharedModel;

use crate::config::BatchedConfig;
use crate::device::Mlx;
use crate::queue::Waiting;
use crate::scheduler::{Job, Scheduler, Stats};

pub struct BatchedEngine {
    name: String,
    shared: Arc<SharedModel>,
    cfg: BatchedConfig,
    stats: Arc<Stats>,
    worker: Worker<Job>,
}

impl BatchedEngine {
    pub fn from_context(ctx: EngineContext) -> Result<Self, String> {
        let shared = SharedModel::from_context(&ctx)?;
        let cfg = BatchedConfig::from_yaml(&ctx.config)?;
        Ok(Self::new(ctx.name, shared, cfg))
    }

    pub fn new(name: String, shared: Arc<SharedModel>, cfg: BatchedConfig) -> Self {
        let stats = Arc::new(Stats::default());
        let limits = cfg.limits(
            shared.kv_pool.step_tokens(),
            shared.model.model.is_hybrid(),
            !runtime::compute::on_cpu(),
        );
        let pipeline = cfg.pipeline;
        let paged = shared.pages().is_some();
        let worker = Worker::supervised(
            &name,
            {
                let (shared, stats) = (shared.clone(), stats.clone());
                move |jobs, cancels| {
                    let device = Mlx(shared.clone());
                    Scheduler::new(device, limits, pipeline, jobs, cancels, stats.clone()).run()
                }
            },
            {
                let stats = stats.clone();
                move || stats.reset()
            },
        )
        .expect("spawn the batched engine's worker")
        // A scheduler waiting for KV blocks looks again at each job and
        // cancellation (`Scheduler::wait_while_stalled`).
        .waking({
            let pool = shared.kv_pool.clone();
            move || pool.wake()
        });
        shared.set_handover_sink(worker.handover_sink({
            let stats = stats.clone();
            move || stats.busy()
        }));
        tracing::info!(engine = %name, max_batch = limits.max_batch, prefill_chunk = limits.prefill.chunk, group_tokens = limits.prefill.group_tokens, width_multiple = limits.prefill.width_multiple, pipeline, paged, "batched engine ready");
        Self {
            name,
            shared,
            cfg,
            stats,
            worker,
        }
    }
}

impl Engine for BatchedEngine {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            greedy_only: false,
            tools: true,
            images: true,
            grammar: true,
            logprobs: true,
            exclusive: false,
        }
    }

    fn submit_to(&self, request: GenerateRequest, events: EventSender) -> Result<(), EngineError> {
        let blocks = runtime::admission::check_queued(&request, &self.shared)?;
        if !runtime::admission::take_slot(&self.stats.queued, self.cfg.max_queue) {
            return Err(EngineError::Overloaded(
                "the request queue is full; retry shortly".into(),
            ));
        }
        let waiting = Waiting {
            request,
            blocks,
            events,
            cancel_handle: None,
        };
        self.worker
            .send(Job::Submit(Box::new(waiting)))
            .inspect_err(|_| self.stats.dequeued())
    }

    fn cancel(&self, id: RequestId) {
        self.worker.cancel(id);
    }

    fn load(&self) -> EngineLoad {
        EngineLoad {
            active: self.stats.active.load(Ordering::Acquire),
            queued: self.stats.queued.load(Ordering::Acquire),
            kv_blocks_held: self.stats.kv_blocks.load(Ordering::Acquire),
            healthy: self.worker.is_alive(),
            accept_rate: None,
            expected_speedup: None,
        }
    }

    /// Cancels what it holds and waits for the scheduler to end.
    fn shutdown(&self) {
        self.worker.shutdown();
    }
}
