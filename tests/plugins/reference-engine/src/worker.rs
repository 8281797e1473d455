//! The worker thread: one request at a time, start to finish, through the
//! runtime's `Sequence`: its prompt from the prefix cache's longest hit,
//! each token under its rules (stop tokens, cancellation, `max_tokens`,
//! the final event after the KV blocks go back).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use engine_core::event::EventSender;
use engine_core::{Event, FinishReason, GenerateRequest, StreamError, TokenEvent};
use mlx_rs::transforms::eval;
use mlx_rs::Dtype;
use runtime::generate;
use runtime::model::Logits;
use runtime::sampling;
use runtime::sequence::Sequence;
use runtime::worker::{self, Cancels};
use runtime::{Reservation, SharedModel};

use crate::engine::State;
use crate::options::{Fault, Options};

pub struct Job {
    pub req: GenerateRequest,
    /// KV blocks for its prompt and `max_tokens`.
    pub blocks: usize,
    pub events: EventSender,
}

impl worker::Job for Job {
    fn request(&self) -> &GenerateRequest {
        &self.req
    }
}

pub fn run(
    shared: Arc<SharedModel>,
    state: Arc<State>,
    jobs: worker::Receiver<Job>,
    cancels: Cancels,
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
        cancels.remove(id);
    }
}

/// The engine's count of KV blocks held, cleared when the sequence gives
/// its blocks back (before its final event: a client that reads the pool
/// right after sees them returned).
struct BlocksHeld(Arc<State>);

impl Drop for BlocksHeld {
    fn drop(&mut self) {
        self.0.kv_blocks.store(0, Ordering::Release);
    }
}

fn serve(
    shared: &SharedModel,
    state: &Arc<State>,
    job: Job,
    options: &Options,
    fault: Option<Fault>,
) {
    let Job {
        req,
        blocks,
        events,
    } = job;
    let Some(reservation) = reserve(shared, &req, blocks, &events) else {
        let mut cancelled = runtime::emit::Emitter::new(req, events);
        cancelled.finish(FinishReason::Cancelled, None);
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
    tracing::debug!(request = %req.id, prompt_tokens = req.prompt.len(), max_tokens = req.max_tokens, "reference engine started a request");
    let Some(mut seq) = Sequence::start_on(shared, req, events, reservation) else {
        return;
    };
    seq.hold(BlocksHeld(state.clone()));
    let pause = Duration::from_millis(options.token_delay_ms);
    let result = if seq.request().is_plain_greedy() {
        let _device = shared.lock_device();
        seq.decode(shared, || std::thread::sleep(pause))
    } else {
        run_sampled(shared, &mut seq, pause)
    };
    match result {
        Ok(reason) => seq.finish(reason, None),
        Err(e) => {
            tracing::warn!(request = %seq.request().id, error = %e, "reference engine generation failed");
            seq.fail(StreamError::Internal(format!("generation failed: {e}")));
        }
    }
}

/// Waits for `blocks` of the shared pool (woken by every release and by
/// the worker at a cancellation); `None` when the request was cancelled
/// (or its client left) while waiting.
fn reserve(
    shared: &SharedModel,
    req: &GenerateRequest,
    blocks: usize,
    events: &EventSender,
) -> Option<Reservation> {
    let stop = || req.cancel.is_cancelled() || events.is_closed();
    // Checked at admission; the pool does not shrink.
    shared.kv_pool.reserve_waiting(blocks, stop).ok().flatten()
}

/// Sampling (penalties, logit bias, logprobs) through the sequence's
/// sampler, one step at a time, from the prefix cache's longest hit.
fn run_sampled(
    shared: &SharedModel,
    seq: &mut Sequence,
    pause: Duration,
) -> runtime::Result<FinishReason> {
    let model = &shared.model.model;
    let vocab = model.config.vocab_size;
    let (mut cache, mut logits) = {
        let _device = shared.lock_device();
        seq.prefill_logits(shared)?
    };
    let (logprobs, top) = {
        let s = &seq.request().sampling;
        (s.logprobs, s.top_logprobs as usize)
    };
    loop {
        let _device = shared.lock_device();
        let row = logits.reshape(&[1, vocab])?;
        let chosen = seq.sampler.sample(&row)?.as_dtype(Dtype::Int32)?;
        let lp = match logprobs {
            true => Some(seq.sampler.logprobs(&row)?),
            false => None,
        };
        eval(lp.iter().chain([&chosen]))?;
        let id = chosen.item_exact::<i32>() as u32;
        let (logprob, top_logprobs) = match lp {
            Some(lp) => sampling::token_logprobs(lp.as_slice::<f32>(), id, top),
            None => (None, Vec::new()),
        };
        let token = TokenEvent {
            id,
            logprob,
            top_logprobs,
        };
        if let Some(reason) = seq.accept(token, false)? {
            seq.publish_answer(shared, &cache);
            return Ok(reason);
        }
        std::thread::sleep(pause);
        logits = model.forward(&generate::tokens_array(&[id]), &mut cache, Logits::Last)?;
    }
}
