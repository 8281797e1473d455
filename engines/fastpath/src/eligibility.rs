//! The fast path re-checks what the policy decided, and refuses with a
//! typed reason so the router falls back to the next engine.

use engine_core::{EngineError, GenerateRequest, Refusal};
use runtime::SharedModel;

pub fn check(req: &GenerateRequest, shared: &SharedModel) -> Result<(), EngineError> {
    if !req.is_plain_greedy() {
        return Err(Refusal::NotPlainGreedy.into());
    }
    if req.has_tools {
        return Err(Refusal::Tools.into());
    }
    runtime::admission::check_request(req, &shared.model)?;
    // Exclusive: nothing else may be running or waiting anywhere.
    let others = shared.handover_sink().is_some_and(|s| s.busy()) || shared.kv_pool.allocated() > 0;
    if others {
        return Err(Refusal::Busy.into());
    }
    Ok(())
}
