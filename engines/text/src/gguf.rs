//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata,
//! rebuilt as the `tokenizer.json` Hugging Face would ship for it.
//!
//! Byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`) are rebuilt
//! from the tokens, merges and token types, with the pre-tokenizer that
//! `tokenizer.ggml.pre` names (llama.cpp's table of known tokenizers).
//! SentencePiece vocabularies (`llama`, Gemma's and Llama 2's) are not: their
//! scores-to-merges conversion is lossy, so such a model needs its
//! `tokenizer.json` next to the file.

use serde_json::{json, Value};

/// The `tokenizer.ggml.*` metadata of one file.
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2`, `llama`, ...
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer's name.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user
    /// defined, 5 unused, 6 byte.
    pub token_types: Vec<i64>,
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub eot_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub add_bos_token: bool,
    pub chat_template: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum GgufVocabError {
    #[error("GGUF tokenizer model `{0}` is not rebuilt here (only byte-level BPE, `gpt2`, is); put the model's tokenizer.json next to the .gguf file")]
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

impl GgufVocab {
    fn token(&self, id: Option<u32>) -> Option<&str> {
        id.and_then(|i| self.tokens.get(i as usize))
            .map(String::as_str)
    }

    /// `tokenizer.json` text for this vocabulary.
    pub fn tokenizer_json(&self) -> Result<String, GgufVocabError> {
        if self.model != "gpt2" {
            return Err(GgufVocabError::Model(self.model.clone()));
        }
        if self.token_types.len() != self.tokens.len() {
            return Err(GgufVocabError::Inconsistent(format!(
                "{} tokens but {} token types",
                self.tokens.len(),
                self.token_types.len()
            )));
        }
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
        let vocab: serde_json::Map<String, Value> = self
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect();
        // Control and user-defined tokens match whole in the text, as the
        // added tokens of the original tokenizer.json do.
        let added: Vec<Value> = self
            .tokens
            .iter()
            .zip(&self.token_types)
            .enumerate()
            .filter(|(_, (_, &ty))| ty == 3 || ty == 4)
            .map(|(id, (content, &ty))| {
                json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": ty == 3})
            })
            .collect();
        let post_processor = match self
            .add_bos_token
            .then(|| self.token(self.bos_token_id))
            .flatten()
        {
            Some(bos) => {
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
            None => Value::Null,
        };
        let tokenizer = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": self.merges,
            },
        });
        Ok(tokenizer.to_string())
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
