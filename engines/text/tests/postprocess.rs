//! Stop strings, reasoning split and tool-call parsing over streamed text:
//! however the text is cut into chunks, the result must be the one for a
//! single chunk, and no input may panic.

use std::fmt::Debug;

use text::reasoning::{ReasoningCounts, ReasoningFormat, ReasoningParser, Segment};
use text::stop::StopMatcher;
use text::tools::{parse_complete, ToolEvent, ToolFormat, ToolParser};

// ---------------------------------------------------------------- harness --

/// Byte offsets where a `&str` may be cut: every char boundary, both ends.
fn cut_points(text: &str) -> Vec<usize> {
    text.char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .collect()
}

/// Runs `run` on the whole text, then on every split into two and into three
/// chunks (empty chunks included), and asserts they all agree.
fn assert_chunk_invariant<T: PartialEq + Debug>(text: &str, run: impl Fn(&[&str]) -> T) -> T {
    let whole = run(&[text]);
    let cuts = cut_points(text);
    for &i in &cuts {
        let got = run(&[&text[..i], &text[i..]]);
        assert_eq!(got, whole, "two chunks cut at {i} of {text:?}");
    }
    for (n, &i) in cuts.iter().enumerate() {
        for &j in &cuts[n..] {
            let got = run(&[&text[..i], &text[i..j], &text[j..]]);
            assert_eq!(got, whole, "three chunks cut at {i},{j} of {text:?}");
        }
    }
    whole
}

/// Deterministic xorshift64* so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Random chunking of `text` at char boundaries.
    fn chunks<'a>(&mut self, text: &'a str) -> Vec<&'a str> {
        let cuts = cut_points(text);
        let mut at: Vec<usize> = (0..self.below(6))
            .map(|_| cuts[self.below(cuts.len())])
            .collect();
        at.push(0);
        at.push(text.len());
        at.sort();
        at.windows(2).map(|w| &text[w[0]..w[1]]).collect()
    }
}

// ------------------------------------------------------------ normalizers --

fn run_stops(stops: &[&str], chunks: &[&str]) -> (String, bool) {
    let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
    let mut m = StopMatcher::new(&stops);
    let mut out = String::new();
    let mut stopped = false;
    for c in chunks {
        let step = m.push(c);
        assert!(
            !stopped || (step.text.is_empty() && step.stopped),
            "text after a stop"
        );
        out.push_str(&step.text);
        stopped |= step.stopped;
    }
    let rest = m.finish();
    assert!(!stopped || rest.is_empty());
    out.push_str(&rest);
    (out, stopped)
}

/// Brute force: the first position where some stop has just been completed.
fn reference_stop(stops: &[&str], text: &str) -> (String, bool) {
    for end in cut_points(text) {
        let done = stops
            .iter()
            .filter(|s| !s.is_empty() && text[..end].ends_with(**s));
        if let Some(longest) = done.max_by_key(|s| s.len()) {
            return (text[..end - longest.len()].to_owned(), true);
        }
    }
    (text.to_owned(), false)
}

fn merge_segments(out: &mut Vec<Segment>, segs: Vec<Segment>) {
    for seg in segs {
        assert!(!seg.text().is_empty(), "empty segment");
        match (out.last_mut(), seg) {
            (Some(Segment::Reasoning(a)), Segment::Reasoning(b)) => a.push_str(&b),
            (Some(Segment::Content(a)), Segment::Content(b)) => a.push_str(&b),
            (_, seg) => out.push(seg),
        }
    }
}

fn run_reasoning(
    format: ReasoningFormat,
    start: bool,
    chunks: &[&str],
) -> (Vec<Segment>, ReasoningCounts) {
    let mut p = ReasoningParser::new(format, start);
    let mut out = Vec::new();
    for c in chunks {
        let segs = p.push(c);
        for w in segs.windows(2) {
            assert_ne!(
                std::mem::discriminant(&w[0]),
                std::mem::discriminant(&w[1]),
                "unmerged"
            );
        }
        merge_segments(&mut out, segs);
    }
    merge_segments(&mut out, p.finish());
    let n = p.counts();
    let total: usize = chunks.iter().map(|c| c.len()).sum();
    assert_eq!(
        n.reasoning_bytes + n.content_bytes + n.tag_bytes + n.trimmed_bytes,
        total
    );
    (out, n)
}

