//! The draft-and-verify loop of the sequences running together
//! ([`Batch`]).
//!
//! Invariant between rounds: every committed token has been streamed, and
//! all but the newest (`history.last()`) are in the sequence's row of the
//! target's KV cache. A round feeds each row `[newest, d1..dk]` (the
//! rows' blocks in one forward), keeps `d1..da` where the target's own
//! pick agreed, adds the target's own pick after them, and drops the KV of
//! the `k - a` rejected positions of that row.
//!
//! The target's pick at each position is what plain decoding would choose
//! there: its argmax for greedy requests; for sampled ones the request's
//! sampler (bias, penalties, temperature, top-k, min-p, top-p) drawing
//! with the noise plain sampling would use at that position of the output
//! ([`sampling::Sampler::picks_along`]). A draft is thus kept with probability
//! p(draft), and on a rejection the committed token is distributed as p
//! without the draft, renormalised: speculative sampling with a point-mass
//! proposal, lossless in distribution, and with a seed the output equals
//! plain sampling's with that seed token for token, however many drafts
//! each round verified.
//!
//! A constrained request (a grammar) verifies under the grammar's masks:
//! drafts are cut at the first token the grammar rejects, the target's
//! choice at each position is its argmax among the tokens allowed there,
//! and tokens are committed through the grammar as the fast path does, so
//! the output equals the fast path's token for token.

use std::ops::Range;
use std::sync::Arc;

use engine_core::{FinishReason, GenerateRequest, SpecStats, StreamError};
use grammar::Allowed;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, Array, Dtype};
use runtime::generate::tokens_array;
use runtime::handover::HandoverSink;
use runtime::model::{Logits, Tapped, Taps};
use runtime::sampling;
use runtime::sequence;
use runtime::{KvCache, Model, SharedModel};

use crate::adaptive::{DraftSizer, RoundCost};
use crate::draft::{DraftSource, DraftState, Proposal};

/// What one round did, for the engine's acceptance window and cost model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundStats {
    pub drafted: u32,
    pub accepted: u32,
}

pub struct Sequence {
    /// Its sampler, grammar, KV blocks, engine slot and output.
    seq: sequence::Sequence,
    /// Where the prefix cache is: read at prefill, written at the end.
    shared: Arc<SharedModel>,
    cache: KvCache,
    /// Prompt, then every committed token that the sequence went on from.
    history: Vec<u32>,
    draft: Option<Box<dyn DraftState>>,
    taps: Taps,
    /// Most tokens the draft source proposes per round.
    max_draft: usize,
    /// How many of them are worth verifying, learned from this sequence.
    sizer: DraftSizer,
    stats: SpecStats,
    /// Why it ended, until its cache is handed back to publish it
    /// ([`Sequence::conclude`]).
    ending: Option<FinishReason>,
}

impl Sequence {
    pub fn new(
        seq: sequence::Sequence,
        shared: Arc<SharedModel>,
        source: &dyn DraftSource,
        adaptive: bool,
    ) -> Self {
        let history = seq.request().prompt.clone();
        Self {
            seq,
            shared,
            // Made at prefill, from the prefix cache's hit.
            cache: KvCache::new(0, 1),
            history,
            draft: Some(source.start()),
            taps: source.taps(),
            max_draft: source.max_draft(),
            sizer: DraftSizer::new(source.max_draft(), source.kinds(), adaptive),
            stats: SpecStats::default(),
            ending: None,
        }
    }

    pub fn request(&self) -> &GenerateRequest {
        self.seq.request()
    }

    /// Ended, or ending ([`Sequence::is_ending`]): commits nothing more.
    pub fn is_finished(&self) -> bool {
        self.seq.out.ended() || self.ending.is_some()
    }

    /// Ended at a stop, a token limit or a grammar's end, waiting for
    /// [`Sequence::conclude`].
    pub fn is_ending(&self) -> bool {
        self.ending.is_some()
    }

    pub fn stats(&self) -> SpecStats {
        self.stats
    }

