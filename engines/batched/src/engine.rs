//! The `Engine` face of the scheduler thread.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use engine_core::{
    Capabilities, Engine, EngineContext, EngineError, EngineLoad, EventSender, GenerateRequest,
    RequestId,
};
use parking_lot::Mutex;
use runtime::handover::{Handover, HandoverSink};
use runtime::SharedModel;

use crate::config::BatchedConfig;
use crate::device::Mlx;
use crate::queue::Waiting;
use crate::scheduler::{Msg, Scheduler, Stats};
use crate::validate;

pub struct BatchedEngine {
    name: String,
    shared: Arc<SharedModel>,
    cfg: BatchedConfig,
    tx: Sender<Msg>,
    stats: Arc<Stats>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Sink(Sender<Msg>, Arc<Stats>);

impl HandoverSink for Sink {
    fn adopt(&self, handover: Handover) -> Result<(), Box<Handover>> {
        self.0
            .send(Msg::Adopt(Box::new(handover)))
            .map_err(|e| match e.0 {
                Msg::Adopt(h) => h,
                _ => unreachable!("sent an Adopt"),
            })
    }

    fn busy(&self) -> bool {
        self.1.queued.load(Ordering::Acquire) > 0 || self.1.active.load(Ordering::Acquire) > 0
    }
}

impl BatchedEngine {
    pub fn from_context(ctx: EngineContext) -> Result<Self, String> {
        let shared = SharedModel::from_context(&ctx)?;
        let cfg = BatchedConfig::from_yaml(&ctx.config)?;
        Ok(Self::new(ctx.name, shared, cfg))
    }

    pub fn new(name: String, shared: Arc<SharedModel>, cfg: BatchedConfig) -> Self {
        let (tx, rx) = crossbeam_channel::unbounded();
        let stats = Arc::new(Stats::default());
        let limits = cfg.limits(
            shared.kv_pool.step_tokens(),
            shared.model.model.is_hybrid(),
            !runtime::compute::on_cpu(),
        );
        let pipeline = cfg.pipeline;
        let paged = shared.pages().is_some();
        let thread = std::thread::Builder::new()
            .name(format!("{name}-scheduler"))
            .spawn({
                let (shared, stats) = (shared.clone(), stats.clone());
                move || Scheduler::supervise(Mlx(shared), limits, pipeline, rx, stats)
            })
            .expect("spawn the scheduler thread");
        shared.set_handover_sink(Arc::new(Sink(tx.clone(), stats.clone())));
        tracing::info!(engine = %name, max_batch = limits.max_batch, prefill_chunk = limits.prefill.chunk, group_tokens = limits.prefill.group_tokens, width_multiple = limits.prefill.width_multiple, pipeline, paged, "batched engine ready");
        Self {
            name,
            shared,
            cfg,
            tx,
            stats,
            thread: Mutex::new(Some(thread)),
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
        let blocks = validate::check(&request, &self.shared)?;
        if self.thread.lock().is_none() {
            return Err(EngineError::ShuttingDown);
        }
        if !runtime::admission::take_slot(&self.stats.queued, self.cfg.max_queue) {
            return Err(EngineError::Overloaded(
                "the request queue is full; retry shortly".into(),
            ));
        }
        self.tx
            .send(Msg::Submit(Box::new(Waiting {
                request,
                blocks,
                events,
            })))
            .map_err(|_| {
                self.stats.dequeued();
                EngineError::ShuttingDown
            })?;
        Ok(())
    }

    fn cancel(&self, id: RequestId) {
        let _ = self.tx.send(Msg::Cancel(id));
    }

    fn load(&self) -> EngineLoad {
        EngineLoad {
            active: self.stats.active.load(Ordering::Acquire),
            queued: self.stats.queued.load(Ordering::Acquire),
            kv_blocks_held: self.stats.kv_blocks.load(Ordering::Acquire),
            healthy: self
                .thread
                .lock()
                .as_ref()
                .is_some_and(|t| !t.is_finished()),
            accept_rate: None,
            expected_speedup: None,
        }
    }

    fn shutdown(&self) {
        let Some(thread) = self.thread.lock().take() else {
            return;
        };
        let _ = self.tx.send(Msg::Shutdown);
        let _ = thread.join();
    }
}

impl Drop for BatchedEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
