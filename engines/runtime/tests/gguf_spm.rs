//! SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model =
//! llama`: Gemma's, Llama 2's) are rebuilt from the metadata alone, and
//! encode and decode as the `sentencepiece` package itself does:
//! scripts/spm_reference.py trains a SentencePiece BPE model on the fixture
//! corpus, its pieces, scores and types go into the GGUF file of a tiny
//! model with no tokenizer.json beside it, and the loaded model's ids must
//! be SentencePiece's (and, for Gemma, transformers' GGUF conversion's).

use std::path::{Path, PathBuf};

use fixtures::gguf::{converted, write_gguf, Meta};
use fixtures::model::{write_model, TinySpec};
use fixtures::reference::token_ids;
use runtime::{Family, LoadedModel};
use serde_json::{json, Value};

const VOCAB: usize = 1000;
const CONTROL: &[&str] = &["<start_of_turn>", "<end_of_turn>"];

/// Corpus lines, whitespace at the edges and in runs, newlines, tabs,
/// characters no piece covers (emoji, CJK: byte fallback), control and
/// user-defined tokens in the text, the empty string, and a few hundred
/// deterministic mixtures of corpus words and odd characters.
fn texts(user_defined: &[&str]) -> Vec<String> {
    let corpus = fixtures::tokenizer::CORPUS;
    let mut texts: Vec<String> = corpus.lines().map(str::to_owned).collect();
    for t in [
        "",
        " ",
        "   ",
        "  leading spaces",
        "trailing spaces   ",
        "multiple   spaces  in    between",
        "new\nlines\n\n\nand\ttabs\t\there",
        " \n \t mixed \r\n whitespace \t",
        "emoji 🎉🦀👩‍👩‍👧 and CJK 中文字符 日本語のテキスト 한국어",
        "ünïcödé ß ÆØÅ ĳ ﬁ \u{00a0}nbsp \u{200b}zwsp 𝔘𝔫𝔦",
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
        "text<end_of_turn>",
        "<start_of_turn><end_of_turn>",
        "a<start_of_turn> b <end_of_turn>c",
        "<start_of_tur n> is not a control token",
    ] {
        texts.push(t.to_owned());
    }
    for u in user_defined {
        texts.push(u.to_string());
        texts.push(format!("before{u}after {u} spaced  {u}"));
    }
    let words: Vec<&str> = corpus.split_whitespace().collect();
    let odd = [" ", "  ", "\n", "\t", "🎉", "中", "é", "<", ">", "▁", "_"];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n as u64) as usize
    };
    for _ in 0..300 {
        let mut t = String::new();
        for _ in 0..1 + next(12) {
            if next(4) == 0 {
                t.push_str(odd[next(odd.len())]);
            } else {
                t.push_str(&" ".repeat(next(3)));
                t.push_str(words[next(words.len())]);
            }
        }
        texts.push(t);
    }
    texts
}

/// SentencePiece trained on the fixture corpus, and its answers for `texts`.
fn reference(
    add_dummy_prefix: bool,
    user_defined: &[&str],
    texts: &[String],
    transformers_arch: Option<&str>,
) -> Value {
    fixtures::reference::run(
        "spm_reference.py",
        &json!({
            "corpus": fixtures::tokenizer::CORPUS, "vocab_size": VOCAB,
            "add_dummy_prefix": add_dummy_prefix, "user_defined": user_defined,
            "control": CONTROL, "texts": texts, "transformers_arch": transformers_arch,
        }),
    )
}

