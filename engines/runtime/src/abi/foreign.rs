//! The plugin's side: each shared service's trait implemented once over
//! the host's C table, and the plugin's `SharedModel` built from them.

use std::path::PathBuf;
use std::sync::Arc;

use engine_core::plugin::abi::Bytes;
use engine_core::plugin::read_c_str;
use engine_core::EngineContext;
use mlx_rs::Array;

use super::handover::ForeignSink;
use super::{
    null_array, retain, LentKv, RawDeviceLock, RawHandoverSink, RawHandoverSlot, RawKv,
    RawKvLedger, RawKvWaits, RawPagePool, RawPrefixCache, RawShared, KV_BUFFERS,
};
use crate::cache::KvCache;
use crate::compute::ComputeDtype;
use crate::device::DeviceLock;
use crate::handover::{HandoverSink, HandoverSlot};
use crate::kv_pool::{KvPool, Ledger, Reclaim};
use crate::kv_quant::KvQuant;
use crate::loader::LoadedModel;
use crate::paged::{PagePool, PageStore};
use crate::prefix_cache::{Hit, PrefixStore, SharedPrefixCache};
use crate::SharedModel;

// The host's tables are thread-safe (atomics and mutexes behind C calls)
// and live for the process.
macro_rules! foreign {
    ($($name:ident($($raw:ty),+)),*) => {$(
        struct $name($($raw),+);
        unsafe impl Send for $name {}
        unsafe impl Sync for $name {}
    )*};
}

foreign!(
    ForeignLedger(RawKvLedger, Option<RawKvWaits>),
    ForeignPages(RawPagePool),
    ForeignDevice(RawDeviceLock)
);

/// A plugin's view of the host's KV pool (`waits`: `None` from a host
/// built before they were shared).
///
/// # Safety
/// `raw` came from [`super::export::ledger`], `waits` from
/// [`super::export::kv_waits`], and both live for the process.
pub unsafe fn kv_pool(raw: &RawKvLedger, waits: Option<&RawKvWaits>) -> KvPool {
    KvPool::with_ledger(
        Arc::new(ForeignLedger(*raw, waits.copied())),
        raw.block_size,
        raw.bytes_per_block,
    )
    .with_state_blocks(raw.state_blocks)
    .with_step_tokens((raw.step_tokens > 0).then_some(raw.step_tokens))
}

// The prefix cache's entries live in the host's store, which alone holds
// cached blocks and reclaims them: a view never counts either.
impl Ledger for ForeignLedger {
    fn total(&self) -> usize {
        self.0.total
    }

    fn allocated(&self) -> usize {
        unsafe { (self.0.allocated)(self.0.ctx) }
    }

    fn cached(&self) -> usize {
        0
    }

    fn try_take(&self, blocks: usize) -> bool {
        self.try_add(blocks)
    }

    fn try_add(&self, blocks: usize) -> bool {
        unsafe { (self.0.try_reserve)(self.0.ctx, blocks) }
    }

    fn release(&self, blocks: usize) {
        unsafe { (self.0.release)(self.0.ctx, blocks) }
    }

    fn set_cached(&self, _blocks: usize, _on: bool) {}

    fn set_reclaim(&self, _reclaim: Reclaim) {}

    fn releases(&self) -> u64 {
        self.1.map_or(0, |w| unsafe { (w.releases)(w.ctx) })
    }

    fn wait_release(&self, seen: u64) {
        match self.1 {
            Some(w) => unsafe { (w.wait)(w.ctx, seen) },
            // An older host shares no waits: look again after a moment.
            None => std::thread::sleep(std::time::Duration::from_millis(2)),
        }
    }

    fn wake(&self) {
        if let Some(w) = self.1 {
            unsafe { (w.wake)(w.ctx) }
        }
    }
}

/// A plugin's view of the host's paged KV pool.
///
/// # Safety
/// `raw` came from [`super::export::pages`] and lives for the process.
pub unsafe fn pages(raw: &RawPagePool) -> PagePool {
    PagePool::with_store(Arc::new(ForeignPages(*raw)), raw.block, raw.blocks)
}

/// Handles the host handed over, as arrays of our own.
unsafe fn taken(handles: &[mlx_sys::mlx_array]) -> Vec<Array> {
    handles.iter().map(|&h| Array::from_ptr(h)).collect()
}