    /// Runs the prompt through the target (chunked), after the prefix the
    /// shared prefix cache holds, and commits its first token. The drafter
    /// observes only the positions computed here: a cached prefix is
    /// context it does not see (fewer accepted drafts, the same output).
    pub fn prefill(&mut self, model: &Model) -> anyhow::Result<()> {
        let (mut cache, done) = self.seq.cached_prefix(&self.shared);
        // Rejected drafts roll a hybrid model's recurrent states back to
        // the states kept for each verified position.
        cache.keep_steps(model.is_hybrid());
        let (taps, draft) = (&self.taps, &mut self.draft);
        let logits = self
            .seq
            .prefill(&self.shared, &mut cache, done, |cache, chunk, _| {
                let out = model.forward_tapped(&tokens_array(chunk), cache, Logits::Last, taps)?;
                if let Some(draft) = draft {
                    draft.observe(model, &out, 0..chunk.len() as i32)?;
                }
                Ok(out.logits)
            })?;
        self.cache = cache;
        let sets = self.allowed_along(&[]);
        let token = self.picks(&logits, &[], &sets)?;
        eval([&token])?;
        self.stats.target_forwards += 1;
        self.commit(&[token.as_slice::<i32>()[0] as u32], &sets)?;
        if self.is_ending() {
            let cache = self.take_cache();
            self.conclude(cache);
        }
        Ok(())
    }

    /// The cache it has filled alone (prefill), to join a batch.
    fn take_cache(&mut self) -> KvCache {
        std::mem::replace(&mut self.cache, KvCache::new(0, 1))
    }

    /// Drafts this round's tokens (when `speculate` and they are expected
    /// to pay for their verify at `cost`): the verify input, not yet run.
    fn plan(
        &mut self,
        model: &Model,
        speculate: bool,
        cost: &RoundCost,
        cache: impl FnOnce() -> anyhow::Result<KvCache>,
    ) -> anyhow::Result<Plan> {
        let newest = *self.history.last().expect("prefilled");
        // Never draft past max_tokens: a round commits at most k + 1.
        let budget = (self.seq.tokens_left().saturating_sub(1) as usize).min(self.max_draft);
        let limit = match (&self.draft, speculate) {
            (Some(_), true) => self.sizer.plan(cost, budget),
            _ => 0,
        };
        let proposal = match &mut self.draft {
            Some(draft) if limit > 0 => draft.propose(model, &cache()?, &self.history, limit)?,
            _ => Proposal::None,
        };
        let newest_arr = Array::from_slice(&[newest as i32], &[1, 1]);
        // Drafts on the device (lazy) or already on the host, cut to the
        // size worth verifying for their kind of evidence.
        // A grammar's masks and the penalties need the drafts on the host.
        let host_drafts = self.seq.constraint.is_some() || self.seq.sampler.reads_history();
        let (input, lazy, mut proposed, kind) = match proposal {
            Proposal::Tokens { mut tokens, kind } => {
                tokens.truncate(self.sizer.size(cost, kind, tokens.len().min(limit)));
                let mut ids = vec![newest];
                ids.extend(&tokens);
                (tokens_array(&ids), None, tokens, kind)
            }
            Proposal::Lazy(d) => match self.sizer.size(cost, 0, (d.dim(1) as usize).min(limit)) {
                0 => (newest_arr, None, Vec::new(), 0),
                k if host_drafts => {
                    let d = runtime::slices::slice(&d, &[0, 0], &[1, k as i32])?
                        .as_dtype(Dtype::Int32)?;
                    eval([&d])?;
                    let tokens: Vec<u32> = d.as_slice::<i32>().iter().map(|&t| t as u32).collect();
                    let mut ids = vec![newest];
                    ids.extend(&tokens);
                    (tokens_array(&ids), None, tokens, 0)
                }
                k => {
                    let d = runtime::slices::slice(&d, &[0, 0], &[1, k as i32])?
                        .as_dtype(Dtype::Int32)?;
                    (
                        ops::concatenate(&[newest_arr, d.clone()], 1)?,
                        Some(d),
                        Vec::new(),
                        0,
                    )
                }
            },
            Proposal::None => (newest_arr, None, Vec::new(), 0),
        };
        // Drafts the grammar rejects are not worth verifying.
        let sets = self.allowed_along(&proposed);
        let input = match sets.len().checked_sub(1) {
            Some(k) if k < proposed.len() => {
                proposed.truncate(k);
                runtime::slices::slice(&input, &[0, 0], &[1, k as i32 + 1])?
            }
            _ => input,
        };
        Ok(Plan {
            input,
            lazy,
            proposed,
            kind,
            sets,
        })
    }

