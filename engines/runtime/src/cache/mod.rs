//! KV cache for one sequence or a left-padded batch of sequences.
//!
//! Rows of a batch are right-aligned: row `b` holds `left_pad[b]` padding
//! columns before its first real token, so all rows append at the same
//! column and a decode step is one batched forward. [`KvCache`] keeps that
//! geometry and runs every batch operation (merging, row selection,
//! rollback) once, over the storages it holds:
//!
//! * keys and values per layer, in the activations' dtype or quantized
//!   ([`crate::kv_quant`]), either in arrays of the cache's own
//!   (`contiguous.rs`) or in a [`crate::paged::PagePool`]'s blocks
//!   (`tables.rs`); attention reads a layer as a [`LayerView`] (`view.rs`);
//! * the recurrent state of linear-attention layers (`recurrent.rs`).

use anyhow::anyhow;
use mlx_rs::Array;

use crate::kv_quant::KvQuant;
use crate::paged::{BlockRef, PagePool};

mod contiguous;
mod recurrent;
mod tables;
mod view;

use contiguous::{Contiguous, STEP};
use recurrent::RecurrentLayers;
pub use recurrent::{Recurrent, Steps, MAX_ROLLBACK_STEPS};
use tables::BlockTables;
pub use tables::PoolTarget;
pub use view::{LayerView, PagedRead};

/// Position of the next token of every row, as rope reads it.
pub enum Offsets {
    Scalar(i32),
    PerRow(Array),
}

impl Offsets {
    /// The positions as an int array: one, or one per row.
    pub fn to_array(&self) -> Array {
        match self {
            Offsets::Scalar(o) => Array::from_int(*o),
            Offsets::PerRow(o) => o.clone(),
        }
    }
}

#[derive(Clone)]
pub struct KvCache {
    /// Each layer's storage format (`None`: the activations' dtype).
    formats: Vec<Option<KvQuant>>,
    /// Filled columns (padding included).
    len: i32,
    left_pad: Vec<i32>,
    kv: Storage,
    recurrent: RecurrentLayers,
}

/// Where the keys and values live.
#[derive(Clone)]
enum Storage {
    Contiguous(Contiguous),
    Paged(BlockTables),
}

