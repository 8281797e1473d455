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

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

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

// The results' envelopes, as documented; the handlers build them as JSON
// chunk by chunk (`api::chat::response`, `api::responses`).

/// A response: `output` items (`reasoning`, `message`, `function_call`);
/// streamed, `response.*` events ending with `response.completed`.
#[derive(Serialize, ToSchema)]
pub struct ResponseObject {
    pub id: String,
    /// "response"
    pub object: String,
    pub created_at: u64,
    /// "completed" or "incomplete".
    pub status: String,
    pub model: String,
    #[schema(value_type = Vec<Object>)]
    pub output: Value,
    #[schema(value_type = Object)]
    pub usage: Value,
}

/// A completion: chat (`object` "chat.completion", streamed as
/// "chat.completion.chunk" events) or text ("text_completion").
#[derive(Serialize, ToSchema)]
pub struct Completion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    #[schema(value_type = Vec<Object>)]
    pub choices: Value,
    #[schema(value_type = Object)]
    pub usage: Value,
}
