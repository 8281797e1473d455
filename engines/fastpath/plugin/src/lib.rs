//! Plugin entry point of the fastpath engine.

fn create(ctx: engine_core::EngineContext) -> Result<Box<dyn engine_core::Engine>, String> {
    Ok(Box::new(fastpath::FastpathEngine::from_context(ctx)?))
}

runtime::export_engine!("fastpath", create);
