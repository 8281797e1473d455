//! Real tokenizers for tiny test models, written in Hugging Face's formats.
//!
//! Tests need model directories that every consumer loads the way it loads
//! a published model: this crate, and Python `transformers.AutoTokenizer`
//! (which mlx-lm uses). So the files follow the published layouts of each
//! family: a byte-level BPE trained here on a small embedded corpus (Qwen,
//! Llama 3) or a SentencePiece-style BPE with byte fallback (Gemma 3), the
//! family's special tokens and ids, its post-processor (BOS or not), and its
//! real chat template. Training is deterministic: the same arguments always
//! write byte-identical files.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde_json::{json, Map, Value};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    NormalizedString, Normalizer, NormalizerWrapper, OffsetReferential, OffsetType,
    PreTokenizedString, PreTokenizer, PreTokenizerWrapper, Trainer,
};

/// Training text: English prose, code, JSON, math, a little CJK and emoji.
pub const CORPUS: &str = include_str!("tiny_corpus.txt");

/// The model families tiny test models come in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Family {
    pub const ALL: [Family; 4] = [Family::Llama, Family::Qwen2, Family::Qwen3, Family::Gemma3];

    /// The family's published chat template (Llama 3.1, Qwen2.5, Qwen3,
    /// Gemma 3).
    pub fn chat_template(self) -> &'static str {
        match self {
            Family::Llama => include_str!("templates/llama3_1.jinja"),
            Family::Qwen2 => include_str!("templates/qwen2_5.jinja"),
            Family::Qwen3 => include_str!("templates/qwen3.jinja"),
            Family::Gemma3 => include_str!("templates/gemma3.jinja"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
        }
    }

    fn spec(self) -> Spec {
        let tok = |content: &'static str, special: bool| SpecialToken { content, special };
        match self {
            Family::Qwen2 | Family::Qwen3 => {
                // Qwen marks the tool and thinking tags as added but not
                // special: they survive skip_special_tokens, and the
                // gateway's parsers look for them in the text.
                let mut specials = vec![
                    tok("<|endoftext|>", true),
                    tok("<|im_start|>", true),
                    tok("<|im_end|>", true),
                    tok("<tool_call>", false),
                    tok("</tool_call>", false),
                ];
                if self == Family::Qwen3 {
                    specials.push(tok("<think>", false));
                    specials.push(tok("</think>", false));
                }
                Spec {
                    specials,
                    bos: None,
                    eos: "<|im_end|>",
                    stop: &["<|im_end|>", "<|endoftext|>"],
                    pad: Some("<|endoftext|>"),
                    unk: None,
                    reserved: "<|reserved_special_token_{}|>",
                    style: Style::ByteLevel {
                        pattern: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                        nfc: true,
                    },
                }
            }
            Family::Llama => Spec {
                specials: vec![
                    tok("<|begin_of_text|>", true),
                    tok("<|end_of_text|>", true),
                    tok("<|start_header_id|>", true),
                    tok("<|end_header_id|>", true),
                    tok("<|eom_id|>", true),
                    tok("<|eot_id|>", true),
                    tok("<|python_tag|>", true),
                ],
                bos: Some("<|begin_of_text|>"),
                eos: "<|eot_id|>",
                // Llama 3.1's generation_config: end_of_text, eom_id, eot_id.
                stop: &["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                pad: None,
                unk: None,
                reserved: "<|reserved_special_token_{}|>",
                style: Style::ByteLevel {
                    pattern: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                    nfc: false,
                },
            },
            Family::Gemma3 => Spec {
                specials: vec![
                    tok("<pad>", true),
                    tok("<eos>", true),
                    tok("<bos>", true),
                    tok("<unk>", true),
                    tok("<mask>", true),
                    tok("<start_of_turn>", true),
                    tok("<end_of_turn>", true),
                ],
                bos: Some("<bos>"),
                eos: "<end_of_turn>",
                // Gemma 3 instruct's generation_config: [1, 106].
                stop: &["<eos>", "<end_of_turn>"],
                pad: Some("<pad>"),
                unk: Some("<unk>"),
                reserved: "<unused{}>",
                style: Style::SentencePiece,
            },
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Family {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Family::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                anyhow!("unknown model family {s:?} (expected llama, qwen2, qwen3 or gemma3)")
            })
    }
}

