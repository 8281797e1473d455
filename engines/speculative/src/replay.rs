//! A draft source that proposes a continuation known in advance: given the
//! target's own greedy continuation of each prompt, it is a drafter that
//! always agrees, so every draft is accepted and a round commits its full
//! block. The tests use it to check full acceptance (and, garbled, a
//! drafter that is always wrong); the benchmarks use it to measure what the
//! verify machinery gives at best.

use std::collections::HashMap;
use std::ops::Range;

use runtime::model::{Tapped, Taps};
use runtime::{KvCache, Model};

use crate::draft::{DraftSource, DraftState, Proposal};

pub struct Replay {
    /// Prompt, then what is proposed after it.
    continuations: HashMap<Vec<u32>, Vec<u32>>,
    max_draft: usize,
}

impl Replay {
    pub fn new(continuations: HashMap<Vec<u32>, Vec<u32>>, max_draft: usize) -> Self {
        Self {
            continuations,
            max_draft,
        }
    }

    /// Every proposed token changed (`t ^ 1`): a drafter that is always
    /// wrong.
    pub fn garbled(mut self) -> Self {
        self.continuations
            .values_mut()
            .flatten()
            .for_each(|t| *t ^= 1);
        self
    }
}

impl DraftSource for Replay {
    fn taps(&self) -> Taps {
        Taps::default()
    }

    fn max_draft(&self) -> usize {
        self.max_draft
    }

    fn start(&self) -> Box<dyn DraftState> {
        Box::new(ReplayState(self.continuations.clone()))
    }
}

struct ReplayState(HashMap<Vec<u32>, Vec<u32>>);

impl DraftState for ReplayState {
    fn observe(&mut self, _: &Model, _: &Tapped, _: Range<i32>) -> anyhow::Result<()> {
        Ok(())
    }

    /// The next `k` tokens of the continuation of the prompt `history`
    /// starts with (none: nothing to propose).
    fn propose(
        &mut self,
        _: &Model,
        _: &KvCache,
        history: &[u32],
        k: usize,
    ) -> anyhow::Result<Proposal> {
        let next: Vec<u32> = self
            .0
            .iter()
            .find(|(prompt, _)| history.starts_with(prompt))
            .map(|(prompt, cont)| {
                cont.iter()
                    .skip(history.len() - prompt.len())
                    .take(k)
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        Ok(Proposal::tokens(next, 0))
    }
}
