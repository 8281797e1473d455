//! Automatic prefix caching on block boundaries, one store for every
//! engine: the KV of a sequence's block-aligned prefix is kept when an
//! engine has computed it (after a prompt's prefill, or when a sequence
//! ends with its answer), and a later prompt of the same cache scope that
//! starts with it skips recomputing those positions, whichever engine
//! serves it. Entries never cross scopes, so one tenant cannot time
//! another's prompts.
//!
//! The host owns the store; plugins reach it through a C table (`abi`), the
//! KV crossing as mlx-c handles, or as block ids when the server's KV is paged:
//! then an entry holds blocks of the one pool, shared with the sequence that
//! computed it and with every later hit (copied only where one writes).
//! Entries hold every layer's keys and values for all their positions
//! (sliding-window layers keep the whole history and mask it), so a
//! truncated entry is exactly the prefix's cache.
//!
//! Entries are charged to the KV pool (their blocks, and a hybrid model's
//! state blocks) as cached blocks: an entry is kept only if the pool has
//! room for it, after giving up older entries, and a sequence that finds
//! the pool full has the cache give entries up for it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use mlx_rs::transforms::eval;

use crate::cache::KvCache;
use crate::kv_pool::{KvPool, Reservation};
use crate::paged::PagePool;

struct Entry {
    scope: Option<String>,
    tokens: Vec<u32>,
    cache: KvCache,
    /// Its blocks in the pool.
    blocks: Reservation,
}

/// The host's store: most recently used entries last, at most `capacity`.
struct Store {
    block: usize,
    capacity: usize,
    pool: KvPool,
    /// The server's paged pool: entries hold its blocks.
    pages: Option<PagePool>,
    entries: VecDeque<Entry>,
}

/// A reusable prefix: its KV (batch 1, no padding) and its length.
pub struct Hit {
    pub cache: KvCache,
    pub tokens: usize,
}

impl Store {
    /// The entry sharing the longest block-aligned prefix with `prompt`
    /// within `scope`, and that prefix's length, leaving at least one prompt
    /// token to compute (its logits start the generation).
    fn best_match(&self, scope: Option<&str>, prompt: &[u32]) -> Option<(usize, usize)> {
        let usable = (prompt.len().saturating_sub(1) / self.block) * self.block;
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.scope.as_deref() == scope)
            .map(|(i, e)| {
                let common = e
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                // A recurrent state cannot be cut back: such an entry
                // serves only prompts that extend all of it.
                let len = match e.cache.has_recurrent() {
                    true if common == e.tokens.len() && common <= usable => common,
                    true => 0,
                    false => (common.min(usable) / self.block) * self.block,
                };
                (i, len)
            })
            .filter(|&(_, len)| len > 0)
            .max_by_key(|&(i, len)| (len, std::cmp::Reverse(i)))
    }

    fn lookup(&mut self, scope: Option<&str>, prompt: &[u32]) -> Option<Hit> {
        let (i, len) = self.best_match(scope, prompt)?;
        let entry = self.entries.remove(i)?;
        let mut cache = entry.cache.clone();
        let cut = cache.truncate(cache.len() - len as i32);
        self.entries.push_back(entry);
        cut.ok()?;
        Some(Hit { cache, tokens: len })
    }

    fn insert(&mut self, scope: Option<&str>, tokens: &[u32], cache: &KvCache) {
        let aligned = (tokens.len().min(cache.len().max(0) as usize) / self.block) * self.block;
        if self.capacity == 0 || aligned == 0 || cache.left_padding() != [0] {
            return;
        }
        // A recurrent state is kept only as an exact snapshot of a block
        // boundary ([`SharedPrefixCache::snapshot_at`]).
        if cache.has_recurrent() && cache.len() as usize != aligned {
            return;
        }
        let key = &tokens[..aligned];
        if self
            .entries
            .iter()
            .any(|e| e.scope.as_deref() == scope && e.tokens.starts_with(key))
        {
            return;
        }
        // A longer prefix supersedes entries it extends.
        self.entries
            .retain(|e| !(e.scope.as_deref() == scope && key.starts_with(&e.tokens)));
        let mut kept = cache.clone();
        if kept.truncate(kept.len() - aligned as i32).is_err() {
            return;
        }
        while self.entries.len() >= self.capacity {
            self.entries.pop_front();
        }
        let blocks = self.pool.blocks_for(aligned);
        let reservation = loop {
            if let Some(r) = self.pool.try_reserve_cached(blocks) {
                break r;
            }
            // Older entries make room; sequences' blocks are never taken.
            if self.entries.pop_front().is_none() {
                return;
            }
        };
        // Paged, the entry shares the cache's blocks; a contiguous cache's
        // positions are copied into the pool (the reservation just taken
        // counts them).
        if let Some(pages) = &self.pages {
            kept = match kept.into_paged(pages) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "moving a prefix into the KV pool failed");
                    return;
                }
            };
        }
        self.entries.push_back(Entry {
            scope: scope.map(str::to_string),
            tokens: key.to_vec(),
            cache: kept,
            blocks: reservation,
        });
    }

    /// Gives up the least recently used entries until `blocks` are freed
    /// (or none is left).
    fn reclaim(&mut self, blocks: usize) {
        let mut freed = 0;
        while freed < blocks {
            let Some(e) = self.entries.pop_front() else {
                return;
            };
            freed += e.blocks.blocks();
        }
    }
}

