//! One fast-path request on the engine's worker thread: the sequence's
//! greedy loop, paused for a handover, or a constrained loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use engine_core::event::EventSender;
use engine_core::{FinishReason, GenerateRequest};
use runtime::generate;
use runtime::handover::HandoverSink;
use runtime::model::Logits;
use runtime::sampling;
use runtime::sequence::{Greedy, Sequence};
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
type End = Greedy<Arc<dyn HandoverSink>>;

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
    let decoded = match seq.constraint.is_some() {
        true => decode_constrained(shared, &mut seq),
        false => decode(shared, &mut seq),
    };
    match decoded {
        Ok(Greedy::Finished(reason)) => {
            seq.finish(reason, None);
            Outcome::Finished(reason)
        }
        Ok(Greedy::Paused {
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

/// Greedy decoding, handed over before the next step is queued once the
/// batched engine has work.
fn decode(shared: &Arc<SharedModel>, seq: &mut Sequence) -> anyhow::Result<End> {
    let _device = shared.lock_device();
    seq.decode_greedy_until(shared, || shared.handover_sink().filter(|s| s.busy()))
}

/// A constrained request: each token is the argmax among those its grammar
/// allows, so no step is queued ahead, and the grammar's state cannot be
/// handed over: the request finishes here. The device lock is taken per
/// step, so the batched engine's work interleaves meanwhile.
fn decode_constrained(shared: &Arc<SharedModel>, seq: &mut Sequence) -> anyhow::Result<End> {
    let model = &shared.model.model;
    let vocab = shared.model.vocab_size();
    let (mut cache, mut logits) = {
        let _device = shared.lock_device();
        seq.prefill_logits(shared)?
    };
    loop {
        let constraint = seq.constraint.as_mut().expect("a constrained request");
        let Some(allowed) = constraint.allowed() else {
            return Ok(Greedy::Finished(FinishReason::Stop));
        };
        let _device = shared.lock_device();
        let token = seq
            .sampler
            .sample_within(&logits, &sampling::allowed_mask(&allowed.to_bools(vocab)))?
            .item_exact::<u32>();
        if let Some(reason) = seq.accept_plain(token, false)? {
            return Ok(Greedy::Finished(reason));
        }
        logits = model.forward(&generate::tokens_array(&[token]), &mut cache, Logits::Last)?;
    }
}
