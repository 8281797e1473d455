//! Every path through the allowed tokens spells valid output: random walks
//! (a stand-in for a model with random weights) over real tokenizers of
//! two styles (byte-level BPE, SentencePiece with byte fallback) end
//! within their budget, and their text validates against the schema.

use engine_core::Grammar;
use fixtures::Family;
use grammar::{CallRule, Compiler};
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

/// The sets along a draft equal the sets met by committing it token by
/// token, stop at the first token the grammar rejects, and leave the state
/// where it was.
#[test]
fn allowed_along_a_draft_matches_stepping_through_it() {
    let g = Grammar::Regex("(ab|cd)[0-9]{2}".into());
    let (_dir, tok, compiler) = tokenizer(Family::Qwen3);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let bools = |a: &Option<grammar::Allowed>| a.as_ref().map(|a| a.to_bools(VOCAB));
    for _ in 0..20 {
        // A valid walk to its end, then a wrong token spliced in.
        let mut stepper = compiler.compile(&g).unwrap();
        let mut path = Vec::new();
        let mut expected = Vec::new();
        loop {
            let allowed = stepper.allowed();
            expected.push(bools(&allowed));
            let Some(allowed) = allowed else { break };
            let ids: Vec<u32> = (0..VOCAB as u32)
                .filter(|&t| allowed.contains(t) && !stepper.is_end(t))
                .collect();
            if ids.is_empty() {
                break;
            }
            let t = ids[rng.random_range(0..ids.len())];
            path.push(t);
            if !stepper.commit(t) {
                expected.push(None);
                break;
            }
        }
        let mut c = compiler.compile(&g).unwrap();
        let before = bools(&c.allowed());
        let sets: Vec<_> = c.allowed_along(&path).iter().map(bools).collect();
        assert_eq!(sets, expected, "{:?}", tok.decode(&path, false));
        assert_eq!(bools(&c.allowed()), before, "the state moved");
        // A rejected token cuts the draft there.
        let cut = rng.random_range(0..path.len());
        let mut wrong = path.clone();
        wrong[cut] = tok.encode("zz", false).unwrap()[0];
        assert_eq!(c.allowed_along(&wrong).len(), cut + 1);
    }
}

/// Commits `tokens`, asserting each is allowed.
fn follow(c: &mut grammar::Constraint, tokens: &[u32], what: &str) {
    for &t in tokens {
        let allowed = c.allowed().unwrap_or_else(|| panic!("{what}: ended early"));
        assert!(
            allowed.contains(t) && !c.is_end(t),
            "{what}: token {t} refused"
        );
        assert!(c.commit(t), "{what}: stopped at {t}");
    }
}

fn allowed_set(c: &mut grammar::Constraint) -> Vec<bool> {
    c.allowed().expect("not complete").to_bools(VOCAB)
}

