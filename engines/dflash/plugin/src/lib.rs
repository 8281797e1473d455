//! Plugin entry point of the dflash engine.

fn create(ctx: engine_core::EngineContext) -> Result<Box<dyn engine_core::Engine>, String> {
    Ok(Box::new(dflash::engine_from_context(ctx)?))
}

runtime::export_engine!("dflash", create);
