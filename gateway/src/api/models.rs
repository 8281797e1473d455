//! `GET /v1/models` and `GET /v1/models/{id}`: the one served model.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Serialize;
use utoipa::ToSchema;

use super::{json_response, ApiError};
use crate::state::SharedState;

#[derive(Serialize, ToSchema)]
pub struct ModelList {
    /// "list"
    pub object: &'static str,
    pub data: Vec<Model>,
}

#[derive(Serialize, ToSchema)]
pub struct Model {
    pub id: String,
    /// "model"
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// Tokens of prompt and completion together.
    pub context_window: usize,
}

fn model(state: &SharedState) -> Model {
    Model {
        id: state.model.name.clone(),
        object: "model",
        created: state.model.created,
        owned_by: "gateway",
        context_window: state.model.context_window,
    }
}

fn json(value: impl Serialize) -> Response {
    json_response(
        StatusCode::OK,
        &serde_json::to_value(value).unwrap_or_default(),
    )
}

#[utoipa::path(
    get,
    path = "/v1/models",
    responses(
        (status = 200, description = "The served model", body = ModelList),
        (status = 401, description = "Missing or wrong API key", body = crate::protocol::error::ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn list(State(state): State<SharedState>) -> Response {
    json(ModelList {
        object: "list",
        data: vec![model(&state)],
    })
}

#[utoipa::path(
    get,
    path = "/v1/models/{id}",
    params(("id" = String, Path, description = "The model's name")),
    responses(
        (status = 200, description = "The model", body = Model),
        (status = 401, description = "Missing or wrong API key", body = crate::protocol::error::ErrorBody),
        (status = 404, description = "Unknown model", body = crate::protocol::error::ErrorBody),
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
    Ok(json(model(&state)))
}
