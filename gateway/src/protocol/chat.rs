//! The chat completion request: raw JSON in, a typed request out.
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

use serde_json::{json, Map, Value};

use crate::protocol::options::{gen_options, wrong_type, GenOptions, RawBody};
use crate::protocol::ApiError;
use crate::vision::ImagePart;

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
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
    /// Tool definitions as the client sent them (validated).
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
    pub fn parse(body: &RawBody, vocab: usize) -> Result<Self, ApiError> {
        let model = body.string("model")?.map(str::to_owned);
        let mut images = Vec::new();
        let messages = messages(body, &mut images)?;
        let tools = tools(body)?;
        let tool_choice = tool_choice(body, &tools)?;
        let parallel_tool_calls = body.bool("parallel_tool_calls")?.unwrap_or(true);

        let mut template_kwargs = Map::new();
        if let Some(on) = body.bool("enable_thinking")? {
            template_kwargs.insert("enable_thinking".into(), Value::Bool(on));
        }
        if let Some(kwargs) = body.object("chat_template_kwargs")? {
            template_kwargs.extend(kwargs.clone());
        }
        let mut options = gen_options(body, vocab)?;
        let response_format = match &options.structured {
            Some(s) if s.param == "response_format" => ResponseFormat::JsonObject,
            _ => ResponseFormat::Text,
        };
        let forced_call = matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_));
        if forced_call && options.structured.is_some() {
            return Err(ApiError::invalid(
                "`tool_choice` forces a tool call, which conflicts with a structured-output constraint",
                "tool_choice",
            ));
        }
        let logprobs = body.bool("logprobs")?.unwrap_or(false);
        let top_logprobs = match body.int("top_logprobs")? {
            None => 0,
            Some(n @ 0..=20) if logprobs || n == 0 => n as u32,
            Some(0..=20) => {
                return Err(ApiError::invalid(
                    "`top_logprobs` requires `logprobs: true`",
                    "top_logprobs",
                ))
            }
            Some(n) => {
                return Err(ApiError::invalid(
                    format!("`top_logprobs` must be between 0 and 20, got {n}"),
                    "top_logprobs",
                ))
            }
        };
        options.sampling.logprobs = logprobs;
        options.sampling.top_logprobs = top_logprobs;
        Ok(ChatRequest {
            model,
            messages,
            tools,
            tool_choice,
            parallel_tool_calls,
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

fn messages(body: &RawBody, images: &mut Vec<ImagePart>) -> Result<Vec<Value>, ApiError> {
    let list = body
        .array("messages")?
        .ok_or_else(|| ApiError::invalid("`messages` is required", "messages"))?;
    if list.is_empty() {
        return Err(ApiError::invalid(
            "`messages` must hold at least one message",
            "messages",
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| message(i, m, images))
        .collect()
}

fn message(i: usize, raw: &Value, images: &mut Vec<ImagePart>) -> Result<Value, ApiError> {
    let at = format!("messages[{i}]");
    let obj = raw
        .as_object()
        .ok_or_else(|| wrong_type(&at, "an object", raw))?;
    let field = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let role = match field("role") {
        Some(Value::String(r)) => r.as_str(),
        Some(v) => return Err(wrong_type(&format!("{at}.role"), "a string", v)),
        None => {
            return Err(ApiError::invalid(
                format!("`{at}.role` is required"),
                format!("{at}.role"),
            ))
        }
    };
    // `developer` is OpenAI's newer name for the system role.
    let role = match role {
        "developer" => "system",
        "system" | "user" | "assistant" | "tool" => role,
        other => {
            return Err(ApiError::invalid(
                format!("`{at}.role` must be one of system, developer, user, assistant, tool; got {other:?}"),
                format!("{at}.role"),
            ))
        }
    };
    let mut out = Map::new();
    out.insert("role".into(), json!(role));
    let before = images.len();
    let content = content(&at, field("content"), images)?;
    if images.len() > before && role != "user" {
        return Err(ApiError::invalid(
            format!("image parts are only allowed in user messages, not in {role} messages"),
            format!("{at}.content"),
        ));
    }
    let tool_calls = match (role, field("tool_calls")) {
        ("assistant", Some(calls)) => Some(tool_calls(&at, calls)?),
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                format!("`{at}.tool_calls` is only allowed on assistant messages"),
                format!("{at}.tool_calls"),
            ))
        }
        (_, None) => None,
    };
    match (&content, role, &tool_calls) {
        (Some(_), _, _) | (None, "assistant", Some(_)) => {}
        (None, "assistant", None) => {
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
    if role == "tool" {
        match field("tool_call_id") {
            Some(Value::String(id)) => {
                out.insert("tool_call_id".into(), json!(id));
            }
            Some(v) => return Err(wrong_type(&format!("{at}.tool_call_id"), "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    format!("`{at}.tool_call_id` is required on tool messages"),
                    format!("{at}.tool_call_id"),
                ))
            }
        }
    }
    for key in ["name", "reasoning_content"] {
        match field(key) {
            Some(Value::String(s)) => {
                out.insert(key.into(), json!(s));
            }
            Some(v) => return Err(wrong_type(&format!("{at}.{key}"), "a string", v)),
            None => {}
        }
    }
    Ok(Value::Object(out))
}

/// A string, text parts joined with newlines; or, with images, the list of
/// text and image parts for the template.
fn content(
    at: &str,
    raw: Option<&Value>,
    images: &mut Vec<ImagePart>,
) -> Result<Option<Value>, ApiError> {
    let param = format!("{at}.content");
    match raw {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(Value::String(s.clone()))),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            let mut listed = Vec::with_capacity(parts.len());
            let before = images.len();
            for (j, part) in parts.iter().enumerate() {
                let p = format!("{param}[{j}]");
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => {
                        texts.push(t.as_str());
                        listed.push(json!({ "type": "text", "text": t }));
                    }
                    (Some("image_url"), _) => {
                        images.push(image_part(&p, part)?);
                        listed.push(json!({ "type": "image" }));
                    }
                    (Some("text"), other) => {
                        return Err(wrong_type(&format!("{p}.text"), "a string", other.unwrap_or(&Value::Null)))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::invalid(
                            format!("content parts of type {other:?} are not supported (only text and image_url)"),
                            format!("{p}.type"),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid(format!("`{p}.type` is required"), format!("{p}.type")))
                    }
                }
            }
            if images.len() > before {
                Ok(Some(Value::Array(listed)))
            } else {
                Ok(Some(Value::String(texts.join("\n"))))
            }
        }
        Some(v) => Err(wrong_type(
            &param,
            "a string or an array of content parts",
            v,
        )),
    }
}

