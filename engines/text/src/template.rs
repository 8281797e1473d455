//! Chat templates, rendered the way `transformers.apply_chat_template` does.
//!
//! Models ship Jinja templates written against Python's jinja2 plus a few
//! helpers that transformers installs. Rendering them with minijinja matches
//! byte-for-byte only if the environment matches too:
//!
//! * `trim_blocks` and `lstrip_blocks` on, `keep_trailing_newline` OFF
//!   (transformers leaves jinja2's default, which drops one trailing newline);
//! * `loopcontrols` (`{% break %}`), `namespace`, `dict`, `raise_exception`,
//!   `strftime_now`, and a `tojson` that is Python's `json.dumps` (", "/": "
//!   separators, no HTML escaping, `indent`/`ensure_ascii`/`sort_keys`), not
//!   minijinja's compact HTML-safe one;
//! * Python string and dict methods (`.startswith`, `.split`, `.items()`...)
//!   through minijinja-contrib's pycompat callback;
//! * Python's printing of `None`/`True`/`False`, lists and dicts;
//! * `{% generation %}` blocks (transformers' assistant-mask extension),
//!   which render their body unchanged;
//! * the same context: message keys whose value is null dropped, reasoning
//!   aliased under `reasoning_content` and `thinking`, `tools`/`documents`
//!   defined (possibly none), the special tokens, then the caller's kwargs.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};
use serde_json::{Map, Value as Json};

use crate::tokenizer::token_string;

/// Errors from loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("chat template {name:?} does not compile: {message}")]
    Syntax { name: String, message: String },
    #[error("the model has chat templates {names:?} but none named \"default\"")]
    NoDefault { names: Vec<String> },
    /// The template itself rejected the conversation (`raise_exception`),
    /// e.g. "Conversation roles must alternate": a client error.
    #[error("{0}")]
    Raised(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
}

pub type Result<T, E = TemplateError> = std::result::Result<T, E>;

/// Name of the template used when no other applies.
pub const DEFAULT: &str = "default";
/// Name of the template transformers prefers when tools are passed.
pub const TOOL_USE: &str = "tool_use";

/// Everything a render needs besides the messages.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// Tool JSON schemas (`{"type": "function", "function": {...}}`), passed
    /// to the template as `tools`; `None` renders `tools` as none.
    pub tools: Option<Vec<Json>>,
    /// Append the assistant header so the model answers next.
    pub add_generation_prompt: bool,
    /// Extra template variables (`enable_thinking`, `date_string`...). They
    /// override the special tokens, as in transformers.
    pub kwargs: Map<String, Json>,
}

impl RenderOptions {
    /// Options with `add_generation_prompt` set.
    pub fn with_generation_prompt(mut self) -> Self {
        self.add_generation_prompt = true;
        self
    }
}

/// A model's chat template(s), compiled once. `Send + Sync`.
pub struct ChatTemplate {
    env: Environment<'static>,
    names: Vec<String>,
    /// bos_token, eos_token, pad_token, unk_token, as far as the model sets
    /// them (transformers passes its `special_tokens_map`).
    special_tokens: BTreeMap<String, String>,
    inserts_bos: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("names", &self.names)
            .field("special_tokens", &self.special_tokens)
            .field("inserts_bos", &self.inserts_bos)
            .finish()
    }
}

