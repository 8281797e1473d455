//! What an engine streams back for one request. Plain data (serde), so
//! events can cross a process or ABI boundary as they are.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::plugin::handles::ForeignEvents;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    pub id: u32,
    /// Log-probability of the chosen token, when the request asked for it.
    #[serde(with = "logprob_json::option")]
    pub logprob: Option<f32>,
    /// The most likely alternatives with their log-probabilities.
    #[serde(with = "logprob_json::pairs")]
    pub top_logprobs: Vec<(u32, f32)>,
}

/// JSON has no infinities (serde_json writes them as null), but a token the
/// sampler ruled out has a log-probability of -inf: events cross the plugin
/// boundary as JSON, so non-finite values travel as text ("-inf").
mod logprob_json {
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Wire {
        Number(f32),
        Text(String),
    }

    fn put(x: f32) -> Wire {
        if x.is_finite() {
            Wire::Number(x)
        } else {
            Wire::Text(x.to_string())
        }
    }

    fn get<E: serde::de::Error>(w: Wire) -> Result<f32, E> {
        match w {
            Wire::Number(x) => Ok(x),
            Wire::Text(t) => t.parse().map_err(E::custom),
        }
    }

    pub mod option {
        use super::*;

        pub fn serialize<S: serde::Serializer>(x: &Option<f32>, s: S) -> Result<S::Ok, S::Error> {
            x.map(put).serialize(s)
        }

        pub fn deserialize<'de, D: serde::Deserializer<'de>>(
            d: D,
        ) -> Result<Option<f32>, D::Error> {
            Option::<Wire>::deserialize(d)?.map(get).transpose()
        }
    }

    pub mod pairs {
        use super::*;

        pub fn serialize<S: serde::Serializer>(v: &[(u32, f32)], s: S) -> Result<S::Ok, S::Error> {
            v.iter()
                .map(|&(t, x)| (t, put(x)))
                .collect::<Vec<_>>()
                .serialize(s)
        }

        pub fn deserialize<'de, D: serde::Deserializer<'de>>(
            d: D,
        ) -> Result<Vec<(u32, f32)>, D::Error> {
            Vec::<(u32, Wire)>::deserialize(d)?
                .into_iter()
                .map(|(t, w)| Ok((t, get(w)?)))
                .collect()
        }
    }
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

/// The sending half, one per request. Inside one build it is a tokio
/// channel; a sender that crossed the plugin boundary sends through the
/// host's C sink (`plugin::abi::RawEventSink`).
#[derive(Clone)]
pub struct EventSender(pub(crate) Sink);

#[derive(Clone)]
pub(crate) enum Sink {
    Local(mpsc::UnboundedSender<Event>),
    Foreign(Arc<ForeignEvents>),
}

impl EventSender {
    /// Fails (giving the event back) when the receiver is gone.
    pub fn send(&self, event: Event) -> Result<(), mpsc::error::SendError<Event>> {
        match &self.0 {
            Sink::Local(tx) => tx.send(event),
            Sink::Foreign(sink) => sink.send(event),
        }
    }

    pub fn is_closed(&self) -> bool {
        match &self.0 {
            Sink::Local(tx) => tx.is_closed(),
            Sink::Foreign(sink) => sink.is_closed(),
        }
    }

    /// Completes when the receiver is gone.
    pub async fn closed(&self) {
        match &self.0 {
            Sink::Local(tx) => tx.closed().await,
            // A C sink cannot wake a future; poll it.
            Sink::Foreign(sink) => {
                while !sink.is_closed() {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
            }
        }
    }
}

pub fn event_channel() -> (EventSender, EventStream) {
    let (tx, rx) = mpsc::unbounded_channel();
    (EventSender(Sink::Local(tx)), rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ruled_out_tokens_keep_their_minus_infinity_through_json() {
        let event = TokenEvent {
            id: 7,
            logprob: Some(f32::NEG_INFINITY),
            top_logprobs: vec![(7, f32::NEG_INFINITY), (3, -0.5)],
        };
        let back: TokenEvent =
            serde_json::from_str(&serde_json::to_string(&event).unwrap()).unwrap();
        assert_eq!(back.logprob, Some(f32::NEG_INFINITY));
        assert_eq!(back.top_logprobs, event.top_logprobs);
        let none: TokenEvent =
            serde_json::from_str(r#"{"id":1,"logprob":null,"top_logprobs":[]}"#).unwrap();
        assert_eq!(none.logprob, None);
    }
}
