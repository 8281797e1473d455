//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata,
//! rebuilt as the `tokenizer.json` Hugging Face would ship for it.
//!
//! * Byte-level BPE (`tokenizer.ggml.model = gpt2`: SmolLM2, Qwen, Llama 3)
//!   is rebuilt from the tokens, merges and token types, with the
//!   pre-tokenizer that `tokenizer.ggml.pre` names (llama.cpp's table of
//!   known tokenizers).
//! * SentencePiece BPE (`llama`: Gemma, Llama 2) stores pieces and scores,
//!   no merges. SentencePiece encodes by repeatedly joining the adjacent
//!   pair whose joined piece scores highest, leftmost on ties, and falls
//!   back to `<0xNN>` byte tokens for what no piece covers. That is a BPE
//!   model whose merges are every split of every normal piece into two
//!   normal pieces, ranked by the joined piece's score, with byte fallback
//!   on; spaces become `▁` (normalizer), and a `▁` is prepended where
//!   `tokenizer.ggml.add_space_prefix` says so (llama.cpp's default; Gemma's
//!   files say no). The decoder reverses it and strips that prefix.
//!   Where the two could part: competing pairs of equal score (two pieces
//!   scored alike, or two splits of one piece) are taken in merge-list
//!   order, where SentencePiece takes the leftmost; its trainer gives every
//!   normal piece its own score (Gemma 3's 255,474 pieces too), and none of
//!   the oracle texts met a split conflict. And added tokens: control and
//!   user-defined tokens are matched whole in the raw text and the text
//!   after one gets its own space prefix, as llama.cpp does (SentencePiece
//!   itself matches user-defined pieces after adding the one prefix, and
//!   control pieces not at all).
//!   `engines/runtime/tests/gguf_spm.rs` checks the ids against the
//!   `sentencepiece` package itself.

use std::collections::{BTreeSet, HashMap};

use serde_json::{json, Value};

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
pub mod token_type {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
    pub const UNUSED: i64 = 5;
    pub const BYTE: i64 = 6;
}
use token_type::*;

