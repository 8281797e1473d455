//! KV cache for one sequence or a left-padded batch of sequences.
//!
//! Per layer, keys and values live in buffers `[B, kv_heads, capacity, _]`
//! (in the activations' dtype, or quantized: see [`crate::kv_quant`]) that
//! grow in steps (like mlx-lm's cache) and are written in place with
//! `slice_update`. Rows of a batch are right-aligned: row `b`
//! holds `left_pad[b]` padding columns before its first real token, so all
//! rows append at the same column and a decode step is one batched forward.
//!
//! Linear-attention layers (Qwen 3.5's Gated DeltaNet) hold no keys or
//! values but a per-row [`Recurrent`] state of constant size, which moves
//! with its row through every batch operation. It cannot be cut back by
//! dropping columns: a rollback restores the state after an earlier
//! position of the last forward, kept when [`KvCache::keep_steps`] is on.
//!
//! A cache can instead be paged ([`KvCache::paged`]): its keys and values
//! live in a [`PagePool`]'s blocks, listed per row, and the columns above
//! are a view of them (row `b`'s column `c` is its position `c -
//! left_pad[b]`). Every operation keeps its meaning; those that move
//! columns around only edit the rows' block tables.

use std::sync::{Arc, Mutex};

use anyhow::anyhow;
use mlx_rs::{ops, Array};

use crate::kv_quant::KvQuant;
use crate::layers::Offsets;
use crate::paged::{self, BlockRef, PagePool};

/// Capacity grows in multiples of this many positions.
const STEP: i32 = 256;

/// One layer's storage: keys and values in the model's dtype, or quantized
/// (`model.kv_cache`). Every buffer is `[B, kv_heads, capacity, _]` and
/// column-aligned with the cache, so growing, row selection, padding and
/// truncation treat both kinds alike.
#[derive(Clone)]
pub(crate) struct LayerKv {
    pub(crate) quant: Option<KvQuant>,
    /// Empty until the layer is first written (and forever for a layer
    /// that reads another layer's): `[keys, values]`, or quantized `[key
    /// codes, key scales, key biases, value codes, value scales, value
    /// biases]`.
    pub(crate) buffers: Vec<Array>,
}

impl LayerKv {
    fn new(quant: Option<KvQuant>) -> Self {
        Self {
            quant,
            buffers: Vec::new(),
        }
    }

    fn map(&mut self, f: impl Fn(&Array) -> anyhow::Result<Array>) -> anyhow::Result<()> {
        for b in &mut self.buffers {
            *b = f(b)?;
        }
        Ok(())
    }

    /// The buffers' first `len` columns as attention reads them.
    fn view(&self, len: i32) -> anyhow::Result<Option<LayerView>> {
        let cols = self
            .buffers
            .iter()
            .map(|b| slice_cols(b, 0, len))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(match (self.quant, <[Array; 2]>::try_from(cols)) {
            (_, Err(cols)) if cols.is_empty() => None,
            (None, Ok([k, v])) => Some(LayerView::Dense(k, v)),
            (Some(quant), Err(mut cols)) if cols.len() == 6 => {
                let values = cols.split_off(3);
                Some(LayerView::Quantized {
                    quant,
                    keys: cols,
                    values,
                })
            }
            _ => return Err(anyhow!("KV layer buffers do not match its format")),
        })
    }
}

/// A layer's keys and values for every filled column, as attention reads
/// them (`[B, kv_heads, len, _]`, rope applied).
#[derive(Clone)]
pub enum LayerView {
    Dense(Array, Array),
    /// `[codes, scales, biases]` each.
    Quantized {
        quant: KvQuant,
        keys: Vec<Array>,
        values: Vec<Array>,
    },
    /// A paged cache's layer: the pool's key and value buffers (`[slots,
    /// kv_heads, head_dim]`) and where each row's columns lie in them.
    Paged {
        keys: Array,
        values: Array,
        read: PagedRead,
    },
}

/// Where a paged batch's columns `0..total` lie in its pool, for one
/// forward: as slots for a gather, and as block tables for the attention
/// kernel ([`crate::ragged::paged_attention`]).
#[derive(Clone)]
pub struct PagedRead {
    /// `B * total`: row-major slots of every column.
    slots: Arc<[i32]>,
    /// `slots` as an array, made by the forward's first gather and shared
    /// by every layer's (the kernel reads `tables` and needs none).
    slot_index: Arc<Mutex<Option<Array>>>,
    /// `[B, most blocks]`: each row's block ids (0 past its end).
    pub tables: Array,
    pub block: i32,
    pub total: i32,
    pub rows: i32,
}

