//! The OpenAI `/v1/completions` exchange with an upstream: the streamed
//! request body built from a validated request, and what each streamed
//! chunk carries back.

use engine_core::{FinishReason, GenerateRequest, SamplingParams};
use serde_json::{json, Map, Value};

use crate::config::Protocol;

/// The prompt as the upstream receives it.
pub enum WirePrompt<'a> {
    Ids(&'a [u32]),
    Text(&'a str),
}

/// A streaming completion request for `model`. Stop strings, templates and
/// detokenizing stay in this gateway: the upstream only generates.
pub fn completion_body(req: &GenerateRequest, model: &str, prompt: WirePrompt<'_>) -> Value {
    let mut body = json!({
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": true,
        "stream_options": { "include_usage": true },
    });
    match prompt {
        WirePrompt::Ids(ids) => {
            body["prompt"] = json!(ids);
            // vLLM's name for "put the generated ids in every chunk".
            body["return_token_ids"] = json!(true);
        }
        WirePrompt::Text(text) => body["prompt"] = json!(text),
    }
    sampling(&req.sampling, &mut body);
    body
}

/// Only what differs from the defaults is sent, so servers that lack a
/// knob are not handed it for nothing.
fn sampling(s: &SamplingParams, body: &mut Value) {
    body["temperature"] = json!(s.temperature);
    let defaults = SamplingParams::default();
    if s.top_p != defaults.top_p {
        body["top_p"] = json!(s.top_p);
    }
    if s.top_k != defaults.top_k {
        body["top_k"] = json!(s.top_k);
    }
    if s.min_p != defaults.min_p {
        body["min_p"] = json!(s.min_p);
    }
    if s.repetition_penalty != defaults.repetition_penalty {
        body["repetition_penalty"] = json!(s.repetition_penalty);
    }
    if s.presence_penalty != defaults.presence_penalty {
        body["presence_penalty"] = json!(s.presence_penalty);
    }
    if s.frequency_penalty != defaults.frequency_penalty {
        body["frequency_penalty"] = json!(s.frequency_penalty);
    }
    if !s.logit_bias.is_empty() {
        let bias: Map<String, Value> = s
            .logit_bias
            .iter()
            .map(|(id, b)| (id.to_string(), json!(b)))
            .collect();
        body["logit_bias"] = Value::Object(bias);
    }
    if let Some(seed) = s.seed {
        body["seed"] = json!(seed);
    }
    if s.logprobs {
        body["logprobs"] = json!(0);
    }
}

/// What the upstream's request cannot carry for this protocol, if
/// anything; the engine refuses such requests so the router falls back.
pub fn unsupported(req: &GenerateRequest, protocol: Protocol) -> Option<&'static str> {
    if req.sampling.top_logprobs > 0 {
        return Some("top_logprobs alternatives are not forwarded to remote upstreams");
    }
    if protocol == Protocol::Text && req.sampling.logprobs {
        return Some("logprobs are not forwarded to text-protocol upstreams");
    }
    None
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chunk {
    /// Generated ids (token-id protocol).
    pub token_ids: Vec<u32>,
    pub text: String,
    /// The chosen tokens' logprobs, aligned with `token_ids` when present.
    pub logprobs: Vec<Option<f32>>,
    pub finish: Option<FinishReason>,
    pub cached_tokens: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChunkError {
    #[error("upstream reported an error: {0}")]
    Upstream(String),
    #[error("upstream sent a chunk that is not a completion: {0}")]
    Malformed(String),
    #[error("upstream returned text without token ids (it ignores `return_token_ids`); configure it with `protocol: text`")]
    NoTokenIds,
}

pub fn parse_chunk(data: &str, protocol: Protocol) -> Result<Chunk, ChunkError> {
    let v: Value =
        serde_json::from_str(data).map_err(|e| ChunkError::Malformed(format!("{e}: {data}")))?;
    if let Some(err) = v.get("error") {
        return Err(ChunkError::Upstream(error_message(err)));
    }
    let mut chunk = Chunk {
        cached_tokens: v
            .pointer("/usage/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .map(|n| n as u32),
        ..Chunk::default()
    };
    let Some(choice) = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
    else {
        // The usage chunk has no choices.
        return Ok(chunk);
    };
    chunk.text = choice
        .get("text")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    chunk.finish = match choice.get("finish_reason") {
        None | Some(Value::Null) => None,
        Some(Value::String(r)) if r == "length" => Some(FinishReason::Length),
        Some(Value::String(r)) if r == "stop" || r == "eos" || r == "tool_calls" => {
            Some(FinishReason::Stop)
        }
        Some(other) => {
            return Err(ChunkError::Upstream(format!(
                "the upstream ended generation with finish_reason {other}"
            )))
        }
    };
    if protocol == Protocol::TokenIds {
        match choice.get("token_ids") {
            Some(Value::Array(ids)) => {
                chunk.token_ids = ids
                    .iter()
                    .map(|id| {
                        id.as_u64()
                            .and_then(|id| u32::try_from(id).ok())
                            .ok_or_else(|| ChunkError::Malformed(format!("token id {id}")))
                    })
                    .collect::<Result<_, _>>()?;
            }
            Some(Value::Null) | None if chunk.text.is_empty() => {}
            _ => return Err(ChunkError::NoTokenIds),
        }
        if let Some(lps) = choice
            .pointer("/logprobs/token_logprobs")
            .and_then(Value::as_array)
        {
            chunk.logprobs = lps.iter().map(|l| l.as_f64().map(|l| l as f32)).collect();
        }
    }
    Ok(chunk)
}

/// The message of an OpenAI-style error (`{"message": ...}`), or a plain
/// string error (`mlx_lm.server`).
pub fn error_message(err: &Value) -> String {
    match err {
        Value::String(s) => s.clone(),
        other => other
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_for_ids_and_text() {
        let mut req = GenerateRequest::new(vec![1, 2, 3], 7);
        req.sampling.top_k = 5;
        req.sampling.seed = Some(9);
        req.sampling.logit_bias = vec![(4, -1.0)];
        let b = completion_body(&req, "m", WirePrompt::Ids(&req.prompt));
        assert_eq!(b["prompt"], json!([1, 2, 3]));
        assert_eq!(b["return_token_ids"], json!(true));
        assert_eq!(b["stream"], json!(true));
        assert_eq!(b["max_tokens"], json!(7));
        assert_eq!(b["top_k"], json!(5));
        assert_eq!(b["seed"], json!(9));
        assert_eq!(b["logit_bias"], json!({"4": -1.0}));
        assert!(b.get("top_p").is_none() && b.get("logprobs").is_none());
        let t = completion_body(&req, "m", WirePrompt::Text("hi"));
        assert_eq!(t["prompt"], json!("hi"));
        assert!(t.get("return_token_ids").is_none());
    }

    #[test]
    fn chunks_with_ids_finish_and_usage() {
        let c = parse_chunk(
            r#"{"choices":[{"index":0,"text":"ab","token_ids":[5,6],"finish_reason":null,"logprobs":{"token_logprobs":[-0.5,-1.0]}}]}"#,
            Protocol::TokenIds,
        )
        .unwrap();
        assert_eq!(c.token_ids, vec![5, 6]);
        assert_eq!(c.logprobs, vec![Some(-0.5), Some(-1.0)]);
        assert_eq!(c.finish, None);
        let end = parse_chunk(
            r#"{"choices":[{"text":"","finish_reason":"length"}]}"#,
            Protocol::TokenIds,
        )
        .unwrap();
        assert_eq!(end.finish, Some(FinishReason::Length));
        let usage = parse_chunk(
            r#"{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":2}}}"#,
            Protocol::TokenIds,
        )
        .unwrap();
        assert_eq!(usage.cached_tokens, Some(2));
        let text = parse_chunk(
            r#"{"choices":[{"text":" hi","finish_reason":"stop"}]}"#,
            Protocol::Text,
        )
        .unwrap();
        assert_eq!(
            (text.text.as_str(), text.finish),
            (" hi", Some(FinishReason::Stop))
        );
    }

    #[test]
    fn chunk_errors() {
        assert_eq!(
            parse_chunk(r#"{"choices":[{"text":"x"}]}"#, Protocol::TokenIds),
            Err(ChunkError::NoTokenIds)
        );
        assert_eq!(
            parse_chunk(
                r#"{"error":{"message":"boom","type":"server_error"}}"#,
                Protocol::TokenIds
            ),
            Err(ChunkError::Upstream("boom".into()))
        );
        assert!(matches!(
            parse_chunk("nope", Protocol::Text),
            Err(ChunkError::Malformed(_))
        ));
        assert!(parse_chunk(
            r#"{"choices":[{"text":"","finish_reason":"abort"}]}"#,
            Protocol::Text
        )
        .is_err());
    }

    #[test]
    fn refuses_what_cannot_be_forwarded() {
        let mut req = GenerateRequest::new(vec![1], 1);
        assert!(unsupported(&req, Protocol::Text).is_none());
        req.sampling.logprobs = true;
        assert!(unsupported(&req, Protocol::TokenIds).is_none());
        assert!(unsupported(&req, Protocol::Text).is_some());
        req.sampling.top_logprobs = 2;
        assert!(unsupported(&req, Protocol::TokenIds).is_some());
    }
}
