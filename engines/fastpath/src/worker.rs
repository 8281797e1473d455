//! The decode loop of one fast-path request, on the engine's worker thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use engine_core::event::EventSender;
use engine_core::{Event, FinishReason, GenerateRequest, StreamError};
use runtime::emit::Emitter;
use runtime::generate::GreedyStream;
use runtime::handover::{Handover, HandoverSink};
use runtime::{memory, KvCache, Reservation, SharedModel};

pub struct Job {
    pub request: GenerateRequest,
    pub reservation: Reservation,
    pub events: EventSender,
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

/// Runs the request. The slot and the KV blocks are released before the
/// final event goes out, so a client that sends its next request the moment
/// this one ends finds the fast path free.
pub fn run(shared: &Arc<SharedModel>, job: Job, slot: &AtomicBool) -> Outcome {
    let Job {
        request,
        reservation,
        events,
    } = job;
    let mut out = Emitter::new(request, events);
    match decode(shared, &mut out) {
        Ok(End::Done(reason)) => {
            drop(reservation);
            slot.store(false, Ordering::Release);
            out.finish(reason, None);
            Outcome::Finished(reason)
        }
        Ok(End::HandOver {
            sink,
            cache,
            last_token,
        }) => {
            slot.store(false, Ordering::Release);
            let (request, events, generated, cached_tokens) = out.into_parts();
            let handover = Handover {
                request,
                cache,
                last_token,
                generated,
                cached_tokens,
                reservation,
                events,
            };
            match sink.adopt(handover) {
                Ok(()) => Outcome::HandedOver,
                Err(h) => {
                    let _ = h.events.send(Event::Error(StreamError::Internal(
                        "generation could not continue".into(),
                    )));
                    Outcome::Failed
                }
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "fast path decode failed");
            drop(reservation);
            slot.store(false, Ordering::Release);
            out.fail(memory::failed_step(&e));
            Outcome::Failed
        }
    }
}

fn decode(shared: &Arc<SharedModel>, out: &mut Emitter) -> anyhow::Result<End> {
    let _device = shared.model.lock_device();
    let max_tokens = out.request.max_tokens;
    let mut stream = GreedyStream::start(&shared.model.model, &out.request.prompt)?;
    loop {
        let hand_over = shared.handover_sink().filter(|s| s.busy());
        // Queue the next step unless this is the last token we may need or
        // we are about to hand over.
        let token = stream.next_token(hand_over.is_none() && out.generated() + 1 < max_tokens)?;
        if let Some(reason) = out.plain(token) {
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