/// A cache's arrays as the plugin boundary carries them (`abi::kv`).
pub(crate) struct KvParts {
    pub formats: Vec<Option<KvQuant>>,
    /// Per layer, its buffers (none when paged).
    pub buffers: Vec<Vec<Array>>,
    pub recurrent: Vec<Option<Recurrent>>,
    pub len: i32,
    pub capacity: i32,
    pub left_pad: Vec<i32>,
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
        let kv = Storage::Contiguous(Contiguous::new(formats.len()));
        Self::of(formats, left_pad, kv)
    }

    /// An empty paged batch cache whose rows will be filled by one prefill
    /// of prompts left-padded by `left_pad` columns each, its keys and
    /// values in `pool`'s blocks.
    pub fn paged(pool: &PagePool, formats: Vec<Option<KvQuant>>, left_pad: Vec<i32>) -> Self {
        let kv = Storage::Paged(BlockTables::new(pool, vec![Vec::new(); left_pad.len()]));
        Self::of(formats, left_pad, kv)
    }

    fn of(formats: Vec<Option<KvQuant>>, left_pad: Vec<i32>, kv: Storage) -> Self {
        let layers = formats.len();
        Self {
            formats,
            len: 0,
            left_pad,
            kv,
            recurrent: RecurrentLayers::new(vec![None; layers], false),
        }
    }

    /// This cache's geometry and recurrent states (not their steps) over
    /// other keys and values.
    fn with_kv(&self, kv: Storage) -> Self {
        Self {
            formats: self.formats.clone(),
            len: self.len,
            left_pad: self.left_pad.clone(),
            kv,
            recurrent: self.recurrent.without_steps(),
        }
    }

    /// A contiguous cache from the arrays that crossed the plugin boundary.
    pub(crate) fn from_parts(parts: KvParts) -> Self {
        Self {
            formats: parts.formats,
            len: parts.len,
            left_pad: parts.left_pad,
            kv: Storage::Contiguous(Contiguous {
                layers: parts.buffers,
                capacity: parts.capacity,
            }),
            recurrent: RecurrentLayers::new(parts.recurrent, false),
        }
    }

    /// Layer `layer`'s own buffers (none when paged), for the plugin
    /// boundary.
    pub(crate) fn buffers(&self, layer: usize) -> &[Array] {
        match &self.kv {
            Storage::Contiguous(c) => &c.layers[layer],
            Storage::Paged(_) => &[],
        }
    }

    /// Columns the buffers hold (a paged cache: its filled ones).
    pub(crate) fn capacity(&self) -> i32 {
        match &self.kv {
            Storage::Contiguous(c) => c.capacity,
            Storage::Paged(_) => self.len,
        }
    }

    /// The pool of a paged cache.
    pub fn page_pool(&self) -> Option<&PagePool> {
        match &self.kv {
            Storage::Paged(t) => Some(t.pool()),
            Storage::Contiguous(_) => None,
        }
    }

    /// A paged single row's pool and blocks (what crosses the plugin
    /// boundary in place of arrays).
    pub(crate) fn paged_table(&self) -> Option<(&PagePool, &[BlockRef])> {
        match &self.kv {
            Storage::Paged(t) => match t.tables() {
                [table] => Some((t.pool(), table)),
                _ => None,
            },
            Storage::Contiguous(_) => None,
        }
    }

    /// Makes this single-row cache (its `len` and formats set) a paged one
    /// over `table`'s blocks of `pool`.
    pub(crate) fn set_paged_table(&mut self, pool: &PagePool, table: Vec<BlockRef>) {
        self.kv = Storage::Paged(BlockTables::new(pool, vec![table]));
    }

    /// This cache with its keys and values moved into `pool`'s blocks
    /// (itself when already paged there).
    pub fn into_paged(self, pool: &PagePool) -> anyhow::Result<KvCache> {
        if self.page_pool().is_some_and(|p| p.same(pool)) {
            return Ok(self);
        }
        let this = self.contiguous()?;
        let Storage::Contiguous(c) = &this.kv else {
            unreachable!("contiguous() copies out of the pool")
        };
        let tables = BlockTables::copy_in(pool, c, this.len, &this.left_pad)?;
        Ok(this.with_kv(Storage::Paged(tables)))
    }

    /// This cache with every layer's keys and values in arrays of its own
    /// (a copy out of the pool when paged).
    pub fn contiguous(&self) -> anyhow::Result<KvCache> {
        let Storage::Paged(t) = &self.kv else {
            return Ok(self.clone());
        };
        let c = t.copy_out(self.formats.len(), self.len, &self.left_pad)?;
        Ok(self.with_kv(Storage::Contiguous(c)))
    }

    /// Each layer's quantization (`None`: stored in the activations' dtype).
    pub fn formats(&self) -> Vec<Option<KvQuant>> {
        self.formats.clone()
    }

    /// Keeps each linear layer's per-position states of the last forward
    /// (of at most [`MAX_ROLLBACK_STEPS`] positions), so
    /// [`KvCache::truncate`] can roll rejected drafted tokens back
    /// (speculative decoding); costs one state per position verified.
    pub fn keep_steps(&mut self, on: bool) {
        self.recurrent.keep_steps(on);
    }

    pub fn keeps_steps(&self) -> bool {
        self.recurrent.keeps_steps()
    }

    /// Layer `layer`'s recurrent state, `None` before its first forward.
    pub fn recurrent(&self, layer: usize) -> Option<&Recurrent> {
        self.recurrent.states()[layer].as_ref()
    }

    pub(crate) fn set_recurrent(&mut self, layer: usize, state: Recurrent, steps: Option<Steps>) {
        self.recurrent.set(layer, state, steps);
    }

    /// Whether any layer holds a recurrent state (a hybrid model's cache).
    pub fn has_recurrent(&self) -> bool {
        self.recurrent.states().iter().any(Option::is_some)
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

    /// Writes `n` new positions of layer `layer` at the end (quantizing
    /// only them where the layer stores quantized) and returns the layer's
    /// keys and values up to and including them. Call
    /// [`KvCache::advance`] once all layers are written.
    pub fn update(&mut self, layer: usize, k: Array, v: Array) -> anyhow::Result<LayerView> {
        let quant = self.formats[layer];
        let n = k.dim(2);
        let parts = match quant {
            None => vec![k, v],
            Some(q) => q.quantize(&k)?.into_iter().chain(q.quantize(&v)?).collect(),
        };
        match &mut self.kv {
            Storage::Paged(t) => t.write(layer, quant, &parts, self.len, n, &self.left_pad),
            Storage::Contiguous(c) => c.write(layer, quant, &parts, self.len),
        }
    }

    /// Whether layer `layer` takes its new keys and values as the paged
    /// pool's rows ([`KvCache::update_rows`]): paged, in the activations'
    /// dtype.
    pub fn takes_rows(&self, layer: usize) -> bool {
        matches!(self.kv, Storage::Paged(_)) && self.formats[layer].is_none()
    }

    /// Where layer `layer`'s `n` new positions a row go in the paged pool,
    /// for a kernel that writes them there itself
    /// ([`crate::gpu_fused::heads_into_pool`]): the layer's buffers once
    /// written and of `dtype` on the GPU, else `None` (the keys and values
    /// then go through [`KvCache::update_rows`]). Blocks are allocated, or
    /// copied where shared, as a write's are; [`KvCache::wrote_pool`]
    /// finishes the write.
    pub fn pool_target(
        &mut self,
        layer: usize,
        dtype: mlx_rs::Dtype,
        n: i32,
    ) -> anyhow::Result<Option<PoolTarget>> {
        match &mut self.kv {
            Storage::Paged(t) if self.formats[layer].is_none() => {
                t.pool_target(layer, dtype, self.len, n, &self.left_pad)
            }
            _ => Ok(None),
        }
    }

    /// What the forward under way reads of a paged cache's layers, once
    /// [`KvCache::pool_target`] began it: for a kernel that writes the
    /// target and reads the layer in one node.
    pub fn pool_read(&self) -> Option<PagedRead> {
        match &self.kv {
            Storage::Paged(t) => t.forward_read(),
            _ => None,
        }
    }

    /// The write into [`KvCache::pool_target`]'s `target` done, by the
    /// node `written` is the token of: what attention reads of the layer.
    pub fn wrote_pool(
        &mut self,
        layer: usize,
        target: PoolTarget,
        written: Array,
    ) -> anyhow::Result<LayerView> {
        match &mut self.kv {
            Storage::Paged(t) => t.wrote(layer, target, written),
            _ => Err(anyhow!("layer {layer} is not paged")),
        }
    }

    /// [`KvCache::update`] of `n` new positions a row given as the pool's
    /// rows, `[B * n, 1, kv_heads, head_dim]` each (row-major over rows
    /// then positions), for a layer [`KvCache::takes_rows`] takes: the
    /// pool scatters them as they are.
    pub fn update_rows(
        &mut self,
        layer: usize,
        k: Array,
        v: Array,
        n: i32,
    ) -> anyhow::Result<LayerView> {
        match &mut self.kv {
            Storage::Paged(t) if self.formats[layer].is_none() => {
                t.write(layer, None, &[k, v], self.len, n, &self.left_pad)
            }
            _ => Err(anyhow!(
                "layer {layer} does not take its keys and values as pool rows"
            )),
        }
    }

    /// Layer `layer`'s keys and values for the filled columns, `[B,
    /// kv_heads, len, head_dim]` in the activations' dtype (rope applied),
    /// for drafters that attend into the target's cache without writing it.
    pub fn layer_kv(&self, layer: usize) -> anyhow::Result<Option<(Array, Array)>> {
        let quant = self.formats[layer];
        let view = match &self.kv {
            Storage::Paged(t) => t.view(layer, quant, self.len, &self.left_pad)?,
            Storage::Contiguous(c) => c.view(layer, quant, self.len)?,
        };
        view.map(|v| v.dense()).transpose()
    }

    /// The arrays holding the cache (a paged cache's pool included), for
    /// evaluating them between prefill chunks.
    pub fn state(&self) -> Vec<Array> {
        let kv = match &self.kv {
            Storage::Paged(t) => t.state(),
            Storage::Contiguous(c) => c.state(),
        };
        kv.into_iter().chain(self.recurrent.arrays()).collect()
    }

    /// Bytes the buffers and recurrent states hold (capacity included; a
    /// paged cache's share of its pool: the blocks its rows list).
    pub fn nbytes(&self) -> usize {
        let kv = match &self.kv {
            Storage::Paged(t) => t.nbytes(),
            Storage::Contiguous(c) => c.nbytes(),
        };
        kv + self.recurrent.nbytes()
    }

    pub fn advance(&mut self, n: i32) {
        self.len += n;
        if let Storage::Paged(t) = &mut self.kv {
            t.end_forward();
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
    /// more than the fewest is shifted right by the difference and its left
    /// padding grows by as much (a contiguous row: one gather per buffer; a
    /// paged row's positions stay in their blocks, and the blocks past its
    /// new end go back); leading padding that no row needs any more is let
    /// go (contiguous: once it spans a growth step). Linear layers go back
    /// to each row's own state, kept by the last forward
    /// ([`KvCache::keep_steps`]).
    pub fn truncate_rows(&mut self, drop: &[i32]) -> anyhow::Result<()> {
        anyhow::ensure!(drop.len() == self.batch_size(), "one count per row");
        let fewest = drop.iter().copied().min().unwrap_or(0);
        let shifts: Vec<i32> = drop.iter().map(|d| d - fewest).collect();
        if drop.iter().any(|&d| d > 0) {
            self.recurrent.roll_back(drop)?;
        }
        if shifts.iter().any(|&s| s > 0) {
            if let Storage::Contiguous(c) = &mut self.kv {
                c.shift_rows(&shifts)?;
            }
            for (pad, s) in self.left_pad.iter_mut().zip(&shifts) {
                *pad += s;
            }
        }
        let common = match &mut self.kv {
            Storage::Paged(t) => {
                self.len -= fewest;
                t.release_past(self.len, &self.left_pad);
                self.left_pad.iter().copied().min().unwrap_or(0)
            }
            Storage::Contiguous(_) => {
                self.len = (self.len - fewest).max(*self.left_pad.iter().max().unwrap_or(&0));
                let common = self.left_pad.iter().copied().min().unwrap_or(0);
                if common < STEP {
                    return Ok(());
                }
                common
            }
        };
        self.drop_leading(common)
    }

    /// Keeps only the given rows, in that order, and drops padding columns
    /// that no remaining row needs.
    pub fn select_rows(&mut self, rows: &[usize]) -> anyhow::Result<()> {
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32]);
        self.left_pad = rows.iter().map(|&r| self.left_pad[r]).collect();
        match &mut self.kv {
            Storage::Contiguous(c) => c.select_rows(&idx)?,
            Storage::Paged(t) => t.select_rows(rows),
        }
        self.recurrent.select_rows(&idx)?;
        let common = self.left_pad.iter().copied().min().unwrap_or(0);
        if common > 0 {
            self.drop_leading(common)?;
        }
        Ok(())
    }

    /// Lets go of the first `cols` columns, padding in every row (a paged
    /// cache's padding columns hold nothing).
    fn drop_leading(&mut self, cols: i32) -> anyhow::Result<()> {
        if let Storage::Contiguous(c) = &mut self.kv {
            c.drop_leading(cols)?;
        }
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
        if parts.iter().any(|p| p.formats != first.formats) {
            return Err(anyhow!(
                "cannot merge KV caches stored in different precisions"
            ));
        }
        let len = parts.iter().map(|c| c.len).max().unwrap_or(0);
        let recurrent = RecurrentLayers::merge(
            &parts
                .iter()
                .map(|p| (&p.recurrent, p.batch_size()))
                .collect::<Vec<_>>(),
        )?;
        let left_pad = parts
            .iter()
            .flat_map(|p| p.left_pad.iter().map(move |l| l + len - p.len))
            .collect();
        let formats = first.formats.clone();
        let kv = match first.page_pool().cloned() {
            Some(pool) => {
                let tables = parts
                    .into_iter()
                    .map(|p| match p.kv {
                        Storage::Paged(t) => Ok(t),
                        Storage::Contiguous(_) => {
                            Err(anyhow!("cannot merge KV caches of different pools"))
                        }
                    })
                    .collect::<anyhow::Result<_>>()?;
                Storage::Paged(BlockTables::stack(&pool, tables)?)
            }
            None => {
                let columns = parts
                    .iter()
                    .map(|p| match &p.kv {
                        Storage::Contiguous(c) => Ok((c, p.len)),
                        Storage::Paged(_) => {
                            Err(anyhow!("cannot merge paged and contiguous KV caches"))
                        }
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                Storage::Contiguous(Contiguous::merge(&columns, len)?)
            }
        };
        Ok(KvCache {
            formats,
            len,
            left_pad,
            kv,
            recurrent,
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
        if out.page_pool().is_some() && common > 0 {
            out.drop_leading(common)?;
        }
        Ok(out)
    }

    /// Row `b` as a cache of its own (no padding): its keys and values
    /// copied out of the batch's buffers, or when paged its blocks shared
    /// (a write copies the block it writes, as for a view).
    pub fn extract_row(&self, b: usize) -> anyhow::Result<KvCache> {
        let mut out = self.row_view(b)?;
        out.recurrent.keep_steps(self.keeps_steps());
        if let Storage::Contiguous(c) = &mut out.kv {
            c.compact(out.len)?;
        }
        Ok(out)
    }

    /// Row `b` as a cache of its own that views the batch's buffers (no
    /// copy): for readers of one row's context (a drafter attending into
    /// the target's keys). Writing to it copies first (a paged row: the
    /// shared block it writes into).
    pub fn row_view(&self, b: usize) -> anyhow::Result<KvCache> {
        let kv = match &self.kv {
            Storage::Paged(t) => Storage::Paged(t.row(b)),
            Storage::Contiguous(c) => Storage::Contiguous(c.row(b, self.left_pad[b], self.len)?),
        };
        Ok(KvCache {
            formats: self.formats.clone(),
            len: self.row_len(b),
            left_pad: vec![0],
            kv,
            recurrent: self.recurrent.row(b)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slices::slice;

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

    #[test]
    fn a_full_pool_fails_the_write_naming_its_size_and_leaks_nothing() {
        let pool = PagePool::new(1, 2, 16).unwrap();
        let mut cache = KvCache::paged(&pool, vec![None], vec![0]);
        cache.update(0, tokens(0, 32), tokens(0, 32)).unwrap();
        cache.advance(32);
        let Err(err) = cache.update(0, tokens(32, 1), tokens(32, 1)) else {
            panic!("a third block was handed out")
        };
        assert!(
            err.to_string()
                .contains("pool is full (2 blocks of 16 positions)"),
            "{err}"
        );
        drop(cache);
        assert_eq!(pool.free_blocks(), 2);
    }
}
