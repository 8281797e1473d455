//! Tool calls out of generated text, streamed: text outside calls goes out as
//! content at once (holding back only what could still be an open tag), and
//! each call comes out whole when it closes, with `arguments` as the JSON
//! string OpenAI wants.
//!
//! Formats:
//! - `Hermes` (Qwen2.5/Qwen3, Hermes): `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`,
//!   any number of them. The Qwen3-Coder body `<function=NAME><parameter=KEY>
//!   VALUE</parameter></function>` is accepted inside the same tags (values
//!   stay strings: without the tool schema their type is unknown).
//! - `Llama3Json`: the whole message is `{"name": .., "parameters": {..}}`
//!   (several may be separated by `;`, or given as a JSON array), optionally
//!   after `<|python_tag|>`. Whether it is a call is only known when the
//!   message ends, so a message that starts with `{` is held until `finish`.
//! - `Gemma` (Gemma 4): `<|tool_call>call:NAME{key:value,..}<tool_call|>`,
//!   where strings are quoted as `<|"|>text<|"|>` and numbers, booleans,
//!   nested `{..}` and `[..]` are bare. A JSON body is accepted too.
//!
//! Malformed input: a closed call whose body does not parse is given back as
//! content, verbatim with its tags, so nothing the model wrote is lost. A call
//! still open when generation ends is accepted if its body already parses
//! (the model stopped right before the close tag); otherwise `finish` returns
//! `ToolParseError::Unterminated` carrying the raw text, which the caller can
//! show as content (typically with `finish_reason: length`).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use serde_json::{Map, Value};

use crate::stop::{Lexed, TagLexer};

/// How a model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Gemma,
}

/// The literal tags around one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallTags {
    pub open: &'static str,
    pub close: &'static str,
}

const HERMES_TAGS: CallTags = CallTags {
    open: "<tool_call>",
    close: "</tool_call>",
};
const GEMMA_TAGS: CallTags = CallTags {
    open: "<|tool_call>",
    close: "<tool_call|>",
};
/// Llama 3.1 marks a tool-call message with this token; the message itself
/// has no close tag (it ends with `<|eom_id|>`/`<|eot_id|>`, i.e. EOS).
pub const LLAMA3_PYTHON_TAG: &str = "<|python_tag|>";
/// Gemma 4's string quote inside call arguments.
const GEMMA_QUOTE: &str = "<|\"|>";

impl ToolFormat {
    /// The tags around each call, for the tag-delimited formats.
    pub fn tags(self) -> Option<CallTags> {
        match self {
            ToolFormat::Hermes => Some(HERMES_TAGS),
            ToolFormat::Gemma => Some(GEMMA_TAGS),
            ToolFormat::Llama3Json => None,
        }
    }
}

/// One complete call, as OpenAI's `tool_calls[]` wants it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_` + 16 hex digits, unique within the process.
    pub id: String,
    pub name: String,
    /// The arguments object, JSON-encoded.
    pub arguments: String,
}

impl ToolCall {
    fn new(name: String, arguments: String) -> Self {
        Self {
            id: new_call_id(),
            name,
            arguments,
        }
    }
}

/// What the parser lets through, in order. A `push` never returns two
/// adjacent `Content`s nor an empty one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    Content(String),
    Call(ToolCall),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolParseError {
    /// Generation ended inside a tool call whose body does not parse.
    #[error("generation ended inside an unfinished tool call")]
    Unterminated { raw: String },
}

impl ToolParseError {
    /// The verbatim text of the unfinished call, open tag included.
    pub fn raw(&self) -> &str {
        match self {
            ToolParseError::Unterminated { raw } => raw,
        }
    }

    pub fn into_raw(self) -> String {
        match self {
            ToolParseError::Unterminated { raw } => raw,
        }
    }
}

/// The parameters of the tools a request offered, by tool name: formats
/// that write argument values as bare text (Qwen3-Coder's XML) type them
/// by the parameter's schema, as vLLM's `qwen3_coder` parser does.
#[derive(Debug, Clone, Default)]
pub struct ToolSchemas(HashMap<String, Map<String, Value>>);

