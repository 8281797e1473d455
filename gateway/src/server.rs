//! Startup (config, model, engines, policy), the router with its layers,
//! and serving until a shutdown signal.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::Request;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use policies::PolicyHandle;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

use crate::api::{
    chat, completions, health, metrics, models, openapi, policy, responses, ApiError,
};
use crate::cli::ServeArgs;
use crate::config::{Config, Overrides};
use crate::host::Registry;
use crate::layers::{auth, concurrency, draining, error_shape, http_metrics, request_id, timeout};
use crate::router::Router;
use crate::state::{AppState, SharedState};
use crate::telemetry;

/// Every route, each also without the `/v1` prefix.
pub fn app(state: SharedState) -> axum::Router {
    let server = &state.config.server;
    let limiter = Arc::new(concurrency::Limiter::new(
        server.max_concurrent,
        server.max_queued,
    ));
    let keys = Arc::new(auth::ApiKeys::new(state.config.api_keys()));
    let body_limit = server.body_limit_bytes;

    let generation = axum::Router::new()
        .route("/v1/chat/completions", post(chat::create))
        .route("/chat/completions", post(chat::create))
        .route("/v1/completions", post(completions::create))
        .route("/completions", post(completions::create))
        .route("/v1/responses", post(responses::create))
        .route("/responses", post(responses::create))
        .route_layer(from_fn_with_state(limiter, concurrency::limit))
        .route_layer(from_fn_with_state(state.clone(), draining::refuse_new_work))
        .route_layer(from_fn_with_state(
            state.config.request_timeout(),
            timeout::limit,
        ));
    let api = axum::Router::new()
        .route("/v1/models", get(models::list))
        .route("/models", get(models::list))
        .route("/v1/models/{id}", get(models::get))
        .route("/models/{id}", get(models::get))
        .route("/v1/policy", get(policy::show))
        .route("/policy", get(policy::show))
        .merge(generation)
        .route_layer(from_fn_with_state(keys, auth::require));
    let open = axum::Router::new()
        .route("/health", get(health::health))
        .route("/v1/health", get(health::health))
        .route("/metrics", get(metrics::render))
        .route("/openapi.json", get(openapi::document))
        .route("/v1/metrics", get(metrics::render));

    let trace = TraceLayer::new_for_http()
        .make_span_with(|req: &Request| {
            let id = req.headers().get(request_id::HEADER).and_then(|v| v.to_str().ok()).unwrap_or("-");
            tracing::info_span!("http", method = %req.method(), path = %req.uri().path(), request_id = %id)
        })
        .on_response(DefaultOnResponse::new().level(Level::INFO));

    // Layers listed last run first: ids, then the span, then the rest.
    api.merge(open)
        .fallback(|req: Request| async move {
            ApiError::NotFound(req.uri().path().to_owned()).into_response()
        })
        .layer(RequestBodyLimitLayer::new(body_limit))
        .layer(from_fn(http_metrics::record))
        .layer(from_fn_with_state(body_limit, error_shape::openai_errors))
        .layer(PropagateRequestIdLayer::new(request_id::HEADER))
        .layer(trace)
        .layer(SetRequestIdLayer::new(
            request_id::HEADER,
            request_id::MakeId::default(),
        ))
        .with_state(state)
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let overrides = Overrides {
        model: args.model.clone(),
        host: args.host,
        port: args.port,
    };
    let config = Config::load(&args.config, &overrides)?;
    let metrics = telemetry::init_metrics()?;

    let registry = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || Registry::load(&config)).await??
    };
    let registry = Arc::new(registry);
    // A policy may name an engine that failed to load (the router skips
    // it), but not one config.yaml does not have.
    let names = registry.configured_names();
    let policy = match PolicyHandle::from_file(&config.path, &names) {
        Ok(policy) => policy,
        Err(e) => {
            registry.shutdown();
            return Err(anyhow::anyhow!(
                "routing policy in {}: {e}",
                config.path.display()
            ));
        }
    };
    policy.spawn_watcher(
        &config.path,
        Duration::from_millis(config.server.policy_reload_ms.max(1)),
    );
    if config.server.engine_probe_s > 0.0 {
        crate::host::probe::spawn(
            registry.clone(),
            Duration::from_secs_f64(config.server.engine_probe_s),
        );
    }
    let router = Router::new(registry.clone(), policy);
    let state = match AppState::new(config.clone(), registry.clone(), router, metrics) {
        Ok(state) => Arc::new(state),
        Err(e) => {
            registry.shutdown();
            return Err(e);
        }
    };

    let addr = (config.server.host, config.server.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {}:{}", addr.0, addr.1))?;
    let local = listener.local_addr()?;
    tracing::info!(address = %local, model = %state.model.name, engines = ?names, "serving");
    // The one line on stdout: scripts and tests read the address from it.
    println!("gateway listening on http://{local}");

    let draining = state.clone();
    let grace = config.shutdown_grace();
    let drained = Arc::new(tokio::sync::Notify::new());
    let drained_early = drained.clone();
    axum::serve(listener, app(state))
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            // From here no connection is accepted and no new generation
            // starts; running ones get `grace` to finish, then are
            // cancelled so their streams end and the server can stop.
            draining.start_draining();
            tracing::info!(grace_s = grace.as_secs_f64(), "shutting down: draining in-flight requests");
            let registry = draining.registry.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = tokio::time::sleep(grace) => {
                        tracing::warn!("shutdown grace period over: cancelling what is still running");
                        let _ = tokio::task::spawn_blocking(move || registry.shutdown()).await;
                    }
                    _ = drained_early.notified() => {}
                }
            });
        })
        .await?;
    drained.notify_one();
    // Every connection has closed. Stop the engines (a fence: their
    // threads are done after this) and free the model before exiting.
    tokio::task::spawn_blocking(move || {
        registry.shutdown();
        drop(registry);
    })
    .await?;
    tracing::info!("stopped");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
