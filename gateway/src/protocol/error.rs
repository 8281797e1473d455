//! The API layer's errors, each with its HTTP status, OpenAI `error.type`,
//! optional `param`/`code`, and a metric label. Messages speak only of the
//! request at hand, never of other clients' traffic.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::telemetry::metric;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// Malformed or out-of-range input; `param` names the field.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
        code: Option<&'static str>,
    },
    #[error("The model `{0}` does not exist")]
    ModelNotFound(String),
    #[error("Invalid or missing API key. Send it as `Authorization: Bearer <key>`.")]
    Unauthorized,
    #[error("The request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("No route for {0}")]
    NotFound(String),
    #[error("Method not allowed for this route")]
    MethodNotAllowed,
    /// The gateway's own admission queue is full.
    #[error("The server has too many pending requests; retry shortly")]
    QueueFull,
    /// Every engine able to serve the request is at capacity.
    #[error("The server is at capacity; retry shortly")]
    Overloaded,
    /// No loaded engine can serve this kind of request.
    #[error("{0}")]
    Unavailable(String),
    /// The engines that could serve it are out of service after a fault,
    /// until a probe finds them serving again.
    #[error("{0}")]
    OutOfService(String),
    /// The server is draining before it stops; no new work is taken.
    #[error("The server is shutting down; retry on another instance")]
    ShuttingDown,
    /// The engine stopped the request itself (the server is shutting down,
    /// an upstream failed mid-stream): why, for the client.
    #[error("The server stopped this request before it finished ({0}); retry")]
    Interrupted(String),
    #[error("The request did not complete within {} seconds", .0.as_secs_f64())]
    Timeout(Duration),
    /// The engine failed while generating.
    #[error("Generation failed: {0}")]
    Engine(String),
    #[error("Internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    pub fn invalid_no_param(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn context_length(message: impl Into<String>, param: &str) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
            code: Some("context_length_exceeded"),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::QueueFull => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Overloaded
            | ApiError::Unavailable(_)
            | ApiError::OutOfService(_)
            | ApiError::Interrupted(_)
            | ApiError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Engine(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `error.type`.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest { .. }
            | ApiError::ModelNotFound(_)
            | ApiError::NotFound(_)
            | ApiError::MethodNotAllowed
            | ApiError::PayloadTooLarge { .. } => "invalid_request_error",
            ApiError::Unauthorized => "authentication_error",
            ApiError::QueueFull => "rate_limit_error",
            ApiError::Overloaded
            | ApiError::Unavailable(_)
            | ApiError::OutOfService(_)
            | ApiError::Interrupted(_)
            | ApiError::ShuttingDown
            | ApiError::Timeout(_) => "server_error",
            ApiError::Engine(_) | ApiError::Internal(_) => "server_error",
        }
    }

    pub fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidRequest { param, .. } => param.as_deref(),
            ApiError::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }

    pub fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::InvalidRequest { code, .. } => *code,
            ApiError::ModelNotFound(_) => Some("model_not_found"),
            ApiError::Unauthorized => Some("invalid_api_key"),
            ApiError::PayloadTooLarge { .. } => Some("request_too_large"),
            ApiError::QueueFull => Some("rate_limit_exceeded"),
            ApiError::Overloaded => Some("server_overloaded"),
            ApiError::Unavailable(_) => Some("no_capable_engine"),
            ApiError::OutOfService(_) => Some("engine_unavailable"),
            ApiError::Interrupted(_) => Some("request_interrupted"),
            ApiError::ShuttingDown => Some("server_shutting_down"),
            ApiError::Timeout(_) => Some("timeout"),
            _ => None,
        }
    }

    /// The `kind` label of `gateway_errors_total`.
    pub fn label(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest {
                code: Some("context_length_exceeded"),
                ..
            } => "context_length",
            ApiError::InvalidRequest { .. } => "invalid_request",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::Unauthorized => "unauthorized",
            ApiError::PayloadTooLarge { .. } => "payload_too_large",
            ApiError::NotFound(_) => "not_found",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::QueueFull => "queue_full",
            ApiError::Overloaded => "overloaded",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::OutOfService(_) => "out_of_service",
            ApiError::Interrupted(_) => "interrupted",
            ApiError::ShuttingDown => "shutting_down",
            ApiError::Timeout(_) => "timeout",
            ApiError::Engine(_) => "engine",
            ApiError::Internal(_) => "internal",
        }
    }

    /// Seconds a client should wait before retrying, when retrying helps.
    pub fn retry_after(&self) -> Option<u64> {
        matches!(
            self,
            ApiError::QueueFull
                | ApiError::Overloaded
                | ApiError::OutOfService(_)
                | ApiError::Interrupted(_)
        )
        .then_some(1)
    }

    /// The OpenAI error object (`{"error": {...}}`).
    pub fn body(&self) -> serde_json::Value {
        let body = ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.kind(),
                param: self.param().map(str::to_owned),
                code: self.code(),
            },
        };
        serde_json::to_value(body).unwrap_or_default()
    }
}

