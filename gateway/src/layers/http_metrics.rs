//! Request counts and latency. Completion requests are also counted by the
//! engine and rule that served them (read from the response's routing
//! headers) and by status.

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;

use crate::api::{ENGINE_HEADER, RULE_HEADER};
use crate::telemetry::metric;

pub async fn record(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let started = Instant::now();
    let response = next.run(req).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!(metric::HTTP_REQUESTS, "route" => route.clone(), "status" => status.clone())
        .increment(1);
    if route.ends_with("completions") {
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none")
                .to_owned()
        };
        let (engine, rule) = (header(ENGINE_HEADER), header(RULE_HEADER));
        metrics::counter!(metric::REQUESTS, "engine" => engine.clone(), "rule" => rule, "status" => status).increment(1);
        metrics::histogram!(metric::REQUEST_DURATION, "engine" => engine)
            .record(started.elapsed().as_secs_f64());
    }
    response
}
