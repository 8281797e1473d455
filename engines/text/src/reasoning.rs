//! Splits generated text into reasoning and content (`reasoning_content` vs
//! `content` on the wire), chunk by chunk, with tags that may straddle chunks.
//!
//! Rules, the same for every format:
//! - An open tag switches to reasoning, a close tag to content; tags are
//!   never emitted. An open tag inside reasoning or a close tag inside
//!   content (a "stray" tag, e.g. `</think>` when the prompt already opened
//!   `<think>` but the caller did not say so) is dropped and changes nothing:
//!   streamed text cannot be taken back, and dropping keeps tag text out of
//!   the answer.
//! - Whitespace right after a tag that switches kind (and at the start, when
//!   starting in reasoning) is dropped: models write `</think>\n\n` as
//!   layout, not content.
//! - Only a tail that could still become a tag is held back; `finish` releases
//!   it as text of the current kind.

use crate::stop::{Lexed, TagLexer};

/// Which tag pair a model uses for its thinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReasoningFormat {
    /// No reasoning split: everything is content.
    None,
    /// `<think>` ... `</think>` (Qwen3, DeepSeek-R1, QwQ).
    Think,
    /// Gemma 4's thought channel: `<|channel>thought\n` ... `<channel|>`.
    GemmaChannel,
}

/// The literal tags of a format. Several spellings may open (or close); when
/// one is a prefix of another the longest match wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReasoningTags {
    pub open: &'static [&'static str],
    pub close: &'static [&'static str],
}

const NO_TAGS: ReasoningTags = ReasoningTags {
    open: &[],
    close: &[],
};

const THINK_TAGS: ReasoningTags = ReasoningTags {
    open: &["<think>"],
    close: &["</think>"],
};

// Gemma 4 opens the channel with the `<|channel>` token followed by the
// channel name `thought` and a newline; the shorter spellings keep a model
// that skips the name or newline from leaking them into reasoning text.
const GEMMA_CHANNEL_TAGS: ReasoningTags = ReasoningTags {
    open: &["<|channel>thought\n", "<|channel>thought", "<|channel>"],
    close: &["<channel|>"],
};

impl ReasoningFormat {
    pub fn tags(self) -> ReasoningTags {
        match self {
            ReasoningFormat::None => NO_TAGS,
            ReasoningFormat::Think => THINK_TAGS,
            ReasoningFormat::GemmaChannel => GEMMA_CHANNEL_TAGS,
        }
    }
}

/// A run of text of one kind. A `push` never returns two adjacent segments
/// of the same kind, nor an empty one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Reasoning(String),
    Content(String),
}

impl Segment {
    pub fn text(&self) -> &str {
        match self {
            Segment::Reasoning(t) | Segment::Content(t) => t,
        }
    }
}

/// Text-level accounting, in bytes of generated text, so the caller can tell
/// tag text from content (e.g. when counting or tokenizing for usage).
/// The four byte counts add up to everything pushed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReasoningCounts {
    pub reasoning_bytes: usize,
    pub content_bytes: usize,
    /// Bytes of tag text consumed (including stray tags).
    pub tag_bytes: usize,
    /// Whitespace dropped right after tags that switch kind.
    pub trimmed_bytes: usize,
    /// Number of tags consumed.
    pub tags: usize,
}

/// The streaming reasoning/content splitter.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    format: ReasoningFormat,
    /// Open tags first, then close tags; `n_open` splits them.
    tags: Vec<&'static str>,
    n_open: usize,
    lexer: TagLexer,
    in_reasoning: bool,
    /// Just after a switch of kind: leading whitespace is layout, not text.
    trim_next: bool,
    counts: ReasoningCounts,
}

impl ReasoningParser {
    /// `starts_in_reasoning`: the prompt already opened the block (e.g. a
    /// chat template that ends with `<think>\n`), so text before the first
    /// close tag is reasoning.
    pub fn new(format: ReasoningFormat, starts_in_reasoning: bool) -> Self {
        let t = format.tags();
        let in_reasoning = starts_in_reasoning && format != ReasoningFormat::None;
        Self {
            format,
            tags: t.open.iter().chain(t.close).copied().collect(),
            n_open: t.open.len(),
            lexer: TagLexer::default(),
            in_reasoning,
            trim_next: in_reasoning,
            counts: ReasoningCounts::default(),
        }
    }

    pub fn push(&mut self, chunk: &str) -> Vec<Segment> {
        let mut out = Vec::new();
        if self.format == ReasoningFormat::None {
            self.emit(chunk.to_owned(), &mut out);
            return out;
        }
        self.lexer.push(chunk);
        self.drain(false, &mut out);
        out
    }

    /// Generation ended: a held-back partial tag is text of the current kind.
    pub fn finish(&mut self) -> Vec<Segment> {
        let mut out = Vec::new();
        self.drain(true, &mut out);
        out
    }

