//! The decode loop of one fast-path request, on the engine's worker thread.

use std::sync::Arc;

use engine_core::event::EventSender;
use engine_core::{Event, Finish, FinishReason, GenerateRequest, TokenEvent};
use mlx_rs::transforms::async_eval;
use runtime::generate::{self, argmax_tokens, DEFAULT_PREFILL_CHUNK};
use runtime::handover::Handover;
use runtime::model::Logits;
use runtime::{Reservation, SharedModel};

pub struct Job {
    pub request: GenerateRequest,
    pub reservation: Reservation,
    pub events: EventSender,
}

pub enum Outcome {
    Finished(FinishReason),
    HandedOver,
}

pub fn run(shared: &Arc<SharedModel>, job: Job) -> Outcome {
    let Job { request, reservation, events } = job;
    match decode(shared, request, reservation, events) {
        Ok(outcome) => outcome,
        Err((events, e)) => {
            tracing::error!(error = %e, "fast path decode failed");
            let _ = events.send(Event::Error(format!("generation failed: {e}")));
            Outcome::Finished(FinishReason::Cancelled)
        }
    }
}

type Failed = (EventSender, anyhow::Error);

fn decode(shared: &Arc<SharedModel>, request: GenerateRequest, reservation: Reservation, events: EventSender) -> Result<Outcome, Failed> {
    let model = &shared.model.model;
    let device = shared.model.device.lock();
    let mut cache = model.new_cache(1);
    let fail = |events: &EventSender, e: anyhow::Error| (events.clone(), e);
    let logits = generate::prefill(model, &mut cache, &request.prompt, DEFAULT_PREFILL_CHUNK).map_err(|e| fail(&events, e))?;
    let mut current = argmax_tokens(&logits).map_err(|e| fail(&events, e))?;
    async_eval([&current]).map_err(|e| fail(&events, e.into()))?;
    let mut generated = 0u32;
    let finish = |reason, generated| {
        let _ = events.send(Event::Finished(Finish {
            reason,
            prompt_tokens: request.prompt.len() as u32,
            completion_tokens: generated,
            cached_tokens: 0,
            spec: None,
        }));
    };
    loop {
        let hand_over = shared.handover_sink().filter(|s| s.busy());
        // Queue the next step before reading this one, unless this is the
        // last token we may need or we are about to hand over.
        let next = if hand_over.is_none() && generated + 1 < request.max_tokens {
            let logits = model.forward(&current, &mut cache, Logits::Last).map_err(|e| fail(&events, e))?;
            let next = argmax_tokens(&logits).map_err(|e| fail(&events, e))?;
            async_eval([&next]).map_err(|e| fail(&events, e.into()))?;
            Some(next)
        } else {
            None
        };
        let token = current.item_exact::<i32>() as u32;
        if request.stop_tokens.contains(&token) {
            finish(FinishReason::Stop, generated);
            return Ok(Outcome::Finished(FinishReason::Stop));
        }
        if request.cancel.is_cancelled() || events.send(Event::Token(TokenEvent { id: token, logprob: None, top_logprobs: Vec::new() })).is_err() {
            finish(FinishReason::Cancelled, generated);
            return Ok(Outcome::Finished(FinishReason::Cancelled));
        }
        generated += 1;
        if generated >= request.max_tokens {
            finish(FinishReason::Length, generated);
            return Ok(Outcome::Finished(FinishReason::Length));
        }
        if let Some(sink) = hand_over {
            drop(device);
            let handover = Handover {
                request,
                cache,
                last_token: token,
                generated,
                cached_tokens: 0,
                reservation,
                events,
            };
            return match sink.adopt(handover) {
                Ok(()) => Ok(Outcome::HandedOver),
                Err(h) => {
                    let _ = h.events.send(Event::Error("generation could not continue".into()));
                    Ok(Outcome::Finished(FinishReason::Cancelled))
                }
            };
        }
        current = next.expect("a next step is queued unless we stop or hand over");
    }
}
