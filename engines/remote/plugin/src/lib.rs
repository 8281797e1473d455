//! Plugin entry point of the remote engine. The runtime crate is linked
//! only to read the served model's name and tokenizer source from the host.

fn create(ctx: engine_core::EngineContext) -> Result<Box<dyn engine_core::Engine>, String> {
    let shared = runtime::SharedModel::from_context(&ctx)?;
    // Our own tokenizer, loaded from the same files: the host's encodes
    // through its copy of the regex library (onig), whose encoding tables
    // are per-copy globals that this plugin's copy does not recognise.
    let tokenizer = shared
        .model
        .tokenizer_source
        .load()
        .map_err(|e| format!("remote engine: cannot load the model's tokenizer: {e}"))?;
    let model = remote::ModelFacts {
        name: shared.model.name.clone(),
        tokenizer: std::sync::Arc::new(tokenizer),
    };
    Ok(Box::new(remote::RemoteEngine::from_context(ctx, model)?))
}

runtime::export_engine!("remote", create);
