//! One fast-path request on the engine's worker thread: the sequence's
//! pipelined loop (greedy or sampled), paused for a handover, or a loop of
//! one step at a time where each pick follows the token before it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use engine_core::event::EventSender;
use engine_core::{FinishReason, GenerateRequest};
use runtime::handover::HandoverSink;
use runtime::sequence::{Decoded, Sequence};
use runtime::{memory, Reservation, SharedModel};

pub struct Job {
    pub request: GenerateRequest,
    pub reservation: Reservation,
    pub events: EventSender,
    pub slot: Slot,
}

impl runtime::worker::Job for Job {
    fn request(&self) -> &GenerateRequest {
        &self.request
    }
}

/// The engine's one slot, taken at submit and given back when dropped:
/// the request holds it, and frees it with its KV blocks before its final
/// event, so a client that sends its next request the moment this one
/// ends finds the fast path free.
pub struct Slot(pub Arc<AtomicBool>);

impl Slot {
    /// Takes the slot, unless it is taken.
    pub fn take(busy: &Arc<AtomicBool>) -> Option<Self> {
        busy.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then(|| Self(busy.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

pub enum Outcome {
    Finished(FinishReason),
    HandedOver,
    Failed,
}

/// How the loop ended, before anything is released: finished, or paused
/// for the batched engine (the sink) to take the sequence over.
type End = Decoded<Arc<dyn HandoverSink>>;

/// Runs the request.
pub fn run(shared: &Arc<SharedModel>, job: Job) -> Outcome {
    let Job {
        request,
        reservation,
        events,
        slot,
    } = job;
    let Some(mut seq) = Sequence::start_on(shared, request, events, reservation) else {
        return Outcome::Failed;
    };
    seq.hold(slot);
    // Handed over to the batched engine once it has work of its own.
    let busy = || shared.handover_sink().filter(|s| s.busy());
    let decoded: anyhow::Result<End> = match seq.pipelines() {
        true => {
            let _device = shared.lock_device();
            seq.decode_until(shared, busy)
        }
        // Each pick follows the token before it (a grammar, penalties).
        false => seq.decode_stepwise_until(shared, busy),
    };
    match decoded {
        Ok(Decoded::Finished(reason)) => {
            seq.finish(reason, None);
            Outcome::Finished(reason)
        }
        Ok(Decoded::Paused {
            with: sink,
            cache,
            last_token,
        }) => match seq.hand_over(cache, last_token, &*sink) {
            true => Outcome::HandedOver,
            false => Outcome::Failed,
        },
        Err(e) => {
            tracing::error!(error = %e, "fast path decode failed");
            seq.fail(memory::failed_step(&e));
            Outcome::Failed
        }
    }
}
