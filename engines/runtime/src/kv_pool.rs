//! The KV block pool shared by every engine.
//!
//! Engines reserve blocks for prompt + max_tokens at admission and hold a
//! [`Reservation`] for as long as the request lives; dropping it (finish,
//! cancel, error, unwinding) returns the blocks. Reservations move between
//! engines with the sequence they cover (fast path to batched handover).
//! Pressure is allocated / total blocks. A hybrid model's sequence also
//! holds a recurrent state of constant size, counted as `state_blocks` more
//! per sequence whatever its length. The host owns the count
//! ([`LocalLedger`]); plugins reach it through C (`abi`).
//!
//! The prefix cache's entries hold blocks too, as *cached* reservations:
//! they count against the total (the memory is real) but not as pressure
//! or as blocks in use, and a reservation that finds the pool full first
//! has the cache give entries up (least recently used first), as vLLM
//! evicts cached blocks.
//!
//! An engine that queues a request while the pool is full waits for
//! blocks to come back ([`KvPool::reserve_waiting`]): every release, in
//! any engine of any image, wakes it, and so does [`KvPool::wake`] (a
//! cancellation), never a timer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("request needs {needed} KV blocks but the pool has {total} in all")]
    NeverFits { needed: usize, total: usize },
    #[error("KV pool is full")]
    Exhausted,
}

/// Who keeps the count of allocated blocks: the host's pool
/// ([`LocalLedger`]), or the host's through C in a plugin
/// (`abi::foreign`).
pub trait Ledger: Send + Sync {
    fn total(&self) -> usize;
    /// Blocks held by sequences (cached ones excluded).
    fn allocated(&self) -> usize;
    /// Blocks the prefix cache holds (given up on demand).
    fn cached(&self) -> usize;
    /// Takes `blocks` if they are free, without reclaiming cached ones.
    fn try_take(&self, blocks: usize) -> bool;
    /// Takes `blocks`, having the prefix cache give up entries if the free
    /// ones are too few.
    fn try_add(&self, blocks: usize) -> bool;
    fn release(&self, blocks: usize);
    /// Counts `blocks` taken (`on`) or given back as the prefix cache's.
    fn set_cached(&self, blocks: usize, on: bool);
    /// Has `reclaim(blocks)` free at least that many cached blocks when a
    /// reservation finds the pool full (set once).
    fn set_reclaim(&self, reclaim: Reclaim);
    /// How many times blocks went back (or a waiter was woken) so far.
    fn releases(&self) -> u64;
    /// Returns once [`Ledger::releases`] is past `seen`.
    fn wait_release(&self, seen: u64);
    /// Wakes every waiter, as a release would, to look again (at a
    /// cancellation).
    fn wake(&self);
}

pub type Reclaim = Box<dyn Fn(usize) + Send + Sync>;

/// The host's count.
#[derive(Default)]
pub struct LocalLedger {
    total: usize,
    /// Every block held, cached ones included.
    allocated: AtomicUsize,
    cached: AtomicUsize,
    reclaim: OnceLock<Reclaim>,
    /// [`Ledger::releases`], and the waiters on it.
    releases: Mutex<u64>,
    released: Condvar,
}