/// Brute force over the whole text: at each position the longest tag that
/// starts there, else one char; whitespace after a kind switch is dropped.
fn reference_reasoning(format: ReasoningFormat, start: bool, text: &str) -> Vec<Segment> {
    let tags = format.tags();
    let mut in_reasoning = start && format != ReasoningFormat::None;
    let mut trim = in_reasoning;
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        let opens = tags.open.iter().map(|t| (*t, true));
        let hit = opens
            .chain(tags.close.iter().map(|t| (*t, false)))
            .filter(|(t, _)| rest.starts_with(t))
            .max_by_key(|(t, _)| t.len());
        if let Some((tag, opens)) = hit {
            i += tag.len();
            if opens != in_reasoning {
                in_reasoning = opens;
                trim = true;
            }
            continue;
        }
        let ch = rest.chars().next().unwrap();
        i += ch.len_utf8();
        if trim && ch.is_whitespace() {
            continue;
        }
        trim = false;
        let seg = if in_reasoning {
            Segment::Reasoning(ch.into())
        } else {
            Segment::Content(ch.into())
        };
        merge_segments(&mut out, vec![seg]);
    }
    out
}

/// Tool events with ids checked and blanked (they are unique per call).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ev {
    Content(String),
    Call(String, String),
    Unterminated(String),
}

fn merge_events(out: &mut Vec<Ev>, events: Vec<ToolEvent>) {
    for e in events {
        match (out.last_mut(), e) {
            (_, ToolEvent::Content(t)) if t.is_empty() => panic!("empty content event"),
            (Some(Ev::Content(a)), ToolEvent::Content(b)) => a.push_str(&b),
            (_, ToolEvent::Content(b)) => out.push(Ev::Content(b)),
            (_, ToolEvent::Call(c)) => {
                assert!(c.id.starts_with("call_") && c.id.len() > 5, "id {:?}", c.id);
                out.push(Ev::Call(c.name, c.arguments));
            }
        }
    }
}

fn run_tools(format: ToolFormat, chunks: &[&str]) -> Vec<Ev> {
    let mut p = ToolParser::new(format);
    let mut out = Vec::new();
    for c in chunks {
        let events = p.push(c);
        for w in events.windows(2) {
            assert!(
                !matches!(w, [ToolEvent::Content(_), ToolEvent::Content(_)]),
                "unmerged"
            );
        }
        merge_events(&mut out, events);
    }
    match p.finish() {
        Ok(events) => merge_events(&mut out, events),
        Err(e) => out.push(Ev::Unterminated(e.into_raw())),
    }
    out
}

fn r(s: &str) -> Segment {
    Segment::Reasoning(s.into())
}
fn c(s: &str) -> Segment {
    Segment::Content(s.into())
}
fn content(s: &str) -> Ev {
    Ev::Content(s.into())
}
fn call(name: &str, args: &str) -> Ev {
    Ev::Call(name.into(), args.into())
}

// ------------------------------------------------------------------ stops --

#[test]
fn stops_are_chunk_invariant_and_match_the_reference() {
    let cases: &[(&[&str], &str)] = &[
        (&["STOP"], "Hello wörld, STOP right there"),
        (&["STOP"], "no stop in this text, only ST and STO"),
        (&["abcd", "bc"], "xxabcd"),
        (&["abc", "b"], "xabc"),
        (&["aab", "ab"], "aaab tail"),
        (&["ab", "abab"], "zzabab"),
        (&["\u{e9}!", "\u{e9}"], "caf\u{e9}! au lait"),
        (&["😀x"], "smile 😀😀x!"),
        (&["日本語"], "日本日本語です"),
        (&["<|im_end|>", "\n\nUser:"], "answer\n\nUser: next"),
        (&["start"], "start of text"),
        (&["end"], "text at the end"),
        (&["", "x"], "a x b"),
        (&["", ""], "nothing stops this"),
    ];
    for (stops, text) in cases {
        let got = assert_chunk_invariant(text, |chunks| run_stops(stops, chunks));
        assert_eq!(
            got,
            reference_stop(stops, text),
            "stops {stops:?} on {text:?}"
        );
    }
}

