//! `GET /v1/policy`: the routing policy in force (its `policy:` section, a
//! hash of it, when it loaded), how often each rule decided since, and the
//! last reload that was refused. Behind the API keys when they are set.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{json, Value};

use super::json_response;
use crate::state::SharedState;

#[utoipa::path(
    get,
    path = "/v1/policy",
    responses(
        (status = 200, description = "The routing policy in force", body = crate::api::openapi::PolicyStatus),
        (status = 401, description = "Missing or wrong API key", body = crate::api::openapi::ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn show(State(state): State<SharedState>) -> Response {
    let handle = state.router.policy();
    let active = handle.active();
    let rules: Vec<Value> = active
        .hits()
        .into_iter()
        .map(|h| json!({"name": h.rule, "route": h.route, "hits": h.hits}))
        .collect();
    let last_rejected = handle
        .last_rejected()
        .map(|r| json!({"at": unix(r.at), "error": r.error}));
    json_response(
        StatusCode::OK,
        &json!({
            "policy": serde_json::to_value(&active.section).unwrap_or(Value::Null),
            "hash": active.hash,
            "loaded_at": unix(active.loaded_at),
            "rules": rules,
            "last_rejected": last_rejected,
        }),
    )
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
