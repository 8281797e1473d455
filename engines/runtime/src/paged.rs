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

use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::anyhow;
use mlx_rs::{ops, transforms::eval, Array};

/// A pool of KV blocks shared by the caches of one engine.
#[derive(Clone)]
pub struct PagePool {
    inner: Arc<Inner>,
}

struct Inner {
    block: i32,
    blocks: u32,
    free: Mutex<Vec<u32>>,
    /// Per layer, its buffers once written (`None` before, and forever for
    /// a layer that reads another layer's keys and values).
    layers: Mutex<Vec<Option<Vec<Array>>>>,
}

impl std::fmt::Debug for PagePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagePool")
            .field("block", &self.inner.block)
            .field("blocks", &self.inner.blocks)
            .field("free", &self.free_blocks())
            .finish()
    }
}

/// One block of the pool, held by the tables that list it; the last holder
/// dropping it returns the block to the pool.
pub struct Block {
    id: u32,
    pool: Arc<Inner>,
}

pub type BlockRef = Arc<Block>;

impl Drop for Block {
    fn drop(&mut self) {
        lock(&self.pool.free).push(self.id);
    }
}

impl Block {
    pub fn id(&self) -> u32 {
        self.id
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
        Ok(Self {
            inner: Arc::new(Inner {
                block,
                blocks,
                // Handed out from the end: lowest ids first.
                free: Mutex::new((1..blocks).rev().collect()),
                layers: Mutex::new(vec![None; num_layers]),
            }),
        })
    }

    /// Positions per block.
    pub fn block(&self) -> i32 {
        self.inner.block
    }

    /// Blocks sequences can hold (the padding block excluded).
    pub fn usable(&self) -> usize {
        self.inner.blocks as usize - 1
    }

    pub fn free_blocks(&self) -> usize {
        lock(&self.inner.free).len()
    }

    pub fn same(&self, other: &PagePool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// One free block, or an error naming the pool's size when none is left.
    pub fn allocate(&self) -> anyhow::Result<BlockRef> {
        let id = lock(&self.inner.free).pop().ok_or_else(|| {
            anyhow!(
                "the paged KV pool is full ({} blocks of {} positions)",
                self.usable(),
                self.inner.block
            )
        })?;
        Ok(Arc::new(Block {
            id,
            pool: self.inner.clone(),
        }))
    }

    /// Slots in a layer's buffers.
    fn slots(&self) -> i32 {
        self.inner.blocks as i32 * self.inner.block
    }

    /// Layer `layer`'s buffers (clones of the handles), `None` before its
    /// first write.
    pub fn buffers(&self, layer: usize) -> Option<Vec<Array>> {
        lock(&self.inner.layers)[layer].clone()
    }

    /// Every written layer's buffers, for evaluation.
    pub fn state(&self) -> Vec<Array> {
        lock(&self.inner.layers)
            .iter()
            .flatten()
            .flatten()
            .cloned()
            .collect()
    }

    /// Bytes the written layers' buffers hold.
    pub fn nbytes(&self) -> usize {
        lock(&self.inner.layers)
            .iter()
            .flatten()
            .flatten()
            .map(Array::nbytes)
            .sum()
    }

    /// Bytes one block holds across the written layers.
    pub fn bytes_per_block(&self) -> usize {
        self.nbytes() / self.inner.blocks as usize
    }

    /// Writes `parts` (each `[B, kv_heads, n, width]`, one per buffer of
    /// the layer) at `slots` (`[B * n]`, row-major over rows then
    /// positions) and returns the layer's new buffers. The first write of a
    /// layer creates its buffers, zeroed and evaluated, shaped after `parts`.
    pub fn write(
        &self,
        layer: usize,
        parts: &[Array],
        slots: &Array,
    ) -> anyhow::Result<Vec<Array>> {
        let mut layers = lock(&self.inner.layers);
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
        for (buf, part) in buffers.iter_mut().zip(parts) {
            let s = part.shape();
            // [B, H, n, W] -> [B * n, 1, H, W]: one update per slot.
            let update = part
                .transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[s[0] * s[2], 1, s[1], s[3]])?
                .as_dtype(buf.dtype())?;
            // The buffer is moved into the scatter so MLX can write it in
            // place (a second handle would make it copy the whole layer).
            let old = std::mem::replace(buf, Array::from_int(0));
            *buf = ops::indexing::scatter_single(old, slots, &update, 0)?;
        }
        Ok(buffers.clone())
    }

    /// Copies every written layer's positions of block `from` into block `to`
    /// (copy on write).
    pub fn copy_block(&self, from: u32, to: u32) -> anyhow::Result<()> {
        let b = self.inner.block;
        let src: Vec<i32> = (0..b).map(|i| from as i32 * b + i).collect();
        let dst: Vec<i32> = (0..b).map(|i| to as i32 * b + i).collect();
        let (src, dst) = (Array::from_slice(&src, &[b]), Array::from_slice(&dst, &[b]));
        let mut layers = lock(&self.inner.layers);
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
    Ok(entry.id as i32 * block + p % block)
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
