//! `GET /v1/models` and `GET /v1/models/{id}`: the one served model.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{json, Value};

use super::{json_response, ApiError};
use crate::state::SharedState;

fn model_object(state: &SharedState) -> Value {
    json!({
        "id": state.model.name,
        "object": "model",
        "created": state.model.created,
        "owned_by": "gateway",
        "context_window": state.model.context_window,
    })
}

#[utoipa::path(
    get,
    path = "/v1/models",
    responses(
        (status = 200, description = "The served model", body = crate::api::openapi::ModelList),
        (status = 401, description = "Missing or wrong API key", body = crate::api::openapi::ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn list(State(state): State<SharedState>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({ "object": "list", "data": [model_object(&state)] }),
    )
}

#[utoipa::path(
    get,
    path = "/v1/models/{id}",
    params(("id" = String, Path, description = "The model's name")),
    responses(
        (status = 200, description = "The model", body = crate::api::openapi::Model),
        (status = 401, description = "Missing or wrong API key", body = crate::api::openapi::ErrorBody),
        (status = 404, description = "Unknown model", body = crate::api::openapi::ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn get(
    State(state): State<SharedState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if id != state.model.name {
        return Err(ApiError::ModelNotFound(id));
    }
    Ok(json_response(StatusCode::OK, &model_object(&state)))
}
