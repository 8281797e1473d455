//! Paged KV storage: the keys and values live in a [`PagePool`]'s blocks,
//! listed per row, and the cache's columns are a view of them (row `b`'s
//! column `c` is its position `c - left_pad[b]`). Every batch operation
//! keeps its meaning; those that move columns around only edit the rows'
//! block tables.

use std::sync::Arc;

use mlx_rs::Array;

use super::contiguous::{align, round_up, Contiguous};
use super::view::{LayerView, PagedRead};
use crate::kv_quant::KvQuant;
use crate::paged::{self, BlockRef, PagePool};

/// A paged cache's rows.
#[derive(Clone)]
pub(crate) struct BlockTables {
    pool: PagePool,
    /// Per row, the blocks holding its positions in order.
    tables: Vec<Vec<BlockRef>>,
    /// The forward under way, set by its first write and cleared by
    /// [`BlockTables::end_forward`].
    forward: Option<Forward>,
}

/// A forward's new positions' slots (`B * n`; as an index array once a
/// kernel takes them, made once for every layer) and what its attention
/// reads.
#[derive(Clone)]
struct Forward {
    slots: Arc<[i32]>,
    index: Option<Array>,
    read: PagedRead,
}

/// A paged layer's buffers and where a forward's new positions go in them,
/// for a kernel that writes them in place ([`crate::KvCache::pool_target`]).
pub struct PoolTarget {
    /// `[slots, kv_heads, head_dim]` each.
    pub keys: Array,
    pub values: Array,
    /// The token of the layer's last in-place write, which this one
    /// follows ([`paged::split_written`]).
    pub after: Option<Array>,
    /// `[B * n]` int32, row-major over rows then positions.
    pub slots: Array,
}

impl BlockTables {
    pub(crate) fn new(pool: &PagePool, tables: Vec<Vec<BlockRef>>) -> Self {
        Self {
            pool: pool.clone(),
            tables,
            forward: None,
        }
    }

    pub(crate) fn pool(&self) -> &PagePool {
        &self.pool
    }

    pub(crate) fn tables(&self) -> &[Vec<BlockRef>] {
        &self.tables
    }