impl PageStore for ForeignPages {
    fn key(&self) -> usize {
        self.0.key
    }

    fn allocate(&self) -> Option<u32> {
        let mut id = 0u32;
        unsafe { (self.0.allocate)(self.0.ctx, &mut id) }.then_some(id)
    }

    fn retain(&self, id: u32) {
        unsafe { (self.0.retain)(self.0.ctx, id) }
    }

    fn release(&self, id: u32) {
        unsafe { (self.0.release)(self.0.ctx, id) }
    }

    fn holders(&self, id: u32) -> u32 {
        unsafe { (self.0.holders)(self.0.ctx, id) }
    }

    fn free_blocks(&self) -> usize {
        unsafe { (self.0.free_blocks)(self.0.ctx) }
    }

    fn layers(&self) -> usize {
        self.0.layers
    }

    fn buffers(&self, layer: usize) -> Option<Vec<Array>> {
        let mut out = [null_array(); KV_BUFFERS];
        let n = unsafe { (self.0.buffers)(self.0.ctx, layer, out.as_mut_ptr()) };
        (n > 0).then(|| unsafe { taken(&out[..n]) })
    }

    fn state(&self) -> Vec<Array> {
        let mut out = vec![null_array(); self.0.layers * KV_BUFFERS];
        let n = unsafe { (self.0.state)(self.0.ctx, out.as_mut_ptr(), out.len()) };
        unsafe { taken(&out[..n]) }
    }

