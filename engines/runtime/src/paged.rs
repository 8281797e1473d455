//! Paged KV storage (issues 18 and 21): one preallocated pool per layer,
//! cut into blocks of `block` positions, and per sequence a table of the
//! blocks that hold its positions in order.
//!
//! A [`crate::KvCache`] in paged mode keeps its rows' block tables instead
//! of arrays of its own, so the batch operations that used to copy every
//! layer's keys and values (stacking a new sequence onto the batch, letting
//! a finished one go, growing the buffers, dropping padding, a verify's
//! per-row rollback) only edit tables. Blocks are reference counted
//! ([`BlockRef`]): a cache cloned or a row viewed shares its blocks, and a
//! write into a shared block copies that block first (copy on write), so a
//! sharer never sees another's tokens.
//!
//! Block 0 is never handed out: writes of left-padding positions go there,
//! and reads of padding columns come from there (attention masks them).
//!
//! A layer's buffers are `[blocks * block, kv_heads, width]` (slots first,
//! so a step's new positions are one scatter along axis 0); they are
//! created, zeroed and evaluated on the layer's first write, and never grow.
//! On the GPU a kernel writes them in place (the fused heads kernel, or
//! one write for keys and values), so they stay the same arrays, and each
//! write's token orders what reads the layer after it ([`LayerBuffers`]);
//! on the CPU MLX's slice update and scatter write them, reusing the old
//! buffers' memory.

//! One pool serves the whole server: the host makes it (`model.kv_layout:
//! paged`) and exports it through a C table (`abi`), so the
//! batch of every engine and the prefix cache's entries hold blocks of the
//! same buffers, and a prefix hit or a handed-over sequence shares its
//! blocks instead of copying them. A block's holders are counted by the
//! host per block id ([`Block`]s of every image together), so a block one
//! image shares with another is copied on write too.

use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::anyhow;
use mlx_rs::{ops, transforms::eval, Array};
use serde::Deserialize;

/// Where a server's keys and values live (`model.kv_layout`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvLayout {
    /// Arrays per sequence and per batch, grown as they fill.
    #[default]
    Contiguous,
    /// Blocks of one pool, allocated at startup for the whole KV budget.
    Paged,
}

/// The pool of KV blocks.
#[derive(Clone)]
pub struct PagePool {
    store: Arc<dyn PageStore>,
    block: i32,
    blocks: u32,
}

/// What holds a pool's blocks and buffers: the host's [`LocalPages`], or
/// the host's through C in a plugin (`abi::foreign`).
pub trait PageStore: Send + Sync {
    /// The pool's identity: the host's pool's, whichever image asks.
    fn key(&self) -> usize;
    /// A free block's id, counted once; `None` when none is free.
    fn allocate(&self) -> Option<u32>;
    fn retain(&self, id: u32);
    fn release(&self, id: u32);
    /// Holders of block `id` across images.
    fn holders(&self, id: u32) -> u32;
    fn free_blocks(&self) -> usize;
    /// Layers the pool has buffers for.
    fn layers(&self) -> usize;
    /// Layer `layer`'s buffers, `None` before its first write (see
    /// [`PagePool::buffers`]).
    fn buffers(&self, layer: usize) -> Option<Vec<Array>>;
    /// Every written layer's buffers and in-place writes' tokens.
    fn state(&self) -> Vec<Array>;
    /// See [`PagePool::write`].
    fn write(&self, layer: usize, parts: &[Array], slots: &[i32]) -> anyhow::Result<Vec<Array>>;
    fn copy_block(&self, from: u32, to: u32) -> anyhow::Result<()>;
    /// Layer `layer`'s buffers were written in place by the node `written`
    /// is the token of ([`crate::KvCache::pool_target`]): later reads and
    /// writes of the layer follow it.
    fn mark_written(&self, layer: usize, written: Array) -> anyhow::Result<()>;
}

/// The host's pool.
pub struct LocalPages {
    block: i32,
    blocks: u32,
    counts: Mutex<Counts>,
    /// Per layer, its buffers once written (`None` before, and forever for
    /// a layer that reads another layer's keys and values).
    layers: Mutex<Vec<Option<LayerBuffers>>>,
    /// The last write's slots and their index array
    /// ([`LocalPages::slot_index`]).
    last_index: Mutex<Option<(Vec<i32>, Array)>>,
}

