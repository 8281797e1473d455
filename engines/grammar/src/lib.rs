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
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value};
use text::tools::ToolFormat;

/// Compiled grammars kept per compiler; past this the cache starts over.
const CACHE_ENTRIES: usize = 256;

/// Compiles grammars for one model's tokenizer. `Send + Sync`; share it.
pub struct Compiler {
    env: TokEnv,
    eos: Arc<[u32]>,
    factory: ParserFactory,
    cache: Mutex<HashMap<u64, TokenParser>>,
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

    /// The grammar of a forced tool call in the model family's `format`: one
    /// call (`many`: one or more) of one of `tools` (name, parameters
    /// schema), its arguments valid against that tool's parameters.
    pub fn tool_calls(&self, format: ToolFormat, tools: &[(String, Value)], many: bool) -> Grammar {
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
        let call = match format.tags() {
            Some(tags) => format!(
                "{} \"\\n\" %json {schema} \"\\n\" {}",
                self.literal(tags.open),
                self.literal(tags.close)
            ),
            None => format!("%json {schema}"),
        };
        let separator = match format {
            ToolFormat::Llama3Json => "\"; \"",
            ToolFormat::Hermes | ToolFormat::Gemma => "\"\\n\"",
        };
        let start = if many {
            format!("start: call ({separator} call)*")
        } else {
            "start: call".to_owned()
        };
        Grammar::Lark(format!("{start}\ncall: {call}\n"))
    }

    /// A tag as a Lark literal: the special token of that name where the
    /// tokenizer has one (its text cannot be spelled otherwise), else text.
    fn literal(&self, tag: &str) -> String {
        match self.env.tok_trie().get_special_token(tag) {
            Some(id) => format!("<[{id}]>"),
            None => Value::String(tag.to_owned()).to_string(),
        }
    }

    /// A fresh constraint for one request.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, GrammarError> {
        let key = {
            let mut h = DefaultHasher::new();
            grammar.hash(&mut h);
            h.finish()
        };
        if let Some(parser) = self.cache.lock().unwrap().get(&key) {
            return Ok(Constraint::new(parser.clone(), self.eos.clone()));
        }
        let top = top_level(grammar)?;
        // Arbitrary client grammars reach the compiler: a panic in it is
        // that grammar's failure, not the server's.
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(top)
        }))
        .map_err(|_| GrammarError("the grammar compiler failed on this grammar".into()))?
        .map_err(|e| GrammarError(e.to_string()))?;
        let mut cache = self.cache.lock().unwrap();
        if cache.len() >= CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(key, parser.clone());
        Ok(Constraint::new(parser, self.eos.clone()))
    }
}

/// JSON Schemas compile to compact JSON with the usual separators and no
/// free whitespace (a model with random weights would otherwise pad
/// forever), unless the schema sets llguidance's own `x-guidance` options.
fn top_level(grammar: &Grammar) -> Result<TopLevelGrammar, GrammarError> {
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
    })
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

    /// How many of `tokens` the grammar accepts in a row, from the current
    /// state, without moving it.
    pub fn accepted_prefix(&mut self, tokens: &[u32]) -> usize {
        self.matcher.validate_tokens(tokens).unwrap_or(0)
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
        self.0.iter_set_entries(|t| {
            if t < vocab {
                out[t] = true;
            }
        });
        out
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
