//! The host's side: each shared service as the C table plugins receive.
//! Every function works through the service's trait, whichever
//! implementation is behind it, and catches panics (none may unwind into
//! the caller's image). Everything exported lives for the process.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use engine_core::plugin::abi::Bytes;
use mlx_rs::Array;
use mlx_sys::mlx_array;

use super::handover::{sink, ForeignSink};
use super::{ctx, guard, leak};
use super::{
    retain, RawDeviceLock, RawHandoverSink, RawHandoverSlot, RawKv, RawKvLedger, RawKvWaits,
    RawPagePool, RawPrefixCache, RawShared, MLX_FINGERPRINT,
};
use crate::device::DeviceLock;
use crate::handover::{HandoverSink, HandoverSlot};
use crate::kv_pool::{KvPool, Ledger};
use crate::paged::{PagePool, PageStore};
use crate::prefix_cache::{Hit, PrefixStore, SharedPrefixCache};
use crate::SharedModel;

/// The pool's count as a C ledger.
pub fn ledger(pool: &KvPool) -> RawKvLedger {
    type Ctx = Arc<dyn Ledger>;
    unsafe extern "C" fn try_reserve(c: *mut c_void, blocks: usize) -> bool {
        guard(false, || ctx::<Ctx>(c).try_add(blocks))
    }
    unsafe extern "C" fn release(c: *mut c_void, blocks: usize) {
        guard((), || ctx::<Ctx>(c).release(blocks))
    }
    unsafe extern "C" fn allocated(c: *mut c_void) -> usize {
        guard(0, || ctx::<Ctx>(c).allocated())
    }
    RawKvLedger {
        ctx: leak::<Ctx>(pool.ledger().clone()),
        total: pool.total(),
        block_size: pool.block_size(),
        bytes_per_block: pool.bytes_per_block(),
        state_blocks: pool.state_blocks(),
        step_tokens: pool.step_tokens().unwrap_or(0),
        try_reserve,
        release,
        allocated,
    }
}

/// Waiting on the pool's count, as a C table.
pub fn kv_waits(pool: &KvPool) -> RawKvWaits {
    type Ctx = Arc<dyn Ledger>;
    unsafe extern "C" fn releases(c: *mut c_void) -> u64 {
        guard(0, || ctx::<Ctx>(c).releases())
    }
    unsafe extern "C" fn wait(c: *mut c_void, seen: u64) {
        guard((), || ctx::<Ctx>(c).wait_release(seen))
    }
    unsafe extern "C" fn wake(c: *mut c_void) {
        guard((), || ctx::<Ctx>(c).wake())
    }
    RawKvWaits {
        ctx: leak::<Ctx>(pool.ledger().clone()),
        releases,
        wait,
        wake,
    }
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

/// The paged pool as a C table.
pub fn pages(pool: &PagePool) -> RawPagePool {
    type Ctx = Arc<dyn PageStore>;
    unsafe extern "C" fn allocate(c: *mut c_void, out: *mut u32) -> bool {
        guard(false, || match ctx::<Ctx>(c).allocate() {
            Some(id) => {
                *out = id;
                true
            }
            None => false,
        })
    }
    unsafe extern "C" fn retain_block(c: *mut c_void, id: u32) {
        guard((), || ctx::<Ctx>(c).retain(id))
    }
    unsafe extern "C" fn release(c: *mut c_void, id: u32) {
        guard((), || ctx::<Ctx>(c).release(id))
    }
    unsafe extern "C" fn holders(c: *mut c_void, id: u32) -> u32 {
        guard(0, || ctx::<Ctx>(c).holders(id))
    }
    unsafe extern "C" fn free_blocks(c: *mut c_void) -> usize {
        guard(0, || ctx::<Ctx>(c).free_blocks())
    }
    unsafe extern "C" fn buffers(c: *mut c_void, layer: usize, out: *mut mlx_array) -> usize {
        guard(0, || {
            give(ctx::<Ctx>(c).buffers(layer).unwrap_or_default(), out)
        })
    }
    unsafe extern "C" fn state(c: *mut c_void, out: *mut mlx_array, cap: usize) -> usize {
        guard(0, || {
            let mut s = ctx::<Ctx>(c).state();
            s.truncate(cap);
            give(s, out)
        })
    }
    #[allow(clippy::too_many_arguments)]
    unsafe extern "C" fn write(
        c: *mut c_void,
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
            ctx::<Ctx>(c).write(layer, &parts, std::slice::from_raw_parts(slots, slots_len))
        }))
        .unwrap_or_else(|_| Err(anyhow::anyhow!("writing into the KV pool panicked")));
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
    unsafe extern "C" fn copy_block(c: *mut c_void, from: u32, to: u32) -> bool {
        guard(false, || ctx::<Ctx>(c).copy_block(from, to).is_ok())
    }
    unsafe extern "C" fn mark_written(c: *mut c_void, layer: usize, written: mlx_array) -> bool {
        guard(false, || {
            ctx::<Ctx>(c).mark_written(layer, retain(written)).is_ok()
        })
    }
    let store = pool.store().clone();
    RawPagePool {
        key: store.key(),
        block: pool.block(),
        blocks: pool.blocks(),
        layers: pool.layers(),
        ctx: leak::<Ctx>(store),
        allocate,
        retain: retain_block,
        release,
        holders,
        free_blocks,
        buffers,
        state,
        write,
        copy_block,
        mark_written,
    }
}

