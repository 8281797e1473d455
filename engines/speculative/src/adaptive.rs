//! How many tokens to draft: as many as the expected accepted tokens pay
//! for, given what a round of that size costs on this engine.
//!
//! A round that drafts `k` tokens commits `1 + E(k)` tokens on average,
//! `E(k) = Σ_{j<=k} Π_{i<=j} p_i` with `p_i` the chance that draft `i` is
//! accepted once drafts `1..i` were, and costs `cost(k)`, measured by the
//! engine as a multiple of a plain decode step (`cost(0) = 1`). The
//! sequence drafts the `k` with the best `(1 + E(k)) / cost(k)`, and nothing
//! unless that beats a decode step by [`MARGIN`].
//!
//! Each sequence keeps its own `p_i`, per kind of evidence behind a draft
//! (prompt lookup: the length of the matched suffix; trained drafters: one
//! kind), moved by [`RATE`] toward every outcome: deep rejections pull the
//! size down within a few rounds, acceptances push it up, and a depth never
//! tried borrows the rate of the one above it so the size can grow. A kind
//! is first tried with one token (a probe), and one that stops paying is
//! probed again after a pause that doubles with every failed probe, so a
//! source with nothing credible drafts (almost) nothing and its sequence
//! runs as plain decode steps. Where the measured cost says that not even
//! drafts that are always accepted would pay (a verify of `k` tokens
//! costing about `k + 1` decode steps), nothing is drafted and probes wait
//! the longest pause: they only keep the cost measured, and the costs
//! themselves are measured afresh after [`COST_STALE_ROUNDS`] plain rounds.

use std::collections::VecDeque;
use std::time::Duration;

/// Weight of the newest outcome in every moving estimate.
const RATE: f64 = 0.3;
/// Acceptance assumed before anything is measured: optimistic enough that a
/// fresh sequence tries drafting.
const PRIOR_ACCEPT: f64 = 0.9;
/// Extra cost per drafted token, relative to a decode step, assumed until
/// the engine has measured both.
const PRIOR_COST_PER_TOKEN: f64 = 0.15;
/// The cost is fitted to the last drafting rounds, once there are enough
/// of them, robustly (medians): one slow verify (a first-seen shape, a
/// busy machine) must not stop drafting.
const COST_ROUNDS: usize = 8;
const COST_ROUNDS_NEEDED: usize = 3;
/// Expected gain a round must promise over a decode step (noise guard).
const MARGIN: f64 = 1.03;
/// Rounds between probes of a kind that stopped paying: first and longest.
const PROBE_FIRST: u32 = 8;
const PROBE_LONGEST: u32 = 1024;
/// Plain rounds in a row after which the drafting rounds' costs are
/// forgotten and measured again. Where they say nothing pays, sequences
/// probe only after the longest pause, which a new sequence never reaches,
/// so without this an estimate taken under a passing load (a busy
/// machine) would stop the engine drafting for good.
const COST_STALE_ROUNDS: u32 = 1024;

/// The engine's measured cost of a round, as a function of the tokens it
/// drafted: `cost(k) / cost(0) = 1 + fixed + per_token * k` for `k >= 1`,
/// fitted to the rounds its sequences ran (drafting included). A verify
/// has a fixed part where it takes another path than a decode step (on the
/// CPU, packed weights unpacked once for all its rows) and a per-token part
/// where every drafted row costs a step's share.
#[derive(Debug, Clone)]
pub struct RoundCost {
    /// Seconds of a round that drafted nothing (moving average).
    decode: Option<f64>,
    /// (drafted, cost relative to a decode step) of the last
    /// [`COST_ROUNDS`] rounds that drafted.
    rounds: VecDeque<(usize, f64)>,
    /// Plain rounds since the last one that drafted.
    plain_since: u32,
    /// `(fixed, per_token)` fitted to `rounds`, refitted when they change:
    /// it is read for every draft size considered, every round.
    line: (f64, f64),
}

