//! KV cache for one sequence or a left-padded batch of sequences.
//!
//! Per layer, keys and values live in one buffer `[B, kv_heads, capacity,
//! head_dim]` that grows in steps (like mlx-lm's cache) and is written in
//! place with `slice_update`. Rows of a batch are right-aligned: row `b`
//! holds `left_pad[b]` padding columns before its first real token, so all
//! rows append at the same column and a decode step is one batched forward.
//!
//! Linear-attention layers (Qwen 3.5's Gated DeltaNet) hold no keys or
//! values but a per-row [`Recurrent`] state of constant size, which moves
//! with its row through every batch operation. It cannot be cut back by
//! dropping columns: a rollback restores the state after an earlier
//! position of the last forward, kept when [`KvCache::keep_steps`] is on.

use anyhow::anyhow;
use mlx_rs::{ops, Array};

use crate::layers::Offsets;

/// Capacity grows in multiples of this many positions.
const STEP: i32 = 256;

/// Forwards of up to this many positions keep their per-position
/// recurrent states when steps are kept (a verify of drafted tokens);
/// longer ones (prefill chunks) cannot be rolled back.
pub const MAX_ROLLBACK_STEPS: i32 = 64;

#[derive(Clone)]
pub struct KvCache {
    pub(crate) keys: Vec<Option<Array>>,
    pub(crate) values: Vec<Option<Array>>,
    /// Filled columns (padding included).
    pub(crate) len: i32,
    pub(crate) capacity: i32,
    pub(crate) left_pad: Vec<i32>,
    /// Per layer: the recurrent state of a linear-attention layer.
    pub(crate) recurrent: Vec<Option<Recurrent>>,
    /// Per linear layer, the states after each position of the last
    /// forward (kept only when `keep_steps` is on).
    steps: Vec<Option<Steps>>,
    keep_steps: bool,
}

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
}

impl KvCache {
    pub fn new(num_layers: usize, batch: usize) -> Self {
        Self {
            keys: vec![None; num_layers],
            values: vec![None; num_layers],
            len: 0,
            capacity: 0,
            left_pad: vec![0; batch],
            recurrent: vec![None; num_layers],
            steps: vec![None; num_layers],
            keep_steps: false,
        }
    }

    /// Keeps each linear layer's per-position states of the last forward
    /// (of at most [`MAX_ROLLBACK_STEPS`] positions), so
    /// [`KvCache::truncate`] can roll rejected drafted tokens back
    /// (speculative decoding); costs one state per position verified.
    pub fn keep_steps(&mut self, on: bool) {
        self.keep_steps = on;
        if !on {
            self.steps.iter_mut().for_each(|s| *s = None);
        }
    }

    pub fn keeps_steps(&self) -> bool {
        self.keep_steps
    }

    /// Layer `layer`'s recurrent state, `None` before its first forward.
    pub fn recurrent(&self, layer: usize) -> Option<&Recurrent> {
        self.recurrent[layer].as_ref()
    }

    pub(crate) fn set_recurrent(&mut self, layer: usize, state: Recurrent, steps: Option<Steps>) {
        self.recurrent[layer] = Some(state);
        self.steps[layer] = steps;
    }

    /// Whether any layer holds a recurrent state (a hybrid model's cache).
    pub fn has_recurrent(&self) -> bool {
        self.recurrent.iter().any(Option::is_some)
    }

    /// Bytes of the recurrent states, all rows.
    pub fn recurrent_bytes(&self) -> usize {
        self.recurrent.iter().flatten().map(Recurrent::nbytes).sum()
    }

    /// A batch cache whose rows will be filled by one prefill of prompts
    /// left-padded to a common length.
    pub fn with_left_padding(num_layers: usize, left_pad: Vec<i32>) -> Self {
        let mut cache = Self::new(num_layers, left_pad.len());
        cache.left_pad = left_pad;
        cache
    }

    pub fn batch_size(&self) -> usize {
        self.left_pad.len()
    }

    /// Columns filled, padding included.
    pub fn len(&self) -> i32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn left_padding(&self) -> &[i32] {
        &self.left_pad
    }