    /// Writes `parts` (layer `layer`'s `n` new columns after column `len`,
    /// one per buffer, in a layout [`PagePool::write`] takes) to their
    /// rows' blocks (allocated, or copied when shared, at the forward's
    /// first write) and returns what attention reads of the layer.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        quant: Option<KvQuant>,
        parts: &[Array],
        len: i32,
        n: i32,
        left_pad: &[i32],
    ) -> anyhow::Result<LayerView> {
        let f = self.begin(len, n, left_pad)?;
        f.read.view(quant, self.pool.write(layer, parts, &f.slots)?)
    }

    /// The forward under way, begun (its blocks made ready) at its first
    /// write.
    fn begin(&mut self, len: i32, n: i32, left_pad: &[i32]) -> anyhow::Result<Forward> {
        if self.forward.is_none() {
            let slots = self.prepare(len, n, left_pad)?;
            let read = self.read(len + n, left_pad)?;
            self.forward = Some(Forward {
                slots,
                index: None,
                read,
            });
        }
        Ok(self.forward.clone().expect("set above"))
    }

    /// See [`crate::KvCache::pool_target`].
    pub(crate) fn pool_target(
        &mut self,
        layer: usize,
        dtype: mlx_rs::Dtype,
        len: i32,
        n: i32,
        left_pad: &[i32],
    ) -> anyhow::Result<Option<PoolTarget>> {
        // Begun first (a write that does not go this way begins it too): its
        // copies on write are writes the kernel follows.
        self.begin(len, n, left_pad)?;
        let Some(listed) = self.pool.buffers(layer) else {
            return Ok(None);
        };
        let (buffers, after) = paged::split_written(listed);
        if !crate::gpu_fused::takes_pool_heads(&buffers, dtype) {
            return Ok(None);
        }
        let f = self.forward.as_mut().expect("begun above");
        let slots = f
            .index
            .get_or_insert_with(|| Array::from_slice(&f.slots, &[f.slots.len() as i32]))
            .clone();
        let [keys, values] = <[Array; 2]>::try_from(buffers).expect("two buffers");
        Ok(Some(PoolTarget {
            keys,
            values,
            after,
            slots,
        }))
    }

    /// See [`crate::KvCache::pool_read`].
    pub(crate) fn forward_read(&self) -> Option<PagedRead> {
        self.forward.as_ref().map(|f| f.read.clone())
    }

    /// See [`crate::KvCache::wrote_pool`].
    pub(crate) fn wrote(
        &mut self,
        layer: usize,
        target: PoolTarget,
        written: Array,
    ) -> anyhow::Result<LayerView> {
        let f = self
            .forward
            .clone()
            .ok_or_else(|| anyhow::anyhow!("layer {layer} written outside a forward"))?;
        self.pool.mark_written(layer, written.clone())?;
        f.read.view(None, vec![target.keys, target.values, written])
    }

    /// Layer `layer`'s columns `0..len` (`None` before its first write).
    pub(crate) fn view(
        &self,
        layer: usize,
        quant: Option<KvQuant>,
        len: i32,
        left_pad: &[i32],
    ) -> anyhow::Result<Option<LayerView>> {
        let Some(buffers) = self.pool.buffers(layer) else {
            return Ok(None);
        };
        self.read(len, left_pad)?.view(quant, buffers).map(Some)
    }

    pub(crate) fn end_forward(&mut self) {
        self.forward = None;
    }

    /// Keeps the given rows, in that order.
    pub(crate) fn select_rows(&mut self, rows: &[usize]) {
        self.tables = rows.iter().map(|&r| self.tables[r].clone()).collect();
        self.forward = None;
    }

    /// Row `b`'s blocks, shared.
    pub(crate) fn row(&self, b: usize) -> Self {
        Self::new(&self.pool, vec![self.tables[b].clone()])
    }

    /// The parts' rows stacked (no copy); they must share one pool.
    pub(crate) fn stack(pool: &PagePool, parts: Vec<BlockTables>) -> anyhow::Result<Self> {
        let mut out = Self::new(pool, Vec::new());
        for p in parts {
            anyhow::ensure!(
                p.pool.same(pool),
                "cannot merge KV caches of different pools"
            );
            out.tables.extend(p.tables);
        }
        Ok(out)
    }

    /// `contiguous`'s first `len` columns written into new blocks of `pool`.
    pub(crate) fn copy_in(
        pool: &PagePool,
        contiguous: &Contiguous,
        len: i32,
        left_pad: &[i32],
    ) -> anyhow::Result<Self> {
        let mut out = Self::new(pool, vec![Vec::new(); left_pad.len()]);
        if len > 0 {
            let slots = out.prepare(0, len, left_pad)?;
            for (l, buffers) in contiguous.layers.iter().enumerate() {
                if !buffers.is_empty() {
                    pool.write(l, &contiguous.columns(l, len)?, &slots)?;
                }
            }
        }
        Ok(out)
    }

    /// Columns `0..len` of `layers` layers copied out of the pool.
    pub(crate) fn copy_out(
        &self,
        layers: usize,
        len: i32,
        left_pad: &[i32],
    ) -> anyhow::Result<Contiguous> {
        let mut out = Contiguous::new(layers);
        if len > 0 {
            let read = self.read(len, left_pad)?;
            let capacity = round_up(len);
            for (l, buffers) in out.layers.iter_mut().enumerate() {
                if let Some(listed) = self.pool.buffers(l) {
                    let (bufs, written) = paged::split_written(listed);
                    *buffers = bufs
                        .iter()
                        .map(|b| align(&read.gather_after(b, written.as_ref())?, len, 0, capacity))
                        .collect::<anyhow::Result<_>>()?;
                }
            }
            out.capacity = capacity;
        }
        Ok(out)
    }

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
        let tables = Array::from_slice(&tables, &[rows, most as i32]);
        Ok(PagedRead::new(slots, tables, block, total, rows))
    }

    /// Lets go of each row's blocks past its last column before `len`.
    pub(crate) fn release_past(&mut self, len: i32, left_pad: &[i32]) {
        self.forward = None;
        let block = self.pool.block();
        for (table, &start) in self.tables.iter_mut().zip(left_pad) {
            let keep = ((len - start).max(0) + block - 1) / block;
            table.truncate(keep as usize);
        }
    }

    /// Every written layer's buffers in the pool, for evaluation.
    pub(crate) fn state(&self) -> Vec<Array> {
        self.pool.state()
    }

    /// The pool's bytes in the blocks the rows list.
    pub(crate) fn nbytes(&self) -> usize {
        self.tables.iter().map(Vec::len).sum::<usize>() * self.pool.bytes_per_block()
    }
}
