//! The worker thread: one request at a time, start to finish.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use engine_core::event::EventSender;
use engine_core::{Event, Finish, FinishReason, GenerateRequest, StreamError, TokenEvent};
use mlx_rs::transforms::eval;
use mlx_rs::{Array, Dtype};
use runtime::generate::{self, DEFAULT_PREFILL_CHUNK};
use runtime::kv_pool::PoolError;
use runtime::model::Logits;
use runtime::sampling::{log_softmax, Sampler};
use runtime::{Reservation, SharedModel};

use crate::engine::State;
use crate::options::{Fault, Options};

pub struct Job {
    pub req: GenerateRequest,
    pub events: EventSender,
}

/// Errors leave the engine as `StreamError::Internal` with this text.
type GenResult<T> = Result<T, String>;

/// How a generation ended, before it is reported.
struct Outcome {
    reason: FinishReason,
    delivered: u32,
}

pub fn run(
    shared: Arc<SharedModel>,
    state: Arc<State>,
    jobs: mpsc::Receiver<Job>,
    options: Options,
) {
    let mut served = 0u32;
    while let Ok(job) = jobs.recv() {
        state.queued.fetch_sub(1, Ordering::AcqRel);
        let id = job.req.id;
        state.active.store(1, Ordering::Release);
        served += 1;
        let fault = options
            .fault
            .filter(|_| options.fault_requests == 0 || served <= options.fault_requests);
        // A panic loses its request (the stream ends unfinished, which
        // benches the engine) and the worker goes on to the next.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            serve(&shared, &state, job, &options, fault)
        }));
        state.active.store(0, Ordering::Release);
        state.kv_blocks.store(0, Ordering::Release);
        state
            .cancels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }
    state.worker_alive.store(false, Ordering::Release);
}

fn serve(shared: &SharedModel, state: &State, job: Job, options: &Options, fault: Option<Fault>) {
    let Job { req, events } = job;
    let prompt_tokens = req.prompt.len() as u32;
    let finish = |reason, delivered| {
        Event::Finished(Finish {
            reason,
            prompt_tokens,
            completion_tokens: delivered,
            cached_tokens: 0,
            spec: None,
        })
    };
    let Some(reservation) = reserve(shared, &req, &events) else {
        let _ = events.send(finish(FinishReason::Cancelled, 0));
        return;
    };
    state
        .kv_blocks
        .store(reservation.blocks(), Ordering::Release);
    match fault {
        // Unwinding returns the reservation; the stream is dropped unfinished.
        Some(Fault::PanicInWorker) => panic!("injected fault: panic in the worker"),
        Some(fault @ (Fault::ErrorInStream | Fault::OverloadInStream | Fault::InvalidInStream)) => {
            drop(reservation);
            state.kv_blocks.store(0, Ordering::Release);
            let message = "injected fault".to_owned();
            let _ = events.send(Event::Error(match fault {
                Fault::OverloadInStream => StreamError::Overloaded(message),
                Fault::InvalidInStream => StreamError::Invalid(message),
                _ => StreamError::Internal(message),
            }));
            return;
        }
        Some(Fault::PanicOnSubmit | Fault::ErrorOnSubmit) | None => {}
    }
    tracing::debug!(request = %req.id, prompt_tokens, max_tokens = req.max_tokens, "reference engine started a request");
    let pause = Duration::from_millis(options.token_delay_ms);
    let result = if req.is_plain_greedy() {
        run_greedy(shared, &req, &events, pause)
    } else {
        run_sampled(shared, &req, &events, pause)
    };
    // The blocks go back before the client learns the request finished, so a
    // client that reads the pool right after sees them returned.
    drop(reservation);
    state.kv_blocks.store(0, Ordering::Release);
    let _ = match result {
        Ok(outcome) => events.send(finish(outcome.reason, outcome.delivered)),
        Err(e) => {
            tracing::warn!(request = %req.id, error = %e, "reference engine generation failed");
            events.send(Event::Error(StreamError::Internal(format!(
                "generation failed: {e}"
            ))))
        }
    };
}