impl ToolSchemas {
    /// From OpenAI `tools` entries (`{"type": "function", "function":
    /// {"name", "parameters"}}`); entries without a name are skipped.
    pub fn from_tools(tools: &[Value]) -> Self {
        let by_name = tools
            .iter()
            .filter_map(|t| {
                let f = &t["function"];
                let name = f["name"].as_str()?;
                let properties = f["parameters"]["properties"].as_object().cloned();
                Some((name.to_owned(), properties.unwrap_or_default()))
            })
            .collect();
        Self(by_name)
    }

    /// A bare-text value of `tool`'s parameter `key`, typed by its schema:
    /// integers, numbers and booleans parsed where they parse, objects and
    /// arrays (and schemas that allow several types) read as JSON where the
    /// text is JSON, strings and unknown parameters kept as text.
    fn typed(&self, tool: &str, key: &str, text: &str) -> Value {
        if text == "null" {
            return Value::Null;
        }
        let schema = self.0.get(tool).and_then(|p| p.get(key));
        let kind = schema.and_then(|s| s["type"].as_str());
        let parsed = match kind {
            None if schema.is_none() => None,
            Some("string") => None,
            Some("integer") => text.trim().parse::<i64>().ok().map(Value::from),
            Some("number") => {
                let t = text.trim();
                t.parse::<i64>().ok().map(Value::from).or_else(|| {
                    t.parse::<f64>()
                        .ok()
                        .and_then(|f| serde_json::Number::from_f64(f).map(Value::Number))
                })
            }
            Some("boolean") => match text.trim().to_ascii_lowercase().as_str() {
                "true" => Some(Value::Bool(true)),
                "false" => Some(Value::Bool(false)),
                _ => None,
            },
            _ => serde_json::from_str(text.trim()).ok(),
        };
        parsed.unwrap_or_else(|| Value::String(text.to_owned()))
    }
}

/// The streaming tool-call parser.
#[derive(Debug, Clone)]
pub struct ToolParser {
    inner: Inner,
}

#[derive(Debug, Clone)]
enum Inner {
    Tagged(Tagged),
    Whole(WholeMessage),
}

impl ToolParser {
    /// A parser that knows no tool's parameters: bare-text argument values
    /// stay strings.
    pub fn new(format: ToolFormat) -> Self {
        Self::with_schemas(format, Arc::default())
    }

    /// A parser that types bare-text argument values by `schemas`.
    pub fn with_schemas(format: ToolFormat, schemas: Arc<ToolSchemas>) -> Self {
        let inner = match format {
            ToolFormat::Hermes => {
                Inner::Tagged(Tagged::new(HERMES_TAGS, parse_hermes_body, schemas))
            }
            ToolFormat::Gemma => Inner::Tagged(Tagged::new(GEMMA_TAGS, parse_gemma_body, schemas)),
            ToolFormat::Llama3Json => Inner::Whole(WholeMessage::default()),
        };
        Self { inner }
    }

    pub fn push(&mut self, chunk: &str) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        match &mut self.inner {
            Inner::Tagged(t) => t.push(chunk, &mut out),
            Inner::Whole(w) => w.push(chunk, &mut out),
        }
        out
    }

    /// Generation ended: releases held-back text and settles an open call.
    pub fn finish(&mut self) -> Result<Vec<ToolEvent>, ToolParseError> {
        let mut out = Vec::new();
        match &mut self.inner {
            Inner::Tagged(t) => t.finish(&mut out)?,
            Inner::Whole(w) => w.finish(&mut out),
        }
        Ok(out)
    }

    /// Whether the text so far has opened a call (or, for `Llama3Json`, looks
    /// like one) that is not settled yet.
    pub fn in_call(&self) -> bool {
        match &self.inner {
            Inner::Tagged(t) => t.body.is_some(),
            Inner::Whole(w) => w.state == WholeState::Call,
        }
    }
}

