//! `engine-reference`: a small, real engine plugin. It serves one request at
//! a time on its own thread over the host's shared model, each through the
//! runtime's `Sequence` from the shared prefix cache's longest hit: plain
//! greedy requests on a pipelined `runtime::generate::DecodeStream`,
//! everything else (sampling, penalties, logit bias, logprobs) through the
//! sequence's sampler and `Model::forward`. It reserves KV blocks in the
//! shared pool for prompt + max_tokens while a request runs and honours
//! cancellation.
//!
//! It is built outside the gateway's default engine set and loaded by path
//! (`plugins:` in config.yaml), which is what the end-to-end tests exercise.
//!
//! Options (its section of `engines:`):
//! ```yaml
//! engines:
//!   ref:
//!     kind: reference
//!     max_queue: 64        # waiting requests before submit answers Overloaded
//!     greedy_only: false   # declare plain greedy only (the gateway enforces it)
//!     tools: true          # declare requests with tools served
//!     fault: panic_in_worker  # inject a fault: panic_on_submit | panic_in_worker |
//!                          #   error_on_submit | error_in_stream |
//!                          #   overload_in_stream | invalid_in_stream
//!     fault_requests: 0    # inject it into this many first requests only (0: all)
//!     token_delay_ms: 0    # pause after each token (tests that need slow streams)
//! ```

mod engine;
mod options;
mod worker;

use engine_core::{Engine, EngineContext};

fn create(ctx: EngineContext) -> Result<Box<dyn Engine>, String> {
    let engine = engine::ReferenceEngine::start(ctx)?;
    Ok(Box::new(engine))
}

runtime::export_engine!("reference", create);
