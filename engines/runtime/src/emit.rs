//! The output side of one sequence, the same for every engine: a chosen
//! token ends the sequence at a stop token (not streamed), goes to the
//! client, is counted only once delivered (billing-safe), and ends it at
//! `max_tokens`; cancellation is checked before every send; the final
//! event goes out exactly once.

use engine_core::event::EventSender;
use engine_core::{
    Event, Finish, FinishReason, GenerateRequest, SpecStats, StreamError, TokenEvent,
};

pub struct Emitter {
    pub request: GenerateRequest,
    events: EventSender,
    /// Tokens delivered to the client, in order: the sequence's context
    /// beyond the prompt (a preempted sequence is recomputed from it).
    delivered: Vec<u32>,
    /// Prompt tokens served from a prefix cache.
    cached_tokens: u32,
    ended: bool,
}

impl Emitter {
    pub fn new(request: GenerateRequest, events: EventSender) -> Self {
        Self::resume(request, events, Vec::new(), 0)
    }

    /// Continues a sequence another engine started (a handover).
    pub fn resume(
        request: GenerateRequest,
        events: EventSender,
        delivered: Vec<u32>,
        cached_tokens: u32,
    ) -> Self {
        Self {
            request,
            events,
            delivered,
            cached_tokens,
            ended: false,
        }
    }

    pub fn set_cached_tokens(&mut self, cached_tokens: u32) {
        self.cached_tokens = cached_tokens;
    }

    pub fn generated(&self) -> u32 {
        self.delivered.len() as u32
    }

    /// The tokens delivered so far.
    pub fn delivered(&self) -> &[u32] {
        &self.delivered
    }

    pub fn cached_tokens(&self) -> u32 {
        self.cached_tokens
    }

    /// Whether the final event (or an error) went out.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Cancelled by the gateway, or the client is gone.
    pub fn is_cancelled(&self) -> bool {
        self.request.cancel.is_cancelled() || self.events.is_closed()
    }

    /// Handles a freshly chosen token with its logprobs; returns why the
    /// sequence ends, if it does (the caller then releases what it holds
    /// and calls [`Emitter::finish`]).
    pub fn token(&mut self, token: TokenEvent) -> Option<FinishReason> {
        if self.request.stop_tokens.contains(&token.id) {
            return Some(FinishReason::Stop);
        }
        let id = token.id;
        if self.request.cancel.is_cancelled() || self.events.send(Event::Token(token)).is_err() {
            return Some(FinishReason::Cancelled);
        }
        self.delivered.push(id);
        (self.generated() >= self.request.max_tokens).then_some(FinishReason::Length)
    }

    /// [`Emitter::token`] for a token without logprobs.
    pub fn plain(&mut self, id: u32) -> Option<FinishReason> {
        self.token(TokenEvent {
            id,
            logprob: None,
            top_logprobs: Vec::new(),
        })
    }

    /// Sends the final event (once; later calls do nothing).
    pub fn finish(&mut self, reason: FinishReason, spec: Option<SpecStats>) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let _ = self.events.send(Event::Finished(Finish {
            reason,
            prompt_tokens: self.request.prompt.len() as u32,
            completion_tokens: self.generated(),
            cached_tokens: self.cached_tokens,
            spec,
        }));
    }

    /// Ends the stream with an error (once; later calls do nothing).
    pub fn fail(&mut self, error: StreamError) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let _ = self.events.send(Event::Error(error));
    }

    /// The request, its stream and its counts, for a handover.
    pub fn into_parts(self) -> (GenerateRequest, EventSender, Vec<u32>, u32) {
        (
            self.request,
            self.events,
            self.delivered,
            self.cached_tokens,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine_core::event::event_channel;
    use engine_core::EventStream;

    fn emitter(max_tokens: u32) -> (Emitter, EventStream) {
        let mut req = GenerateRequest::new(vec![1, 2, 3], max_tokens);
        req.stop_tokens = vec![9];
        let (tx, rx) = event_channel();
        (Emitter::new(req, tx), rx)
    }

    fn drain(rx: &mut EventStream) -> Vec<Event> {
        std::iter::from_fn(|| rx.try_recv().ok()).collect()
    }

    #[test]
    fn stop_token_is_not_streamed_or_counted() {
        let (mut e, mut rx) = emitter(10);
        assert_eq!(e.plain(4), None);
        assert_eq!(e.plain(9), Some(FinishReason::Stop));
        e.finish(FinishReason::Stop, None);
        e.finish(FinishReason::Length, None);
        let events = drain(&mut rx);
        assert_eq!(events.len(), 2, "one token, one final event: {events:?}");
        let Event::Finished(f) = &events[1] else {
            panic!("{events:?}")
        };
        assert_eq!(
            (f.reason, f.completion_tokens, f.prompt_tokens),
            (FinishReason::Stop, 1, 3)
        );
    }

    #[test]
    fn max_tokens_ends_after_the_last_delivered_token() {
        let (mut e, _rx) = emitter(2);
        assert_eq!(e.plain(4), None);
        assert_eq!(e.plain(5), Some(FinishReason::Length));
        assert_eq!(e.generated(), 2);
    }

    #[test]
    fn cancellation_stops_before_the_send_and_counts_only_delivered() {
        let (mut e, mut rx) = emitter(10);
        e.plain(4);
        e.request.cancel.cancel();
        assert!(e.is_cancelled());
        assert_eq!(e.plain(5), Some(FinishReason::Cancelled));
        assert_eq!(e.generated(), 1, "billing-safe");
        assert_eq!(drain(&mut rx).len(), 1);
    }

    #[test]
    fn a_gone_client_cancels() {
        let (mut e, rx) = emitter(10);
        drop(rx);
        assert!(e.is_cancelled());
        assert_eq!(e.plain(4), Some(FinishReason::Cancelled));
        assert_eq!(e.generated(), 0);
    }

    #[test]
    fn an_error_ends_the_stream_once() {
        let (mut e, mut rx) = emitter(10);
        e.fail(StreamError::Overloaded("full".into()));
        e.finish(FinishReason::Stop, None);
        assert_eq!(
            drain(&mut rx),
            vec![Event::Error(StreamError::Overloaded("full".into()))]
        );
        assert!(e.ended());
    }
}
