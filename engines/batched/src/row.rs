//! One request in the decode batch: the runtime's [`Sequence`] (sampler,
//! grammar, KV reservation, output) and the input of its next step.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use engine_core::{FinishReason, GenerateRequest, StreamError};
use runtime::sequence::Sequence;

use crate::scheduler::Stats;

/// A row's place in the engine's `active` count, given back with its KV
/// blocks (the sequence holds it). Counted here rather than at the
/// scheduler's next publish, so a client that sends its next request the
/// moment this one's final event arrives finds the engine idle (an
/// exclusive engine would refuse it otherwise).
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
    pub seq: Sequence,
    /// Input of the next decode step.
    pub last_token: u32,
}

impl Row {
    /// A started sequence, counted active until it ends.
    pub fn new(mut seq: Sequence, active: Active, last_token: u32) -> Self {
        seq.hold(active);
        Self { seq, last_token }
    }

    pub fn request(&self) -> &GenerateRequest {
        self.seq.request()
    }

    pub fn is_cancelled(&self) -> bool {
        self.seq.is_cancelled()
    }

    pub fn finish(mut self, reason: FinishReason) {
        self.seq.finish(reason, None);
    }

    pub fn fail(mut self, error: StreamError) {
        self.seq.fail(error);
    }
}

#[cfg(test)]
mod tests {
    use engine_core::event::event_channel;
    use engine_core::{Event, GenerateRequest};
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
        let reservation = pool.try_reserve(1).unwrap();
        let seq = Sequence::start(request, events, reservation, 8, |_| unreachable!()).unwrap();
        let row = Row::new(seq, Active::take(&stats), 0);
        assert_eq!(stats.active.load(Ordering::Acquire), 1);
        row.finish(FinishReason::Stop);
        assert!(matches!(stream.try_recv(), Ok(Event::Finished(_))));
        assert_eq!(stats.active.load(Ordering::Acquire), 0);
        assert_eq!(pool.allocated(), 0);
    }
}