impl Default for RoundCost {
    fn default() -> Self {
        Self {
            decode: None,
            rounds: VecDeque::new(),
            plain_since: 0,
            line: fit_line(&VecDeque::new()),
        }
    }
}

impl RoundCost {
    pub fn record(&mut self, drafted: usize, took: Duration) {
        let t = took.as_secs_f64();
        if drafted == 0 {
            self.decode = Some(ewma(self.decode, t));
            self.plain_since += 1;
            if self.plain_since >= COST_STALE_ROUNDS {
                self.rounds.clear();
                self.plain_since = 0;
                self.line = fit_line(&self.rounds);
            }
            return;
        }
        self.plain_since = 0;
        if let Some(decode) = self.decode {
            if self.rounds.len() == COST_ROUNDS {
                self.rounds.pop_front();
            }
            self.rounds.push_back((drafted, t / decode));
            self.line = fit_line(&self.rounds);
        }
    }

    /// `(fixed, per_token)`: see [`fit_line`].
    fn fit(&self) -> (f64, f64) {
        self.line
    }

    /// `cost(k) / cost(0)`.
    pub fn relative(&self, k: usize) -> f64 {
        if k == 0 {
            return 1.0;
        }
        let (fixed, per_token) = self.fit();
        1.0 + fixed + per_token * k as f64
    }

    /// Whether some round of at most `limit` drafts could beat a decode
    /// step if every draft were accepted.
    fn could_pay(&self, limit: usize) -> bool {
        (1..=limit).any(|k| (1 + k) as f64 / self.relative(k) > MARGIN)
    }

    /// Seconds of a plain decode step: measured, or inferred from a round
    /// of `drafted` tokens that took `took`.
    pub fn decode_seconds(&self, drafted: usize, took: Duration) -> f64 {
        self.decode
            .unwrap_or_else(|| took.as_secs_f64() / self.relative(drafted))
    }
}

/// `(fixed, per_token)`. The slope is the median of the slopes between
/// rounds of different sizes (Theil-Sen) and the fixed part the median
/// of what it leaves. Rounds of one size alone cannot tell the two
/// apart: they get the prior slope (at most the measured one) and the
/// rest is fixed, so a larger round is tried and measured.
fn fit_line(rounds: &VecDeque<(usize, f64)>) -> (f64, f64) {
    if rounds.len() < COST_ROUNDS_NEEDED {
        return (0.0, PRIOR_COST_PER_TOKEN);
    }
    let mut slopes = Vec::new();
    for (i, &(k1, c1)) in rounds.iter().enumerate() {
        for &(k2, c2) in rounds.iter().skip(i + 1) {
            if k1 != k2 {
                slopes.push((c2 - c1) / (k2 as f64 - k1 as f64));
            }
        }
    }
    let per_token = if slopes.is_empty() {
        let each = median(rounds.iter().map(|&(k, c)| (c - 1.0) / k as f64));
        PRIOR_COST_PER_TOKEN.min(each)
    } else {
        median(slopes.into_iter())
    }
    .max(0.0);
    let fixed = median(rounds.iter().map(|&(k, c)| c - 1.0 - per_token * k as f64)).max(0.0);
    (fixed, per_token)
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn ewma(old: Option<f64>, new: f64) -> f64 {
    match old {
        Some(o) => o + RATE * (new - o),
        None => new,
    }
}

/// One kind of evidence's acceptance estimates and probing state.
#[derive(Debug, Clone)]
struct Kind {
    /// `p_i` per depth, `None` until that depth was tried.
    accept: Vec<Option<f64>>,
    /// Rounds to wait before the next probe, and rounds waited.
    probe_every: u32,
    waited: u32,
}

impl Kind {
    fn new(max_draft: usize) -> Self {
        Self {
            accept: vec![None; max_draft],
            probe_every: PROBE_FIRST,
            // A kind never tried is due for its first probe.
            waited: PROBE_FIRST,
        }
    }

    /// `p_i` for every depth: untried depths borrow the rate above them.
    fn rates(&self) -> impl Iterator<Item = f64> + '_ {
        let mut last = PRIOR_ACCEPT;
        self.accept.iter().map(move |p| {
            last = p.unwrap_or(last);
            last
        })
    }

    /// The draft size with the best expected tokens per unit of cost, or
    /// 0 when none beats a decode step or the kind was never tried (it is
    /// probed first: a wrong block costs up to `cost(k)` decode steps).
    fn best(&self, cost: &RoundCost, limit: usize) -> usize {
        if self.accept.first().is_none_or(Option::is_none) {
            return 0;
        }
        let (mut expected, mut reach) = (0.0, 1.0);
        let (mut best, mut best_gain) = (0, MARGIN);
        for (i, p) in self.rates().take(limit).enumerate() {
            reach *= p;
            expected += reach;
            let k = i + 1;
            let gain = (1.0 + expected) / cost.relative(k);
            if gain > best_gain {
                (best, best_gain) = (k, gain);
            }
        }
        best
    }

    /// Whether a one-token probe is due: after the kind's pause, or the
    /// longest one where not even a full block of accepted drafts would
    /// pay (a probe itself may not: it is how a larger block gets tried).
    fn probe_due(&self, cost: &RoundCost) -> bool {
        let pause = if cost.could_pay(self.accept.len()) {
            self.probe_every
        } else {
            PROBE_LONGEST
        };
        self.waited >= pause
    }

    fn learn(&mut self, drafted: usize, accepted: usize) {
        for (i, p) in self.accept.iter_mut().enumerate().take(drafted) {
            let hit = if i < accepted { 1.0 } else { 0.0 };
            *p = Some(ewma(Some(p.unwrap_or(PRIOR_ACCEPT)), hit));
            if i >= accepted {
                break; // deeper drafts were never judged
            }
        }
    }
}

