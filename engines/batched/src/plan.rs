//! One scheduler step, decided apart from the device: counts in, a
//! [`StepPlan`] out, so the rules (one token budget per step, chunked
//! prefill, admission, preemption after running out of memory) are tested
//! without a model.
//!
//! Every sequence catches up to its target as vLLM v1's scheduler has it:
//! its KV holds `done` tokens of the `target` it needs before its next
//! pick (its prompt; for a row recomputed after preemption, its prompt and
//! every token it generated but the newest; a decoding row is one token
//! behind). A step spends one token budget: the decode rows first, one
//! token each, then prompt chunks of the sequences catching up, oldest
//! first, then whatever is left starts the next one.
//!
//! Where the device mixes (see [`crate::device::Device::mixes`]), the
//! step's decode rows and chunks run in one forward; elsewhere, one
//! forward per chunk (or padded group) beside one decode step.

use std::time::{Duration, Instant};

use runtime::sequence::Prefill;

use crate::admit::{self, Candidate, PrefillBudget, Start};

/// What the planner sees of the scheduler.
pub struct State<'a, Q> {
    /// Rows in the decode batch: one token each this step.
    pub decoding: usize,
    /// Sequences being prefilled, oldest first.
    pub catching_up: &'a [Prefill],
    /// Rows preempted after running out of memory, oldest first: the
    /// tokens each recomputes.
    pub preempted: &'a [usize],
    /// The wait queue, front first, read lazily.
    pub waiting: Q,
    /// KV blocks of the shared pool not reserved.
    pub free_blocks: usize,
    /// Most rows admitted at once (`max_batch`, or less after running out
    /// of memory).
    pub row_limit: usize,
}

/// What one step runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    /// Rows of the batch decoded (all of them: each row is one token
    /// behind after every step). A sequence whose prompt completes in
    /// the step joins the batch and decodes with them.
    pub decode: usize,
    /// Prompt tokens each sequence catching up computes, in the order of
    /// [`State::catching_up`]; 0: none this step.
    pub chunks: Vec<usize>,
    /// What starts this step.
    pub admit: Option<Admit>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// The oldest preempted row starts its recompute, with up to `tokens`
    /// of it this step.
    Rejoin { tokens: usize },
    /// The front waiting request starts alone, chunk by chunk, with up to
    /// `tokens` of its prompt this step.
    Chunked { tokens: usize },
    /// The first `n` waiting requests, prefilled together in one padded
    /// forward this step.
    Group(usize),
}

/// Decides one step under `budget`'s tokens: every decode row, then
/// chunks for the sequences catching up (oldest first), then, from what
/// is left, the next start: a preempted row before anything waiting (it
/// rejoins first), and a waiting request while its KV fits the free
/// blocks (in order: a small one behind does not overtake). A padded
/// group of short prompts has its own width budget (`group_tokens`) and
/// starts only in a step no chunk took. Rows never exceed `row_limit`.
pub fn plan<Q: IntoIterator<Item = Candidate>>(
    state: State<'_, Q>,
    budget: PrefillBudget,
) -> StepPlan {
    let mut left = prompt_tokens(budget.chunk, state.decoding);
    let chunks: Vec<usize> = state
        .catching_up
        .iter()
        .map(|c| {
            let take = c.left().min(left);
            left -= take;
            take
        })
        .collect();
    let rows = state.decoding + state.catching_up.len();
    let admit = match (left, state.preempted.first()) {
        (0, _) => None,
        _ if rows >= state.row_limit => None,
        (tokens, Some(&context)) => Some(Admit::Rejoin {
            tokens: tokens.min(context),
        }),
        (tokens, None) => {
            let room = state.row_limit - rows;
            match admit::plan(state.waiting, room, state.free_blocks, budget) {
                Some(Start::Chunked) => Some(Admit::Chunked { tokens }),
                Some(Start::Group(n)) if chunks.iter().all(|&c| c == 0) => Some(Admit::Group(n)),
                _ => None,
            }
        }
    };
    StepPlan {
        decode: state.decoding,
        chunks,
        admit,
    }
}

