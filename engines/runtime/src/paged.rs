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

//! One pool serves the whole server: the host makes it (`model.kv_layout:
//! paged`) and exports it through a C table ([`PagePool::export`]), so the
//! batch of every engine and the prefix cache's entries hold blocks of the
//! same buffers, and a prefix hit or a handed-over sequence shares its
//! blocks instead of copying them. A block's holders are counted by the
//! host per block id ([`Block`]s of every image together), so a block one
//! image shares with another is copied on write too.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::anyhow;
use mlx_rs::{ops, transforms::eval, Array};
use mlx_sys::mlx_array;
use serde::Deserialize;

use crate::abi::{null_array, retain, RawPagePool, KV_BUFFERS};

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

/// The pool of KV blocks: the host's, or the host's through C.
#[derive(Clone)]
pub struct PagePool {
    backend: Backend,
    block: i32,
    blocks: u32,
}

#[derive(Clone)]
enum Backend {
    Local(Arc<Inner>),
    Foreign(RawPagePool),
}

// The host's table functions are thread-safe (mutexes behind C calls).
unsafe impl Send for Backend {}
unsafe impl Sync for Backend {}

struct Inner {
    block: i32,
    blocks: u32,
    counts: Mutex<Counts>,
    /// Per layer, its buffers once written (`None` before, and forever for
    /// a layer that reads another layer's keys and values).
    layers: Mutex<Vec<Option<Vec<Array>>>>,
    /// The last scatter's slots and their index array: a forward writes
    /// the same slots in every layer, so the array is made from host
    /// memory once a forward, not once a layer.
    scatter: Mutex<Option<(Vec<i32>, Array)>>,
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

impl Inner {
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

    fn slots(&self) -> i32 {
        self.blocks as i32 * self.block
    }

