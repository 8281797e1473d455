//! Constrained decoding with llguidance: a request's [`Grammar`] (JSON
//! Schema, regex, Lark, a list of choices) compiled against the model's
//! tokenizer into a [`Constraint`], which gives the set of tokens allowed at
//! each step and follows the tokens chosen. No MLX here: engines turn the
//! allowed set into a mask on the device.
//!
//! Compiling is cached by the grammar's hash (one compile per schema; each
//! request gets a clone of the compiled parser). The token trie is built
//! once per tokenizer.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use engine_core::Grammar;
use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value};
use text::tools::ToolFormat;

mod schema;
pub use schema::closed;

/// Compiled grammars kept per compiler; past this the cache starts over.
const CACHE_ENTRIES: usize = 256;

/// Compiles grammars for one model's tokenizer. `Send + Sync`; share it.
pub struct Compiler {
    env: TokEnv,
    eos: Arc<[u32]>,
    factory: ParserFactory,
    cache: Mutex<HashMap<u64, TokenParser>>,
}

/// How tool calls are held to their grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallRule {
    /// The output is calls only (`tool_choice` `required` or a function),
    /// not text.
    pub forced: bool,
    /// More than one call may follow (`parallel_tool_calls`).
    pub parallel: bool,
}

/// A JSON Schema llguidance cannot compile: where (a JSON Pointer into
/// the schema, empty for the root) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SchemaError {
    pub pointer: String,
    pub message: String,
}

/// Why a grammar cannot be used; the message is meant for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