/// Reasoning is free text up to the close tag, a text tag (Qwen's
/// `</think>`) or a special token (Gemma's channel tokens; here
/// `<start_of_turn>` stands in); then the answer's grammar applies from
/// its start. With an open tag the block may be skipped; without one (the
/// prompt opened it) the answer waits for the close tag.
#[test]
fn reasoning_is_free_and_the_answer_follows_the_grammar() {
    let answer = Grammar::Regex("[0-9]{3}".into());
    for (family, open, close) in [
        (Family::Qwen3, "<think>", "</think>"),
        (Family::Gemma3, "<mask>", "<start_of_turn>"),
    ] {
        let (_dir, tok, compiler) = tokenizer(family);
        let ids = |s: &str| tok.hf().encode(s, false).unwrap().get_ids().to_vec();
        let plain = allowed_set(&mut compiler.compile(&answer).unwrap());
        let wrapped = |open: Option<&str>| Grammar::AfterReasoning {
            open: open.map(str::to_owned),
            close: close.to_owned(),
            then: Box::new(answer.clone()),
        };
        let thought = ids("\nLet me think: {\"a\": 1} <b> x7\n");

        let mut c = compiler.compile(&wrapped(Some(open))).unwrap();
        // The answer may start at once, or the block opens.
        let first = allowed_set(&mut c);
        assert!(
            plain.iter().zip(&first).all(|(p, f)| !p || *f),
            "{family:?}"
        );
        follow(&mut c, &ids(open), "open");
        // Inside: text the answer's grammar would refuse, but not the end.
        let inside = c.allowed().unwrap();
        assert!(tok.eos_token_id().is_some_and(|e| !inside.contains(e)));
        follow(&mut c, &thought, "reasoning");
        follow(&mut c, &ids(close), "close");
        assert_eq!(allowed_set(&mut c), plain, "{family:?}: after the block");
        follow(&mut c, &ids("12"), "answer");
        let last = ids("3")[0];
        assert!(c.allowed().unwrap().contains(last));
        assert!(!c.commit(last), "{family:?}: the answer is complete");

        // Opened by the prompt: no answer before the close tag.
        let mut c = compiler.compile(&wrapped(None)).unwrap();
        let digit = ids("1")[0];
        assert!(
            c.allowed().unwrap().contains(digit),
            "digits are reasoning text too"
        );
        follow(&mut c, &thought, "reasoning");
        follow(&mut c, &ids(close), "close");
        assert_eq!(allowed_set(&mut c), plain, "{family:?}: after the block");

        // A continued grammar starts where its tokens left it.
        let mut generated = ids(open);
        generated.extend(&thought);
        let mut continued = compiler
            .compile(&Grammar::Continued {
                grammar: Box::new(wrapped(Some(open))),
                generated: generated.clone(),
            })
            .unwrap();
        follow(&mut continued, &ids(close), "continued close");
        assert_eq!(allowed_set(&mut continued), plain);
        generated.extend(ids("x"));
        generated.extend(ids(close));
        generated.extend(ids("x"));
        let refused = compiler.compile(&Grammar::Continued {
            grammar: Box::new(wrapped(Some(open))),
            generated,
        });
        assert!(
            refused.is_err(),
            "{family:?}: an answer off the grammar resumed"
        );
    }
}
/// A forced tool call's grammar, in each family's format: every walk that
/// ends parses as calls (and nothing else), arguments valid against the
/// tool's parameters; one call unless `many`.
#[test]
fn forced_tool_calls_parse_with_valid_arguments() {
    use text::tools::{parse_complete, ToolFormat};
    let weather = json!({
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": false
    });
    let validator = jsonschema::validator_for(&weather).unwrap();
    let tools = vec![
        ("get_weather".to_owned(), weather.clone()),
        (
            "ping".to_owned(),
            json!({"type": "object", "properties": {}, "additionalProperties": false}),
        ),
    ];
    let (_dir, tok, compiler) = tokenizer(Family::Qwen3);
    for format in [
        ToolFormat::Hermes,
        ToolFormat::Llama3Json,
        ToolFormat::Gemma,
    ] {
        for (many, budget) in [(false, 400), (true, 3000)] {
            let g = compiler.tool_calls(
                format,
                &tools,
                CallRule {
                    forced: true,
                    parallel: many,
                },
            );
            let mut ended = 0;
            for seed in 0..10 {
                let Some(text) = walk(&compiler, &tok, &g, seed, budget) else {
                    assert!(many, "{format:?}: one call did not end: seed {seed}");
                    continue;
                };
                ended += 1;
                let (content, calls) = parse_complete(format, &text);
                assert!(
                    content.trim().is_empty(),
                    "{format:?}: {text:?} left {content:?}"
                );
                assert!(
                    !calls.is_empty() && (many || calls.len() == 1),
                    "{format:?}: {text:?}"
                );
                for call in calls {
                    let args: Value = serde_json::from_str(&call.arguments).unwrap();
                    match call.name.as_str() {
                        "get_weather" => assert!(validator.is_valid(&args), "{text}"),
                        "ping" => assert_eq!(args, json!({})),
                        other => panic!("{other}"),
                    }
                }
            }
            assert!(ended > 0, "{format:?}: no walk ended");
        }
    }
}

