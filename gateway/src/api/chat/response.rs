//! Chat completion responses: the whole message, or `chat.completion.chunk`
//! events (role first, then content / reasoning / tool-call deltas, then the
//! finish reason, then usage when asked for).

use serde_json::{json, Value};
use text::tools::ToolCall;
use text::Tokenizer;

use crate::api::logprobs;
use crate::api::sse::{self, ChunkFormat};
use crate::generation::{Batch, Summary};
use crate::pipeline::Delta;

fn tool_call_json(call: &ToolCall, index: Option<usize>) -> Value {
    let mut v = json!({
        "id": call.id,
        "type": "function",
        "function": { "name": call.name, "arguments": call.arguments },
    });
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

/// The non-streamed `chat.completion` object.
pub fn completion(
    id: &str,
    created: u64,
    model: &str,
    tokenizer: &Tokenizer,
    batch: &Batch,
    summary: &Summary,
) -> Value {
    let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for delta in &batch.deltas {
        match delta {
            Delta::Content(t) => content.push_str(t),
            Delta::Reasoning(t) => reasoning.push_str(t),
            Delta::ToolCall(c) => calls.push(tool_call_json(c, None)),
        }
    }
    let mut message = json!({ "role": "assistant", "content": content });
    if !calls.is_empty() && content.trim().is_empty() {
        message["content"] = Value::Null;
    }
    if !reasoning.is_empty() {
        message["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    let logprobs = if batch.logprobs.is_empty() {
        Value::Null
    } else {
        logprobs::chat(tokenizer, &batch.logprobs)
    };
    json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": summary.finish_reason.as_str(),
        }],
        "usage": summary.usage.to_json(),
    })
}

/// Streams `chat.completion.chunk`s.
#[derive(Clone)]
pub struct ChatChunks {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub include_usage: bool,
    pub tokenizer: Tokenizer,
    pub tool_calls: usize,
}

impl ChatChunks {
    fn chunk(&self, delta: Value, logprobs: Value, finish_reason: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason }],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

impl ChunkFormat for ChatChunks {
    fn opening(&mut self) -> Vec<Value> {
        vec![self.chunk(
            json!({ "role": "assistant", "content": "" }),
            Value::Null,
            Value::Null,
        )]
    }

    fn batch(&mut self, batch: &Batch) -> Vec<Value> {
        let mut out = Vec::new();
        // Logprobs ride on the first chunk of the batch they belong to.
        let mut logprobs = if batch.logprobs.is_empty() {
            Value::Null
        } else {
            logprobs::chat(&self.tokenizer, &batch.logprobs)
        };
        for delta in &batch.deltas {
            let d = match delta {
                Delta::Content(t) => json!({ "content": t }),
                Delta::Reasoning(t) => json!({ "reasoning_content": t }),
                Delta::ToolCall(c) => {
                    let index = self.tool_calls;
                    self.tool_calls += 1;
                    json!({ "tool_calls": [tool_call_json(c, Some(index))] })
                }
            };
            out.push(self.chunk(d, std::mem::take(&mut logprobs), Value::Null));
        }
        if !logprobs.is_null() {
            // Tokens that produced no text yet (a partial character).
            out.push(self.chunk(json!({}), logprobs, Value::Null));
        }
        out
    }

    fn closing(&mut self, summary: &Summary) -> Vec<Value> {
        let mut out = vec![self.chunk(
            json!({}),
            Value::Null,
            json!(summary.finish_reason.as_str()),
        )];
        if self.include_usage {
            out.push(sse::usage_chunk(
                &self.id,
                "chat.completion.chunk",
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
    use crate::generation::{FinishReason, Usage};

    fn tokenizer() -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        fixtures::tokenizer::write_tokenizer(dir.path(), fixtures::Family::Qwen3, 512).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    fn call() -> ToolCall {
        let (_, calls) = text::tools::parse_complete(
            text::tools::ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        );
        calls.into_iter().next().unwrap()
    }

    fn summary(reason: FinishReason) -> Summary {
        Summary {
            finish_reason: reason,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 5,
                ..Usage::default()
            },
        }
    }

    #[test]
    fn message_with_tool_calls_and_reasoning() {
        let (_d, tok) = tokenizer();
        let batch = Batch {
            deltas: vec![
                Delta::Reasoning("think".into()),
                Delta::Content("\n".into()),
                Delta::ToolCall(call()),
            ],
            ..Batch::default()
        };
        let v = completion(
            "chatcmpl-1",
            7,
            "m",
            &tok,
            &batch,
            &summary(FinishReason::ToolCalls),
        );
        let msg = &v["choices"][0]["message"];
        assert_eq!(msg["content"], Value::Null);
        assert_eq!(msg["reasoning_content"], "think");
        let call = &msg["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert!(call["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(call["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(v["usage"]["total_tokens"], 8);
    }

    #[test]
    fn stream_chunks_carry_tool_call_deltas_with_indexes() {
        let (_d, tok) = tokenizer();
        let mut chunks = ChatChunks {
            id: "c".into(),
            created: 1,
            model: "m".into(),
            include_usage: true,
            tokenizer: tok,
            tool_calls: 0,
        };
        let opening = chunks.opening();
        assert_eq!(opening[0]["choices"][0]["delta"]["role"], "assistant");
        let batch = Batch {
            deltas: vec![
                Delta::Content("a".into()),
                Delta::ToolCall(call()),
                Delta::ToolCall(call()),
            ],
            ..Batch::default()
        };
        let out = chunks.batch(&batch);
        assert_eq!(out.len(), 3);
        assert_eq!(out[0]["choices"][0]["delta"]["content"], "a");
        assert_eq!(out[1]["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
        assert_eq!(out[2]["choices"][0]["delta"]["tool_calls"][0]["index"], 1);
        assert!(out
            .iter()
            .all(|c| c["usage"].is_null() && c["object"] == "chat.completion.chunk"));
        let closing = chunks.closing(&summary(FinishReason::ToolCalls));
        assert_eq!(closing[0]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(closing[1]["choices"], json!([]));
        assert_eq!(closing[1]["usage"]["completion_tokens"], 5);
    }
}