    /// Tokens of row `b` held in the cache (its sequence position).
    pub fn row_len(&self, b: usize) -> i32 {
        self.len - self.left_pad[b]
    }

    /// Position of the next token of every row.
    pub fn offsets(&self) -> Offsets {
        if self.left_pad.iter().all(|&p| p == 0) && self.left_pad.len() == 1 {
            Offsets::Scalar(self.len)
        } else {
            let o: Vec<i32> = self.left_pad.iter().map(|p| self.len - p).collect();
            Offsets::PerRow(Array::from_slice(&o, &[o.len() as i32]))
        }
    }

    /// Writes `n` new positions of layer `layer` at the end and returns the
    /// layer's keys and values up to and including them. Call
    /// [`KvCache::advance`] once all layers are written.
    pub fn update(&mut self, layer: usize, k: Array, v: Array) -> anyhow::Result<(Array, Array)> {
        let n = k.dim(2);
        let end = self.len + n;
        if end > self.capacity {
            let new_capacity = round_up(end);
            for l in 0..self.keys.len() {
                self.keys[l] = grow(self.keys[l].take(), self.len, new_capacity)?;
                self.values[l] = grow(self.values[l].take(), self.len, new_capacity)?;
            }
            self.capacity = new_capacity;
        }
        let keys = write(self.keys[layer].take(), &k, self.len, self.capacity)?;
        let values = write(self.values[layer].take(), &v, self.len, self.capacity)?;
        let k_view = slice_cols(&keys, 0, end)?;
        let v_view = slice_cols(&values, 0, end)?;
        self.keys[layer] = Some(keys);
        self.values[layer] = Some(values);
        Ok((k_view, v_view))
    }

    /// Layer `layer`'s keys and values for the filled columns, `[B,
    /// kv_heads, len, head_dim]` (rope applied), for drafters that attend
    /// into the target's cache without writing it.
    pub fn layer_kv(&self, layer: usize) -> anyhow::Result<Option<(Array, Array)>> {
        match (&self.keys[layer], &self.values[layer]) {
            (Some(k), Some(v)) => Ok(Some((
                slice_cols(k, 0, self.len)?,
                slice_cols(v, 0, self.len)?,
            ))),
            _ => Ok(None),
        }
    }

    /// The buffers, for evaluating them between prefill chunks.
    pub fn state(&self) -> impl Iterator<Item = &Array> {
        self.keys.iter().chain(self.values.iter()).flatten().chain(
            self.recurrent
                .iter()
                .flatten()
                .flat_map(|r| [&r.conv, &r.ssm]),
        )
    }

    pub fn advance(&mut self, n: i32) {
        self.len += n;
    }

    /// Drops the last `n` positions of every row (speculative rollback).
    /// Linear layers go back to their state after that position, which
    /// must lie within the last forward, with steps kept.
    pub fn truncate(&mut self, n: i32) -> anyhow::Result<()> {
        if n > 0 && self.has_recurrent() {
            for l in 0..self.recurrent.len() {
                if self.recurrent[l].is_none() {
                    continue;
                }
                let steps = self.steps[l].take().ok_or_else(|| {
                    anyhow!("cannot roll a recurrent state back: its steps were not kept")
                })?;
                let s = steps.ssm.len() as i32;
                anyhow::ensure!(
                    n <= s,
                    "cannot roll a recurrent state back {n} positions, its last forward had {s}"
                );
                self.recurrent[l] = Some(steps.after((s - n) as usize)?);
            }
        }
        self.len = (self.len - n).max(*self.left_pad.iter().max().unwrap_or(&0));
        Ok(())
    }

