//! The KV block pool shared by every engine.
//!
//! Engines reserve blocks for prompt + max_tokens at admission and hold a
//! [`Reservation`] for as long as the request lives; dropping it (finish,
//! cancel, error, unwinding) returns the blocks. Reservations move between
//! engines with the sequence they cover (fast path to batched handover).
//! Pressure is allocated / total blocks. A hybrid model's sequence also
//! holds a recurrent state of constant size, counted as `state_blocks` more
//! per sequence whatever its length. The host owns the count; plugins
//! reach it through a C ledger ([`KvPool::export`] / [`KvPool::import`]).

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::abi::RawKvLedger;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("request needs {needed} KV blocks but the pool has {total} in all")]
    NeverFits { needed: usize, total: usize },
    #[error("KV pool is full")]
    Exhausted,
}

/// Who keeps the count of allocated blocks: this image (the host's pool),
/// or the host through C calls (a plugin's view of the same pool).
#[derive(Debug)]
enum Ledger {
    Local {
        total: usize,
        allocated: AtomicUsize,
    },
    Foreign(RawKvLedger),
}

// The host's ledger functions are thread-safe (atomics behind C calls).
unsafe impl Send for Ledger {}
unsafe impl Sync for Ledger {}

impl Ledger {
    fn total(&self) -> usize {
        match self {
            Ledger::Local { total, .. } => *total,
            Ledger::Foreign(raw) => raw.total,
        }
    }

    fn allocated(&self) -> usize {
        match self {
            Ledger::Local { allocated, .. } => allocated.load(Ordering::Acquire),
            Ledger::Foreign(raw) => unsafe { (raw.allocated)(raw.ctx) },
        }
    }

    fn try_add(&self, blocks: usize) -> bool {
        match self {
            Ledger::Local { total, allocated } => allocated
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                    (current + blocks <= *total).then_some(current + blocks)
                })
                .is_ok(),
            Ledger::Foreign(raw) => unsafe { (raw.try_reserve)(raw.ctx, blocks) },
        }
    }

    fn release(&self, blocks: usize) {
        match self {
            Ledger::Local { allocated, .. } => {
                allocated.fetch_sub(blocks, Ordering::AcqRel);
            }
            Ledger::Foreign(raw) => unsafe { (raw.release)(raw.ctx, blocks) },
        }
    }
}

#[derive(Debug, Clone)]
pub struct KvPool {
    ledger: Arc<Ledger>,
    block_size: usize,
    bytes_per_block: usize,
    /// Blocks one sequence's recurrent state takes, on top of its tokens'.
    state_blocks: usize,
}

impl KvPool {
    pub fn new(total_blocks: usize, block_size: usize, bytes_per_block: usize) -> Self {
        Self {
            ledger: Arc::new(Ledger::Local {
                total: total_blocks,
                allocated: AtomicUsize::new(0),
            }),
            block_size: block_size.max(1),
            bytes_per_block,
            state_blocks: 0,
        }
    }

    /// Counts `bytes` of recurrent state per sequence (a hybrid model's
    /// linear-attention layers), in whole blocks, in every reservation.
    pub fn with_sequence_state(mut self, bytes: usize) -> Self {
        self.state_blocks = bytes.div_ceil(self.bytes_per_block.max(1));
        self
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

    /// This pool as a C ledger; it stays alive for the process.
    pub fn export(&self) -> RawKvLedger {
        unsafe extern "C" fn try_reserve(ctx: *mut c_void, blocks: usize) -> bool {
            (*(ctx as *const Ledger)).try_add(blocks)
        }
        unsafe extern "C" fn release(ctx: *mut c_void, blocks: usize) {
            (*(ctx as *const Ledger)).release(blocks)
        }
        unsafe extern "C" fn allocated(ctx: *mut c_void) -> usize {
            (*(ctx as *const Ledger)).allocated()
        }
        RawKvLedger {
            ctx: Arc::into_raw(self.ledger.clone()) as *mut c_void,
            total: self.total(),
            block_size: self.block_size,
            bytes_per_block: self.bytes_per_block,
            state_blocks: self.state_blocks,
            try_reserve,
            release,
            allocated,
        }
    }

    /// A view of the host's pool.
    ///
    /// # Safety
    /// `raw` came from [`KvPool::export`] and lives for the process.
    pub unsafe fn import(raw: &RawKvLedger) -> Self {
        Self {
            ledger: Arc::new(Ledger::Foreign(RawKvLedger { ..*raw })),
            block_size: raw.block_size,
            bytes_per_block: raw.bytes_per_block,
            state_blocks: raw.state_blocks,
        }
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

    pub fn allocated(&self) -> usize {
        self.ledger.allocated()
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
        })
    }

    /// Takes over `blocks` that another engine reserved in this pool and
    /// gave up with [`Reservation::into_blocks`] (a handed-over sequence).
    pub fn adopt(&self, blocks: usize) -> Reservation {
        Reservation {
            ledger: self.ledger.clone(),
            blocks,
        }
    }
}

/// Blocks held by one request; returned to the pool on drop.
#[derive(Debug)]
pub struct Reservation {
    ledger: Arc<Ledger>,
    blocks: usize,
}

impl Reservation {
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Gives the blocks up without returning them, for [`KvPool::adopt`].
    pub fn into_blocks(self) -> usize {
        let blocks = self.blocks;
        std::mem::forget(self);
        blocks
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.ledger.release(self.blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_state_counts_once_per_sequence() {
        // 1 KiB blocks; a 2.5 KiB recurrent state takes 3 whatever the length.
        let pool = KvPool::new(10, 16, 1024).with_sequence_state(2560);
        assert_eq!(pool.state_blocks(), 3);
        assert_eq!(pool.blocks_for(1), 4);
        assert_eq!(pool.blocks_for(17), 5);
        assert_eq!(pool.blocks_for_bytes(16, 64), 4);
        // A plugin's view of the pool counts the same.
        let view = unsafe { KvPool::import(&pool.export()) };
        assert_eq!(view.blocks_for(17), 5);
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
    fn an_imported_pool_shares_the_hosts_count() {
        let host = KvPool::new(10, 16, 1024);
        let raw = host.export();
        let view = unsafe { KvPool::import(&raw) };
        assert_eq!((view.total(), view.block_size()), (10, 16));
        let r = view.try_reserve(7).unwrap();
        assert_eq!(host.allocated(), 7);
        assert_eq!(host.try_reserve(4).unwrap_err(), PoolError::Exhausted);
        // Handed from the view to the host, returned once.
        let adopted = host.adopt(r.into_blocks());
        assert_eq!(view.allocated(), 7);
        drop(adopted);
        assert_eq!(view.allocated(), 0);
    }
}