/// What the caller needs to write a consistent `config.json` and
/// `generation_config.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TinyTokenizerInfo {
    /// Total ids, special tokens included (the embedding rows needed).
    pub vocab_size: usize,
    pub bos_token_id: Option<u32>,
    /// Every id that ends a generation, as the family's
    /// `generation_config.json` lists them (sorted).
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
}

struct SpecialToken {
    content: &'static str,
    special: bool,
}

struct Spec {
    /// Family special tokens in id order.
    specials: Vec<SpecialToken>,
    bos: Option<&'static str>,
    /// `eos_token` of tokenizer_config.json: the chat turn end.
    eos: &'static str,
    /// All tokens that stop generation.
    stop: &'static [&'static str],
    pad: Option<&'static str>,
    unk: Option<&'static str>,
    /// Name of filler tokens (`{}` = index) when the corpus runs out of
    /// merges before `vocab_size`; real Llama 3 and Gemma vocabularies have
    /// such reserved tokens too.
    reserved: &'static str,
    style: Style,
}

enum Style {
    /// GPT-2 byte-level BPE behind a regex split (Qwen, Llama 3).
    ByteLevel { pattern: &'static str, nfc: bool },
    /// SentencePiece-converted BPE: spaces as "▁", no pre-tokenizer, byte
    /// fallback tokens `<0x00>`..`<0xFF>` (Gemma).
    SentencePiece,
}

/// Writes `tokenizer.json`, `tokenizer_config.json` and
/// `special_tokens_map.json` for a `family` tokenizer with exactly
/// `vocab_size` ids into `dir` (created if needed).
pub fn write_tokenizer(dir: &Path, family: Family, vocab_size: usize) -> Result<TinyTokenizerInfo> {
    let spec = family.spec();
    let (tokenizer_json, ids) = match spec.style {
        Style::ByteLevel { pattern, nfc } => byte_level(&spec, family, pattern, nfc, vocab_size)?,
        Style::SentencePiece => sentencepiece(&spec, vocab_size)?,
    };
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let id = |t: &str| -> Result<u32> {
        ids.get(t)
            .copied()
            .ok_or_else(|| anyhow!("{family}: token {t} missing from the vocabulary"))
    };

    // Round-trip through the tokenizers crate before writing, so a file we
    // write is one it (and so Python's binding of it) loads.
    let text = serde_json::to_string_pretty(&tokenizer_json)?;
    let check = tokenizers::Tokenizer::from_str(&text)
        .map_err(|e| anyhow!("{family}: generated tokenizer.json does not load: {e}"))?;
    ensure!(
        check.get_vocab_size(true) == vocab_size,
        "{family}: generated {} ids, wanted {vocab_size}",
        check.get_vocab_size(true)
    );
    write(dir, "tokenizer.json", &text)?;

    let added_tokens_decoder: Map<String, Value> = tokenizer_json["added_tokens"]
        .as_array()
        .expect("added_tokens is an array")
        .iter()
        .map(|t| {
            let mut entry = t.as_object().expect("added token is an object").clone();
            let id = entry.remove("id").expect("added token has an id");
            (id.to_string(), Value::Object(entry))
        })
        .collect();
    let config = json!({
        "add_bos_token": spec.bos.is_some(),
        "add_eos_token": false,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": spec.bos,
        "chat_template": family.chat_template(),
        // Python-side cleanup (" ." -> ".") would make Python's decode
        // differ from the tokenizer.json decoder that Rust runs.
        "clean_up_tokenization_spaces": false,
        "eos_token": spec.eos,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "pad_token": spec.pad,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": spec.unk,
    });
    write(
        dir,
        "tokenizer_config.json",
        &serde_json::to_string_pretty(&config)?,
    )?;

    let mut map = Map::new();
    for (key, tok) in [
        ("bos_token", spec.bos),
        ("eos_token", Some(spec.eos)),
        ("pad_token", spec.pad),
        ("unk_token", spec.unk),
    ] {
        if let Some(tok) = tok {
            map.insert(key.into(), added_token_fields(tok));
        }
    }
    write(
        dir,
        "special_tokens_map.json",
        &serde_json::to_string_pretty(&map)?,
    )?;

    let mut eos_token_ids = spec
        .stop
        .iter()
        .map(|t| id(t))
        .collect::<Result<Vec<_>>>()?;
    eos_token_ids.sort_unstable();
    Ok(TinyTokenizerInfo {
        vocab_size,
        bos_token_id: spec.bos.map(id).transpose()?,
        eos_token_ids,
        pad_token_id: spec.pad.map(id).transpose()?,
    })
}

fn write(dir: &Path, name: &str, text: &str) -> Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
}

