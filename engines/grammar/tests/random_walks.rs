//! Every path through the allowed tokens spells valid output: random walks
//! (a stand-in for a model with random weights) over real tokenizers of
//! two styles (byte-level BPE, SentencePiece with byte fallback) end
//! within their budget, and their text validates against the schema.

use engine_core::Grammar;
use fixtures::Family;
use grammar::Compiler;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

const VOCAB: usize = 512;

fn tokenizer(family: Family) -> (tempfile::TempDir, text::Tokenizer, Compiler) {
    let dir = tempfile::tempdir().unwrap();
    fixtures::tokenizer::write_tokenizer(dir.path(), family, VOCAB).unwrap();
    let tok = text::Tokenizer::from_dir(dir.path()).unwrap();
    let eos = tok.eos_token_id().expect("the fixture names its EOS");
    let compiler = Compiler::new(&tok, VOCAB, &[eos]).unwrap();
    (dir, tok, compiler)
}

/// Walks the grammar picking uniformly among allowed tokens; the text, or
/// `None` if the walk did not end within `budget` tokens.
fn walk(
    compiler: &Compiler,
    tok: &text::Tokenizer,
    g: &Grammar,
    seed: u64,
    budget: usize,
) -> Option<String> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut c = compiler.compile(g).unwrap();
    let mut out = Vec::new();
    for _ in 0..budget {
        let Some(allowed) = c.allowed() else {
            return Some(tok.decode(&out, true).unwrap());
        };
        let ids: Vec<u32> = (0..VOCAB as u32).filter(|&t| allowed.contains(t)).collect();
        let t = ids[rng.random_range(0..ids.len())];
        if c.is_end(t) {
            return Some(tok.decode(&out, true).unwrap());
        }
        out.push(t);
        if !c.commit(t) {
            return Some(tok.decode(&out, true).unwrap());
        }
    }
    None
}

#[test]
fn random_walks_spell_valid_json() {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": false
    });
    let validator = jsonschema::validator_for(&schema).unwrap();
    let g = Grammar::JsonSchema(schema.to_string());
    for family in [Family::Qwen3, Family::Gemma3] {
        let (_dir, tok, compiler) = tokenizer(family);
        for seed in 0..40 {
            let text = walk(&compiler, &tok, &g, seed, 400)
                .unwrap_or_else(|| panic!("{family:?} seed {seed}: no end"));
            let v: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{family:?} {text:?}: {e}"));
            assert!(validator.is_valid(&v), "{family:?}: {text}");
        }
    }
}

#[test]
fn regex_choice_and_lark_are_followed() {
    let (_dir, tok, compiler) = tokenizer(Family::Qwen3);
    let choice = Grammar::Choice(vec!["yes".into(), "no".into(), "maybe \"so\"".into()]);
    let regex = Grammar::Regex("[0-9]{3}-[a-z]{2}".into());
    let lark = Grammar::Lark("start: \"(\" NUM (\",\" NUM)* \")\"\nNUM: /[0-9]{1,2}/".into());
    for seed in 0..20 {
        let c = walk(&compiler, &tok, &choice, seed, 50).unwrap();
        assert!(["yes", "no", "maybe \"so\""].contains(&c.as_str()), "{c:?}");
        let r = walk(&compiler, &tok, &regex, seed, 50).unwrap();
        assert!(r.len() == 6 && r.as_bytes()[3] == b'-', "{r:?}");
        assert!(
            r[..3].bytes().all(|b| b.is_ascii_digit())
                && r[4..].bytes().all(|b| b.is_ascii_lowercase()),
            "{r:?}"
        );
        if let Some(l) = walk(&compiler, &tok, &lark, seed, 200) {
            assert!(is_number_tuple(&l), "{l:?}");
        }
    }
}

/// `(`, numbers of 1-2 digits separated by commas, `)`.
fn is_number_tuple(s: &str) -> bool {
    let Some(inner) = s.strip_prefix('(').and_then(|s| s.strip_suffix(')')) else {
        return false;
    };
    inner
        .split(',')
        .all(|n| (1..=2).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit()))
}

#[test]
fn bad_grammars_are_refused_with_a_reason() {
    let (_dir, _tok, compiler) = tokenizer(Family::Qwen3);
    for g in [
        Grammar::JsonSchema("{\"type\": \"objekt\"}".into()),
        Grammar::JsonSchema("[1]".into()),
        Grammar::Regex("(unclosed".into()),
        Grammar::Lark("start: undefined_rule".into()),
        Grammar::Choice(vec![]),
    ] {
        let e = compiler
            .compile(&g)
            .err()
            .unwrap_or_else(|| panic!("{g:?} compiled"));
        assert!(!e.0.is_empty());
    }
}

#[test]
fn a_dead_end_ends_the_sequence() {
    let (_dir, tok, compiler) = tokenizer(Family::Qwen3);
    let mut c = compiler
        .compile(&Grammar::Choice(vec!["ab".into()]))
        .unwrap();
    let ids = tok.hf().encode("ab", false).unwrap().get_ids().to_vec();
    for &t in &ids {
        assert!(c.allowed().unwrap().contains(t));
        c.commit(t);
    }
    // Complete: only the end is left, or nothing at all.
    match c.allowed() {
        None => {}
        Some(a) => assert!((0..VOCAB as u32)
            .filter(|&t| a.contains(t))
            .all(|t| c.is_end(t))),
    }
}
