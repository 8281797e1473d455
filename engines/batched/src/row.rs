//! One request in the decode batch: its sampler, its KV reservation, and
//! its output side (the runtime's emitter: stop tokens, billing-safe
//! counts, the final event).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use engine_core::{FinishReason, GenerateRequest, StreamError, TokenEvent};
use runtime::emit::Emitter;
use runtime::sampling::Sampler;
use runtime::Reservation;

use crate::scheduler::Stats;

/// A row's place in the engine's `active` count, given back when dropped.
/// Counted here rather than at the scheduler's next publish, so a client
/// that sends its next request the moment this one's final event arrives
/// finds the engine idle (an exclusive engine would refuse it otherwise).
pub struct Active(Arc<Stats>);

impl Active {
    pub fn take(stats: &Arc<Stats>) -> Self {
        stats.active.fetch_add(1, Ordering::AcqRel);
        Self(stats.clone())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        // Saturating: a scheduler restarted after a panic zeroes the count.
        let _ = self
            .0
            .active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

pub struct Row {
    pub out: Emitter,
    pub sampler: Sampler,
    /// Held for the row's whole life; released before its final event.
    pub reservation: Reservation,
    /// Likewise.
    pub active: Active,
    /// Input of the next decode step.
    pub last_token: u32,
    /// The request's grammar state (structured outputs).
    pub constraint: Option<grammar::Constraint>,
}

impl Row {
    pub fn request(&self) -> &GenerateRequest {
        &self.out.request
    }

    /// Plain greedy rows share one argmax over the whole batch; a
    /// constrained row picks under its own mask.
    pub fn plain_greedy(&self) -> bool {
        self.constraint.is_none() && self.out.request.is_plain_greedy()
    }

    pub fn wants_logprobs(&self) -> bool {
        self.out.request.sampling.logprobs
    }

    /// Whether the row's next pick can be built before its current token
    /// is read on the host (pipelined decode): not under a grammar, whose
    /// mask follows the token, nor with penalties, which count it.
    pub fn pipelines(&self) -> bool {
        self.constraint.is_none() && !self.sampler.reads_history()
    }

    /// Tokens it may still emit before `max_tokens`.
    pub fn tokens_left(&self) -> u32 {
        self.request()
            .max_tokens
            .saturating_sub(self.out.generated())
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

    /// Ends the row: its KV blocks and its place in the count go back
    /// first, then the final event.
    pub fn finish(self, reason: FinishReason) {
        self.release().finish(reason, None);
    }

    pub fn fail(self, error: StreamError) {
        self.release().fail(error);
    }

    /// Gives back the KV blocks and the count; the emitter is left to
    /// send the end.
    fn release(self) -> Emitter {
        drop(self.reservation);
        drop(self.active);
        self.out
    }
}

#[cfg(test)]
mod tests {
    use engine_core::event::event_channel;
    use engine_core::{Event, SamplingParams};
    use runtime::KvPool;

    use super::*;

    /// The fast path refuses while the batched engine counts a row, so a
    /// row must leave the count before its final event reaches the client
    /// (it used to leave at the scheduler's next publish, after it).
    #[test]
    fn a_finished_row_leaves_the_count_before_its_final_event() {
        let stats = Arc::new(Stats::default());
        let pool = KvPool::new(4, 16, 1);
        let (events, mut stream) = event_channel();
        let request = GenerateRequest::new(vec![1, 2], 4);
        let sampler = Sampler::new(&SamplingParams::greedy(), 8, &request.prompt).unwrap();
        let row = Row {
            out: Emitter::new(request, events),
            sampler,
            reservation: pool.try_reserve(1).unwrap(),
            active: Active::take(&stats),
            last_token: 0,
            constraint: None,
        };
        assert_eq!(stats.active.load(Ordering::Acquire), 1);
        row.finish(FinishReason::Stop);
        assert!(matches!(stream.try_recv(), Ok(Event::Finished(_))));
        assert_eq!(stats.active.load(Ordering::Acquire), 0);
        assert_eq!(pool.allocated(), 0);
    }
}