/// What an exported prefix cache's functions reach: the store, and the
/// pool a lent paged cache's blocks belong to.
struct PrefixCtx {
    store: Arc<dyn PrefixStore>,
    pages: Option<PagePool>,
}

/// The prefix cache as a C table.
pub fn prefix_cache(cache: &SharedPrefixCache) -> RawPrefixCache {
    unsafe fn read<'a>(scope: Bytes, scoped: bool) -> Option<&'a str> {
        scoped.then(|| std::str::from_utf8(scope.as_slice()).unwrap_or_default())
    }
    unsafe fn tokens<'a>(b: Bytes) -> &'a [u32] {
        if b.ptr.is_null() || b.len == 0 {
            return &[];
        }
        std::slice::from_raw_parts(b.ptr.cast(), b.len / 4)
    }
    unsafe extern "C" fn lookup(
        c: *mut c_void,
        scope: Bytes,
        scoped: bool,
        prompt: Bytes,
        out: *mut RawKv,
    ) -> usize {
        guard(0, || {
            let c = ctx::<PrefixCtx>(c);
            let hit = c
                .store
                .lookup(read(scope, scoped), tokens(prompt), (*out).layers);
            match hit {
                Some(Hit { cache, tokens }) => match (*out).give(cache) {
                    true => tokens,
                    false => 0,
                },
                None => 0,
            }
        })
    }
    unsafe extern "C" fn has_hit(
        c: *mut c_void,
        scope: Bytes,
        scoped: bool,
        prompt: Bytes,
    ) -> bool {
        guard(false, || {
            ctx::<PrefixCtx>(c)
                .store
                .has_hit(read(scope, scoped), tokens(prompt))
        })
    }
    unsafe extern "C" fn insert(
        c: *mut c_void,
        scope: Bytes,
        scoped: bool,
        seq: Bytes,
        kv: *const RawKv,
    ) {
        guard((), || {
            let c = ctx::<PrefixCtx>(c);
            match (*kv).retained(c.pages.as_ref()) {
                Ok(cache) => c.store.insert(read(scope, scoped), tokens(seq), &cache),
                Err(e) => tracing::warn!(error = %e, "a prefix could not be kept"),
            }
        })
    }
    RawPrefixCache {
        ctx: leak(PrefixCtx {
            store: cache.store.clone(),
            pages: cache.pages.clone(),
        }),
        block: cache.block,
        capacity: cache.capacity,
        exact: cache.exact,
        lookup,
        has_hit,
        insert,
    }
}

