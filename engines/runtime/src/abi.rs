//! The shared model state across the plugin boundary, as C tables: the
//! host's device lock, KV pool ledger, handover slot and prefix cache, and
//! the model's weights as mlx-c array handles (libmlx is one shared library in the
//! process, so a handle made by one image is valid in every other). A
//! plugin builds its own `SharedModel` over them
//! ([`SharedModel::from_context`](crate::SharedModel::from_context)).
//!
//! Ownership follows engine-core's `plugin::abi`: one owner per handle.
//! Everything the host exports here lives for the process.
//!
//! Any change to this file changes [`MLX_FINGERPRINT`] (build.rs hashes it),
//! and the host refuses plugins built against the old one.

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};

use engine_core::plugin::abi::{Bytes, RawCancel, RawEventSink};
use engine_core::{CancelToken, EventSender, GenerateRequest};
use mlx_rs::Array;
use mlx_sys::mlx_array;

use crate::cache::{KvCache, LayerKv, Recurrent};
use crate::handover::{Handover, HandoverSink};
use crate::kv_pool::KvPool;
use crate::kv_quant::KvQuant;
use crate::paged::{BlockRef, PagePool};

/// The MLX headers and mlx-c this build compiled against and the hash of
/// this file, NUL-terminated: the descriptor's `mlx` field.
pub const MLX_FINGERPRINT: &str = concat!(env!("RUNTIME_MLX_FINGERPRINT"), "\0");

/// [`MLX_FINGERPRINT`] without its NUL.
pub fn mlx_fingerprint() -> &'static str {
    MLX_FINGERPRINT.trim_end_matches('\0')
}

/// What the host shares with every plugin (`HostServices::shared`).
#[repr(C)]
pub struct RawShared {
    /// The host's [`MLX_FINGERPRINT`].
    pub mlx: *const c_char,
    /// NUL-terminated checkpoint path (directory or GGUF file), served
    /// name and compute dtype (`model.compute_dtype`).
    pub model_path: *const c_char,
    pub model_name: *const c_char,
    pub compute_dtype: *const c_char,
    /// `model.kv_cache` as `bits:group_size`, empty when off.
    pub kv_cache: *const c_char,
    /// Every weight, in `LoadedModel::parameters` order.
    pub arrays: *const mlx_array,
    pub arrays_len: usize,
    pub device: RawDeviceLock,
    pub kv: RawKvLedger,
    pub handover: RawHandoverSlot,
    pub prefix: RawPrefixCache,
    /// The paged KV pool (`paged::PagePool`), null when the server's KV
    /// is contiguous.
    pub pages: *const RawPagePool,
}

/// The host's paged KV pool. Block ids index its buffers' blocks; each
/// holder of a block (a `paged::Block`, in any image) is one count.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawPagePool {
    pub ctx: *mut c_void,
    /// Positions per block, blocks (the padding block 0 included), layers.
    pub block: i32,
    pub blocks: u32,
    pub layers: usize,
    /// A free block's id to `out`, counted once; false when none is free.
    pub allocate: unsafe extern "C" fn(ctx: *mut c_void, out: *mut u32) -> bool,
    pub retain: unsafe extern "C" fn(ctx: *mut c_void, id: u32),
    pub release: unsafe extern "C" fn(ctx: *mut c_void, id: u32),
    pub holders: unsafe extern "C" fn(ctx: *mut c_void, id: u32) -> u32,
    pub free_blocks: unsafe extern "C" fn(ctx: *mut c_void) -> usize,
    /// Layer `layer`'s buffers to `out` (up to [`KV_BUFFERS`] handles, each
    /// then the caller's); 0 before the layer's first write.
    pub buffers: unsafe extern "C" fn(ctx: *mut c_void, layer: usize, out: *mut mlx_array) -> usize,
    /// Every written layer's buffers to `out` (at most `cap`).
    pub state: unsafe extern "C" fn(ctx: *mut c_void, out: *mut mlx_array, cap: usize) -> usize,
    /// Writes `parts` (lent) at `slots` into layer `layer`; its new
    /// buffers to `out` as `buffers` does, or 0 and a NUL-terminated
    /// message in `err`.
    pub write: unsafe extern "C" fn(
        ctx: *mut c_void,
        layer: usize,
        parts: *const mlx_array,
        parts_len: usize,
        slots: *const i32,
        slots_len: usize,
        out: *mut mlx_array,
        err: *mut u8,
        err_cap: usize,
    ) -> usize,
    pub copy_block: unsafe extern "C" fn(ctx: *mut c_void, from: u32, to: u32) -> bool,
}

