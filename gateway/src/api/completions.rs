//! `POST /v1/completions`: a raw prompt (text or token ids), or a list of
//! them, no chat template, no reasoning or tool parsing. `n` choices of
//! each prompt, indexed prompt by prompt (`suffix` and `best_of` > 1 are
//! rejected). `return_token_ids` (vLLM's extension) adds each choice's
//! generated ids as `token_ids`, so another gateway's remote engine can use
//! this one as an upstream.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde_json::{json, Value};
use text::Tokenizer;

use super::body::{CacheScope, RawJson};
use super::choices::Choices;
use super::sse::ChunkFormat;
use super::{json_response, logprobs, random_id, sse, unix_now, with_route, ApiError};
use crate::generation::{Batch, Generation, Summary};
use crate::pipeline::Delta;
use crate::prepare;
use crate::protocol::completions::CompletionRequest;
use crate::protocol::options::check_choices;
use crate::state::SharedState;

/// Text completion of a raw prompt, streamed when `stream` is true.
#[utoipa::path(
    post,
    path = "/v1/completions",
    request_body = crate::protocol::completions::CompletionBody,
    responses(
        (status = 200, description = "The completion (JSON), or `text/event-stream` chunks", body = crate::protocol::Completion),
        crate::protocol::error::GenerationErrors,
    ),
    security((), ("api_key" = []))
)]
pub async fn create(
    State(state): State<SharedState>,
    scope: Option<Extension<CacheScope>>,
    RawJson(body): RawJson,
) -> Result<Response, ApiError> {
    let mut request = CompletionRequest::parse(&body, state.model.vocab)?;
    state.model.fill_sampling(&mut request.options);
    let n = request.options.n;
    check_choices(n, request.prompts.len(), state.config.server.max_n)?;
    let scope = scope.map(|Extension(s)| s.0);
    let mut prepared = Vec::with_capacity(request.prompts.len());
    for prompt in &request.prompts {
        prepared.push(prepare::completion(&state, &request, prompt, scope.clone()).await?);
    }
    let model = prepared[0].0.model.clone();
    let tokenizer: Tokenizer = (*state.registry.shared.model.tokenizer).clone();
    let chunks = |echo: String| CompletionChunks {
        id: random_id("cmpl-"),
        created: unix_now(),
        model: model.clone(),
        include_usage: request.options.include_usage,
        tokenizer: tokenizer.clone(),
        echo: if request.echo { echo } else { String::new() },
        offset: 0,
        return_token_ids: request.return_token_ids,
    };
    if prepared.len() > 1 || n > 1 {
        let first = chunks(String::new());
        let mut formats = Vec::new();
        for (_, text) in &prepared {
            for _ in 0..n {
                // One response: every choice under the first one's id.
                formats.push(CompletionChunks {
                    id: first.id.clone(),
                    created: first.created,
                    ..chunks(text.clone())
                });
            }
        }
        let wholes = formats.clone();
        let whole =
            |i: usize, batch: &Batch, summary: &Summary| wholes[i].clone().whole(batch, summary);
        let (prompts, _): (Vec<_>, Vec<_>) = prepared.into_iter().unzip();
        let choices = Choices::start(&state, prompts, n).await?;
        return Ok(choices
            .respond(request.options.stream, formats, whole)
            .await);
    }
    let (prepared, text) = prepared.pop().expect("one prompt");
    let generation = Generation::start(&state, prepared)?;
    let (engine, rule) = (generation.engine.clone(), generation.rule.clone());
    let chunks = chunks(text);
    let response = if request.options.stream {
        sse::response(generation, chunks)
    } else {
        // Errors after routing still say which engine and rule they met.
        match generation.collect().await {
            Ok((batch, summary)) => json_response(StatusCode::OK, &chunks.whole(&batch, &summary)),
            Err(e) => e.into_response(),
        }
    };
    Ok(with_route(response, &engine, &rule))
}

fn text_of(batch: &Batch) -> String {
    batch
        .deltas
        .iter()
        .filter_map(|d| match d {
            Delta::Content(t) | Delta::Reasoning(t) => Some(t.as_str()),
            Delta::ToolCall(_) => None,
        })
        .collect()
}

/// `text_completion` objects, whole or as stream chunks.
#[derive(Clone)]
pub struct CompletionChunks {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    tokenizer: Tokenizer,
    /// The prompt text when `echo` is set.
    echo: String,
    /// Bytes of text emitted so far (for `text_offset`).
    offset: usize,
    return_token_ids: bool,
}

impl CompletionChunks {
    fn object(
        &self,
        text: &str,
        token_ids: &[u32],
        logprobs: Value,
        finish_reason: Value,
    ) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason }],
        });
        if self.return_token_ids {
            v["choices"][0]["token_ids"] = json!(token_ids);
        }
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn logprobs(&self, batch: &Batch) -> Value {
        if batch.logprobs.is_empty() {
            Value::Null
        } else {
            logprobs::completion(&self.tokenizer, &batch.logprobs, self.offset)
        }
    }

    fn whole(mut self, batch: &Batch, summary: &Summary) -> Value {
        self.include_usage = false;
        self.offset = self.echo.len();
        let text = format!("{}{}", self.echo, text_of(batch));
        let mut v = self.object(
            &text,
            &batch.token_ids,
            self.logprobs(batch),
            json!(summary.finish_reason.as_str()),
        );
        v["usage"] = summary.usage.to_json();
        v
    }
}

impl ChunkFormat for CompletionChunks {
    fn opening(&mut self) -> Vec<Value> {
        if self.echo.is_empty() {
            return Vec::new();
        }
        let echo = std::mem::take(&mut self.echo);
        self.offset = echo.len();
        vec![self.object(&echo, &[], Value::Null, Value::Null)]
    }

    fn batch(&mut self, batch: &Batch) -> Vec<Value> {
        let text = text_of(batch);
        let ids_due = self.return_token_ids && !batch.token_ids.is_empty();
        if text.is_empty() && batch.logprobs.is_empty() && !ids_due {
            return Vec::new();
        }
        let chunk = self.object(&text, &batch.token_ids, self.logprobs(batch), Value::Null);
        self.offset += text.len();
        vec![chunk]
    }

    fn closing(&mut self, summary: &Summary) -> Vec<Value> {
        let mut out =
            vec![self.object("", &[], Value::Null, json!(summary.finish_reason.as_str()))];
        if self.include_usage {
            out.push(sse::usage_chunk(
                &self.id,
                "text_completion",
                self.created,
                &self.model,
                summary,
            ));
        }
        out
    }
}