impl ChatTemplate {
    /// Loads the chat template(s) of a model directory, with the precedence
    /// transformers uses: `chat_template.jinja` (and
    /// `additional_chat_templates/*.jinja`) over `tokenizer_config.json`'s
    /// `chat_template` over `chat_template.json`. `Ok(None)` when the model
    /// has no template (a base model).
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        Self::from_dir_or(dir, &Json::Object(Map::new()))
    }

    /// [`ChatTemplate::from_dir`] of the directory beside a GGUF file: where
    /// it has no `tokenizer_config.json`, the special tokens (`bos_token`
    /// ...) are those of `defaults`, the file's metadata.
    pub fn from_dir_or(dir: &Path, defaults: &Json) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let (config, special) = if config_path.exists() {
            let config = read_json(&config_path)?;
            let special = special_tokens(&config);
            (config, special)
        } else {
            (Json::Object(Map::new()), special_tokens(defaults))
        };
        let mut templates: Vec<(String, String)> = Vec::new();
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            templates.push((DEFAULT.to_owned(), read_text(&jinja)?));
        }
        let extra_dir = dir.join("additional_chat_templates");
        if extra_dir.is_dir() {
            let entries = std::fs::read_dir(&extra_dir).map_err(|source| TemplateError::Read {
                path: extra_dir.clone(),
                source,
            })?;
            let mut extra = Vec::new();
            for entry in entries {
                let path = entry
                    .map_err(|source| TemplateError::Read {
                        path: extra_dir.clone(),
                        source,
                    })?
                    .path();
                if path.extension().is_some_and(|e| e == "jinja") {
                    if let Some(stem) = path.file_stem().and_then(|s| s.to_str()) {
                        extra.push((stem.to_owned(), read_text(&path)?));
                    }
                }
            }
            extra.sort();
            templates.extend(extra);
        }
        if templates.is_empty() {
            if let Some(v) = config.get("chat_template") {
                templates = parse_template_field(v, &config_path)?;
            }
        }
        if templates.is_empty() {
            let path = dir.join("chat_template.json");
            if path.exists() {
                if let Some(v) = read_json(&path)?.get("chat_template") {
                    templates = parse_template_field(v, &path)?;
                }
            }
        }
        if templates.is_empty() {
            return Ok(None);
        }
        Self::with_templates(templates, special).map(Some)
    }

    /// The template of an in-memory `tokenizer_config.json` (a GGUF file's
    /// metadata); `origin` names it in errors. `Ok(None)` without one.
    pub fn from_tokenizer_config(config: &Json, origin: &Path) -> Result<Option<Self>> {
        let templates = match config.get("chat_template") {
            Some(v) => parse_template_field(v, origin)?,
            None => Vec::new(),
        };
        if templates.is_empty() {
            return Ok(None);
        }
        Self::with_templates(templates, special_tokens(config)).map(Some)
    }

    /// One template source with its special tokens.
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        let mut special = BTreeMap::new();
        if let Some(t) = bos_token {
            special.insert("bos_token".to_owned(), t.to_owned());
        }
        if let Some(t) = eos_token {
            special.insert("eos_token".to_owned(), t.to_owned());
        }
        Self::with_templates(vec![(DEFAULT.to_owned(), source.to_owned())], special)
    }

    /// Named templates (`default`, `tool_use`, ...) plus the special-token
    /// variables (`bos_token` ... ) every render sees.
    pub fn with_templates(
        templates: Vec<(String, String)>,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<Self> {
        let mut env = hf_environment();
        let mut names = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            let source = rewrite_generation_tags(&source).into_owned();
            env.add_template_owned(name.clone(), source)
                .map_err(|e| TemplateError::Syntax {
                    name: name.clone(),
                    message: describe(&e),
                })?;
            names.push(name);
        }
        let mut template = ChatTemplate {
            env,
            names,
            special_tokens,
            inserts_bos: false,
        };
        template.inserts_bos = template.probe_inserts_bos();
        Ok(template)
    }

    /// Names of the templates the model ships.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Whether the model has a separate `tool_use` template.
    pub fn has_tool_use(&self) -> bool {
        self.names.iter().any(|n| n == TOOL_USE)
    }

    /// Whether rendered prompts begin with the BOS string (Llama 3, Gemma):
    /// such prompts must be encoded without adding special tokens, or BOS is
    /// doubled. (`Tokenizer::encode_chat` always does that, like
    /// transformers.)
    pub fn inserts_bos(&self) -> bool {
        self.inserts_bos
    }

    /// Renders a conversation with the template transformers would pick:
    /// `tool_use` when tools are given and it exists, else `default`.
    pub fn render(&self, messages: &[Json], options: &RenderOptions) -> Result<String> {
        let name = if options.tools.is_some() && self.has_tool_use() {
            TOOL_USE
        } else if self.names.iter().any(|n| n == DEFAULT) {
            DEFAULT
        } else {
            return Err(TemplateError::NoDefault {
                names: self.names.clone(),
            });
        };
        self.render_named(name, messages, options)
    }

    /// Renders with one named template.
    pub fn render_named(
        &self,
        name: &str,
        messages: &[Json],
        options: &RenderOptions,
    ) -> Result<String> {
        let template = self
            .env
            .get_template(name)
            .map_err(|e| TemplateError::Render(describe(&e)))?;
        let ctx = self.context(messages, options)?;
        template.render(ctx).map_err(|e| match raised_message(&e) {
            Some(msg) => TemplateError::Raised(msg),
            None => TemplateError::Render(describe(&e)),
        })
    }

    fn context(&self, messages: &[Json], options: &RenderOptions) -> Result<Value> {
        let mut chat = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let Json::Object(m) = m else {
                return Err(TemplateError::Render(format!(
                    "message {i} is not a JSON object"
                )));
            };
            chat.push(Json::Object(normalize_message(m)));
        }
        let mut ctx = Map::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), Json::String(v.clone()));
        }
        for (k, v) in &options.kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Json::Array(chat));
        ctx.insert(
            "tools".into(),
            options.tools.clone().map_or(Json::Null, Json::Array),
        );
        ctx.insert("documents".into(), Json::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(options.add_generation_prompt),
        );
        Ok(Value::from_serialize(&ctx))
    }

    fn probe_inserts_bos(&self) -> bool {
        let Some(bos) = self.special_tokens.get("bos_token") else {
            return false;
        };
        let probe = [serde_json::json!({"role": "user", "content": "hi"})];
        let options = RenderOptions {
            add_generation_prompt: true,
            ..Default::default()
        };
        self.render(&probe, &options)
            .is_ok_and(|s| !bos.is_empty() && s.starts_with(bos.as_str()))
    }
}

