//! A deadline on each API request until its response starts. Dropping the
//! handler future on timeout drops its generation, which cancels it in the
//! engine.

use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::protocol::ApiError;

pub async fn limit(State(deadline): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(deadline, next.run(req)).await {
        Ok(response) => response,
        Err(_) => ApiError::Timeout(deadline).into_response(),
    }
}