#[test]
fn stop_examples() {
    assert_eq!(run_stops(&["abc", "b"], &["xabc"]), ("xa".into(), true));
    assert_eq!(
        run_stops(&["abcd", "bc"], &["xxabcd"]),
        ("xxa".into(), true)
    );
    assert_eq!(run_stops(&["STOP"], &["a ST", "OP b"]), ("a ".into(), true));
    assert_eq!(
        run_stops(&["STOP"], &["a ST", "OX b"]),
        ("a STOX b".into(), false)
    );
}

// -------------------------------------------------------------- reasoning --

#[test]
fn think_format_is_chunk_invariant() {
    let cases: &[(bool, &str, &[Segment])] = &[
        (
            false,
            "<think>\nLet me think… 日本</think>\n\nThe answer is 42 😀",
            &[r("Let me think… 日本"), c("The answer is 42 😀")],
        ),
        (
            true,
            "\nprompt opened it é</think>\n\nanswer",
            &[r("prompt opened it é"), c("answer")],
        ),
        (
            false,
            "a<think>b</think>c<think>d</think>e",
            &[c("a"), r("b"), c("c"), r("d"), c("e")],
        ),
        (false, "stray</think>\nclose", &[c("stray\nclose")]),
        (
            false,
            "<think>x<think>nested</think>y",
            &[r("xnested"), c("y")],
        ),
        (false, "<think></think>", &[]),
        (false, "answer then <think>", &[c("answer then ")]),
        (false, "answer </th", &[c("answer </th")]),
        (false, "<think>unclosed <thi", &[r("unclosed <thi")]),
        (false, "<<think>>é</think></think>", &[c("<"), r(">é")]),
        (
            false,
            "<thinking> is not a tag",
            &[c("<thinking> is not a tag")],
        ),
    ];
    for (start, text, want) in cases {
        let (got, _) = assert_chunk_invariant(text, |chunks| {
            run_reasoning(ReasoningFormat::Think, *start, chunks)
        });
        assert_eq!(got, *want, "{text:?}");
        assert_eq!(
            got,
            reference_reasoning(ReasoningFormat::Think, *start, text)
        );
    }
}

#[test]
fn gemma_channel_is_chunk_invariant() {
    let cases: &[(&str, &[Segment])] = &[
        (
            "<|channel>thought\nplan é 😀<channel|>Final ü",
            &[r("plan é 😀"), c("Final ü")],
        ),
        ("<|channel>bare<channel|>y", &[r("bare"), c("y")]),
        ("<|channel>thoughtless<channel|>y", &[r("less"), c("y")]),
        (
            "<|channel>thought\n<channel|>only answer",
            &[c("only answer")],
        ),
        ("<|channel>though", &[r("though")]),
        ("answer<|chan", &[c("answer<|chan")]),
        ("<channel|>stray", &[c("stray")]),
        ("<think>not gemma</think>", &[c("<think>not gemma</think>")]),
    ];
    for (text, want) in cases {
        let (got, _) = assert_chunk_invariant(text, |chunks| {
            run_reasoning(ReasoningFormat::GemmaChannel, false, chunks)
        });
        assert_eq!(got, *want, "{text:?}");
        assert_eq!(
            got,
            reference_reasoning(ReasoningFormat::GemmaChannel, false, text)
        );
    }
}