/// Non-streaming: all content (trimmed when there are calls, so a pure
/// tool-call message has empty content) and the calls in order. An
/// unfinished call is kept as content.
pub fn parse_complete(format: ToolFormat, text: &str) -> (String, Vec<ToolCall>) {
    let mut parser = ToolParser::new(format);
    let mut events = parser.push(text);
    match parser.finish() {
        Ok(rest) => events.extend(rest),
        Err(e) => events.push(ToolEvent::Content(e.into_raw())),
    }
    let mut content = String::new();
    let mut calls = Vec::new();
    for event in events {
        match event {
            ToolEvent::Content(t) => content.push_str(&t),
            ToolEvent::Call(c) => calls.push(c),
        }
    }
    if !calls.is_empty() {
        content = content.trim().to_owned();
    }
    (content, calls)
}

fn push_content(out: &mut Vec<ToolEvent>, text: &str) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(ToolEvent::Content(prev)) => prev.push_str(text),
        _ => out.push(ToolEvent::Content(text.to_owned())),
    }
}

/// Parses one call body into (name, JSON-encoded arguments).
type BodyParser = fn(&str, &ToolSchemas) -> Option<(String, String)>;

/// Formats where each call sits between an open and a close tag.
#[derive(Debug, Clone)]
struct Tagged {
    tags: CallTags,
    parse_body: BodyParser,
    schemas: Arc<ToolSchemas>,
    lexer: TagLexer,
    /// `Some` while inside a call.
    body: Option<String>,
    /// Just after a call: the newline(s) between calls are not content.
    trim_next: bool,
}

impl Tagged {
    fn new(tags: CallTags, parse_body: BodyParser, schemas: Arc<ToolSchemas>) -> Self {
        Self {
            tags,
            parse_body,
            schemas,
            lexer: TagLexer::default(),
            body: None,
            trim_next: false,
        }
    }

    fn push(&mut self, chunk: &str, out: &mut Vec<ToolEvent>) {
        self.lexer.push(chunk);
        self.drain(false, out);
    }

