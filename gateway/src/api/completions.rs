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
use super::validate::{as_int, check_choices, gen_options, wrong_type, GenOptions, RawBody};
use super::{json_response, logprobs, random_id, sse, unix_now, with_route, ApiError};
use crate::generation::{Batch, Generation, Summary};
use crate::pipeline::Delta;
use crate::prepare;
use crate::state::SharedState;

/// A prompt as text or as token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// At least one.
    pub prompts: Vec<Prompt>,
    pub echo: bool,
    pub return_token_ids: bool,
    pub options: GenOptions,
}

impl CompletionRequest {
    pub fn parse(body: &RawBody, vocab: usize) -> Result<Self, ApiError> {
        let model = body.string("model")?.map(str::to_owned);
        let prompts = prompts(body, vocab)?;
        let echo = body.bool("echo")?.unwrap_or(false);
        let return_token_ids = body.bool("return_token_ids")?.unwrap_or(false);
        if body.string("suffix")?.is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("`suffix` is not supported", "suffix"));
        }
        let mut options = gen_options(body, vocab)?;
        if let Some(n) = body.int("logprobs")? {
            if !(0..=5).contains(&n) {
                return Err(ApiError::invalid(
                    format!("`logprobs` must be between 0 and 5, got {n}"),
                    "logprobs",
                ));
            }
            options.sampling.logprobs = true;
            options.sampling.top_logprobs = n as u32;
        }
        Ok(CompletionRequest {
            model,
            prompts,
            echo,
            return_token_ids,
            options,
        })
    }
}

/// `prompt`: a string, token ids, or a list of either.
fn prompts(body: &RawBody, vocab: usize) -> Result<Vec<Prompt>, ApiError> {
    let ids = |items: &[Value], param: &str| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|v| {
                as_int(v)
                    .filter(|&id| id >= 0 && (id as usize) < vocab)
                    .map(|id| id as u32)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            format!("`{param}` token ids must be integers in 0..{vocab}"),
                            param,
                        )
                    })
            })
            .collect()
    };
    let prompts = match body.get("prompt") {
        None => return Err(ApiError::invalid("`prompt` is required", "prompt")),
        Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
        Some(Value::Array(items)) => match items.first() {
            None => return Err(ApiError::invalid("`prompt` is empty", "prompt")),
            Some(Value::String(_) | Value::Array(_)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => Ok(Prompt::Text(s.clone())),
                    Value::Array(inner) => Ok(Prompt::Tokens(ids(inner, &format!("prompt[{i}]"))?)),
                    v => Err(wrong_type(
                        &format!("prompt[{i}]"),
                        "a string or an array of token ids",
                        v,
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(_) => vec![Prompt::Tokens(ids(items, "prompt")?)],
        },
        Some(v) => {
            return Err(wrong_type(
                "prompt",
                "a string, an array of strings or an array of token ids",
                v,
            ))
        }
    };
    let single = prompts.len() == 1;
    for (i, p) in prompts.iter().enumerate() {
        let empty = match p {
            Prompt::Text(t) => t.is_empty(),
            Prompt::Tokens(t) => t.is_empty(),
        };
        if empty {
            let param = if single {
                "prompt".to_owned()
            } else {
                format!("prompt[{i}]")
            };
            return Err(ApiError::invalid(format!("`{param}` is empty"), &param));
        }
    }
    Ok(prompts)
}

/// Text completion of a raw prompt, streamed when `stream` is true.
#[utoipa::path(
    post,
    path = "/v1/completions",
    request_body = crate::api::openapi::CompletionRequest,
    responses(
        (status = 200, description = "The completion (JSON), or `text/event-stream` chunks", body = crate::api::openapi::Completion),
        crate::api::openapi::GenerationErrors,
    ),
    security((), ("api_key" = []))
)]
pub async fn create(
    State(state): State<SharedState>,
    scope: Option<Extension<CacheScope>>,
    RawJson(body): RawJson,
) -> Result<Response, ApiError> {
    let mut request = CompletionRequest::parse(&body, state.model.vocab)?;
    state
        .model
        .fill_sampling(&body, &mut request.options.sampling);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<CompletionRequest, ApiError> {
        CompletionRequest::parse(&RawBody::parse(v.to_string().as_bytes()).unwrap(), 512)
    }

    #[test]
    fn prompt_shapes() {
        let prompts = |v| parse(v).unwrap().prompts;
        assert_eq!(
            prompts(json!({"prompt": "hi"})),
            [Prompt::Text("hi".into())]
        );
        assert_eq!(
            prompts(json!({"prompt": ["hi"]})),
            [Prompt::Text("hi".into())]
        );
        assert_eq!(
            prompts(json!({"prompt": [1, 2, 3]})),
            [Prompt::Tokens(vec![1, 2, 3])]
        );
        assert_eq!(
            prompts(json!({"prompt": [[4, 5]]})),
            [Prompt::Tokens(vec![4, 5])]
        );
        assert_eq!(
            prompts(json!({"prompt": ["a", [6], "b"]})),
            [
                Prompt::Text("a".into()),
                Prompt::Tokens(vec![6]),
                Prompt::Text("b".into())
            ]
        );
        let r = parse(json!({"prompt": "x", "logprobs": 2, "echo": true})).unwrap();
        assert!(r.echo && r.options.sampling.logprobs && r.options.sampling.top_logprobs == 2);
        assert!(!r.return_token_ids);
        assert!(
            parse(json!({"prompt": [1], "return_token_ids": true}))
                .unwrap()
                .return_token_ids
        );
    }

    #[test]
    fn bad_prompts() {
        for (input, param) in [
            (json!({}), "prompt"),
            (json!({"prompt": ""}), "prompt"),
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": 7}), "prompt"),
            (json!({"prompt": ["a", ""]}), "prompt[1]"),
            (json!({"prompt": [[1], []]}), "prompt[1]"),
            (json!({"prompt": ["a", 3]}), "prompt[1]"),
            (json!({"prompt": [[1], [2, 512]]}), "prompt[1]"),
            (json!({"prompt": [1, 512]}), "prompt"),
            (json!({"prompt": [1, -1]}), "prompt"),
            (json!({"prompt": [[1, "x"]]}), "prompt[0]"),
            (json!({"prompt": "x", "logprobs": 6}), "logprobs"),
            (json!({"prompt": "x", "logprobs": true}), "logprobs"),
            (json!({"prompt": "x", "suffix": "y"}), "suffix"),
            (json!({"prompt": "x", "best_of": 2}), "best_of"),
            (json!({"prompt": "x", "echo": 1}), "echo"),
            (
                json!({"prompt": "x", "return_token_ids": 1}),
                "return_token_ids",
            ),
        ] {
            let e = parse(input.clone()).unwrap_err();
            assert_eq!(e.param(), Some(param), "{input}: {e}");
        }
    }
}
