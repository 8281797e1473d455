//! The full set of token ids that end a generation.
//!
//! No single file is authoritative. `config.json` often names only the
//! pretraining end-of-text token (Qwen2.5 base: `<|endoftext|>`; Llama 3
//! base: `<|end_of_text|>`), `generation_config.json` adds the chat turn
//! end for instruct models (Llama 3.1: `[128001, 128008, 128009]`), and
//! `tokenizer_config.json`'s `eos_token` is what transformers and mlx-lm stop
//! on. A model that emits any of them has finished its turn, so the stop set
//! is their union.
//!
//! On top of that come the well-known end-of-turn markers, only when the
//! vocabulary has them: fine-tunes and conversions regularly forget to list
//! the chat-format turn end (e.g. an instruct model whose config still says
//! `<|endoftext|>` but whose template ends turns with `<|im_end|>`), and then
//! generation runs past the turn into a hallucinated next one. These strings
//! never occur as ordinary text pieces, so stopping on them is always right.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::tokenizer::{token_string, Tokenizer};

/// End-of-turn / end-of-text markers of common chat formats.
pub const WELL_KNOWN_EOS: &[&str] = &[
    "<|im_end|>",      // ChatML (Qwen, many fine-tunes)
    "<|eot_id|>",      // Llama 3 end of turn
    "<|eom_id|>",      // Llama 3.1 end of message (tool call pending)
    "<|end_of_text|>", // Llama 3 end of document
    "<|endoftext|>",   // GPT-2 lineage, Qwen end of document
    "<end_of_turn>",   // Gemma end of turn
    "<eos>",           // Gemma end of document
    "</s>",            // SentencePiece models (Llama 2, Mistral)
    "<|end|>",         // Phi-3
    "<|return|>",      // gpt-oss final answer
    "<|call|>",        // gpt-oss tool call
];

#[derive(Debug, thiserror::Error)]
pub enum EosError {
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
    #[error("{path}: eos_token_id must be an integer or a list of integers, got {value}")]
    BadId { path: PathBuf, value: Value },
}

/// The stop set of the model in `dir`, sorted and deduplicated. Missing
/// `config.json` / `generation_config.json` contribute nothing.
pub fn eos_token_ids(dir: &Path, tokenizer: &Tokenizer) -> Result<Vec<u32>, EosError> {
    let mut ids = BTreeSet::new();
    for name in ["config.json", "generation_config.json"] {
        let path = dir.join(name);
        if let Some(config) = read_optional_json(&path)? {
            ids.extend(ids_from_config(&config, &path)?);
        }
    }
    if let Some(config) = read_optional_json(&dir.join("tokenizer_config.json"))? {
        if let Some(tok) = config.get("eos_token").and_then(token_string) {
            ids.extend(tokenizer.token_to_id(&tok));
        }
    }
    ids.extend(tokenizer.eos_token_id());
    ids.extend(
        WELL_KNOWN_EOS
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t)),
    );
    Ok(ids.into_iter().collect())
}

/// `eos_token_id` of a config: absent/null, an integer, or a list of them.
/// Multimodal configs nest it under `text_config`.
pub fn ids_from_config(config: &Value, path: &Path) -> Result<Vec<u32>, EosError> {
    let mut out = Vec::new();
    for v in [
        config.get("eos_token_id"),
        config
            .get("text_config")
            .and_then(|t| t.get("eos_token_id")),
    ]
    .into_iter()
    .flatten()
    {
        let bad = || EosError::BadId {
            path: path.to_owned(),
            value: v.clone(),
        };
        let as_id = |x: &Value| x.as_u64().and_then(|n| u32::try_from(n).ok());
        match v {
            Value::Null => {}
            Value::Array(items) => {
                for item in items {
                    out.push(as_id(item).ok_or_else(bad)?);
                }
            }
            other => out.push(as_id(other).ok_or_else(bad)?),
        }
    }
    Ok(out)
}

fn read_optional_json(path: &Path) -> Result<Option<Value>, EosError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| EosError::Json {
                path: path.to_owned(),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(EosError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fixtures::tokenizer::write_tokenizer;
    use fixtures::Family;
    use serde_json::json;

    fn write(dir: &Path, name: &str, v: Value) {
        std::fs::write(dir.join(name), v.to_string()).unwrap();
    }

    #[test]
    fn union_of_configs_tokenizer_and_well_known() {
        let dir = tempfile::tempdir().unwrap();
        let info = write_tokenizer(dir.path(), Family::Llama, 600).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let id = |t: &str| tok.token_to_id(t).unwrap();
        // A base-model config that only knows end_of_text, plus a plain
        // number that is not a special token at all.
        write(
            dir.path(),
            "config.json",
            json!({"eos_token_id": id("<|end_of_text|>")}),
        );
        write(
            dir.path(),
            "generation_config.json",
            json!({"eos_token_id": [7, id("<|eot_id|>")]}),
        );
        let ids = eos_token_ids(dir.path(), &tok).unwrap();
        let mut want = vec![7, id("<|end_of_text|>"), id("<|eot_id|>"), id("<|eom_id|>")];
        want.sort();
        assert_eq!(ids, want);
        let mut info_ids = info.eos_token_ids.clone();
        info_ids.sort();
        assert!(info_ids.iter().all(|i| ids.contains(i)));
    }

    #[test]
    fn absent_configs_and_null_ids_are_fine() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), Family::Qwen3, 600).unwrap();
        write(dir.path(), "config.json", json!({"eos_token_id": null}));
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let ids = eos_token_ids(dir.path(), &tok).unwrap();
        let want: BTreeSet<u32> = ["<|im_end|>", "<|endoftext|>"]
            .iter()
            .map(|t| tok.token_to_id(t).unwrap())
            .collect();
        assert_eq!(ids, want.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn gemma_turn_end_and_nested_text_config() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), Family::Gemma3, 800).unwrap();
        write(
            dir.path(),
            "config.json",
            json!({"text_config": {"eos_token_id": [1]}}),
        );
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let ids = eos_token_ids(dir.path(), &tok).unwrap();
        assert_eq!(ids, vec![1, tok.token_to_id("<end_of_turn>").unwrap()]);
    }

    #[test]
    fn bad_ids_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), Family::Qwen2, 600).unwrap();
        write(
            dir.path(),
            "generation_config.json",
            json!({"eos_token_id": "x"}),
        );
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let err = eos_token_ids(dir.path(), &tok).unwrap_err().to_string();
        assert!(err.contains("generation_config.json"), "{err}");
    }
}
