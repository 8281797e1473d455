//! The KV block pool shared by every engine.
//!
//! Engines reserve blocks for prompt + max_tokens at admission and hold a
//! [`Reservation`] for as long as the request lives; dropping it (finish,
//! cancel, error, unwinding) returns the blocks. Reservations move between
//! engines with the sequence they cover (fast path to batched handover).
//! Pressure is allocated / total blocks.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("request needs {needed} KV blocks but the pool has {total} in all")]
    NeverFits { needed: usize, total: usize },
    #[error("KV pool is full")]
    Exhausted,
}

#[derive(Debug)]
struct Inner {
    total: usize,
    allocated: AtomicUsize,
}

#[derive(Debug, Clone)]
pub struct KvPool {
    inner: Arc<Inner>,
    block_size: usize,
    bytes_per_block: usize,
}

impl KvPool {
    pub fn new(total_blocks: usize, block_size: usize, bytes_per_block: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                total: total_blocks,
                allocated: AtomicUsize::new(0),
            }),
            block_size: block_size.max(1),
            bytes_per_block,
        }
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
        self.inner.total
    }

    pub fn allocated(&self) -> usize {
        self.inner.allocated.load(Ordering::Acquire)
    }

    pub fn pressure(&self) -> f64 {
        if self.inner.total == 0 {
            return 1.0;
        }
        self.allocated() as f64 / self.inner.total as f64
    }

    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Blocks for `tokens` at this pool's byte rate, scaled when the caller's
    /// cache stores more bytes per token than the pool was sized for.
    pub fn blocks_for_bytes(&self, tokens: usize, bytes_per_token: usize) -> usize {
        let bytes = tokens * bytes_per_token;
        bytes.div_ceil(self.bytes_per_block.max(1))
    }

    pub fn check_fits(&self, blocks: usize) -> Result<(), PoolError> {
        if blocks > self.inner.total {
            return Err(PoolError::NeverFits {
                needed: blocks,
                total: self.inner.total,
            });
        }
        Ok(())
    }

    pub fn try_reserve(&self, blocks: usize) -> Result<Reservation, PoolError> {
        self.check_fits(blocks)?;
        let mut current = self.inner.allocated.load(Ordering::Acquire);
        loop {
            if current + blocks > self.inner.total {
                return Err(PoolError::Exhausted);
            }
            match self.inner.allocated.compare_exchange_weak(
                current,
                current + blocks,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Ok(Reservation {
                        inner: self.inner.clone(),
                        blocks,
                    })
                }
                Err(actual) => current = actual,
            }
        }
    }
}

/// Blocks held by one request; returned to the pool on drop.
#[derive(Debug)]
pub struct Reservation {
    inner: Arc<Inner>,
    blocks: usize,
}

impl Reservation {
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.inner
            .allocated
            .fetch_sub(self.blocks, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