impl PagedRead {
    /// `buf` (`[slots, kv_heads, width]`) gathered into the batch's columns,
    /// `[B, kv_heads, total, width]`.
    pub fn gather(&self, buf: &Array) -> anyhow::Result<Array> {
        let s = buf.shape();
        let index = paged::lock(&self.slot_index)
            .get_or_insert_with(|| Array::from_slice(&self.slots, &[self.slots.len() as i32]))
            .clone();
        Ok(buf
            .take_axis(&index, 0)?
            .reshape(&[self.rows, self.total, s[1], s[2]])?
            .transpose_axes(&[0, 2, 1, 3])?)
    }
}

impl LayerView {
    /// Keys and values in the activations' dtype (dequantized where stored
    /// quantized), for readers that need plain arrays.
    pub fn dense(&self) -> anyhow::Result<(Array, Array)> {
        Ok(match self {
            LayerView::Dense(k, v) => (k.clone(), v.clone()),
            LayerView::Quantized {
                quant,
                keys,
                values,
            } => (quant.dequantize(keys)?, quant.dequantize(values)?),
            LayerView::Paged { keys, values, read } => (read.gather(keys)?, read.gather(values)?),
        })
    }
}

/// Forwards of up to this many positions keep their per-position
/// recurrent states when steps are kept (a verify of drafted tokens);
/// longer ones (prefill chunks) cannot be rolled back.
pub const MAX_ROLLBACK_STEPS: i32 = 64;

#[derive(Clone)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerKv>,
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
    /// The rows' blocks when the cache is paged (`layers` then hold no
    /// buffers of their own).
    paged: Option<Paged>,
}

/// A paged cache's rows.
#[derive(Clone)]
pub(crate) struct Paged {
    pool: PagePool,
    /// Per row, the blocks holding its positions in order.
    tables: Vec<Vec<BlockRef>>,
    /// The forward under way: its new positions' slots (`B * n`) and
    /// what its attention reads, set by its first write and cleared by
    /// [`KvCache::advance`].
    forward: Option<(Arc<[i32]>, PagedRead)>,
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
    /// A cache of `num_layers` layers in the activations' dtype.
    pub fn new(num_layers: usize, batch: usize) -> Self {
        Self::with_formats(vec![None; num_layers], vec![0; batch])
    }

    /// A batch cache whose layer `l` stores quantized with `formats[l]`
    /// (`None`: the activations' dtype) and whose rows will be filled by one
    /// prefill of prompts left-padded to a common length.
    pub fn with_formats(formats: Vec<Option<KvQuant>>, left_pad: Vec<i32>) -> Self {
        let num_layers = formats.len();
        Self {
            layers: formats.into_iter().map(LayerKv::new).collect(),
            len: 0,
            capacity: 0,
            left_pad,
            recurrent: vec![None; num_layers],
            steps: vec![None; num_layers],
            keep_steps: false,
            paged: None,
        }
    }

    /// An empty paged batch cache whose rows will be filled by one prefill
    /// of prompts left-padded by `left_pad` columns each, its keys and
    /// values in `pool`'s blocks.
    pub fn paged(pool: &PagePool, formats: Vec<Option<KvQuant>>, left_pad: Vec<i32>) -> Self {
        let rows = left_pad.len();
        let mut cache = Self::with_formats(formats, left_pad);
        cache.paged = Some(Paged {
            pool: pool.clone(),
            tables: vec![Vec::new(); rows],
            forward: None,
        });
        cache
    }

    /// The pool of a paged cache.
    pub fn page_pool(&self) -> Option<&PagePool> {
        self.paged.as_ref().map(|p| &p.pool)
    }

    /// A paged single row's pool and blocks (what crosses the plugin
    /// boundary in place of arrays).
    pub(crate) fn paged_table(&self) -> Option<(&PagePool, &[BlockRef])> {
        let p = self.paged.as_ref()?;
        match p.tables.as_slice() {
            [table] => Some((&p.pool, table)),
            _ => None,
        }
    }

