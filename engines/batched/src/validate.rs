//! Checks a request against the model before anything touches the device:
//! a bad request gets a clear error naming it, never a panic or a
//! half-admitted sequence.

use engine_core::{EngineError, GenerateRequest};
use runtime::SharedModel;

pub fn check(req: &GenerateRequest, shared: &SharedModel) -> Result<usize, EngineError> {
    let id = req.id;
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
    if let Some(&(bad, _)) = req.sampling.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
        return Err(EngineError::Invalid(format!("{id}: logit_bias token id {bad} is outside the vocabulary (size {vocab})")));
    }
    let total = req.prompt.len() + req.max_tokens as usize;
    let window = shared.model.context_window();
    if total > window {
        return Err(EngineError::Invalid(format!(
            "{id}: prompt ({} tokens) + max_tokens ({}) exceeds the context window ({window})",
            req.prompt.len(),
            req.max_tokens
        )));
    }
    let blocks = shared.kv_pool.blocks_for(total);
    shared
        .kv_pool
        .check_fits(blocks)
        .map_err(|e| EngineError::Invalid(format!("{id}: {e}")))?;
    Ok(blocks)
}