/// The device lock as a C table.
fn device(lock: Arc<dyn DeviceLock>) -> RawDeviceLock {
    type Ctx = Arc<dyn DeviceLock>;
    unsafe extern "C" fn acquire(c: *mut c_void) {
        ctx::<Ctx>(c).acquire()
    }
    unsafe extern "C" fn release(c: *mut c_void) {
        ctx::<Ctx>(c).release()
    }
    RawDeviceLock {
        ctx: leak::<Ctx>(lock),
        lock: acquire,
        unlock: release,
    }
}

/// What an exported slot's functions reach. The sink last handed out
/// keeps its C handle, so asking again makes no new one, and a sink that
/// came in through C goes out as its own handle (no second hop).
struct SlotCtx {
    slot: Arc<dyn HandoverSlot>,
    pool: KvPool,
    pages: Option<PagePool>,
    last: Mutex<Option<(Arc<dyn HandoverSink>, RawHandoverSink)>>,
}

fn same_sink(a: &Arc<dyn HandoverSink>, b: &Arc<dyn HandoverSink>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// The handover slot as a C table.
pub(crate) fn slot(
    slot: Arc<dyn HandoverSlot>,
    pool: KvPool,
    pages: Option<PagePool>,
) -> RawHandoverSlot {
    unsafe extern "C" fn set(c: *mut c_void, raw: RawHandoverSink) {
        guard((), || {
            let c = ctx::<SlotCtx>(c);
            let sink: Arc<dyn HandoverSink> = Arc::new(ForeignSink(raw));
            c.slot.set(sink.clone());
            *c.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((sink, raw));
        })
    }
    unsafe extern "C" fn get(c: *mut c_void, out: *mut RawHandoverSink) -> bool {
        guard(false, || {
            let c = ctx::<SlotCtx>(c);
            let Some(current) = c.slot.get() else {
                return false;
            };
            let mut last = c.last.lock().unwrap_or_else(|e| e.into_inner());
            let raw = match &*last {
                Some((s, raw)) if same_sink(s, &current) => *raw,
                _ => {
                    let raw = sink(current.clone(), c.pool.clone(), c.pages.clone());
                    *last = Some((current, raw));
                    raw
                }
            };
            out.write(raw);
            true
        })
    }
    RawHandoverSlot {
        ctx: leak(SlotCtx {
            slot,
            pool,
            pages,
            last: Mutex::new(None),
        }),
        set,
        get,
    }
}

impl SharedModel {
    /// The host's end: this model as the C tables every plugin receives
    /// (`HostServices::shared`). The tables, and a reference to `self`,
    /// live for the process.
    pub fn export(self: &Arc<Self>) -> *const c_void {
        let text = |s: &str| {
            std::ffi::CString::new(s)
                .unwrap_or_default()
                .into_raw()
                .cast_const()
        };
        let arrays: Vec<_> = self.model.parameters().iter().map(|a| a.as_ptr()).collect();
        let arrays = arrays.leak();
        let raw = RawShared {
            size: std::mem::size_of::<RawShared>(),
            mlx: MLX_FINGERPRINT.as_ptr().cast(),
            model_path: text(&self.model.path.to_string_lossy()),
            model_name: text(&self.model.name),
            compute_dtype: text(self.model.compute.name()),
            kv_cache: text(
                &self
                    .model
                    .model
                    .kv_quant()
                    .map_or_else(String::new, |q| q.to_string()),
            ),
            arrays: arrays.as_ptr(),
            arrays_len: arrays.len(),
            device: device(self.model.device.clone()),
            kv: ledger(&self.kv_pool),
            handover: slot(
                self.handover.clone(),
                self.kv_pool.clone(),
                self.pages.clone(),
            ),
            prefix: prefix_cache(&self.prefix),
            pages: self.pages.as_ref().map_or(std::ptr::null(), |p| {
                Box::into_raw(Box::new(pages(p))).cast_const()
            }),
            kv_waits: kv_waits(&self.kv_pool),
        };
        // The model's arrays must outlive every plugin's view of them.
        std::mem::forget(self.clone());
        Box::into_raw(Box::new(raw)) as *const c_void
    }
}
