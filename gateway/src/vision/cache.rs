//! The vision feature cache: soft-token embeddings of recent images, keyed
//! by the SHA-256 of the image's encoded bytes, least recently used out
//! first. A repeated image skips decoding and the vision tower. Hits and
//! misses are counted for /metrics.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lru::LruCache;
use sha2::{Digest, Sha256};

use crate::telemetry::metric;

pub type ImageHash = [u8; 32];

pub fn hash(bytes: &[u8]) -> ImageHash {
    Sha256::digest(bytes).into()
}

pub fn hex(hash: &ImageHash) -> String {
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

pub struct FeatureCache {
    entries: Option<Mutex<LruCache<ImageHash, Arc<Vec<f32>>>>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl FeatureCache {
    /// `capacity` 0 turns caching off (every image runs the tower).
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: NonZeroUsize::new(capacity).map(|c| Mutex::new(LruCache::new(c))),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    pub fn get(&self, key: &ImageHash) -> Option<Arc<Vec<f32>>> {
        let found = self.entries.as_ref().and_then(|e| {
            e.lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(key)
                .cloned()
        });
        if found.is_some() {
            self.hits.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(metric::VISION_CACHE_HITS).increment(1);
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(metric::VISION_CACHE_MISSES).increment(1);
        }
        found
    }

    pub fn insert(&self, key: ImageHash, features: Arc<Vec<f32>>) {
        if let Some(entries) = &self.entries {
            let mut entries = entries.lock().unwrap_or_else(|p| p.into_inner());
            entries.put(key, features);
            metrics::gauge!(metric::VISION_CACHE_IMAGES).set(entries.len() as f64);
        }
    }

    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_goes_first() {
        let cache = FeatureCache::new(2);
        let (a, b, c) = (hash(b"a"), hash(b"b"), hash(b"c"));
        cache.insert(a, Arc::new(vec![1.0]));
        cache.insert(b, Arc::new(vec![2.0]));
        assert!(cache.get(&a).is_some()); // a is now the most recent
        cache.insert(c, Arc::new(vec![3.0]));
        assert!(cache.get(&b).is_none());
        assert_eq!(*cache.get(&a).unwrap(), vec![1.0]);
        assert_eq!((cache.hits(), cache.misses()), (2, 1));
    }

    #[test]
    fn capacity_zero_caches_nothing() {
        let cache = FeatureCache::new(0);
        cache.insert(hash(b"a"), Arc::new(vec![1.0]));
        assert!(cache.get(&hash(b"a")).is_none());
    }
}
