//! The engine interface: schedule a validated request, get a stream back.

use serde::{Deserialize, Serialize};

use crate::event::{event_channel, EventSender, EventStream};
use crate::request::{GenerateRequest, RequestId};

/// What an engine can serve, declared once at load. The host decides from
/// it alone which engines may take a request ([`Capabilities::accepts`]);
/// engines do not check it again.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Serves only plain greedy requests (no sampling, penalties, seed,
    /// logprobs: [`GenerateRequest::is_plain_greedy`]).
    pub greedy_only: bool,
    /// Can serve requests that carry tool definitions.
    pub tools: bool,
    /// Can serve requests with images (their soft-token embeddings).
    pub images: bool,
    /// Applies a request's grammar as token masks (structured outputs).
    #[serde(default)]
    pub grammar: bool,
    /// Reports each token's log-probability (and alternatives) when asked.
    #[serde(default)]
    pub logprobs: bool,
    /// Serves one request alone: the router gives it a request only while
    /// no other is in flight on any engine, and none to anyone else before
    /// that one is placed. Others that arrive while it runs go elsewhere;
    /// the engine may hand its sequence to one of them (`runtime::handover`).
    #[serde(default)]
    pub exclusive: bool,
}

/// What a request needs of an engine ([`GenerateRequest::needs`]), and how
/// many other requests are in flight beside it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    pub plain_greedy: bool,
    pub tools: bool,
    pub images: bool,
    pub grammar: bool,
    pub logprobs: bool,
    /// Requests in flight on any engine (queued ones and sequences being
    /// handed over included).
    pub in_flight: usize,
}

impl GenerateRequest {
    /// What this request needs of an engine, with `in_flight` other
    /// requests beside it ([`Capabilities::accepts`]).
    pub fn needs(&self, in_flight: usize) -> Needs {
        Needs {
            plain_greedy: self.is_plain_greedy(),
            tools: self.has_tools,
            images: !self.images.is_empty(),
            grammar: self.grammar.is_some(),
            logprobs: self.sampling.logprobs,
            in_flight,
        }
    }
}

/// Why an engine may not take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unsupported {
    #[error("it serves plain greedy requests only")]
    NotPlainGreedy,
    #[error("it does not serve requests with tools")]
    Tools,
    #[error("it does not serve requests with images")]
    Images,
    #[error("it does not apply structured-output grammars")]
    Grammar,
    #[error("it does not report logprobs")]
    Logprobs,
    /// Not about the request: the engine serves one alone and another is
    /// in flight.
    #[error("it serves one request alone and others are in flight")]
    NotAlone,
}

impl Capabilities {
    /// The one rule of which engine may take which request: the first
    /// thing `needs` asks that this engine lacks. The router applies it
    /// before a rule may route to an engine and before submitting; `gateway
    /// policy explain` and `policy test` show it the same way.
    pub fn accepts(&self, needs: &Needs) -> Result<(), Unsupported> {
        let lacks = [
            (
                self.greedy_only && !needs.plain_greedy,
                Unsupported::NotPlainGreedy,
            ),
            (needs.tools && !self.tools, Unsupported::Tools),
            (needs.images && !self.images, Unsupported::Images),
            (needs.grammar && !self.grammar, Unsupported::Grammar),
            (needs.logprobs && !self.logprobs, Unsupported::Logprobs),
            (self.exclusive && needs.in_flight > 0, Unsupported::NotAlone),
        ];
        lacks
            .into_iter()
            .find_map(|(lacking, why)| lacking.then_some(why))
            .map_or(Ok(()), Err)
    }
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

/// Why an engine declined a request its capabilities accept (its own
/// state: full, not ready); the router falls back to the next engine in
/// the chain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum Refusal {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{GenerateRequest, Grammar, ImageInput};

    /// Each capability refuses exactly the requests that need it, by name.
    #[test]
    fn accepts_names_what_the_engine_lacks() {
        let plain = GenerateRequest::new(vec![1], 1);
        let mut sampled = plain.clone();
        sampled.sampling.temperature = 0.7;
        let mut tools = plain.clone();
        tools.has_tools = true;
        let mut images = plain.clone();
        images.images.push(ImageInput {
            start: 0,
            tokens: 1,
            width: 1,
            embeddings: Default::default(),
            bidirectional: false,
        });
        let mut grammar = plain.clone();
        grammar.grammar = Some(Grammar::Regex("a".into()));
        let mut logprobs = sampled.clone();
        logprobs.sampling.logprobs = true;

        let none = Capabilities::default();
        assert_eq!(none.accepts(&plain.needs(0)), Ok(()));
        assert_eq!(none.accepts(&sampled.needs(3)), Ok(()));
        assert_eq!(none.accepts(&tools.needs(0)), Err(Unsupported::Tools));
        assert_eq!(none.accepts(&images.needs(0)), Err(Unsupported::Images));
        assert_eq!(none.accepts(&grammar.needs(0)), Err(Unsupported::Grammar));
        assert_eq!(none.accepts(&logprobs.needs(0)), Err(Unsupported::Logprobs));
        assert!(Unsupported::Logprobs.to_string().contains("logprobs"));

        let all = Capabilities {
            tools: true,
            images: true,
            grammar: true,
            logprobs: true,
            ..Capabilities::default()
        };
        for req in [&plain, &sampled, &tools, &images, &grammar, &logprobs] {
            assert_eq!(all.accepts(&req.needs(5)), Ok(()), "{req:?}");
        }

        let greedy_only = Capabilities {
            greedy_only: true,
            ..all.clone()
        };
        assert_eq!(greedy_only.accepts(&plain.needs(0)), Ok(()));
        assert_eq!(
            greedy_only.accepts(&sampled.needs(0)),
            Err(Unsupported::NotPlainGreedy)
        );
        // Logprobs are not plain greedy, even at temperature 0.
        let mut greedy_logprobs = plain.clone();
        greedy_logprobs.sampling.logprobs = true;
        assert_eq!(
            greedy_only.accepts(&greedy_logprobs.needs(0)),
            Err(Unsupported::NotPlainGreedy)
        );

        let exclusive = Capabilities {
            exclusive: true,
            ..all
        };
        assert_eq!(exclusive.accepts(&plain.needs(0)), Ok(()));
        assert_eq!(
            exclusive.accepts(&plain.needs(1)),
            Err(Unsupported::NotAlone)
        );
    }

    /// A plugin built before a capability existed declares it absent.
    #[test]
    fn capabilities_missing_from_json_are_absent() {
        let old: Capabilities =
            serde_json::from_str(r#"{"greedy_only":false,"tools":true,"images":false}"#).unwrap();
        assert!(old.tools && !old.grammar && !old.logprobs && !old.exclusive);
    }
}
