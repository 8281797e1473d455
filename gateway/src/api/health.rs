//! `GET /health`: ready (200) only when every configured engine loaded and
//! reports healthy and the server is not draining; otherwise 503. The body
//! lists every engine (with its fault, if any), plugins that were refused,
//! the shared KV pool's figures, and memory: what MLX holds now and at its
//! peak, what the device has free now, and how a `memory:` budget was
//! divided.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{json, Value};

use super::json_response;
use crate::state::SharedState;

#[utoipa::path(
    get,
    path = "/health",
    responses(
        (status = 200, description = "Every engine is ready"),
        (status = 503, description = "Degraded (an engine failed or is out of service) or draining"),
    )
)]
pub async fn health(State(state): State<SharedState>) -> Response {
    let registry = &state.registry;
    let mut engines: Vec<Value> = Vec::new();
    let mut all_ready = true;
    for entry in registry.engines() {
        let load = entry.load();
        all_ready &= load.healthy;
        let mut engine = json!({
            "name": entry.name,
            "kind": entry.kind,
            "status": if load.healthy { "ready" } else { "unhealthy" },
            "active": load.active,
            "queued": load.queued,
            "kv_blocks_held": load.kv_blocks_held,
        });
        if let Some(fault) = entry.active_fault() {
            engine["fault"] = json!({ "kind": fault.kind.label(), "reason": fault.reason });
        }
        engines.push(engine);
    }
    for failed in &registry.failed {
        all_ready = false;
        engines.push(json!({
            "name": failed.name,
            "kind": failed.kind,
            "status": "failed",
            "error": failed.error,
        }));
    }
    let refused: Vec<Value> = registry
        .refused_plugins
        .iter()
        .map(|p| json!({ "path": p.path, "error": p.error }))
        .collect();
    let pool = &registry.shared.kv_pool;
    let draining = state.is_draining();
    all_ready &= !draining;
    let status = match (draining, all_ready) {
        (true, _) => "draining",
        (false, true) => "ok",
        (false, false) => "degraded",
    };
    let body = json!({
        "status": status,
        "model": state.model.name,
        "engines": engines,
        "refused_plugins": refused,
        "kv_pool": {
            "total_blocks": pool.total(),
            "allocated_blocks": pool.allocated(),
            "prefix_cache_blocks": pool.cached(),
            "block_size": pool.block_size(),
            "bytes_per_block": pool.bytes_per_block(),
            "pressure": pool.pressure(),
            // The blocks themselves when the KV is paged: what sequences
            // and prefix-cache entries hold of the preallocated pool.
            "paged": registry.shared.pages().map(|p| json!({
                "blocks": p.usable(),
                "blocks_held": p.usable() - p.free_blocks(),
                "bytes": p.nbytes(),
            })),
        },
        "memory": {
            "mlx": runtime::memory::mlx_memory(),
            "budget": registry.memory,
            "device_free": runtime::memory::device_free(),
        },
    });
    let status = if all_ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(status, &body)
}
