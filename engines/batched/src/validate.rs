//! Checks a request against the model before anything touches the device:
//! a bad request gets a clear error naming it, never a panic or a
//! half-admitted sequence.

use engine_core::{EngineError, GenerateRequest};
use runtime::SharedModel;

pub fn check(req: &GenerateRequest, shared: &SharedModel) -> Result<usize, EngineError> {
    runtime::admission::check_request(req, &shared.model)?;
    runtime::admission::blocks_that_fit(
        &shared.kv_pool,
        req,
        req.prompt.len() + req.max_tokens as usize,
    )
}