fn added_token_fields(content: &str) -> Value {
    json!({
        "content": content,
        "lstrip": false,
        "normalized": false,
        "rstrip": false,
        "single_word": false,
    })
}

fn added_token(id: u32, content: &str, special: bool) -> Value {
    json!({
        "id": id,
        "content": content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": false,
        "special": special,
    })
}

/// Vocabulary and merges of a trained BPE, in id / rank order.
struct Trained {
    vocab: Vec<String>,
    merges: Vec<Value>,
}

/// Trains a BPE on pre-split words. Ties between equally frequent pairs are
/// broken by pair ids inside the trainer and the alphabet is sorted, so the
/// result does not depend on hash or thread order.
fn train(words: &[String], alphabet: HashSet<char>, vocab_size: usize) -> Result<Trained> {
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(0)
        .show_progress(false)
        .initial_alphabet(alphabet)
        .build();
    trainer
        .feed(words.iter(), |w| Ok(vec![w.to_owned()]))
        .map_err(|e| anyhow!("BPE training failed: {e}"))?;
    let mut model = BPE::default();
    trainer
        .train(&mut model)
        .map_err(|e| anyhow!("BPE training failed: {e}"))?;
    let model = serde_json::to_value(&model)?;
    let vocab_map = model["vocab"]
        .as_object()
        .ok_or_else(|| anyhow!("trained BPE has no vocab"))?;
    let mut vocab = vec![String::new(); vocab_map.len()];
    for (token, id) in vocab_map {
        let id = id.as_u64().ok_or_else(|| anyhow!("bad id for {token}"))? as usize;
        ensure!(id < vocab.len(), "trained BPE ids are not dense");
        vocab[id] = token.clone();
    }
    let merges = model["merges"]
        .as_array()
        .ok_or_else(|| anyhow!("trained BPE has no merges"))?
        .clone();
    Ok(Trained { vocab, merges })
}

fn byte_level(
    spec: &Spec,
    family: Family,
    pattern: &str,
    nfc: bool,
    vocab_size: usize,
) -> Result<(Value, BTreeMap<String, u32>)> {
    let n_special = spec.specials.len();
    let floor = n_special + 256;
    ensure!(
        vocab_size >= floor,
        "vocab_size {vocab_size} is too small for {family}: it needs at least {floor} \
         ({n_special} special tokens + 256 byte tokens)"
    );
    let split = json!({
        "type": "Split",
        "pattern": {"Regex": pattern},
        "behavior": "Isolated",
        "invert": false,
    });
    let byte_level = json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": family == Family::Llama,
        "use_regex": false,
    });
    let pre_tokenizer = json!({"type": "Sequence", "pretokenizers": [split, byte_level]});
    let normalizer = if nfc {
        json!({"type": "NFC"})
    } else {
        Value::Null
    };

    let words = pre_tokenize(&normalizer, &pre_tokenizer, CORPUS)?;
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let trained = train(&words, alphabet, vocab_size - n_special)?;

    let mut ids = BTreeMap::new();
    let mut vocab = Map::new();
    for (i, token) in trained.vocab.iter().enumerate() {
        vocab.insert(token.clone(), json!(i));
        ids.insert(token.clone(), i as u32);
    }
    // Special tokens follow the BPE vocabulary, as in Qwen and Llama 3.
    let mut added = Vec::new();
    let mut next = trained.vocab.len() as u32;
    for t in &spec.specials {
        ensure!(
            !ids.contains_key(t.content),
            "{family}: {} was learned as a merge",
            t.content
        );
        added.push(added_token(next, t.content, t.special));
        ids.insert(t.content.to_owned(), next);
        next += 1;
    }
    added.extend(reserved_tokens(spec, next, vocab_size));

    let llama = family == Family::Llama;
    let post_processor = match spec.bos {
        Some(bos) => json!({
            "type": "Sequence",
            "processors": [
                {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
                bos_template(bos, ids[bos]),
            ],
        }),
        None => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false})
        }
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": llama, "trim_offsets": llama, "use_regex": llama},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            // Llama 3 looks whole pre-tokens up in the vocab before merging.
            "ignore_merges": family == Family::Llama,
            "vocab": vocab,
            "merges": trained.merges,
        },
    });
    Ok((tokenizer, ids))
}