    /// Makes this single-row cache (its `len` and formats set) a paged one
    /// over `table`'s blocks of `pool`.
    pub(crate) fn set_paged_table(&mut self, pool: &PagePool, table: Vec<BlockRef>) {
        self.paged = Some(Paged {
            pool: pool.clone(),
            tables: vec![table],
            forward: None,
        });
        self.capacity = self.len;
    }

    /// This cache with its keys and values moved into `pool`'s blocks
    /// (itself when already paged there).
    pub fn into_paged(self, pool: &PagePool) -> anyhow::Result<KvCache> {
        if let Some(p) = &self.paged {
            if p.pool.same(pool) {
                return Ok(self);
            }
        }
        let this = self.contiguous()?;
        let mut out = KvCache::paged(pool, this.formats(), this.left_pad.clone());
        out.recurrent = this.recurrent.clone();
        out.keep_steps = this.keep_steps;
        if this.len > 0 {
            let slots = out.paged_mut().prepare(0, this.len, &this.left_pad)?;
            for (l, layer) in this.layers.iter().enumerate() {
                if layer.buffers.is_empty() {
                    continue;
                }
                let parts = layer
                    .buffers
                    .iter()
                    .map(|b| slice_cols(b, 0, this.len))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                pool.write(l, &parts, &slots)?;
            }
            out.advance(this.len);
        }
        Ok(out)
    }

    /// This cache with every layer's keys and values in arrays of its own
    /// (a copy out of the pool when paged).
    pub fn contiguous(&self) -> anyhow::Result<KvCache> {
        let Some(p) = &self.paged else {
            return Ok(self.clone());
        };
        let mut out = KvCache::with_formats(self.formats(), self.left_pad.clone());
        out.recurrent = self.recurrent.clone();
        out.keep_steps = self.keep_steps;
        if self.len > 0 {
            let read = p.read(self.len, &self.left_pad)?;
            let capacity = round_up(self.len);
            for (l, layer) in out.layers.iter_mut().enumerate() {
                if let Some(bufs) = p.pool.buffers(l) {
                    layer.buffers = bufs
                        .iter()
                        .map(|b| align(&read.gather(b)?, self.len, 0, capacity))
                        .collect::<anyhow::Result<_>>()?;
                }
            }
            out.len = self.len;
            out.capacity = capacity;
        }
        Ok(out)
    }

    fn paged_mut(&mut self) -> &mut Paged {
        self.paged.as_mut().expect("a paged cache")
    }