/// Waits for room in the shared pool; `None` when the request was cancelled
/// (or its client left) while waiting.
fn reserve(
    shared: &SharedModel,
    req: &GenerateRequest,
    events: &EventSender,
) -> Option<Reservation> {
    let pool = &shared.kv_pool;
    let blocks = pool.blocks_for(req.prompt.len() + req.max_tokens as usize);
    loop {
        if req.cancel.is_cancelled() || events.is_closed() {
            return None;
        }
        match pool.try_reserve(blocks) {
            Ok(r) => return Some(r),
            // Checked at admission; the pool does not shrink.
            Err(PoolError::NeverFits { .. }) => return None,
            Err(PoolError::Exhausted) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

fn stopped(req: &GenerateRequest, events: &EventSender) -> bool {
    req.cancel.is_cancelled() || events.is_closed()
}

fn run_greedy(
    shared: &SharedModel,
    req: &GenerateRequest,
    events: &EventSender,
    pause: Duration,
) -> GenResult<Outcome> {
    let _device = shared.lock_device();
    let mut delivered = 0u32;
    let max = req.max_tokens as usize;
    let run = generate::greedy(
        &shared.model.model,
        &req.prompt,
        max,
        &req.stop_tokens,
        |id| {
            let event = Event::Token(TokenEvent {
                id,
                logprob: None,
                top_logprobs: Vec::new(),
            });
            if events.send(event).is_err() {
                return false;
            }
            delivered += 1;
            std::thread::sleep(pause);
            !req.cancel.is_cancelled()
        },
    )
    .map_err(|e| e.to_string())?;
    let reason = if stopped(req, events) {
        FinishReason::Cancelled
    } else if run.tokens.len() >= max {
        FinishReason::Length
    } else {
        FinishReason::Stop
    };
    Ok(Outcome { reason, delivered })
}

fn run_sampled(
    shared: &SharedModel,
    req: &GenerateRequest,
    events: &EventSender,
    pause: Duration,
) -> GenResult<Outcome> {
    let model = &shared.model.model;
    let vocab = model.config.vocab_size;
    let err = |e: mlx_rs::error::Exception| e.to_string();
    let mut sampler = Sampler::new(&req.sampling, vocab, &req.prompt).map_err(err)?;
    let mut cache = shared.new_cache(vec![0]);
    let mut logits = {
        let _device = shared.lock_device();
        generate::prefill(model, &mut cache, &req.prompt, DEFAULT_PREFILL_CHUNK)
            .map_err(|e| e.to_string())?
    };
    let mut delivered = 0u32;
    loop {
        if stopped(req, events) {
            return Ok(Outcome {
                reason: FinishReason::Cancelled,
                delivered,
            });
        }
        let _device = shared.lock_device();
        let row = logits.reshape(&[1, vocab]).map_err(err)?;
        let chosen = sampler
            .sample(&row)
            .map_err(err)?
            .as_dtype(Dtype::Int32)
            .map_err(err)?;
        let logprobs = if req.sampling.logprobs {
            Some(log_softmax(&sampler.adjust(&row).map_err(err)?).map_err(err)?)
        } else {
            None
        };
        eval([&chosen]).map_err(err)?;
        let id = chosen.item_exact::<i32>() as u32;
        if req.stop_tokens.contains(&id) {
            return Ok(Outcome {
                reason: FinishReason::Stop,
                delivered,
            });
        }
        let (logprob, top_logprobs) = match logprobs {
            Some(lp) => token_logprobs(&lp, id, req.sampling.top_logprobs as usize).map_err(err)?,
            None => (None, Vec::new()),
        };
        if events
            .send(Event::Token(TokenEvent {
                id,
                logprob,
                top_logprobs,
            }))
            .is_err()
        {
            return Ok(Outcome {
                reason: FinishReason::Cancelled,
                delivered,
            });
        }
        delivered += 1;
        std::thread::sleep(pause);
        if delivered >= req.max_tokens {
            return Ok(Outcome {
                reason: FinishReason::Length,
                delivered,
            });
        }
        sampler.observe(id).map_err(err)?;
        logits = model
            .forward(&generate::tokens_array(&[id]), &mut cache, Logits::Last)
            .map_err(|e| e.to_string())?;
    }
}

/// A token's log-probability and the most likely alternatives.
type TokenLogprobs = (Option<f32>, Vec<(u32, f32)>);

/// The chosen token's log-probability and the `top` most likely tokens.
fn token_logprobs(
    logprobs: &Array,
    id: u32,
    top: usize,
) -> Result<TokenLogprobs, mlx_rs::error::Exception> {
    eval([logprobs])?;
    let all: &[f32] = logprobs.as_slice::<f32>();
    let chosen = all.get(id as usize).copied();
    let mut best: Vec<(u32, f32)> = Vec::new();
    if top > 0 {
        let mut order: Vec<u32> = (0..all.len() as u32).collect();
        let k = top.min(order.len());
        order.select_nth_unstable_by(k - 1, |a, b| all[*b as usize].total_cmp(&all[*a as usize]));
        order.truncate(k);
        order.sort_by(|a, b| all[*b as usize].total_cmp(&all[*a as usize]));
        best = order.into_iter().map(|t| (t, all[t as usize])).collect();
    }
    Ok((chosen, best))
}
