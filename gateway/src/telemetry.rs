//! Logs (tracing, `RUST_LOG`) and metrics (Prometheus text): installed once
//! by the host; plugins forward their log records to it.

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Metric names, in one place so handlers, layers and tests agree.
pub mod metric {
    pub const HTTP_REQUESTS: &str = "gateway_http_requests_total";
    pub const REQUESTS: &str = "gateway_requests_total";
    pub const REQUEST_DURATION: &str = "gateway_request_duration_seconds";
    pub const ERRORS: &str = "gateway_errors_total";
    pub const ROUTES: &str = "gateway_routes_total";
    pub const ROUTE_FALLBACKS: &str = "gateway_route_fallbacks_total";
    pub const GENERATIONS: &str = "gateway_generations_total";
    pub const PROMPT_TOKENS: &str = "gateway_prompt_tokens_total";
    pub const COMPLETION_TOKENS: &str = "gateway_completion_tokens_total";
    pub const TTFT: &str = "gateway_time_to_first_token_seconds";
    pub const GENERATION_DURATION: &str = "gateway_generation_duration_seconds";
    pub const ENGINE_HEALTHY: &str = "gateway_engine_healthy";
    pub const ENGINE_ACTIVE: &str = "gateway_engine_active";
    pub const ENGINE_QUEUED: &str = "gateway_engine_queued";
    pub const ENGINE_KV_BLOCKS: &str = "gateway_engine_kv_blocks";
    pub const ENGINES_FAILED: &str = "gateway_engines_failed";
    pub const ENGINE_FAULTS: &str = "gateway_engine_faults_total";
    pub const KV_BLOCKS_TOTAL: &str = "gateway_kv_blocks_total";
    pub const KV_BLOCKS_ALLOCATED: &str = "gateway_kv_blocks_allocated";
    pub const KV_BLOCKS_CACHED: &str = "gateway_kv_blocks_cached";
    pub const KV_PRESSURE: &str = "gateway_kv_pressure";
    pub const KV_PAGED_BLOCKS_HELD: &str = "gateway_kv_paged_blocks_held";
    pub const MEMORY_BYTES: &str = "gateway_memory_bytes";
    pub const MEMORY_BUDGET_BYTES: &str = "gateway_memory_budget_bytes";
    pub const SPEC_DRAFTED: &str = "gateway_spec_drafted_tokens_total";
    pub const SPEC_ACCEPTED: &str = "gateway_spec_accepted_tokens_total";
    pub const SPEC_TARGET_FORWARDS: &str = "gateway_spec_target_forwards_total";
    pub const ENGINE_ACCEPT_RATE: &str = "gateway_engine_accept_rate";
    pub const ENGINE_SPEEDUP: &str = "gateway_engine_speedup";
    pub const VISION_CACHE_HITS: &str = "gateway_vision_cache_hits_total";
    pub const VISION_CACHE_MISSES: &str = "gateway_vision_cache_misses_total";
    pub const VISION_CACHE_IMAGES: &str = "gateway_vision_cache_images";
}

/// Logs go to stderr (stdout carries only the "listening" line), filtered
/// by `RUST_LOG`, else at `default` (`info` when serving). Plugins forward
/// their records here (`engine_core::plugin`'s log callback, target
/// `plugin`).
pub fn init_tracing(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let subscriber = tracing_subscriber::registry().with(filter).with(
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
    );
    // A second init (unit tests) keeps the first subscriber.
    let _ = subscriber.try_init();
}

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Installs the process-wide Prometheus recorder and describes the metrics.
pub fn init_metrics() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)?
        .install_recorder()?;
    describe();
    // Histograms keep a rolling window that needs periodic upkeep.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

fn describe() {
    use metric::*;
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(HTTP_REQUESTS, "HTTP responses by route and status code");
    describe_counter!(
        REQUESTS,
        "Completion requests by serving engine, route rule and HTTP status"
    );
    describe_histogram!(
        REQUEST_DURATION,
        Unit::Seconds,
        "Time to response headers of completion requests"
    );
    describe_counter!(ERRORS, "API errors by kind");
    describe_counter!(
        ROUTES,
        "Routing decisions by engine and the rule that matched"
    );
    describe_counter!(
        ROUTE_FALLBACKS,
        "Requests an engine refused and the router passed on"
    );
    describe_counter!(
        GENERATIONS,
        "Finished generations by engine, rule and finish reason"
    );
    describe_counter!(PROMPT_TOKENS, "Prompt tokens by engine");
    describe_counter!(COMPLETION_TOKENS, "Generated tokens by engine");
    describe_histogram!(
        TTFT,
        Unit::Seconds,
        "Time from routing to the first generated token"
    );
    describe_histogram!(
        GENERATION_DURATION,
        Unit::Seconds,
        "Time from routing to the end of generation"
    );
    describe_gauge!(
        ENGINE_HEALTHY,
        "1 when the engine reports healthy and has no active fault"
    );
    describe_gauge!(ENGINE_ACTIVE, "Requests running on the engine");
    describe_gauge!(ENGINE_QUEUED, "Requests waiting on the engine");
    describe_gauge!(ENGINE_KV_BLOCKS, "KV blocks the engine holds");
    describe_gauge!(
        ENGINE_SPEEDUP,
        "Speculative engine's recent speed over plain decoding (tokens per target forward x decode-step cost / round cost)"
    );
    describe_gauge!(ENGINES_FAILED, "Configured engines that failed to load");
    describe_counter!(
        ENGINE_FAULTS,
        "Engine faults (panic, lost stream, error) by engine and kind"
    );
    describe_gauge!(KV_BLOCKS_TOTAL, "Blocks in the shared KV pool");
    describe_gauge!(
        KV_BLOCKS_ALLOCATED,
        "Blocks reserved in the shared KV pool by sequences"
    );
    describe_gauge!(
        KV_BLOCKS_CACHED,
        "Blocks the prefix cache holds in the shared KV pool (given up when sequences need them)"
    );
    describe_gauge!(KV_PRESSURE, "Allocated over total KV blocks");
    describe_gauge!(
        KV_PAGED_BLOCKS_HELD,
        "Blocks of the paged KV pool that sequences and prefix-cache entries hold (model.kv_layout: paged)"
    );
    describe_gauge!(
        MEMORY_BYTES,
        "Device memory MLX holds: live arrays (active), freed buffers kept for reuse (cache), the peak of active"
    );
    describe_gauge!(
        MEMORY_BUDGET_BYTES,
        "How the memory budget was divided at startup: budget, weights, activations, kv_pool"
    );
    describe_counter!(
        VISION_CACHE_HITS,
        "Images whose features came from the vision feature cache"
    );
    describe_counter!(
        VISION_CACHE_MISSES,
        "Images that ran the vision tower (not in the feature cache)"
    );
    describe_gauge!(VISION_CACHE_IMAGES, "Images in the vision feature cache");
}
