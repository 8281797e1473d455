//! What the host shares with every engine: the one loaded model, the one KV
//! pool, the one prefix cache, the device lock and the handover slot. The host holds the
//! originals and exports them as C tables ([`SharedModel::export`]); each
//! plugin builds its own `SharedModel` over those tables
//! ([`SharedModel::from_context`]), so no Rust type crosses the boundary.

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, RwLock};

use engine_core::plugin::read_c_str;
use engine_core::EngineContext;

use crate::abi::{
    export_sink, mlx_fingerprint, DeviceGuard, DeviceLock, ForeignSink, RawDeviceLock,
    RawHandoverSink, RawHandoverSlot, RawShared, MLX_FINGERPRINT,
};
use crate::cache::KvCache;
use crate::compute::ComputeDtype;
use crate::handover::HandoverSink;
use crate::kv_pool::KvPool;
use crate::kv_quant::KvQuant;
use crate::loader::LoadedModel;
use crate::paged::{KvLayout, PagePool};
use crate::prefix_cache::SharedPrefixCache;

/// Prefix cache entries when the host names no other number.
pub const DEFAULT_PREFIX_CACHE_ENTRIES: usize = 16;

pub struct SharedModel {
    pub model: LoadedModel,
    pub kv_pool: KvPool,
    /// Where every engine's sequences keep their keys and values when the
    /// server's KV is paged: one pool with a block for each the ledger
    /// (`kv_pool`) counts, so the ledger admits and the pool holds.
    pages: Option<PagePool>,
    /// Block-aligned prefixes every engine reuses and publishes.
    pub prefix: SharedPrefixCache,
    /// The engine that adopts sequences other engines hand over (the
    /// batched engine registers itself here).
    handover: Slot,
    /// Structured-output grammars compiled against this model's tokenizer,
    /// built at the first constrained request.
    grammars: OnceLock<Result<Arc<grammar::Compiler>, String>>,
}

/// An engine's turn on the device ([`SharedModel::lock_device`]).
pub struct DeviceTurn<'a> {
    pages: Option<&'a PagePool>,
    _guard: DeviceGuard<'a>,
}

impl Drop for DeviceTurn<'_> {
    fn drop(&mut self) {
        if let Some(pages) = self.pages {
            if let Err(e) = mlx_rs::transforms::async_eval(&pages.state()) {
                tracing::warn!(error = %e, "queuing the KV pool's writes failed");
            }
        }
    }
}

enum Slot {
    /// The sink, and its C handle for plugins (made once, at registration).
    Local(RwLock<Option<(Arc<dyn HandoverSink>, RawHandoverSink)>>),
    Foreign(RawHandoverSlot),
}

// The host's slot functions are thread-safe.
unsafe impl Send for Slot {}
unsafe impl Sync for Slot {}

impl SharedModel {
    pub fn new(model: LoadedModel, kv_pool: KvPool) -> Self {
        Self::with_prefix_cache(model, kv_pool, DEFAULT_PREFIX_CACHE_ENTRIES)
    }

    /// A shared model whose prefix cache keeps `entries` prefixes (0
    /// disables it) on the pool's block boundaries.
    pub fn with_prefix_cache(model: LoadedModel, kv_pool: KvPool, entries: usize) -> Self {
        Self::with_layout(model, kv_pool, entries, KvLayout::Contiguous)
            .expect("a contiguous layout needs no pool")
    }

    /// A shared model whose KV is laid out as `layout`: paged, its pool is
    /// made here with a block for each one `kv_pool` counts (its memory is
    /// taken at the first write; see [`PagePool::preallocate`]).
    pub fn with_layout(
        model: LoadedModel,
        kv_pool: KvPool,
        entries: usize,
        layout: KvLayout,
    ) -> anyhow::Result<Self> {
        let hybrid = model.model.is_hybrid();
        let pages = match layout {
            KvLayout::Contiguous => None,
            KvLayout::Paged => Some(PagePool::new(
                model.model.num_layers(),
                kv_pool.total().max(1),
                kv_pool.block_size(),
            )?),
        };
        Ok(Self {
            model,
            prefix: SharedPrefixCache::new(&kv_pool, entries, hybrid, pages.as_ref()),
            kv_pool,
            pages,
            handover: Slot::Local(RwLock::new(None)),
            grammars: OnceLock::new(),
        })
    }