impl LocalLedger {
    fn releases_lock(&self) -> std::sync::MutexGuard<'_, u64> {
        self.releases.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Ledger for LocalLedger {
    fn total(&self) -> usize {
        self.total
    }

    fn allocated(&self) -> usize {
        self.allocated
            .load(Ordering::Acquire)
            .saturating_sub(self.cached.load(Ordering::Acquire))
    }

    fn cached(&self) -> usize {
        self.cached.load(Ordering::Acquire)
    }

    fn try_take(&self, blocks: usize) -> bool {
        self.allocated
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                (current + blocks <= self.total).then_some(current + blocks)
            })
            .is_ok()
    }

    fn try_add(&self, blocks: usize) -> bool {
        if self.try_take(blocks) {
            return true;
        }
        let Some(reclaim) = self.reclaim.get() else {
            return false;
        };
        let free = self
            .total
            .saturating_sub(self.allocated.load(Ordering::Acquire));
        reclaim(blocks.saturating_sub(free));
        self.try_take(blocks)
    }

    fn release(&self, blocks: usize) {
        self.allocated.fetch_sub(blocks, Ordering::AcqRel);
        self.wake();
    }

    fn set_cached(&self, blocks: usize, on: bool) {
        match on {
            true => self.cached.fetch_add(blocks, Ordering::AcqRel),
            false => self.cached.fetch_sub(blocks, Ordering::AcqRel),
        };
    }

    fn set_reclaim(&self, reclaim: Reclaim) {
        let _ = self.reclaim.set(reclaim);
    }

    fn releases(&self) -> u64 {
        *self.releases_lock()
    }

    fn wait_release(&self, seen: u64) {
        let count = self.releases_lock();
        let _count = self
            .released
            .wait_while(count, |n| *n == seen)
            .unwrap_or_else(|e| e.into_inner());
    }

    fn wake(&self) {
        *self.releases_lock() += 1;
        self.released.notify_all();
    }
}

#[derive(Clone)]
pub struct KvPool {
    ledger: Arc<dyn Ledger>,
    block_size: usize,
    bytes_per_block: usize,
    /// Blocks one sequence's recurrent state takes, on top of its tokens'.
    state_blocks: usize,
    /// Under a memory budget, the tokens of the step whose activations
    /// were measured: no engine's forward should hold more.
    step_tokens: Option<usize>,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("total", &self.total())
            .field("in_use", &self.allocated())
            .field("block_size", &self.block_size)
            .finish()
    }
}

impl KvPool {
    pub fn new(total_blocks: usize, block_size: usize, bytes_per_block: usize) -> Self {
        let ledger = LocalLedger {
            total: total_blocks,
            ..LocalLedger::default()
        };
        Self::with_ledger(Arc::new(ledger), block_size, bytes_per_block)
    }

    /// A pool counted by `ledger` (a plugin's view of the host's).
    pub fn with_ledger(ledger: Arc<dyn Ledger>, block_size: usize, bytes_per_block: usize) -> Self {
        Self {
            ledger,
            block_size: block_size.max(1),
            bytes_per_block,
            state_blocks: 0,
            step_tokens: None,
        }
    }

    /// Counts `blocks` of recurrent state per sequence (a view of the
    /// host's pool takes the host's count).
    pub fn with_state_blocks(mut self, blocks: usize) -> Self {
        self.state_blocks = blocks;
        self
    }

    /// The pool's count, for its C form (`abi`).
    pub fn ledger(&self) -> &Arc<dyn Ledger> {
        &self.ledger
    }

    /// Counts `bytes` of recurrent state per sequence (a hybrid model's
    /// linear-attention layers), in whole blocks, in every reservation.
    pub fn with_sequence_state(mut self, bytes: usize) -> Self {
        self.state_blocks = bytes.div_ceil(self.bytes_per_block.max(1));
        self
    }

    /// Bounds every forward by the memory budget's measured step.
    pub fn with_step_tokens(mut self, step_tokens: Option<usize>) -> Self {
        self.step_tokens = step_tokens;
        self
    }

    /// The memory budget's measured step, `None` without a budget.
    pub fn step_tokens(&self) -> Option<usize> {
        self.step_tokens
    }

    /// Blocks each sequence's recurrent state takes.
    pub fn state_blocks(&self) -> usize {
        self.state_blocks
    }

    /// A pool of `budget_bytes` for a model storing `bytes_per_token` of K+V
    /// per token.
    pub fn with_budget(budget_bytes: usize, block_size: usize, bytes_per_token: usize) -> Self {
        let bytes_per_block = bytes_per_token * block_size.max(1);
        Self::new(
            budget_bytes / bytes_per_block.max(1),
            block_size,
            bytes_per_block,
        )
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }

    pub fn total(&self) -> usize {
        self.ledger.total()
    }

    /// Blocks held by sequences (the prefix cache's excluded).
    pub fn allocated(&self) -> usize {
        self.ledger.allocated()
    }

    /// Blocks the prefix cache holds, given up when sequences need them.
    pub fn cached(&self) -> usize {
        self.ledger.cached()
    }

    pub fn pressure(&self) -> f64 {
        if self.total() == 0 {
            return 1.0;
        }
        self.allocated() as f64 / self.total() as f64
    }

    /// Blocks of one sequence of `tokens`: its KV and its recurrent state.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size) + self.state_blocks
    }

    /// Blocks for `tokens` at this pool's byte rate, scaled when the caller's
    /// cache stores more bytes per token than the pool was sized for.
    pub fn blocks_for_bytes(&self, tokens: usize, bytes_per_token: usize) -> usize {
        let bytes = tokens * bytes_per_token;
        bytes.div_ceil(self.bytes_per_block.max(1)) + self.state_blocks
    }

    pub fn check_fits(&self, blocks: usize) -> Result<(), PoolError> {
        if blocks > self.total() {
            return Err(PoolError::NeverFits {
                needed: blocks,
                total: self.total(),
            });
        }
        Ok(())
    }

    pub fn try_reserve(&self, blocks: usize) -> Result<Reservation, PoolError> {
        self.check_fits(blocks)?;
        if !self.ledger.try_add(blocks) {
            return Err(PoolError::Exhausted);
        }
        Ok(Reservation {
            ledger: self.ledger.clone(),
            blocks,
            cached: false,
        })
    }

    /// [`KvPool::try_reserve`], waiting while the pool is full until
    /// blocks come back; `None` once `stop` holds (checked again at each
    /// release and at each [`KvPool::wake`]: call it when what `stop`
    /// reads changes, as a cancellation).
    pub fn reserve_waiting(
        &self,
        blocks: usize,
        stop: impl Fn() -> bool,
    ) -> Result<Option<Reservation>, PoolError> {
        loop {
            // Read before looking: a release after it ends the wait at once.
            let seen = self.releases();
            if stop() {
                return Ok(None);
            }
            match self.try_reserve(blocks) {
                Err(PoolError::Exhausted) => self.wait_release(seen),
                reserved => return reserved.map(Some),
            }
        }
    }

    /// Wakes every [`KvPool::reserve_waiting`] to look at its `stop` again.
    pub fn wake(&self) {
        self.ledger.wake();
    }

    /// How many times blocks went back (or waiters were woken): read
    /// before looking at the pool, then [`KvPool::wait_release`].
    pub fn releases(&self) -> u64 {
        self.ledger.releases()
    }

    /// Returns once blocks went back (or waiters were woken) after
    /// [`KvPool::releases`] read `seen`.
    pub fn wait_release(&self, seen: u64) {
        self.ledger.wait_release(seen);
    }

    /// Blocks for a prefix-cache entry, only if they are free: the cache
    /// makes room among its own entries itself. Counted as cached.
    pub fn try_reserve_cached(&self, blocks: usize) -> Option<Reservation> {
        if !self.ledger.try_take(blocks) {
            return None;
        }
        self.ledger.set_cached(blocks, true);
        Some(Reservation {
            ledger: self.ledger.clone(),
            blocks,
            cached: true,
        })
    }

    /// Has `reclaim(blocks)` free at least that many cached blocks when a
    /// reservation finds the pool full (the host's pool; set once).
    pub fn set_reclaim(&self, reclaim: impl Fn(usize) + Send + Sync + 'static) {
        self.ledger.set_reclaim(Box::new(reclaim));
    }

    /// Takes over `blocks` that another engine reserved in this pool and
    /// gave up with [`Reservation::into_blocks`] (a handed-over sequence).
    pub fn adopt(&self, blocks: usize) -> Reservation {
        Reservation {
            ledger: self.ledger.clone(),
            blocks,
            cached: false,
        }
    }
}

