//! The OpenAI-compatible API: one module per endpoint, each holding its own
//! response types, plus the pieces they share; the requests they read are
//! [`crate::protocol`]'s.

pub mod body;
pub mod chat;
pub mod choices;
pub mod completions;
pub mod health;
pub mod logprobs;
pub mod metrics;
pub mod models;
pub mod openapi;
pub mod policy;
pub mod responses;
pub mod sse;

use axum::http::HeaderValue;
use axum::response::Response;

pub use crate::protocol::{json_response, unix_now, ApiError};

/// A random id with the given prefix (`chatcmpl-`, `cmpl-`).
pub fn random_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // RandomState is seeded per process from the OS; mixing in a counter
    // makes every id distinct.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let a = h.finish();
    h.write_u64(a);
    format!("{prefix}{a:016x}{:08x}", h.finish() as u32)
}

/// Every completion response names the engine that served it and the
/// policy rule that sent it there.
pub fn with_route(mut response: Response, engine: &str, rule: &str) -> Response {
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(engine) {
        headers.insert(ENGINE_HEADER, v);
    }
    if let Ok(v) = HeaderValue::from_str(rule) {
        headers.insert(RULE_HEADER, v);
    }
    response
}

pub const ENGINE_HEADER: &str = "x-engine";
pub const RULE_HEADER: &str = "x-route-rule";
