//! While the server drains before stopping, requests that would start new
//! work get 503 at once; those already running go on.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::protocol::ApiError;
use crate::state::SharedState;

pub async fn refuse_new_work(
    State(state): State<SharedState>,
    req: Request,
    next: Next,
) -> Response {
    if state.is_draining() {
        return ApiError::ShuttingDown.into_response();
    }
    next.run(req).await
}