/// The errors a generation request can get.
// Only described in the document; errors are built by `ApiError`.
#[allow(dead_code)]
#[derive(utoipa::IntoResponses)]
pub enum GenerationErrors {
    #[response(status = 400, description = "Invalid request")]
    Invalid(ErrorBody),
    #[response(status = 401, description = "Missing or wrong API key")]
    Unauthorized(ErrorBody),
    #[response(status = 404, description = "Unknown model")]
    UnknownModel(ErrorBody),
    #[response(status = 413, description = "Body over the size limit")]
    TooLarge(ErrorBody),
    #[response(status = 429, description = "Too many pending requests")]
    QueueFull(ErrorBody),
    #[response(status = 503, description = "At capacity or shutting down")]
    Unavailable(ErrorBody),
    #[response(status = 504, description = "No response within the request timeout")]
    Timeout(ErrorBody),
}

/// Every error: `{"error": {...}}`.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    /// "invalid_request_error", "authentication_error", "rate_limit_error"
    /// or "server_error".
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        metrics::counter!(metric::ERRORS, "kind" => self.label()).increment(1);
        if self.status().is_server_error() {
            tracing::warn!(status = self.status().as_u16(), error = %self, "request failed");
        } else {
            tracing::debug!(status = self.status().as_u16(), error = %self, "request rejected");
        }
        let mut response = super::json_response(self.status(), &self.body());
        if let Some(secs) = self.retry_after() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_maps_to_status_type_and_label() {
        let cases = [
            (
                ApiError::invalid("bad", "temperature"),
                400,
                "invalid_request_error",
                Some("temperature"),
            ),
            (
                ApiError::ModelNotFound("m".into()),
                404,
                "invalid_request_error",
                Some("model"),
            ),
            (ApiError::Unauthorized, 401, "authentication_error", None),
            (
                ApiError::PayloadTooLarge { limit: 1 },
                413,
                "invalid_request_error",
                None,
            ),
            (ApiError::QueueFull, 429, "rate_limit_error", None),
            (ApiError::Overloaded, 503, "server_error", None),
            (
                ApiError::OutOfService("x".into()),
                503,
                "server_error",
                None,
            ),
            (
                ApiError::Timeout(Duration::from_secs(3)),
                504,
                "server_error",
                None,
            ),
            (ApiError::Engine("x".into()), 500, "server_error", None),
        ];
        for (err, status, kind, param) in cases {
            assert_eq!(err.status().as_u16(), status, "{err:?}");
            assert_eq!(err.kind(), kind);
            assert_eq!(err.param(), param);
            let body = err.body();
            assert_eq!(body["error"]["type"], kind);
            assert!(body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()));
            assert!(!err.label().is_empty());
        }
        assert_eq!(ApiError::QueueFull.retry_after(), Some(1));
        // Capable engines benched after a fault come back: retry.
        assert_eq!(ApiError::OutOfService("x".into()).retry_after(), Some(1));
        assert_eq!(ApiError::Unavailable("x".into()).retry_after(), None);
        assert_eq!(ApiError::invalid("x", "y").retry_after(), None);
    }

    #[test]
    fn capacity_messages_do_not_describe_other_traffic() {
        for err in [ApiError::QueueFull, ApiError::Overloaded] {
            let msg = err.to_string().to_lowercase();
            for word in ["active", "fast", "engine", "request is"] {
                assert!(!msg.contains(word), "{msg}");
            }
        }
    }
}