    /// Each layer's quantization (`None`: stored in the activations' dtype).
    pub fn formats(&self) -> Vec<Option<KvQuant>> {
        self.layers.iter().map(|l| l.quant).collect()
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

    pub fn batch_size(&self) -> usize {
        self.left_pad.len()
    }

    /// Whether its keys and values live in a page pool's blocks.
    pub fn is_paged(&self) -> bool {
        self.paged.is_some()
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

    /// Writes `n` new positions of layer `layer` at the end (quantizing
    /// only them where the layer stores quantized) and returns the layer's
    /// keys and values up to and including them. Call
    /// [`KvCache::advance`] once all layers are written.
    pub fn update(&mut self, layer: usize, k: Array, v: Array) -> anyhow::Result<LayerView> {
        let n = k.dim(2);
        let end = self.len + n;
        if self.paged.is_some() {
            return self.update_paged(layer, k, v);
        }
        if end > self.capacity {
            let new_capacity = round_up(end);
            let len = self.len;
            for l in &mut self.layers {
                l.map(|b| align(b, len, 0, new_capacity))?;
            }
            self.capacity = new_capacity;
        }
        let entry = &mut self.layers[layer];
        let new = match entry.quant {
            None => vec![k, v],
            Some(q) => q.quantize(&k)?.into_iter().chain(q.quantize(&v)?).collect(),
        };
        let mut buffers = std::mem::take(&mut entry.buffers).into_iter();
        entry.buffers = new
            .iter()
            .map(|part| write(buffers.next(), part, self.len, self.capacity))
            .collect::<anyhow::Result<_>>()?;
        entry
            .view(end)?
            .ok_or_else(|| anyhow!("layer {layer} was not written"))
    }

    /// [`KvCache::update`] of a paged cache: the new positions go to their
    /// rows' blocks (allocated, or copied when shared, at the forward's
    /// first write).
    fn update_paged(&mut self, layer: usize, k: Array, v: Array) -> anyhow::Result<LayerView> {
        let (len, n) = (self.len, k.dim(2));
        let quant = self.layers[layer].quant;
        let p = self.paged.as_mut().expect("a paged cache");
        if p.forward.is_none() {
            let slots = p.prepare(len, n, &self.left_pad)?;
            let read = p.read(len + n, &self.left_pad)?;
            p.forward = Some((slots, read));
        }
        let (slots, read) = p.forward.clone().expect("set above");
        let parts = match quant {
            None => vec![k, v],
            Some(q) => q.quantize(&k)?.into_iter().chain(q.quantize(&v)?).collect(),
        };
        paged_view(quant, p.pool.write(layer, &parts, &slots)?, read)
    }

    /// Layer `layer`'s keys and values for the filled columns, `[B,
    /// kv_heads, len, head_dim]` in the activations' dtype (rope applied),
    /// for drafters that attend into the target's cache without writing it.
    pub fn layer_kv(&self, layer: usize) -> anyhow::Result<Option<(Array, Array)>> {
        if let Some(p) = &self.paged {
            let Some(bufs) = p.pool.buffers(layer) else {
                return Ok(None);
            };
            let read = p.read(self.len, &self.left_pad)?;
            return Ok(Some(
                paged_view(self.layers[layer].quant, bufs, read)?.dense()?,
            ));
        }
        self.layers[layer]
            .view(self.len)?
            .map(|v| v.dense())
            .transpose()
    }

    /// The arrays holding the cache (a paged cache's pool included), for
    /// evaluating them between prefill chunks.
    pub fn state(&self) -> Vec<Array> {
        let kv = match &self.paged {
            Some(p) => p.pool.state(),
            None => self.layers.iter().flat_map(|l| l.buffers.clone()).collect(),
        };
        kv.into_iter()
            .chain(
                self.recurrent
                    .iter()
                    .flatten()
                    .flat_map(|r| [r.conv.clone(), r.ssm.clone()]),
            )
            .collect()
    }

    /// Bytes the buffers and recurrent states hold (capacity included; a
    /// paged cache's share of its pool: the blocks its rows list).
    pub fn nbytes(&self) -> usize {
        let kv = match &self.paged {
            Some(p) => p.tables.iter().map(Vec::len).sum::<usize>() * p.pool.bytes_per_block(),
            None => self
                .layers
                .iter()
                .flat_map(|l| &l.buffers)
                .map(Array::nbytes)
                .sum(),
        };
        kv + self.recurrent_bytes()
    }

    pub fn advance(&mut self, n: i32) {
        self.len += n;
        if let Some(p) = &mut self.paged {
            p.forward = None;
        }
    }

    /// Drops the last `n` positions of every row (speculative rollback).
    /// Linear layers go back to their state after that position, which
    /// must lie within the last forward, with steps kept.
    pub fn truncate(&mut self, n: i32) -> anyhow::Result<()> {
        self.truncate_rows(&vec![n; self.batch_size()])
    }

    /// Drops the last `drop[b]` positions of each row `b` (a batched
    /// verify's rejected drafts). Rows stay right-aligned: a row that drops
    /// more than the fewest is shifted right by the difference (one gather
    /// per buffer) and its left padding grows by as much; leading padding
    /// that no row needs any more is let go once it spans a growth step.
    /// Linear layers go back to each row's own state, kept by the last
    /// forward ([`KvCache::keep_steps`]).
    pub fn truncate_rows(&mut self, drop: &[i32]) -> anyhow::Result<()> {
        anyhow::ensure!(drop.len() == self.batch_size(), "one count per row");
        let fewest = drop.iter().copied().min().unwrap_or(0);
        let shifts: Vec<i32> = drop.iter().map(|d| d - fewest).collect();
        if drop.iter().any(|&d| d > 0) {
            for l in 0..self.recurrent.len() {
                if self.recurrent[l].is_none() {
                    continue;
                }
                let state = if shifts.iter().all(|&s| s == 0) {
                    self.rolled_back(l, fewest)?
                } else {
                    let rows = drop
                        .iter()
                        .enumerate()
                        .map(|(b, &d)| {
                            let idx = Array::from_slice(&[b as i32], &[1]);
                            self.rolled_back(l, d)?.map(|a| Ok(a.take_axis(&idx, 0)?))
                        })
                        .collect::<anyhow::Result<Vec<_>>>()?;
                    Recurrent {
                        conv: ops::concatenate(
                            &rows.iter().map(|r| &r.conv).collect::<Vec<_>>(),
                            0,
                        )?,
                        ssm: ops::concatenate(&rows.iter().map(|r| &r.ssm).collect::<Vec<_>>(), 0)?,
                    }
                };
                self.recurrent[l] = Some(state);
                self.steps[l] = None;
            }
        }
        if let Some(p) = &mut self.paged {
            // A row's positions stay where they are: its start moves right
            // by its shift, and the blocks past its new end go back.
            p.forward = None;
            for (pad, s) in self.left_pad.iter_mut().zip(&shifts) {
                *pad += s;
            }
            self.len -= fewest;
            p.release_past(self.len, &self.left_pad);
            let common = self.left_pad.iter().copied().min().unwrap_or(0);
            self.drop_leading(common)?;
            return Ok(());
        }
        if shifts.iter().any(|&s| s > 0) {
            // Column c of row b takes column c - shift[b] (the columns it
            // leaves behind are padding).
            let cap = self.capacity;
            let idx: Vec<i32> = shifts
                .iter()
                .flat_map(|&s| (0..cap).map(move |c| (c - s).max(0)))
                .collect();
            let idx = Array::from_slice(&idx, &[shifts.len() as i32, 1, cap, 1]);
            for l in &mut self.layers {
                l.map(|b| Ok(b.take_along_axis(&idx, 2)?))?;
            }
            for (pad, s) in self.left_pad.iter_mut().zip(&shifts) {
                *pad += s;
            }
        }
        self.len = (self.len - fewest).max(*self.left_pad.iter().max().unwrap_or(&0));
        let common = self.left_pad.iter().copied().min().unwrap_or(0);
        if common >= STEP {
            self.drop_leading(common)?;
        }
        Ok(())
    }

    /// Linear layer `l`'s state (every row) `n` positions before the end of
    /// the last forward, from the steps it kept.
    fn rolled_back(&self, l: usize, n: i32) -> anyhow::Result<Recurrent> {
        let steps = self.steps[l].as_ref().ok_or_else(|| {
            anyhow!("cannot roll a recurrent state back: its steps were not kept")
        })?;
        let s = steps.ssm.len() as i32;
        anyhow::ensure!(
            n <= s,
            "cannot roll a recurrent state back {n} positions, its last forward had {s}"
        );
        steps.after((s - n) as usize)
    }

    /// Keeps only the given rows, in that order, and drops padding columns
    /// that no remaining row needs.
    pub fn select_rows(&mut self, rows: &[usize]) -> anyhow::Result<()> {
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32]);
        self.left_pad = rows.iter().map(|&r| self.left_pad[r]).collect();
        for l in &mut self.layers {
            l.map(|b| Ok(b.take_axis(&idx, 0)?))?;
        }
        if let Some(p) = &mut self.paged {
            p.tables = rows.iter().map(|&r| p.tables[r].clone()).collect();
            p.forward = None;
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
        if self.paged.is_some() {
            // Padding columns hold nothing in a paged cache.
            self.len -= cols;
            self.capacity = self.len;
            for p in &mut self.left_pad {
                *p -= cols;
            }
            return Ok(());
        }
        let capacity = self.capacity;
        for l in &mut self.layers {
            l.map(|b| slice_cols(b, cols, capacity))?;
        }
        self.capacity -= cols;
        self.len -= cols;
        for p in &mut self.left_pad {
            *p -= cols;
        }
        Ok(())
    }

    /// Stacks caches into one batch, right-aligning their rows. Caches
    /// whose layers store in different precisions never merge: a prefix
    /// computed in one is not continued in the other.
    pub fn merge(parts: Vec<KvCache>) -> anyhow::Result<KvCache> {
        let first = parts.first().ok_or_else(|| anyhow!("nothing to merge"))?;
        let formats = first.formats();
        if parts.iter().any(|p| p.formats() != formats) {
            return Err(anyhow!(
                "cannot merge KV caches stored in different precisions"
            ));
        }
        let num_layers = formats.len();
        let len = parts.iter().map(|c| c.len).max().unwrap_or(0);
        if let Some(pool) = first.page_pool() {
            return Self::merge_paged(pool.clone(), parts, len);
        }
        if parts.iter().any(|p| p.paged.is_some()) {
            return Err(anyhow!("cannot merge paged and contiguous KV caches"));
        }
        let capacity = round_up(len.max(1));
        let without_kv: Vec<bool> = (0..num_layers)
            .map(|l| parts.iter().all(|p| p.layers[l].buffers.is_empty()))
            .collect();
        let recurrent = merge_recurrent(&parts)?;
        let keep_steps = parts.iter().any(|p| p.keep_steps);
        let mut left_pad = Vec::new();
        // Per layer, per buffer: the parts' rows.
        let mut pieces: Vec<Vec<Vec<Array>>> = vec![Vec::new(); num_layers];
        for part in parts {
            let shift = len - part.len;
            left_pad.extend(part.left_pad.iter().map(|p| p + shift));
            for (l, layer) in part.layers.iter().enumerate() {
                if layer.buffers.is_empty() {
                    // Layers that attend to another layer's keys and
                    // values hold none of their own, in every part alike.
                    if without_kv[l] {
                        continue;
                    }
                    return Err(anyhow!("cannot merge an empty cache"));
                }
                pieces[l].resize(layer.buffers.len(), Vec::new());
                for (i, b) in layer.buffers.iter().enumerate() {
                    pieces[l][i].push(align(b, part.len, shift, capacity)?);
                }
            }
        }
        let layers = formats
            .into_iter()
            .zip(pieces)
            .map(|(quant, bufs)| -> anyhow::Result<LayerKv> {
                Ok(LayerKv {
                    quant,
                    buffers: bufs
                        .iter()
                        .map(|rows| ops::concatenate(rows, 0))
                        .collect::<Result<_, _>>()?,
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(KvCache {
            layers,
            len,
            capacity,
            left_pad,
            recurrent,
            steps: vec![None; num_layers],
            keep_steps,
            paged: None,
        })
    }

    /// `part`'s rows appended to `batch` (or on their own, without one),
    /// right-aligned as [`KvCache::merge`] has them. A paged cache then
    /// lets go of the leading columns every row pads: they hold no blocks,
    /// and a lone row left unpadded attends as a plain sequence does (on a
    /// GPU through MLX's vector kernel; a padded row takes the ragged
    /// kernel, whose one block per query head is slower for a single row).
    pub fn join(batch: Option<KvCache>, part: KvCache) -> anyhow::Result<KvCache> {
        let mut out = match batch {
            Some(b) => Self::merge(vec![b, part])?,
            None => part,
        };
        let common = out.left_pad.iter().copied().min().unwrap_or(0);
        if out.paged.is_some() && common > 0 {
            out.drop_leading(common)?;
        }
        Ok(out)
    }

    /// [`KvCache::merge`] of paged caches: their tables stacked, no copy.
    fn merge_paged(pool: PagePool, parts: Vec<KvCache>, len: i32) -> anyhow::Result<KvCache> {
        let recurrent = merge_recurrent(&parts)?;
        let mut out = KvCache::paged(&pool, parts[0].formats(), Vec::new());
        out.recurrent = recurrent;
        out.keep_steps = parts.iter().any(|p| p.keep_steps);
        out.len = len;
        out.capacity = len;
        let tables = &mut out.paged.as_mut().expect("paged").tables;
        for part in parts {
            let Some(p) = part.paged.filter(|p| p.pool.same(&pool)) else {
                return Err(anyhow!("cannot merge KV caches of different pools"));
            };
            let shift = len - part.len;
            out.left_pad.extend(part.left_pad.iter().map(|l| l + shift));
            tables.extend(p.tables);
        }
        Ok(out)
    }

    /// Row `b` as a cache of its own (no padding): its keys and values
    /// copied out of the batch's buffers, or when paged its blocks shared
    /// (a write copies the block it writes, as for a view).
    pub fn extract_row(&self, b: usize) -> anyhow::Result<KvCache> {
        let mut out = self.row_view(b)?;
        out.keep_steps = self.keep_steps;
        if self.paged.is_none() {
            let (len, capacity) = (out.len, round_up(out.len.max(1)));
            for l in &mut out.layers {
                l.map(|buf| align(buf, len, 0, capacity))?;
            }
            out.capacity = capacity;
        }
        Ok(out)
    }

    /// Row `b` as a cache of its own that views the batch's buffers (no
    /// copy): for readers of one row's context (a drafter attending into
    /// the target's keys). Writing to it copies first (a paged row: the
    /// shared block it writes into).
    pub fn row_view(&self, b: usize) -> anyhow::Result<KvCache> {
        let idx = Array::from_slice(&[b as i32], &[1]);
        let (start, len) = (self.left_pad[b], self.row_len(b));
        let bi = b as i32;
        let mut out = match &self.paged {
            Some(p) => {
                let mut out = KvCache::paged(&p.pool, self.formats(), vec![0]);
                out.paged_mut().tables = vec![p.tables[b].clone()];
                out
            }
            None => KvCache::with_formats(self.formats(), vec![0]),
        };
        for (mine, theirs) in out.layers.iter_mut().zip(&self.layers) {
            mine.buffers = theirs
                .buffers
                .iter()
                .map(|buf| {
                    let s = buf.shape();
                    slice(buf, &[bi, 0, start, 0], &[bi + 1, s[1], self.len, s[3]])
                })
                .collect::<anyhow::Result<_>>()?;
        }
        for (l, r) in self.recurrent.iter().enumerate() {
            if let Some(r) = r {
                out.recurrent[l] = Some(r.map(|a| Ok(a.take_axis(&idx, 0)?))?);
            }
        }
        out.len = len;
        out.capacity = len;
        Ok(out)
    }
}

/// A paged layer's view from its pool `buffers`: read in place when
/// stored in the activations' dtype, gathered into columns when quantized
/// (quantized attention takes arrays).
fn paged_view(
    quant: Option<KvQuant>,
    mut buffers: Vec<Array>,
    read: PagedRead,
) -> anyhow::Result<LayerView> {
    Ok(match quant {
        None => {
            let values = buffers.pop().expect("two buffers");
            let keys = buffers.pop().expect("two buffers");
            LayerView::Paged { keys, values, read }
        }
        Some(quant) => {
            let mut keys = buffers
                .iter()
                .map(|b| read.gather(b))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let values = keys.split_off(3);
            LayerView::Quantized {
                quant,
                keys,
                values,
            }
        }
    })
}

impl Paged {
    /// Makes room for `n` new positions after column `len` in every row:
    /// blocks they would write that another cache shares are copied, and
    /// missing ones allocated. Returns the new positions' slots, row-major
    /// over rows then positions.
    fn prepare(&mut self, len: i32, n: i32, left_pad: &[i32]) -> anyhow::Result<Arc<[i32]>> {
        let block = self.pool.block();
        let mut slots = Vec::with_capacity(left_pad.len() * n as usize);
        for (table, &start) in self.tables.iter_mut().zip(left_pad) {
            let (from, to) = ((len - start).max(0), len + n - start);
            let needed = ((to.max(0) + block - 1) / block) as usize;
            for i in (from / block) as usize..needed.min(table.len()) {
                if paged::is_shared(&table[i]) {
                    let copy = self.pool.allocate()?;
                    self.pool.copy_block(table[i].id(), copy.id())?;
                    table[i] = copy;
                }
            }
            while table.len() < needed {
                table.push(self.pool.allocate()?);
            }
            for col in len..len + n {
                slots.push(paged::slot(table, start, block, col)?);
            }
        }
        Ok(slots.into())
    }

    /// Where columns `0..total` of each row lie.
    fn read(&self, total: i32, left_pad: &[i32]) -> anyhow::Result<PagedRead> {
        let block = self.pool.block();
        let rows = left_pad.len() as i32;
        let mut slots = Vec::with_capacity((rows * total) as usize);
        for (table, &start) in self.tables.iter().zip(left_pad) {
            for col in 0..total {
                slots.push(paged::slot(table, start, block, col)?);
            }
        }
        let most = self.tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut tables = vec![0i32; rows as usize * most];
        for (b, table) in self.tables.iter().enumerate() {
            for (i, blk) in table.iter().enumerate() {
                tables[b * most + i] = blk.id() as i32;
            }
        }
        Ok(PagedRead {
            slots: slots.into(),
            slot_index: Arc::default(),
            tables: Array::from_slice(&tables, &[rows, most as i32]),
            block,
            total,
            rows,
        })
    }

    /// Lets go of each row's blocks past its last column before `len`.
    fn release_past(&mut self, len: i32, left_pad: &[i32]) {
        let block = self.pool.block();
        for (table, &start) in self.tables.iter_mut().zip(left_pad) {
            let keep = ((len - start).max(0) + block - 1) / block;
            table.truncate(keep as usize);
        }
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

fn write(buf: Option<Array>, update: &Array, at: i32, capacity: i32) -> anyhow::Result<Array> {
    let s = update.shape().to_vec();
    let buf = match buf {
        Some(b) => b,
        None => ops::zeros_dtype(&[s[0], s[1], capacity, s[3]], update.dtype())?,
    };
    slice_update(buf, update, &[0, 0, at, 0])
}

/// `buf` with `update` written at `start` (`buf` is taken so MLX can write
/// it in place).
pub(crate) fn slice_update(buf: Array, update: &Array, start: &[i32]) -> anyhow::Result<Array> {
    let stop: Vec<i32> = start
        .iter()
        .zip(update.shape())
        .map(|(a, n)| a + n)
        .collect();
    let strides = vec![1; start.len()];
    let n = start.len();
    ffi_op(|res, stream| unsafe {
        mlx_sys::mlx_slice_update(
            res,
            buf.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            n,
            stop.as_ptr(),
            n,
            strides.as_ptr(),
            n,
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

#[cfg(test)]
mod tests {
    use super::*;

    const Q: KvQuant = KvQuant {
        bits: 8,
        group_size: 32,
    };

    /// `[1, 1, n, 32]` keys whose values encode their position.
    fn tokens(from: i32, n: i32) -> Array {
        let data: Vec<f32> = (from..from + n)
            .flat_map(|p| (0..32).map(move |i| p as f32 + i as f32 / 64.0))
            .collect();
        Array::from_slice(&data, &[1, 1, n, 32])
    }

    fn filled(quant: Option<KvQuant>, n: i32) -> KvCache {
        let mut c = KvCache::with_formats(vec![quant], vec![0]);
        c.update(0, tokens(0, n), tokens(0, n)).unwrap();
        c.advance(n);
        c
    }

    /// Row `b`'s keys for its real tokens, dequantized.
    fn row_keys(c: &KvCache, b: i32) -> Vec<f32> {
        let (k, _) = c.layer_kv(0).unwrap().unwrap();
        let s = k.shape().to_vec();
        let row = slice(
            &k,
            &[b, 0, c.left_pad[b as usize], 0],
            &[b + 1, s[1], s[2], s[3]],
        );
        row.unwrap().as_slice::<f32>().to_vec()
    }

    #[test]
    fn quantized_rows_merge_select_and_split_like_dense_ones() {
        let (a, b) = (filled(Some(Q), 3), filled(Some(Q), 5));
        let want = (row_keys(&a, 0), row_keys(&b, 0));
        // 8-bit codes of values up to 5: within half a step of the original.
        let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| (p - q).abs() < 0.02);
        assert!(close(&want.0, tokens(0, 3).as_slice::<f32>()));
        let mut merged = KvCache::merge(vec![a, b]).unwrap();
        assert_eq!(merged.left_padding(), &[2, 0]);
        assert!(merged
            .state()
            .iter()
            .any(|x| x.dtype() == mlx_rs::Dtype::Uint32));
        assert_eq!(row_keys(&merged, 0), want.0);
        assert_eq!(row_keys(&merged, 1), want.1);
        assert_eq!(row_keys(&merged.extract_row(0).unwrap(), 0), want.0);
        merged.select_rows(&[0]).unwrap();
        assert_eq!((merged.len(), merged.left_padding()), (3, &[0][..]));
        assert_eq!(row_keys(&merged, 0), want.0);
        // A new token appends quantized after the kept ones.
        merged.update(0, tokens(3, 1), tokens(3, 1)).unwrap();
        merged.advance(1);
        merged.truncate(1).unwrap();
        assert_eq!(row_keys(&merged, 0), want.0, "rollback drops it again");
    }

    #[test]
    fn caches_of_different_precisions_never_merge() {
        let Err(err) = KvCache::merge(vec![filled(Some(Q), 3), filled(None, 3)]) else {
            panic!("merged")
        };
        assert!(err.to_string().contains("different precisions"), "{err}");
        let other = KvQuant { bits: 4, ..Q };
        assert!(KvCache::merge(vec![filled(Some(Q), 3), filled(Some(other), 3)]).is_err());
    }

    #[test]
    fn quantized_layers_take_a_quarter_of_the_fp32_bytes_or_less() {
        let (dense, quant) = (filled(None, 256), filled(Some(Q), 256));
        // 32 fp32 values: 128 bytes; 8-bit: 32 bytes + one fp32 scale and bias.
        assert_eq!(dense.nbytes(), 2 * 256 * 128);
        assert_eq!(quant.nbytes(), 2 * 256 * (32 + 8));
    }
}