    /// Keeps only the given rows, in that order, and drops padding columns
    /// that no remaining row needs.
    pub fn select_rows(&mut self, rows: &[usize]) -> anyhow::Result<()> {
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32]);
        self.left_pad = rows.iter().map(|&r| self.left_pad[r]).collect();
        for buf in self.keys.iter_mut().chain(self.values.iter_mut()) {
            if let Some(b) = buf.take() {
                *buf = Some(b.take_axis(&idx, 0)?);
            }
        }
        for r in self.recurrent.iter_mut().flatten() {
            *r = r.map(|a| Ok(a.take_axis(&idx, 0)?))?;
        }
        self.steps.iter_mut().for_each(|s| *s = None);
        let common = self.left_pad.iter().copied().min().unwrap_or(0);
        if common > 0 {
            self.drop_leading(common)?;
        }
        Ok(())
    }

    fn drop_leading(&mut self, cols: i32) -> anyhow::Result<()> {
        for buf in self.keys.iter_mut().chain(self.values.iter_mut()) {
            if let Some(b) = buf.take() {
                *buf = Some(slice_cols(&b, cols, self.capacity)?);
            }
        }
        self.capacity -= cols;
        self.len -= cols;
        for p in &mut self.left_pad {
            *p -= cols;
        }
        Ok(())
    }

    /// Stacks caches into one batch, right-aligning their rows.
    pub fn merge(parts: Vec<KvCache>) -> anyhow::Result<KvCache> {
        let num_layers = parts
            .first()
            .ok_or_else(|| anyhow!("nothing to merge"))?
            .keys
            .len();
        let len = parts.iter().map(|c| c.len).max().unwrap_or(0);
        let capacity = round_up(len.max(1));
        let without_kv: Vec<bool> = (0..num_layers)
            .map(|l| parts.iter().all(|p| p.keys[l].is_none()))
            .collect();
        let recurrent = merge_recurrent(&parts)?;
        let keep_steps = parts.iter().any(|p| p.keep_steps);
        let mut left_pad = Vec::new();
        let mut keys = vec![Vec::new(); num_layers];
        let mut values = vec![Vec::new(); num_layers];
        for part in parts {
            let shift = len - part.len;
            left_pad.extend(part.left_pad.iter().map(|p| p + shift));
            for l in 0..num_layers {
                match (&part.keys[l], &part.values[l]) {
                    (Some(k), Some(v)) => {
                        keys[l].push(align(k, part.len, shift, capacity)?);
                        values[l].push(align(v, part.len, shift, capacity)?);
                    }
                    // Layers that attend to another layer's keys and values
                    // hold none of their own, in every part alike.
                    _ if without_kv[l] => {}
                    _ => return Err(anyhow!("cannot merge an empty cache")),
                }
            }
        }
        let stack = |parts: Vec<Vec<Array>>| -> anyhow::Result<Vec<Option<Array>>> {
            parts
                .into_iter()
                .map(|p| match p.is_empty() {
                    true => Ok(None),
                    false => Ok(Some(ops::concatenate(&p, 0)?)),
                })
                .collect()
        };
        Ok(KvCache {
            keys: stack(keys)?,
            values: stack(values)?,
            len,
            capacity,
            left_pad,
            recurrent,
            steps: vec![None; num_layers],
            keep_steps,
        })
    }

    /// Row `b` as a cache of its own (no padding).
    pub fn extract_row(&self, b: usize) -> anyhow::Result<KvCache> {
        let idx = Array::from_slice(&[b as i32], &[1]);
        let start = self.left_pad[b];
        let mut out = KvCache::new(self.keys.len(), 1);
        let row_len = self.len - start;
        let capacity = round_up(row_len.max(1));
        for l in 0..self.keys.len() {
            if let (Some(k), Some(v)) = (&self.keys[l], &self.values[l]) {
                let k = slice_cols(&k.take_axis(&idx, 0)?, start, self.len)?;
                let v = slice_cols(&v.take_axis(&idx, 0)?, start, self.len)?;
                out.keys[l] = Some(align(&k, row_len, 0, capacity)?);
                out.values[l] = Some(align(&v, row_len, 0, capacity)?);
            }
        }
        for (l, r) in self.recurrent.iter().enumerate() {
            if let Some(r) = r {
                out.recurrent[l] = Some(r.map(|a| Ok(a.take_axis(&idx, 0)?))?);
            }
        }
        out.keep_steps = self.keep_steps;
        out.len = row_len;
        out.capacity = capacity;
        Ok(out)
    }
}