/// A layer's buffers, and where the GPU writes them in place
/// ([`crate::gpu_fused::kv_write`], [`crate::gpu_fused::heads_into_pool`])
/// the last write's token, which every later read and write of the layer
/// follows. A write does not wait for the reads queued before it, so
/// positions are written again (after a rollback) only once the reads of
/// the forward that wrote them were evaluated, as every engine reads a
/// verify's tokens before it rolls back.
#[derive(Clone)]
struct LayerBuffers {
    arrays: Vec<Array>,
    written: Option<Array>,
}

impl LayerBuffers {
    /// The buffers as the store lists them ([`PagePool::buffers`]).
    fn listed(&self) -> Vec<Array> {
        self.arrays.iter().chain(&self.written).cloned().collect()
    }

    /// Refuses MLX's scatter or slice update over buffers written in place:
    /// neither orders itself after the kernels that wrote them. (A layer
    /// the GPU writes in place is always written so: never reached.)
    fn check_unwritten(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.written.is_none(),
            "a KV layer written in place cannot take MLX's scatter"
        );
        Ok(())
    }
}

/// A dense layer's buffers: keys and values.
const DENSE_BUFFERS: usize = 2;

/// A layer's buffers as [`PagePool::buffers`] lists them, split into the
/// buffers and the token of their last in-place write (listed after a
/// dense layer's two).
pub(crate) fn split_written(mut listed: Vec<Array>) -> (Vec<Array>, Option<Array>) {
    let written = (listed.len() == DENSE_BUFFERS + 1)
        .then(|| listed.pop())
        .flatten();
    (listed, written)
}

/// `index` as an index array MLX's CUDA graph reads only after the
/// in-place write `written` is the token of: a gather by it reads what the
/// write wrote. (MLX's `depends` orders evaluation, not the graph's
/// kernels, which run in the order of the buffers they share.)
pub(crate) fn index_after(index: &Array, written: Option<&Array>) -> anyhow::Result<Array> {
    match written {
        Some(w) => Ok(crate::gpu_fused::ordered(index, w)?),
        None => Ok(index.clone()),
    }
}

struct Counts {
    free: Vec<u32>,
    /// Per block, the [`Block`]s holding it (across images).
    holders: Vec<u32>,
}

impl std::fmt::Debug for PagePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagePool")
            .field("block", &self.block)
            .field("blocks", &self.blocks)
            .field("free", &self.free_blocks())
            .finish()
    }
}

/// One block of the pool, held by the tables that list it (an `Arc` per
/// image); the last holder dropping it returns the block to the pool.
pub struct Block {
    id: u32,
    pool: PagePool,
}

pub type BlockRef = Arc<Block>;

impl Drop for Block {
    fn drop(&mut self) {
        self.pool.release(self.id);
    }
}

impl Block {
    pub fn id(&self) -> u32 {
        self.id
    }
}

