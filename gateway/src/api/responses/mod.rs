//! `POST /v1/responses`: OpenAI's Responses API over the same generation as
//! chat. The output is a list of items: a `reasoning` item (models that
//! think), a `message` with one `output_text` part, `function_call` items.
//! Streamed, it is the documented event sequence: `response.created`,
//! `response.in_progress`, per item `response.output_item.added`, its
//! deltas (`response.reasoning_text.delta`, `response.output_text.delta`
//! inside `response.content_part.added`/`.done`,
//! `response.function_call_arguments.delta`/`.done`),
//! `response.output_item.done`, then `response.completed` (or
//! `response.incomplete` at `max_output_tokens`) with the whole response.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde_json::{json, Map, Value};
use text::tools::ToolCall;

use super::body::{CacheScope, RawJson};
use super::sse::ChunkFormat;
use super::{json_response, random_id, sse, unix_now, with_route, ApiError};
use crate::generation::{Batch, FinishReason, Generation, Summary, Usage};
use crate::pipeline::Delta;
use crate::prepare;
use crate::protocol::responses::ResponsesRequest;
use crate::state::SharedState;

/// Create a response, streamed as server-sent events when `stream` is true.
#[utoipa::path(
    post,
    path = "/v1/responses",
    request_body = crate::protocol::responses::ResponsesBody,
    responses(
        (status = 200, description = "The response object (JSON), or `text/event-stream` events", body = crate::protocol::ResponseObject),
        crate::protocol::error::GenerationErrors,
    ),
    security((), ("api_key" = []))
)]
pub async fn create(
    State(state): State<SharedState>,
    scope: Option<Extension<CacheScope>>,
    RawJson(body): RawJson,
) -> Result<Response, ApiError> {
    let mut request = ResponsesRequest::parse(&body, state.model.vocab)?;
    state.model.fill_sampling(&mut request.chat.options);
    let prepared = prepare::chat(
        &state,
        &request.chat,
        "max_output_tokens",
        scope.map(|Extension(s)| s.0),
    )
    .await
    .map_err(|e| request.renamed(e))?;
    let mut echo = request.echo;
    echo.insert("model".into(), json!(prepared.model));
    let generation = Generation::start(&state, prepared)?;
    let (engine, rule) = (generation.engine.clone(), generation.rule.clone());
    let mut output = Output::new(random_id("resp_"), echo);
    let response = if request.chat.options.stream {
        sse::response(generation, Events::new(output))
    } else {
        match generation.collect().await {
            Ok((batch, summary)) => {
                for delta in &batch.deltas {
                    output.push(delta);
                }
                output.close();
                json_response(StatusCode::OK, &output.object(Some(&summary)))
            }
            Err(e) => e.into_response(),
        }
    };
    Ok(with_route(response, &engine, &rule))
}

/// One output item as it grows.
enum Item {
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
    Call { id: String, call: ToolCall },
}

impl Item {
    fn json(&self, done: bool) -> Value {
        let status = if done { "completed" } else { "in_progress" };
        match self {
            Item::Reasoning { id, text } => json!({
                "type": "reasoning",
                "id": id,
                "summary": [],
                "content": if done { json!([{"type": "reasoning_text", "text": text}]) } else { json!([]) },
                "status": status,
            }),
            Item::Message { id, text } => json!({
                "type": "message",
                "id": id,
                "status": status,
                "role": "assistant",
                "content": if done { json!([output_text(text)]) } else { json!([]) },
            }),
            Item::Call { id, call } => json!({
                "type": "function_call",
                "id": id,
                "call_id": call.id,
                "name": call.name,
                "arguments": if done { call.arguments.as_str() } else { "" },
                "status": status,
            }),
        }
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// The response being built: its items in order, and the events that
/// report each change (kept for streaming, ignored otherwise).
struct Output {
    id: String,
    created_at: u64,
    echo: Map<String, Value>,
    items: Vec<Item>,
    /// Whether the last item is still open.
    open: bool,
    events: Vec<Value>,
}

impl Output {
    fn new(id: String, echo: Map<String, Value>) -> Self {
        Self {
            id,
            created_at: unix_now(),
            echo,
            items: Vec::new(),
            open: false,
            events: Vec::new(),
        }
    }

    /// The response object; `summary` once generation is over.
    fn object(&self, summary: Option<&Summary>) -> Value {
        let (status, incomplete) = match summary.map(|s| s.finish_reason) {
            None => ("in_progress", Value::Null),
            Some(FinishReason::Length) => ("incomplete", json!({"reason": "max_output_tokens"})),
            Some(_) => ("completed", Value::Null),
        };
        let done = summary.is_some();
        let mut v = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": incomplete,
            "output": self.items.iter().map(|i| i.json(done)).collect::<Vec<_>>(),
            "previous_response_id": null,
            "store": false,
            "usage": summary.map_or(Value::Null, |s| usage(&s.usage)),
        });
        for (k, val) in &self.echo {
            v[k] = val.clone();
        }
        if v["text"].is_null() {
            v["text"] = json!({"format": {"type": "text"}});
        }
        if v["metadata"].is_null() {
            v["metadata"] = json!({});
        }
        v
    }

    fn event(&mut self, kind: &str, mut body: Value) {
        body["type"] = json!(kind);
        self.events.push(body);
    }