/// The lock that serialises device work across engines.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawDeviceLock {
    pub ctx: *mut c_void,
    pub lock: unsafe extern "C" fn(ctx: *mut c_void),
    pub unlock: unsafe extern "C" fn(ctx: *mut c_void),
}

/// The KV block pool's count.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawKvLedger {
    pub ctx: *mut c_void,
    pub total: usize,
    pub block_size: usize,
    pub bytes_per_block: usize,
    /// Blocks each sequence's recurrent state takes (hybrid models).
    pub state_blocks: usize,
    /// The memory budget's measured step in tokens (0: no budget).
    pub step_tokens: usize,
    /// Adds `blocks` when they fit (giving up prefix-cache entries if
    /// needed); false when the pool is full.
    pub try_reserve: unsafe extern "C" fn(ctx: *mut c_void, blocks: usize) -> bool,
    pub release: unsafe extern "C" fn(ctx: *mut c_void, blocks: usize),
    /// Blocks held by sequences (not the prefix cache's).
    pub allocated: unsafe extern "C" fn(ctx: *mut c_void) -> usize,
}

/// Where the engine that adopts handed-over sequences registers.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawHandoverSlot {
    pub ctx: *mut c_void,
    pub set: unsafe extern "C" fn(ctx: *mut c_void, sink: RawHandoverSink),
    /// Writes the registered sink to `out`; false when none is.
    pub get: unsafe extern "C" fn(ctx: *mut c_void, out: *mut RawHandoverSink) -> bool,
}

/// An engine that adopts sequences; lives for the process once registered.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawHandoverSink {
    pub ctx: *mut c_void,
    /// True: the sink took the sequence (its cancel and event handles and
    /// its reserved blocks are the sink's now; the arrays are only lent).
    /// False: nothing was taken.
    pub adopt: unsafe extern "C" fn(ctx: *mut c_void, handover: *const RawHandover) -> bool,
    pub busy: unsafe extern "C" fn(ctx: *mut c_void) -> bool,
}

/// A running sequence (`handover::Handover`) in C form.
#[repr(C)]
pub struct RawHandover {
    /// JSON of the `GenerateRequest`.
    pub request: Bytes,
    pub cancel: RawCancel,
    pub events: RawEventSink,
    /// Lent for the call.
    pub cache: RawKv,
    pub last_token: u32,
    /// Tokens streamed so far (`last_token` included).
    pub generated: *const u32,
    pub generated_len: usize,
    pub cached_tokens: u32,
    pub reserved_blocks: usize,
}

/// A `KvCache` in C form. Per layer its storage format and
/// [`KV_BUFFERS`] handle slots: its buffers (`cache::LayerKv`), null past
/// its last one and for a layer not yet written (or one that reads another
/// layer's keys and values). Per layer also two slots for a
/// linear-attention layer's recurrent state (convolution inputs,
/// delta-rule state), null for other layers.
#[repr(C)]
pub struct RawKv {
    pub formats: *mut RawKvFormat,
    pub buffers: *mut mlx_array,
    pub recurrent: *mut mlx_array,
    pub layers: usize,
    pub len: i32,
    pub capacity: i32,
    pub left_pad: *const i32,
    pub batch: usize,
    /// A paged cache (batch 1): the ids of its row's blocks in the host's
    /// pool, in order (each one count the receiver then holds, or lent
    /// with the cache); `buffers` then hold nothing. `blocks_cap`: room a
    /// receiver has.
    pub blocks: *mut u32,
    pub blocks_len: usize,
    pub blocks_cap: usize,
}

