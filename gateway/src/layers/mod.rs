//! Cross-cutting concerns as layers, not handler code: request ids, auth,
//! the concurrency limit with its bounded queue, draining on shutdown,
//! timeouts, HTTP metrics,
//! and OpenAI-shaped bodies for errors the framework produces itself.

pub mod auth;
pub mod concurrency;
pub mod draining;
pub mod error_shape;
pub mod http_metrics;
pub mod request_id;
pub mod timeout;
