//! Automatic prefix caching on block boundaries: the KV of a prompt's
//! block-aligned prefix is kept after prefill, and a later prompt of the
//! same cache scope that starts with it skips recomputing those positions.
//! Entries never cross scopes, so one tenant cannot time another's prompts.
//!
//! A hybrid model's cache (recurrent states) cannot be cut back to a shorter
//! prefix: there an entry is an exact snapshot taken at a block boundary
//! during prefill, reused only by prompts that extend all of it.

use std::collections::VecDeque;

use runtime::KvCache;

struct Entry {
    scope: Option<String>,
    tokens: Vec<u32>,
    cache: KvCache,
}

pub struct PrefixCache {
    block: usize,
    capacity: usize,
    /// Entries are reused whole, never truncated (hybrid models).
    exact: bool,
    /// Most recently used last.
    entries: VecDeque<Entry>,
}

pub struct Hit {
    pub cache: KvCache,
    pub tokens: usize,
}

impl PrefixCache {
    pub fn new(block: usize, capacity: usize, exact: bool) -> Self {
        Self {
            block: block.max(1),
            capacity,
            exact,
            entries: VecDeque::new(),
        }
    }

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
                let whole = common == e.tokens.len() && common <= usable;
                match self.exact {
                    true if whole => (i, common),
                    true => (i, 0),
                    false => (i, (common.min(usable) / self.block) * self.block),
                }
            })
            .filter(|&(_, len)| len > 0)
            .max_by_key(|&(i, len)| (len, std::cmp::Reverse(i)))
    }

    /// The reusable KV of the longest cached prefix of `prompt`.
    pub fn lookup(&mut self, scope: Option<&str>, prompt: &[u32]) -> Option<Hit> {
        let (i, len) = self.best_match(scope, prompt)?;
        let entry = self.entries.remove(i)?;
        let mut cache = entry.cache.clone();
        cache
            .truncate(cache.len() - len as i32)
            .expect("exact entries are reused whole");
        self.entries.push_back(entry);
        Some(Hit { cache, tokens: len })
    }

    /// Whether `lookup` would find a reusable prefix (without touching the
    /// recency order).
    pub fn has_hit(&self, scope: Option<&str>, prompt: &[u32]) -> bool {
        self.best_match(scope, prompt).is_some()
    }

    /// Whether a prompt is long enough to leave a reusable prefix.
    pub fn wants(&self, prompt: &[u32]) -> bool {
        self.capacity > 0 && prompt.len() >= self.block
    }

    /// Where a hybrid model's prefill of `prompt` stops for a snapshot (the
    /// last block boundary inside it), `None` when no snapshot is wanted.
    pub fn snapshot_at(&self, prompt: &[u32]) -> Option<usize> {
        let aligned = (prompt.len() / self.block) * self.block;
        (self.exact && self.wants(prompt) && aligned < prompt.len()).then_some(aligned)
    }

    /// Keeps the block-aligned prefix of a freshly prefilled prompt. `cache`
    /// holds exactly the prompt's KV (for exact entries: only a prompt
    /// ending on a block boundary is kept).
    pub fn insert(&mut self, scope: Option<&str>, prompt: &[u32], cache: &KvCache) {
        if self.capacity == 0 {
            return;
        }
        let aligned = (prompt.len() / self.block) * self.block;
        if aligned == 0 || (self.exact && aligned != prompt.len()) {
            return;
        }
        let key = &prompt[..aligned];
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
        kept.truncate(kept.len() - aligned as i32)
            .expect("exact entries are kept whole");
        while self.entries.len() >= self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back(Entry {
            scope: scope.map(str::to_string),
            tokens: key.to_vec(),
            cache: kept,
        });
    }
}