/// A layer's storage in a [`RawKv`]: `bits` 0 for the activations'
/// dtype, else quantized with `bits` and `group_size`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawKvFormat {
    pub bits: i32,
    pub group_size: i32,
}

/// Handle slots per layer in [`RawKv::buffers`]: the most buffers a
/// layer has (quantized keys and values: codes, scales, biases each).
pub const KV_BUFFERS: usize = 6;

impl RawKvFormat {
    fn of(quant: Option<KvQuant>) -> Self {
        match quant {
            None => Self {
                bits: 0,
                group_size: 0,
            },
            Some(q) => Self {
                bits: q.bits,
                group_size: q.group_size,
            },
        }
    }

    fn quant(self) -> Option<KvQuant> {
        (self.bits != 0).then_some(KvQuant {
            bits: self.bits,
            group_size: self.group_size,
        })
    }
}

/// The shared prefix cache (`prefix_cache::SharedPrefixCache`). Scopes are
/// UTF-8 bytes (`scoped` false: no scope), token sequences the bytes of
/// their u32s.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawPrefixCache {
    pub ctx: *mut c_void,
    /// Tokens per block; entries are block-aligned.
    pub block: usize,
    /// Entries kept at most (0: disabled).
    pub capacity: usize,
    /// Entries are recurrent-state snapshots, reused whole.
    pub exact: bool,
    /// Length of the longest reusable prefix of `prompt`, 0 when none;
    /// on a hit its KV is written to `out` (the caller's buffers of
    /// `out.layers` handles), each handle then owned by the caller.
    pub lookup: unsafe extern "C" fn(
        ctx: *mut c_void,
        scope: Bytes,
        scoped: bool,
        prompt: Bytes,
        out: *mut RawKv,
    ) -> usize,
    pub has_hit:
        unsafe extern "C" fn(ctx: *mut c_void, scope: Bytes, scoped: bool, prompt: Bytes) -> bool,
    /// Keeps the block-aligned prefix of `tokens`; `kv` is only lent.
    pub insert: unsafe extern "C" fn(
        ctx: *mut c_void,
        scope: Bytes,
        scoped: bool,
        tokens: Bytes,
        kv: *const RawKv,
    ),
}

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
        let layers = self.layers.min(cache.layers.len());
        for (l, layer) in cache.layers.into_iter().take(layers).enumerate() {
            *self.formats.add(l) = RawKvFormat::of(layer.quant);
            for (i, a) in layer.buffers.into_iter().take(KV_BUFFERS).enumerate() {
                let handle = a.as_ptr();
                std::mem::forget(a);
                *self.buffers.add(l * KV_BUFFERS + i) = handle;
            }
        }
        for (l, r) in cache.recurrent.into_iter().take(layers).enumerate() {
            if let Some(r) = r {
                for (i, a) in [r.conv, r.ssm].into_iter().enumerate() {
                    *self.recurrent.add(l * 2 + i) = a.as_ptr();
                    std::mem::forget(a);
                }
            }
        }
        self.len = cache.len;
        self.capacity = cache.capacity;
        true
    }

    /// The block ids of a paged cache, empty for a contiguous one.
    unsafe fn block_ids(&self) -> &[u32] {
        match self.blocks_len {
            0 => &[],
            n => std::slice::from_raw_parts(self.blocks, n),
        }
    }

    /// The cache's layers, each buffer made an `Array` by `take`.
    unsafe fn layers(&self, take: impl Fn(mlx_array) -> Array) -> Vec<LayerKv> {
        (0..self.layers)
            .map(|l| LayerKv {
                quant: (*self.formats.add(l)).quant(),
                buffers: (0..KV_BUFFERS)
                    .map(|i| *self.buffers.add(l * KV_BUFFERS + i))
                    .take_while(|h| !h.ctx.is_null())
                    .map(&take)
                    .collect(),
            })
            .collect()
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
        let left_pad = std::slice::from_raw_parts(self.left_pad, self.batch).to_vec();
        let mut cache = KvCache::with_formats(vec![None; self.layers], left_pad);
        cache.layers = self.layers(|h| retain(h));
        cache.recurrent = self.recurrent(|h| retain(h));
        cache.len = self.len;
        cache.capacity = self.capacity;
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
        let mut cache = KvCache::with_formats(vec![None; self.raw.layers], vec![0]);
        unsafe {
            cache.layers = self.raw.layers(|h| Array::from_ptr(h));
            cache.recurrent = self.raw.recurrent(|h| Array::from_ptr(h));
        }
        cache.len = self.raw.len;
        cache.capacity = self.raw.capacity;
        unsafe {
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
        let layers = &cache.layers;
        Self {
            formats: layers.iter().map(|l| RawKvFormat::of(l.quant)).collect(),
            buffers: layers
                .iter()
                .flat_map(|l| {
                    (0..KV_BUFFERS).map(|i| l.buffers.get(i).map_or_else(null_array, Array::as_ptr))
                })
                .collect(),
            recurrent: cache
                .recurrent
                .iter()
                .flat_map(|r| match r {
                    Some(r) => [r.conv.as_ptr(), r.ssm.as_ptr()],
                    None => [null_array(), null_array()],
                })
                .collect(),
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
            len: self.cache.len,
            capacity: self.cache.capacity,
            left_pad: self.cache.left_pad.as_ptr(),
            batch: self.cache.left_pad.len(),
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

/// Exclusive use of the device: the host's lock, or the host's through C.
pub(crate) enum DeviceLock {
    Local { locked: Mutex<bool>, free: Condvar },
    Foreign(RawDeviceLock),
}

// The host's lock functions are thread-safe.
unsafe impl Send for DeviceLock {}
unsafe impl Sync for DeviceLock {}

/// Holds the device until dropped.
pub struct DeviceGuard<'a>(&'a DeviceLock);

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

impl DeviceLock {
    pub(crate) fn new() -> Self {
        DeviceLock::Local {
            locked: Mutex::new(false),
            free: Condvar::new(),
        }
    }

    pub(crate) fn lock(&self) -> DeviceGuard<'_> {
        self.acquire();
        DeviceGuard(self)
    }

    // A panicked holder left nothing half-written that matters here, so
    // poisoning is ignored.
    fn acquire(&self) {
        match self {
            DeviceLock::Local { locked, free } => {
                let mut held = locked.lock().unwrap_or_else(|p| p.into_inner());
                while *held {
                    held = free.wait(held).unwrap_or_else(|p| p.into_inner());
                }
                *held = true;
            }
            DeviceLock::Foreign(raw) => unsafe { (raw.lock)(raw.ctx) },
        }
    }

    /// Releases a lock taken by a guard that was forgotten (the C unlock).
    pub(crate) fn release_raw(&self) {
        self.release();
    }

    fn release(&self) {
        match self {
            DeviceLock::Local { locked, free } => {
                *locked.lock().unwrap_or_else(|p| p.into_inner()) = false;
                free.notify_one();
            }
            DeviceLock::Foreign(raw) => unsafe { (raw.unlock)(raw.ctx) },
        }
    }
}

/// A handover sink registered through C (by another image, or exported by
/// this one).
pub(crate) struct ForeignSink(pub(crate) RawHandoverSink);

unsafe impl Send for ForeignSink {}
unsafe impl Sync for ForeignSink {}

impl HandoverSink for ForeignSink {
    fn adopt(&self, h: Handover) -> Result<(), Box<Handover>> {
        let Ok(request) = serde_json::to_vec(&h.request) else {
            return Err(Box::new(h));
        };
        let lent = LentKv::new(&h.cache);
        let raw = RawHandover {
            request: Bytes::new(&request),
            cancel: h.request.cancel.clone().into_raw(),
            events: h.events.clone().into_raw(),
            cache: lent.raw(),
            last_token: h.last_token,
            generated: h.generated.as_ptr(),
            generated_len: h.generated.len(),
            cached_tokens: h.cached_tokens,
            reserved_blocks: h.reservation.blocks(),
        };
        // SAFETY: the sink lives for the process; `raw` outlives the call.
        if unsafe { (self.0.adopt)(self.0.ctx, &raw) } {
            // The adopter holds the blocks now.
            h.reservation.into_blocks();
            return Ok(());
        }
        unsafe {
            (raw.cancel.release)(raw.cancel.ctx);
            (raw.events.release)(raw.events.ctx);
        }
        Err(Box::new(h))
    }

    fn busy(&self) -> bool {
        unsafe { (self.0.busy)(self.0.ctx) }
    }

    fn raw(&self) -> Option<RawHandoverSink> {
        Some(self.0)
    }
}

/// What an exported sink's functions reach: the sink, and the pool its
/// adopted blocks belong to.
struct SinkCtx {
    sink: Arc<dyn HandoverSink>,
    pool: KvPool,
    pages: Option<PagePool>,
}

/// `sink` as a C handle; it lives for the process.
pub(crate) fn export_sink(
    sink: Arc<dyn HandoverSink>,
    pool: KvPool,
    pages: Option<PagePool>,
) -> RawHandoverSink {
    if let Some(raw) = sink.raw() {
        return raw;
    }
    unsafe extern "C" fn adopt(ctx: *mut c_void, raw: *const RawHandover) -> bool {
        catch_unwind(AssertUnwindSafe(|| {
            let ctx = &*(ctx as *const SinkCtx);
            let raw = &*raw;
            let Ok(mut request) = serde_json::from_slice::<GenerateRequest>(raw.request.as_slice())
            else {
                return false;
            };
            let Ok(cache) = raw.cache.retained(ctx.pages.as_ref()) else {
                return false;
            };
            request.cancel = CancelToken::from_raw(std::ptr::read(&raw.cancel));
            let handover = Handover {
                request,
                cache,
                last_token: raw.last_token,
                generated: std::slice::from_raw_parts(raw.generated, raw.generated_len).to_vec(),
                cached_tokens: raw.cached_tokens,
                reservation: ctx.pool.adopt(raw.reserved_blocks),
                events: EventSender::from_raw(std::ptr::read(&raw.events)),
            };
            match ctx.sink.adopt(handover) {
                Ok(()) => true,
                Err(h) => {
                    // Given back: the caller still owns the handles and
                    // the blocks, so none is released here.
                    let h = *h;
                    h.reservation.into_blocks();
                    std::mem::forget(h.events);
                    std::mem::forget(h.request.cancel);
                    false
                }
            }
        }))
        .unwrap_or(false)
    }
    unsafe extern "C" fn busy(ctx: *mut c_void) -> bool {
        catch_unwind(AssertUnwindSafe(|| (*(ctx as *const SinkCtx)).sink.busy())).unwrap_or(false)
    }
    RawHandoverSink {
        ctx: Box::into_raw(Box::new(SinkCtx { sink, pool, pages })) as *mut c_void,
        adopt,
        busy,
    }
}

/// Registers `engine_core`'s runtime macro for plugins over the shared
/// model: [`engine_core::export_engine!`] with this build's
/// [`MLX_FINGERPRINT`], so the host refuses the plugin at load when it was
/// built against another MLX, mlx-c or shared-state layout.
#[macro_export]
macro_rules! export_engine {
    ($kind:literal, $constructor:path) => {
        $crate::__engine_core::export_engine!(
            $kind,
            $constructor,
            mlx = $crate::abi::MLX_FINGERPRINT
        );
    };
}