    /// Learns from the verdict, shows the drafter the committed positions
    /// (rows of `out`, this sequence's verify output) and commits.
    fn settle(
        &mut self,
        model: &Model,
        plan: Plan,
        verdict: Verdict,
        out: &Tapped,
    ) -> anyhow::Result<RoundStats> {
        let (k, accepted) = (plan.drafted() as usize, verdict.accepted);
        self.sizer.learn(plan.kind, k, accepted);
        if let Some(draft) = &mut self.draft {
            draft.observe(model, out, rows(accepted))?;
        }
        self.stats.target_forwards += 1;
        self.stats.drafted += k as u64;
        self.stats.accepted += accepted as u64;
        let mut committed = plan.proposed[..accepted].to_vec();
        committed.push(verdict.target[accepted]);
        self.commit(&committed, &plan.sets)?;
        Ok(RoundStats {
            drafted: k as u32,
            accepted: accepted as u32,
        })
    }

    /// Streams committed tokens (drawn with [`sampling::Sampler::picks_along`]'s
    /// keys) through the per-token rule ([`sequence::Sequence::accept`];
    /// `sets` from [`Sequence::allowed_along`]); tokens after the end are
    /// dropped.
    fn commit(&mut self, tokens: &[u32], sets: &[Option<Allowed>]) -> anyhow::Result<()> {
        for (i, &token) in tokens.iter().enumerate() {
            self.seq.sampler.pass_draw();
            let grammar_over = matches!(sets.get(i), Some(None));
            match self.seq.accept_plain(token, grammar_over)? {
                Some(reason) => {
                    self.end(reason);
                    return Ok(());
                }
                None => self.history.push(token),
            }
        }
        self.check_cancelled();
        Ok(())
    }

    /// The target's `L` picks (`[L]` int32, lazy) from `[1, L, V]` logits:
    /// at each position what plain decoding would choose after the drafts
    /// before it, among the tokens its grammar set allows where `sets` has
    /// one (a `None` set, the output complete, limits nothing: that
    /// position's token is not committed).
    fn picks(
        &self,
        logits: &Array,
        drafts: &[u32],
        sets: &[Option<Allowed>],
    ) -> anyhow::Result<Array> {
        let vocab = logits.dim(-1) as usize;
        let allowed: Vec<Option<Array>> = sets
            .iter()
            .map(|set| {
                set.as_ref()
                    .map(|a| sampling::allowed_mask(&a.to_bools(vocab)))
            })
            .collect();
        Ok(self.seq.sampler.picks_along(logits, drafts, &allowed)?)
    }

    /// The grammar's allowed sets along `drafts` (see
    /// [`grammar::Constraint::allowed_along`]); without a grammar, no limits on any
    /// position.
    fn allowed_along(&mut self, drafts: &[u32]) -> Vec<Option<Allowed>> {
        match &mut self.seq.constraint {
            Some(c) => c.allowed_along(drafts),
            None => Vec::new(),
        }
    }

    /// Ends the sequence: a cancelled one at once (nothing is published:
    /// that happens outside the device lock), any other once its cache is
    /// handed back ([`Sequence::conclude`]).
    fn end(&mut self, reason: FinishReason) {
        if self.is_finished() {
            return;
        }
        if reason == FinishReason::Cancelled {
            self.drop_caches();
            self.seq.finish(reason, Some(self.stats));
        } else {
            self.ending = Some(reason);
        }
    }