/// Prompt tokens a step of `budget` tokens takes beside `decoding` rows:
/// the rest of the budget, but never under half of it, so a prompt still
/// moves beside a batch as wide as the budget.
pub fn prompt_tokens(budget: usize, decoding: usize) -> usize {
    budget.saturating_sub(decoding).max(budget.div_ceil(2))
}

/// What a step that ran out of memory leaves: of `admitted` rows, how
/// many end now (the newest; after [`OOM_RETRIES`] failures in a row,
/// half, at least one), and the row limit while the rest are recomputed.
pub fn after_oom(
    admitted: usize,
    streak: u32,
    cap: Option<RowCap>,
    now: Instant,
) -> (usize, RowCap) {
    let shed = if streak > OOM_RETRIES {
        (admitted / 2).max(1).min(admitted)
    } else {
        0
    };
    // A first failure halves what was admitted; each further one in a
    // row halves the cap again, even while rows are still rejoining.
    let cap = match cap {
        Some(cap) if streak > 1 => cap.halved(now),
        _ => RowCap::after_failure(admitted, now),
    };
    (shed, cap)
}

/// Steps in a row that may run out of memory before rows are ended.
pub const OOM_RETRIES: u32 = 3;

/// How long the row count that ran out of memory stays out of reach.
const ROW_CEILING_LIFTS_AFTER: Duration = Duration::from_secs(60);

/// The row limit after a step ran out of memory with `n` rows: half of
/// them at first, one more per row that finishes, but below `n` until a
/// minute passes without another failure (else the batch would grow back
/// into the same failure again and again, recomputing its rows each time).
#[derive(Debug, Clone, Copy)]
pub struct RowCap {
    rows: usize,
    ceiling: usize,
    since: Instant,
}

impl RowCap {
    fn after_failure(n: usize, now: Instant) -> Self {
        Self {
            rows: (n / 2).max(1),
            ceiling: n.saturating_sub(1).max(1),
            since: now,
        }
    }

    /// After another failure in a row: half the rows, under the ceiling
    /// the first failure set.
    fn halved(self, now: Instant) -> Self {
        Self {
            rows: (self.rows / 2).max(1),
            since: now,
            ..self
        }
    }

    fn ceiling(&self, now: Instant) -> usize {
        if now.duration_since(self.since) < ROW_CEILING_LIFTS_AFTER {
            self.ceiling
        } else {
            usize::MAX
        }
    }

    /// `n` rows finished: as many more may run, up to the ceiling. `None`:
    /// the cap reached `max_batch` and is lifted.
    pub fn rows_finished(mut self, n: usize, max_batch: usize, now: Instant) -> Option<Self> {
        self.rows = (self.rows + n).min(self.ceiling(now));
        (self.rows < max_batch).then_some(self)
    }

    pub fn limit(&self) -> usize {
        self.rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admit::tests::short;

    fn state<'a>(
        decoding: usize,
        catching_up: &'a [Prefill],
        preempted: &'a [usize],
        waiting: &'a [Candidate],
    ) -> State<'a, std::iter::Copied<std::slice::Iter<'a, Candidate>>> {
        State {
            decoding,
            catching_up,
            preempted,
            waiting: waiting.iter().copied(),
            free_blocks: 100,
            row_limit: 32,
        }
    }

    const BUDGET: PrefillBudget = PrefillBudget {
        chunk: 256,
        group_tokens: 256,
        width_multiple: 1,
    };

    fn prompt(target: usize) -> Prefill {
        Prefill::new(0, target, None)
    }

