//! The decode loop of one fast-path request, on the engine's worker thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use engine_core::event::EventSender;
use engine_core::{Event, Finish, FinishReason, GenerateRequest, TokenEvent};
use runtime::generate::GreedyStream;
use runtime::handover::{Handover, HandoverSink};
use runtime::{KvCache, Reservation, SharedModel};

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
    Done {
        reason: FinishReason,
        generated: u32,
    },
    HandOver {
        sink: Arc<dyn HandoverSink>,
        cache: KvCache,
        last_token: u32,
        generated: u32,
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
    match decode(shared, &request, &events) {
        Ok(End::Done { reason, generated }) => {
            drop(reservation);
            slot.store(false, Ordering::Release);
            let _ = events.send(Event::Finished(Finish {
                reason,
                prompt_tokens: request.prompt.len() as u32,
                completion_tokens: generated,
                cached_tokens: 0,
                spec: None,
            }));
            Outcome::Finished(reason)
        }
        Ok(End::HandOver {
            sink,
            cache,
            last_token,
            generated,
        }) => {
            slot.store(false, Ordering::Release);
            let handover = Handover {
                request,
                cache,
                last_token,
                generated,
                cached_tokens: 0,
                reservation,
                events,
            };
            match sink.adopt(handover) {
                Ok(()) => Outcome::HandedOver,
                Err(h) => {
                    let _ = h
                        .events
                        .send(Event::Error("generation could not continue".into()));
                    Outcome::Failed
                }
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "fast path decode failed");
            drop(reservation);
            slot.store(false, Ordering::Release);
            let _ = events.send(Event::Error(format!("generation failed: {e}")));
            Outcome::Failed
        }
    }
}

fn decode(
    shared: &Arc<SharedModel>,
    request: &GenerateRequest,
    events: &EventSender,
) -> anyhow::Result<End> {
    let _device = shared.model.lock_device();
    let mut stream = GreedyStream::start(&shared.model.model, &request.prompt)?;
    let mut generated = 0u32;
    loop {
        let hand_over = shared.handover_sink().filter(|s| s.busy());
        // Queue the next step unless this is the last token we may need or
        // we are about to hand over.
        let token = stream.next_token(hand_over.is_none() && generated + 1 < request.max_tokens)?;
        if request.stop_tokens.contains(&token) {
            return Ok(End::Done {
                reason: FinishReason::Stop,
                generated,
            });
        }
        let event = Event::Token(TokenEvent {
            id: token,
            logprob: None,
            top_logprobs: Vec::new(),
        });
        if request.cancel.is_cancelled() || events.send(event).is_err() {
            return Ok(End::Done {
                reason: FinishReason::Cancelled,
                generated,
            });
        }
        generated += 1;
        if generated >= request.max_tokens {
            return Ok(End::Done {
                reason: FinishReason::Length,
                generated,
            });
        }
        if let Some(sink) = hand_over {
            return Ok(End::HandOver {
                sink,
                cache: stream.into_cache(),
                last_token: token,
                generated,
            });
        }
    }
}
