//! What an engine streams back for one request, and where it goes. Plain
//! data (serde); across the plugin boundary tokens travel as C structures
//! and the rest as JSON (`plugin::handles`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    pub id: u32,
    /// Log-probability of the chosen token, when the request asked for it.
    pub logprob: Option<f32>,
    /// The most likely alternatives with their log-probabilities.
    pub top_logprobs: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by the client, a stop string, or shutdown.
    Cancelled,
}

/// Speculative decoding accounting for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecStats {
    /// Draft tokens the target verified.
    pub drafted: u64,
    /// Of those, the ones it agreed with (and kept).
    pub accepted: u64,
    /// Target forward passes that committed tokens (prefill included).
    pub target_forwards: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: u32,
    /// Tokens delivered to the client, cancelled requests included
    /// (billing-safe).
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
    pub spec: Option<SpecStats>,
}

/// Why a request that an engine accepted ended without finishing. The
/// kind decides what the client sees: `Invalid` is the client's mistake
/// (400), `Overloaded` a capacity problem worth retrying (503
/// `server_overloaded` with Retry-After), `Interrupted` a failure outside
/// the engine that cut the request short, such as an upstream that died
/// mid-stream (503 `request_interrupted` with Retry-After), `Internal` the
/// engine's failure (500, and a fault against the engine).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum StreamError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Overloaded(String),
    #[error("{0}")]
    Interrupted(String),
    #[error("{0}")]
    Internal(String),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Event {
    Token(TokenEvent),
    Finished(Finish),
    Error(StreamError),
}

/// The receiving half of a request's events. The engine drops its sender
/// after `Finished` or `Error`; a dropped receiver means the client is gone.
pub type EventStream = mpsc::UnboundedReceiver<Event>;

/// Where one request's events go: a channel in this image, or the host's
/// through C for an engine in a plugin (`plugin::handles`).
pub trait EventSink: Send + Sync {
    /// Gives the event back when the receiver is gone.
    fn send(&self, event: Event) -> Result<(), Event>;
    fn is_closed(&self) -> bool;
    /// Completes when the receiver is gone.
    fn closed(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

impl EventSink for mpsc::UnboundedSender<Event> {
    fn send(&self, event: Event) -> Result<(), Event> {
        mpsc::UnboundedSender::send(self, event).map_err(|e| e.0)
    }

    fn is_closed(&self) -> bool {
        mpsc::UnboundedSender::is_closed(self)
    }

    fn closed(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(mpsc::UnboundedSender::closed(self))
    }
}

/// The sending half, one per request.
#[derive(Clone)]
pub struct EventSender(Arc<dyn EventSink>);

impl EventSender {
    pub fn new(sink: impl EventSink + 'static) -> Self {
        EventSender(Arc::new(sink))
    }

    /// Fails (giving the event back) when the receiver is gone.
    pub fn send(&self, event: Event) -> Result<(), mpsc::error::SendError<Event>> {
        self.0.send(event).map_err(mpsc::error::SendError)
    }

    pub fn is_closed(&self) -> bool {
        self.0.is_closed()
    }

    /// Completes when the receiver is gone.
    pub async fn closed(&self) {
        self.0.closed().await
    }
}

pub fn event_channel() -> (EventSender, EventStream) {
    let (tx, rx) = mpsc::unbounded_channel();
    (EventSender::new(tx), rx)
}