    /// Exclusive use of the device for one engine step (or one fast-path
    /// run). Paged, the turn ends by queuing what it wrote into the pool:
    /// MLX binds a graph to the thread that built it, and the next
    /// engine's thread builds on the pool's buffers.
    pub fn lock_device(&self) -> DeviceTurn<'_> {
        DeviceTurn {
            pages: self.pages.as_ref(),
            _guard: self.model.lock_device(),
        }
    }

    /// The server's paged KV pool, when its KV is paged.
    pub fn pages(&self) -> Option<&PagePool> {
        self.pages.as_ref()
    }

    /// An empty cache for a batch of rows left-padded by `left_pad`, in the
    /// server's layout (its keys and values in the pool when paged).
    pub fn new_cache(&self, left_pad: Vec<i32>) -> KvCache {
        let model = &self.model.model;
        match &self.pages {
            Some(pool) => model.new_paged_cache(pool, left_pad),
            None => model.new_padded_cache(left_pad),
        }
    }

    /// Prompt tokens per prefill forward: the default chunk, within the
    /// memory budget's measured step.
    pub fn prefill_chunk(&self) -> usize {
        let step = self.kv_pool.step_tokens().unwrap_or(usize::MAX);
        crate::generate::DEFAULT_PREFILL_CHUNK.min(step.max(1))
    }

    /// The grammar compiler for this model (its token trie is built once).
    pub fn grammars(&self) -> Result<Arc<grammar::Compiler>, String> {
        self.grammars
            .get_or_init(|| {
                let vocab = self.model.vocab_size();
                grammar::Compiler::new(&self.model.tokenizer, vocab, &self.model.stop_tokens)
                    .map(Arc::new)
                    .map_err(|e| format!("cannot build the grammar compiler: {e}"))
            })
            .clone()
    }

    pub fn set_handover_sink(&self, sink: Arc<dyn HandoverSink>) {
        match &self.handover {
            Slot::Local(slot) => {
                let raw = export_sink(sink.clone(), self.kv_pool.clone(), self.pages.clone());
                *slot.write().unwrap_or_else(|e| e.into_inner()) = Some((sink, raw));
            }
            Slot::Foreign(raw) => unsafe {
                (raw.set)(
                    raw.ctx,
                    export_sink(sink, self.kv_pool.clone(), self.pages.clone()),
                )
            },
        }
    }

    pub fn handover_sink(&self) -> Option<Arc<dyn HandoverSink>> {
        match &self.handover {
            Slot::Local(slot) => slot
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .map(|(sink, _)| sink.clone()),
            Slot::Foreign(raw) => unsafe {
                let mut sink = std::mem::MaybeUninit::<RawHandoverSink>::uninit();
                (raw.get)(raw.ctx, sink.as_mut_ptr())
                    .then(|| Arc::new(ForeignSink(sink.assume_init())) as Arc<dyn HandoverSink>)
            },
        }
    }

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
        if host_mlx != mlx_fingerprint() {
            return Err(format!(
                "the gateway's model runtime is `{host_mlx}`, this plugin's is `{}`; rebuild the plugin with the gateway's MLX (scripts/setup) and engine sources",
                mlx_fingerprint()
            ));
        }
        let path = PathBuf::from(unsafe { read_c_str(raw.model_path) });
        let name = unsafe { read_c_str(raw.model_name) };
        let compute: ComputeDtype = unsafe { read_c_str(raw.compute_dtype) }.parse()?;
        let kv_cache = match unsafe { read_c_str(raw.kv_cache) } {
            s if s.is_empty() => None,
            s => Some(s.parse::<KvQuant>()?),
        };
        let arrays = unsafe { std::slice::from_raw_parts(raw.arrays, raw.arrays_len) };
        let mut model = LoadedModel::view(
            &path,
            &name,
            compute,
            arrays,
            DeviceLock::Foreign(raw.device),
        )
        .map_err(|e| format!("cannot build a view of the host's model: {e:#}"))?;
        model
            .model
            .set_kv_quant(kv_cache)
            .map_err(|e| format!("{e:#}"))?;
        let pages = unsafe { raw.pages.as_ref() }.map(|p| unsafe { PagePool::import(p) });
        Ok(Arc::new(SharedModel {
            model,
            kv_pool: unsafe { KvPool::import(&raw.kv) },
            prefix: unsafe { SharedPrefixCache::import(&raw.prefix, pages.as_ref()) },
            pages,
            handover: Slot::Foreign(raw.handover),
            grammars: OnceLock::new(),
        }))
    }

    /// The host's end: this model as the C tables every plugin receives
    /// (`HostServices::shared`). The tables, and a reference to `self`,
    /// live for the process.
    pub fn export(self: &Arc<Self>) -> *const c_void {
        unsafe extern "C" fn lock(ctx: *mut c_void) {
            std::mem::forget((*(ctx as *const SharedModel)).model.lock_device());
        }
        unsafe extern "C" fn unlock(ctx: *mut c_void) {
            (*(ctx as *const SharedModel)).model.device.release_raw();
        }
        unsafe extern "C" fn set(ctx: *mut c_void, sink: RawHandoverSink) {
            (*(ctx as *const SharedModel)).set_handover_sink(Arc::new(ForeignSink(sink)));
        }
        unsafe extern "C" fn get(ctx: *mut c_void, out: *mut RawHandoverSink) -> bool {
            let Slot::Local(slot) = &(*(ctx as *const SharedModel)).handover else {
                return false;
            };
            match &*slot.read().unwrap_or_else(|e| e.into_inner()) {
                Some((_, raw)) => {
                    out.write(*raw);
                    true
                }
                None => false,
            }
        }
        let ctx = Arc::into_raw(self.clone()) as *mut c_void;
        let leak = |s: &str| {
            std::ffi::CString::new(s)
                .unwrap_or_default()
                .into_raw()
                .cast_const()
        };
        let arrays: Vec<_> = self.model.parameters().iter().map(|a| a.as_ptr()).collect();
        let arrays = arrays.leak();
        let raw = RawShared {
            mlx: MLX_FINGERPRINT.as_ptr().cast(),
            model_path: leak(&self.model.path.to_string_lossy()),
            model_name: leak(&self.model.name),
            compute_dtype: leak(self.model.compute.name()),
            kv_cache: leak(
                &self
                    .model
                    .model
                    .kv_quant()
                    .map_or_else(String::new, |q| q.to_string()),
            ),
            arrays: arrays.as_ptr(),
            arrays_len: arrays.len(),
            device: RawDeviceLock { ctx, lock, unlock },
            kv: self.kv_pool.export(),
            handover: RawHandoverSlot { ctx, set, get },
            prefix: self.prefix.export(),
            pages: self.pages.as_ref().map_or(std::ptr::null(), |p| {
                Box::into_raw(Box::new(p.export())).cast_const()
            }),
        };
        Box::into_raw(Box::new(raw)) as *const c_void
    }
}
