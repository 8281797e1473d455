//! Prompt lookup: drafts by finding the sequence's last few tokens earlier
//! in the prompt or output and proposing what followed them there. No
//! drafter weights, no device work; it pays off when outputs quote their
//! inputs (code edits, extraction, summaries, repeated structure).

use runtime::model::{Tapped, Taps};
use runtime::{KvCache, Model};

use crate::draft::{DraftSource, DraftState, Proposal};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLookup {
    /// Longest suffix to match; longer matches are tried first.
    pub max_ngram: usize,
    /// Shortest suffix worth matching.
    pub min_ngram: usize,
    /// Tokens proposed per round.
    pub draft_tokens: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        Self {
            max_ngram: 3,
            min_ngram: 1,
            draft_tokens: 8,
        }
    }
}

impl PromptLookup {
    /// `k` tokens continuing what followed the most recent earlier
    /// occurrence of the longest matching suffix of `history` (up to
    /// `max_ngram` tokens), and how far the agreement between the two
    /// places actually reaches back (at least the suffix, at most
    /// [`MATCH_CAP`]): the evidence behind the draft.
    pub fn lookup(&self, history: &[u32], k: usize) -> (Vec<u32>, usize) {
        let len = history.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if len <= n {
                continue;
            }
            let pattern = &history[len - n..];
            // Most recent occurrence first: it best reflects the current
            // context. The suffix itself (start len - n) is excluded.
            let found = (0..len - n)
                .rev()
                .find(|&start| &history[start..start + n] == pattern);
            if let Some(start) = found {
                // Copy what followed, reading on into the copy itself when
                // the match overlaps the end: a loop of period p keeps
                // repeating instead of stopping after p tokens.
                let from = start + n;
                let mut out: Vec<u32> = Vec::with_capacity(k);
                for i in from..from + k {
                    out.push(if i < len { history[i] } else { out[i - len] });
                }
                let reach = (n..MATCH_CAP)
                    .take_while(|&m| {
                        m < start + n && history[start + n - 1 - m] == history[len - 1 - m]
                    })
                    .count();
                return (out, n + reach);
            }
        }
        (Vec::new(), 0)
    }
}

/// Match lengths worth telling apart; longer ones count as this long.
pub const MATCH_CAP: usize = 16;

/// The kind of evidence a match of `len` tokens is: 1, 2, 3, 4-7, 8-15, 16+.
fn kind_of(len: usize) -> usize {
    match len {
        0..=3 => len.saturating_sub(1),
        4..=7 => 3,
        8..=15 => 4,
        _ => 5,
    }
}

impl DraftSource for PromptLookup {
    fn taps(&self) -> Taps {
        Taps::default()
    }

    fn max_draft(&self) -> usize {
        self.draft_tokens
    }

    /// One kind per class of match length ([`kind_of`]): a 1-token match
    /// is weak evidence, a passage quoted for 16 tokens strong, and only
    /// the classes whose continuations are accepted often enough are
    /// verified.
    fn kinds(&self) -> usize {
        kind_of(MATCH_CAP) + 1
    }

    fn start(&self) -> Box<dyn DraftState> {
        Box::new(*self)
    }
}

impl DraftState for PromptLookup {
    fn observe(&mut self, _: &Model, _: &Tapped, _: std::ops::Range<i32>) -> anyhow::Result<()> {
        Ok(())
    }

    fn propose(
        &mut self,
        _: &Model,
        _: &KvCache,
        history: &[u32],
        k: usize,
    ) -> anyhow::Result<Proposal> {
        let (tokens, matched) = self.lookup(history, k);
        Ok(Proposal::tokens(tokens, kind_of(matched)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pl(max: usize, k: usize) -> PromptLookup {
        PromptLookup {
            max_ngram: max,
            min_ngram: 1,
            draft_tokens: k,
        }
    }

    #[test]
    fn proposes_what_followed_the_longest_match() {
        // "1 2 3 9 ... 5 2 3 7 ... 2 3": the 2-gram "2 3" last occurred
        // before 7; the 3-gram "4 2 3" does not occur.
        let h = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 4, 2, 3];
        assert_eq!(pl(3, 2).lookup(&h, 2), (vec![7, 8], 2));
        // A longer match wins over a more recent shorter one.
        let h = [5, 6, 7, 1, 2, 0, 7, 3, 5, 6, 7];
        assert_eq!(pl(3, 3).lookup(&h, 3), (vec![1, 2, 0], 3));
    }

    #[test]
    fn the_evidence_is_how_far_the_match_reaches_back() {
        // "9 1 2 3 4 | 5 ... 0 1 2 3 4": the 3-gram "2 3 4" matched, and
        // the agreement reaches back over "1" too (not "9" vs "0").
        let h = [9, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4];
        assert_eq!(pl(3, 2).lookup(&h, 2), (vec![5, 6], 4));
        // A quoted passage reaches as far as it goes, capped.
        let passage: Vec<u32> = (100..140).collect();
        let h: Vec<u32> = passage
            .iter()
            .chain(&[7, 7])
            .chain(&passage[..30])
            .copied()
            .collect();
        assert_eq!(pl(3, 1).lookup(&h, 1), (vec![130], MATCH_CAP));
        assert_eq!(
            [1, 2, 3, 4, 7, 8, 15, 16, 40].map(kind_of),
            [0, 1, 2, 3, 3, 4, 4, 5, 5]
        );
    }

    #[test]
    fn a_match_at_the_end_continues_its_period() {
        assert_eq!(pl(2, 5).lookup(&[4, 4], 5).0, vec![4; 5]);
        // "7 1 2 3 1 2": "1 2" last occurred one period back, before "3".
        assert_eq!(
            pl(2, 7).lookup(&[7, 1, 2, 3, 1, 2], 7),
            (vec![3, 1, 2, 3, 1, 2, 3], 2)
        );
    }

    #[test]
    fn no_match_no_draft() {
        assert!(pl(3, 4).lookup(&[1, 2, 3], 4).0.is_empty());
        assert!(pl(3, 4).lookup(&[], 4).0.is_empty());
        assert!(pl(3, 4).lookup(&[1, 2, 1, 2], 0).0.is_empty());
    }
}
