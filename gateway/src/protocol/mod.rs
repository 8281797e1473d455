//! The wire protocol: the OpenAI-style requests as the gateway reads them,
//! and its errors. Below the handlers (`crate::api`): the request
//! preparation, the generation and the shared state import these, never a
//! handler module.

pub mod body;
pub mod chat;
pub mod completions;
pub mod error;
pub mod options;
pub mod responses;
pub mod structured;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;

pub use error::ApiError;

/// Seconds since the Unix epoch, for `created` fields.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