    /// Completes an ending: publishes `cache` (its context: every committed
    /// token but the newest, possibly accepted drafts after a stop token)
    /// to the prefix cache, so the chat's next turn finds it, releases
    /// what it holds and sends the final event.
    pub fn conclude(&mut self, cache: KvCache) {
        let Some(reason) = self.ending.take() else {
            return;
        };
        self.seq.publish(&self.shared, &self.history, &cache);
        self.drop_caches();
        self.seq.finish(reason, Some(self.stats));
    }

    /// Ends the sequence with an error (the engine keeps running).
    pub fn fail(&mut self, error: StreamError) {
        if self.seq.out.ended() {
            return;
        }
        self.ending = None;
        self.drop_caches();
        self.seq.fail(error);
    }

    fn drop_caches(&mut self) {
        self.cache = KvCache::new(0, 1);
        self.draft = None;
    }

    /// Gives the running sequence to `sink` with its row of the cache
    /// (every committed token but the newest) and its KV blocks; the
    /// client's stream goes on there. Its drafting statistics so far are
    /// not in the final usage.
    fn hand_over(self, cache: KvCache, sink: &dyn HandoverSink) {
        let last_token = *self.history.last().expect("prefilled");
        self.seq.hand_over(cache, last_token, sink);
    }

    /// Cancelled from outside (client gone, shutdown) between rounds.
    pub fn check_cancelled(&mut self) {
        if self.request().cancel.is_cancelled() {
            self.end(FinishReason::Cancelled);
        }
    }
}

/// A round's input, drafted and not yet verified.
struct Plan {
    /// `[1, 1 + k]`: the newest committed token, then the drafts.
    input: Array,
    /// `[1, k]` drafts still on the device, read back with the verdict.
    lazy: Option<Array>,
    /// The drafts, once on the host.
    proposed: Vec<u32>,
    /// The kind of evidence behind them (see [`DraftSizer`]).
    kind: usize,
    /// The grammar's allowed sets along them (empty: no grammar).
    sets: Vec<Option<Allowed>>,
}

/// The target's picks along a verified block, and how many drafts they
/// agree with.
struct Verdict {
    target: Vec<u32>,
    accepted: usize,
}

impl Plan {
    fn drafted(&self) -> i32 {
        self.input.dim(1) - 1
    }

    /// Reads the target's `1 + k` picks (from [`Sequence::picks`],
    /// evaluated with the lazy drafts) and compares them with the drafts.
    fn judge(&mut self, picks: &Array) -> anyhow::Result<Verdict> {
        if let Some(d) = self.lazy.take() {
            self.proposed = d.as_slice::<i32>().iter().map(|&t| t as u32).collect();
        }
        let target: Vec<u32> = picks.as_slice::<i32>().iter().map(|&t| t as u32).collect();
        let accepted = self
            .proposed
            .iter()
            .zip(&target)
            .take_while(|(d, t)| d == t)
            .count();
        Ok(Verdict { target, accepted })
    }
}

/// The sequences running together. Row `b` of their stacked cache (left
/// padded, right-aligned) is `seqs[b]`'s context; it is kept from round to
/// round, so a round copies no keys or values unless rows accept
/// different numbers of drafts.
#[derive(Default)]
pub struct Batch {
    seqs: Vec<Sequence>,
    cache: Option<KvCache>,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    pub fn seqs_mut(&mut self) -> &mut [Sequence] {
        &mut self.seqs
    }

    /// Whether some row has ended (or is ending) and is still in the batch.
    pub fn any_finished(&self) -> bool {
        self.seqs.iter().any(Sequence::is_finished)
    }

