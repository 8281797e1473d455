//! `GET /v1/policy`: the routing policy in force (its `policy:` section, a
//! hash of it, when it loaded), how often each rule decided since, and the
//! last reload that was refused. Behind the API keys when they are set.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::json_response;
use crate::state::SharedState;

/// `GET /v1/policy`: the routing policy in force.
#[derive(Serialize, ToSchema)]
pub struct PolicyStatus {
    /// The config's `policy:` section as loaded.
    #[schema(value_type = Object)]
    pub policy: Value,
    /// 16 hex digits; the same for the same section.
    pub hash: String,
    /// When it was loaded (Unix seconds).
    pub loaded_at: u64,
    /// Each rule in order, then `default`, with its decisions since then.
    pub rules: Vec<PolicyRule>,
    /// The last reload refused since then (the policy stayed), or null.
    pub last_rejected: Option<PolicyRejection>,
}

#[derive(Serialize, ToSchema)]
pub struct PolicyRule {
    pub name: String,
    pub route: String,
    pub hits: u64,
}

#[derive(Serialize, ToSchema)]
pub struct PolicyRejection {
    /// Unix seconds.
    pub at: u64,
    pub error: String,
}

#[utoipa::path(
    get,
    path = "/v1/policy",
    responses(
        (status = 200, description = "The routing policy in force", body = PolicyStatus),
        (status = 401, description = "Missing or wrong API key", body = crate::protocol::error::ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn show(State(state): State<SharedState>) -> Response {
    let handle = state.router.policy();
    let active = handle.active();
    let status = PolicyStatus {
        policy: serde_json::to_value(&active.section).unwrap_or(Value::Null),
        hash: active.hash.clone(),
        loaded_at: unix(active.loaded_at),
        rules: active
            .hits()
            .into_iter()
            .map(|h| PolicyRule {
                name: h.rule,
                route: h.route,
                hits: h.hits,
            })
            .collect(),
        last_rejected: handle.last_rejected().map(|r| PolicyRejection {
            at: unix(r.at),
            error: r.error,
        }),
    };
    json_response(
        StatusCode::OK,
        &serde_json::to_value(status).unwrap_or_default(),
    )
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
