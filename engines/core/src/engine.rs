//! The engine interface: schedule a validated request, get a stream back.

use serde::{Deserialize, Serialize};

use crate::event::{event_channel, EventSender, EventStream};
use crate::request::{GenerateRequest, RequestId};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Serves only plain greedy requests (no sampling, penalties, seed).
    pub greedy_only: bool,
    /// Can serve requests that carry tool definitions.
    pub tools: bool,
    /// Can serve requests with images (their soft-token embeddings).
    pub images: bool,
    /// Applies a request's grammar as token masks (structured outputs).
    #[serde(default)]
    pub grammar: bool,
}

/// A snapshot of an engine's load, read by the router per request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineLoad {
    pub active: usize,
    pub queued: usize,
    pub kv_blocks_held: usize,
    pub healthy: bool,
    /// Moving-window draft acceptance rate, for speculative engines.
    pub accept_rate: Option<f32>,
    /// Moving-window speed relative to plain decoding, for speculative
    /// engines: tokens per target forward times a decode step's cost over
    /// the rounds' cost (above 1.0, speculation pays).
    pub expected_speedup: Option<f32>,
}

/// Why an engine declined a request it could otherwise serve; the router
/// falls back to the next engine in the chain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum Refusal {
    #[error("engine serves only plain greedy requests")]
    NotPlainGreedy,
    #[error("engine does not serve requests with tools")]
    Tools,
    #[error("engine is at its concurrency limit")]
    Busy,
    #[error("engine is not ready")]
    NotReady,
    #[error("{0}")]
    Other(String),
}

#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum EngineError {
    /// Declined; another engine may serve it.
    #[error("refused: {0}")]
    Refused(#[from] Refusal),
    /// The request itself is invalid for this model (for example it can
    /// never fit the context window or the KV pool).
    #[error("{0}")]
    Invalid(String),
    /// Temporarily out of capacity (queue full); retry later.
    #[error("{0}")]
    Overloaded(String),
    #[error("engine is shutting down")]
    ShuttingDown,
    #[error("internal engine error: {0}")]
    Internal(String),
    /// The engine itself broke (a panic) and is out of service.
    #[error("engine failure: {0}")]
    Failed(String),
}

pub trait Engine: Send + Sync {
    fn name(&self) -> &str;
    fn capabilities(&self) -> Capabilities;
    /// Schedules the request; its events go to `events`, and every stream
    /// ends with exactly one `Finished` or `Error`. On `Err` nothing was
    /// sent. The caller owns the stream (across the plugin boundary the
    /// sender is the host's C sink).
    fn submit_to(&self, req: GenerateRequest, events: EventSender) -> Result<(), EngineError>;
    /// [`Engine::submit_to`] a new channel, returning its stream.
    fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        let (events, stream) = event_channel();
        self.submit_to(req, events)?;
        Ok(stream)
    }
    /// Stops a request at the next step; its KV blocks return to the pool.
    fn cancel(&self, id: RequestId);
    fn load(&self) -> EngineLoad;
    /// Fence: cancels in-flight work and returns once it has stopped.
    fn shutdown(&self);
}