    fn write(&self, layer: usize, parts: &[Array], slots: &[i32]) -> anyhow::Result<Vec<Array>> {
        let handles: Vec<_> = parts.iter().map(Array::as_ptr).collect();
        let mut out = [null_array(); KV_BUFFERS];
        let mut err = [0u8; 512];
        let n = unsafe {
            (self.0.write)(
                self.0.ctx,
                layer,
                handles.as_ptr(),
                handles.len(),
                slots.as_ptr(),
                slots.len(),
                out.as_mut_ptr(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if n == 0 {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            anyhow::bail!("{}", String::from_utf8_lossy(&err[..end]));
        }
        Ok(unsafe { taken(&out[..n]) })
    }

    fn copy_block(&self, from: u32, to: u32) -> anyhow::Result<()> {
        unsafe { (self.0.copy_block)(self.0.ctx, from, to) }
            .then_some(())
            .ok_or_else(|| anyhow::anyhow!("copying KV block {from} to {to} failed"))
    }

    fn mark_written(&self, layer: usize, written: Array) -> anyhow::Result<()> {
        unsafe { (self.0.mark_written)(self.0.ctx, layer, written.as_ptr()) }
            .then_some(())
            .ok_or_else(|| anyhow::anyhow!("layer {layer} of the KV pool is not written in place"))
    }
}

/// The host's prefix cache seen from a plugin, whose entries hold blocks
/// of `pages` (the host's pool, seen from this image).
struct ForeignPrefix {
    raw: RawPrefixCache,
    pages: Option<PagePool>,
}

unsafe impl Send for ForeignPrefix {}
unsafe impl Sync for ForeignPrefix {}

/// A plugin's view of the host's prefix cache.
///
/// # Safety
/// `raw` came from [`super::export::prefix_cache`] and lives for the
/// process.
pub unsafe fn prefix_cache(raw: &RawPrefixCache, pages: Option<&PagePool>) -> SharedPrefixCache {
    SharedPrefixCache {
        block: raw.block,
        capacity: raw.capacity,
        exact: raw.exact,
        pages: pages.cloned(),
        store: Arc::new(ForeignPrefix {
            raw: *raw,
            pages: pages.cloned(),
        }),
    }
}

fn scope_bytes(scope: Option<&str>) -> (Bytes, bool) {
    match scope {
        Some(s) => (Bytes::new(s.as_bytes()), true),
        None => (Bytes::new(&[]), false),
    }
}

/// Token ids as the bytes of their native-endian u32s (both sides are one
/// process).
fn token_bytes(tokens: &[u32]) -> Bytes {
    Bytes {
        ptr: tokens.as_ptr().cast(),
        len: std::mem::size_of_val(tokens),
    }
}

impl PrefixStore for ForeignPrefix {
    fn lookup(&self, scope: Option<&str>, prompt: &[u32], layers: usize) -> Option<Hit> {
        let (scope, scoped) = scope_bytes(scope);
        let mut out = RawKv::receiver(layers, prompt.len() / self.raw.block + 1);
        let tokens = unsafe {
            (self.raw.lookup)(
                self.raw.ctx,
                scope,
                scoped,
                token_bytes(prompt),
                &mut out.raw,
            )
        };
        if tokens == 0 {
            return None;
        }
        match out.into_cache(self.pages.as_ref()) {
            Ok(cache) => Some(Hit { cache, tokens }),
            Err(e) => {
                tracing::warn!(error = %e, "a prefix-cache hit could not be taken");
                None
            }
        }
    }

    fn has_hit(&self, scope: Option<&str>, prompt: &[u32]) -> bool {
        let (scope, scoped) = scope_bytes(scope);
        unsafe { (self.raw.has_hit)(self.raw.ctx, scope, scoped, token_bytes(prompt)) }
    }

    fn insert(&self, scope: Option<&str>, tokens: &[u32], cache: &KvCache) {
        let (scope, scoped) = scope_bytes(scope);
        let lent = LentKv::new(cache);
        unsafe {
            (self.raw.insert)(
                self.raw.ctx,
                scope,
                scoped,
                token_bytes(tokens),
                &lent.raw(),
            )
        };
    }
}

impl DeviceLock for ForeignDevice {
    fn acquire(&self) {
        unsafe { (self.0.lock)(self.0.ctx) }
    }

    fn release(&self) {
        unsafe { (self.0.unlock)(self.0.ctx) }
    }
}

/// The host's handover slot seen from a plugin; a sink registered here is
/// exported with the pools its adopted blocks belong to.
struct ForeignSlot {
    raw: RawHandoverSlot,
    pool: KvPool,
    pages: Option<PagePool>,
}

unsafe impl Send for ForeignSlot {}
unsafe impl Sync for ForeignSlot {}

impl HandoverSlot for ForeignSlot {
    fn set(&self, sink: Arc<dyn HandoverSink>) {
        let raw = super::handover::sink(sink, self.pool.clone(), self.pages.clone());
        unsafe { (self.raw.set)(self.raw.ctx, raw) }
    }

    fn get(&self) -> Option<Arc<dyn HandoverSink>> {
        let mut sink = std::mem::MaybeUninit::<RawHandoverSink>::uninit();
        unsafe { (self.raw.get)(self.raw.ctx, sink.as_mut_ptr()) }
            .then(|| Arc::new(ForeignSink(unsafe { sink.assume_init() })) as Arc<dyn HandoverSink>)
    }
}

impl SharedModel {
    /// This engine's view of the host's shared model. Fails with what to
    /// rebuild when the host's MLX or shared-state layout is not this
    /// build's, and when the host shares no model.
    pub fn from_context(ctx: &EngineContext) -> Result<Arc<SharedModel>, String> {
        let ptr = ctx.shared.as_ptr() as *const RawShared;
        // SAFETY: the host passes null or its `RawShared`, live for the
        // process; the descriptor check made sure the layout is ours, and
        // the fingerprint below checks again for plugins that did not
        // declare MLX.
        let raw = unsafe { ptr.as_ref() }.ok_or("the host shares no model with this engine")?;
        let host_mlx = unsafe { read_c_str(raw.mlx) };
        if host_mlx != super::mlx_fingerprint() {
            return Err(format!(
                "the gateway's model runtime is `{host_mlx}`, this plugin's is `{}`; rebuild the plugin with the gateway's MLX (scripts/setup) and engine sources",
                super::mlx_fingerprint()
            ));
        }
        let path = PathBuf::from(unsafe { read_c_str(raw.model_path) });
        let name = unsafe { read_c_str(raw.model_name) };
        let compute: ComputeDtype = unsafe { read_c_str(raw.compute_dtype) }.parse()?;
        let kv_cache = match unsafe { read_c_str(raw.kv_cache) } {
            s if s.is_empty() => None,
            s => Some(s.parse::<KvQuant>()?),
        };
        // SAFETY: the host's handles are live for the process.
        let arrays = unsafe {
            std::slice::from_raw_parts(raw.arrays, raw.arrays_len)
                .iter()
                .map(|&h| retain(h))
                .collect()
        };
        let device = Arc::new(ForeignDevice(raw.device));
        let mut model = LoadedModel::view(&path, &name, compute, arrays, device)
            .map_err(|e| format!("cannot build a view of the host's model: {e:#}"))?;
        model
            .model
            .set_kv_quant(kv_cache)
            .map_err(|e| format!("{e:#}"))?;
        let pages = unsafe { raw.pages.as_ref() }.map(|p| unsafe { pages(p) });
        // Read only where the host's table reaches it.
        let shares_waits =
            raw.size >= std::mem::offset_of!(RawShared, kv_waits) + size_of::<RawKvWaits>();
        let kv_pool = unsafe { kv_pool(&raw.kv, shares_waits.then_some(&raw.kv_waits)) };
        let prefix = unsafe { prefix_cache(&raw.prefix, pages.as_ref()) };
        let handover = Arc::new(ForeignSlot {
            raw: raw.handover,
            pool: kv_pool.clone(),
            pages: pages.clone(),
        });
        Ok(Arc::new(SharedModel::from_parts(
            model, kv_pool, pages, prefix, handover,
        )))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::handover::{Handover, LocalSlot};
    use crate::kv_pool::tests::waits_for_releases_and_wakes;
    use crate::kv_pool::PoolError;

    #[test]
    fn a_view_of_the_pool_shares_the_hosts_count() {
        let host = KvPool::new(10, 16, 1024).with_sequence_state(2560);
        let waits = super::super::export::kv_waits(&host);
        let view = unsafe { kv_pool(&super::super::export::ledger(&host), Some(&waits)) };
        assert_eq!((view.total(), view.block_size()), (10, 16));
        assert_eq!(view.blocks_for(17), 5, "two blocks and the state's three");
        let r = view.try_reserve(7).unwrap();
        assert_eq!(host.allocated(), 7);
        assert_eq!(host.try_reserve(4).unwrap_err(), PoolError::Exhausted);
        // Handed from the view to the host, returned once.
        let adopted = host.adopt(r.into_blocks());
        assert_eq!(view.allocated(), 7);
        drop(adopted);
        assert_eq!(view.allocated(), 0);
    }

    #[test]
    fn a_view_waits_for_the_hosts_blocks_to_come_back() {
        let host = KvPool::new(4, 16, 1024);
        let waits = super::super::export::kv_waits(&host);
        let view = unsafe { kv_pool(&super::super::export::ledger(&host), Some(&waits)) };
        waits_for_releases_and_wakes(&view, &host);
        waits_for_releases_and_wakes(&host, &view);
    }

    struct Sink(AtomicBool);

    impl HandoverSink for Sink {
        fn adopt(&self, h: Handover) -> Result<(), Box<Handover>> {
            Err(Box::new(h))
        }
        fn busy(&self) -> bool {
            self.0.load(Ordering::Acquire)
        }
    }

    #[test]
    fn a_sink_registered_by_one_plugin_reaches_another_in_one_hop() {
        let pool = KvPool::new(10, 16, 1024);
        let host: Arc<dyn HandoverSlot> = Arc::new(LocalSlot::default());
        let raw = super::super::export::slot(host.clone(), pool.clone(), None);
        let view = |raw| ForeignSlot {
            raw,
            pool: pool.clone(),
            pages: None,
        };
        let (a, b) = (view(raw), view(raw));
        assert!(b.get().is_none());
        let sink = Arc::new(Sink(AtomicBool::new(false)));
        a.set(sink.clone());
        let got = b.get().expect("registered");
        assert!(!got.busy() && !host.get().unwrap().busy());
        sink.0.store(true, Ordering::Release);
        assert!(got.busy() && host.get().unwrap().busy());
        // `b` calls `a`'s exported sink itself, not the host's wrapper of
        // it, and asking again hands out the same handle.
        let ctx = |s: Option<Arc<dyn HandoverSink>>| {
            let s = s.unwrap();
            let raw = std::ptr::addr_of!(*s).cast::<ForeignSink>();
            unsafe { (*raw).0.ctx }
        };
        let host_wrapper = ctx(host.get());
        assert_eq!(ctx(b.get()), host_wrapper);
        assert_eq!(ctx(b.get()), ctx(b.get()));
    }
}