fn sentencepiece(spec: &Spec, vocab_size: usize) -> Result<(Value, BTreeMap<String, u32>)> {
    let n_special = spec.specials.len();
    let floor = n_special + 256;
    ensure!(
        vocab_size >= floor,
        "vocab_size {vocab_size} is too small for gemma3: it needs at least {floor} \
         ({n_special} special tokens + 256 byte-fallback tokens)"
    );
    let budget = vocab_size - floor;

    // Character frequencies of the normalized corpus. Characters outside the
    // Basic Multilingual Plane (emoji) are left to byte fallback, as rare
    // characters are in the real Gemma vocabulary; when the budget is small
    // only the most frequent characters get their own piece.
    let text = CORPUS.replace(' ', "▁");
    let mut freq: BTreeMap<char, usize> = BTreeMap::new();
    for c in text.chars().filter(|c| c.len_utf8() < 4) {
        *freq.entry(c).or_default() += 1;
    }
    let mut by_freq: Vec<(char, usize)> = freq.into_iter().collect();
    by_freq.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let keep = by_freq.len().min(budget * 3 / 4);
    let alphabet: HashSet<char> = by_freq[..keep].iter().map(|(c, _)| *c).collect();

    // SentencePiece-like pieces: a word starts at "▁", digits stand alone
    // (Gemma splits digits), newline runs are their own pieces, and
    // characters outside the alphabet cut words (they become byte tokens).
    let mut words = Vec::new();
    let mut word = String::new();
    let flush = |word: &mut String, words: &mut Vec<String>| {
        if !word.is_empty() {
            words.push(std::mem::take(word));
        }
    };
    for c in text.chars() {
        if !alphabet.contains(&c) {
            flush(&mut word, &mut words);
            continue;
        }
        let last = word.chars().last();
        let boundary = match last {
            None => false,
            Some(l) => {
                (c == '▁' && l != '▁')
                    || c.is_ascii_digit()
                    || l.is_ascii_digit()
                    || (c == '\n') != (l == '\n')
            }
        };
        if boundary {
            flush(&mut word, &mut words);
        }
        word.push(c);
    }
    flush(&mut word, &mut words);

    let trained = train(&words, HashSet::new(), budget)?;

    let mut ids = BTreeMap::new();
    let mut vocab = Map::new();
    let mut push = |token: String, ids: &mut BTreeMap<String, u32>| -> Result<()> {
        let id = vocab.len() as u32;
        ensure!(
            !ids.contains_key(&token),
            "gemma3: duplicate token {token:?}"
        );
        vocab.insert(token.clone(), json!(id));
        ids.insert(token, id);
        Ok(())
    };
    // Gemma's layout: special tokens first (<pad>=0, <eos>=1, <bos>=2),
    // then the byte-fallback tokens, then the learned pieces.
    for t in &spec.specials {
        push(t.content.to_owned(), &mut ids)?;
    }
    for b in 0..=255u8 {
        push(format!("<0x{b:02X}>"), &mut ids)?;
    }
    for token in trained.vocab {
        push(token, &mut ids)?;
    }
    let mut added: Vec<Value> = spec
        .specials
        .iter()
        .map(|t| added_token(ids[t.content], t.content, t.special))
        .collect();
    let next = vocab.len() as u32;
    added.extend(reserved_tokens(spec, next, vocab_size));

    let bos = spec.bos.expect("gemma has a BOS token");
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false},
        "post_processor": bos_template(bos, ids[bos]),
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": spec.unk,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": trained.merges,
        },
    });
    Ok((tokenizer, ids))
}