/// The `tokenizer.ggml.*` metadata of one file.
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2`, `llama`, ...
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer's name.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores` (SentencePiece): a piece's merge priority.
    /// NaN where the file holds something other than a number.
    pub scores: Vec<f64>,
    /// llama.cpp token types ([`token_type`]); -1 where the file holds
    /// something other than an integer.
    pub token_types: Vec<i64>,
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub eot_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`; llama.cpp's default when absent is
    /// yes for SentencePiece vocabularies, no otherwise.
    pub add_bos_token: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece's dummy prefix);
    /// llama.cpp's default when absent is yes.
    pub add_space_prefix: Option<bool>,
    pub chat_template: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum GgufVocabError {
    #[error("GGUF tokenizer model `{0}` is not rebuilt here (only byte-level BPE, `gpt2`, and SentencePiece BPE, `llama`, are); put the model's tokenizer.json next to the .gguf file")]
    Model(String),
    #[error("GGUF pre-tokenizer `{0}` is not known here (known: {known}); put the model's tokenizer.json next to the .gguf file", known = KNOWN_PRE.join(", "))]
    Pre(String),
    #[error("GGUF tokenizer metadata is inconsistent: {0}")]
    Inconsistent(String),
}

const KNOWN_PRE: &[&str] = &[
    "default",
    "gpt-2",
    "smollm",
    "starcoder",
    "qwen2",
    "llama-bpe",
];

/// The split regexes of Llama 3's and Qwen2's tokenizer.json (the two
/// differ in how many digits one piece takes).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// SentencePiece's whitespace symbol.
const SPACE: &str = "\u{2581}";

/// The pipeline stages of one tokenizer.json, around its added tokens and
/// post-processor.
struct Pipeline {
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    model: Value,
}

fn inconsistent(message: String) -> GgufVocabError {
    GgufVocabError::Inconsistent(message)
}

impl GgufVocab {
    fn token(&self, id: Option<u32>) -> Option<&str> {
        id.and_then(|i| self.tokens.get(i as usize))
            .map(String::as_str)
    }

    /// Whether encoding with special tokens prepends BOS.
    fn adds_bos(&self) -> bool {
        self.add_bos_token.unwrap_or(self.model == "llama")
    }

    /// `tokenizer.json` text for this vocabulary.
    pub fn tokenizer_json(&self) -> Result<String, GgufVocabError> {
        self.check_token_types()?;
        let pipeline = match self.model.as_str() {
            "gpt2" => self.byte_level()?,
            "llama" => self.sentencepiece()?,
            other => return Err(GgufVocabError::Model(other.to_owned())),
        };
        let tokenizer = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": self.added_tokens(),
            "normalizer": pipeline.normalizer,
            "pre_tokenizer": pipeline.pre_tokenizer,
            "post_processor": self.post_processor(),
            "decoder": pipeline.decoder,
            "model": pipeline.model,
        });
        Ok(tokenizer.to_string())
    }

    fn check_token_types(&self) -> Result<(), GgufVocabError> {
        if self.token_types.len() != self.tokens.len() {
            return Err(inconsistent(format!(
                "`tokenizer.ggml.token_type` has {} entries for {} tokens",
                self.token_types.len(),
                self.tokens.len()
            )));
        }
        if let Some((id, ty)) = self
            .token_types
            .iter()
            .enumerate()
            .find(|(_, ty)| !(NORMAL..=BYTE).contains(*ty))
        {
            return Err(inconsistent(format!(
                "`tokenizer.ggml.token_type` of token {id} (`{}`) is {ty}, not a llama.cpp token type (1 normal .. 6 byte)",
                self.tokens[id]
            )));
        }
        Ok(())
    }

    /// The vocabulary as tokenizer.json's `model.vocab`.
    fn vocab(&self) -> serde_json::Map<String, Value> {
        self.tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect()
    }

    /// Control, unknown and user-defined tokens match whole in the raw
    /// text, as the added tokens of the original tokenizer.json (and
    /// llama.cpp) do; the first two are special (skipped when decoding
    /// with `skip_special_tokens`).
    fn added_tokens(&self) -> Vec<Value> {
        self.tokens
            .iter()
            .zip(&self.token_types)
            .enumerate()
            .filter(|(_, (_, &ty))| matches!(ty, UNKNOWN | CONTROL | USER_DEFINED))
            .map(|(id, (content, &ty))| {
                json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": ty != USER_DEFINED})
            })
            .collect()
    }

    fn post_processor(&self) -> Value {
        let Some(bos) = self
            .adds_bos()
            .then(|| self.token(self.bos_token_id))
            .flatten()
        else {
            return Value::Null;
        };
        let mut special = serde_json::Map::new();
        special.insert(
            bos.to_owned(),
            json!({"id": bos, "ids": [self.bos_token_id], "tokens": [bos]}),
        );
        json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": special,
        })
    }

    fn byte_level(&self) -> Result<Pipeline, GgufVocabError> {
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
        let pre = self.pre.as_deref().unwrap_or("default");
        let (normalizer, pre_tokenizer) = match pre {
            "default" | "gpt-2" => (Value::Null, byte_level(true)),
            "smollm" | "starcoder" => (
                Value::Null,
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Digits", "individual_digits": true},
                    byte_level(true),
                ]}),
            ),
            "qwen2" => (
                json!({"type": "NFC"}),
                json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}),
            ),
            "llama-bpe" => (
                Value::Null,
                json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
            ),
            other => return Err(GgufVocabError::Pre(other.to_owned())),
        };
        Ok(Pipeline {
            normalizer,
            pre_tokenizer,
            decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
            model: json!({
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": self.vocab(), "merges": self.merges,
            }),
        })
    }

    fn sentencepiece(&self) -> Result<Pipeline, GgufVocabError> {
        if self.scores.len() != self.tokens.len() {
            return Err(inconsistent(format!(
                "`tokenizer.ggml.scores` has {} entries for {} tokens",
                self.scores.len(),
                self.tokens.len()
            )));
        }
        if let Some(id) = self.scores.iter().position(|s| s.is_nan()) {
            return Err(inconsistent(format!(
                "`tokenizer.ggml.scores` of token {id} (`{}`) is not a number",
                self.tokens[id]
            )));
        }
        let byte_fallback = self.check_byte_tokens()?;
        let unk_token = self
            .token(self.unknown_token_id)
            .or_else(|| self.typed(UNKNOWN).next().map(|(_, t)| t));
        if !byte_fallback && unk_token.is_none() {
            return Err(inconsistent(
                "`tokenizer.ggml.tokens` has neither byte tokens (<0x00>..<0xFF>) nor an unknown token for text no piece covers".into(),
            ));
        }
        let add_prefix = self.add_space_prefix.unwrap_or(true);
        let replace_spaces =
            json!({"type": "Replace", "pattern": {"String": " "}, "content": SPACE});
        let normalizer = if add_prefix {
            json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace_spaces]})
        } else {
            replace_spaces
        };
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": SPACE}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if add_prefix {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        Ok(Pipeline {
            normalizer,
            pre_tokenizer: Value::Null,
            decoder: json!({"type": "Sequence", "decoders": decoders}),
            model: json!({
                "type": "BPE", "dropout": null, "unk_token": unk_token,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": byte_fallback, "ignore_merges": false,
                "vocab": self.vocab(), "merges": self.sentencepiece_merges()?,
            }),
        })
    }

    fn typed(&self, ty: i64) -> impl Iterator<Item = (usize, &str)> {
        self.tokens
            .iter()
            .zip(&self.token_types)
            .enumerate()
            .filter(move |(_, (_, &t))| t == ty)
            .map(|(id, (token, _))| (id, token.as_str()))
    }

    /// Whether the vocabulary falls back to bytes: it does when it has byte
    /// tokens, and then it must have all 256.
    fn check_byte_tokens(&self) -> Result<bool, GgufVocabError> {
        let mut bytes = BTreeSet::new();
        for (id, token) in self.typed(BYTE) {
            let byte = token
                .strip_prefix("<0x")
                .and_then(|t| t.strip_suffix('>'))
                .filter(|hex| hex.len() == 2)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or_else(|| {
                    inconsistent(format!(
                        "token {id} (`{token}`) is typed byte in `tokenizer.ggml.token_type` but is not spelled <0xNN>"
                    ))
                })?;
            bytes.insert(byte);
        }
        if bytes.is_empty() {
            return Ok(false);
        }
        if let Some(missing) = (0..=255u8).find(|b| !bytes.contains(b)) {
            return Err(inconsistent(format!(
                "`tokenizer.ggml.tokens` has {} of the 256 byte tokens byte fallback needs (no <0x{missing:02X}>)",
                bytes.len()
            )));
        }
        Ok(true)
    }

    /// Every split of every normal piece into two normal pieces, best
    /// joined score first (ties by id), shorter left part first within a
    /// piece. Unused pieces SentencePiece would join and then split again;
    /// BPE cannot, so a vocabulary where a join forms one is refused.
    fn sentencepiece_merges<'s>(&'s self) -> Result<Vec<[&'s str; 2]>, GgufVocabError> {
        let normal: HashMap<&'s str, usize> = self.typed(NORMAL).map(|(id, t)| (t, id)).collect();
        let splits = |piece: &'s str| -> Vec<[&'s str; 2]> {
            piece
                .char_indices()
                .skip(1)
                .map(|(at, _)| piece.split_at(at))
                .filter(|(l, r)| normal.contains_key(l) && normal.contains_key(r))
                .map(|(l, r)| [l, r])
                .collect()
        };
        if let Some((id, token)) = self.typed(UNUSED).find(|(_, t)| !splits(t).is_empty()) {
            return Err(inconsistent(format!(
                "token {id} (`{token}`) is typed unused in `tokenizer.ggml.token_type` but two normal pieces join into it; SentencePiece's resegmentation of such pieces is not rebuilt"
            )));
        }
        let mut ranked: Vec<(&str, usize)> = normal.iter().map(|(&t, &id)| (t, id)).collect();
        ranked.sort_by(|a, b| {
            self.scores[b.1]
                .total_cmp(&self.scores[a.1])
                .then(a.1.cmp(&b.1))
        });
        Ok(ranked
            .into_iter()
            .flat_map(|(piece, _)| splits(piece))
            .collect())
    }

    /// The `tokenizer_config.json` fields the tokenizer and template read.
    pub fn tokenizer_config(&self) -> Value {
        let mut config = serde_json::Map::new();
        for (key, id) in [
            ("bos_token", self.bos_token_id),
            ("eos_token", self.eos_token_id),
            ("pad_token", self.padding_token_id),
            ("unk_token", self.unknown_token_id),
        ] {
            if let Some(t) = self.token(id) {
                config.insert(key.into(), json!(t));
            }
        }
        if let Some(t) = &self.chat_template {
            config.insert("chat_template".into(), json!(t));
        }
        Value::Object(config)
    }

    /// The ids the metadata says end a generation.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        [self.eos_token_id, self.eot_token_id]
            .into_iter()
            .flatten()
            .collect()
    }
}
