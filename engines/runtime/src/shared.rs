//! What the host shares with every engine: the one loaded model, the one KV
//! pool, the one prefix cache, the device lock and the handover slot. The
//! host holds the originals and exports them as C tables
//! (`SharedModel::export`, in `abi`); each plugin builds its own
//! `SharedModel` over those tables (`SharedModel::from_context`), so no
//! Rust type crosses the boundary.

use std::sync::{Arc, OnceLock};

use engine_core::ModelFacts;

use crate::cache::KvCache;
use crate::device::DeviceGuard;
use crate::handover::{HandoverSink, HandoverSlot, LocalSlot};
use crate::kv_pool::KvPool;
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
    pub(crate) pages: Option<PagePool>,
    /// Block-aligned prefixes every engine reuses and publishes.
    pub prefix: SharedPrefixCache,
    /// The engine that adopts sequences other engines hand over (the
    /// batched engine registers itself here).
    pub(crate) handover: Arc<dyn HandoverSlot>,
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
    /// taken at the first write; see [`crate::generate::preallocate`]).
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
        let prefix = SharedPrefixCache::new(&kv_pool, entries, hybrid, pages.as_ref());
        Ok(Self::from_parts(
            model,
            kv_pool,
            pages,
            prefix,
            Arc::new(LocalSlot::default()),
        ))
    }

    /// A shared model over these services (a plugin's: the host's through C).
    pub(crate) fn from_parts(
        model: LoadedModel,
        kv_pool: KvPool,
        pages: Option<PagePool>,
        prefix: SharedPrefixCache,
        handover: Arc<dyn HandoverSlot>,
    ) -> Self {
        Self {
            model,
            kv_pool,
            pages,
            prefix,
            handover,
            grammars: OnceLock::new(),
        }
    }

    /// The served model's name and tokenizer, for engines that do not run
    /// it ([`engine_core::EngineContext::model`]).
    pub fn facts(&self) -> ModelFacts {
        ModelFacts {
            name: self.model.name.clone(),
            tokenizer: self.model.tokenizer_source.clone(),
        }
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
        self.handover.set(sink)
    }

    pub fn handover_sink(&self) -> Option<Arc<dyn HandoverSink>> {
        self.handover.get()
    }
}