    fn drain(&mut self, at_end: bool, out: &mut Vec<ToolEvent>) {
        loop {
            let tag = if self.body.is_some() {
                self.tags.close
            } else {
                self.tags.open
            };
            match self.lexer.next(&[tag], at_end) {
                None => break,
                Some(Lexed::Text(text)) => match &mut self.body {
                    Some(body) => body.push_str(&text),
                    None => self.content(&text, out),
                },
                Some(Lexed::Tag(_)) => match self.body.take() {
                    None => self.body = Some(String::new()),
                    Some(body) => self.close(body, out),
                },
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) -> Result<(), ToolParseError> {
        self.drain(true, out);
        let Some(body) = self.body.take() else {
            return Ok(());
        };
        match (self.parse_body)(&body, &self.schemas) {
            Some((name, arguments)) => {
                out.push(ToolEvent::Call(ToolCall::new(name, arguments)));
                Ok(())
            }
            None => Err(ToolParseError::Unterminated {
                raw: format!("{}{body}", self.tags.open),
            }),
        }
    }

    fn close(&mut self, body: String, out: &mut Vec<ToolEvent>) {
        match (self.parse_body)(&body, &self.schemas) {
            Some((name, arguments)) => {
                out.push(ToolEvent::Call(ToolCall::new(name, arguments)));
                self.trim_next = true;
            }
            None => {
                let raw = format!("{}{body}{}", self.tags.open, self.tags.close);
                self.content(&raw, out);
            }
        }
    }

    fn content(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        let text = if self.trim_next {
            text.trim_start()
        } else {
            text
        };
        if !text.is_empty() {
            self.trim_next = false;
            push_content(out, text);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum WholeState {
    /// Only whitespace (or part of `<|python_tag|>`) so far.
    #[default]
    Undecided,
    /// Starts like a call: held until the message ends.
    Call,
    /// Plain text: passed straight through.
    Text,
}

/// `Llama3Json`: the message as a whole is either a call or content.
#[derive(Debug, Clone, Default)]
struct WholeMessage {
    state: WholeState,
    /// Everything pushed while not `Text`.
    raw: String,
    /// Leading whitespace of `raw` already skipped, so a long run of it is
    /// not rescanned on every push.
    lead: usize,
}

impl WholeMessage {
    fn push(&mut self, chunk: &str, out: &mut Vec<ToolEvent>) {
        match self.state {
            WholeState::Text => push_content(out, chunk),
            WholeState::Call => self.raw.push_str(chunk),
            WholeState::Undecided => {
                self.raw.push_str(chunk);
                let unseen = &self.raw[self.lead..];
                self.lead += unseen.len() - unseen.trim_start().len();
                let start = &self.raw[self.lead..];
                if start.is_empty()
                    || (LLAMA3_PYTHON_TAG.starts_with(start) && start != LLAMA3_PYTHON_TAG)
                {
                    return;
                }
                if start.starts_with('{')
                    || start.starts_with('[')
                    || start.starts_with(LLAMA3_PYTHON_TAG)
                {
                    self.state = WholeState::Call;
                } else {
                    self.state = WholeState::Text;
                    push_content(out, &std::mem::take(&mut self.raw));
                }
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let raw = std::mem::take(&mut self.raw);
        if self.state == WholeState::Call {
            let start = raw.trim_start();
            // Plain JSON must name its arguments to count as a call: a JSON
            // answer like {"name": "Ada"} is content. After the python tag
            // the model has declared a call, so be lenient.
            let parsed = match start.strip_prefix(LLAMA3_PYTHON_TAG) {
                Some(body) => parse_json_calls(body, false),
                None => parse_json_calls(start, true),
            };
            if let Some(calls) = parsed {
                out.extend(
                    calls
                        .into_iter()
                        .map(|(n, a)| ToolEvent::Call(ToolCall::new(n, a))),
                );
                return;
            }
        }
        push_content(out, &raw);
    }
}

/// One or more JSON calls: objects or arrays of objects, separated by
/// whitespace or `;`. `None` unless every value is a call.
fn parse_json_calls(text: &str, require_args: bool) -> Option<Vec<(String, String)>> {
    let mut calls = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
        if rest.is_empty() {
            break;
        }
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        rest = &rest[values.byte_offset()..];
        match value {
            Value::Array(items) => {
                for item in &items {
                    calls.push(call_from_json(item, require_args)?);
                }
            }
            other => calls.push(call_from_json(&other, require_args)?),
        }
    }
    (!calls.is_empty()).then_some(calls)
}

/// `{"name": .., "arguments"|"parameters": ..}`, or the same wrapped in
/// OpenAI's `{"type": "function", "function": {..}}`.
fn call_from_json(value: &Value, require_args: bool) -> Option<(String, String)> {
    let obj = value.as_object()?;
    if !obj.contains_key("name") {
        return obj
            .get("function")
            .filter(|f| f.is_object())
            .and_then(|f| call_from_json(f, require_args));
    }
    let name = obj.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let args = obj.get("arguments").or_else(|| obj.get("parameters"));
    if require_args && args.is_none() {
        return None;
    }
    let arguments = match args {
        None | Some(Value::Null) => "{}".to_owned(),
        // Already encoded by the model: keep it as written.
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    Some((name.to_owned(), arguments))
}

fn parse_hermes_body(body: &str, schemas: &ToolSchemas) -> Option<(String, String)> {
    let body = body.trim();
    if body.starts_with("<function=") {
        return parse_xml_function(body, schemas);
    }
    call_from_json(&serde_json::from_str(body).ok()?, false)
}

/// Qwen3-Coder (and Qwen 3.5): `<function=NAME>`
/// `<parameter=KEY>`VALUE`</parameter>`.. `</function>`, with one newline of
/// layout around each value; values typed by the tool's `schemas`.
fn parse_xml_function(body: &str, schemas: &ToolSchemas) -> Option<(String, String)> {
    const PARAM_OPEN: &str = "<parameter=";
    const PARAM_CLOSE: &str = "</parameter>";
    let rest = body.strip_prefix("<function=")?;
    let gt = rest.find('>')?;
    let name = rest[..gt].trim();
    if name.is_empty() {
        return None;
    }
    let mut rest = rest[gt + 1..].trim_end().strip_suffix("</function>")?;
    let mut args = Map::new();
    while let Some(at) = rest.find(PARAM_OPEN) {
        let after = &rest[at + PARAM_OPEN.len()..];
        let gt = after.find('>')?;
        let key = after[..gt].trim();
        let value_and_rest = &after[gt + 1..];
        let end = value_and_rest.find(PARAM_CLOSE)?;
        let value = &value_and_rest[..end];
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        args.insert(key.to_owned(), schemas.typed(name, key, value));
        rest = &value_and_rest[end + PARAM_CLOSE.len()..];
    }
    Some((name.to_owned(), Value::Object(args).to_string()))
}

/// Gemma 4: `call:NAME{key:value,..}` (the `call:` prefix is optional).
fn parse_gemma_body(body: &str, _: &ToolSchemas) -> Option<(String, String)> {
    let body = body.trim();
    if body.starts_with('{') {
        return call_from_json(&serde_json::from_str(body).ok()?, false);
    }
    let body = body
        .strip_prefix("call:")
        .or_else(|| body.strip_prefix(':'))
        .unwrap_or(body);
    let brace = body.find('{')?;
    let name = body[..brace].trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    let mut p = GemmaArgs {
        s: body,
        pos: brace,
        depth: 0,
    };
    let args = p.object()?;
    p.skip_ws();
    if p.pos != body.len() {
        return None;
    }
    Some((name.to_owned(), Value::Object(args).to_string()))
}

/// Recursive-descent reader for Gemma 4's argument syntax.
struct GemmaArgs<'a> {
    s: &'a str,
    pos: usize,
    depth: usize,
}

impl<'a> GemmaArgs<'a> {
    /// Deeper nesting than any real call: refuse instead of recursing on.
    const MAX_DEPTH: usize = 64;

    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    fn skip_ws(&mut self) {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start().len();
    }

    fn eat(&mut self, c: char) -> bool {
        let hit = self.rest().starts_with(c);
        if hit {
            self.pos += c.len_utf8();
        }
        hit
    }

    fn value(&mut self) -> Option<Value> {
        self.skip_ws();
        let rest = self.rest();
        if rest.starts_with(GEMMA_QUOTE) {
            self.quoted().map(Value::String)
        } else if rest.starts_with('{') {
            self.object().map(Value::Object)
        } else if rest.starts_with('[') {
            self.array()
        } else if rest.starts_with('"') {
            self.json_string().map(Value::String)
        } else {
            self.bare()
        }
    }

    fn quoted(&mut self) -> Option<String> {
        self.pos += GEMMA_QUOTE.len();
        let end = self.rest().find(GEMMA_QUOTE)?;
        let text = self.rest()[..end].to_owned();
        self.pos += end + GEMMA_QUOTE.len();
        Some(text)
    }

    fn json_string(&mut self) -> Option<String> {
        let mut values = serde_json::Deserializer::from_str(self.rest()).into_iter::<String>();
        let text = values.next()?.ok()?;
        self.pos += values.byte_offset();
        Some(text)
    }

    /// A number, boolean, null or unquoted word, up to the next delimiter.
    fn bare(&mut self) -> Option<Value> {
        let rest = self.rest();
        let end = rest.find([',', '}', ']']).unwrap_or(rest.len());
        let text = rest[..end].trim();
        if text.is_empty() {
            return None;
        }
        self.pos += end;
        Some(serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned())))
    }

    fn key(&mut self) -> Option<String> {
        let rest = self.rest();
        if rest.starts_with(GEMMA_QUOTE) {
            return self.quoted();
        }
        if rest.starts_with('"') {
            return self.json_string();
        }
        let end = rest.find([':', ',', '}', ']'])?;
        let key = rest[..end].trim();
        if key.is_empty() {
            return None;
        }
        self.pos += end;
        Some(key.to_owned())
    }

    fn object(&mut self) -> Option<Map<String, Value>> {
        if !self.eat('{') || self.depth >= Self::MAX_DEPTH {
            return None;
        }
        self.depth += 1;
        let mut map = Map::new();
        loop {
            self.skip_ws();
            if self.eat('}') {
                break;
            }
            let key = self.key()?;
            self.skip_ws();
            if !self.eat(':') {
                return None;
            }
            let value = self.value()?;
            map.insert(key, value);
            self.skip_ws();
            if !self.eat(',') {
                self.skip_ws();
                if !self.eat('}') {
                    return None;
                }
                break;
            }
        }
        self.depth -= 1;
        Some(map)
    }

    fn array(&mut self) -> Option<Value> {
        if !self.eat('[') || self.depth >= Self::MAX_DEPTH {
            return None;
        }
        self.depth += 1;
        let mut items = Vec::new();
        loop {
            self.skip_ws();
            if self.eat(']') {
                break;
            }
            items.push(self.value()?);
            self.skip_ws();
            if !self.eat(',') {
                self.skip_ws();
                if !self.eat(']') {
                    return None;
                }
                break;
            }
        }
        self.depth -= 1;
        Some(Value::Array(items))
    }
}

/// `call_` + 16 hex digits: a per-process random seed plus a counter, mixed
/// by a bijection, so ids never repeat within a process and differ between
/// processes.
fn new_call_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static SEED: OnceLock<u64> = OnceLock::new();
    let seed = *SEED.get_or_init(|| RandomState::new().hash_one(std::process::id()));
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("call_{:016x}", splitmix64(seed.wrapping_add(n)))
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(json: &str) -> Value {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn hermes_single_call() {
        let (content, calls) = parse_complete(
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        );
        assert_eq!(content, "");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(args(&calls[0].arguments), args(r#"{"city":"Paris"}"#));
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 21);
    }

    #[test]
    fn arguments_string_is_kept_and_parameters_accepted() {
        let (_, calls) = parse_complete(
            ToolFormat::Hermes,
            r#"<tool_call>{"name":"a","arguments":"{\"x\": 1}"}</tool_call><tool_call>{"name":"b","parameters":{"y":[1,2]}}</tool_call><tool_call>{"name":"c"}</tool_call>"#,
        );
        let got: Vec<(&str, &str)> = calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![("a", "{\"x\": 1}"), ("b", r#"{"y":[1,2]}"#), ("c", "{}")]
        );
    }

    #[test]
    fn qwen3_coder_xml_body() {
        let text = "<tool_call>\n<function=search>\n<parameter=query>\nrust lang\n</parameter>\n<parameter=page>\n2\n</parameter>\n</function>\n</tool_call>";
        let (_, calls) = parse_complete(ToolFormat::Hermes, text);
        assert_eq!(calls[0].name, "search");
        assert_eq!(
            args(&calls[0].arguments),
            args(r#"{"query":"rust lang","page":"2"}"#)
        );
    }

    #[test]
    fn qwen3_coder_xml_values_are_typed_by_the_tool_schema() {
        let tools = [
            json!({"type": "function", "function": {"name": "book", "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"},
                "pets": {"type": "boolean"}, "rooms": {"type": "array"}, "extra": {"type": "object"},
                "note": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            }}}}),
        ];
        let schemas = Arc::new(ToolSchemas::from_tools(&tools));
        let param = |k: &str, v: &str| format!("<parameter={k}>\n{v}\n</parameter>\n");
        let body: String = [
            param("city", "42"),
            param("nights", "3"),
            param("budget", "99.5"),
            param("pets", "True"),
            param("rooms", "[1, 2]"),
            param("extra", "{\"view\": \"sea\"}"),
            param("note", "7"),
            param("unknown", "8"),
            param("age", "null"),
        ]
        .concat();
        let text = format!("<tool_call>\n<function=book>\n{body}</function>\n</tool_call>");
        let mut parser = ToolParser::with_schemas(ToolFormat::Hermes, schemas);
        let mut events = parser.push(&text);
        events.extend(parser.finish().unwrap());
        let [ToolEvent::Call(call)] = &events[..] else {
            panic!("{events:?}");
        };
        assert_eq!(
            args(&call.arguments),
            json!({"city": "42", "nights": 3, "budget": 99.5, "pets": true, "rooms": [1, 2],
                   "extra": {"view": "sea"}, "note": 7, "unknown": "8", "age": null})
        );
        // What does not parse as its type stays text; without schemas, all text.
        let (_, calls) = parse_complete(ToolFormat::Hermes, &text);
        assert_eq!(args(&calls[0].arguments)["nights"], "3");
        let odd = "<tool_call>\n<function=book>\n<parameter=nights>\nthree\n</parameter>\n</function>\n</tool_call>";
        let mut parser = ToolParser::with_schemas(
            ToolFormat::Hermes,
            Arc::new(ToolSchemas::from_tools(&tools)),
        );
        let events = parser.push(odd);
        let [ToolEvent::Call(call)] = &events[..] else {
            panic!("{events:?}");
        };
        assert_eq!(args(&call.arguments)["nights"], "three");
    }

    #[test]
    fn gemma_call_syntax() {
        let text =
            "<|tool_call>call:get_weather{location:<|\"|>Paris, FR<|\"|>,days:3,metric:true,\
                    opts:{tags:[<|\"|>a<|\"|>,2,null],note:plain word}}<tool_call|>";
        let (content, calls) = parse_complete(ToolFormat::Gemma, text);
        assert_eq!(content, "");
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            args(&calls[0].arguments),
            args(
                r#"{"location":"Paris, FR","days":3,"metric":true,"opts":{"tags":["a",2,null],"note":"plain word"}}"#
            )
        );
        let (_, calls) = parse_complete(ToolFormat::Gemma, "<|tool_call>call:ping{}<tool_call|>");
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("ping", "{}")
        );
    }

    #[test]
    fn gemma_deep_nesting_is_refused_not_overflowed() {
        let body = format!("call:f{{a:{}1{}}}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(parse_gemma_body(&body, &ToolSchemas::default()).is_none());
    }

    #[test]
    fn llama3_whole_message() {
        let (content, calls) = parse_complete(
            ToolFormat::Llama3Json,
            " {\"name\": \"f\", \"parameters\": {\"q\": 1}}",
        );
        assert_eq!(content, "");
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("f", r#"{"q":1}"#)
        );
        let (_, calls) = parse_complete(
            ToolFormat::Llama3Json,
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {}}",
        );
        assert_eq!(
            calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
    }

    #[test]
    fn llama3_json_answer_is_content() {
        let text = "{\"name\": \"Ada\", \"born\": 1815}";
        assert_eq!(
            parse_complete(ToolFormat::Llama3Json, text),
            (text.to_owned(), vec![])
        );
        let text = "{\"name\": \"f\", \"parameters\": {}} and then some";
        assert_eq!(
            parse_complete(ToolFormat::Llama3Json, text),
            (text.to_owned(), vec![])
        );
    }

    #[test]
    fn invalid_closed_call_is_content_and_unterminated_is_an_error() {
        let text = "hi <tool_call>{not json}</tool_call> bye";
        assert_eq!(
            parse_complete(ToolFormat::Hermes, text),
            (text.to_owned(), vec![])
        );

        let mut p = ToolParser::new(ToolFormat::Hermes);
        assert_eq!(
            p.push("ok <tool_call>{\"name\": \"f\", \"argu"),
            vec![ToolEvent::Content("ok ".into())]
        );
        assert!(p.in_call());
        let err = p.finish().unwrap_err();
        assert_eq!(err.raw(), "<tool_call>{\"name\": \"f\", \"argu");

        // Body complete but the close tag never came: accepted.
        let mut p = ToolParser::new(ToolFormat::Hermes);
        p.push("<tool_call>{\"name\": \"f\", \"arguments\": {}}\n");
        let events = p.finish().unwrap();
        assert!(matches!(&events[..], [ToolEvent::Call(c)] if c.name == "f"));
    }

    #[test]
    fn ids_are_unique() {
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| new_call_id()).collect();
        assert_eq!(ids.len(), 1000);
    }
}
