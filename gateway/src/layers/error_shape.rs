//! Errors produced below the handlers (no route, wrong method, a body over
//! the limit rejected by its length) come as plain text; clients of an
//! OpenAI API expect `{"error": {...}}`. This rewrites them.

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::protocol::ApiError;

pub async fn openai_errors(State(body_limit): State<usize>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_owned();
    let response = next.run(req).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let error = match status {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge { limit: body_limit },
        StatusCode::NOT_FOUND => ApiError::NotFound(path),
        StatusCode::METHOD_NOT_ALLOWED => ApiError::MethodNotAllowed,
        StatusCode::UNSUPPORTED_MEDIA_TYPE | StatusCode::BAD_REQUEST => {
            ApiError::invalid_no_param(format!("The request was rejected ({status})"))
        }
        other => ApiError::Internal(format!("HTTP {other}")),
    };
    let (parts, _) = response.into_parts();
    let mut shaped = error.into_response();
    *shaped.status_mut() = status;
    // Keep headers such as `Allow` on a 405.
    for (name, value) in parts.headers.iter() {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            shaped.headers_mut().insert(name.clone(), value.clone());
        }
    }
    shaped
}