/// Whether another table, in this image or another, lists `block`: a
/// write into it must copy it first.
pub fn is_shared(block: &BlockRef) -> bool {
    Arc::strong_count(block) > 1 || block.pool.holders(block.id) > 1
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl LocalPages {
    fn slots(&self) -> i32 {
        self.blocks as i32 * self.block
    }

    /// `slots` as an index array, made from host memory once a forward
    /// (every layer writes the same slots), not once a layer.
    fn slot_index(&self, slots: &[i32]) -> Array {
        let mut last = lock(&self.last_index);
        match last.as_ref() {
            Some((at, index)) if at.as_slice() == slots => index.clone(),
            _ => {
                let index = Array::from_slice(slots, &[slots.len() as i32]);
                *last = Some((slots.to_vec(), index.clone()));
                index
            }
        }
    }
}

impl PageStore for LocalPages {
    fn key(&self) -> usize {
        self as *const Self as usize
    }

    fn allocate(&self) -> Option<u32> {
        let mut c = lock(&self.counts);
        let id = c.free.pop()?;
        c.holders[id as usize] = 1;
        Some(id)
    }

    fn retain(&self, id: u32) {
        lock(&self.counts).holders[id as usize] += 1;
    }

    fn holders(&self, id: u32) -> u32 {
        lock(&self.counts).holders[id as usize]
    }

    fn free_blocks(&self) -> usize {
        lock(&self.counts).free.len()
    }

    fn layers(&self) -> usize {
        lock(&self.layers).len()
    }

    fn release(&self, id: u32) {
        let mut c = lock(&self.counts);
        let h = &mut c.holders[id as usize];
        // A block no one holds is free already (never listed twice).
        if *h == 0 {
            return;
        }
        *h -= 1;
        if *h == 0 {
            c.free.push(id);
        }
    }

    fn write(&self, layer: usize, parts: &[Array], slots: &[i32]) -> anyhow::Result<Vec<Array>> {
        let mut layers = lock(&self.layers);
        let entry = layers
            .get_mut(layer)
            .ok_or_else(|| anyhow!("the KV pool has no layer {layer}"))?;
        let as_rows = parts.iter().all(|p| is_rows(p, slots.len()));
        if entry.is_none() {
            let created = parts
                .iter()
                .map(|p| {
                    let s = p.shape();
                    let heads = if as_rows { s[2] } else { s[1] };
                    Ok(ops::zeros_dtype(&[self.slots(), heads, s[3]], p.dtype())?)
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            eval(&created)?;
            *entry = Some(LayerBuffers {
                arrays: created,
                written: None,
            });
        }
        let buffers = entry.as_mut().expect("created above");
        anyhow::ensure!(
            buffers.arrays.len() == parts.len(),
            "layer {layer} stores {} buffers, {} were written",
            buffers.arrays.len(),
            parts.len()
        );
        // On the GPU one kernel writes the keys and values in place.
        if crate::gpu_fused::takes_kv_write(&buffers.arrays, parts) {
            let index = self.slot_index(slots);
            let after = buffers.written.as_ref();
            let written =
                crate::gpu_fused::kv_write(&buffers.arrays, parts, as_rows, &index, after)?;
            buffers.written = Some(written);
            return Ok(buffers.listed());
        }
        buffers.check_unwritten()?;
        // Consecutive slots (one sequence's decode step, a chunk within a
        // block) are one slice written in place, as a contiguous cache
        // writes; others, and parts given as the scatter's rows, a scatter
        // of one update per slot.
        let consecutive = !as_rows && slots.windows(2).all(|w| w[1] == w[0] + 1);
        let indices = (!consecutive).then(|| self.slot_index(slots));
        for (buf, part) in buffers.arrays.iter_mut().zip(parts) {
            let s = part.shape();
            // [B, H, n, W] -> [B * n, H, W] (a single position needs no
            // transpose).
            let rows = match (as_rows, s[2]) {
                (true, _) | (false, 1) => part.clone(),
                _ => part.transpose_axes(&[0, 2, 1, 3])?,
            };
            let rows = rows.as_dtype(buf.dtype())?;
            // The buffer is moved into the update so MLX can write it in
            // place (a second handle would make it copy the whole layer).
            let old = std::mem::replace(buf, Array::from_int(0));
            *buf = match &indices {
                None => {
                    let rows = rows.reshape(&[s[0] * s[2], s[1], s[3]])?;
                    crate::slices::slice_update(old, &rows, &[slots[0], 0, 0])?
                }
                Some(idx) => {
                    let rows = match as_rows {
                        true => rows,
                        false => rows.reshape(&[s[0] * s[2], 1, s[1], s[3]])?,
                    };
                    ops::indexing::scatter_single(old, idx, &rows, 0)?
                }
            };
        }
        Ok(buffers.listed())
    }

    fn copy_block(&self, from: u32, to: u32) -> anyhow::Result<()> {
        let b = self.block;
        let src: Vec<i32> = (0..b).map(|i| from as i32 * b + i).collect();
        let dst: Vec<i32> = (0..b).map(|i| to as i32 * b + i).collect();
        let (src, dst) = (Array::from_slice(&src, &[b]), Array::from_slice(&dst, &[b]));
        let mut layers = lock(&self.layers);
        for layer in layers.iter_mut().flatten() {
            let src = index_after(&src, layer.written.as_ref())?;
            let rows = layer
                .arrays
                .iter()
                .map(|buf| {
                    let s = buf.shape();
                    Ok(buf.take_axis(&src, 0)?.reshape(&[b, 1, s[1], s[2]])?)
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            // Written in place on the GPU, as a forward's rows are.
            if crate::gpu_fused::takes_kv_write(&layer.arrays, &rows) {
                let after = layer.written.as_ref();
                layer.written = Some(crate::gpu_fused::kv_write(
                    &layer.arrays,
                    &rows,
                    true,
                    &dst,
                    after,
                )?);
                continue;
            }
            layer.check_unwritten()?;
            for (buf, rows) in layer.arrays.iter_mut().zip(rows) {
                let old = std::mem::replace(buf, Array::from_int(0));
                *buf = ops::indexing::scatter_single(old, &dst, &rows, 0)?;
            }
        }
        Ok(())
    }

    fn mark_written(&self, layer: usize, written: Array) -> anyhow::Result<()> {
        let mut layers = lock(&self.layers);
        let buffers = layers
            .get_mut(layer)
            .and_then(Option::as_mut)
            .ok_or_else(|| anyhow!("layer {layer} of the KV pool has no buffers"))?;
        anyhow::ensure!(
            buffers.arrays.len() == DENSE_BUFFERS,
            "layer {layer} of the KV pool is not written in place"
        );
        buffers.written = Some(written);
        Ok(())
    }

    fn state(&self) -> Vec<Array> {
        lock(&self.layers)
            .iter()
            .flatten()
            .flat_map(LayerBuffers::listed)
            .collect()
    }

    fn buffers(&self, layer: usize) -> Option<Vec<Array>> {
        lock(&self.layers)
            .get(layer)
            .and_then(|l| l.as_ref().map(LayerBuffers::listed))
    }
}

impl PagePool {
    /// A pool of `usable` blocks of `block` positions for a model of
    /// `num_layers` layers (one more block is kept for padding).
    pub fn new(num_layers: usize, usable: usize, block: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(
            block > 0 && usable > 0,
            "a KV pool needs blocks of at least one position"
        );
        let blocks = u32::try_from(usable + 1)?;
        let block = i32::try_from(block)?;
        anyhow::ensure!(
            (blocks as i64) * (block as i64) < i32::MAX as i64,
            "a KV pool of {blocks} blocks of {block} positions is too large"
        );
        let pages = LocalPages {
            block,
            blocks,
            counts: Mutex::new(Counts {
                // Handed out from the end: lowest ids first.
                free: (1..blocks).rev().collect(),
                holders: vec![0; blocks as usize],
            }),
            layers: Mutex::new(vec![None; num_layers]),
            last_index: Mutex::new(None),
        };
        Ok(Self {
            store: Arc::new(pages),
            block,
            blocks,
        })
    }

    /// A pool whose blocks `store` holds (a plugin's view of the host's),
    /// of `blocks` blocks (the padding block included) of `block`
    /// positions.
    pub fn with_store(store: Arc<dyn PageStore>, block: i32, blocks: u32) -> Self {
        Self {
            store,
            block,
            blocks,
        }
    }

    /// The pool's blocks and buffers, for its C form (`abi`).
    pub fn store(&self) -> &Arc<dyn PageStore> {
        &self.store
    }

    /// Blocks, the padding block included.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    pub fn layers(&self) -> usize {
        self.store.layers()
    }

    /// Positions per block.
    pub fn block(&self) -> i32 {
        self.block
    }

    /// Blocks sequences can hold (the padding block excluded).
    pub fn usable(&self) -> usize {
        self.blocks as usize - 1
    }

    pub fn free_blocks(&self) -> usize {
        self.store.free_blocks()
    }

    pub fn same(&self, other: &PagePool) -> bool {
        self.store.key() == other.store.key()
    }

    /// One free block, or an error naming the pool's size when none is left.
    pub fn allocate(&self) -> anyhow::Result<BlockRef> {
        let id = self.store.allocate().ok_or_else(|| {
            anyhow!(
                "the paged KV pool is full ({} blocks of {} positions)",
                self.usable(),
                self.block
            )
        })?;
        Ok(self.adopt(id))
    }

    /// A holder of block `id` for this image, taking over one count the
    /// pool already has for it.
    pub(crate) fn adopt(&self, id: u32) -> BlockRef {
        Arc::new(Block {
            id,
            pool: self.clone(),
        })
    }

    /// Another holder of block `id` (one listed by a table from another
    /// image).
    pub(crate) fn share(&self, id: u32) -> anyhow::Result<BlockRef> {
        anyhow::ensure!(
            id > 0 && id < self.blocks,
            "block {id} is not one of the pool's"
        );
        self.retain(id);
        Ok(self.adopt(id))
    }

    pub(crate) fn retain(&self, id: u32) {
        self.store.retain(id)
    }

    fn release(&self, id: u32) {
        self.store.release(id)
    }

    fn holders(&self, id: u32) -> u32 {
        self.store.holders(id)
    }

    /// Layer `layer`'s buffers (handles of our own), `None` before its
    /// first write; a layer the GPU writes in place lists its last write's
    /// token after them ([`split_written`]).
    pub fn buffers(&self, layer: usize) -> Option<Vec<Array>> {
        self.store.buffers(layer)
    }

    /// Every written layer's buffers and in-place writes' tokens, for
    /// evaluation (which runs the writes still queued).
    pub fn state(&self) -> Vec<Array> {
        self.store.state()
    }

    /// Bytes the written layers' buffers hold.
    pub fn nbytes(&self) -> usize {
        (0..self.layers())
            .filter_map(|l| self.buffers(l))
            .flat_map(|listed| split_written(listed).0)
            .map(|b| b.nbytes())
            .sum()
    }

    /// Bytes one block holds across the written layers.
    pub fn bytes_per_block(&self) -> usize {
        self.nbytes() / self.blocks as usize
    }

    /// Writes `parts` (each `[B, kv_heads, n, width]`, one per buffer of
    /// the layer, or already the scatter's rows `[B * n, 1, kv_heads,
    /// width]`, which need no reshape node) at `slots` (`B * n`, row-major
    /// over rows then positions) and returns the layer's buffers as
    /// [`PagePool::buffers`] lists them. The
    /// first write of a layer creates its buffers, zeroed and evaluated,
    /// shaped after `parts`.
    pub fn write(
        &self,
        layer: usize,
        parts: &[Array],
        slots: &[i32],
    ) -> anyhow::Result<Vec<Array>> {
        self.store.write(layer, parts, slots)
    }

    /// Copies every written layer's positions of block `from` into block `to`
    /// (copy on write).
    pub fn copy_block(&self, from: u32, to: u32) -> anyhow::Result<()> {
        self.store.copy_block(from, to)
    }

    /// See [`PageStore::mark_written`].
    pub(crate) fn mark_written(&self, layer: usize, written: Array) -> anyhow::Result<()> {
        self.store.mark_written(layer, written)
    }
}

/// Whether `part` is given as a scatter's rows (`[slots, 1, kv_heads,
/// width]`) rather than as `[B, kv_heads, n, width]`. Where both readings
/// fit (one position of one-head rows) they lay the data out alike.
fn is_rows(part: &Array, slots: usize) -> bool {
    part.ndim() == 4 && part.dim(0) as usize == slots && part.dim(1) == 1
}

/// Row `b`'s slot of column `col`: positions before the row's start
/// (left padding) map into the padding block, others into its blocks.
/// The ragged attention kernel follows the same rule (`ragged.rs`).
pub fn slot(table: &[BlockRef], start: i32, block: i32, col: i32) -> anyhow::Result<i32> {
    let p = col - start;
    if p < 0 {
        return Ok(col.rem_euclid(block));
    }
    let entry = table
        .get((p / block) as usize)
        .ok_or_else(|| anyhow!("position {p} lies past its row's blocks"))?;
    Ok(entry.id() as i32 * block + p % block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_back_when_their_last_holder_goes() {
        let pool = PagePool::new(1, 3, 16).unwrap();
        let a = pool.allocate().unwrap();
        let shared = a.clone();
        let b = pool.allocate().unwrap();
        assert_ne!(a.id(), 0, "block 0 holds padding");
        assert_eq!(pool.free_blocks(), 1);
        drop(a);
        assert_eq!(pool.free_blocks(), 1, "still held by its sharer");
        drop((shared, b));
        assert_eq!(pool.free_blocks(), 3);
    }

    #[test]
    fn padding_columns_map_into_the_padding_block() {
        let pool = PagePool::new(1, 4, 4).unwrap();
        let table = vec![pool.allocate().unwrap(), pool.allocate().unwrap()];
        // Row starting at column 3: columns 0-2 are padding.
        assert_eq!(slot(&table, 3, 4, 1).unwrap(), 1);
        assert_eq!(slot(&table, 3, 4, 3).unwrap(), table[0].id() as i32 * 4);
        assert_eq!(slot(&table, 3, 4, 8).unwrap(), table[1].id() as i32 * 4 + 1);
        assert!(slot(&table, 3, 4, 11).is_err(), "past the row's blocks");
    }
}
