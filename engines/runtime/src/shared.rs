//! What the host shares with every engine plugin through
//! `EngineContext::shared`: the one loaded model and the one KV pool.

use std::sync::Arc;

use engine_core::EngineContext;
use std::sync::RwLock;

use crate::handover::HandoverSink;

use crate::kv_pool::KvPool;
use crate::loader::LoadedModel;

pub struct SharedModel {
    pub model: LoadedModel,
    pub kv_pool: KvPool,
    /// The engine that adopts sequences other engines hand over (the
    /// batched engine registers itself here). std's lock, not parking_lot's:
    /// plugins share this object but not parking_lot's global tables.
    handover: RwLock<Option<Arc<dyn HandoverSink>>>,
}

impl SharedModel {
    pub fn new(model: LoadedModel, kv_pool: KvPool) -> Self {
        Self {
            model,
            kv_pool,
            handover: RwLock::new(None),
        }
    }

    pub fn set_handover_sink(&self, sink: Arc<dyn HandoverSink>) {
        *self.handover.write().unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }

    pub fn handover_sink(&self) -> Option<Arc<dyn HandoverSink>> {
        self.handover
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The shared model from an engine's context. Fails when the plugin was
    /// built against a different runtime crate than the host.
    pub fn from_context(ctx: &EngineContext) -> Result<Arc<SharedModel>, String> {
        ctx.shared
            .clone()
            .downcast::<SharedModel>()
            .map_err(|_| "the host's shared model is not this plugin's runtime::SharedModel (built from another runtime crate?)".to_string())
    }
}