/// One sequence's draft sizing.
#[derive(Debug, Clone)]
pub struct DraftSizer {
    kinds: Vec<Kind>,
    /// `false`: always the full block (`adaptive: false`, for comparison).
    adaptive: bool,
}

impl DraftSizer {
    /// `kinds`: how many kinds of evidence the source tells apart.
    pub fn new(max_draft: usize, kinds: usize, adaptive: bool) -> Self {
        Self {
            kinds: vec![Kind::new(max_draft); kinds.max(1)],
            adaptive,
        }
    }

    /// Before proposing: the most tokens any kind may draft this round
    /// (the source proposes that many at most), or 0 for a plain decode
    /// step, so that a source with device work does not run it for
    /// nothing.
    pub fn plan(&mut self, cost: &RoundCost, limit: usize) -> usize {
        let most = self.most(cost, limit);
        if self.adaptive && most == 0 {
            for k in &mut self.kinds {
                k.waited += 1;
            }
        }
        most
    }

    /// Whether the next [`DraftSizer::plan`] will say 0, whatever token
    /// comes before it: the engine then queues that plain step before
    /// reading the token, as a plain decoding loop does.
    pub fn plans_nothing(&self, cost: &RoundCost, limit: usize) -> bool {
        self.most(cost, limit) == 0
    }

    fn most(&self, cost: &RoundCost, limit: usize) -> usize {
        if !self.adaptive {
            return limit;
        }
        self.kinds
            .iter()
            .map(|k| k.best(cost, limit).max(k.probe_due(cost) as usize))
            .max()
            .unwrap_or(0)
            .min(limit)
    }

    /// After proposing `limit` tokens with evidence `kind`: how many of
    /// them to verify (0 = a plain decode step).
    pub fn size(&mut self, cost: &RoundCost, kind: usize, limit: usize) -> usize {
        if !self.adaptive {
            return limit;
        }
        let last = self.kinds.len() - 1;
        let k = &mut self.kinds[kind.min(last)];
        let best = k.best(cost, limit);
        if best > 0 || k.probe_due(cost) {
            k.waited = 0;
            return best.max(1).min(limit);
        }
        k.waited += 1;
        0
    }