impl Compiler {
    /// `vocab` is the model's output size (may exceed the tokenizer's);
    /// `eos` the tokens that end a sequence, allowed where the grammar may end.
    pub fn new(tokenizer: &text::Tokenizer, vocab: usize, eos: &[u32]) -> anyhow::Result<Self> {
        let env = TokenizerBytes::new(tokenizer, vocab, eos)?;
        let env: TokEnv = Arc::new(env);
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        let eos = env.tok_trie().eos_tokens().into();
        Ok(Self {
            env,
            eos,
            factory,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// The grammar of tool calls in the model family's `format`, each a call
    /// of one of `tools` (name, parameters schema) with its arguments valid
    /// against that tool's parameters. Forced (`rule.forced`), the output is
    /// calls only; otherwise it is free text, or calls from the moment one
    /// starts in the family's format (its open tag; for Llama 3's bare JSON,
    /// a message that starts with `{`). One call, or with `rule.parallel`
    /// one or more.
    pub fn tool_calls(
        &self,
        format: ToolFormat,
        tools: &[(String, Value)],
        rule: CallRule,
    ) -> Grammar {
        let arguments_key = match format {
            ToolFormat::Llama3Json => "parameters",
            ToolFormat::Hermes | ToolFormat::Gemma => "arguments",
        };
        let bodies: Vec<Value> = tools
            .iter()
            .map(|(name, parameters)| {
                json!({
                    "type": "object",
                    "properties": { "name": { "const": name }, arguments_key: parameters },
                    "required": ["name", arguments_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut schema = json!({ "anyOf": bodies });
        schema["x-guidance"] = compact_json();
        let separator = match format {
            ToolFormat::Llama3Json => "\"; \"",
            ToolFormat::Hermes | ToolFormat::Gemma => "\"\\n\"",
        };
        let more = if rule.parallel {
            format!("({separator} call)*")
        } else {
            String::new()
        };
        // The arguments' schema appears once: `args`.
        let start = match (format.tags(), rule.forced) {
            (None, true) => format!("start: call {more}\ncall: args"),
            // A message that starts with `{` is a call; text may not.
            (None, false) => format!(
                "start: TEXT? | call {more}\nTEXT: /(?s:\\s+|\\s*[^\\s{{\\[].*)/\ncall: args"
            ),
            (Some(tags), forced) => {
                let (open, close) = (self.spell(tags.open), self.spell(tags.close));
                let call = format!("call: {open} body\nbody: \"\\n\" args \"\\n\" {close}");
                if forced {
                    format!("start: call {more}\n{call}")
                } else if self.is_special(tags.open) {
                    // Text cannot spell a special token: the open tag ends it.
                    format!("start: TEXT? (call {more})?\nTEXT: /(?s:.+)/\n{call}")
                } else {
                    // Text up to the first open tag (a lazy lexeme that ends
                    // there), or text that never writes it.
                    let tag = regex_escape(tags.open);
                    format!(
                        "start: TEXT? | lead body {more}\n\
                         TEXT: /(?s:.+)/ & ~/(?s:.*{tag}.*)/\n\
                         lead[lazy]: /(?s:.*{tag})/\n{call}"
                    )
                }
            }
        };
        let lark = format!("{start}\nargs: %json {schema}\n");
        Grammar::Lark(lark)
    }

    /// Whether `tag` is one special token of the tokenizer.
    fn is_special(&self, tag: &str) -> bool {
        match self.env.tokenize_bytes_special(tag.as_bytes())[..] {
            [id] => self.env.tok_trie().token(id).first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER),
            _ => false,
        }
    }

    /// Where a JSON Schema llguidance cannot compile goes wrong: the JSON
    /// Pointer of the deepest subschema that fails on its own (the root's
    /// definitions kept in reach of its `$ref`s), and why.
    pub fn check_schema(&self, schema: &Value) -> Result<(), SchemaError> {
        let Err(GrammarError(mut message)) = self.build_schema(schema) else {
            return Ok(());
        };
        let mut pointer = String::new();
        let mut at = schema;
        'deeper: loop {
            for (suffix, child) in schema::children(at) {
                if let Err(GrammarError(why)) = self.build_schema(&with_definitions(child, schema))
                {
                    pointer.push_str(&suffix);
                    message = why;
                    at = child;
                    continue 'deeper;
                }
            }
            break;
        }
        Err(SchemaError { pointer, message })
    }

    fn build_schema(&self, schema: &Value) -> Result<TokenParser, GrammarError> {
        self.build(&Grammar::JsonSchema(schema.to_string()))
    }

    /// A tag as a Lark sequence, as the tokenizer reads it: its special
    /// tokens by id (their text cannot be spelled otherwise), the text
    /// between them as literals.
    fn spell(&self, tag: &str) -> String {
        let trie = self.env.tok_trie();
        let mut parts = Vec::new();
        let mut text: Vec<u8> = Vec::new();
        let flush = |text: &mut Vec<u8>, parts: &mut Vec<String>| {
            if !text.is_empty() {
                let s = String::from_utf8_lossy(text).into_owned();
                parts.push(Value::String(s).to_string());
                text.clear();
            }
        };
        for id in self.env.tokenize_bytes_special(tag.as_bytes()) {
            let bytes = trie.token(id);
            if bytes.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                flush(&mut text, &mut parts);
                parts.push(format!("<[{id}]>"));
            } else {
                text.extend_from_slice(bytes);
            }
        }
        flush(&mut text, &mut parts);
        parts.join(" ")
    }

    /// A fresh constraint for one request.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, GrammarError> {
        if let Grammar::Continued { grammar, generated } = grammar {
            let mut constraint = self.compile(grammar)?;
            for &token in generated {
                if constraint.matcher.consume_token(token).is_err() {
                    return Err(GrammarError(
                        "the output so far does not follow the grammar".into(),
                    ));
                }
            }
            return Ok(constraint);
        }
        let key = {
            let mut h = DefaultHasher::new();
            grammar.hash(&mut h);
            h.finish()
        };
        if let Some(parser) = self.cache.lock().unwrap().get(&key) {
            return Ok(Constraint::new(parser.clone(), self.eos.clone()));
        }
        let parser = self.build(grammar)?;
        let mut cache = self.cache.lock().unwrap();
        if cache.len() >= CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(key, parser.clone());
        Ok(Constraint::new(parser, self.eos.clone()))
    }

    /// A parser for `grammar`, uncached.
    fn build(&self, grammar: &Grammar) -> Result<TokenParser, GrammarError> {
        let top = self.top_level(grammar)?;
        // Arbitrary client grammars reach the compiler: a panic in it is
        // that grammar's failure, not the server's.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(top)
        }))
        .map_err(|_| GrammarError("the grammar compiler failed on this grammar".into()))?
        .map_err(|e| GrammarError(e.to_string()))
    }

    /// The `reasoning` rule: free output up to `close`. A close tag that is
    /// one token (special or not) ends a run of any other tokens but the
    /// end of sequence (the answer must follow), as vLLM's reasoning
    /// parsers watch for the end token; a longer one ends a lazy lexeme.
    fn reasoning_block(&self, close: &str) -> String {
        match self.env.tokenize_bytes_special(close.as_bytes())[..] {
            [id] => {
                let mut excluded = vec![id.to_string()];
                excluded.extend(self.eos.iter().map(|t| t.to_string()));
                format!("reasoning: <[^{}]>* <[{id}]>", excluded.join(","))
            }
            _ => format!("reasoning[suffix={}]: /(?s:.*)/", self.spell(close)),
        }
    }

    /// JSON Schemas compile to compact JSON with the usual separators and
    /// no free whitespace (a model with random weights would otherwise pad
    /// forever), unless the schema sets llguidance's own `x-guidance`
    /// options.
    fn top_level(&self, grammar: &Grammar) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match grammar {
            Grammar::JsonSchema(text) => {
                let mut schema: Value = serde_json::from_str(text)
                    .map_err(|e| GrammarError(format!("the JSON Schema is not valid JSON: {e}")))?;
                match &mut schema {
                    Value::Object(obj) => {
                        obj.entry("x-guidance").or_insert_with(compact_json);
                    }
                    Value::Bool(_) => {}
                    _ => {
                        return Err(GrammarError(
                            "a JSON Schema must be an object or a boolean".into(),
                        ))
                    }
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Grammar::Choice(choices) => {
                if choices.is_empty() {
                    return Err(GrammarError("the list of choices is empty".into()));
                }
                // Lark string literals take JSON string escapes.
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| Value::String(c.clone()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            Grammar::AfterReasoning { open, close, then } => {
                let mut answer = match **then {
                    Grammar::AfterReasoning { .. } | Grammar::Continued { .. } => {
                        return Err(GrammarError(
                            "a reasoning block holds one plain grammar".into(),
                        ))
                    }
                    ref plain => self.top_level(plain)?,
                };
                let mut answer = answer.grammars.remove(0);
                answer.name = Some("answer".into());
                let block = self.reasoning_block(close);
                let start = match open {
                    Some(open) => format!("start: ({} reasoning)? @answer", self.spell(open)),
                    None => "start: reasoning @answer".to_owned(),
                };
                let lark = format!("{start}\n{block}\n");
                TopLevelGrammar {
                    grammars: vec![GrammarWithLexer::from_lark(lark), answer],
                    max_tokens: None,
                }
            }
            Grammar::Continued { .. } => {
                return Err(GrammarError("a continued grammar cannot be nested".into()))
            }
        })
    }
}

/// `sub` with the root schema's `$defs` and `definitions` beside it, so
/// its `$ref`s resolve when it is compiled alone.
fn with_definitions(sub: &Value, root: &Value) -> Value {
    let mut sub = sub.clone();
    if let Value::Object(obj) = &mut sub {
        for key in ["$defs", "definitions"] {
            if let Some(defs) = root.get(key) {
                obj.entry(key).or_insert_with(|| defs.clone());
            }
        }
    }
    sub
}

/// `text` as a regex matching it literally, inside Lark's `/.../`.
fn regex_escape(text: &str) -> String {
    regex_syntax::escape(text).replace('/', "\\/")
}

fn compact_json() -> Value {
    json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
    eos: Arc<[u32]>,
}

impl Constraint {
    fn new(parser: TokenParser, eos: Arc<[u32]>) -> Self {
        Self {
            matcher: Matcher::new(Ok(parser)),
            eos,
        }
    }

    /// Tokens allowed next, one bit each (bit `t % 32` of word `t / 32`),
    /// end-of-sequence tokens included where the grammar may end. `None`
    /// when the output is complete or nothing can follow (a dead end): the
    /// sequence ends there with what it has.
    pub fn allowed(&mut self) -> Option<Allowed> {
        if self.matcher.is_stopped() {
            return None;
        }
        match self.matcher.compute_mask() {
            Ok(mask) if !mask.is_zero() => Some(Allowed(mask)),
            Ok(_) => None,
            Err(e) => {
                tracing_error(&e.to_string());
                None
            }
        }
    }

    /// Follows a chosen token. Returns whether the output may go on: false
    /// once the grammar is complete (or the token broke it).
    pub fn commit(&mut self, token: u32) -> bool {
        if let Err(e) = self.matcher.consume_token(token) {
            tracing_error(&e.to_string());
            return false;
        }
        !self.matcher.is_stopped()
    }

    /// The allowed sets along a draft, for verifying it in one forward:
    /// entry `i` is what may follow `tokens[..i]` ([`Constraint::allowed`]
    /// there). Entries stop after the first draft token the grammar
    /// rejects, an end-of-sequence token, or a `None` (the output complete),
    /// so `len() - 1` drafted tokens are worth verifying. The state does not
    /// move.
    pub fn allowed_along(&mut self, tokens: &[u32]) -> Vec<Option<Allowed>> {
        let mut sets: Vec<Option<Allowed>> = Vec::with_capacity(tokens.len() + 1);
        let mut consumed = 0;
        loop {
            let allowed = self.allowed();
            let next = tokens
                .get(consumed)
                .copied()
                .filter(|&t| !self.is_end(t) && allowed.as_ref().is_some_and(|a| a.contains(t)));
            sets.push(allowed);
            // An allowed token is consumed without error.
            match next {
                Some(t) if self.matcher.consume_token(t).is_ok() => consumed += 1,
                _ => break,
            }
        }
        if let Err(e) = self.matcher.rollback(consumed) {
            tracing_error(&e.to_string());
        }
        sets
    }

    /// Whether `token` ends the sequence (an end-of-sequence token).
    pub fn is_end(&self, token: u32) -> bool {
        self.eos.contains(&token)
    }
}

/// llguidance errors past compiling mean a token the mask did not allow got
/// through: the sequence ends, the engine goes on.
fn tracing_error(message: &str) {
    tracing::warn!(
        error = message,
        "grammar matcher failed; ending the sequence"
    );
}

/// The set of allowed tokens.
pub struct Allowed(llguidance::toktrie::SimpleVob);

impl Allowed {
    pub fn contains(&self, token: u32) -> bool {
        self.0.is_allowed(token)
    }

    /// One bool per token of the model's vocabulary.
    pub fn to_bools(&self, vocab: usize) -> Vec<bool> {
        let mut out = vec![false; vocab];
        self.write_bools(&mut out);
        out
    }

    /// Sets `out[t]` for each allowed token `t` below `out.len()`.
    pub fn write_bools(&self, out: &mut [bool]) {
        self.0.iter_set_entries(|t| {
            if let Some(slot) = out.get_mut(t) {
                *slot = true;
            }
        });
    }
}

/// The tokenizer as llguidance sees it: every token's bytes (from
/// `tokenizer.json` through llguidance's own reader), fitted to the model's
/// vocabulary (padded with unusable special entries), and our tokenizer for
/// text.
struct TokenizerBytes {
    trie: TokTrie,
    tokenizer: text::Tokenizer,
}

impl TokenizerBytes {
    fn new(tokenizer: &text::Tokenizer, vocab: usize, eos: &[u32]) -> anyhow::Result<Self> {
        let json: Value = serde_json::from_str(
            &tokenizer
                .hf()
                .to_string(false)
                .map_err(|e| anyhow::anyhow!("cannot serialize the tokenizer: {e}"))?,
        )?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)?;
        // Tokens past the model's outputs can never be chosen.
        words.truncate(vocab);
        while words.len() < vocab {
            let mut name = format!(".<[{}]>", words.len()).into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(name);
        }
        let eos: Vec<u32> = eos
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        let info = TokRxInfo {
            vocab_size: vocab as u32,
            tok_eos: eos.first().copied().unwrap_or(0),
            tok_bos: None,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(&eos);
        }
        Ok(Self {
            trie,
            tokenizer: tokenizer.clone(),
        })
    }
}

impl TokenizerEnv for TokenizerBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.hf().encode(text, false) {
                Ok(enc) => enc.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(s),
            },
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}
