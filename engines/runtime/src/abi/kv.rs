//! A `KvCache` in C form ([`RawKv`]): written by a callee into a caller's
//! buffers ([`KvReceiver`]), or lent for one call ([`LentKv`]).

use mlx_rs::Array;
use mlx_sys::mlx_array;

use super::{RawKv, RawKvFormat, KV_BUFFERS};
use crate::cache::{KvCache, KvParts, Recurrent};
use crate::kv_quant::KvQuant;
use crate::paged::{BlockRef, PagePool};

impl RawKv {
    /// Buffers for a callee to write a cache of `layers` layers into (a
    /// paged one of at most `blocks` blocks).
    pub(crate) fn receiver(layers: usize, blocks: usize) -> KvReceiver {
        let mut formats = vec![RawKvFormat::of(None); layers];
        let mut buffers = vec![null_array(); layers * KV_BUFFERS];
        let mut recurrent = vec![null_array(); layers * 2];
        let mut ids = vec![0u32; blocks];
        let left_pad = Box::new(0i32);
        let raw = RawKv {
            formats: formats.as_mut_ptr(),
            buffers: buffers.as_mut_ptr(),
            recurrent: recurrent.as_mut_ptr(),
            layers,
            len: 0,
            capacity: 0,
            left_pad: &*left_pad,
            batch: 1,
            blocks: ids.as_mut_ptr(),
            blocks_len: 0,
            blocks_cap: ids.len(),
        };
        KvReceiver {
            _formats: formats,
            _buffers: buffers,
            _recurrent: recurrent,
            _ids: ids,
            _left_pad: left_pad,
            raw,
        }
    }

    /// Writes `cache` (batch 1) into a receiver's buffers, handing over a
    /// handle of each array (a paged cache: a count of each block). False,
    /// handing nothing over, when its blocks do not fit.
    ///
    /// # Safety
    /// `self` came from [`RawKv::receiver`] for as many layers as `cache`.
    pub(crate) unsafe fn give(&mut self, cache: KvCache) -> bool {
        if let Some((pool, table)) = cache.paged_table() {
            if table.len() > self.blocks_cap {
                return false;
            }
            for (i, b) in table.iter().enumerate() {
                pool.retain(b.id());
                *self.blocks.add(i) = b.id();
            }
            self.blocks_len = table.len();
        }
        // Each array handed over as a handle of the receiver's own.
        let hand_over = |a: &Array| {
            let mine = a.clone();
            let handle = mine.as_ptr();
            std::mem::forget(mine);
            handle
        };
        let formats = cache.formats();
        let layers = self.layers.min(formats.len());
        for (l, quant) in formats.into_iter().take(layers).enumerate() {
            *self.formats.add(l) = RawKvFormat::of(quant);
            for (i, a) in cache.buffers(l).iter().take(KV_BUFFERS).enumerate() {
                *self.buffers.add(l * KV_BUFFERS + i) = hand_over(a);
            }
            if let Some(r) = cache.recurrent(l) {
                *self.recurrent.add(l * 2) = hand_over(&r.conv);
                *self.recurrent.add(l * 2 + 1) = hand_over(&r.ssm);
            }
        }
        self.len = cache.len();
        self.capacity = cache.capacity();
        true
    }

    /// The block ids of a paged cache, empty for a contiguous one.
    unsafe fn block_ids(&self) -> &[u32] {
        match self.blocks_len {
            0 => &[],
            n => std::slice::from_raw_parts(self.blocks, n),
        }
    }

    /// Each layer's format.
    unsafe fn formats(&self) -> Vec<Option<KvQuant>> {
        (0..self.layers)
            .map(|l| (*self.formats.add(l)).quant())
            .collect()
    }

    /// Each layer's buffers, each made an `Array` by `take`.
    unsafe fn layer_buffers(&self, take: impl Fn(mlx_array) -> Array) -> Vec<Vec<Array>> {
        (0..self.layers)
            .map(|l| {
                (0..KV_BUFFERS)
                    .map(|i| *self.buffers.add(l * KV_BUFFERS + i))
                    .take_while(|h| !h.ctx.is_null())
                    .map(&take)
                    .collect()
            })
            .collect()
    }

    /// The cache (contiguous: its blocks are added by
    /// [`RawKv::with_pages`]), each array made an `Array` by `take`.
    unsafe fn parts(&self, take: impl Fn(mlx_array) -> Array) -> KvCache {
        KvCache::from_parts(KvParts {
            formats: self.formats(),
            buffers: self.layer_buffers(&take),
            recurrent: self.recurrent(&take),
            len: self.len,
            capacity: self.capacity,
            left_pad: std::slice::from_raw_parts(self.left_pad, self.batch).to_vec(),
        })
    }

