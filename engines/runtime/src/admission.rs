//! Checks every engine applies to a request before it touches the device,
//! so a bad request gets the same clear error, naming it, whichever engine
//! the router picked.

use std::sync::atomic::{AtomicUsize, Ordering};

use engine_core::{EngineError, GenerateRequest, Refusal};

use crate::kv_pool::{KvPool, PoolError, Reservation};
use crate::loader::LoadedModel;
use crate::shared::SharedModel;

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

/// Reserves KV for `tokens` of `req` at `bytes_per_token` now, for engines
/// that do not queue: a request that could never fit the pool is invalid;
/// a pool that is full right now is a refusal, so the router tries the
/// next engine.
pub fn reserve(
    pool: &KvPool,
    req: &GenerateRequest,
    tokens: usize,
    bytes_per_token: usize,
) -> Result<Reservation, EngineError> {
    pool.try_reserve(pool.blocks_for_bytes(tokens, bytes_per_token))
        .map_err(|e| pool_error(req, e))
}

/// [`check_request`], then the KV blocks `req` needs for its prompt and
/// `max_tokens` at the pool's own rate, for engines that queue a request
/// until they are free ([`KvPool::reserve_waiting`]); invalid when they
/// could never be.
pub fn check_queued(req: &GenerateRequest, shared: &SharedModel) -> Result<usize, EngineError> {
    check_request(req, &shared.model)?;
    let pool = &shared.kv_pool;
    let blocks = pool.blocks_for(req.prompt.len() + req.max_tokens as usize);
    pool.check_fits(blocks).map_err(|e| pool_error(req, e))?;
    Ok(blocks)
}

fn pool_error(req: &GenerateRequest, e: PoolError) -> EngineError {
    match e {
        PoolError::NeverFits { .. } => EngineError::Invalid(format!("{}: {e}", req.id)),
        PoolError::Exhausted => Refusal::Busy.into(),
    }
}

/// Counts one more in `count` unless it is at `cap` already, in one atomic
/// step: concurrent submits cannot both pass the check and overshoot.
pub fn take_slot(count: &AtomicUsize, cap: usize) -> bool {
    count
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < cap).then_some(n + 1)
        })
        .is_ok()
}