/// Mirrors what vLLM does to each message before rendering: keys whose
/// value is null are dropped, except `content`, which becomes "" (OpenAI
/// clients send `content: null` next to `tool_calls`), and reasoning sent
/// as `reasoning_content`, `thinking` or `reasoning` is visible under both
/// `reasoning_content` and `thinking`.
fn normalize_message(m: &Map<String, Json>) -> Map<String, Json> {
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| m.get(*k).filter(|v| !v.is_null()))
        .cloned();
    let mut out = Map::new();
    if let Some(r) = &reasoning {
        out.insert("thinking".into(), r.clone());
    }
    for (k, v) in m {
        if !v.is_null() {
            out.insert(k.clone(), v.clone());
        }
    }
    if let Some(r) = reasoning {
        out.insert("reasoning_content".into(), r);
    }
    // A missing or null content (an assistant turn that only calls tools)
    // renders as "", as vLLM does, so templates that concatenate
    // `message['content']` work on every message.
    out.entry("content")
        .or_insert_with(|| Json::String(String::new()));
    out
}

/// The special-token variables every render sees, from `tokenizer_config.json`.
fn special_tokens(config: &Json) -> BTreeMap<String, String> {
    ["bos_token", "eos_token", "pad_token", "unk_token"]
        .into_iter()
        .filter_map(|key| Some((key.to_owned(), config.get(key).and_then(token_string)?)))
        .collect()
}

/// `chat_template` is a string, or a list of `{"name", "template"}`.
fn parse_template_field(v: &Json, path: &Path) -> Result<Vec<(String, String)>> {
    let invalid = |message: String| TemplateError::Invalid {
        path: path.to_owned(),
        message,
    };
    match v {
        Json::Null => Ok(Vec::new()),
        Json::String(s) => Ok(vec![(DEFAULT.to_owned(), s.clone())]),
        Json::Array(items) => items
            .iter()
            .map(|item| {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some(n), Some(t)) => Ok((n.to_owned(), t.to_owned())),
                    _ => Err(invalid(format!(
                        "chat_template entries must be {{\"name\", \"template\"}} strings, got {item}"
                    ))),
                }
            })
            .collect(),
        other => Err(invalid(format!(
            "chat_template must be a string or a list, got {other}"
        ))),
    }
}

