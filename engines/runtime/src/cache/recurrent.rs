//! Linear-attention layers (Qwen 3.5's Gated DeltaNet) hold no keys or
//! values but a per-row [`Recurrent`] state of constant size, which moves
//! with its row through every batch operation. It cannot be cut back by
//! dropping columns: a rollback restores the state after an earlier
//! position of the last forward, kept when steps are kept
//! ([`crate::KvCache::keep_steps`]).

use anyhow::anyhow;
use mlx_rs::{ops, Array};

use crate::slices::slice;

/// Forwards of up to this many positions keep their per-position
/// recurrent states when steps are kept (a verify of drafted tokens);
/// longer ones (prefill chunks) cannot be rolled back.
pub const MAX_ROLLBACK_STEPS: i32 = 64;

/// One linear-attention layer's state, per row of the batch.
#[derive(Clone)]
pub struct Recurrent {
    /// `[B, conv_kernel - 1, conv_dim]`: the convolution's last inputs.
    pub conv: Array,
    /// `[B, value_heads, value_head_dim, key_head_dim]`, float32.
    pub ssm: Array,
}

/// What rolling a linear layer back within its last forward needs.
#[derive(Clone)]
pub struct Steps {
    /// The state before the forward.
    pub before: Recurrent,
    /// `[B, conv_kernel - 1 + S, conv_dim]`: the old convolution inputs
    /// followed by the forward's.
    pub conv_input: Array,
    /// The delta-rule state after each of the S positions.
    pub ssm: Vec<Array>,
}

impl Recurrent {
    fn map(&self, f: impl Fn(&Array) -> anyhow::Result<Array>) -> anyhow::Result<Self> {
        Ok(Self {
            conv: f(&self.conv)?,
            ssm: f(&self.ssm)?,
        })
    }

    /// The rows `idx` lists, in that order.
    fn rows(&self, idx: &Array) -> anyhow::Result<Self> {
        self.map(|a| Ok(a.take_axis(idx, 0)?))
    }

    /// `states` stacked row by row.
    fn stack(states: &[Recurrent]) -> anyhow::Result<Self> {
        Ok(Recurrent {
            conv: ops::concatenate(&states.iter().map(|r| &r.conv).collect::<Vec<_>>(), 0)?,
            ssm: ops::concatenate(&states.iter().map(|r| &r.ssm).collect::<Vec<_>>(), 0)?,
        })
    }

    /// Bytes held, all rows.
    pub fn nbytes(&self) -> usize {
        self.conv.nbytes() + self.ssm.nbytes()
    }
}

impl Steps {
    /// The state after the first `n` positions of the forward.
    fn after(&self, n: usize) -> anyhow::Result<Recurrent> {
        if n == 0 {
            return Ok(self.before.clone());
        }
        let keep = self.before.conv.dim(1);
        let s = self.conv_input.shape();
        Ok(Recurrent {
            conv: slice(
                &self.conv_input,
                &[0, n as i32, 0],
                &[s[0], n as i32 + keep, s[2]],
            )?,
            ssm: self.ssm[n - 1].clone(),
        })
    }

    /// The state (every row) `n` positions before the end of the forward.
    fn back(&self, n: i32) -> anyhow::Result<Recurrent> {
        let s = self.ssm.len() as i32;
        anyhow::ensure!(
            n <= s,
            "cannot roll a recurrent state back {n} positions, its last forward had {s}"
        );
        self.after((s - n) as usize)
    }
}

/// Every layer's recurrent state (`None` for attention layers and before a
/// linear layer's first forward), and what rolls each back.
#[derive(Clone)]
pub(crate) struct RecurrentLayers {
    states: Vec<Option<Recurrent>>,
    /// Per linear layer, the states after each position of the last
    /// forward (kept only when `keep_steps` is on).
    steps: Vec<Option<Steps>>,
    keep_steps: bool,
}

impl RecurrentLayers {
    pub(crate) fn new(states: Vec<Option<Recurrent>>, keep_steps: bool) -> Self {
        Self {
            steps: vec![None; states.len()],
            states,
            keep_steps,
        }
    }

