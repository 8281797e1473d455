//! The model's tokenizer, loaded from a Hugging Face model directory.
//!
//! `tokenizer.json` holds the whole pipeline (normalizer, pre-tokenizer, BPE
//! model, post-processor, decoder, added tokens); `tokenizer_config.json`
//! names the BOS/EOS strings. Chat prompts are encoded the way
//! `transformers.apply_chat_template(tokenize=True)` does: without adding
//! special tokens, because the template already wrote them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

/// Errors from loading or running the tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
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
    #[error("cannot load tokenizer from {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("tokenizer failed to encode: {0}")]
    Encode(String),
    #[error("tokenizer failed to decode: {0}")]
    Decode(String),
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// A loaded tokenizer. Cheap to clone (shared), `Send + Sync`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    hf: tokenizers::Tokenizer,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    unk_token: Option<String>,
    /// Whether `encode(text, add_special_tokens = true)` prepends BOS
    /// (Llama 3 and Gemma post-processors do; Qwen's does not).
    adds_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.inner.bos_token)
            .field("eos_token", &self.inner.eos_token)
            .field("adds_bos", &self.inner.adds_bos)
            .finish()
    }
}

impl Tokenizer {
    /// Loads the tokenizer a model's `source` names.
    pub fn load(source: &engine_core::TokenizerSource) -> Result<Self> {
        match source {
            engine_core::TokenizerSource::Dir(dir) => Self::from_dir(dir),
            engine_core::TokenizerSource::Json {
                json,
                config,
                origin,
            } => Self::from_json(json, Some(config), origin),
        }
    }

    /// Loads `tokenizer.json` and (if present) `tokenizer_config.json` from a
    /// model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            Some(read_json(&config_path)?)
        } else {
            None
        };
        Self::from_file(&dir.join("tokenizer.json"), config.as_ref())
    }

    /// Loads a `tokenizer.json`, taking the special-token strings from an
    /// already parsed `tokenizer_config.json` when given.
    pub fn from_file(path: &Path, config: Option<&Value>) -> Result<Self> {
        let hf = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        Ok(Self::from_hf(hf, config))
    }

    /// A tokenizer from the text of a `tokenizer.json` (built in memory, e.g.
    /// from a GGUF file's vocabulary); `origin` names it in errors.
    pub fn from_json(json: &str, config: Option<&Value>, origin: &Path) -> Result<Self> {
        let hf: tokenizers::Tokenizer =
            json.parse()
                .map_err(|e: tokenizers::Error| TokenizerError::Load {
                    path: origin.to_owned(),
                    message: e.to_string(),
                })?;
        Ok(Self::from_hf(hf, config))
    }

    fn from_hf(hf: tokenizers::Tokenizer, config: Option<&Value>) -> Self {
        let token = |key: &str| config.and_then(|c| token_string(c.get(key)?));
        let bos_token = token("bos_token");
        let eos_token = token("eos_token");
        let pad_token = token("pad_token");
        let unk_token = token("unk_token");
        let adds_bos = match bos_token.as_deref().and_then(|t| hf.token_to_id(t)) {
            Some(bos_id) => hf
                .encode("", true)
                .map(|e| e.get_ids().first() == Some(&bos_id))
                .unwrap_or(false),
            None => false,
        };
        Tokenizer {
            inner: Arc::new(Inner {
                hf,
                bos_token,
                eos_token,
                pad_token,
                unk_token,
                adds_bos,
            }),
        }
    }

    /// Encodes text. `add_special_tokens` runs the post-processor (which may
    /// prepend BOS); special tokens written in the text are always matched.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .hf
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Encodes a rendered chat prompt as `apply_chat_template(tokenize=True)`
    /// does: the template already wrote BOS where the model wants it, so the
    /// post-processor must not add another.
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>> {
        self.encode(rendered, false)
    }

    /// Encodes a raw completion prompt: special tokens are added unless the
    /// text already starts with the BOS string, so BOS is never doubled.
    pub fn encode_completion(&self, prompt: &str) -> Result<Vec<u32>> {
        self.encode(prompt, !self.starts_with_bos(prompt))
    }

    /// Decodes ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .hf
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// Number of ids the tokenizer can produce, added tokens included (what
    /// Python's `len(tokenizer)` reports).
    pub fn vocab_size(&self) -> usize {
        self.inner.hf.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.hf.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.hf.id_to_token(id)
    }

    /// Whether `id` is an added token marked special (skipped by
    /// `decode(.., skip_special_tokens = true)`).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .hf
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.inner.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.inner.eos_token.as_deref()
    }

    pub fn pad_token(&self) -> Option<&str> {
        self.inner.pad_token.as_deref()
    }

    pub fn unk_token(&self) -> Option<&str> {
        self.inner.unk_token.as_deref()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token().and_then(|t| self.token_to_id(t))
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token().and_then(|t| self.token_to_id(t))
    }

    /// Whether encoding with `add_special_tokens = true` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.inner.adds_bos
    }

    /// Whether `text` (typically a rendered chat template) already begins
    /// with the BOS string, in which case adding special tokens would
    /// double it.
    pub fn starts_with_bos(&self, text: &str) -> bool {
        self.bos_token()
            .is_some_and(|bos| !bos.is_empty() && text.starts_with(bos))
    }

    /// The underlying `tokenizers` tokenizer, for what this wrapper does not
    /// cover.
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner.hf
    }
}

