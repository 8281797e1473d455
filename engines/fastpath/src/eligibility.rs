//! The fast path re-checks what the policy decided, and refuses with a
//! typed reason so the router falls back to the next engine.

use engine_core::{EngineError, GenerateRequest, Refusal};
use runtime::SharedModel;

pub fn check(req: &GenerateRequest, shared: &SharedModel) -> Result<(), EngineError> {
    let id = req.id;
    if !req.sampling.is_plain_greedy() || req.sampling.logprobs {
        return Err(Refusal::NotPlainGreedy.into());
    }
    if req.has_tools {
        return Err(Refusal::Tools.into());
    }
    if req.prompt.is_empty() {
        return Err(EngineError::Invalid(format!("{id}: the prompt is empty")));
    }
    if req.max_tokens == 0 {
        return Err(EngineError::Invalid(format!("{id}: max_tokens must be at least 1")));
    }
    let vocab = shared.model.vocab_size();
    if let Some(bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::Invalid(format!("{id}: prompt token id {bad} is outside the vocabulary (size {vocab})")));
    }
    let window = shared.model.context_window();
    if req.prompt.len() + req.max_tokens as usize > window {
        return Err(EngineError::Invalid(format!(
            "{id}: prompt ({} tokens) + max_tokens ({}) exceeds the context window ({window})",
            req.prompt.len(),
            req.max_tokens
        )));
    }
    // Exclusive: nothing else may be running or waiting anywhere.
    let others = shared.handover_sink().is_some_and(|s| s.busy()) || shared.kv_pool.allocated() > 0;
    if others {
        return Err(Refusal::Busy.into());
    }
    Ok(())
}