    /// The same states, no steps kept yet.
    pub(crate) fn without_steps(&self) -> Self {
        Self::new(self.states.clone(), self.keep_steps)
    }

    pub(crate) fn states(&self) -> &[Option<Recurrent>] {
        &self.states
    }

    pub(crate) fn set(&mut self, layer: usize, state: Recurrent, steps: Option<Steps>) {
        self.states[layer] = Some(state);
        self.steps[layer] = steps;
    }

    pub(crate) fn keeps_steps(&self) -> bool {
        self.keep_steps
    }

    pub(crate) fn keep_steps(&mut self, on: bool) {
        self.keep_steps = on;
        if !on {
            self.forget_steps();
        }
    }

    fn forget_steps(&mut self) {
        self.steps.iter_mut().for_each(|s| *s = None);
    }

    /// The states' arrays, for evaluation.
    pub(crate) fn arrays(&self) -> impl Iterator<Item = Array> + '_ {
        self.states
            .iter()
            .flatten()
            .flat_map(|r| [r.conv.clone(), r.ssm.clone()])
    }

    pub(crate) fn nbytes(&self) -> usize {
        self.states.iter().flatten().map(Recurrent::nbytes).sum()
    }

    /// Keeps the rows `idx` lists, in that order; the steps kept go.
    pub(crate) fn select_rows(&mut self, idx: &Array) -> anyhow::Result<()> {
        for r in self.states.iter_mut().flatten() {
            *r = r.rows(idx)?;
        }
        self.forget_steps();
        Ok(())
    }

    /// Row `b`'s states, without steps.
    pub(crate) fn row(&self, b: usize) -> anyhow::Result<Self> {
        let idx = Array::from_slice(&[b as i32], &[1]);
        let states = self
            .states
            .iter()
            .map(|r| r.as_ref().map(|r| r.rows(&idx)).transpose())
            .collect::<anyhow::Result<_>>()?;
        Ok(Self::new(states, false))
    }

    /// The parts' states (each with its number of rows) stacked row by
    /// row; a part that has not run a layer yet (no tokens) contributes
    /// zero states. Steps are kept on if any part keeps them.
    pub(crate) fn merge(parts: &[(&RecurrentLayers, usize)]) -> anyhow::Result<Self> {
        let layers = parts[0].0.states.len();
        let states = (0..layers)
            .map(|l| {
                let Some(like) = parts.iter().find_map(|(p, _)| p.states[l].as_ref()) else {
                    return Ok(None);
                };
                let rows = parts
                    .iter()
                    .map(|(p, rows)| match &p.states[l] {
                        Some(r) => Ok(r.clone()),
                        None => like.map(|a| {
                            let mut shape = a.shape().to_vec();
                            shape[0] = *rows as i32;
                            Ok(ops::zeros_dtype(&shape, a.dtype())?)
                        }),
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                Recurrent::stack(&rows).map(Some)
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self::new(states, parts.iter().any(|(p, _)| p.keep_steps)))
    }

    /// Each row `b` back to its state `drop[b]` positions before the end
    /// of the last forward (a speculative rollback), from the steps kept.
    pub(crate) fn roll_back(&mut self, drop: &[i32]) -> anyhow::Result<()> {
        let Some(&first) = drop.first() else {
            return Ok(());
        };
        for l in 0..self.states.len() {
            if self.states[l].is_none() {
                continue;
            }
            let steps = self.steps[l].as_ref().ok_or_else(|| {
                anyhow!("cannot roll a recurrent state back: its steps were not kept")
            })?;
            let state = if drop.iter().all(|&d| d == first) {
                steps.back(first)?
            } else {
                let rows = drop
                    .iter()
                    .enumerate()
                    .map(|(b, &d)| steps.back(d)?.rows(&Array::from_slice(&[b as i32], &[1])))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                Recurrent::stack(&rows)?
            };
            self.states[l] = Some(state);
            self.steps[l] = None;
        }
        Ok(())
    }
}