    fn push(&mut self, delta: &Delta) {
        let index = self.items.len().saturating_sub(1);
        if self.open {
            let appended = match (delta, self.items.last_mut()) {
                (Delta::Reasoning(t), Some(Item::Reasoning { id, text })) => {
                    text.push_str(t);
                    Some(("response.reasoning_text.delta", id.clone(), t))
                }
                (Delta::Content(t), Some(Item::Message { id, text })) => {
                    text.push_str(t);
                    Some(("response.output_text.delta", id.clone(), t))
                }
                _ => None,
            };
            if let Some((kind, id, t)) = appended {
                let mut event =
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t});
                if kind == "response.output_text.delta" {
                    event["logprobs"] = json!([]);
                }
                self.event(kind, event);
                return;
            }
        }
        if matches!(delta, Delta::Content(t) if t.trim().is_empty()) {
            // Layout between items (a newline after a tool call).
            return;
        }
        self.close();
        let item = match delta {
            Delta::Reasoning(_) => Item::Reasoning {
                id: random_id("rs_"),
                text: String::new(),
            },
            Delta::Content(_) => Item::Message {
                id: random_id("msg_"),
                text: String::new(),
            },
            Delta::ToolCall(call) => Item::Call {
                id: random_id("fc_"),
                call: call.clone(),
            },
        };
        self.open_item(item);
        if !matches!(delta, Delta::ToolCall(_)) {
            self.push(delta);
        }
    }

    fn open_item(&mut self, item: Item) {
        let index = self.items.len();
        let added = item.json(false);
        let id = added["id"].clone();
        self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        );
        match &item {
            Item::Message { .. } => self.event(
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": output_text("")}),
            ),
            Item::Call { call, .. } => {
                let arguments = call.arguments.clone();
                self.event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": index, "delta": arguments}),
                );
            }
            Item::Reasoning { .. } => {}
        }
        self.items.push(item);
        self.open = true;
    }

    /// Ends the open item with its `.done` events.
    fn close(&mut self) {
        if !std::mem::replace(&mut self.open, false) {
            return;
        }
        let index = self.items.len() - 1;
        let done = self.items[index].json(true);
        let id = done["id"].clone();
        match &self.items[index] {
            Item::Reasoning { text, .. } => {
                let text = text.clone();
                self.event(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
            }
            Item::Message { text, .. } => {
                let text = text.clone();
                self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                );
                self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": output_text(&text)}),
                );
            }
            Item::Call { call, .. } => {
                let arguments = call.arguments.clone();
                self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "arguments": arguments}),
                );
            }
        }
        self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        );
    }
}

/// Usage in the Responses API's names.
fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// The streamed events, numbered in order.
struct Events {
    output: Output,
    sequence: u64,
}

impl Events {
    fn new(output: Output) -> Self {
        Self {
            output,
            sequence: 0,
        }
    }

    fn drain(&mut self) -> Vec<Value> {
        let mut out = std::mem::take(&mut self.output.events);
        for e in &mut out {
            e["sequence_number"] = json!(self.sequence);
            self.sequence += 1;
        }
        out
    }
}

impl ChunkFormat for Events {
    fn named_events(&self) -> bool {
        true
    }

    fn opening(&mut self) -> Vec<Value> {
        let response = self.output.object(None);
        self.output
            .event("response.created", json!({"response": response.clone()}));
        self.output
            .event("response.in_progress", json!({"response": response}));
        self.drain()
    }

    fn batch(&mut self, batch: &Batch) -> Vec<Value> {
        for delta in &batch.deltas {
            self.output.push(delta);
        }
        self.drain()
    }

    fn closing(&mut self, summary: &Summary) -> Vec<Value> {
        self.output.close();
        let kind = match summary.finish_reason {
            FinishReason::Length => "response.incomplete",
            _ => "response.completed",
        };
        let response = self.output.object(Some(summary));
        self.output.event(kind, json!({"response": response}));
        self.drain()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call() -> ToolCall {
        let (_, calls) = text::tools::parse_complete(
            text::tools::ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>",
        );
        calls.into_iter().next().unwrap()
    }

    fn summary(reason: FinishReason) -> Summary {
        Summary {
            finish_reason: reason,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 5,
                reasoning_tokens: 2,
                ..Usage::default()
            },
        }
    }

    #[test]
    fn events_follow_the_documented_order() {
        let mut events = Events::new(Output::new("resp_1".into(), Map::new()));
        let mut all = events.opening();
        let batch = Batch {
            deltas: vec![
                Delta::Reasoning("hm".into()),
                Delta::Content("Hel".into()),
                Delta::Content("lo".into()),
                Delta::ToolCall(call()),
            ],
            ..Batch::default()
        };
        all.extend(events.batch(&batch));
        all.extend(events.closing(&summary(FinishReason::ToolCalls)));
        let kinds: Vec<&str> = all.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let seq: Vec<u64> = all
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(seq, (0..all.len() as u64).collect::<Vec<_>>());
        let done = &all.last().unwrap()["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][1]["content"][0]["text"], "Hello");
        assert_eq!(done["output"][2]["name"], "f");
        assert_eq!(
            done["usage"]["output_tokens_details"]["reasoning_tokens"],
            2
        );
    }

    #[test]
    fn the_limit_makes_it_incomplete() {
        let mut out = Output::new("resp_1".into(), Map::new());
        out.push(&Delta::Content("a".into()));
        out.close();
        let v = out.object(Some(&summary(FinishReason::Length)));
        assert_eq!(v["status"], "incomplete");
        assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(v["output"][0]["content"][0]["text"], "a");
    }
}