    /// The cache's recurrent states, each array made an `Array` by `take`.
    unsafe fn recurrent(&self, take: impl Fn(mlx_array) -> Array) -> Vec<Option<Recurrent>> {
        (0..self.layers)
            .map(|l| {
                let (conv, ssm) = (*self.recurrent.add(l * 2), *self.recurrent.add(l * 2 + 1));
                (!conv.ctx.is_null() && !ssm.ctx.is_null()).then(|| Recurrent {
                    conv: take(conv),
                    ssm: take(ssm),
                })
            })
            .collect()
    }

    /// A cache over the same arrays (and blocks of `pages`), with handles
    /// (and counts) of our own.
    ///
    /// # Safety
    /// Every non-null handle is a live mlx-c array handle.
    pub(crate) unsafe fn retained(&self, pages: Option<&PagePool>) -> anyhow::Result<KvCache> {
        let cache = self.parts(|h| retain(h));
        self.with_pages(cache, pages, |pool, id| pool.share(id))
    }

    /// `cache` (its layers' formats read) made paged over this table's
    /// blocks, each made a holder by `hold`, when it lists any.
    unsafe fn with_pages(
        &self,
        mut cache: KvCache,
        pages: Option<&PagePool>,
        hold: impl Fn(&PagePool, u32) -> anyhow::Result<BlockRef>,
    ) -> anyhow::Result<KvCache> {
        let ids = self.block_ids();
        if ids.is_empty() {
            return Ok(cache);
        }
        let pool = pages.ok_or_else(|| {
            anyhow::anyhow!("a paged KV cache reached an engine that has no KV pool")
        })?;
        let table = ids
            .iter()
            .map(|&id| hold(pool, id))
            .collect::<anyhow::Result<Vec<_>>>()?;
        cache.set_paged_table(pool, table);
        Ok(cache)
    }
}

/// Buffers a callee fills through [`RawKv::give`].
pub(crate) struct KvReceiver {
    _formats: Vec<RawKvFormat>,
    _buffers: Vec<mlx_array>,
    _recurrent: Vec<mlx_array>,
    _ids: Vec<u32>,
    _left_pad: Box<i32>,
    pub(crate) raw: RawKv,
}

impl KvReceiver {
    /// The cache written, owning its handles (and its blocks' counts,
    /// which are `pages`').
    pub(crate) fn into_cache(self, pages: Option<&PagePool>) -> anyhow::Result<KvCache> {
        // SAFETY: `give` wrote handles it handed over to us.
        unsafe {
            let cache = self.raw.parts(|h| Array::from_ptr(h));
            self.raw
                .with_pages(cache, pages, |pool, id| Ok(pool.adopt(id)))
        }
    }
}

/// A cache lent across the boundary for one call.
pub(crate) struct LentKv<'a> {
    formats: Vec<RawKvFormat>,
    buffers: Vec<mlx_array>,
    recurrent: Vec<mlx_array>,
    /// A paged cache's row of block ids.
    ids: Vec<u32>,
    cache: &'a KvCache,
}

impl<'a> LentKv<'a> {
    pub(crate) fn new(cache: &'a KvCache) -> Self {
        let formats = cache.formats();
        Self {
            buffers: (0..formats.len())
                .flat_map(|l| {
                    let buffers = cache.buffers(l);
                    (0..KV_BUFFERS).map(|i| buffers.get(i).map_or_else(null_array, Array::as_ptr))
                })
                .collect(),
            recurrent: (0..formats.len())
                .flat_map(|l| match cache.recurrent(l) {
                    Some(r) => [r.conv.as_ptr(), r.ssm.as_ptr()],
                    None => [null_array(), null_array()],
                })
                .collect(),
            formats: formats.into_iter().map(RawKvFormat::of).collect(),
            ids: cache
                .paged_table()
                .map(|(_, t)| t.iter().map(|b| b.id()).collect())
                .unwrap_or_default(),
            cache,
        }
    }

    /// Valid while `self` lives.
    pub(crate) fn raw(&self) -> RawKv {
        RawKv {
            formats: self.formats.as_ptr().cast_mut(),
            buffers: self.buffers.as_ptr().cast_mut(),
            recurrent: self.recurrent.as_ptr().cast_mut(),
            layers: self.formats.len(),
            len: self.cache.len(),
            capacity: self.cache.capacity(),
            left_pad: self.cache.left_padding().as_ptr(),
            batch: self.cache.batch_size(),
            blocks: self.ids.as_ptr().cast_mut(),
            blocks_len: self.ids.len(),
            blocks_cap: self.ids.len(),
        }
    }
}

/// A new handle of our own to the host's array.
///
/// # Safety
/// `handle` is a live mlx-c array handle.
pub(crate) unsafe fn retain(handle: mlx_array) -> Array {
    let mut mine = mlx_sys::mlx_array_new();
    mlx_sys::mlx_array_set(&mut mine, handle);
    Array::from_ptr(mine)
}

pub(crate) fn null_array() -> mlx_array {
    mlx_array {
        ctx: std::ptr::null_mut(),
    }
}