/// Filler tokens for ids `next..vocab_size`.
fn reserved_tokens(spec: &Spec, next: u32, vocab_size: usize) -> Vec<Value> {
    (next as usize..vocab_size)
        .enumerate()
        .map(|(i, id)| {
            added_token(
                id as u32,
                &spec.reserved.replace("{}", &i.to_string()),
                true,
            )
        })
        .collect()
}

/// A post-processor that prepends BOS (Llama 3, Gemma).
fn bos_template(bos: &str, id: u32) -> Value {
    json!({
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [id], "tokens": [bos]}},
    })
}

/// Splits text into the words the BPE sees, with the real pipeline.
fn pre_tokenize(normalizer: &Value, pre_tokenizer: &Value, text: &str) -> Result<Vec<String>> {
    let mut normalized = NormalizedString::from(text);
    if !normalizer.is_null() {
        let n: NormalizerWrapper = serde_json::from_value(normalizer.clone())?;
        n.normalize(&mut normalized)
            .map_err(|e| anyhow!("normalizer failed: {e}"))?;
    }
    let p: PreTokenizerWrapper = serde_json::from_value(pre_tokenizer.clone())?;
    let mut pre = PreTokenizedString::from(normalized);
    p.pre_tokenize(&mut pre)
        .map_err(|e| anyhow!("pre-tokenizer failed: {e}"))?;
    let words: Vec<String> = pre
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(s, _, _)| s.to_owned())
        .collect();
    if words.is_empty() {
        bail!("the corpus pre-tokenized to nothing");
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::{ChatTemplate, RenderOptions};
    use crate::tokenizer::Tokenizer;
    use std::path::PathBuf;
    use std::process::Command;

    #[test]
    fn family_names_round_trip() {
        for f in Family::ALL {
            assert_eq!(f.to_string().parse::<Family>().unwrap(), f);
        }
        let err = "mistral".parse::<Family>().unwrap_err().to_string();
        assert!(err.contains("mistral"), "{err}");
    }

    #[test]
    fn exact_vocab_size_and_consistent_ids() {
        for family in Family::ALL {
            for size in [263, 300, 512, 1000, 3000] {
                let dir = tempfile::tempdir().unwrap();
                let info = write_tokenizer(dir.path(), family, size).unwrap();
                let tok = Tokenizer::from_dir(dir.path()).unwrap();
                assert_eq!(info.vocab_size, size);
                assert_eq!(tok.vocab_size(), size, "{family} {size}");
                // Every id decodes to a token: no holes in the id space.
                for id in 0..size as u32 {
                    assert!(
                        tok.id_to_token(id).is_some(),
                        "{family} {size}: id {id} has no token"
                    );
                }
                assert_eq!(info.bos_token_id, tok.bos_token_id());
                assert!(info.eos_token_ids.contains(&tok.eos_token_id().unwrap()));
                assert_eq!(
                    info.pad_token_id,
                    tok.pad_token().and_then(|t| tok.token_to_id(t))
                );
                assert!(info.eos_token_ids.windows(2).all(|w| w[0] < w[1]));
            }
        }
    }

    #[test]
    fn family_layouts_match_the_real_ones() {
        let dir = tempfile::tempdir().unwrap();
        let gemma = write_tokenizer(dir.path(), Family::Gemma3, 600).unwrap();
        assert_eq!(gemma.pad_token_id, Some(0));
        assert_eq!(gemma.eos_token_ids[0], 1);
        assert_eq!(gemma.bos_token_id, Some(2));
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.eos_token(), Some("<end_of_turn>"));
        assert_eq!(tok.token_to_id("<0x00>"), Some(7));
        assert_eq!(tok.encode("hi", true).unwrap()[0], 2);

        let dir = tempfile::tempdir().unwrap();
        let llama = write_tokenizer(dir.path(), Family::Llama, 600).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        // Special tokens follow the BPE vocabulary.
        assert_eq!(llama.bos_token_id, tok.token_to_id("<|begin_of_text|>"));
        assert_eq!(llama.bos_token_id, Some(593));
        assert_eq!(tok.encode("hi", true).unwrap()[0], 593);
        assert_eq!(llama.pad_token_id, None);
    }

    #[test]
    fn training_is_deterministic_and_fast() {
        for family in Family::ALL {
            let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let start = std::time::Instant::now();
            write_tokenizer(a.path(), family, 2000).unwrap();
            let took = start.elapsed();
            write_tokenizer(b.path(), family, 2000).unwrap();
            for name in [
                "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json",
            ] {
                let x = std::fs::read(a.path().join(name)).unwrap();
                let y = std::fs::read(b.path().join(name)).unwrap();
                assert!(x == y, "{family}: {name} differs between runs");
            }
            // Well under a second in release; debug builds of this crate
            // and a loaded machine get slack.
            assert!(took.as_secs_f64() < 5.0, "{family}: training took {took:?}");
        }
    }

    #[test]
    fn too_small_vocab_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_tokenizer(dir.path(), Family::Qwen3, 100)
            .unwrap_err()
            .to_string();
        assert!(err.contains("at least 263"), "{err}");
    }

    /// The Python interpreter of the project's MLX venv, if set up.
    fn venv_python() -> Option<PathBuf> {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.mlx/venv/bin/python");
        p.exists().then_some(p)
    }

    const PYTHON_CHECK: &str = r#"
