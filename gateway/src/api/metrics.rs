//! `GET /metrics`: Prometheus text. Engine and KV pool gauges are sampled
//! at scrape time, so they are always current.

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::Response;

use crate::state::SharedState;
use crate::telemetry::metric;

#[utoipa::path(
    get,
    path = "/metrics",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain"))
)]
pub async fn render(State(state): State<SharedState>) -> Response {
    let registry = &state.registry;
    for entry in registry.engines() {
        let load = entry.load();
        let name = entry.name.clone();
        metrics::gauge!(metric::ENGINE_HEALTHY, "engine" => name.clone()).set(if load.healthy {
            1.0
        } else {
            0.0
        });
        metrics::gauge!(metric::ENGINE_ACTIVE, "engine" => name.clone()).set(load.active as f64);
        metrics::gauge!(metric::ENGINE_QUEUED, "engine" => name.clone()).set(load.queued as f64);
        metrics::gauge!(metric::ENGINE_KV_BLOCKS, "engine" => name.clone())
            .set(load.kv_blocks_held as f64);
        if let Some(rate) = load.accept_rate {
            metrics::gauge!(metric::ENGINE_ACCEPT_RATE, "engine" => name.clone()).set(rate as f64);
        }
        if let Some(speedup) = load.expected_speedup {
            metrics::gauge!(metric::ENGINE_SPEEDUP, "engine" => name).set(speedup as f64);
        }
    }
    for failed in &registry.failed {
        metrics::gauge!(metric::ENGINE_HEALTHY, "engine" => failed.name.clone()).set(0.0);
    }
    metrics::gauge!(metric::ENGINES_FAILED).set(registry.failed.len() as f64);
    let pool = &registry.shared.kv_pool;
    metrics::gauge!(metric::KV_BLOCKS_TOTAL).set(pool.total() as f64);
    metrics::gauge!(metric::KV_BLOCKS_ALLOCATED).set(pool.allocated() as f64);
    metrics::gauge!(metric::KV_BLOCKS_CACHED).set(pool.cached() as f64);
    metrics::gauge!(metric::KV_PRESSURE).set(pool.pressure());
    if let Some(pages) = registry.shared.pages() {
        metrics::gauge!(metric::KV_PAGED_BLOCKS_HELD)
            .set((pages.usable() - pages.free_blocks()) as f64);
    }
    let mlx = runtime::memory::mlx_memory();
    for (kind, bytes) in [
        ("active", mlx.active),
        ("cache", mlx.cache),
        ("peak", mlx.peak),
    ] {
        metrics::gauge!(metric::MEMORY_BYTES, "kind" => kind).set(bytes as f64);
    }
    if let Some(plan) = &registry.memory {
        for (part, bytes) in [
            ("budget", plan.budget),
            ("weights", plan.weights),
            ("activations", plan.activations),
            ("kv_pool", plan.kv_pool),
        ] {
            metrics::gauge!(metric::MEMORY_BUDGET_BYTES, "part" => part).set(bytes as f64);
        }
    }
    let mut response = Response::new(Body::from(state.metrics.render()));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}
