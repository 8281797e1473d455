//! Plugin entry point of the remote engine. The runtime crate is linked
//! only to read the served model's name and tokenizer from the host.

fn create(ctx: engine_core::EngineContext) -> Result<Box<dyn engine_core::Engine>, String> {
    let shared = runtime::SharedModel::from_context(&ctx)?;
    let model = remote::ModelFacts {
        name: shared.model.name.clone(),
        tokenizer: shared.model.tokenizer.clone(),
    };
    Ok(Box::new(remote::RemoteEngine::from_context(ctx, model)?))
}

engine_core::export_engine!("remote", create);
