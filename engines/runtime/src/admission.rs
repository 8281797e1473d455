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
    check_images(req, model)?;
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

/// Image embeddings must fit the prompt and the model: inside the prompt,
/// one row of the text model's width per soft token, not overlapping.
fn check_images(req: &GenerateRequest, model: &LoadedModel) -> Result<(), EngineError> {
    let id = req.id;
    if req.images.is_empty() {
        return Ok(());
    }
    if model.vision.is_none() {
        return Err(EngineError::Invalid(format!(
            "{id}: the model does not read images"
        )));
    }
    let width = model.model.config.hidden_size as u32;
    let mut end = 0;
    for (i, im) in req.images.iter().enumerate() {
        let fits = im.start >= end
            && im.end() as usize <= req.prompt.len()
            && im.width == width
            && im.embeddings.len() == im.tokens as usize * width as usize;
        if !fits {
            return Err(EngineError::Invalid(format!(
                "{id}: image {i} does not fit the prompt or the model (start {}, {} tokens of width {})",
                im.start, im.tokens, im.width
            )));
        }
        end = im.end();
    }
    Ok(())
}