    /// Adds a prefilled sequence as the last row; on failure it is handed
    /// back with the error.
    pub fn join(&mut self, mut seq: Sequence) -> Result<(), (Sequence, anyhow::Error)> {
        let own = seq.take_cache();
        let stacked = KvCache::join(self.cache.take(), own);
        match stacked {
            Ok(cache) => {
                self.cache = Some(cache);
                self.seqs.push(seq);
                Ok(())
            }
            Err(e) => {
                self.fail(runtime::memory::failed_step(&e));
                Err((seq, e))
            }
        }
    }

    /// Concludes every ending row with its own row of the cache, then
    /// drops the rows that finished.
    pub fn retire(&mut self) -> anyhow::Result<()> {
        let Some(cache) = &mut self.cache else {
            return Ok(());
        };
        for (b, seq) in self.seqs.iter_mut().enumerate() {
            if seq.is_ending() {
                seq.conclude(cache.extract_row(b)?);
            }
        }
        let keep: Vec<usize> = (0..self.seqs.len())
            .filter(|&b| !self.seqs[b].is_finished())
            .collect();
        if keep.len() == self.seqs.len() {
            return Ok(());
        }
        if keep.is_empty() {
            self.cache = None;
        } else {
            cache.select_rows(&keep)?;
        }
        self.seqs.retain(|s| !s.is_finished());
        Ok(())
    }

    /// Hands every running row that `sink` can continue (not a grammar's:
    /// its state stays here) over to it, each with its own row of the
    /// cache, evaluated; returns how many moved.
    pub fn hand_over(&mut self, sink: &dyn HandoverSink) -> anyhow::Result<usize> {
        let Some(cache) = &mut self.cache else {
            return Ok(0);
        };
        let moving: Vec<bool> = self
            .seqs
            .iter()
            .map(|s| !s.is_finished() && s.seq.can_hand_over())
            .collect();
        let mut rows = Vec::new();
        for b in (0..moving.len()).filter(|&b| moving[b]) {
            let mut row = cache.extract_row(b)?;
            row.keep_steps(false);
            rows.push(row);
        }
        if rows.is_empty() {
            return Ok(0);
        }
        // Lazy arrays would be computed on this thread's stream, which the
        // adopting engine's thread lacks.
        let state: Vec<Array> = rows.iter().flat_map(KvCache::state).collect();
        eval(&state)?;
        let keep: Vec<usize> = (0..moving.len()).filter(|&b| !moving[b]).collect();
        if keep.is_empty() {
            self.cache = None;
        } else {
            cache.select_rows(&keep)?;
        }
        let moved = rows.len();
        let mut rows = rows.into_iter();
        for (seq, moves) in std::mem::take(&mut self.seqs).into_iter().zip(moving) {
            match moves {
                true => seq.hand_over(rows.next().expect("a row each"), sink),
                false => self.seqs.push(seq),
            }
        }
        Ok(moved)
    }

    /// Fails every sequence (a failed round: their context is lost).
    pub fn fail(&mut self, error: StreamError) {
        for seq in &mut self.seqs {
            seq.fail(error.clone());
        }
        self.seqs.clear();
        self.cache = None;
    }