/// Where the entries are: the host's store, or the host's through C in a
/// plugin (`abi::foreign`).
pub trait PrefixStore: Send + Sync {
    /// See [`SharedPrefixCache::lookup`].
    fn lookup(&self, scope: Option<&str>, prompt: &[u32], layers: usize) -> Option<Hit>;
    fn has_hit(&self, scope: Option<&str>, prompt: &[u32]) -> bool;
    /// Keeps the block-aligned prefix of `tokens`; `cache` is evaluated,
    /// and paged only in the server's pool.
    fn insert(&self, scope: Option<&str>, tokens: &[u32], cache: &KvCache);
}

impl PrefixStore for Mutex<Store> {
    fn lookup(&self, scope: Option<&str>, prompt: &[u32], _layers: usize) -> Option<Hit> {
        lock(self).lookup(scope, prompt)
    }

    fn has_hit(&self, scope: Option<&str>, prompt: &[u32]) -> bool {
        lock(self).best_match(scope, prompt).is_some()
    }

    fn insert(&self, scope: Option<&str>, tokens: &[u32], cache: &KvCache) {
        lock(self).insert(scope, tokens, cache)
    }
}

/// The one prefix cache of the process.
pub struct SharedPrefixCache {
    pub(crate) block: usize,
    pub(crate) capacity: usize,
    /// The model holds recurrent states (a hybrid model): entries are
    /// snapshots reused whole.
    pub(crate) exact: bool,
    /// The server's paged pool, whose blocks entries hold.
    pub(crate) pages: Option<PagePool>,
    pub(crate) store: Arc<dyn PrefixStore>,
}

fn lock(store: &Mutex<Store>) -> MutexGuard<'_, Store> {
    store.lock().unwrap_or_else(|e| e.into_inner())
}

impl SharedPrefixCache {
    /// A store of `capacity` entries (0 disables it) on the pool's block
    /// boundaries, charged to `pool` (which reclaims entries when full),
    /// for a model whose caches hold recurrent states when `exact`; its
    /// entries hold blocks of `pages` when the server's KV is paged.
    pub fn new(pool: &KvPool, capacity: usize, exact: bool, pages: Option<&PagePool>) -> Self {
        let block = pool.block_size();
        let store = Arc::new(Mutex::new(Store {
            block,
            capacity,
            pool: pool.clone(),
            pages: pages.cloned(),
            entries: VecDeque::new(),
        }));
        let weak = Arc::downgrade(&store);
        pool.set_reclaim(move |blocks| {
            if let Some(store) = weak.upgrade() {
                lock(&store).reclaim(blocks);
            }
        });
        Self {
            block,
            capacity,
            exact,
            pages: pages.cloned(),
            store,
        }
    }

    /// Whether a sequence this long can leave a reusable prefix.
    pub fn wants(&self, tokens: usize) -> bool {
        self.capacity > 0 && tokens >= self.block
    }