    #[test]
    fn decode_rows_spend_the_budget_first_and_a_long_prompt_the_rest() {
        let long = [prompt(1000)];
        let p = plan(state(7, &long, &[], &[]), BUDGET);
        assert_eq!((p.decode, p.chunks, p.admit), (7, vec![249], None));
        // Beside a batch as wide as the budget, half of it still goes to
        // the prompt.
        let p = plan(state(300, &long, &[], &[]), BUDGET);
        assert_eq!(p.chunks, vec![128]);
        assert_eq!(prompt_tokens(8, 4), 4);
        assert_eq!(prompt_tokens(8, 0), 8);
    }

    #[test]
    fn what_the_oldest_prompt_leaves_goes_to_the_next_then_starts_a_waiting_one() {
        let two = [Prefill::new(900, 1000, None), prompt(1000)];
        let p = plan(state(6, &two, &[], &[short(1000)]), BUDGET);
        assert_eq!(p.chunks, vec![100, 150]);
        assert_eq!(p.admit, None, "nothing left");
        let one = [Prefill::new(900, 1000, None)];
        let p = plan(state(6, &one, &[], &[short(1000)]), BUDGET);
        assert_eq!(p.chunks, vec![100]);
        assert_eq!(p.admit, Some(Admit::Chunked { tokens: 150 }));
    }

    #[test]
    fn a_waiting_request_starts_only_with_a_row_free_and_its_kv_free() {
        let one = [Prefill::new(900, 1000, None)];
        let waiting = [short(1000)];
        let full = State {
            row_limit: 7,
            ..state(6, &one, &[], &waiting)
        };
        assert_eq!(plan(full, BUDGET).admit, None, "rows at the limit");
        let big = [Candidate {
            blocks: 101,
            ..short(1000)
        }];
        assert_eq!(plan(state(6, &one, &[], &big), BUDGET).admit, None, "KV");
    }

    #[test]
    fn preempted_rows_rejoin_before_anything_waiting_starts() {
        let p = plan(state(2, &[], &[400, 30], &[short(8)]), BUDGET);
        assert_eq!(p.admit, Some(Admit::Rejoin { tokens: 254 }));
        let p = plan(state(2, &[], &[40, 30], &[short(8)]), BUDGET);
        assert_eq!(p.admit, Some(Admit::Rejoin { tokens: 40 }));
    }

    #[test]
    fn a_padded_group_starts_only_in_a_step_no_chunk_took() {
        let eight = [short(8); 8];
        let p = plan(state(3, &[], &[], &eight), BUDGET);
        assert_eq!(p.admit, Some(Admit::Group(8)));
        let one = [Prefill::new(90, 100, None)];
        assert_eq!(plan(state(3, &one, &[], &eight), BUDGET).admit, None);
        // A prompt that just finished its chunks leaves the step to them.
        let done = [Prefill::new(100, 100, None)];
        let p = plan(state(3, &done, &[], &eight), BUDGET);
        assert_eq!((p.chunks, p.admit), (vec![0], Some(Admit::Group(8))));
    }

    #[test]
    fn running_out_of_memory_halves_the_rows_then_ends_the_newest() {
        let t0 = Instant::now();
        let (shed, cap) = after_oom(8, 1, None, t0);
        assert_eq!((shed, cap.limit()), (0, 4));
        let (shed, cap) = after_oom(8, 2, Some(cap), t0);
        assert_eq!((shed, cap.limit()), (0, 2));
        let (shed, cap) = after_oom(3, OOM_RETRIES + 1, Some(cap), t0);
        assert_eq!((shed, cap.limit()), (1, 1));
        // Rows that finish let as many more in, under the first failure's
        // ceiling (7) for a minute, and the cap goes at `max_batch`.
        let (_, cap) = after_oom(8, 1, None, t0);
        let cap = cap.rows_finished(10, 32, t0).unwrap();
        assert_eq!(cap.limit(), 7);
        let later = t0 + ROW_CEILING_LIFTS_AFTER;
        assert!(cap.rows_finished(30, 32, later).is_none());
    }
}
