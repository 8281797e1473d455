//! What the host shares with every engine plugin through
//! `EngineContext::shared`: the one loaded model and the one KV pool.

use std::sync::Arc;

use engine_core::EngineContext;

use crate::kv_pool::KvPool;
use crate::loader::LoadedModel;

pub struct SharedModel {
    pub model: LoadedModel,
    pub kv_pool: KvPool,
}

impl SharedModel {
    /// The shared model from an engine's context. Fails when the plugin was
    /// built against a different runtime crate than the host.
    pub fn from_context(ctx: &EngineContext) -> Result<Arc<SharedModel>, String> {
        ctx.shared
            .clone()
            .downcast::<SharedModel>()
            .map_err(|_| "the host's shared model is not this plugin's runtime::SharedModel (built from another runtime crate?)".to_string())
    }
}
