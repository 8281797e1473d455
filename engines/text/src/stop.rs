//! Literal strings in streamed text: stop strings, and the tag lexer that the
//! reasoning and tool-call parsers share.
//!
//! Text arrives in chunks cut anywhere, so a match may straddle chunks. The
//! rule everywhere here: hold back exactly the tail that could still grow into
//! a match, release everything else at once. All offsets come from `str`
//! searches or `char_indices`, so a cut never lands inside a UTF-8 character.

/// What one `StopMatcher::push` lets through.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text that is safe to emit now: it can no longer be part of a stop.
    pub text: String,
    /// A stop string matched; `text` ends right before it and nothing after
    /// it is ever emitted.
    pub stopped: bool,
}

/// Truncates a text stream at the first stop string, across chunk boundaries.
///
/// "First" means the match that *ends* earliest (ties: the one that starts
/// earliest). That is what a per-token check sees, and it does not depend on
/// where the chunks are cut: with stops `["abc", "b"]`, text `"xabc"` emits
/// `"xa"` however it is chunked.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: &[String]) -> Self {
        let mut own: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        own.sort();
        own.dedup();
        Self {
            stops: own,
            held: String::new(),
            stopped: false,
        }
    }

    /// Feeds a chunk; returns what may be emitted now. After a stop, every
    /// call returns empty text with `stopped` set.
    pub fn push(&mut self, chunk: &str) -> StopStep {
        if self.stopped {
            return StopStep {
                text: String::new(),
                stopped: true,
            };
        }
        if self.stops.is_empty() {
            return StopStep {
                text: chunk.to_owned(),
                stopped: false,
            };
        }
        self.held.push_str(chunk);
        if let Some(at) = earliest_ending(&self.held, &self.stops) {
            self.held.truncate(at);
            self.stopped = true;
            return StopStep {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        let cut = partial_tail_start(&self.held, &self.stops).unwrap_or(self.held.len());
        let rest = self.held.split_off(cut);
        StopStep {
            text: std::mem::replace(&mut self.held, rest),
            stopped: false,
        }
    }

    /// Generation ended without a stop: the held-back tail was plain text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped
    }
}

/// Start of the match that ends first (ties: starts first), if any.
fn earliest_ending(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|at| (at + s.len(), at)))
        .min()
        .map(|(_, at)| at)
}

/// Start of the longest suffix of `text` that is a proper prefix of some
/// pattern: the part that must wait for more text before it can be judged.
pub(crate) fn partial_tail_start<S: AsRef<str>>(text: &str, pats: &[S]) -> Option<usize> {
    let longest = pats.iter().map(|p| p.as_ref().len()).max()?;
    // Only the last `longest - 1` bytes can begin a proper prefix.
    let mut from = text.len().saturating_sub(longest.saturating_sub(1));
    while !text.is_char_boundary(from) {
        from += 1;
    }
    text[from..]
        .char_indices()
        .map(|(i, _)| from + i)
        .find(|&i| {
            let tail = &text[i..];
            pats.iter().any(|p| {
                let p = p.as_ref();
                p.len() > tail.len() && p.starts_with(tail)
            })
        })
}

/// Earliest tag in `text` (longest one when several start at the same
/// place), as (byte offset, index into `tags`).
fn first_tag(text: &str, tags: &[&str]) -> Option<(usize, usize)> {
    let mut best: Option<(usize, usize)> = None;
    for (idx, tag) in tags.iter().enumerate().filter(|(_, t)| !t.is_empty()) {
        if let Some(at) = text.find(tag) {
            let better = match best {
                None => true,
                Some((b_at, b_idx)) => at < b_at || (at == b_at && tag.len() > tags[b_idx].len()),
            };
            if better {
                best = Some((at, idx));
            }
        }
    }
    best
}

/// One piece of lexed text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Lexed {
    /// Text that is certainly not (part of) a tag.
    Text(String),
    /// The tag at this index of the tag list passed to `next`.
    Tag(usize),
}

/// Splits a text stream into plain text and tags. The tag set is given per
/// call because what counts as a tag depends on the caller's state (an open
/// tag in content, a close tag inside a block). Tags are matched earliest
/// first; when one tag is a prefix of another (`<|channel>` and
/// `<|channel>thought`), the longest wins, so the lexer waits until the
/// longer one is ruled out.
#[derive(Debug, Clone, Default)]
pub(crate) struct TagLexer {
    buf: String,
}