/// Blocks held by one request (or prefix-cache entry); returned to the
/// pool on drop.
pub struct Reservation {
    ledger: Arc<dyn Ledger>,
    blocks: usize,
    cached: bool,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("blocks", &self.blocks)
            .field("cached", &self.cached)
            .finish()
    }
}

impl Reservation {
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Gives the blocks up without returning them, for [`KvPool::adopt`].
    pub fn into_blocks(self) -> usize {
        debug_assert!(!self.cached, "a cached reservation never moves");
        let blocks = self.blocks;
        std::mem::forget(self);
        blocks
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.cached {
            self.ledger.set_cached(self.blocks, false);
        }
        self.ledger.release(self.blocks);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn a_sequence_state_counts_once_per_sequence() {
        // 1 KiB blocks; a 2.5 KiB recurrent state takes 3 whatever the length.
        let pool = KvPool::new(10, 16, 1024).with_sequence_state(2560);
        assert_eq!(pool.state_blocks(), 3);
        assert_eq!(pool.blocks_for(1), 4);
        assert_eq!(pool.blocks_for(17), 5);
        assert_eq!(pool.blocks_for_bytes(16, 64), 4);
    }

    #[test]
    fn reserve_release_and_pressure() {
        let pool = KvPool::new(10, 16, 1024);
        assert_eq!(pool.pressure(), 0.0);
        assert_eq!(pool.blocks_for(17), 2);
        let a = pool.try_reserve(4).unwrap();
        let b = pool.try_reserve(6).unwrap();
        assert_eq!(pool.pressure(), 1.0);
        assert_eq!(pool.try_reserve(1).unwrap_err(), PoolError::Exhausted);
        drop(a);
        assert_eq!(pool.allocated(), 6);
        assert!(matches!(
            pool.try_reserve(11),
            Err(PoolError::NeverFits {
                needed: 11,
                total: 10
            })
        ));
        drop(b);
        assert_eq!(pool.allocated(), 0);
    }

    #[test]
    fn a_full_pool_waits_for_blocks_to_come_back_or_to_be_told_to_stop() {
        let pool = KvPool::new(4, 16, 1);
        waits_for_releases_and_wakes(&pool, &pool);
        assert_eq!(
            pool.reserve_waiting(5, || false).unwrap_err(),
            PoolError::NeverFits {
                needed: 5,
                total: 4
            }
        );
    }

    /// A [`KvPool::reserve_waiting`] on `waiter` (a pool of 4 blocks) ends
    /// when `other`, the same count, gives blocks back, and stops when
    /// `other` wakes it.
    pub(crate) fn waits_for_releases_and_wakes(waiter: &KvPool, other: &KvPool) {
        let moment = std::time::Duration::from_millis(20);
        let held = other.try_reserve(4).unwrap();
        let waiting = std::thread::spawn({
            let pool = waiter.clone();
            move || pool.reserve_waiting(3, || false).unwrap().unwrap().blocks()
        });
        std::thread::sleep(moment);
        assert!(!waiting.is_finished(), "no blocks, no answer");
        drop(held);
        assert_eq!(waiting.join().unwrap(), 3, "woken by the release");
        let _held = other.try_reserve(4).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let waiting = std::thread::spawn({
            let (pool, stop) = (waiter.clone(), stop.clone());
            move || {
                pool.reserve_waiting(2, || stop.load(Ordering::Acquire))
                    .unwrap()
                    .is_none()
            }
        });
        std::thread::sleep(moment);
        assert!(!waiting.is_finished());
        stop.store(true, Ordering::Release);
        other.wake();
        assert!(waiting.join().unwrap(), "stopped when woken");
    }
}
