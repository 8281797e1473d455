//! Checks every engine applies to a request before it touches the device,
//! so a bad request gets the same clear error, naming it, whichever engine
//! the router picked.

use engine_core::{EngineError, GenerateRequest};

use crate::loader::LoadedModel;

pub fn check_request(req: &GenerateRequest, model: &LoadedModel) -> Result<(), EngineError> {
    let id = req.id;
    if req.prompt.is_empty() {
        return Err(EngineError::Invalid(format!("{id}: the prompt is empty")));
    }
    if req.max_tokens == 0 {
        return Err(EngineError::Invalid(format!(
            "{id}: max_tokens must be at least 1"
        )));
    }
    let vocab = model.vocab_size();
    if let Some(bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::Invalid(format!(
            "{id}: prompt token id {bad} is outside the vocabulary (size {vocab})"
        )));
    }
    if let Some(&(bad, _)) = req
        .sampling
        .logit_bias
        .iter()
        .find(|(t, _)| *t as usize >= vocab)
    {
        return Err(EngineError::Invalid(format!(
            "{id}: logit_bias token id {bad} is outside the vocabulary (size {vocab})"
        )));
    }
    let window = model.context_window();
    if req.prompt.len() + req.max_tokens as usize > window {
        return Err(EngineError::Invalid(format!(
            "{id}: prompt ({} tokens) + max_tokens ({}) exceeds the context window ({window})",
            req.prompt.len(),
            req.max_tokens
        )));
    }
    Ok(())
}
