//! Contiguous KV storage: per layer, buffers `[B, kv_heads, capacity, _]`
//! that grow in steps (like mlx-lm's cache) and are written in place with
//! `slice_update`; column `c` is column `c` of every buffer.

use anyhow::anyhow;
use mlx_rs::{ops, Array};

use super::view::LayerView;
use crate::kv_quant::KvQuant;
use crate::slices::{slice, slice_cols, slice_update};

/// Capacity grows in multiples of this many positions.
pub(crate) const STEP: i32 = 256;

#[derive(Clone)]
pub(crate) struct Contiguous {
    /// Per layer, empty until the layer is first written (and forever for a
    /// layer that reads another layer's): `[keys, values]`, or quantized
    /// `[key codes, key scales, key biases, value codes, value scales,
    /// value biases]`. Every buffer is column-aligned with the cache, so
    /// growing, row selection, padding and truncation treat both alike.
    pub(crate) layers: Vec<Vec<Array>>,
    pub(crate) capacity: i32,
}

impl Contiguous {
    pub(crate) fn new(layers: usize) -> Self {
        Self {
            layers: vec![Vec::new(); layers],
            capacity: 0,
        }
    }

    fn map(&mut self, f: impl Fn(&Array) -> anyhow::Result<Array>) -> anyhow::Result<()> {
        for b in self.layers.iter_mut().flatten() {
            *b = f(b)?;
        }
        Ok(())
    }

    /// Writes `parts` (layer `layer`'s new columns, one per buffer) at
    /// column `len`, every layer grown first where they do not fit, and
    /// returns what attention reads of the layer.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        quant: Option<KvQuant>,
        parts: &[Array],
        len: i32,
    ) -> anyhow::Result<LayerView> {
        let end = len + parts[0].dim(2);
        if end > self.capacity {
            let capacity = round_up(end);
            self.map(|b| align(b, len, 0, capacity))?;
            self.capacity = capacity;
        }
        let capacity = self.capacity;
        let mut old = std::mem::take(&mut self.layers[layer]).into_iter();
        self.layers[layer] = parts
            .iter()
            .map(|part| {
                let buf = match old.next() {
                    Some(b) => b,
                    None => {
                        let s = part.shape();
                        ops::zeros_dtype(&[s[0], s[1], capacity, s[3]], part.dtype())?
                    }
                };
                slice_update(buf, part, &[0, 0, len, 0])
            })
            .collect::<anyhow::Result<_>>()?;
        self.view(layer, quant, len + parts[0].dim(2))?
            .ok_or_else(|| anyhow!("layer {layer} was not written"))
    }

    /// Layer `layer`'s columns `0..len` (`None` before its first write).
    pub(crate) fn view(
        &self,
        layer: usize,
        quant: Option<KvQuant>,
        len: i32,
    ) -> anyhow::Result<Option<LayerView>> {
        LayerView::of(quant, self.columns(layer, len)?)
    }

    /// Layer `layer`'s first `len` columns, one array per buffer.
    pub(crate) fn columns(&self, layer: usize, len: i32) -> anyhow::Result<Vec<Array>> {
        self.layers[layer]
            .iter()
            .map(|b| slice_cols(b, 0, len))
            .collect()
    }

    /// Keeps the rows `idx` lists, in that order.
    pub(crate) fn select_rows(&mut self, idx: &Array) -> anyhow::Result<()> {
        self.map(|b| Ok(b.take_axis(idx, 0)?))
    }

    /// Shifts row `b` right by `shifts[b]` columns (the columns it leaves
    /// behind become padding): one gather per buffer.
    pub(crate) fn shift_rows(&mut self, shifts: &[i32]) -> anyhow::Result<()> {
        let cap = self.capacity;
        let idx: Vec<i32> = shifts
            .iter()
            .flat_map(|&s| (0..cap).map(move |c| (c - s).max(0)))
            .collect();
        let idx = Array::from_slice(&idx, &[shifts.len() as i32, 1, cap, 1]);
        self.map(|b| Ok(b.take_along_axis(&idx, 2)?))
    }

    /// Lets go of the first `cols` columns.
    pub(crate) fn drop_leading(&mut self, cols: i32) -> anyhow::Result<()> {
        let capacity = self.capacity;
        self.map(|b| slice_cols(b, cols, capacity))?;
        self.capacity -= cols;
        Ok(())
    }

    /// The first `len` columns in buffers of their own, of the capacity
    /// that holds them.
    pub(crate) fn compact(&mut self, len: i32) -> anyhow::Result<()> {
        let capacity = round_up(len.max(1));
        self.map(|b| align(b, len, 0, capacity))?;
        self.capacity = capacity;
        Ok(())
    }

    /// Row `b`'s columns `start..end` as a one-row view (no copy).
    pub(crate) fn row(&self, b: usize, start: i32, end: i32) -> anyhow::Result<Self> {
        let bi = b as i32;
        let layers = self
            .layers
            .iter()
            .map(|buffers| {
                buffers
                    .iter()
                    .map(|buf| {
                        let s = buf.shape();
                        slice(buf, &[bi, 0, start, 0], &[bi + 1, s[1], end, s[3]])
                    })
                    .collect()
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            layers,
            capacity: end - start,
        })
    }

    /// The parts (each with its filled columns) stacked into `len`
    /// columns, each part's rows right-aligned.
    pub(crate) fn merge(parts: &[(&Contiguous, i32)], len: i32) -> anyhow::Result<Self> {
        let num_layers = parts[0].0.layers.len();
        let capacity = round_up(len.max(1));
        let without_kv: Vec<bool> = (0..num_layers)
            .map(|l| parts.iter().all(|(p, _)| p.layers[l].is_empty()))
            .collect();
        // Per layer, per buffer: the parts' rows.
        let mut pieces: Vec<Vec<Vec<Array>>> = vec![Vec::new(); num_layers];
        for (part, part_len) in parts {
            let shift = len - part_len;
            for (l, buffers) in part.layers.iter().enumerate() {
                if buffers.is_empty() {
                    // Layers that attend to another layer's keys and
                    // values hold none of their own, in every part alike.
                    if without_kv[l] {
                        continue;
                    }
                    return Err(anyhow!("cannot merge an empty cache"));
                }
                pieces[l].resize(buffers.len(), Vec::new());
                for (i, b) in buffers.iter().enumerate() {
                    pieces[l][i].push(align(b, *part_len, shift, capacity)?);
                }
            }
        }
        let layers = pieces
            .iter()
            .map(|bufs| {
                bufs.iter()
                    .map(|rows| Ok(ops::concatenate(rows, 0)?))
                    .collect()
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self { layers, capacity })
    }

    /// Every buffer, for evaluation.
    pub(crate) fn state(&self) -> Vec<Array> {
        self.layers.iter().flatten().cloned().collect()
    }

    /// Bytes the buffers hold, capacity included.
    pub(crate) fn nbytes(&self) -> usize {
        self.layers.iter().flatten().map(Array::nbytes).sum()
    }
}

/// `buf[:, :, :len]` shifted right by `shift` columns inside a zeroed buffer
/// of `capacity` columns.
pub(crate) fn align(buf: &Array, len: i32, shift: i32, capacity: i32) -> anyhow::Result<Array> {
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

pub(crate) fn round_up(n: i32) -> i32 {
    (n + STEP - 1) / STEP * STEP
}