    /// One round of every row: each drafts on its own (when `speculate`
    /// and its drafts are expected to pay at `cost`), then one forward
    /// verifies every row's block, right-padded to the widest, and each
    /// row keeps its newest token and its own accepted drafts
    /// ([`KvCache::truncate_rows`]). Rows that drafted nothing take their
    /// plain decode step in the same forward. A sequence whose drafter
    /// fails ends with that error (its row runs a dropped dummy token); an
    /// error of the forward itself is returned (the caller fails the
    /// batch). Returns the verified rows' rounds.
    pub fn round(
        &mut self,
        model: &Model,
        speculate: bool,
        cost: &RoundCost,
    ) -> anyhow::Result<Vec<RoundStats>> {
        let Some(cache) = &mut self.cache else {
            return Ok(Vec::new());
        };
        let mut plans = Vec::with_capacity(self.seqs.len());
        for (b, seq) in self.seqs.iter_mut().enumerate() {
            let plan = match seq.is_finished() {
                true => None,
                false => match seq.plan(model, speculate, cost, || cache.row_view(b)) {
                    Ok(plan) => Some(plan),
                    Err(e) => {
                        tracing::error!(request = %seq.request().id, error = %e, "drafting failed");
                        seq.fail(runtime::memory::failed_step(&e));
                        None
                    }
                },
            };
            plans.push(plan);
        }
        let Some(width) = plans.iter().flatten().map(|p| p.input.dim(1)).max() else {
            return Ok(Vec::new());
        };
        let dummy = Array::from_slice(&[0i32], &[1, 1]);
        let input = plans
            .iter()
            .map(|p| right_padded(p.as_ref().map_or(&dummy, |p| &p.input), width))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let taps = self.seqs[0].taps.clone();
        let out = model.forward_tapped(&ops::concatenate(&input, 0)?, cache, Logits::All, &taps)?;
        let mut rows = Vec::new();
        for (b, plan) in plans.iter().enumerate() {
            rows.push(match plan {
                Some(plan) => {
                    let out = row_of(&out, b as i32, plan.input.dim(1))?;
                    let picks = self.seqs[b].picks(&out.logits, &plan.proposed, &plan.sets)?;
                    Some((out, picks))
                }
                None => None,
            });
        }
        // One sync for the whole batch: every row's picks and lazy drafts.
        let pending = rows
            .iter()
            .flatten()
            .map(|(_, picks)| picks)
            .chain(plans.iter().flatten().filter_map(|p| p.lazy.as_ref()));
        eval(pending)?;
        let verdicts: Vec<Option<Verdict>> = plans
            .iter_mut()
            .zip(&rows)
            .map(|(plan, row)| match (plan, row) {
                (Some(plan), Some((_, picks))) => plan.judge(picks).map(Some),
                _ => Ok(None),
            })
            .collect::<anyhow::Result<_>>()?;
        // Each row keeps its newest token and accepted drafts; a row
        // without a plan keeps nothing of this forward.
        let drop: Vec<i32> = verdicts
            .iter()
            .map(|v| v.as_ref().map_or(width, |v| width - 1 - v.accepted as i32))
            .collect();
        cache.truncate_rows(&drop)?;
        let mut stats = Vec::new();
        let rounds = self.seqs.iter_mut().zip(plans).zip(verdicts).zip(rows);
        for (((seq, plan), verdict), row) in rounds {
            let (Some(plan), Some(verdict), Some((out, _))) = (plan, verdict, row) else {
                continue;
            };
            match seq.settle(model, plan, verdict, &out) {
                Ok(round) => stats.push(round),
                Err(e) => {
                    tracing::error!(request = %seq.request().id, error = %e, "drafter update failed");
                    seq.fail(runtime::memory::failed_step(&e));
                }
            }
        }
        Ok(stats)
    }
}

/// `[1, n]` tokens followed by zeros up to `width` columns (positions a
/// row's verdict never reads, dropped with its rejected drafts).
fn right_padded(tokens: &Array, width: i32) -> anyhow::Result<Array> {
    let n = tokens.dim(1);
    if n == width {
        return Ok(tokens.clone());
    }
    let pad = ops::zeros_dtype(&[1, width - n], tokens.dtype())?;
    Ok(ops::concatenate(&[tokens.clone(), pad], 1)?)
}

/// Row `b`'s first `n` positions of a batched forward's outputs.
fn row_of(out: &Tapped, b: i32, n: i32) -> anyhow::Result<Tapped> {
    let cut = |a: &Array| {
        let s = a.shape();
        runtime::slices::slice(a, &[b, 0, 0], &[b + 1, n, s[2]])
    };
    Ok(Tapped {
        logits: cut(&out.logits)?,
        layers: out.layers.as_ref().map(cut).transpose()?,
        final_hidden: out.final_hidden.as_ref().map(cut).transpose()?,
    })
}

/// Rows of the verify output that are now committed context: the newest
/// token and the accepted drafts.
fn rows(accepted: usize) -> Range<i32> {
    0..accepted as i32 + 1
}