/// The `tokenizer.*` metadata llama.cpp's converter writes for the
/// reference's vocabulary.
fn spm_meta(reference: &Value, add_space_prefix: Option<bool>) -> Vec<(&'static str, Meta)> {
    let strings = |k: &str| {
        reference[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect()
    };
    let id = |k: &str| Meta::U32(reference[k].as_u64().unwrap() as u32);
    let mut meta = vec![
        ("tokenizer.ggml.model", Meta::Str("llama".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(strings("tokens"))),
        (
            "tokenizer.ggml.scores",
            Meta::F32s(
                reference["scores"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.token_type",
            Meta::I32s(
                reference["types"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_i64().unwrap() as i32)
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.bos_token_id", id("bos")),
        ("tokenizer.ggml.eos_token_id", id("eos")),
        ("tokenizer.ggml.unknown_token_id", id("unk")),
        (
            "tokenizer.chat_template",
            Meta::Str(fixtures::tokenizer::chat_template(Family::Gemma3).into()),
        ),
    ];
    if let Some(prefix) = add_space_prefix {
        meta.push(("tokenizer.ggml.add_space_prefix", Meta::Bool(prefix)));
    }
    meta
}

/// A tiny `family` model as a GGUF file in `dir` whose tokenizer is
/// `tokenizer` metadata only (no tokenizer.json beside it).
fn gguf_with_vocab(dir: &Path, family: Family, tokenizer: Vec<(&'static str, Meta)>) -> PathBuf {
    let hf = dir.join("hf");
    let mut spec = TinySpec::tiny(family);
    spec.vocab = VOCAB as i32;
    write_model(&hf, &spec).unwrap();
    let (mut meta, tensors) = converted(&hf, family);
    meta.retain(|(k, _)| !k.starts_with("tokenizer."));
    meta.extend(tokenizer);
    let file = dir.join("spm.gguf");
    std::fs::write(&file, write_gguf(&meta, &tensors)).unwrap();
    file
}

/// Loads the GGUF model and checks its tokenizer against the reference.
fn check(
    family: Family,
    add_space_prefix: Option<bool>,
    user_defined: &[&str],
    arch: Option<&str>,
) {
    let texts = texts(user_defined);
    let prefix = add_space_prefix.unwrap_or(true);
    let reference = reference(prefix, user_defined, &texts, arch);
    let dir = tempfile::tempdir().unwrap();
    let file = gguf_with_vocab(dir.path(), family, spm_meta(&reference, add_space_prefix));
    let model = LoadedModel::load(&file, None).unwrap();
    let tok = &model.tokenizer;
    let mut mismatches = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let want = token_ids(&reference["ids"][i]);
        let ours = tok.encode(text, false).unwrap();
        if ours != want {
            mismatches.push(format!("{text:?}: ours {ours:?}, sentencepiece {want:?}"));
        }
        let decoded = tok.decode(&want, true).unwrap();
        if decoded != reference["decoded"][i] {
            mismatches.push(format!(
                "decode of {text:?}: ours {decoded:?}, sentencepiece {}",
                reference["decoded"][i]
            ));
        }
        if arch.is_some() {
            let theirs = token_ids(&reference["transformers"][i]);
            if theirs != want {
                mismatches.push(format!(
                    "{text:?}: transformers {theirs:?}, sentencepiece {want:?}"
                ));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} texts differ:\n{}",
        mismatches.len(),
        texts.len(),
        mismatches.join("\n")
    );
    // BOS comes first when the metadata (or llama.cpp's default) says so;
    // EOS stops; the template renders control tokens that encode whole.
    let bos = reference["bos"].as_u64().unwrap() as u32;
    assert_eq!(tok.encode("hi", true).unwrap()[0], bos);
    assert!(model
        .stop_tokens
        .contains(&(reference["eos"].as_u64().unwrap() as u32)));
    let template = model.template.as_ref().expect("tokenizer.chat_template");
    let chat = [json!({"role": "user", "content": "Hello"})];
    let rendered = template
        .render(
            &chat,
            &text::RenderOptions::default().with_generation_prompt(),
        )
        .unwrap();
    let ids = tok.encode_chat(&rendered).unwrap();
    let start = tok.token_to_id("<start_of_turn>").unwrap();
    assert_eq!(
        ids.iter().filter(|&&i| i == start).count(),
        2,
        "{rendered:?}"
    );
    assert_eq!(ids[0], bos, "{rendered:?}");
    // A template beside the file (and no tokenizer_config.json) renders
    // with the file's special tokens.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ bos_token }}[{{ messages[0]['content'] }}]",
    )
    .unwrap();
    let model = LoadedModel::load(&file, None).unwrap();
    let template = model.template.as_ref().expect("chat_template.jinja");
    let rendered = template
        .render(&chat, &text::RenderOptions::default())
        .unwrap();
    let bos_token = tok.id_to_token(bos).unwrap();
    assert_eq!(rendered, format!("{bos_token}[Hello]"));
}

/// Gemma's files: no space prefix (`add_space_prefix = false`), BOS added,
/// user-defined pieces (Gemma has HTML tags and whitespace runs).
#[test]
fn gemma_style_vocab_encodes_as_sentencepiece_and_transformers() {
    check(
        Family::Gemma3,
        Some(false),
        &["<tool>", "</tool>", "<b>"],
        Some("gemma3"),
    );
}

/// Llama 2's files: the dummy space prefix (llama.cpp's default when the
/// key is absent, as here) and BOS by default. transformers' conversion
/// is left out: its `Metaspace` pre-tokenizer adds no prefix to text that
/// starts with a space, where SentencePiece does (`"  a"` is `▁▁▁a` there).
#[test]
fn llama2_style_vocab_with_space_prefix_encodes_as_sentencepiece() {
    check(Family::Llama, None, &[], None);
}

/// A change to a file's metadata.
type MetaEdit<'a> = Box<dyn Fn(&mut Vec<(&'static str, Meta)>) + 'a>;

/// Bad vocabularies are load errors naming the file and the key.
#[test]
fn inconsistent_vocabularies_are_load_errors() {
    let texts = texts(&[]);
    let reference = reference(false, &[], &texts[..1], None);
    let dir = tempfile::tempdir().unwrap();
    let replace = |meta: &mut Vec<(&'static str, Meta)>, key: &'static str, value: Meta| {
        meta.retain(|(k, _)| *k != key);
        meta.push((key, value));
    };
    let tokens: Vec<String> = reference["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    let types: Vec<i32> = reference["types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap() as i32)
        .collect();
    let byte_41 = tokens.iter().position(|t| t == "<0x41>").unwrap();
    let cases: Vec<(MetaEdit, &str)> = vec![
        (
            Box::new(|m| replace(m, "tokenizer.ggml.scores", Meta::F32s(vec![0.0; 5]))),
            "`tokenizer.ggml.scores` has 5 entries",
        ),
        (
            Box::new(|m| m.retain(|(k, _)| *k != "tokenizer.ggml.scores")),
            "`tokenizer.ggml.scores` has 0 entries",
        ),
        (
            Box::new(|m| {
                let mut t = types.clone();
                t[7] = 9;
                replace(m, "tokenizer.ggml.token_type", Meta::I32s(t));
            }),
            "`tokenizer.ggml.token_type` of token 7",
        ),
        (
            Box::new(|m| {
                let mut t = tokens.clone();
                t[byte_41] = "A-byte".into();
                replace(m, "tokenizer.ggml.tokens", Meta::Strs(t));
            }),
            "not spelled <0xNN>",
        ),
        (
            Box::new(|m| {
                let mut t = types.clone();
                t[byte_41] = 1;
                replace(m, "tokenizer.ggml.token_type", Meta::I32s(t));
            }),
            "255 of the 256 byte tokens byte fallback needs (no <0x41>)",
        ),
        (
            Box::new(|m| replace(m, "tokenizer.ggml.model", Meta::Str("rwkv".into()))),
            "tokenizer model `rwkv`",
        ),
    ];
    for (i, (edit, expect)) in cases.into_iter().enumerate() {
        let case = dir.path().join(i.to_string());
        let mut meta = spm_meta(&reference, Some(false));
        edit(&mut meta);
        let file = gguf_with_vocab(&case, Family::Gemma3, meta);
        let err = format!("{:#}", LoadedModel::load(&file, None).err().unwrap());
        assert!(
            err.contains(expect) && err.contains(&file.display().to_string()),
            "{expect}: {err}"
        );
    }
}
