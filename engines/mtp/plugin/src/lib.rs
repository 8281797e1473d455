//! Plugin entry point of the mtp engine.

fn create(ctx: engine_core::EngineContext) -> Result<Box<dyn engine_core::Engine>, String> {
    Ok(Box::new(mtp::engine_from_context(ctx)?))
}

runtime::export_engine!("mtp", create);
