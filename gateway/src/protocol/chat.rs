//! The chat completion request: its wire type (parsed and documented),
//! and the typed request the rules below make of it.
//!
//! Choices made here (documented for clients):
//! * `n` > 1 generates that many choices (up to `server.max_n`), each a
//!   request of its own sharing the prompt's prefill (`api::choices`);
//!   `best_of` other than 1 is rejected.
//! * `thinking_budget` (mlx-vlm's server's field): on a model that thinks,
//!   the think block is closed for the model after that many reasoning
//!   tokens and the answer follows (`generation::ThinkingBudget`).
//! * `tool_choice`: `none` hides the tools from the model and turns off
//!   tool-call parsing; `auto` offers every tool, lets the model answer in
//!   text, and constrains decoding from the moment a call starts in the
//!   model family's format; `required` offers every tool and constrains
//!   decoding to calls only; a named function offers only that one and
//!   constrains decoding to one call of it. Arguments are held to the
//!   tool's `parameters`: closed (no properties beyond the schema's) for a
//!   `strict: true` tool and for any forced call, as written otherwise.
//!   `parallel_tool_calls: false` allows at most one call.
//! * Structured outputs (`response_format` json_schema / json_object, vLLM's
//!   `structured_outputs` and `guided_*`): see [`crate::protocol::structured`].
//!   `json_object` also adds a system instruction asking for one JSON
//!   object, as trained models answer better when told. A constraint with a
//!   forced tool call is a conflict (400).
//! * `enable_thinking` and `chat_template_kwargs` are passed to the chat
//!   template (`chat_template_kwargs` wins where both set a key).
//! * Content parts: text parts are joined with newlines. `image_url` parts
//!   (user messages only) keep the content a list of parts for the chat
//!   template, `{"type": "image"}` where each image goes; the images
//!   themselves are listed in `ChatRequest::images`, and whether the model
//!   reads images is the handler's check. Other part types are rejected.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use utoipa::ToSchema;

use super::body::{whole, StringOr};
use super::options::{gen_options, GenOptions, GenerationOptions};
use super::ApiError;
use crate::vision::ImagePart;

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ChatCompletionRequest)]
pub struct ChatBody {
    #[schema(value_type = ModelName, required = true)]
    pub model: Option<ModelName>,
    #[schema(min_items = 1)]
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub options: GenerationOptions,
    pub logprobs: Option<bool>,
    #[schema(minimum = 0, maximum = 20)]
    #[serde(default, deserialize_with = "whole")]
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    /// false: at most one call.
    pub parallel_tool_calls: Option<bool>,
    /// Passed to the chat template.
    pub enable_thinking: Option<bool>,
    /// Extra variables for the chat template (they win over
    /// `enable_thinking`).
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

/// The served model's name (see `/v1/models`).
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ModelName(pub String);

#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatMessage {
    pub role: Role,
    /// A string or a list of parts; null for an assistant message that
    /// only calls tools.
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    /// An assistant's earlier reasoning, for templates that show it.
    pub reasoning_content: Option<String>,
    /// An assistant's calls.
    pub tool_calls: Option<Vec<ToolCall>>,
    /// Required on tool messages: the call this answers.
    pub tool_call_id: Option<String>,
}

/// `developer` is OpenAI's newer name for `system`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

#[derive(Debug, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(
            match StringOr::read(d, "a string or an array of content parts")? {
                StringOr::String(s) => Self::Text(s),
                StringOr::Other(parts) => Self::Parts(parts),
            },
        )
    }
}

/// `{"type": "text", "text": ...}`, or, in user messages to a vision
/// model, `{"type": "image_url", "image_url": {"url": ...}}`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: PartKind,
    pub text: Option<String>,
    pub image_url: Option<ImageUrl>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PartKind {
    Text,
    ImageUrl,
}

/// `{"url": ...}` (a bare URL string is accepted too, as some clients send
/// it): `data:` URLs, `http(s)://` or a local path where the config allows.
#[derive(Debug, ToSchema)]
#[serde(untagged)]
pub enum ImageUrl {
    Url(String),
    Object { url: String },
}

impl<'de> Deserialize<'de> for ImageUrl {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Object {
            url: String,
        }
        Ok(
            match StringOr::<Object>::read(d, "a string or an object")? {
                StringOr::String(url) => Self::Url(url),
                StringOr::Other(o) => Self::Object { url: o.url },
            },
        )
    }
}

