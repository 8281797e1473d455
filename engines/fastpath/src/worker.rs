//! The decode loop of one fast-path request, on the engine's worker thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use engine_core::event::EventSender;
use engine_core::{FinishReason, GenerateRequest};
use runtime::generate;
use runtime::handover::HandoverSink;
use runtime::model::Logits;
use runtime::sampling;
use runtime::sequence::Sequence;
use runtime::{memory, KvCache, Reservation, SharedModel};

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

/// How the loop ended, before anything is released.
enum End {
    Done(FinishReason),
    HandOver {
        sink: Arc<dyn HandoverSink>,
        cache: KvCache,
        last_token: u32,
    },
}

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
        Ok(End::Done(reason)) => {
            seq.finish(reason, None);
            Outcome::Finished(reason)
        }
        Ok(End::HandOver {
            sink,
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

fn decode(shared: &Arc<SharedModel>, seq: &mut Sequence) -> anyhow::Result<End> {
    let _device = shared.lock_device();
    let max_tokens = seq.request().max_tokens;
    let mut stream = seq.prefill_greedy(shared)?;
    // When the first token was read: the decode rate on this side of HTTP,
    // to set beside the client's figures.
    let mut first_read = None;
    loop {
        let hand_over = shared.handover_sink().filter(|s| s.busy());
        // Queue the next step unless this is the last token we may need or
        // we are about to hand over.
        let token =
            stream.next_token(hand_over.is_none() && seq.out.generated() + 1 < max_tokens)?;
        let since = *first_read.get_or_insert_with(Instant::now);
        let end = seq.accept_plain(token, false)?;
        let read = seq.out.generated();
        if end.is_some() && read > 1 {
            let tok_s = (read - 1) as f64 / since.elapsed().as_secs_f64();
            tracing::debug!(tokens = read, tok_s, "fast path decode");
        }
        if end.is_some() || hand_over.is_some() {
            seq.publish_answer(shared, stream.cache());
        }
        if let Some(reason) = end {
            return Ok(End::Done(reason));
        }
        if let Some(sink) = hand_over {
            return Ok(End::HandOver {
                sink,
                cache: stream.into_cache()?,
                last_token: token,
            });
        }
    }
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
            return Ok(End::Done(FinishReason::Stop));
        };
        let _device = shared.lock_device();
        let token = seq
            .sampler
            .sample_within(&logits, &sampling::allowed_mask(&allowed.to_bools(vocab)))?
            .item_exact::<u32>();
        if let Some(reason) = seq.accept_plain(token, false)? {
            return Ok(End::Done(reason));
        }
        logits = model.forward(&generate::tokens_array(&[token]), &mut cache, Logits::Last)?;
    }
}
