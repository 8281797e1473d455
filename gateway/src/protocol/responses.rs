//! The Responses API request, read into the chat request it amounts to:
//! `instructions` become the system message, `input` (text, or messages and
//! `function_call` / `function_call_output` items) the conversation,
//! function `tools` and `tool_choice` their chat spelling,
//! `max_output_tokens` the limit, `text.format` the structured output. The
//! chat parser then checks it all once; its errors are renamed back to the
//! Responses fields.
//!
//! Not kept: stored responses (`previous_response_id` is a 400; `store` is
//! accepted and ignored), background mode, built-in tools (web search,
//! file search, ...).

use serde::Deserialize;
use serde_json::{json, Map, Value};
use utoipa::ToSchema;

use super::body::{read, whole, wrong_type};
use super::chat::{forces_call, ChatRequest, FunctionDefinition, ModelName, Tool, ToolType};
use super::structured::{format_constraint, FormatType};
use super::ApiError;

/// `POST /v1/responses`.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponsesRequest)]
pub struct ResponsesBody {
    #[schema(value_type = ModelName, required = true)]
    pub model: Option<ModelName>,
    /// A string (one user message) or a list of items: messages
    /// (`{"role", "content"}` with `input_text` / `input_image` parts),
    /// `function_call` and `function_call_output` items.
    #[schema(required = true)]
    pub input: Option<Value>,
    /// The system message.
    pub instructions: Option<String>,
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole")]
    pub max_output_tokens: Option<i64>,
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f64>,
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<ResponseTool>>,
    /// "none", "auto", "required" or `{"type": "function", "name": ...}`.
    pub tool_choice: Option<Value>,
    /// false: at most one call.
    pub parallel_tool_calls: Option<bool>,
    pub text: Option<TextOptions>,
    /// Not supported (responses are not stored): always a 400.
    pub previous_response_id: Option<String>,
    /// Not supported: true is a 400.
    pub background: Option<bool>,
    /// Accepted; responses are never stored.
    pub store: Option<bool>,
    /// Echoed in the response.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Map<String, Value>>,
}

/// A function tool (built-in tools are not supported).
#[derive(Debug, Deserialize, ToSchema)]
pub struct ResponseTool {
    #[serde(rename = "type")]
    pub kind: ToolType,
    #[schema(min_length = 1)]
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema (checked against the meta-schema).
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Map<String, Value>>,
    pub strict: Option<bool>,
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct TextOptions {
    pub format: Option<TextFormat>,
}

/// "text", "json_object", or "json_schema" with `schema` beside it.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TextFormat {
    #[serde(rename = "type")]
    pub kind: FormatType,
    pub name: Option<String>,
    pub description: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Value>,
    pub strict: Option<bool>,
}

/// A parsed Responses request.
pub struct ResponsesRequest {
    pub chat: ChatRequest,
    /// Echoed in the response object.
    pub echo: Map<String, Value>,
    /// Messages before `input`'s (the `instructions`).
    offset: usize,
}

impl ResponsesRequest {
    /// The request in `body` (a JSON object).
    pub fn parse(body: &Value, vocab: usize) -> Result<Self, ApiError> {
        let wire: ResponsesBody = read(body)?;
        if wire.previous_response_id.is_some() {
            return Err(ApiError::invalid(
                "`previous_response_id` is not supported: responses are not stored; send the whole conversation in `input`",
                "previous_response_id",
            ));
        }
        if wire.background == Some(true) {
            return Err(ApiError::invalid(
                "`background` responses are not supported",
                "background",
            ));
        }
        let field = |key: &str| body.get(key).filter(|v| !v.is_null());
        let offset = usize::from(wire.instructions.is_some());
        let mut messages: Vec<Value> = wire
            .instructions
            .iter()
            .map(|text| json!({"role": "system", "content": text}))
            .collect();
        messages.extend(input(wire.input.as_ref().filter(|v| !v.is_null()))?);
        let mut chat = Map::new();
        chat.insert("messages".into(), Value::Array(messages));
        for key in [
            "model",
            "temperature",
            "top_p",
            "stream",
            "parallel_tool_calls",
        ] {
            if let Some(v) = field(key) {
                chat.insert(key.into(), v.clone());
            }
        }
        if let Some(n) = wire.max_output_tokens {
            chat.insert("max_completion_tokens".into(), json!(n));
        }
        if let Some(tools) = wire.tools {
            chat.insert("tools".into(), self::tools(tools));
        }
        if let Some(choice) = field("tool_choice") {
            chat.insert("tool_choice".into(), tool_choice(choice));
        }
        let mut parsed =
            ChatRequest::parse(&Value::Object(chat), vocab).map_err(|e| renamed(e, offset))?;
        // `text.format` is the structured output, named as the client sent it.
        let format = match wire.text.and_then(|t| t.format) {
            Some(f) => format_constraint(
                f.kind,
                Some((f.schema.as_ref(), f.strict)),
                "text.format",
                "text.format",
            )?,
            None => None,
        };
        if format.is_some() && forces_call(&parsed.tool_choice) {
            return Err(ApiError::invalid(
                "`tool_choice` forces a tool call, which conflicts with `text.format`",
                "tool_choice",
            ));
        }
        parsed.options.structured = format;
        let mut echo = Map::new();
        for key in [
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "metadata",
            "text",
        ] {
            echo.insert(key.into(), field(key).cloned().unwrap_or(Value::Null));
        }
        echo.insert("tools".into(), field("tools").cloned().unwrap_or(json!([])));
        echo.insert(
            "tool_choice".into(),
            field("tool_choice").cloned().unwrap_or(json!("auto")),
        );
        echo.insert(
            "parallel_tool_calls".into(),
            Value::Bool(parsed.parallel_tool_calls),
        );
        Ok(Self {
            chat: parsed,
            echo,
            offset,
        })
    }