    /// The verify of a round that drafted `drafted` tokens with evidence
    /// `kind` accepted `accepted` of them.
    pub fn learn(&mut self, kind: usize, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let last = self.kinds.len() - 1;
        let k = &mut self.kinds[kind.min(last)];
        k.learn(drafted, accepted);
        // A probe (one token) that failed waits twice as long next time.
        if drafted == 1 {
            k.probe_every = if accepted > 0 {
                PROBE_FIRST
            } else {
                (k.probe_every * 2).min(PROBE_LONGEST)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(
        sizer: &mut DraftSizer,
        cost: &RoundCost,
        rounds: usize,
        mut accept: impl FnMut(usize) -> usize,
    ) -> Vec<usize> {
        (0..rounds)
            .map(|_| {
                let k = match sizer.plan(cost, 8) {
                    0 => 0,
                    limit => sizer.size(cost, 0, limit),
                };
                sizer.learn(0, k, accept(k));
                k
            })
            .collect()
    }

    #[test]
    fn plans_nothing_foretells_the_next_plan() {
        // Accepted drafts, then rejections (probes thinning out), and
        // rounds with no budget: every round's forecast is what plan()
        // then says.
        let mut cost = RoundCost::default();
        cost.record(0, Duration::from_millis(10));
        let mut s = DraftSizer::new(8, 2, true);
        let (mut plain, mut drafting) = (0, 0);
        for round in 0..600 {
            let limit = if round % 97 == 0 { 0 } else { 8 };
            let forecast = s.plans_nothing(&cost, limit);
            let planned = s.plan(&cost, limit);
            assert_eq!(forecast, planned == 0, "round {round}");
            let k = match planned {
                0 => 0,
                most => s.size(&cost, round % 2, most),
            };
            let accepted = if round < 150 { k } else { 0 };
            s.learn(round % 2, k, accepted);
            cost.record(k, Duration::from_millis(10 + k as u64));
            (plain, drafting) = match planned {
                0 => (plain + 1, drafting),
                _ => (plain, drafting + 1),
            };
        }
        assert!(
            plain > 300 && drafting > 100,
            "{plain} plain, {drafting} drafting"
        );
        let fixed = DraftSizer::new(8, 1, false);
        assert!(!fixed.plans_nothing(&cost, 8) && fixed.plans_nothing(&cost, 0));
    }

    #[test]
    fn a_cost_that_stopped_drafting_is_measured_again() {
        let mut cost = RoundCost::default();
        let step = Duration::from_millis(10);
        cost.record(0, step);
        // Verifies measured (under load, say) at two steps more than k.
        for k in [1, 2, 4, 8, 1, 2] {
            cost.record(k, step * (k as u32 + 2));
        }
        assert!(!cost.could_pay(8), "these verifies never pay");
        for _ in 1..COST_STALE_ROUNDS {
            cost.record(0, step);
        }
        assert!(!cost.could_pay(8), "not forgotten before its time");
        cost.record(0, step);
        assert!(cost.could_pay(8), "measured again after the plain rounds");
    }

    #[test]
    fn always_rejected_drafts_stop_and_probes_thin_out() {
        let (mut s, cost) = (DraftSizer::new(8, 1, true), RoundCost::default());
        let sizes = run(&mut s, &cost, 400, |_| 0);
        let late: usize = sizes[200..].iter().sum();
        assert!(sizes[..5].iter().any(|&k| k > 0), "a fresh sequence tries");
        assert!(
            late <= 2,
            "probes back off: {late} tokens drafted in the last 200 rounds"
        );
    }

    #[test]
    fn always_accepted_drafts_grow_to_the_full_block() {
        let (mut s, cost) = (DraftSizer::new(8, 1, true), RoundCost::default());
        let sizes = run(&mut s, &cost, 20, |k| k);
        assert_eq!(sizes[0], 1, "a kind never tried is probed first");
        assert!(sizes[5..].iter().all(|&k| k == 8), "{sizes:?}");
    }

    #[test]
    fn nothing_is_drafted_where_not_even_accepted_drafts_pay() {
        // A verify of k drafts costing k + 1 decode steps: drafting cannot
        // beat plain steps.
        let mut cost = RoundCost::default();
        cost.record(0, Duration::from_millis(10));
        for (k, took) in [(4, 12), (4, 50), (1, 11)] {
            cost.record(k, Duration::from_millis(took));
        }
        assert!(cost.could_pay(8), "one slow verify is not the cost");
        for (k, took) in [(4, 50), (1, 20), (4, 50), (1, 20)] {
            cost.record(k, Duration::from_millis(took));
        }
        assert!(!cost.could_pay(8), "{:?}", cost.fit());
        let mut s = DraftSizer::new(8, 1, true);
        let sizes = run(&mut s, &cost, 2000, |k| k);
        let drafted: usize = sizes.iter().sum();
        assert!(sizes[..1000].iter().all(|&k| k == 0), "{sizes:?}");
        assert!(drafted <= 2, "only probes that keep the cost measured");
    }

    #[test]
    fn a_fixed_verify_cost_still_pays_for_long_blocks() {
        // Dequantized products on the CPU: any verify costs about two
        // decode steps, a drafted token little more.
        let mut cost = RoundCost::default();
        cost.record(0, Duration::from_millis(100));
        for (k, took) in [(1, 210), (1, 212), (8, 230), (1, 209)] {
            cost.record(k, Duration::from_millis(took));
        }
        let (fixed, per_token) = cost.fit();
        assert!((fixed - 1.08).abs() < 0.03, "{fixed}");
        assert!((per_token - 0.028).abs() < 0.01, "{per_token}");
        // Probes alone (one size) leave room to try a larger block.
        let mut probes = RoundCost::default();
        probes.record(0, Duration::from_millis(100));
        for took in [210, 212, 209] {
            probes.record(1, Duration::from_millis(took));
        }
        assert!(probes.could_pay(8), "{:?}", probes.fit());
        let mut s = DraftSizer::new(8, 1, true);
        let sizes = run(&mut s, &cost, 20, |k| k);
        assert!(sizes[5..].iter().all(|&k| k == 8), "{sizes:?}");
        // Half the drafts rejected: a block of 8 commits 2 tokens for 2.3
        // steps, one token 1.5 for 2.1: plain steps win.
        let mut s = DraftSizer::new(8, 1, true);
        let sizes = run(&mut s, &cost, 200, |k| k / 2);
        let late: usize = sizes[100..].iter().sum();
        assert!(late <= 16, "{sizes:?}");
    }

    #[test]
    fn deep_rejections_shrink_the_block() {
        let (mut s, cost) = (DraftSizer::new(8, 1, true), RoundCost::default());
        let sizes = run(&mut s, &cost, 30, |k| k.min(2));
        assert!(
            sizes[10..].iter().all(|&k| (2..=4).contains(&k)),
            "{sizes:?}"
        );
    }

    #[test]
    fn expensive_verifies_draft_less() {
        let mut cost = RoundCost::default();
        cost.record(0, Duration::from_millis(10));
        for _ in 0..COST_ROUNDS_NEEDED {
            cost.record(4, Duration::from_millis(30)); // +50% per token
        }
        let mut s = DraftSizer::new(8, 1, true);
        // 50% acceptance cannot pay for +50% per token.
        let mut flip = false;
        let sizes = run(&mut s, &cost, 60, |k| {
            flip = !flip;
            usize::from(flip && k > 0)
        });
        assert!(
            sizes[30..].iter().filter(|&&k| k > 1).count() == 0,
            "{sizes:?}"
        );
    }
}