import json, sys
from transformers import AutoTokenizer
out = []
for case in json.loads(sys.argv[1]):
    tok = AutoTokenizer.from_pretrained(case["dir"])
    chats = []
    for conv in case["conversations"]:
        chat = tok.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False,
                                       add_generation_prompt=True, **conv["kwargs"])
        chats.append({"text": chat, "ids": tok.encode(chat, add_special_tokens=False)})
    plain = tok.encode(case["text"], add_special_tokens=False)
    out.append({
        "len": len(tok),
        "bos": tok.bos_token, "eos": tok.eos_token, "pad": tok.pad_token,
        "ids": tok.encode(case["text"]),
        "ids_plain": plain,
        "decoded": tok.decode(plain),
        "decoded_skip": tok.decode(tok.encode(case["text"]), skip_special_tokens=True),
        "chats": chats,
    })
print(json.dumps(out))
"#;

    fn conversations(family: Family) -> Vec<Value> {
        let tools = json!([{"type": "function", "function": {
            "name": "get_weather",
            "description": "Get the weather for a city",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "description": "City name"},
                               "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"]}}}]);
        let tool_chat = json!([
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Zürich? ☀️"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5}"},
        ]);
        let multi_turn = json!([
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "<think>\nGreeting.\n</think>\n\nHello! 你好"},
            {"role": "user", "content": "What is 2+2?"},
        ]);
        let with_reasoning = json!([
            {"role": "user", "content": "Add 2 and 2."},
            {"role": "assistant", "reasoning_content": "Easy.", "content": "4"},
        ]);
        match family {
            Family::Gemma3 => vec![
                json!({"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "  Hi 🎉  "},
                                    {"role": "assistant", "content": "Hello!"},
                                    {"role": "user", "content": [{"type": "text", "text": "Bye"}]}],
                       "tools": null, "kwargs": {}}),
                json!({"messages": multi_turn, "tools": null, "kwargs": {}}),
            ],
            Family::Qwen3 => vec![
                json!({"messages": tool_chat, "tools": tools, "kwargs": {}}),
                json!({"messages": tool_chat, "tools": tools, "kwargs": {"enable_thinking": false}}),
                json!({"messages": multi_turn, "tools": null, "kwargs": {"enable_thinking": true}}),
                json!({"messages": with_reasoning, "tools": null, "kwargs": {}}),
            ],
            _ => vec![
                json!({"messages": tool_chat, "tools": tools, "kwargs": {}}),
                json!({"messages": multi_turn, "tools": null, "kwargs": {}}),
            ],
        }
    }

    /// Python's transformers must load what we write and agree with this
    /// crate on ids, decoding and the rendered chat template.
    #[test]
    fn python_transformers_agrees() {
        let Some(python) = venv_python() else {
            eprintln!("note: skipping the transformers cross-check: no .mlx/venv/bin/python (run the MLX setup to enable it)");
            return;
        };
        let root = tempfile::tempdir().unwrap();
        let mut cases = Vec::new();
        for family in Family::ALL {
            let dir = root.path().join(family.to_string());
            write_tokenizer(&dir, family, 1200).unwrap();
            let special = match family {
                Family::Gemma3 => "<end_of_turn>",
                Family::Llama => "<|eot_id|>",
                _ => "<|im_end|>",
            };
            let text = format!(
                "Hello, world! It's  12345 apples.\n\n\tfn main() {{}} 你好 🎉👍🏽 naïve{special}tail"
            );
            cases.push(json!({
                "dir": dir.to_str().unwrap(),
                "text": text,
                "conversations": conversations(family),
            }));
        }
        let output = Command::new(&python)
            .arg("-c")
            .arg(PYTHON_CHECK)
            .arg(Value::Array(cases.clone()).to_string())
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_VERBOSITY", "error")
            .output()
            .expect("run python");
        assert!(
            output.status.success(),
            "python failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let results: Vec<Value> =
            serde_json::from_slice(&output.stdout).expect("python printed JSON");

        for (family, (case, py)) in Family::ALL.iter().zip(cases.iter().zip(&results)) {
            let dir = Path::new(case["dir"].as_str().unwrap());
            let tok = Tokenizer::from_dir(dir).unwrap();
            let template = ChatTemplate::from_dir(dir).unwrap().expect("template");
            let text = case["text"].as_str().unwrap();
            let ids = |v: &Value| -> Vec<u32> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            };
            assert_eq!(py["len"], json!(tok.vocab_size()), "{family}: len");
            assert_eq!(py["bos"], json!(tok.bos_token()), "{family}: bos");
            assert_eq!(py["eos"], json!(tok.eos_token()), "{family}: eos");
            assert_eq!(py["pad"], json!(tok.pad_token()), "{family}: pad");
            assert_eq!(
                ids(&py["ids"]),
                tok.encode(text, true).unwrap(),
                "{family}: ids"
            );
            let plain = tok.encode(text, false).unwrap();
            assert_eq!(
                ids(&py["ids_plain"]),
                plain,
                "{family}: ids without specials"
            );
            assert_eq!(
                py["decoded"],
                json!(tok.decode(&plain, false).unwrap()),
                "{family}: decode"
            );
            assert_eq!(py["decoded"], json!(text), "{family}: round trip");
            let with_specials = tok.encode(text, true).unwrap();
            assert_eq!(
                py["decoded_skip"],
                json!(tok.decode(&with_specials, true).unwrap()),
                "{family}: decode skipping specials"
            );
            let convs = case["conversations"].as_array().unwrap();
            for (i, (conv, py_chat)) in convs
                .iter()
                .zip(py["chats"].as_array().unwrap())
                .enumerate()
            {
                let options = RenderOptions {
                    tools: conv["tools"].as_array().cloned(),
                    add_generation_prompt: true,
                    kwargs: conv["kwargs"].as_object().unwrap().clone(),
                };
                let ours = template
                    .render(conv["messages"].as_array().unwrap(), &options)
                    .unwrap_or_else(|e| panic!("{family} conversation {i}: {e}"));
                assert_eq!(
                    py_chat["text"].as_str().unwrap(),
                    ours,
                    "{family}: conversation {i}"
                );
                assert_eq!(
                    ids(&py_chat["ids"]),
                    tok.encode_chat(&ours).unwrap(),
                    "{family}: chat ids {i}"
                );
            }
        }
    }
}