impl TagLexer {
    pub(crate) fn push(&mut self, chunk: &str) {
        self.buf.push_str(chunk);
    }

    /// The next piece, or `None` when what is left could still become a tag.
    /// `at_end`: no more text will come, so nothing is held back (a complete
    /// `<|channel>` no longer waits to see if `thought` follows).
    pub(crate) fn next(&mut self, tags: &[&str], at_end: bool) -> Option<Lexed> {
        if self.buf.is_empty() {
            return None;
        }
        let hold = if at_end {
            None
        } else {
            partial_tail_start(&self.buf, tags)
        };
        match first_tag(&self.buf, tags) {
            // A partial match starting at or before `at` may still turn into
            // an earlier or longer tag, so a match only counts before `hold`.
            Some((at, idx)) if hold.is_none_or(|h| at < h) => {
                if at > 0 {
                    return Some(Lexed::Text(self.take_front(at)));
                }
                self.buf.drain(..tags[idx].len());
                Some(Lexed::Tag(idx))
            }
            _ => match hold.unwrap_or(self.buf.len()) {
                0 => None,
                cut => Some(Lexed::Text(self.take_front(cut))),
            },
        }
    }

    fn take_front(&mut self, at: usize) -> String {
        let rest = self.buf.split_off(at);
        std::mem::replace(&mut self.buf, rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn holds_only_possible_prefixes() {
        let mut m = StopMatcher::new(&stops(&["STOP"]));
        assert_eq!(m.push("abc ST").text, "abc ");
        assert_eq!(m.push("x").text, "STx");
        let step = m.push("yy STO");
        assert_eq!(step.text, "yy ");
        let step = m.push("P tail");
        assert_eq!(
            step,
            StopStep {
                text: String::new(),
                stopped: true
            }
        );
        assert_eq!(m.push("more").text, "");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn finish_flushes_held_text() {
        let mut m = StopMatcher::new(&stops(&["</end>"]));
        assert_eq!(m.push("done </e").text, "done ");
        assert_eq!(m.finish(), "</e");
    }

    #[test]
    fn empty_stops_are_ignored() {
        let mut m = StopMatcher::new(&stops(&["", ""]));
        assert_eq!(m.push("abc").text, "abc");
        assert!(!m.is_stopped());
    }

    #[test]
    fn partial_tail_respects_char_boundaries() {
        // "é" is two bytes; a stop starting with it must never be cut inside.
        assert_eq!(partial_tail_start("caf\u{e9}", &["\u{e9}t\u{e9}"]), Some(3));
        assert_eq!(partial_tail_start("x\u{1F600}", &["\u{1F600}!"]), Some(1));
        assert_eq!(partial_tail_start("abc", &["zzz"]), None);
        assert_eq!(partial_tail_start("abc", &[] as &[&str]), None);
    }

    #[test]
    fn lexer_prefers_longest_tag_and_waits_for_it() {
        let tags = ["<a>", "<a>b"];
        let mut lx = TagLexer::default();
        lx.push("x<a>");
        assert_eq!(lx.next(&tags, false), Some(Lexed::Text("x".into())));
        assert_eq!(lx.next(&tags, false), None, "could still become <a>b");
        lx.push("c");
        assert_eq!(lx.next(&tags, false), Some(Lexed::Tag(0)));
        assert_eq!(lx.next(&tags, false), Some(Lexed::Text("c".into())));
        lx.push("<a>b!");
        assert_eq!(lx.next(&tags, false), Some(Lexed::Tag(1)));
        assert_eq!(lx.next(&tags, false), Some(Lexed::Text("!".into())));
        assert_eq!(lx.next(&tags, false), None);
        lx.push("<a>b<a");
        assert_eq!(lx.next(&tags, false), Some(Lexed::Tag(1)));
        assert_eq!(lx.next(&tags, false), None);
        assert_eq!(lx.next(&tags, true), Some(Lexed::Text("<a".into())));
        lx.push("<a>");
        assert_eq!(lx.next(&tags, true), Some(Lexed::Tag(0)));
        assert_eq!(lx.next(&tags, true), None);
    }
}
