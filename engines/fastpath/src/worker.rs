//! The decode loop of one fast-path request, on the engine's worker thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use engine_core::event::EventSender;
use engine_core::{FinishReason, GenerateRequest, SamplingParams, StreamError};
use runtime::emit::Emitter;
use runtime::generate::{self, GreedyStream};
use runtime::handover::{Handover, HandoverSink};
use runtime::model::Logits;
use runtime::sampling::{self, Sampler};
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
    let constraint = match compile(shared, &out.request) {
        Ok(c) => c,
        Err(message) => {
            drop(reservation);
            slot.store(false, Ordering::Release);
            out.fail(StreamError::Invalid(message));
            return Outcome::Failed;
        }
    };
    let decoded = match constraint {
        Some(c) => decode_constrained(shared, &mut out, c),
        None => decode(shared, &mut out),
    };
    match decoded {
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
            match Handover::of(out, cache, last_token, reservation).give_to(&*sink) {
                true => Outcome::HandedOver,
                false => Outcome::Failed,
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
    let _device = shared.lock_device();
    let model = &shared.model.model;
    let max_tokens = out.request.max_tokens;
    let scope = out.request.cache_scope.clone();
    // The prompt, then every token read: what the cache holds, in order.
    let mut seen = out.request.prompt.clone();
    let (mut cache, cached) =
        match shared
            .prefix
            .lookup(scope.as_deref(), &seen, model.num_layers())
        {
            Some(hit) => (hit.cache, hit.tokens),
            None => (shared.new_cache(vec![0]), 0),
        };
    out.set_cached_tokens(cached as u32);
    let mut from = cached;
    // A hybrid model's prefix is kept as a snapshot of the prompt's last
    // block boundary, so the prefill stops there first.
    if let Some(at) = shared
        .prefix
        .snapshot_at(seen.len())
        .filter(|&at| from < at)
    {
        generate::prefill(model, &mut cache, &seen[from..at], shared.prefill_chunk())?;
        shared.prefix.insert(scope.as_deref(), &seen[..at], &cache);
        from = at;
    }
    let mut stream = GreedyStream::resume(model, cache, &seen[from..], shared.prefill_chunk())?;
    // The prompt now, for requests sharing it (n > 1); the answer at the end.
    shared
        .prefix
        .insert(scope.as_deref(), &seen, stream.cache());
    // When the first token was read: the decode rate on this side of HTTP,
    // to set beside the client's figures.
    let mut first_read = None;
    loop {
        let hand_over = shared.handover_sink().filter(|s| s.busy());
        // Queue the next step unless this is the last token we may need or
        // we are about to hand over.
        let token = stream.next_token(hand_over.is_none() && out.generated() + 1 < max_tokens)?;
        seen.push(token);
        let since = *first_read.get_or_insert_with(Instant::now);
        let end = out.plain(token);
        let read = seen.len() - out.request.prompt.len();
        if end.is_some() && read > 1 {
            let tok_s = (read - 1) as f64 / since.elapsed().as_secs_f64();
            tracing::debug!(tokens = read, tok_s, "fast path decode");
        }
        if end.is_some() || hand_over.is_some() {
            // Published before the final event: the chat's next turn,
            // sent the moment this one ends, starts from it.
            shared
                .prefix
                .insert(scope.as_deref(), &seen, stream.cache());
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

fn compile(
    shared: &SharedModel,
    request: &GenerateRequest,
) -> Result<Option<grammar::Constraint>, String> {
    let Some(g) = &request.grammar else {
        return Ok(None);
    };
    let compiler = shared.grammars()?;
    let constraint = compiler
        .compile(g)
        .map_err(|e| format!("{}: {e}", request.id))?;
    Ok(Some(constraint))
}

/// A constrained request: each token is the argmax among those its grammar
/// allows, so no step is queued ahead, and the grammar's state cannot be
/// handed over: the request finishes here. The device lock is taken per
/// step, so the batched engine's work interleaves meanwhile.
fn decode_constrained(
    shared: &Arc<SharedModel>,
    out: &mut Emitter,
    mut constraint: grammar::Constraint,
) -> anyhow::Result<End> {
    let model = &shared.model.model;
    let vocab = shared.model.vocab_size();
    let mut argmax = Sampler::new(&SamplingParams::greedy(), vocab as i32, &[])?;
    let mut cache = shared.new_cache(vec![0]);
    let mut logits = {
        let _device = shared.lock_device();
        generate::prefill(
            model,
            &mut cache,
            &out.request.prompt,
            shared.prefill_chunk(),
        )?
    };
    loop {
        let Some(allowed) = constraint.allowed() else {
            return Ok(End::Done(FinishReason::Stop));
        };
        let _device = shared.lock_device();
        let token = argmax
            .sample_within(&logits, &sampling::allowed_mask(&allowed.to_bools(vocab)))?
            .item_exact::<u32>();
        if constraint.is_end(token) {
            return Ok(End::Done(FinishReason::Stop));
        }
        if let Some(reason) = out.plain(token) {
            return Ok(End::Done(reason));
        }
        if !constraint.commit(token) {
            return Ok(End::Done(FinishReason::Stop));
        }
        logits = model.forward(&generate::tokens_array(&[token]), &mut cache, Logits::Last)?;
    }
}