/// `{"type": "image_url", "image_url": {"url": ...}}` (a bare string URL is
/// accepted too, as some clients send it).
fn image_part(p: &str, part: &Value) -> Result<ImagePart, ApiError> {
    let url = match part.get("image_url") {
        Some(Value::Object(obj)) => match obj.get("url") {
            Some(Value::String(u)) => u.clone(),
            Some(v) => return Err(wrong_type(&format!("{p}.image_url.url"), "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    format!("`{p}.image_url.url` is required"),
                    format!("{p}.image_url.url"),
                ))
            }
        },
        Some(Value::String(u)) => u.clone(),
        Some(v) => return Err(wrong_type(&format!("{p}.image_url"), "an object", v)),
        None => {
            return Err(ApiError::invalid(
                format!("`{p}.image_url` is required"),
                format!("{p}.image_url"),
            ))
        }
    };
    Ok(ImagePart {
        url,
        param: format!("{p}.image_url.url"),
    })
}

/// `{p}.function` of a tool or tool call: an object with a non-empty name.
fn named_function<'a>(
    obj: &'a Map<String, Value>,
    p: &str,
) -> Result<(&'a Map<String, Value>, &'a str), ApiError> {
    let function = obj
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            ApiError::invalid(
                format!("`{p}.function` must be an object"),
                format!("{p}.function"),
            )
        })?;
    match function.get("name") {
        Some(Value::String(n)) if !n.is_empty() => Ok((function, n)),
        _ => Err(ApiError::invalid(
            format!("`{p}.function.name` must be a non-empty string"),
            format!("{p}.function.name"),
        )),
    }
}