    /// An error about the chat request this became, in this request's
    /// field names.
    pub fn renamed(&self, e: ApiError) -> ApiError {
        renamed(e, self.offset)
    }
}

/// `input`: a string (one user message) or a list of items.
fn input(input: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    match input {
        None => Err(ApiError::invalid("`input` is required", "input")),
        Some(Value::String(text)) => Ok(vec![json!({"role": "user", "content": text})]),
        Some(Value::Array(items)) if items.is_empty() => Err(ApiError::invalid(
            "`input` must hold at least one item",
            "input",
        )),
        Some(Value::Array(items)) => {
            let mut messages: Vec<Value> = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                let obj = item
                    .as_object()
                    .ok_or_else(|| wrong_type(&at, "an object", item))?;
                match obj.get("type").and_then(Value::as_str).unwrap_or("message") {
                    "message" => messages.push(message(&at, obj)?),
                    "function_call" => {
                        let call = json!({
                            "id": field_str(obj, &at, "call_id")?,
                            "type": "function",
                            "function": {
                                "name": field_str(obj, &at, "name")?,
                                "arguments": field_str(obj, &at, "arguments")?,
                            },
                        });
                        // Consecutive calls belong to one assistant turn.
                        match messages.last_mut() {
                            Some(last) if last["role"] == "assistant" && last["tool_calls"].is_array() => {
                                last["tool_calls"].as_array_mut().unwrap().push(call);
                            }
                            _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                        }
                    }
                    "function_call_output" => {
                        let output = match obj.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            Some(v @ (Value::Array(_) | Value::Object(_))) => v.to_string(),
                            Some(v) => return Err(wrong_type(&format!("{at}.output"), "a string", v)),
                            None => {
                                return Err(ApiError::invalid(
                                    format!("`{at}.output` is required"),
                                    format!("{at}.output"),
                                ))
                            }
                        };
                        messages.push(json!({
                            "role": "tool",
                            "tool_call_id": field_str(obj, &at, "call_id")?,
                            "content": output,
                        }));
                    }
                    // Earlier reasoning is not sent back to the model.
                    "reasoning" => {}
                    other => {
                        return Err(ApiError::invalid(
                            format!("input items of type {other:?} are not supported (message, function_call, function_call_output, reasoning)"),
                            format!("{at}.type"),
                        ))
                    }
                }
            }
            Ok(messages)
        }
        Some(v) => Err(wrong_type("input", "a string or an array of items", v)),
    }
}

fn field_str(obj: &Map<String, Value>, at: &str, key: &str) -> Result<String, ApiError> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(v) => Err(wrong_type(&format!("{at}.{key}"), "a string", v)),
        None => Err(ApiError::invalid(
            format!("`{at}.{key}` is required"),
            format!("{at}.{key}"),
        )),
    }
}

/// A message item; its content parts (`input_text`, `output_text`,
/// `input_image`) in chat's spelling.
fn message(at: &str, obj: &Map<String, Value>) -> Result<Value, ApiError> {
    let mut out = obj.clone();
    out.remove("type");
    out.remove("id");
    out.remove("status");
    if let Some(Value::Array(parts)) = obj.get("content") {
        let mut chat_parts = Vec::with_capacity(parts.len());
        for (j, part) in parts.iter().enumerate() {
            let p = format!("{at}.content[{j}]");
            let kind = part.get("type").and_then(Value::as_str);
            chat_parts.push(match kind {
                Some("input_text" | "output_text" | "text") => {
                    json!({"type": "text", "text": part.get("text").cloned().unwrap_or(Value::Null)})
                }
                Some("input_image") => {
                    let url = part.get("image_url").cloned().unwrap_or(Value::Null);
                    json!({"type": "image_url", "image_url": {"url": url}})
                }
                _ => {
                    return Err(ApiError::invalid(
                        "content parts must be input_text, output_text or input_image",
                        format!("{p}.type"),
                    ))
                }
            });
        }
        out.insert("content".into(), Value::Array(chat_parts));
    }
    Ok(Value::Object(out))
}