fn hf_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    // jinja2's `sequence` test is "has len and getitem": strings and dicts
    // pass it too.
    env.add_test("sequence", |v: Value| {
        matches!(
            v.kind(),
            ValueKind::Seq | ValueKind::String | ValueKind::Map
        )
    });
    env
}

/// Marks errors raised by the template itself, so they can be told apart
/// from bugs in rendering.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: Value) -> Result<Value, Error> {
    let message = message
        .as_str()
        .map_or_else(|| message.to_string(), str::to_owned);
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn raised_message(e: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(r) = s.downcast_ref::<Raised>() {
            return Some(r.0.clone());
        }
        source = s.source();
    }
    None
}

/// minijinja's error plus its template location and cause chain.
fn describe(e: &Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let _ = write!(out, ": {s}");
        source = s.source();
    }
    out
}

/// Python's `datetime.now().strftime(format)`, in local time.
fn strftime_now(format: &str) -> Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item<'_>> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: unsupported format {format:?}"),
        ));
    }
    let mut out = String::new();
    write!(
        out,
        "{}",
        chrono::Local::now().format_with_items(items.into_iter())
    )
    .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now: format failed"))?;
    Ok(out)
}

/// Prints values as jinja2 does on Python: `None`, `True`, `False`, float
/// reprs (`1e+16`), and Python reprs for lists and dicts. Undefined prints
/// nothing.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &State,
    value: &Value,
) -> Result<(), Error> {
    let python = match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => true,
        ValueKind::Number => !value.is_integer(),
        _ => false,
    };
    if python {
        let mut s = String::new();
        py_repr(value, &mut s)?;
        out.write_str(&s).map_err(Error::from)
    } else {
        minijinja::escape_formatter(out, state, value)
    }
}