/// A special token in `tokenizer_config.json` is either a plain string or an
/// AddedToken object `{"content": "...", ...}`; `null` means none.
pub(crate) fn token_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).map_err(|source| TokenizerError::Read {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|source| TokenizerError::Json {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fixtures::tokenizer::write_tokenizer;
    use fixtures::Family;

    fn load(family: Family) -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), family, 1024).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    #[test]
    fn tokenizer_is_send_sync() {
        fn check<T: Send + Sync + Clone>() {}
        check::<Tokenizer>();
    }

    #[test]
    fn round_trips_text_and_reads_special_tokens() {
        let (_d, tok) = load(Family::Qwen3);
        assert_eq!(tok.vocab_size(), 1024);
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        assert_eq!(tok.bos_token(), None);
        assert!(!tok.adds_bos());
        let text = "Hello, world! 你好 🎉 fn main() {}";
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        let im_end = tok.token_to_id("<|im_end|>").unwrap();
        assert_eq!(tok.id_to_token(im_end).as_deref(), Some("<|im_end|>"));
        assert!(tok.is_special(im_end));
        // Qwen marks <think> as an added but non-special token, so it
        // survives skip_special_tokens (the reasoning parser needs it).
        let think = tok.token_to_id("<think>").unwrap();
        assert!(!tok.is_special(think));
        assert_eq!(tok.decode(&[think, im_end], true).unwrap(), "<think>");
    }

    #[test]
    fn special_tokens_in_text_are_single_ids() {
        let (_d, tok) = load(Family::Qwen2);
        let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
        assert_eq!(ids[0], tok.token_to_id("<|im_start|>").unwrap());
        assert_eq!(*ids.last().unwrap(), tok.token_to_id("<|im_end|>").unwrap());
    }

    #[test]
    fn bos_is_added_once() {
        for family in [Family::Llama, Family::Gemma3] {
            let (_d, tok) = load(family);
            assert!(tok.adds_bos(), "{family}");
            let bos = tok.bos_token_id().unwrap();
            let plain = tok.encode_completion("hello").unwrap();
            assert_eq!(plain[0], bos);
            assert_ne!(plain[1], bos);
            let with_bos = format!("{}hello", tok.bos_token().unwrap());
            let ids = tok.encode_completion(&with_bos).unwrap();
            assert_eq!(ids, plain, "{family}: BOS must not be doubled");
            assert_eq!(tok.encode_chat(&with_bos).unwrap(), plain);
        }
    }

    #[test]
    fn missing_file_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
    }
}