impl ImageUrl {
    fn url(&self) -> &str {
        match self {
            Self::Url(url) | Self::Object { url } => url,
        }
    }
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct ToolCall {
    pub id: Option<String>,
    pub function: CalledFunction,
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct CalledFunction {
    pub name: String,
    /// A JSON object encoded as a string (or the object itself).
    pub arguments: Option<Arguments>,
}

#[derive(Debug, ToSchema)]
#[serde(untagged)]
pub enum Arguments {
    Text(String),
    #[schema(value_type = Object)]
    Object(Map<String, Value>),
}

impl<'de> Deserialize<'de> for Arguments {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match StringOr::read(d, "a string")? {
            StringOr::String(s) => Self::Text(s),
            StringOr::Other(o) => Self::Object(o),
        })
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ToolType {
    Function,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: ToolType,
    pub function: FunctionDefinition,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct FunctionDefinition {
    #[schema(min_length = 1)]
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema (checked against the meta-schema); calls' arguments
    /// are held to it.
    #[schema(value_type = Option<Object>)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Map<String, Value>>,
    /// Closes every object schema that leaves `additionalProperties` unset
    /// (forced calls always are).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// "none", "auto" or "required", or `{"type": "function", "function":
/// {"name": ...}}` to force one tool.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

#[derive(Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
enum ToolChoiceMode {
    None,
    Auto,
    Required,
}

#[derive(Deserialize, ToSchema)]
struct NamedToolChoice {
    #[serde(rename = "type")]
    #[allow(dead_code)]
    kind: Option<ToolType>,
    function: NamedFunction,
}

#[derive(Deserialize, ToSchema)]
struct NamedFunction {
    #[schema(min_length = 1)]
    name: String,
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{value::StrDeserializer, Error};
        Ok(
            match StringOr::<NamedToolChoice>::read(d, "a string or an object")? {
                StringOr::String(mode) => {
                    match ToolChoiceMode::deserialize(StrDeserializer::<D::Error>::new(&mode))? {
                        ToolChoiceMode::None => Self::None,
                        ToolChoiceMode::Auto => Self::Auto,
                        ToolChoiceMode::Required => Self::Required,
                    }
                }
                StringOr::Other(named) if named.function.name.is_empty() => {
                    return Err(D::Error::custom("`function.name` must not be empty"))
                }
                StringOr::Other(named) => Self::Named(named.function.name),
            },
        )
    }
}

impl utoipa::PartialSchema for ToolChoice {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::OneOfBuilder::new()
            .item(ToolChoiceMode::schema())
            .item(NamedToolChoice::schema())
            .into()
    }
}

impl ToSchema for ToolChoice {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        <NamedToolChoice as ToSchema>::schemas(schemas);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFormat {
    Text,
    JsonObject,
}

/// Added as (or to) the system message for `json_object`.
pub const JSON_INSTRUCTION: &str =
    "Respond with a single valid JSON object and nothing else: no prose, no code fences.";

/// One offered tool's parameters as its calls are held to them.
#[derive(Debug, Clone, PartialEq)]
pub struct CallSchema {
    /// Its place in the request's `tools`.
    pub index: usize,
    pub name: String,
    pub parameters: Value,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub model: Option<String>,
    /// Messages shaped for the chat template.
    pub messages: Vec<Value>,
    /// Tool definitions (validated), as the template renders them.
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// One or more calls (true, the default) or at most one.
    pub parallel_tool_calls: bool,
    pub response_format: ResponseFormat,
    pub template_kwargs: Map<String, Value>,
    pub options: GenOptions,
    /// The `image_url` parts, in prompt order.
    pub images: Vec<ImagePart>,
}

impl ChatRequest {
    /// The request in `body` (a JSON object).
    pub fn parse(body: &Value, vocab: usize) -> Result<Self, ApiError> {
        Self::from_wire(GenerationOptions::read_into(body)?, vocab)
    }

    fn from_wire(wire: ChatBody, vocab: usize) -> Result<Self, ApiError> {
        let mut images = Vec::new();
        let messages = messages(&wire.messages, &mut images)?;
        let tools = wire.tools.as_deref().unwrap_or_default();
        check_tools(tools)?;
        let tool_choice = tool_choice(wire.tool_choice.clone(), tools)?;
        let mut template_kwargs = Map::new();
        if let Some(on) = wire.enable_thinking {
            template_kwargs.insert("enable_thinking".into(), Value::Bool(on));
        }
        template_kwargs.extend(wire.chat_template_kwargs.clone().unwrap_or_default());
        let mut options = gen_options(&wire.options, vocab)?;
        let response_format = match &options.structured {
            Some(s) if s.param == "response_format" => ResponseFormat::JsonObject,
            _ => ResponseFormat::Text,
        };
        if forces_call(&tool_choice) && options.structured.is_some() {
            return Err(ApiError::invalid(
                "`tool_choice` forces a tool call, which conflicts with a structured-output constraint",
                "tool_choice",
            ));
        }
        let logprobs = wire.logprobs.unwrap_or(false);
        options.sampling.logprobs = logprobs;
        options.sampling.top_logprobs = top_logprobs(wire.top_logprobs, logprobs)?;
        Ok(ChatRequest {
            model: wire.model.map(|m| m.0),
            messages,
            tools: tools
                .iter()
                .map(|t| serde_json::to_value(t).unwrap_or_default())
                .collect(),
            tool_choice,
            parallel_tool_calls: wire.parallel_tool_calls.unwrap_or(true),
            response_format,
            template_kwargs,
            options,
            images,
        })
    }

    /// Tools the model is offered (what the template renders).
    pub fn offered_tools(&self) -> Option<Vec<Value>> {
        if self.tools.is_empty() {
            return None;
        }
        match &self.tool_choice {
            ToolChoice::None => None,
            ToolChoice::Auto | ToolChoice::Required => Some(self.tools.clone()),
            ToolChoice::Named(name) => Some(
                self.tools
                    .iter()
                    .filter(|t| t["function"]["name"] == name.as_str())
                    .cloned()
                    .collect(),
            ),
        }
    }

    /// The parameters the offered tools' calls are held to, as decoding
    /// constrains them: closed (no properties beyond the schema's) for a
    /// `strict` tool and for every forced call, as written otherwise; no
    /// `parameters` is any object. Empty when no tool is offered.
    pub fn call_schemas(&self) -> Vec<CallSchema> {
        let forced = matches!(
            self.tool_choice,
            ToolChoice::Required | ToolChoice::Named(_)
        );
        let offered = self.offered_tools().unwrap_or_default();
        self.tools
            .iter()
            .enumerate()
            .filter(|(_, t)| offered.contains(t))
            .map(|(index, t)| {
                let f = &t["function"];
                let parameters = match &f["parameters"] {
                    Value::Null => json!({"type": "object"}),
                    p => p.clone(),
                };
                let closed = forced || f["strict"] == true;
                CallSchema {
                    index,
                    name: f["name"].as_str().unwrap_or_default().to_owned(),
                    parameters: if closed {
                        grammar::closed(&parameters)
                    } else {
                        parameters
                    },
                }
            })
            .collect()
    }

    /// The messages with the JSON-mode instruction applied.
    pub fn template_messages(&self) -> Vec<Value> {
        let mut messages = self.messages.clone();
        if self.response_format == ResponseFormat::JsonObject {
            match messages.first_mut() {
                Some(first) if first["role"] == "system" && first["content"].is_string() => {
                    let content = format!(
                        "{}\n\n{JSON_INSTRUCTION}",
                        first["content"].as_str().unwrap_or_default()
                    );
                    first["content"] = Value::String(content);
                }
                _ => messages.insert(0, json!({ "role": "system", "content": JSON_INSTRUCTION })),
            }
        }
        messages
    }
}

/// `required` and a named function force a call.
pub fn forces_call(choice: &ToolChoice) -> bool {
    matches!(choice, ToolChoice::Required | ToolChoice::Named(_))
}

fn top_logprobs(n: Option<i64>, logprobs: bool) -> Result<u32, ApiError> {
    match n {
        None => Ok(0),
        Some(n @ 0..=20) if logprobs || n == 0 => Ok(n as u32),
        Some(0..=20) => Err(ApiError::invalid(
            "`top_logprobs` requires `logprobs: true`",
            "top_logprobs",
        )),
        Some(n) => Err(ApiError::invalid(
            format!("`top_logprobs` must be between 0 and 20, got {n}"),
            "top_logprobs",
        )),
    }
}

fn messages(list: &[ChatMessage], images: &mut Vec<ImagePart>) -> Result<Vec<Value>, ApiError> {
    if list.is_empty() {
        return Err(ApiError::invalid(
            "`messages` must hold at least one message",
            "messages",
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| message(&format!("messages[{i}]"), m, images))
        .collect()
}

/// One message shaped for the chat template.
fn message(at: &str, m: &ChatMessage, images: &mut Vec<ImagePart>) -> Result<Value, ApiError> {
    let role = match m.role {
        Role::System | Role::Developer => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    let mut out = Map::new();
    out.insert("role".into(), json!(role));
    let before = images.len();
    let content = m
        .content
        .as_ref()
        .map(|c| content(&format!("{at}.content"), c, images))
        .transpose()?;
    if images.len() > before && m.role != Role::User {
        return Err(ApiError::invalid(
            format!("image parts are only allowed in user messages, not in {role} messages"),
            format!("{at}.content"),
        ));
    }
    let tool_calls = match (m.role, &m.tool_calls) {
        (Role::Assistant, Some(calls)) => Some(tool_calls(&format!("{at}.tool_calls"), calls)?),
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                format!("`{at}.tool_calls` is only allowed on assistant messages"),
                format!("{at}.tool_calls"),
            ))
        }
        (_, None) => None,
    };
    match (&content, m.role, &tool_calls) {
        (Some(_), _, _) | (None, Role::Assistant, Some(_)) => {}
        (None, Role::Assistant, None) => {
            return Err(ApiError::invalid(
                format!("`{at}` needs `content` or `tool_calls`"),
                format!("{at}.content"),
            ))
        }
        (None, _, _) => {
            return Err(ApiError::invalid(
                format!("`{at}.content` is required"),
                format!("{at}.content"),
            ))
        }
    }
    out.insert("content".into(), content.unwrap_or(Value::Null));
    if let Some(calls) = tool_calls {
        out.insert("tool_calls".into(), Value::Array(calls));
    }
    match (&m.tool_call_id, m.role) {
        (Some(id), Role::Tool) => {
            out.insert("tool_call_id".into(), json!(id));
        }
        (None, Role::Tool) => {
            return Err(ApiError::invalid(
                format!("`{at}.tool_call_id` is required on tool messages"),
                format!("{at}.tool_call_id"),
            ))
        }
        _ => {}
    }
    for (key, value) in [
        ("name", &m.name),
        ("reasoning_content", &m.reasoning_content),
    ] {
        if let Some(s) = value {
            out.insert(key.into(), json!(s));
        }
    }
    Ok(Value::Object(out))
}

/// A string, text parts joined with newlines; or, with images, the list of
/// text and image parts for the template.
fn content(
    at: &str,
    content: &MessageContent,
    images: &mut Vec<ImagePart>,
) -> Result<Value, ApiError> {
    let parts = match content {
        MessageContent::Text(s) => return Ok(Value::String(s.clone())),
        MessageContent::Parts(parts) => parts,
    };
    let mut texts = Vec::with_capacity(parts.len());
    let mut listed = Vec::with_capacity(parts.len());
    let before = images.len();
    for (j, part) in parts.iter().enumerate() {
        let p = format!("{at}[{j}]");
        match (part.kind, &part.text, &part.image_url) {
            (PartKind::Text, Some(t), _) => {
                texts.push(t.as_str());
                listed.push(json!({ "type": "text", "text": t }));
            }
            (PartKind::Text, None, _) => {
                return Err(ApiError::invalid(
                    format!("`{p}.text` is required"),
                    format!("{p}.text"),
                ))
            }
            (PartKind::ImageUrl, _, Some(image)) => {
                images.push(ImagePart {
                    url: image.url().to_owned(),
                    param: format!("{p}.image_url.url"),
                });
                listed.push(json!({ "type": "image" }));
            }
            (PartKind::ImageUrl, _, None) => {
                return Err(ApiError::invalid(
                    format!("`{p}.image_url` is required"),
                    format!("{p}.image_url"),
                ))
            }
        }
    }
    if images.len() > before {
        Ok(Value::Array(listed))
    } else {
        Ok(Value::String(texts.join("\n")))
    }
}

/// A function's name may not be empty.
fn named(name: &str, at: &str) -> Result<(), ApiError> {
    if name.is_empty() {
        return Err(ApiError::invalid(
            format!("`{at}.function.name` must be a non-empty string"),
            format!("{at}.function.name"),
        ));
    }
    Ok(())
}

/// Assistant tool calls, with `arguments` decoded from its JSON string so
/// templates that iterate over the arguments (Llama 3.1) can.
fn tool_calls(at: &str, calls: &[ToolCall]) -> Result<Vec<Value>, ApiError> {
    calls
        .iter()
        .enumerate()
        .map(|(k, call)| {
            let p = format!("{at}[{k}]");
            named(&call.function.name, &p)?;
            let arguments = match &call.function.arguments {
                None => json!({}),
                Some(Arguments::Object(o)) => Value::Object(o.clone()),
                Some(Arguments::Text(s)) => match serde_json::from_str::<Value>(s) {
                    Ok(v @ Value::Object(_)) => v,
                    _ => {
                        return Err(ApiError::invalid(
                            format!(
                                "`{p}.function.arguments` must be a JSON object encoded as a string"
                            ),
                            format!("{p}.function.arguments"),
                        ))
                    }
                },
            };
            Ok(json!({
                "id": call.id,
                "type": "function",
                "function": { "name": call.function.name, "arguments": arguments },
            }))
        })
        .collect()
}

/// Names are non-empty and distinct; `parameters` is a JSON Schema.
fn check_tools(tools: &[Tool]) -> Result<(), ApiError> {
    let mut names = std::collections::HashSet::new();
    for (i, tool) in tools.iter().enumerate() {
        let p = format!("tools[{i}]");
        let name = &tool.function.name;
        named(name, &p)?;
        if !names.insert(name) {
            return Err(ApiError::invalid(
                format!("tool {name:?} is defined twice"),
                format!("{p}.function.name"),
            ));
        }
        if let Some(schema) = &tool.function.parameters {
            if let Err(e) = jsonschema::meta::validate(&Value::Object(schema.clone())) {
                return Err(ApiError::invalid(
                    format!("`{p}.function.parameters` is not a valid JSON Schema: {e}"),
                    format!("{p}.function.parameters"),
                ));
            }
        }
    }
    Ok(())
}

/// `auto` unless given; a forced call needs tools, a named one a tool of
/// that name.
fn tool_choice(choice: Option<ToolChoice>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let choice = choice.unwrap_or(ToolChoice::Auto);
    if let ToolChoice::Named(name) = &choice {
        if !tools.iter().any(|t| &t.function.name == name) {
            return Err(ApiError::invalid(
                format!("`tool_choice` names {name:?}, which is not in `tools`"),
                "tool_choice",
            ));
        }
    }
    if tools.is_empty() && forces_call(&choice) {
        return Err(ApiError::invalid(
            "`tool_choice` requires `tools`",
            "tool_choice",
        ));
    }
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ChatRequest, ApiError> {
        ChatRequest::parse(&v, 512)
    }

    fn param_of(v: Value) -> String {
        let e = parse(v.clone()).unwrap_err();
        assert_eq!(e.status().as_u16(), 400, "{v}");
        e.param().unwrap_or_default().to_owned()
    }

    #[test]
    fn minimal_and_full_requests() {
        let r =
            parse(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})).unwrap();
        assert_eq!(r.messages, vec![json!({"role": "user", "content": "hi"})]);
        assert_eq!(r.tool_choice, ToolChoice::Auto);
        assert!(r.offered_tools().is_none());

        let r = parse(json!({
            "model": "m",
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be brief"}, {"type": "text", "text": "really"}]},
                {"role": "user", "content": "weather?", "name": "ann"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
                ]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "enable_thinking": false,
            "chat_template_kwargs": {"enable_thinking": true, "x": 1},
            "logprobs": true, "top_logprobs": 3
        }))
        .unwrap();
        assert_eq!(
            r.messages[0],
            json!({"role": "system", "content": "be brief\nreally"})
        );
        assert_eq!(r.messages[1]["name"], "ann");
        assert_eq!(
            r.messages[2]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(r.messages[3]["tool_call_id"], "call_1");
        assert_eq!(r.tool_choice, ToolChoice::Named("get_weather".into()));
        assert_eq!(r.offered_tools().unwrap().len(), 1);
        assert_eq!(r.template_kwargs["enable_thinking"], true);
        assert!(r.options.sampling.logprobs && r.options.sampling.top_logprobs == 3);
        // A forced call and a structured-output constraint conflict.
        let mut both = json!({
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
            "tool_choice": "required",
            "response_format": {"type": "json_object"}
        });
        assert_eq!(param_of(both.clone()), "tool_choice");
        both["tool_choice"] = json!("auto");
        let msgs = parse(both).unwrap().template_messages();
        assert!(msgs[0]["content"]
            .as_str()
            .unwrap()
            .ends_with(JSON_INSTRUCTION));
    }

    #[test]
    fn image_parts_keep_their_place_for_the_template() {
        let r = parse(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": "/tmp/x.png"}
        ]}]}))
        .unwrap();
        assert_eq!(
            r.messages[0]["content"],
            json!([{"type": "text", "text": "what is"}, {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}])
        );
        assert_eq!(r.images.len(), 2);
        assert_eq!(r.images[1].url, "/tmp/x.png");
        assert_eq!(r.images[1].param, "messages[0].content[3].image_url.url");
    }

    #[test]
    fn calls_are_held_closed_when_strict_or_forced() {
        let open = json!({"type": "object", "properties": {"a": {"type": "string"}}});
        let request = |strict: bool, choice: Value| {
            parse(json!({
                "messages": [{"role": "user", "content": "x"}],
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": open, "strict": strict}},
                    {"type": "function", "function": {"name": "g"}}
                ],
                "tool_choice": choice
            }))
            .unwrap()
            .call_schemas()
        };
        let auto = request(false, json!("auto"));
        assert_eq!((auto[0].index, auto[1].index), (0, 1));
        assert_eq!(auto[0].parameters, open);
        assert_eq!(auto[1].parameters, json!({"type": "object"}));
        assert_eq!(
            request(true, json!("auto"))[0].parameters["additionalProperties"],
            false
        );
        let named = request(
            false,
            json!({"type": "function", "function": {"name": "g"}}),
        );
        assert_eq!(named.len(), 1);
        assert_eq!((named[0].index, named[0].name.as_str()), (1, "g"));
        assert_eq!(named[0].parameters["additionalProperties"], false);
        assert_eq!(
            request(false, json!("required"))[0].parameters["additionalProperties"],
            false
        );
        assert!(request(false, json!("none")).is_empty());
    }

    #[test]
    fn json_mode_adds_a_system_message_when_there_is_none() {
        let r = parse(json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})).unwrap();
        let msgs = r.template_messages();
        assert_eq!(msgs[0]["role"], "system");
        assert_eq!(msgs.len(), 2);
    }

    #[test]
    fn tool_choice_none_hides_tools() {
        let r = parse(json!({
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "none"
        }))
        .unwrap();
        assert!(r.offered_tools().is_none());
    }

    #[test]
    fn bad_inputs_name_their_param() {
        let user = json!({"role": "user", "content": "x"});
        let cases = [
            (json!({"model": 3, "messages": [user]}), "model"),
            (json!({}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": []}), "messages"),
            (json!({"messages": [3]}), "messages[0]"),
            (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
            (
                json!({"messages": [{"role": "robot", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "user", "content": 5}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user"}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "assistant"}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
                "messages[0].content[0].image_url.url",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "tool", "content": "x"}]}),
                "messages[0].tool_call_id",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
                "messages[0].tool_calls",
            ),
            (
                json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "nope"}}]}]}),
                "messages[0].tool_calls[0].function.arguments",
            ),
            (json!({"messages": [user], "tools": {}}), "tools"),
            (
                json!({"messages": [user], "tools": [{"type": "function", "function": {}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"messages": [user], "tools": [{"type": "retrieval"}]}),
                "tools[0].type",
            ),
            (
                json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}),
                "tools[0].function.strict",
            ),
            (
                json!({"messages": [user], "tool_choice": "required"}),
                "tool_choice",
            ),
            (
                json!({"messages": [user], "tool_choice": "sometimes"}),
                "tool_choice",
            ),
            (
                json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                "tool_choice",
            ),
            (
                json!({"messages": [user], "response_format": {"type": "json_schema", "json_schema": {}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"messages": [user], "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"messages": [user], "response_format": {"type": "json_object"}, "guided_choice": ["a"]}),
                "guided_choice",
            ),
            (
                json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "guided_regex": "a"}),
                "tool_choice",
            ),
            (
                json!({"messages": [user], "response_format": "json"}),
                "response_format",
            ),
            (
                json!({"messages": [user], "enable_thinking": "yes"}),
                "enable_thinking",
            ),
            (
                json!({"messages": [user], "chat_template_kwargs": []}),
                "chat_template_kwargs",
            ),
            (
                json!({"messages": [user], "top_logprobs": 3}),
                "top_logprobs",
            ),
            (
                json!({"messages": [user], "logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (json!({"messages": [user], "logprobs": 1}), "logprobs"),
            (json!({"messages": [user], "max_tokens": 0}), "max_tokens"),
        ];
        for (input, param) in cases {
            assert_eq!(param_of(input.clone()), param, "{input}");
        }
    }
}
