//! `x-request-id`: the client's is kept (and echoed), otherwise one is made.

use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{HeaderName, HeaderValue, Request};
use tower_http::request_id::{MakeRequestId, RequestId};

pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// Ids like `req-5f3a9c1e-42`: a per-process random prefix and a counter,
/// unique without a UUID dependency.
#[derive(Clone)]
pub struct MakeId {
    prefix: u32,
    counter: std::sync::Arc<AtomicU64>,
}

impl Default for MakeId {
    fn default() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        Self {
            prefix: h.finish() as u32,
            counter: Default::default(),
        }
    }
}

impl MakeRequestId for MakeId {
    fn make_request_id<B>(&mut self, _request: &Request<B>) -> Option<RequestId> {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        HeaderValue::from_str(&format!("req-{:08x}-{n}", self.prefix))
            .ok()
            .map(RequestId::new)
    }
}
