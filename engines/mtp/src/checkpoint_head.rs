//! `draft: checkpoint`: the target checkpoint's own MTP head (Qwen 3.5's
//! `mtp.*`, [`runtime::model::MtpHead`]) as the draft source, drafting as
//! mlx-vlm's `qwen3_5_mtp` drafter does.
//!
//! The head keeps its own keys and values, one entry per target position
//! `p`, computed from the token at `p + 1` beside the target's final normed
//! hidden state at `p`. Committed positions wait in `pending` until a
//! proposal runs them (their next token is known by then); the last output
//! gives the first draft (the seed). Each further draft feeds the head's
//! own output back as the hidden state, appending an entry per draft. After
//! the verify, entries of accepted drafts stay (made from the head's own
//! hidden state, as the reference keeps them) and the rest are trimmed; the
//! target's hidden states of the positions not covered wait for the next
//! proposal.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, Array, Dtype};
use runtime::generate::{tokens_array, DEFAULT_PREFILL_CHUNK};
use runtime::model::{MtpHead, Tapped, Taps};
use runtime::slices::slice;
use runtime::{KvCache, Model};
use speculative::{DraftSource, DraftState, Proposal};

/// A loaded MTP head and the number of tokens it drafts per round.
#[derive(Clone)]
pub struct CheckpointHead {
    head: Arc<MtpHead>,
    draft_tokens: usize,
}

impl CheckpointHead {
    /// Drafts per round by default: mlx-vlm's block size for the head
    /// (`mtp_num_hidden_layers + 2`, the verified token included).
    pub fn default_draft_tokens(target: &Model) -> usize {
        target
            .config
            .hybrid
            .as_ref()
            .map_or(1, |h| h.mtp_layers as usize + 1)
    }

    /// The head of `target`'s checkpoint in `dir`; fails, saying so, when
    /// it ships none.
    pub fn load(target: &Model, dir: &Path, draft_tokens: usize) -> anyhow::Result<Self> {
        let head = MtpHead::load(target, dir)?.with_context(|| {
            format!(
                "{} has no MTP head (no `mtp.*` weights; Qwen 3.5 checkpoints ship one, MLX conversions drop it): `draft: checkpoint` cannot draft",
                dir.display()
            )
        })?;
        tracing::info!(
            checkpoint = %dir.display(),
            layers = head.num_layers(),
            draft_tokens,
            "drafting with the checkpoint's MTP head"
        );
        Ok(Self {
            head: Arc::new(head),
            draft_tokens: draft_tokens.max(1),
        })
    }
}

impl DraftSource for CheckpointHead {
    fn taps(&self) -> Taps {
        Taps {
            layers: Vec::new(),
            final_hidden: true,
        }
    }

    fn max_draft(&self) -> usize {
        self.draft_tokens
    }

    fn start(&self) -> Box<dyn DraftState> {
        Box::new(State {
            cache: self.head.new_cache(),
            head: self.head.clone(),
            first: None,
            pending: Vec::new(),
            appended: None,
        })
    }
}

struct State {
    head: Arc<MtpHead>,
    /// The head's keys and values.
    cache: KvCache,
    /// The position of the head cache's first entry: the first position
    /// the target computed for this sequence (after a prefix-cache hit,
    /// not 0).
    first: Option<i32>,
    /// Target hidden states `[1, n, H]` of committed positions the head has
    /// not run yet, oldest first.
    pending: Vec<Array>,
    /// Entries the last proposal appended from the head's own outputs
    /// (`k - 1` for `k` drafts); `None` when no proposal awaits its verify.
    appended: Option<i32>,
}

impl DraftState for State {
    fn observe(&mut self, _: &Model, out: &Tapped, rows: Range<i32>) -> anyhow::Result<()> {
        let h = out
            .final_hidden
            .as_ref()
            .context("the target forward returned no final hidden state")?;
        // A verify's rows: the verified token and the accepted drafts. The
        // entries of accepted drafts are already in the head's cache.
        let keep = match self.appended.take() {
            Some(appended) => {
                let keep = appended.min(rows.end - 1);
                self.cache.truncate(appended - keep)?;
                // Evaluated with the drafts, unless the loop verified none
                // of them: then now, so its graph does not grow over rounds.
                eval(&self.cache.state())?;
                keep
            }
            None => 0,
        };
        let from = rows.start + keep;
        if from < rows.end {
            self.pending
                .push(slice(h, &[0, from, 0], &[1, rows.end, h.dim(2)])?);
        }
        Ok(())
    }

    fn propose(
        &mut self,
        target: &Model,
        cache: &KvCache,
        history: &[u32],
        k: usize,
    ) -> anyhow::Result<Proposal> {
        if self.pending.is_empty() || k == 0 {
            return Ok(Proposal::None);
        }
        let hidden = ops::concatenate(&std::mem::take(&mut self.pending), 1)?;
        // The pending positions end just before the newest token's.
        let newest = cache.len();
        let start = newest - hidden.dim(1);
        let first = *self.first.get_or_insert(start);
        anyhow::ensure!(
            first + self.cache.len() == start,
            "the MTP head's cache ends at {}, its pending states start at {start}",
            first + self.cache.len()
        );
        // Each position's entry reads the token after it.
        let next = history
            .get(start as usize + 1..=newest as usize)
            .context("the history is shorter than the target's cache")?;
        // In prefill-sized chunks: a long prompt's catch-up stays bounded.
        let (n, width) = (hidden.dim(1), hidden.dim(2));
        let mut out = None;
        for from in (0..n).step_by(DEFAULT_PREFILL_CHUNK) {
            let to = (from + DEFAULT_PREFILL_CHUNK as i32).min(n);
            out = Some(self.head.forward(
                target,
                &tokens_array(&next[from as usize..to as usize]),
                &slice(&hidden, &[0, from, 0], &[1, to, width])?,
                &mut self.cache,
                start + from,
            )?);
        }
        let out = out.expect("pending states are not empty");
        let mut out_last = slice(&out, &[0, out.dim(1) - 1, 0], &[1, out.dim(1), width])?;
        let mut token = greedy(target, &out_last)?;
        let mut drafts = vec![token.clone()];
        for step in 1..k as i32 {
            out_last = self.head.forward(
                target,
                &token,
                &out_last,
                &mut self.cache,
                newest + step - 1,
            )?;
            token = greedy(target, &out_last)?;
            drafts.push(token.clone());
        }
        self.appended = Some(k as i32 - 1);
        Ok(Proposal::Lazy(ops::concatenate(&drafts, 1)?))
    }
}

/// The target's greedy token `[1, 1]` (int32) after the head's output
/// `[1, 1, H]`.
fn greedy(target: &Model, h: &Array) -> anyhow::Result<Array> {
    Ok(ops::indexing::argmax_axis(&target.logits(h)?, -1, None)?
        .reshape(&[1, 1])?
        .as_dtype(Dtype::Int32)?)
}
