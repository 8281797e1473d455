//! One generation from routing to the last delta, shared by chat and
//! completions, streaming or not: routes the validated request, runs the
//! engine's token events through the text pipeline, and accounts usage and
//! metrics. Dropping a `Generation` early cancels it in its engine.

use std::time::Instant;

use engine_core::{Event, FinishReason as EngineFinish, SpecStats, StreamError, TokenEvent};
use serde_json::{json, Value};

use crate::api::ApiError;
use crate::host::FaultKind;
use crate::pipeline::{push_delta, Delta, Pipeline};
use crate::prepare::Prepared;
use crate::router::CancelGuard;
use crate::state::AppState;
use crate::telemetry::metric;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
    pub reasoning_tokens: u32,
    /// Draft accounting when a speculative engine served the request.
    pub spec: Option<SpecStats>,
}

impl Usage {
    pub fn to_json(self) -> Value {
        let mut usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": { "cached_tokens": self.cached_tokens },
            "completion_tokens_details": { "reasoning_tokens": self.reasoning_tokens },
        });
        if let Some(spec) = self.spec {
            // OpenAI's names for predicted-output tokens, plus the details.
            let details = &mut usage["completion_tokens_details"];
            details["accepted_prediction_tokens"] = json!(spec.accepted);
            details["rejected_prediction_tokens"] = json!(spec.drafted - spec.accepted);
            usage["speculative"] = json!({
                "drafted_tokens": spec.drafted,
                "accepted_tokens": spec.accepted,
                "acceptance_rate": ratio(spec.accepted, spec.drafted),
                "target_forwards": spec.target_forwards,
                "tokens_per_target_forward": ratio(self.completion_tokens as u64, spec.target_forwards),
            });
        }
        usage
    }
}

impl Usage {
    /// The usage of several choices together: each prompt counted once
    /// (with the cached tokens of the choice that `leads` it, which
    /// prefilled it), the generated tokens of all.
    pub fn merged(choices: impl IntoIterator<Item = (bool, Usage)>) -> Usage {
        let mut all = Usage::default();
        for (leads, u) in choices {
            if leads {
                all.prompt_tokens += u.prompt_tokens;
                all.cached_tokens += u.cached_tokens;
            }
            all.completion_tokens += u.completion_tokens;
            all.reasoning_tokens += u.reasoning_tokens;
            all.spec = match (all.spec, u.spec) {
                (Some(a), Some(b)) => Some(SpecStats {
                    drafted: a.drafted + b.drafted,
                    accepted: a.accepted + b.accepted,
                    target_forwards: a.target_forwards + b.target_forwards,
                }),
                (a, b) => a.or(b),
            };
        }
        all
    }
}

/// `a / b` rounded to 4 places; 0 when nothing was counted.
fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        return 0.0;
    }
    (a as f64 / b as f64 * 1e4).round() / 1e4
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    pub finish_reason: FinishReason,
    pub usage: Usage,
}

/// What arrived since the last call: text deltas, the tokens' logprobs
/// (when asked for), and the summary once generation is over.
#[derive(Debug, Default)]
pub struct Batch {
    pub deltas: Vec<Delta>,
    pub logprobs: Vec<TokenEvent>,
    /// The generated token ids, for clients that ask for them.
    pub token_ids: Vec<u32>,
    pub done: Option<Summary>,
}

/// Most events folded into one batch, so a fast engine still streams.
const MAX_EVENTS_PER_BATCH: usize = 64;

pub struct Generation {
    pub engine: String,
    pub rule: String,
    events: engine_core::EventStream,
    /// The first event, taken early by [`Generation::started`].
    peeked: Option<Option<Event>>,
    guard: CancelGuard,
    pipeline: Pipeline,
    prompt_tokens: u32,
    want_logprobs: bool,
    started: Instant,
    first_token: bool,
    done: bool,
}

impl Generation {
    /// Routes the prepared request to an engine.
    pub fn start(state: &AppState, prepared: Prepared) -> Result<Self, ApiError> {
        let Prepared {
            model,
            request,
            text,
        } = prepared;
        let tokenizer = (*state.registry.shared.model.tokenizer).clone();
        let pipeline = Pipeline::new(tokenizer, &request.prompt, &text);
        let prompt_tokens = request.prompt.len() as u32;
        let want_logprobs = request.sampling.logprobs;
        let routed = state.router.route(request, &model)?;
        Ok(Generation {
            engine: routed.entry.name.clone(),
            rule: routed.rule,
            events: routed.events,
            peeked: None,
            guard: routed.guard,
            pipeline,
            prompt_tokens,
            want_logprobs,
            started: Instant::now(),
            first_token: false,
            done: false,
        })
    }

    /// Waits for the engine's first event: by then the prompt is
    /// prefilled and in the shared prefix cache, where requests sharing it
    /// find it. The event is kept for [`Generation::next`].
    pub async fn started(&mut self) {
        if self.peeked.is_none() && !self.done {
            self.peeked = Some(self.events.recv().await);
        }
    }

    /// The next batch, `None` after the last one (or after an error).
    pub async fn next(&mut self) -> Option<Result<Batch, ApiError>> {
        if self.done {
            return None;
        }
        let mut event = match self.peeked.take() {
            Some(event) => event,
            None => self.events.recv().await,
        };
        let mut batch = Batch::default();
        for _ in 0..MAX_EVENTS_PER_BATCH {
            match event {
                Some(Event::Token(token)) => {
                    if let Some(done) = self.on_token(token, &mut batch) {
                        return Some(done.map(|()| batch));
                    }
                }
                Some(Event::Finished(finish)) => return Some(self.on_finish(finish, batch)),
                Some(Event::Error(error)) => {
                    self.end("error");
                    return Some(Err(self.stream_error(error)));
                }
                None => {
                    self.end("error");
                    let message = "the engine stopped without finishing the request";
                    self.guard.fault(FaultKind::LostStream, message);
                    return Some(Err(ApiError::Engine(message.into())));
                }
            }
            match self.events.try_recv() {
                Ok(next) => event = Some(next),
                Err(_) => break,
            }
        }
        Some(Ok(batch))
    }