    fn write(&self, layer: usize, parts: &[Array], slots: &[i32]) -> anyhow::Result<Vec<Array>> {
        let mut layers = lock(&self.layers);
        let entry = layers
            .get_mut(layer)
            .ok_or_else(|| anyhow!("the KV pool has no layer {layer}"))?;
        if entry.is_none() {
            let created = parts
                .iter()
                .map(|p| {
                    let s = p.shape();
                    Ok(ops::zeros_dtype(&[self.slots(), s[1], s[3]], p.dtype())?)
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            eval(&created)?;
            *entry = Some(created);
        }
        let buffers = entry.as_mut().expect("created above");
        anyhow::ensure!(
            buffers.len() == parts.len(),
            "layer {layer} stores {} buffers, {} were written",
            buffers.len(),
            parts.len()
        );
        // Consecutive slots (one sequence's decode step, a chunk within a
        // block) are one slice written in place, as a contiguous cache
        // writes; others a scatter of one update per slot.
        let consecutive = slots.windows(2).all(|w| w[1] == w[0] + 1);
        let indices = (!consecutive).then(|| {
            let mut last = lock(&self.scatter);
            match last.as_ref() {
                Some((at, index)) if at.as_slice() == slots => index.clone(),
                _ => {
                    let index = Array::from_slice(slots, &[slots.len() as i32]);
                    *last = Some((slots.to_vec(), index.clone()));
                    index
                }
            }
        });
        for (buf, part) in buffers.iter_mut().zip(parts) {
            let s = part.shape();
            // [B, H, n, W] -> [B * n, H, W] (a single position needs no
            // transpose).
            let rows = match s[2] {
                1 => part.clone(),
                _ => part.transpose_axes(&[0, 2, 1, 3])?,
            };
            let rows = rows.as_dtype(buf.dtype())?;
            // The buffer is moved into the update so MLX can write it in
            // place (a second handle would make it copy the whole layer).
            let old = std::mem::replace(buf, Array::from_int(0));
            *buf = match &indices {
                None => {
                    let rows = rows.reshape(&[s[0] * s[2], s[1], s[3]])?;
                    crate::cache::slice_update(old, &rows, &[slots[0], 0, 0])?
                }
                Some(idx) => {
                    let rows = rows.reshape(&[s[0] * s[2], 1, s[1], s[3]])?;
                    ops::indexing::scatter_single(old, idx, &rows, 0)?
                }
            };
        }
        Ok(buffers.clone())
    }

    fn copy_block(&self, from: u32, to: u32) -> anyhow::Result<()> {
        let b = self.block;
        let src: Vec<i32> = (0..b).map(|i| from as i32 * b + i).collect();
        let dst: Vec<i32> = (0..b).map(|i| to as i32 * b + i).collect();
        let (src, dst) = (Array::from_slice(&src, &[b]), Array::from_slice(&dst, &[b]));
        let mut layers = lock(&self.layers);
        for buffers in layers.iter_mut().flatten() {
            for buf in buffers.iter_mut() {
                let s = buf.shape().to_vec();
                let rows = buf.take_axis(&src, 0)?.reshape(&[b, 1, s[1], s[2]])?;
                let old = std::mem::replace(buf, Array::from_int(0));
                *buf = ops::indexing::scatter_single(old, &dst, &rows, 0)?;
            }
        }
        Ok(())
    }

    fn state(&self) -> Vec<Array> {
        lock(&self.layers)
            .iter()
            .flatten()
            .flatten()
            .cloned()
            .collect()
    }

    fn buffers(&self, layer: usize) -> Option<Vec<Array>> {
        lock(&self.layers).get(layer).cloned().flatten()
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
        let inner = Inner {
            block,
            blocks,
            counts: Mutex::new(Counts {
                // Handed out from the end: lowest ids first.
                free: (1..blocks).rev().collect(),
                holders: vec![0; blocks as usize],
            }),
            layers: Mutex::new(vec![None; num_layers]),
            scatter: Mutex::new(None),
        };
        Ok(Self {
            backend: Backend::Local(Arc::new(inner)),
            block,
            blocks,
        })
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
        match &self.backend {
            Backend::Local(inner) => inner.free_blocks(),
            Backend::Foreign(raw) => unsafe { (raw.free_blocks)(raw.ctx) },
        }
    }

    /// The pool's identity: the host's pool, whichever image asks.
    fn key(&self) -> usize {
        match &self.backend {
            Backend::Local(inner) => Arc::as_ptr(inner) as usize,
            Backend::Foreign(raw) => raw.ctx as usize,
        }
    }

    pub fn same(&self, other: &PagePool) -> bool {
        self.key() == other.key()
    }

    /// One free block, or an error naming the pool's size when none is left.
    pub fn allocate(&self) -> anyhow::Result<BlockRef> {
        let id = match &self.backend {
            Backend::Local(inner) => inner.allocate(),
            Backend::Foreign(raw) => {
                let mut id = 0u32;
                unsafe { (raw.allocate)(raw.ctx, &mut id) }.then_some(id)
            }
        };
        let id = id.ok_or_else(|| {
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
        match &self.backend {
            Backend::Local(inner) => inner.retain(id),
            Backend::Foreign(raw) => unsafe { (raw.retain)(raw.ctx, id) },
        }
    }

    fn release(&self, id: u32) {
        match &self.backend {
            Backend::Local(inner) => inner.release(id),
            Backend::Foreign(raw) => unsafe { (raw.release)(raw.ctx, id) },
        }
    }

    fn holders(&self, id: u32) -> u32 {
        match &self.backend {
            Backend::Local(inner) => inner.holders(id),
            Backend::Foreign(raw) => unsafe { (raw.holders)(raw.ctx, id) },
        }
    }

    /// Layer `layer`'s buffers (handles of our own), `None` before its
    /// first write.
    pub fn buffers(&self, layer: usize) -> Option<Vec<Array>> {
        match &self.backend {
            Backend::Local(inner) => inner.buffers(layer),
            Backend::Foreign(raw) => unsafe {
                let mut out = [null_array(); KV_BUFFERS];
                let n = (raw.buffers)(raw.ctx, layer, out.as_mut_ptr());
                (n > 0).then(|| out[..n].iter().map(|&h| Array::from_ptr(h)).collect())
            },
        }
    }

    /// Every written layer's buffers, for evaluation.
    pub fn state(&self) -> Vec<Array> {
        match &self.backend {
            Backend::Local(inner) => inner.state(),
            Backend::Foreign(raw) => unsafe {
                let mut out = vec![null_array(); raw.layers * KV_BUFFERS];
                let n = (raw.state)(raw.ctx, out.as_mut_ptr(), out.len());
                out[..n].iter().map(|&h| Array::from_ptr(h)).collect()
            },
        }
    }

    /// Bytes the written layers' buffers hold.
    pub fn nbytes(&self) -> usize {
        self.state().iter().map(Array::nbytes).sum()
    }

    /// Bytes one block holds across the written layers.
    pub fn bytes_per_block(&self) -> usize {
        self.nbytes() / self.blocks as usize
    }

    /// Writes `parts` (each `[B, kv_heads, n, width]`, one per buffer of
    /// the layer) at `slots` (`B * n`, row-major over rows then positions)
    /// and returns the layer's new buffers. The first write of a layer
    /// creates its buffers, zeroed and evaluated, shaped after `parts`.
    pub fn write(
        &self,
        layer: usize,
        parts: &[Array],
        slots: &[i32],
    ) -> anyhow::Result<Vec<Array>> {
        match &self.backend {
            Backend::Local(inner) => inner.write(layer, parts, slots),
            Backend::Foreign(raw) => unsafe {
                let handles: Vec<mlx_array> = parts.iter().map(Array::as_ptr).collect();
                let mut out = [null_array(); KV_BUFFERS];
                let mut err = [0u8; 512];
                let n = (raw.write)(
                    raw.ctx,
                    layer,
                    handles.as_ptr(),
                    handles.len(),
                    slots.as_ptr(),
                    slots.len(),
                    out.as_mut_ptr(),
                    err.as_mut_ptr(),
                    err.len(),
                );
                if n == 0 {
                    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
                    return Err(anyhow!("{}", String::from_utf8_lossy(&err[..end])));
                }
                Ok(out[..n].iter().map(|&h| Array::from_ptr(h)).collect())
            },
        }
    }

    /// Copies every written layer's positions of block `from` into block `to`
    /// (copy on write).
    pub fn copy_block(&self, from: u32, to: u32) -> anyhow::Result<()> {
        match &self.backend {
            Backend::Local(inner) => inner.copy_block(from, to),
            Backend::Foreign(raw) => unsafe { (raw.copy_block)(raw.ctx, from, to) }
                .then_some(())
                .ok_or_else(|| anyhow!("copying KV block {from} to {to} failed")),
        }
    }

    /// Makes every layer's buffers now by running one token through
    /// `model` (so the pool's memory is taken at startup, not mid-serving).
    pub fn preallocate(&self, model: &crate::Model) -> anyhow::Result<()> {
        let mut cache = model.new_paged_cache(self, vec![0]);
        let logits = model.forward(
            &crate::generate::tokens_array(&[0]),
            &mut cache,
            crate::model::Logits::Last,
        )?;
        eval([&logits])?;
        eval(&cache.state())?;
        Ok(())
    }

    /// The host's pool as a C table; it stays alive for the process.
    pub fn export(&self) -> RawPagePool {
        let Backend::Local(inner) = &self.backend else {
            panic!("only the host's KV pool is exported");
        };
        fn me<'a>(ctx: *mut c_void) -> &'a Inner {
            // SAFETY: `ctx` is the `Arc<Inner>` leaked below.
            unsafe { &*(ctx as *const Inner) }
        }
        fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
            catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
        }
        /// Hands `arrays` over as handles written to `out`.
        unsafe fn give(arrays: Vec<Array>, out: *mut mlx_array) -> usize {
            let n = arrays.len();
            for (i, a) in arrays.into_iter().enumerate() {
                *out.add(i) = a.as_ptr();
                std::mem::forget(a);
            }
            n
        }
        unsafe extern "C" fn allocate(ctx: *mut c_void, out: *mut u32) -> bool {
            guard(false, || match me(ctx).allocate() {
                Some(id) => {
                    *out = id;
                    true
                }
                None => false,
            })
        }
        unsafe extern "C" fn retain_block(ctx: *mut c_void, id: u32) {
            guard((), || me(ctx).retain(id))
        }
        unsafe extern "C" fn release(ctx: *mut c_void, id: u32) {
            guard((), || me(ctx).release(id))
        }
        unsafe extern "C" fn holders(ctx: *mut c_void, id: u32) -> u32 {
            guard(0, || me(ctx).holders(id))
        }
        unsafe extern "C" fn free_blocks(ctx: *mut c_void) -> usize {
            guard(0, || me(ctx).free_blocks())
        }
        unsafe extern "C" fn buffers(ctx: *mut c_void, layer: usize, out: *mut mlx_array) -> usize {
            guard(0, || give(me(ctx).buffers(layer).unwrap_or_default(), out))
        }
        unsafe extern "C" fn state(ctx: *mut c_void, out: *mut mlx_array, cap: usize) -> usize {
            guard(0, || {
                let mut s = me(ctx).state();
                s.truncate(cap);
                give(s, out)
            })
        }
        #[allow(clippy::too_many_arguments)]
        unsafe extern "C" fn write(
            ctx: *mut c_void,
            layer: usize,
            parts: *const mlx_array,
            parts_len: usize,
            slots: *const i32,
            slots_len: usize,
            out: *mut mlx_array,
            err: *mut u8,
            err_cap: usize,
        ) -> usize {
            let result = catch_unwind(AssertUnwindSafe(|| {
                let parts: Vec<Array> = std::slice::from_raw_parts(parts, parts_len)
                    .iter()
                    .map(|&h| retain(h))
                    .collect();
                me(ctx).write(layer, &parts, std::slice::from_raw_parts(slots, slots_len))
            }))
            .unwrap_or_else(|_| Err(anyhow!("writing into the KV pool panicked")));
            match result {
                Ok(bufs) => give(bufs, out),
                Err(e) => {
                    let msg = format!("{e:#}");
                    let n = msg.len().min(err_cap.saturating_sub(1));
                    std::ptr::copy_nonoverlapping(msg.as_ptr(), err, n);
                    *err.add(n) = 0;
                    0
                }
            }
        }
        unsafe extern "C" fn copy_block(ctx: *mut c_void, from: u32, to: u32) -> bool {
            guard(false, || me(ctx).copy_block(from, to).is_ok())
        }
        RawPagePool {
            ctx: Arc::into_raw(inner.clone()) as *mut c_void,
            block: self.block,
            blocks: self.blocks,
            layers: lock(&inner.layers).len(),
            allocate,
            retain: retain_block,
            release,
            holders,
            free_blocks,
            buffers,
            state,
            write,
            copy_block,
        }
    }

    /// A view of the host's pool.
    ///
    /// # Safety
    /// `raw` came from [`PagePool::export`] and lives for the process.
    pub unsafe fn import(raw: &RawPagePool) -> Self {
        Self {
            backend: Backend::Foreign(*raw),
            block: raw.block,
            blocks: raw.blocks,
        }
    }
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
    use crate::cache::KvCache;

    /// `[1, 1, n, 32]` keys whose values encode their position.
    fn keys(n: i32) -> Array {
        let data: Vec<f32> = (0..n * 32).map(|i| i as f32).collect();
        Array::from_slice(&data, &[1, 1, n, 32])
    }

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
    fn a_full_pool_fails_the_write_naming_its_size_and_leaks_nothing() {
        let pool = PagePool::new(1, 2, 16).unwrap();
        let mut cache = KvCache::paged(&pool, vec![None], vec![0]);
        cache.update(0, keys(32), keys(32)).unwrap();
        cache.advance(32);
        let Err(err) = cache.update(0, keys(1), keys(1)) else {
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