    fn drain(&mut self, at_end: bool, out: &mut Vec<Segment>) {
        while let Some(piece) = self.lexer.next(&self.tags, at_end) {
            match piece {
                Lexed::Text(text) => self.emit(text, out),
                Lexed::Tag(idx) => {
                    self.counts.tags += 1;
                    self.counts.tag_bytes += self.tags[idx].len();
                    let opens = idx < self.n_open;
                    // A stray tag changes nothing, so the text around it
                    // stays as written.
                    if opens != self.in_reasoning {
                        self.in_reasoning = opens;
                        self.trim_next = true;
                    }
                }
            }
        }
    }

    /// Whether text arriving now would be reasoning.
    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    pub fn counts(&self) -> ReasoningCounts {
        self.counts
    }

    fn emit(&mut self, mut text: String, out: &mut Vec<Segment>) {
        if self.trim_next {
            let keep = text.trim_start().len();
            self.counts.trimmed_bytes += text.len() - keep;
            text.drain(..text.len() - keep);
            if text.is_empty() {
                return;
            }
            self.trim_next = false;
        }
        if text.is_empty() {
            return;
        }
        if self.in_reasoning {
            self.counts.reasoning_bytes += text.len();
        } else {
            self.counts.content_bytes += text.len();
        }
        match (out.last_mut(), self.in_reasoning) {
            (Some(Segment::Reasoning(prev)), true) | (Some(Segment::Content(prev)), false) => {
                prev.push_str(&text)
            }
            (_, true) => out.push(Segment::Reasoning(text)),
            (_, false) => out.push(Segment::Content(text)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(format: ReasoningFormat, start: bool, chunks: &[&str]) -> Vec<Segment> {
        let mut p = ReasoningParser::new(format, start);
        let mut out: Vec<Segment> = Vec::new();
        let pieces = chunks.iter().flat_map(|c| p.push(c)).collect::<Vec<_>>();
        for seg in pieces.into_iter().chain(p.finish()) {
            match (out.last_mut(), seg) {
                (Some(Segment::Reasoning(a)), Segment::Reasoning(b)) => a.push_str(&b),
                (Some(Segment::Content(a)), Segment::Content(b)) => a.push_str(&b),
                (_, seg) => out.push(seg),
            }
        }
        out
    }

    fn r(s: &str) -> Segment {
        Segment::Reasoning(s.into())
    }
    fn c(s: &str) -> Segment {
        Segment::Content(s.into())
    }

    #[test]
    fn think_block_then_answer() {
        let got = split(
            ReasoningFormat::Think,
            false,
            &["<think>\nhmm, 2+2", "</think>\n\n4"],
        );
        assert_eq!(got, vec![r("hmm, 2+2"), c("4")]);
    }

    #[test]
    fn starts_in_reasoning_when_prompt_opened_the_block() {
        let got = split(ReasoningFormat::Think, true, &["\nfirst</th", "ink>answer"]);
        assert_eq!(got, vec![r("first"), c("answer")]);
    }

    #[test]
    fn stray_close_in_content_is_dropped() {
        let got = split(
            ReasoningFormat::Think,
            false,
            &["lost thoughts</think>\nanswer"],
        );
        assert_eq!(got, vec![c("lost thoughts\nanswer")]);
        // An open tag inside reasoning does not nest.
        let got = split(
            ReasoningFormat::Think,
            false,
            &["<think>a<think>b</think>c"],
        );
        assert_eq!(got, vec![r("ab"), c("c")]);
    }

    #[test]
    fn gemma_channel_tags() {
        let got = split(
            ReasoningFormat::GemmaChannel,
            false,
            &["<|chan", "nel>thou", "ght\nplan it<chan", "nel|>Done."],
        );
        assert_eq!(got, vec![r("plan it"), c("Done.")]);
        // Without the channel name the bare token still opens.
        let got = split(
            ReasoningFormat::GemmaChannel,
            false,
            &["<|channel>x<channel|>y"],
        );
        assert_eq!(got, vec![r("x"), c("y")]);
    }

    #[test]
    fn counts_add_up() {
        let text = "<think>\nab</think>\n\ncd";
        let mut p = ReasoningParser::new(ReasoningFormat::Think, false);
        p.push(text);
        p.finish();
        let n = p.counts();
        assert_eq!(n.tags, 2);
        assert_eq!(n.tag_bytes, "<think></think>".len());
        assert_eq!(
            (n.reasoning_bytes, n.content_bytes, n.trimmed_bytes),
            (2, 2, 3)
        );
        assert_eq!(
            n.reasoning_bytes + n.content_bytes + n.tag_bytes + n.trimmed_bytes,
            text.len()
        );
    }

    #[test]
    fn none_format_passes_through() {
        let got = split(ReasoningFormat::None, true, &["<think>x", "</think>"]);
        assert_eq!(got, vec![c("<think>x</think>")]);
    }

    #[test]
    fn unfinished_partial_tag_is_released_at_finish() {
        let got = split(ReasoningFormat::Think, false, &["a</thi"]);
        assert_eq!(got, vec![c("a</thi")]);
        let got = split(ReasoningFormat::Think, false, &["<think>never closed <"]);
        assert_eq!(got, vec![r("never closed <")]);
    }
}