/// Function tools in chat's spelling, `{type, function: {name,
/// description, parameters, strict}}`.
fn tools(list: Vec<ResponseTool>) -> Value {
    let tools: Vec<Tool> = list
        .into_iter()
        .map(|t| Tool {
            kind: t.kind,
            function: FunctionDefinition {
                name: t.name,
                description: t.description,
                parameters: t.parameters,
                strict: t.strict,
            },
        })
        .collect();
    serde_json::to_value(tools).unwrap_or_default()
}

/// `{"type": "function", "name": ...}` becomes chat's nested form.
fn tool_choice(choice: &Value) -> Value {
    match choice.get("name") {
        Some(name) if choice.get("type").and_then(Value::as_str) == Some("function") => {
            json!({"type": "function", "function": {"name": name}})
        }
        _ => choice.clone(),
    }
}

/// The chat parser's field names, back in the Responses request's terms.
fn renamed(e: ApiError, offset: usize) -> ApiError {
    let (message, param, code) = match e {
        ApiError::InvalidRequest {
            message,
            param: Some(param),
            code,
        } => (message, param, code),
        other => return other,
    };
    let param = if let Some(rest) = param.strip_prefix("messages[") {
        let (index, tail) = rest.split_once(']').unwrap_or((rest, ""));
        match index.parse::<usize>() {
            Ok(i) if i < offset => "instructions".to_owned(),
            Ok(i) => format!("input[{}]{tail}", i - offset),
            Err(_) => "input".to_owned(),
        }
    } else if param == "messages" {
        "input".to_owned()
    } else if param == "max_completion_tokens" {
        "max_output_tokens".to_owned()
    } else if let Some(rest) = param.strip_prefix("tools[") {
        format!("tools[{}", rest.replacen("].function.", "].", 1))
    } else {
        param
    };
    let message = message
        .replace("`messages", "`input")
        .replace("max_completion_tokens", "max_output_tokens");
    ApiError::InvalidRequest {
        message,
        param: Some(param),
        code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::chat::ToolChoice;

    fn parse(v: Value) -> Result<ResponsesRequest, ApiError> {
        ResponsesRequest::parse(&v, 512)
    }

    #[test]
    fn items_become_the_conversation() {
        let r = parse(json!({
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "reasoning", "id": "rs_1", "summary": []}
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 7
        }))
        .unwrap();
        let m = &r.chat.messages;
        assert_eq!(m.len(), 4);
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[1]["content"], "weather?");
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(m[3]["role"], "tool");
        assert_eq!(r.chat.tool_choice, ToolChoice::Named("get_weather".into()));
        assert_eq!(r.chat.options.max_tokens, Some(7));
        let text = parse(json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})).unwrap();
        assert_eq!(
            text.chat.options.structured.unwrap().param,
            "text.format.schema"
        );
    }

    #[test]
    fn bad_inputs_name_the_responses_field() {
        let cases = [
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (json!({}), "input"),
            (json!({"input": []}), "input"),
            (json!({"input": 3}), "input"),
            (
                json!({"input": [{"type": "file_search_call"}]}),
                "input[0].type",
            ),
            (
                json!({"input": [{"role": "robot", "content": "x"}]}),
                "input[0].role",
            ),
            (
                json!({"instructions": "x", "input": [{"role": "user", "content": 5}]}),
                "input[0].content",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c"}]}),
                "input[0].output",
            ),
            (
                json!({"input": "x", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "tools[0].type",
            ),
            (
                json!({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]}),
                "tools[0].parameters",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}),
                "text.format.schema",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "objekt"}}}}),
                "text.format.schema",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "json_object"}}, "tools": [{"type": "function", "name": "f"}], "tool_choice": "required"}),
                "tool_choice",
            ),
        ];
        for (body, param) in cases {
            let e = parse(body.clone())
                .err()
                .unwrap_or_else(|| panic!("{body} parsed"));
            assert_eq!(e.status().as_u16(), 400, "{body}");
            assert_eq!(e.param(), Some(param), "{body}: {e}");
        }
    }
}
