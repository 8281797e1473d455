//! Plugin entry point of the remote engine. It runs no model, so it links
//! no MLX: the served model's name and tokenizer come in the engine's
//! context.

fn create(ctx: engine_core::EngineContext) -> Result<Box<dyn engine_core::Engine>, String> {
    Ok(Box::new(remote::RemoteEngine::from_context(ctx)?))
}

engine_core::export_engine!("remote", create);