    /// Where a prefill of `prompt_len` tokens should end a chunk so its
    /// cache can be kept: the last block boundary inside the prompt, for a
    /// hybrid model only (other caches are cut back to a boundary later).
    pub fn snapshot_at(&self, prompt_len: usize) -> Option<usize> {
        let aligned = (prompt_len / self.block) * self.block;
        (self.exact && self.wants(prompt_len) && aligned < prompt_len).then_some(aligned)
    }

    /// The reusable KV of the longest cached prefix of `prompt` in `scope`
    /// (for a model of `layers` layers).
    pub fn lookup(&self, scope: Option<&str>, prompt: &[u32], layers: usize) -> Option<Hit> {
        if self.capacity == 0 {
            return None;
        }
        self.store.lookup(scope, prompt, layers)
    }

    /// Whether [`SharedPrefixCache::lookup`] would find a reusable prefix
    /// (without touching the recency order).
    pub fn has_hit(&self, scope: Option<&str>, prompt: &[u32]) -> bool {
        if self.capacity == 0 {
            return false;
        }
        self.store.has_hit(scope, prompt)
    }

    /// Keeps the block-aligned prefix of `tokens`, whose KV `cache` (batch
    /// 1, no padding) holds from position 0; positions past `tokens` are
    /// ignored. Call under the device lock: the arrays are evaluated here,
    /// since a lazy graph is bound to the thread that built it and other
    /// engines read entries from theirs.
    pub fn insert(&self, scope: Option<&str>, tokens: &[u32], cache: &KvCache) {
        if !self.wants(tokens.len()) {
            return;
        }
        // Entries hold blocks of the server's pool only: a cache paged in
        // another pool is copied out.
        let copied;
        let cache = match cache.page_pool() {
            Some(p) if !self.pages.as_ref().is_some_and(|s| s.same(p)) => {
                match cache.contiguous() {
                    Ok(c) => {
                        copied = c;
                        &copied
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "copying a prefix out of the KV pool failed");
                        return;
                    }
                }
            }
            _ => cache,
        };
        if let Err(e) = eval(&cache.state()) {
            tracing::warn!(error = %e, "a prefix for the prefix cache failed to evaluate");
            return;
        }
        self.store.insert(scope, tokens, cache);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Array;

    fn filled(n: i32) -> KvCache {
        let mut c = KvCache::new(1, 1);
        let k = Array::zeros::<f32>(&[1, 1, n, 8]).unwrap();
        c.update(0, k.clone(), k).unwrap();
        c.advance(n);
        c
    }

    fn seq(from: u32) -> Vec<u32> {
        (from..from + 32).collect()
    }

    /// `prefix` and one more token: a prompt that can reuse all of it.
    fn extending(prefix: &[u32]) -> Vec<u32> {
        [prefix, &[1]].concat()
    }

    #[test]
    fn entries_are_charged_to_the_pool_and_given_up_for_sequences() {
        // Four 16-token blocks; each 32-token entry takes two.
        let pool = KvPool::new(4, 16, 1024);
        let store = SharedPrefixCache::new(&pool, 8, false, None);
        store.insert(None, &seq(0), &filled(32));
        store.insert(None, &seq(100), &filled(32));
        assert_eq!((pool.cached(), pool.allocated()), (4, 0));
        assert_eq!(pool.pressure(), 0.0, "cached blocks are no pressure");
        // The pool is full: a third entry displaces the oldest.
        store.insert(None, &seq(200), &filled(32));
        assert_eq!(pool.cached(), 4);
        assert!(!store.has_hit(None, &extending(&seq(0))));
        assert!(store.has_hit(None, &extending(&seq(100))));
        assert!(store.has_hit(None, &extending(&seq(200))));
        // A sequence needing three blocks gets them from the cache.
        let r = pool.try_reserve(3).unwrap();
        assert_eq!((pool.allocated(), pool.cached()), (3, 0));
        assert!(!store.has_hit(None, &extending(&seq(200))));
        // With the pool held by sequences, nothing is cached.
        store.insert(None, &seq(300), &filled(32));
        assert_eq!(pool.cached(), 0);
        drop(r);
        assert_eq!(pool.allocated(), 0);
    }
}