/// Assistant tool calls, with `arguments` decoded from its JSON string so
/// templates that iterate over the arguments (Llama 3.1) can.
fn tool_calls(at: &str, raw: &Value) -> Result<Vec<Value>, ApiError> {
    let param = format!("{at}.tool_calls");
    let list = raw
        .as_array()
        .ok_or_else(|| wrong_type(&param, "an array", raw))?;
    let mut out = Vec::with_capacity(list.len());
    for (k, call) in list.iter().enumerate() {
        let p = format!("{param}[{k}]");
        let obj = call
            .as_object()
            .ok_or_else(|| wrong_type(&p, "an object", call))?;
        let (function, name) = named_function(obj, &p)?;
        let name = name.to_string();
        let arguments = match function.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
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
            Some(v @ Value::Object(_)) => v.clone(),
            Some(v) => {
                return Err(wrong_type(
                    &format!("{p}.function.arguments"),
                    "a string",
                    v,
                ))
            }
        };
        let id = match obj.get("id") {
            Some(Value::String(id)) => Value::String(id.clone()),
            None | Some(Value::Null) => Value::Null,
            Some(v) => return Err(wrong_type(&format!("{p}.id"), "a string", v)),
        };
        out.push(json!({
            "id": id,
            "type": "function",
            "function": { "name": name, "arguments": arguments },
        }));
    }
    Ok(out)
}

fn tools(body: &RawBody) -> Result<Vec<Value>, ApiError> {
    let Some(list) = body.array("tools")? else {
        return Ok(Vec::new());
    };
    let mut names = std::collections::HashSet::new();
    for (i, tool) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        let obj = tool
            .as_object()
            .ok_or_else(|| wrong_type(&p, "an object", tool))?;
        match obj.get("type").and_then(Value::as_str) {
            Some("function") => {}
            _ => {
                return Err(ApiError::invalid(
                    format!("`{p}.type` must be \"function\""),
                    format!("{p}.type"),
                ))
            }
        }
        let (function, name) = named_function(obj, &p)?;
        if !names.insert(name.to_string()) {
            return Err(ApiError::invalid(
                format!("tool {name:?} is defined twice"),
                format!("{p}.function.name"),
            ));
        }
        match function.get("parameters") {
            None | Some(Value::Null) => {}
            Some(schema @ Value::Object(_)) => {
                if let Err(e) = jsonschema::meta::validate(schema) {
                    return Err(ApiError::invalid(
                        format!("`{p}.function.parameters` is not a valid JSON Schema: {e}"),
                        format!("{p}.function.parameters"),
                    ));
                }
            }
            Some(v) => {
                return Err(wrong_type(
                    &format!("{p}.function.parameters"),
                    "an object",
                    v,
                ))
            }
        }
        match function.get("description") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(v) => {
                return Err(wrong_type(
                    &format!("{p}.function.description"),
                    "a string",
                    v,
                ))
            }
        }
        match function.get("strict") {
            None | Some(Value::Null) | Some(Value::Bool(_)) => {}
            Some(v) => return Err(wrong_type(&format!("{p}.function.strict"), "a boolean", v)),
        }
    }
    Ok(list.clone())
}

fn tool_choice(body: &RawBody, tools: &[Value]) -> Result<ToolChoice, ApiError> {
    let choice = match body.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    format!("`tool_choice` must be \"none\", \"auto\", \"required\" or a function, got {other:?}"),
                    "tool_choice",
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "`tool_choice` must look like {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        "tool_choice",
                    )
                })?;
            if !tools.iter().any(|t| t["function"]["name"] == name) {
                return Err(ApiError::invalid(format!("`tool_choice` names {name:?}, which is not in `tools`"), "tool_choice"));
            }
            ToolChoice::Named(name.to_owned())
        }
        Some(v) => return Err(wrong_type("tool_choice", "a string or an object", v)),
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
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
        ChatRequest::parse(&RawBody::parse(v.to_string().as_bytes()).unwrap(), 512)
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
