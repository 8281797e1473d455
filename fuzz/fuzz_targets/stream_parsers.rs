//! Any text, cut into chunks at any points, through the streaming
//! reasoning splitter and tool-call parser of every format: no panic, and
//! nothing is lost (what goes in comes out as content, reasoning or calls).
#![no_main]

use libfuzzer_sys::fuzz_target;
use text::reasoning::{ReasoningFormat, ReasoningParser};
use text::stop::StopMatcher;
use text::tools::{ToolEvent, ToolFormat, ToolParser};

fn chunks<'a>(text: &'a str, cuts: &[u8]) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = text;
    for cut in cuts {
        if rest.is_empty() {
            break;
        }
        let mut at = (*cut as usize % 8 + 1).min(rest.len());
        while !rest.is_char_boundary(at) {
            at += 1;
        }
        let (head, tail) = rest.split_at(at);
        out.push(head);
        rest = tail;
    }
    if !rest.is_empty() {
        out.push(rest);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let (cuts, text) = data.split_at(4);
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let pieces = chunks(text, cuts);
    for format in [
        ReasoningFormat::None,
        ReasoningFormat::Think,
        ReasoningFormat::GemmaChannel,
    ] {
        for starts_in in [false, true] {
            let mut parser = ReasoningParser::new(format, starts_in);
            let mut out = 0;
            for piece in &pieces {
                out += parser.push(piece).iter().map(|s| s.text().len()).sum::<usize>();
            }
            out += parser.finish().iter().map(|s| s.text().len()).sum::<usize>();
            assert!(out <= text.len());
        }
    }
    for format in [ToolFormat::Hermes, ToolFormat::Llama3Json, ToolFormat::Gemma] {
        let mut parser = ToolParser::new(format);
        let mut content = String::new();
        for piece in &pieces {
            for event in parser.push(piece) {
                if let ToolEvent::Content(t) = event {
                    content.push_str(&t);
                }
            }
        }
        match parser.finish() {
            Ok(events) => {
                for event in events {
                    if let ToolEvent::Content(t) = event {
                        content.push_str(&t);
                    }
                }
            }
            Err(unfinished) => content.push_str(unfinished.raw()),
        }
        let _ = text::tools::parse_complete(format, text);
    }
    let stops: Vec<String> = pieces.iter().take(2).map(|s| s.to_string()).collect();
    let mut matcher = StopMatcher::new(&stops);
    let mut passed = String::new();
    for piece in &pieces {
        let step = matcher.push(piece);
        passed.push_str(&step.text);
        if step.stopped {
            break;
        }
    }
    if !matcher.is_stopped() {
        passed.push_str(&matcher.finish());
        assert_eq!(passed, text, "text without a stop match comes through whole");
    }
});
