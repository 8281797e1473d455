//! The request body as a JSON object, read under the configured size limit.

use axum::extract::{FromRequest, Request};

use serde_json::Value;

use crate::protocol::body;
use crate::protocol::ApiError;
use crate::state::SharedState;

/// Extracts the body; too large is 413, anything but a JSON object is 400.
/// The endpoint's request type reads it.
pub struct RawJson(pub Value);

impl FromRequest<SharedState> for RawJson {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &SharedState) -> Result<Self, Self::Rejection> {
        let limit = state.config.server.body_limit_bytes;
        // Reading fails only past the limit or when the client breaks off,
        // in which case nobody reads the answer.
        let bytes = axum::body::to_bytes(req.into_body(), limit)
            .await
            .map_err(|_| ApiError::PayloadTooLarge { limit })?;
        body::object(&bytes).map(RawJson)
    }
}

/// The prefix-cache scope of the caller (set by the auth layer), so cached
/// prompts are only reused between requests of the same API key.
#[derive(Debug, Clone)]
pub struct CacheScope(pub String);