fn py_repr(v: &Value, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::String => py_str_repr(v.as_str().unwrap_or_default(), out),
        // minijinja keeps integers and floats apart; `1.0` prints as a float.
        ValueKind::Number if !v.is_integer() => py_float(f64::try_from(v.clone())?, out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, out)?;
                out.push_str(": ");
                py_repr(&v.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
    Ok(())
}

fn py_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for
/// exponents in [-4, 16), scientific (`1e+16`, `1.5e-07`) otherwise.
fn py_float(f: f64, out: &mut String) {
    if f.is_nan() {
        out.push_str("NaN");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    if f == 0.0 {
        out.push_str(if f.is_sign_negative() { "-0.0" } else { "0.0" });
        return;
    }
    let sci = format!("{f:e}"); // e.g. "-1.2345e-7", shortest round-trip
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    out.push_str(sign);
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exp - 1) as usize));
            out.push_str(&digits);
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.push_str(&"0".repeat(int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`.
fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let mut opts = JsonOptions::default();
    // Positional order is json.dumps's: ensure_ascii, indent, separators, sort_keys.
    let positional = args.0;
    let arg = |i: usize, name: &str| -> Result<Option<Value>, Error> {
        let kw: Option<Value> = kwargs.get(name)?;
        Ok(kw.or_else(|| positional.get(i).cloned()))
    };
    if let Some(v) = arg(0, "ensure_ascii")? {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = arg(1, "indent")? {
        opts.indent = match v.kind() {
            ValueKind::None | ValueKind::Undefined => None,
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            _ => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int")
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        };
    }
    let separators = arg(2, "separators")?;
    if let Some(v) = arg(3, "sort_keys")? {
        opts.sort_keys = v.is_true();
    }
    let (item_sep, key_sep) = match separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => (a.to_string(), b.to_string()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair",
                    ))
                }
            }
        }
        None if opts.indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    opts.item_sep = item_sep;
    opts.key_sep = key_sep;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

#[derive(Default)]
struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn write_json(v: &Value, o: &JsonOptions, depth: usize, out: &mut String) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::String => json_str(v.as_str().unwrap_or_default(), o.ensure_ascii, out),
        ValueKind::Number if !v.is_integer() => py_float(f64::try_from(v.clone())?, out),
        ValueKind::Number => {
            let _ = write!(out, "{v}");
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                write_json(item, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                let key_str = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
                    ValueKind::None => "null".to_owned(),
                    ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
                    _ => key.to_string(),
                };
                json_str(&key_str, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                write_json(&v.get_item(key)?, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: Object of type Undefined is not JSON serializable",
            ))
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// A JSON string the way Python's json module writes it.
fn json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// transformers' `{% generation %}...{% endgeneration %}` extension only
/// records where assistant text lies; rendering-wise it is a plain block.
/// Rewriting the tags to `{% if true %}...{% endif %}` keeps the template's
/// whitespace control (`-`/`+`) exactly.
fn rewrite_generation_tags(src: &str) -> Cow<'_, str> {
    if !src.contains("generation") {
        return Cow::Borrowed(src);
    }
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    let mut changed = false;
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}") else {
            break;
        };
        let tag = &rest[start + 2..start + len];
        let open = tag.len() - tag.trim_start_matches(['-', '+']).len();
        let close = tag.len() - tag.trim_end_matches(['-', '+']).len();
        let inner = tag[open..tag.len() - close].trim();
        let replacement = match inner {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        out.push_str(&rest[..start + 2]);
        match replacement {
            Some(r) => {
                changed = true;
                out.push_str(&tag[..open]);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.push_str(&tag[tag.len() - close..]);
            }
            None => out.push_str(tag),
        }
        out.push_str("%}");
        rest = &rest[start + len + 2..];
    }
    if !changed {
        return Cow::Borrowed(src);
    }
    out.push_str(rest);
    Cow::Owned(out)
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| TemplateError::Read {
        path: path.to_owned(),
        source,
    })
}

fn read_json(path: &Path) -> Result<Json> {
    serde_json::from_str(&read_text(path)?).map_err(|source| TemplateError::Json {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fixtures::Family;
    use serde_json::json;

    // Expected outputs, produced by transformers' own
    // `render_jinja_template` from the same templates and inputs.
    const QWEN3_TOOLS: &str = r##"<|im_start|>system
You are a helpful assistant.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
What's the weather in Paris?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temperature": 21}
</tool_response><|im_end|>
<|im_start|>assistant
"##;

    const QWEN3_TOOLS_NO_THINKING: &str = r##"<|im_start|>system
You are a helpful assistant.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
What's the weather in Paris?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temperature": 21}
</tool_response><|im_end|>
<|im_start|>assistant
<think>

</think>

"##;

    const LLAMA31_TOOLS: &str = r##"<|begin_of_text|><|start_header_id|>system<|end_header_id|>

Environment: ipython
Cutting Knowledge Date: December 2023
Today Date: 26 Jul 2024

You are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.

{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {
                    "type": "string"
                },
                "unit": {
                    "type": "string",
                    "enum": [
                        "c",
                        "f"
                    ]
                }
            },
            "required": [
                "city"
            ]
        }
    }
}

What's the weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>

{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>

"{\"temperature\": 21}"<|eot_id|><|start_header_id|>assistant<|end_header_id|>

"##;

    const QWEN25_TOOLS: &str = r##"<|im_start|>system
You are a helpful assistant.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
What's the weather in Paris?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temperature": 21}
</tool_response><|im_end|>
<|im_start|>assistant
"##;

    const GEMMA3_CHAT: &str = r##"<bos><start_of_turn>user
You are a helpful assistant.

What's the weather in Paris?<end_of_turn>
<start_of_turn>model
It is sunny.<end_of_turn>
<start_of_turn>user
Thanks!<end_of_turn>
<start_of_turn>model
"##;

    fn tools() -> Vec<Json> {
        vec![json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string"},
                               "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"]}}})]
    }

    /// system + user + assistant(tool_calls) + tool.
    fn tool_conversation() -> Vec<Json> {
        vec![
            json!({"role": "system", "content": "You are a helpful assistant."}),
            json!({"role": "user", "content": "What's the weather in Paris?"}),
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"}),
        ]
    }

    fn options(tools: Option<Vec<Json>>, kwargs: Json) -> RenderOptions {
        RenderOptions {
            tools,
            add_generation_prompt: true,
            kwargs: kwargs.as_object().cloned().unwrap_or_default(),
        }
    }

    fn family(f: Family, bos: Option<&str>, eos: &str) -> ChatTemplate {
        ChatTemplate::new(fixtures::tokenizer::chat_template(f), bos, Some(eos)).unwrap()
    }

    #[test]
    fn qwen3_with_tools_and_thinking_switch() {
        let t = family(Family::Qwen3, None, "<|im_end|>");
        let conv = tool_conversation();
        assert_eq!(
            t.render(&conv, &options(Some(tools()), json!({}))).unwrap(),
            QWEN3_TOOLS
        );
        assert_eq!(
            t.render(
                &conv,
                &options(Some(tools()), json!({"enable_thinking": false}))
            )
            .unwrap(),
            QWEN3_TOOLS_NO_THINKING
        );
        assert!(!t.inserts_bos());
    }

    #[test]
    fn qwen3_keeps_reasoning_only_after_the_last_query() {
        let t = family(Family::Qwen3, None, "<|im_end|>");
        let conv = vec![
            json!({"role": "user", "content": "Hi"}),
            json!({"role": "assistant", "content": "<think>\nold\n</think>\n\nHello"}),
            json!({"role": "user", "content": "2+2?"}),
            json!({"role": "assistant", "reasoning": "add", "content": "4"}),
        ];
        let got = t.render(&conv, &RenderOptions::default()).unwrap();
        assert_eq!(
            got,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n\
             <|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n"
        );
    }

    #[test]
    fn llama31_puts_tools_in_the_first_user_message() {
        let t = family(Family::Llama, Some("<|begin_of_text|>"), "<|eot_id|>");
        let got = t
            .render(&tool_conversation(), &options(Some(tools()), json!({})))
            .unwrap();
        assert_eq!(got, LLAMA31_TOOLS);
        assert!(t.inserts_bos());
    }

    #[test]
    fn qwen25_with_tools() {
        let t = family(Family::Qwen2, None, "<|im_end|>");
        let got = t
            .render(&tool_conversation(), &options(Some(tools()), json!({})))
            .unwrap();
        assert_eq!(got, QWEN25_TOOLS);
    }

    #[test]
    fn gemma3_folds_the_system_prompt_into_the_first_turn() {
        let t = family(Family::Gemma3, Some("<bos>"), "<eos>");
        let conv = vec![
            json!({"role": "system", "content": "You are a helpful assistant."}),
            json!({"role": "user", "content": "What's the weather in Paris?"}),
            json!({"role": "assistant", "content": "It is sunny."}),
            json!({"role": "user", "content": "Thanks!"}),
        ];
        assert_eq!(
            t.render(&conv, &RenderOptions::default().with_generation_prompt())
                .unwrap(),
            GEMMA3_CHAT
        );
        assert!(t.inserts_bos());
        // Gemma 3's template has no tool role: the conversation above with a
        // tool result is rejected by the template itself.
        let err = t
            .render(&tool_conversation(), &RenderOptions::default())
            .unwrap_err();
        match err {
            TemplateError::Raised(msg) => assert!(msg.contains("must alternate"), "{msg}"),
            other => panic!("expected Raised, got {other:?}"),
        }
    }

    /// Jinja features and helpers, against what transformers renders.
    #[test]
    fn python_jinja_compatibility() {
        let cases: &[(&str, &str)] = &[
            ("{{ x | tojson }}", "{\"b\": 1, \"a\": [1.0, 2.5, 1e+16, 1.5e-07, -0.0, 100, 123456789.125], \"s\": \"<a href='x'>&</a> é 🎉\\n\\t\\\"q\\\"\\\\\", \"n\": null, \"t\": true, \"e\": [], \"o\": {}}"),
            ("{{ x | tojson(indent=2) }}", "{\n  \"b\": 1,\n  \"a\": [\n    1.0,\n    2.5,\n    1e+16,\n    1.5e-07,\n    -0.0,\n    100,\n    123456789.125\n  ],\n  \"s\": \"<a href='x'>&</a> é 🎉\\n\\t\\\"q\\\"\\\\\",\n  \"n\": null,\n  \"t\": true,\n  \"e\": [],\n  \"o\": {}\n}"),
            ("{{ x | tojson(ensure_ascii=true) }}", "{\"b\": 1, \"a\": [1.0, 2.5, 1e+16, 1.5e-07, -0.0, 100, 123456789.125], \"s\": \"<a href='x'>&</a> \\u00e9 \\ud83c\\udf89\\n\\t\\\"q\\\"\\\\\", \"n\": null, \"t\": true, \"e\": [], \"o\": {}}"),
            ("{{ x | tojson(sort_keys=true, separators=(',', ':')) }}", "{\"a\":[1.0,2.5,1e+16,1.5e-07,-0.0,100,123456789.125],\"b\":1,\"e\":[],\"n\":null,\"o\":{},\"s\":\"<a href='x'>&</a> é 🎉\\n\\t\\\"q\\\"\\\\\",\"t\":true}"),
            ("{{ none }} {{ true }} {{ false }} {{ [1, 'a', none, 2.0] }} {{ {'k': \"it's\", 'q': 'say \"hi\"'} }} {{ undefined_var }}.", "None True False [1, 'a', None, 2.0] {'k': \"it's\", 'q': 'say \"hi\"'} ."),
            ("{{ 'a,b,,c'.split(',') }} {{ 'a  b c'.split() }} [{{ '  x  '.strip() }}] {{ 'xxhixx'.strip('x') }} {{ 'Hello'.startswith('He') }} {{ 'Hello'.endswith('lo') }} {{ 'a b'.upper() }} {{ 'A'.lower() }} {{ 'a-b'.replace('-', '+') }}", "['a', 'b', '', 'c'] ['a', 'b', 'c'] [x] hi True True A B a a+b"),
            ("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %} {{ d.get('missing', 'dflt') }} {{ d.get('a') }} {{ d.keys() | list }} {{ 'a' in d }}", "a=1;b=two; dflt 1 ['a', 'b'] True"),
            ("{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i > 4 %}{% break %}{% endif %}{{ i }}{% endfor %}", "0134"),
            ("{%- set ns = namespace(n=0) %}{% for m in [1,2,3] %}{% set ns.n = ns.n + m %}{% endfor %}{{ ns.n }}", "6"),
            ("{% generation %}A{% endgeneration %}-{%- generation -%}  B  {%- endgeneration -%}  -", "A-B-"),
            ("{{ [1,2,3][::-1] }} {{ 'abc'[::-1] }} {{ [1,2,3][1:] }}", "[3, 2, 1] cba [2, 3]"),
            ("x\n", "x"),
            ("{{ 'x' is string }} {{ [1] is sequence }} {{ 'ab' is sequence }} {{ {} is mapping }} {{ 's' is iterable }} {{ 1 is number }}", "True True True True True True"),
            ("{{ 7 // 2 }} {{ 7 / 2 }} {{ 2 ** 3 }} {{ 'ab' * 2 }} {{ 10 % 3 }} {{ 3.0 }} {{ 1e16 }} {{ 0.1 + 0.2 }}", "3 3.5 8 abab 1 3.0 1e+16 0.30000000000000004"),
            ("{{ dict(a=1, b=[true]) }}", "{'a': 1, 'b': [True]}"),
            ("{{ d.missing is defined }} {{ d.missing is undefined }} {{ nothing | default('dflt') }}", "False True dflt"),
            ("{% if true %}\n    indented\n{% endif %}\n  {%- if true %} x {% endif %}\nend", "    indented\n x end"),
            ("{{ '  trim me  ' | trim }}|{{ [3,1,2] | sort | join(',') }}|{{ d | length }}|{{ 'abc' | length }}", "trim me|1,2,3|2|3"),
            ("{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | join('/') }}", "u1/u2"),
        ];
        let ctx_x = json!({"b": 1, "a": [1.0, 2.5, 1e16, 1.5e-7, -0.0, 100, 123456789.125],
            "s": "<a href='x'>&</a> é 🎉\n\t\"q\"\\", "n": null, "t": true, "e": [], "o": {}});
        let messages = vec![
            json!({"role": "user", "content": "u1"}),
            json!({"role": "assistant", "content": "a"}),
            json!({"role": "user", "content": "u2"}),
        ];
        for (source, want) in cases {
            let t = ChatTemplate::new(source, None, None).unwrap();
            let opts = RenderOptions {
                kwargs: json!({"x": ctx_x, "d": {"a": 1, "b": "two"}})
                    .as_object()
                    .unwrap()
                    .clone(),
                ..Default::default()
            };
            let got = t
                .render(&messages, &opts)
                .unwrap_or_else(|e| panic!("{source}: {e}"));
            assert_eq!(got, *want, "template: {source}");
        }
    }

    #[test]
    fn strftime_now_formats_local_time() {
        let t = ChatTemplate::new(
            "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y') }}",
            None,
            None,
        )
        .unwrap();
        let got = t.render(&[], &RenderOptions::default()).unwrap();
        let today = chrono::Local::now();
        assert_eq!(
            got,
            format!("{}|{}", today.format("%Y-%m-%d"), today.format("%d %b %Y"))
        );
        let bad = ChatTemplate::new("{{ strftime_now('%Q') }}", None, None).unwrap();
        assert!(bad.render(&[], &RenderOptions::default()).is_err());
    }

    #[test]
    fn null_fields_are_dropped_and_reasoning_aliased() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.role }}:{{ m.content | length }}:{{ 'name' in m }}:{{ m.thinking }}:{{ m.reasoning_content }};{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let got = t
            .render(
                &[
                    json!({"role": "assistant", "content": null, "name": null, "thinking": "t"}),
                    json!({"role": "user", "content": "x"}),
                ],
                &RenderOptions::default(),
            )
            .unwrap();
        assert_eq!(got, "assistant:0:False:t:t;user:1:False::;");
    }

    /// SmolLM2's ChatML template adds `message['content']` to strings: a
    /// tool round as OpenAI clients send it (assistant `content: null` with
    /// `tool_calls`, then `role: tool`) renders, the missing content as "",
    /// as vLLM renders it.
    #[test]
    fn tool_rounds_render_on_templates_that_concatenate_content() {
        let t = ChatTemplate::new(
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let got = t
            .render(
                &[
                    json!({"role": "user", "content": "weather?"}),
                    json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{}"}}]}),
                    json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"}),
                    json!({"role": "assistant", "tool_calls": []}),
                ],
                &RenderOptions::default(),
            )
            .unwrap();
        assert_eq!(
            got,
            "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n\
             <|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
        );
    }

    #[test]
    fn special_tokens_and_kwargs_are_variables() {
        let t = ChatTemplate::new(
            "{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ flag }}",
            Some("<s>"),
            Some("</s>"),
        )
        .unwrap();
        let opts = options(None, json!({"flag": false}));
        assert_eq!(t.render(&[], &opts).unwrap(), "<s>|</s>|None|False");
        // kwargs override the special tokens, as in transformers.
        let opts = options(None, json!({"bos_token": "B"}));
        assert!(t.render(&[], &opts).unwrap().starts_with("B|"));
    }

    #[test]
    fn tool_use_template_is_picked_when_tools_are_given() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            json!({"eos_token": {"content": "</s>"}, "chat_template": [
                {"name": "default", "template": "plain{{ eos_token }}"},
                {"name": "tool_use", "template": "tools={{ tools | length }}"},
            ]})
            .to_string(),
        )
        .unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert!(t.has_tool_use());
        assert_eq!(
            t.render(&[], &RenderOptions::default()).unwrap(),
            "plain</s>"
        );
        assert_eq!(
            t.render(&[], &options(Some(tools()), json!({}))).unwrap(),
            "tools=1"
        );

        // chat_template.jinja wins over tokenizer_config.json.
        std::fs::write(dir.path().join("chat_template.jinja"), "from file\n").unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.names(), ["default"]);
        assert_eq!(
            t.render(&[], &RenderOptions::default()).unwrap(),
            "from file"
        );
    }

    #[test]
    fn missing_template_and_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
        std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("tokenizer_config.json"), "{err}");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": 5}"#,
        )
        .unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("string or a list"),
            "{err}"
        );
        let err = ChatTemplate::new("{% if %}", None, None).unwrap_err();
        assert!(matches!(err, TemplateError::Syntax { .. }), "{err:?}");
    }

    #[test]
    fn template_is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
    }
}
