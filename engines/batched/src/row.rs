//! One request in the decode batch: its sampler, its stream, its KV
//! reservation, and the accounting that makes its counts billing-safe.

use engine_core::event::EventSender;
use engine_core::{Event, Finish, FinishReason, GenerateRequest, TokenEvent};
use runtime::sampling::Sampler;
use runtime::Reservation;

pub struct Row {
    pub request: GenerateRequest,
    pub sampler: Sampler,
    pub events: EventSender,
    /// Held for the row's whole life; dropping the row returns the blocks.
    pub reservation: Reservation,
    /// Tokens streamed to the client.
    pub generated: u32,
    /// Input of the next decode step.
    pub last_token: u32,
    pub cached_tokens: u32,
}

impl Row {
    /// Plain greedy rows share one argmax over the whole batch.
    pub fn plain_greedy(&self) -> bool {
        self.request.sampling.is_plain_greedy() && !self.request.sampling.logprobs
    }

    pub fn wants_logprobs(&self) -> bool {
        self.request.sampling.logprobs
    }

    /// Handles a freshly sampled token; returns why the row ends, if it does.
    pub fn accept(
        &mut self,
        token: u32,
        logprob: Option<f32>,
        top: Vec<(u32, f32)>,
    ) -> Option<FinishReason> {
        if self.request.stop_tokens.contains(&token) {
            return Some(FinishReason::Stop);
        }
        let event = Event::Token(TokenEvent {
            id: token,
            logprob,
            top_logprobs: top,
        });
        if self.events.send(event).is_err() {
            // The client is gone.
            return Some(FinishReason::Cancelled);
        }
        self.generated += 1;
        self.last_token = token;
        if self.generated >= self.request.max_tokens {
            return Some(FinishReason::Length);
        }
        None
    }

    pub fn is_cancelled(&self) -> bool {
        self.request.cancel.is_cancelled() || self.events.is_closed()
    }

    pub fn finish(self, reason: FinishReason) {
        finish(
            &self.events,
            &self.request,
            reason,
            self.generated,
            self.cached_tokens,
        );
    }
}

pub fn finish(
    events: &EventSender,
    req: &GenerateRequest,
    reason: FinishReason,
    generated: u32,
    cached: u32,
) {
    let _ = events.send(Event::Finished(Finish {
        reason,
        prompt_tokens: req.prompt.len() as u32,
        completion_tokens: generated,
        cached_tokens: cached,
        spec: None,
    }));
}
