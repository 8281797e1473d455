//! One request in the decode batch: its sampler, its KV reservation, and
//! its output side (the runtime's emitter: stop tokens, billing-safe
//! counts, the final event).

use engine_core::{FinishReason, GenerateRequest, StreamError, TokenEvent};
use runtime::emit::Emitter;
use runtime::sampling::Sampler;
use runtime::Reservation;

pub struct Row {
    pub out: Emitter,
    pub sampler: Sampler,
    /// Held for the row's whole life; released before its final event.
    pub reservation: Reservation,
    /// Input of the next decode step.
    pub last_token: u32,
}

impl Row {
    pub fn request(&self) -> &GenerateRequest {
        &self.out.request
    }

    /// Plain greedy rows share one argmax over the whole batch.
    pub fn plain_greedy(&self) -> bool {
        self.out.request.is_plain_greedy()
    }

    pub fn wants_logprobs(&self) -> bool {
        self.out.request.sampling.logprobs
    }

    /// Handles a freshly sampled token; returns why the row ends, if it does.
    pub fn accept(&mut self, token: TokenEvent) -> Option<FinishReason> {
        let id = token.id;
        let end = self.out.token(token);
        self.last_token = id;
        end
    }

    /// What the row's KV holds: the prompt and every delivered token but
    /// the newest, which is the next decode input.
    pub fn context(&self) -> Vec<u32> {
        let fed = self.out.delivered().len().saturating_sub(1);
        [
            self.request().prompt.as_slice(),
            &self.out.delivered()[..fed],
        ]
        .concat()
    }

    /// `context().len()`, without building it.
    pub fn context_len(&self) -> usize {
        self.request().prompt.len() + self.out.delivered().len().saturating_sub(1)
    }

    pub fn is_cancelled(&self) -> bool {
        self.out.is_cancelled()
    }

    /// Ends the row: its KV blocks go back first, then the final event.
    pub fn finish(self, reason: FinishReason) {
        self.release().finish(reason, None);
    }

    pub fn fail(self, error: StreamError) {
        self.release().fail(error);
    }

    /// Gives back the KV blocks; the emitter is left to send the end.
    fn release(self) -> Emitter {
        drop(self.reservation);
        self.out
    }
}