/// `tool_choice: "auto"`: free text, or calls from the moment one starts.
/// Every walk's text parses as the family's parser reads it: calls with
/// valid arguments (one unless parallel), and content that holds no call
/// the parser gave up on. Both kinds of output occur.
#[test]
fn optional_tool_calls_are_held_to_their_schema_once_they_start() {
    use text::tools::{parse_complete, ToolFormat};
    let weather = json!({
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": false
    });
    let validator = jsonschema::validator_for(&weather).unwrap();
    let tools = vec![("get_weather".to_owned(), weather.clone())];
    let (_dir, tok, compiler) = tokenizer(Family::Qwen3);
    for format in [
        ToolFormat::Hermes,
        ToolFormat::Llama3Json,
        ToolFormat::Gemma,
    ] {
        for parallel in [false, true] {
            let g = compiler.tool_calls(
                format,
                &tools,
                CallRule {
                    forced: false,
                    parallel,
                },
            );
            let (mut texts, mut calls_seen) = (0, 0);
            // Walks start from a prefix, as a model would choose it: plain
            // text, or the first bytes of a call.
            let opening = match format.tags() {
                Some(tags) => format!("Sure. {}\n", tags.open),
                None => "{".to_owned(),
            };
            for (seed, prefix) in (0..24).map(|s| {
                (
                    s,
                    if s % 2 == 0 {
                        "Hi there"
                    } else {
                        opening.as_str()
                    },
                )
            }) {
                let prefix_ids = tok.encode_completion(prefix).unwrap();
                let Some(text) = walk_from(&compiler, &tok, &g, &prefix_ids, seed, 600) else {
                    continue;
                };
                let (content, calls) = parse_complete(format, &text);
                if let Some(tags) = format.tags() {
                    assert!(!content.contains(tags.open), "{format:?}: {text:?}");
                }
                assert!(parallel || calls.len() <= 1, "{format:?}: {text:?}");
                if calls.is_empty() {
                    texts += 1;
                } else {
                    calls_seen += 1;
                }
                for call in calls {
                    assert_eq!(call.name, "get_weather");
                    let args: Value = serde_json::from_str(&call.arguments).unwrap();
                    assert!(validator.is_valid(&args), "{format:?}: {text}");
                }
            }
            assert!(
                texts > 0 && calls_seen > 0,
                "{format:?}: {texts} texts, {calls_seen} calls"
            );
        }
    }
}

/// `walk` after forcing `prefix` through the grammar (which must accept it).
fn walk_from(
    compiler: &Compiler,
    tok: &text::Tokenizer,
    g: &Grammar,
    prefix: &[u32],
    seed: u64,
    budget: usize,
) -> Option<String> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut c = compiler.compile(g).unwrap();
    let mut out = Vec::new();
    for &t in prefix {
        assert!(
            c.allowed().is_some_and(|a| a.contains(t)),
            "{:?} refused after {:?}",
            tok.decode(&[t], false),
            tok.decode(&out, false)
        );
        out.push(t);
        c.commit(t);
    }
    for _ in 0..budget {
        let Some(allowed) = c.allowed() else {
            return Some(tok.decode(&out, false).unwrap());
        };
        let ids: Vec<u32> = (0..VOCAB as u32).filter(|&t| allowed.contains(t)).collect();
        let t = ids[rng.random_range(0..ids.len())];
        if c.is_end(t) {
            return Some(tok.decode(&out, false).unwrap());
        }
        out.push(t);
        if !c.commit(t) {
            return Some(tok.decode(&out, false).unwrap());
        }
    }
    None
}

/// A schema llguidance cannot compile is named down to the subschema.
#[test]
fn schema_errors_name_the_subschema() {
    let (_dir, _tok, compiler) = tokenizer(Family::Qwen3);
    let ok =
        json!({"type": "object", "properties": {"when": {"type": "string", "format": "date"}}});
    assert!(compiler.check_schema(&ok).is_ok());
    let bad = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "place": {"$ref": "#/$defs/Place"}
        },
        "$defs": {"Place": {"type": "object", "properties": {"zip": {"type": "string", "format": "zip-code"}}}}
    });
    let e = compiler.check_schema(&bad).unwrap_err();
    assert_eq!(e.pointer, "/$defs/Place/properties/zip");
    assert!(e.message.contains("zip-code"), "{e}");
}