/// The parts' recurrent states stacked row by row; a part that has not run
/// a layer yet (no tokens) contributes zero states.
fn merge_recurrent(parts: &[KvCache]) -> anyhow::Result<Vec<Option<Recurrent>>> {
    let layers = parts[0].recurrent.len();
    (0..layers)
        .map(|l| {
            let Some(like) = parts.iter().find_map(|p| p.recurrent[l].as_ref()) else {
                return Ok(None);
            };
            let zeros = |a: &Array, rows: usize| -> anyhow::Result<Array> {
                let mut shape = a.shape().to_vec();
                shape[0] = rows as i32;
                Ok(ops::zeros_dtype(&shape, a.dtype())?)
            };
            let (mut conv, mut ssm) = (Vec::new(), Vec::new());
            for p in parts {
                match &p.recurrent[l] {
                    Some(r) => {
                        conv.push(r.conv.clone());
                        ssm.push(r.ssm.clone());
                    }
                    None => {
                        conv.push(zeros(&like.conv, p.batch_size())?);
                        ssm.push(zeros(&like.ssm, p.batch_size())?);
                    }
                }
            }
            Ok(Some(Recurrent {
                conv: ops::concatenate(&conv, 0)?,
                ssm: ops::concatenate(&ssm, 0)?,
            }))
        })
        .collect()
}

/// `buf[:, :, :len]` shifted right by `shift` columns inside a zeroed buffer
/// of `capacity` columns.
fn align(buf: &Array, len: i32, shift: i32, capacity: i32) -> anyhow::Result<Array> {
    let used = slice_cols(buf, 0, len)?;
    let s = buf.shape();
    let mut pieces = Vec::new();
    if shift > 0 {
        pieces.push(ops::zeros_dtype(&[s[0], s[1], shift, s[3]], buf.dtype())?);
    }
    pieces.push(used);
    let tail = capacity - shift - len;
    if tail > 0 {
        pieces.push(ops::zeros_dtype(&[s[0], s[1], tail, s[3]], buf.dtype())?);
    }
    Ok(ops::concatenate(&pieces, 2)?)
}

fn grow(buf: Option<Array>, len: i32, capacity: i32) -> anyhow::Result<Option<Array>> {
    match buf {
        None => Ok(None),
        Some(b) => Ok(Some(align(&b, len, 0, capacity)?)),
    }
}

fn write(buf: Option<Array>, update: &Array, at: i32, capacity: i32) -> anyhow::Result<Array> {
    let s = update.shape().to_vec();
    let buf = match buf {
        Some(b) => b,
        None => ops::zeros_dtype(&[s[0], s[1], capacity, s[3]], update.dtype())?,
    };
    let start = [0, 0, at, 0];
    let stop = [s[0], s[1], at + s[2], s[3]];
    let strides = [1, 1, 1, 1];
    ffi_op(|res, stream| unsafe {
        mlx_sys::mlx_slice_update(
            res,
            buf.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            4,
            stop.as_ptr(),
            4,
            strides.as_ptr(),
            4,
            stream,
        )
    })
}

/// `buf[:, :, from:to, :]`.
fn slice_cols(buf: &Array, from: i32, to: i32) -> anyhow::Result<Array> {
    let s = buf.shape();
    slice(buf, &[0, 0, from, 0], &[s[0], s[1], to, s[3]])
}

/// A strided view `a[start:stop]` over every axis (no copy).
pub fn slice(a: &Array, start: &[i32], stop: &[i32]) -> anyhow::Result<Array> {
    let strides = vec![1; start.len()];
    ffi_op(|res, stream| unsafe {
        mlx_sys::mlx_slice(
            res,
            a.as_ptr(),
            start.as_ptr(),
            start.len(),
            stop.as_ptr(),
            stop.len(),
            strides.as_ptr(),
            strides.len(),
            stream,
        )
    })
}

/// Runs one mlx-c op that mlx-rs does not wrap with the signature we need.
fn ffi_op(
    f: impl FnOnce(*mut mlx_sys::mlx_array, mlx_sys::mlx_stream) -> i32,
) -> anyhow::Result<Array> {
    let stream = mlx_rs::Stream::thread_local_or_default();
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        if f(&mut res, stream.as_ptr()) != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(anyhow!("mlx slice operation failed"));
        }
        Ok(Array::from_ptr(res))
    }
}

fn round_up(n: i32) -> i32 {
    (n + STEP - 1) / STEP * STEP
}