#[test]
fn reasoning_counts_separate_tags_from_text() {
    let text = "<|channel>thought\nab<channel|>\ncd";
    let (_, n) = run_reasoning(ReasoningFormat::GemmaChannel, false, &[text]);
    assert_eq!(n.tags, 2);
    assert_eq!(n.tag_bytes, "<|channel>thought\n<channel|>".len());
    assert_eq!(
        (n.reasoning_bytes, n.content_bytes, n.trimmed_bytes),
        (2, 2, 1)
    );
}

// ------------------------------------------------------------------ tools --

#[test]
fn hermes_is_chunk_invariant() {
    let text = "Let me check 🌦.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>\n";
    let got = assert_chunk_invariant(text, |chunks| run_tools(ToolFormat::Hermes, chunks));
    assert_eq!(
        got,
        vec![
            content("Let me check 🌦.\n"),
            call("get_weather", r#"{"city":"Zürich"}"#),
            call("time", "{}")
        ]
    );

    let text =
        "<tool_call>{bad}</tool_call>é<tool_call>{\"name\":\"f\",\"arguments\":\"{}\"}</tool_call>";
    let got = assert_chunk_invariant(text, |chunks| run_tools(ToolFormat::Hermes, chunks));
    assert_eq!(
        got,
        vec![content("<tool_call>{bad}</tool_call>é"), call("f", "{}")]
    );

    let text = "text <tool_call>{\"name\": \"f\", \"argu";
    let got = assert_chunk_invariant(text, |chunks| run_tools(ToolFormat::Hermes, chunks));
    assert_eq!(
        got,
        vec![
            content("text "),
            Ev::Unterminated("<tool_call>{\"name\": \"f\", \"argu".into())
        ]
    );

    let text = "ends with a partial <tool_ca";
    let got = assert_chunk_invariant(text, |chunks| run_tools(ToolFormat::Hermes, chunks));
    assert_eq!(got, vec![content(text)]);
}

#[test]
fn gemma_tools_are_chunk_invariant() {
    let text =
        "On it.<|tool_call>call:get_weather{city:<|\"|>Zürich, 日本<|\"|>,days:2}<tool_call|>";
    let got = assert_chunk_invariant(text, |chunks| run_tools(ToolFormat::Gemma, chunks));
    assert_eq!(
        got,
        vec![
            content("On it."),
            call("get_weather", r#"{"city":"Zürich, 日本","days":2}"#)
        ]
    );

    let text = "<|tool_call>call:a{}<tool_call|><|tool_call>call:b{x:[1,{y:<|\"|>}<|\"|>}]}<tool_call|> done";
    let got = assert_chunk_invariant(text, |chunks| run_tools(ToolFormat::Gemma, chunks));
    assert_eq!(
        got,
        vec![
            call("a", "{}"),
            call("b", r#"{"x":[1,{"y":"}"}]}"#),
            content("done")
        ]
    );

    let text = "<|tool_call>call:broken{x:<tool_call|>";
    let got = assert_chunk_invariant(text, |chunks| run_tools(ToolFormat::Gemma, chunks));
    assert_eq!(got, vec![content(text)]);
}

#[test]
fn llama3_json_is_chunk_invariant() {
    let text = "  {\"name\": \"f\", \"parameters\": {\"x\": \"ü\"}}";
    let got = assert_chunk_invariant(text, |chunks| run_tools(ToolFormat::Llama3Json, chunks));
    assert_eq!(got, vec![call("f", r#"{"x":"ü"}"#)]);

    let text = "<|python_tag|>{\"name\": \"a\", \"arguments\": {}}; [{\"name\": \"b\", \"parameters\": {\"k\": 1}}]";
    let got = assert_chunk_invariant(text, |chunks| run_tools(ToolFormat::Llama3Json, chunks));
    assert_eq!(got, vec![call("a", "{}"), call("b", r#"{"k":1}"#)]);

    for text in [
        "Hi there, 😀 no tools",
        " <|pyth",
        "{\"just\": \"json\"}",
        "<|python_tag|>brave_search.call(q=1)",
    ] {
        let got = assert_chunk_invariant(text, |chunks| run_tools(ToolFormat::Llama3Json, chunks));
        assert_eq!(got, vec![content(text)], "{text:?}");
    }
}

#[test]
fn parse_complete_matches_streaming() {
    let text = "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n";
    let (body, calls) = parse_complete(ToolFormat::Hermes, text);
    assert_eq!(body, "Sure.");
    assert_eq!(calls.len(), 1);
    assert_eq!(
        (calls[0].name.as_str(), calls[0].arguments.as_str()),
        ("f", r#"{"a":1}"#)
    );
    // An unfinished call comes back as content rather than vanishing.
    let text = "x <tool_call>{\"name\"";
    assert_eq!(
        parse_complete(ToolFormat::Hermes, text),
        (text.to_owned(), vec![])
    );
}

// ------------------------------------------------------------------- fuzz --

const PIECES: &[&str] = &[
    "<think>",
    "</think>",
    "<|channel>thought\n",
    "<|channel>",
    "<channel|>",
    "thought",
    "<tool_call>",
    "</tool_call>",
    "<|tool_call>",
    "<tool_call|>",
    "<|python_tag|>",
    "<|\"|>",
    "call:",
    "{",
    "}",
    "[",
    "]",
    "\"name\"",
    "\"arguments\"",
    "\"parameters\"",
    ":",
    ",",
    ";",
    "\"f\"",
    "1",
    "é",
    "😀",
    "日",
    " ",
    "\n",
    "a",
    "<",
    "|",
    ">",
    "/",
    "\\",
    "\"",
    "<function=",
    "<parameter=",
    "</parameter>",
    "</function>",
];

fn random_text(rng: &mut Rng) -> String {
    if rng.below(4) == 0 {
        let bytes: Vec<u8> = (0..rng.below(40)).map(|_| rng.next() as u8).collect();
        return String::from_utf8_lossy(&bytes).into_owned();
    }
    (0..rng.below(30))
        .map(|_| PIECES[rng.below(PIECES.len())])
        .collect()
}

#[test]
fn fuzz_random_chunkings_agree_and_never_panic() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..3000 {
        let text = random_text(&mut rng);
        let stops: Vec<&str> = (0..rng.below(3))
            .map(|_| PIECES[rng.below(PIECES.len())])
            .collect();
        let start = rng.below(2) == 0;
        let whole_stop = run_stops(&stops, &[&text]);
        assert_eq!(
            whole_stop,
            reference_stop(&stops, &text),
            "stops {stops:?} on {text:?}"
        );
        let whole_reasoning: Vec<_> = [
            ReasoningFormat::None,
            ReasoningFormat::Think,
            ReasoningFormat::GemmaChannel,
        ]
        .into_iter()
        .map(|f| (f, run_reasoning(f, start, &[&text])))
        .collect();
        for (f, (segments, _)) in &whole_reasoning {
            assert_eq!(
                segments,
                &reference_reasoning(*f, start, &text),
                "{f:?} {start} {text:?}"
            );
        }
        let whole_tools: Vec<_> = [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Gemma,
        ]
        .into_iter()
        .map(|f| (f, run_tools(f, &[&text])))
        .collect();
        for (_, events) in &whole_tools {
            // Without a call, every byte comes back as content (or as the raw
            // text of an unfinished call).
            if !events.iter().any(|e| matches!(e, Ev::Call(..))) {
                let back: String = events
                    .iter()
                    .map(|e| match e {
                        Ev::Content(t) | Ev::Unterminated(t) => t.as_str(),
                        Ev::Call(..) => unreachable!(),
                    })
                    .collect();
                assert_eq!(back, text);
            }
        }
        for _ in 0..3 {
            let chunks = rng.chunks(&text);
            assert_eq!(run_stops(&stops, &chunks), whole_stop, "{chunks:?}");
            for (f, whole) in &whole_reasoning {
                assert_eq!(
                    &run_reasoning(*f, start, &chunks),
                    whole,
                    "{f:?} {chunks:?}"
                );
            }
            for (f, whole) in &whole_tools {
                assert_eq!(&run_tools(*f, &chunks), whole, "{f:?} {chunks:?}");
            }
        }
    }
}

/// Well-formed documents (content, reasoning blocks, calls in every format)
/// with noise, so the call paths get fuzzed too, not only the error paths.
fn random_document(rng: &mut Rng) -> String {
    const PARTS: &[&str] = &[
        "Sure, é 😀 ",
        "\n",
        "<think>\nhmm 日本</think>\n\n",
        "<|channel>thought\nplan<channel|>",
        "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"k\": \"v ü\"}}\n</tool_call>\n",
        "<tool_call>{\"name\": \"s\", \"arguments\": \"{}\"}</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        "<|tool_call>call:g{a:<|\"|>x, y<|\"|>,b:[1,2]}<tool_call|>",
        "{\"name\": \"l\", \"parameters\": {\"n\": 1}}",
        "<|python_tag|>",
        "<",
        "STOP",
    ];
    (0..1 + rng.below(6))
        .map(|_| PARTS[rng.below(PARTS.len())])
        .collect()
}

#[test]
fn fuzz_documents_with_calls_agree_across_chunkings() {
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    let mut calls_seen = 0;
    for _ in 0..1500 {
        let text = random_document(&mut rng);
        for f in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Gemma,
        ] {
            let whole = run_tools(f, &[&text]);
            calls_seen += whole.iter().filter(|e| matches!(e, Ev::Call(..))).count();
            for _ in 0..3 {
                let chunks = rng.chunks(&text);
                assert_eq!(run_tools(f, &chunks), whole, "{f:?} {chunks:?}");
            }
        }
        for f in [ReasoningFormat::Think, ReasoningFormat::GemmaChannel] {
            let whole = run_reasoning(f, false, &[&text]);
            assert_eq!(whole.0, reference_reasoning(f, false, &text));
            let chunks = rng.chunks(&text);
            assert_eq!(run_reasoning(f, false, &chunks), whole);
        }
        let chunks = rng.chunks(&text);
        assert_eq!(
            run_stops(&["STOP", "</"], &chunks),
            reference_stop(&["STOP", "</"], &text)
        );
    }
    assert!(
        calls_seen > 1000,
        "only {calls_seen} calls: the generator lost its bite"
    );
}

/// One-char chunks over long texts: per-chunk work must not grow with the
/// text (a quadratic parser would not finish here).
#[test]
fn long_streams_in_tiny_chunks_stay_linear() {
    let long = "é 😀 a<b ".repeat(40_000);
    let call =
        format!("<tool_call>{{\"name\": \"f\", \"arguments\": {{\"s\": \"{long}\"}}}}</tool_call>");
    let chars: Vec<&str> = call
        .char_indices()
        .map(|(i, c)| &call[i..i + c.len_utf8()])
        .collect();

    let mut tools = ToolParser::new(ToolFormat::Hermes);
    let mut n_calls = 0;
    for c in &chars {
        n_calls += tools
            .push(c)
            .iter()
            .filter(|e| matches!(e, ToolEvent::Call(_)))
            .count();
    }
    assert_eq!(n_calls, 1);

    let spaces = " ".repeat(200_000);
    let mut llama = ToolParser::new(ToolFormat::Llama3Json);
    for i in 0..spaces.len() {
        assert!(llama.push(&spaces[i..i + 1]).is_empty());
    }
    assert_eq!(
        llama.finish().unwrap(),
        vec![ToolEvent::Content(spaces.clone())]
    );

    let mut reasoning = ReasoningParser::new(ReasoningFormat::GemmaChannel, true);
    let mut stop = StopMatcher::new(&["<never-appears-in-this-text>".to_string()]);
    let mut emitted = 0;
    for c in &chars {
        emitted += reasoning
            .push(c)
            .iter()
            .map(|s| s.text().len())
            .sum::<usize>();
        emitted += stop.push(c).text.len();
    }
    emitted += stop.finish().len();
    emitted += reasoning
        .finish()
        .iter()
        .map(|s| s.text().len())
        .sum::<usize>();
    assert_eq!(emitted, 2 * call.len());
}
