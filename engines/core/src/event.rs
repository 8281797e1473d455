//! What an engine streams back for one request.

use tokio::sync::mpsc;

#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    /// Log-probability of the chosen token, when the request asked for it.
    pub logprob: Option<f32>,
    /// The most likely alternatives with their log-probabilities.
    pub top_logprobs: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by the client, a stop string, or shutdown.
    Cancelled,
}

/// Speculative decoding accounting for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Draft tokens the target verified.
    pub drafted: u64,
    /// Of those, the ones it agreed with (and kept).
    pub accepted: u64,
    /// Target forward passes that committed tokens (prefill included).
    pub target_forwards: u64,
}

#[derive(Debug, Clone, PartialEq)]
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

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    Finished(Finish),
    Error(String),
}

/// The receiving half of a request's events. The engine drops its sender
/// after `Finished` or `Error`; a dropped receiver means the client is gone.
pub type EventStream = mpsc::UnboundedReceiver<Event>;
pub type EventSender = mpsc::UnboundedSender<Event>;

pub fn event_channel() -> (EventSender, EventStream) {
    mpsc::unbounded_channel()
}