    /// What the client sees of an engine's error event. Only an internal
    /// failure is a fault against the engine; capacity and the request's
    /// own input are not the engine's.
    fn stream_error(&mut self, error: StreamError) -> ApiError {
        match error {
            StreamError::Invalid(message) => {
                self.guard.disarm();
                ApiError::invalid_no_param(message)
            }
            StreamError::Overloaded(message) => {
                self.guard.disarm();
                tracing::info!(engine = %self.engine, reason = %message, "engine overloaded after admission");
                ApiError::Overloaded
            }
            StreamError::Internal(message) => {
                self.guard.fault(FaultKind::RequestError, &message);
                ApiError::Engine(message)
            }
        }
    }

    /// Runs to the end: every delta and logprob, and the summary.
    pub async fn collect(mut self) -> Result<(Batch, Summary), ApiError> {
        let mut all = Batch::default();
        while let Some(batch) = self.next().await {
            let batch = batch?;
            for delta in batch.deltas {
                push_delta(&mut all.deltas, delta);
            }
            all.logprobs.extend(batch.logprobs);
            all.token_ids.extend(batch.token_ids);
            if let Some(summary) = batch.done {
                all.done = Some(summary);
                return Ok((all, summary));
            }
        }
        Err(ApiError::Engine(
            "the generation ended without a result".into(),
        ))
    }

    /// `Some` when this token ended the generation (a stop string).
    fn on_token(&mut self, token: TokenEvent, batch: &mut Batch) -> Option<Result<(), ApiError>> {
        if !self.first_token {
            self.first_token = true;
            metrics::histogram!(metric::TTFT, "engine" => self.engine.clone())
                .record(self.started.elapsed().as_secs_f64());
        }
        let step = match self.pipeline.push(token.id) {
            Ok(step) => step,
            Err(e) => {
                self.end("error");
                return Some(Err(ApiError::Internal(e.to_string())));
            }
        };
        for delta in step.deltas {
            push_delta(&mut batch.deltas, delta);
        }
        batch.token_ids.push(token.id);
        if self.want_logprobs {
            batch.logprobs.push(token);
        }
        if step.stopped {
            // The stop string is the end; the engine need not go on.
            self.guard.cancel();
            let usage = self.usage(self.pipeline.tokens(), 0);
            batch.done = Some(self.summarize(FinishReason::Stop, usage));
            return Some(Ok(()));
        }
        None
    }

    fn on_finish(
        &mut self,
        finish: engine_core::Finish,
        mut batch: Batch,
    ) -> Result<Batch, ApiError> {
        self.guard.disarm();
        let tail = match self.pipeline.finish() {
            Ok(tail) => tail,
            Err(e) => {
                self.end("error");
                return Err(ApiError::Internal(e.to_string()));
            }
        };
        for delta in tail {
            push_delta(&mut batch.deltas, delta);
        }
        let reason = match finish.reason {
            EngineFinish::Stop if self.pipeline.tool_calls() > 0 => FinishReason::ToolCalls,
            EngineFinish::Stop => FinishReason::Stop,
            EngineFinish::Length => FinishReason::Length,
            EngineFinish::Cancelled => {
                self.end("cancelled");
                return Err(ApiError::Interrupted);
            }
        };
        let mut usage = self.usage(finish.completion_tokens, finish.cached_tokens);
        usage.spec = finish.spec;
        batch.done = Some(self.summarize(reason, usage));
        Ok(batch)
    }

    fn usage(&self, completion_tokens: u32, cached_tokens: u32) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            cached_tokens,
            reasoning_tokens: self.pipeline.reasoning_tokens().min(completion_tokens),
            spec: None,
        }
    }

    fn summarize(&mut self, reason: FinishReason, usage: Usage) -> Summary {
        self.end(reason.as_str());
        let engine = self.engine.clone();
        metrics::counter!(metric::PROMPT_TOKENS, "engine" => engine.clone())
            .increment(usage.prompt_tokens as u64);
        metrics::counter!(metric::COMPLETION_TOKENS, "engine" => engine.clone())
            .increment(usage.completion_tokens as u64);
        if let Some(spec) = usage.spec {
            metrics::counter!(metric::SPEC_DRAFTED, "engine" => engine.clone())
                .increment(spec.drafted);
            metrics::counter!(metric::SPEC_ACCEPTED, "engine" => engine.clone())
                .increment(spec.accepted);
            metrics::counter!(metric::SPEC_TARGET_FORWARDS, "engine" => engine)
                .increment(spec.target_forwards);
        }
        Summary {
            finish_reason: reason,
            usage,
        }
    }

    fn end(&mut self, outcome: &'static str) {
        if self.done {
            return;
        }
        self.done = true;
        metrics::counter!(metric::GENERATIONS, "engine" => self.engine.clone(), "rule" => self.rule.clone(), "finish" => outcome)
            .increment(1);
        metrics::histogram!(metric::GENERATION_DURATION, "engine" => self.engine.clone())
            .record(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        // Not finished: the client left or timed out. The guard, dropped
        // next, cancels the request in the engine.
        if !self.done {
            self.end("cancelled");
        }
    }
}
