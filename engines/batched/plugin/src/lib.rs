//! Plugin entry point of the batched engine.

fn create(ctx: engine_core::EngineContext) -> Result<Box<dyn engine_core::Engine>, String> {
    Ok(Box::new(batched::BatchedEngine::from_context(ctx)?))
}

runtime::export_engine!("batched", create);
