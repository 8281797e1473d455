//! The interface between the verify loop and whatever proposes tokens.

use mlx_rs::Array;
use runtime::model::{Tapped, Taps};
use runtime::{KvCache, Model};

/// What one draft step proposes to follow the last committed token.
pub enum Proposal {
    /// Nothing worth verifying: the loop takes a plain decode step.
    None,
    /// Tokens already known on the host (prompt lookup), with the kind of
    /// evidence behind them (below [`DraftSource::kinds`]): acceptance is
    /// learned per kind.
    Tokens { tokens: Vec<u32>, kind: usize },
    /// `[1, k]` int32 tokens still being computed on the device; the verify
    /// forward is chained onto them so a round syncs with the host once.
    Lazy(Array),
}

impl Proposal {
    /// Host tokens with their kind of evidence; nothing when there are none.
    pub fn tokens(tokens: Vec<u32>, kind: usize) -> Self {
        if tokens.is_empty() {
            Proposal::None
        } else {
            Proposal::Tokens { tokens, kind }
        }
    }
}

/// A drafter, loaded once per engine and shared by its sequences.
pub trait DraftSource: Send + Sync {
    /// Hidden states of the target the drafter reads from every forward.
    fn taps(&self) -> Taps;
    /// Most tokens proposed per round.
    fn max_draft(&self) -> usize;
    /// Kinds of evidence its proposals tell apart (prompt lookup: match
    /// lengths), each with its own acceptance estimate; lazy proposals are
    /// kind 0.
    fn kinds(&self) -> usize {
        1
    }
    /// Per-sequence drafting state.
    fn start(&self) -> Box<dyn DraftState>;
}

/// One sequence's drafting state.
pub trait DraftState: Send {
    /// Target hidden states of newly committed positions: `rows` of the
    /// last forward's tapped outputs, in order.
    fn observe(
        &mut self,
        target: &Model,
        out: &Tapped,
        rows: std::ops::Range<i32>,
    ) -> anyhow::Result<()>;

    /// Up to `k` tokens to follow `history` (prompt and committed tokens;
    /// the last one is not in `cache` yet and sits at position
    /// `cache.len()`).
    fn propose(
        &mut self,
        target: &Model,
        cache: &KvCache,
        history: &[u32],
        k: usize,
    ) -> anyhow::Result<Proposal>;
}
