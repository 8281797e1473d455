//! Which upstream gets the next request: a pure function of the
//! upstreams' state, so it is tested on its own.
//!
//! Among healthy upstreams under their in-flight cap (and, when any
//! publishes KV usage, preferring those under the high watermark), the
//! least loaded wins; load is our own in-flight requests to it (or what it
//! reports running, when that is higher: other clients use it too) plus
//! what it reports queued. A request with a long prompt prefers the
//! upstream its prefix hashes to (rendezvous hashing, stable when
//! upstreams come and go), unless that one is busier than the least
//! loaded by more than the allowed imbalance.

use crate::load_report::LoadReport;

#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Stable identity for hashing (the upstream's URL hash).
    pub key: u64,
    pub healthy: bool,
    pub outstanding: usize,
    pub report: LoadReport,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BalanceRules {
    pub max_outstanding: Option<usize>,
    pub kv_high_watermark: f64,
    pub affinity_max_imbalance: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Choice {
    Upstream(usize),
    /// Healthy upstreams exist but every one is at its in-flight cap.
    AllBusy,
    /// No healthy upstream (or every healthy one was already tried).
    NoneHealthy,
}

impl Candidate {
    fn load(&self) -> f64 {
        let running = (self.outstanding as f64).max(self.report.running.unwrap_or(0.0));
        running + self.report.waiting.unwrap_or(0.0)
    }

    fn kv_saturated(&self, watermark: f64) -> bool {
        self.report.kv_usage.is_some_and(|kv| kv >= watermark)
    }
}

/// `excluded`: upstreams already tried for this request. `affinity`: the
/// hash of the request's prompt prefix, when it is long enough.
/// `rotation` breaks ties between equally loaded upstreams.
pub fn choose(
    candidates: &[Candidate],
    excluded: &[usize],
    affinity: Option<u64>,
    rules: &BalanceRules,
    rotation: usize,
) -> Choice {
    let healthy: Vec<usize> = (0..candidates.len())
        .filter(|i| candidates[*i].healthy && !excluded.contains(i))
        .collect();
    if healthy.is_empty() {
        return Choice::NoneHealthy;
    }
    let mut open: Vec<usize> = healthy
        .into_iter()
        .filter(|&i| {
            rules
                .max_outstanding
                .is_none_or(|cap| candidates[i].outstanding < cap)
        })
        .collect();
    if open.is_empty() {
        return Choice::AllBusy;
    }
    if open
        .iter()
        .any(|&i| !candidates[i].kv_saturated(rules.kv_high_watermark))
    {
        open.retain(|&i| !candidates[i].kv_saturated(rules.kv_high_watermark));
    }
    let least = open
        .iter()
        .map(|&i| candidates[i].load())
        .fold(f64::INFINITY, f64::min);
    if let Some(key) = affinity {
        let preferred = *open
            .iter()
            .max_by_key(|&&i| mix(key ^ candidates[i].key.rotate_left(17)))
            .expect("open is not empty");
        if candidates[preferred].load() <= least + rules.affinity_max_imbalance as f64 {
            return Choice::Upstream(preferred);
        }
    }
    let tied: Vec<usize> = open
        .into_iter()
        .filter(|&i| candidates[i].load() <= least)
        .collect();
    Choice::Upstream(tied[rotation % tied.len()])
}

/// FNV-1a over the first `n` tokens: the same prefix gives the same key in
/// every process.
pub fn prefix_key(prompt: &[u32], n: usize) -> Option<u64> {
    if n == 0 || prompt.len() < n {
        return None;
    }
    Some(fnv(prompt[..n].iter().flat_map(|t| t.to_le_bytes())))
}

pub fn fnv(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// splitmix64's finalizer: spreads a combined key over all bits.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(key: u64, outstanding: usize) -> Candidate {
        Candidate {
            key,
            healthy: true,
            outstanding,
            report: LoadReport::default(),
        }
    }

    const RULES: BalanceRules = BalanceRules {
        max_outstanding: None,
        kv_high_watermark: 0.9,
        affinity_max_imbalance: 2,
    };

    #[test]
    fn least_outstanding_wins_and_ties_rotate() {
        let c = [cand(1, 3), cand(2, 1), cand(3, 2)];
        assert_eq!(choose(&c, &[], None, &RULES, 0), Choice::Upstream(1));
        let tied = [cand(1, 0), cand(2, 0)];
        assert_eq!(choose(&tied, &[], None, &RULES, 0), Choice::Upstream(0));
        assert_eq!(choose(&tied, &[], None, &RULES, 1), Choice::Upstream(1));
    }

    #[test]
    fn unhealthy_tried_and_capped_upstreams_are_skipped() {
        let mut c = [cand(1, 0), cand(2, 5)];
        c[0].healthy = false;
        assert_eq!(choose(&c, &[], None, &RULES, 0), Choice::Upstream(1));
        assert_eq!(choose(&c, &[1], None, &RULES, 0), Choice::NoneHealthy);
        let capped = BalanceRules {
            max_outstanding: Some(5),
            ..RULES
        };
        assert_eq!(choose(&c, &[], None, &capped, 0), Choice::AllBusy);
    }

    #[test]
    fn published_figures_count() {
        let mut c = [cand(1, 1), cand(2, 2)];
        c[0].report.waiting = Some(3.0);
        assert_eq!(choose(&c, &[], None, &RULES, 0), Choice::Upstream(1));
        c[0].report = LoadReport {
            running: Some(9.0),
            ..LoadReport::default()
        };
        assert_eq!(choose(&c, &[], None, &RULES, 0), Choice::Upstream(1));
        // A KV-saturated upstream gets work only when all are.
        let mut kv = [cand(1, 0), cand(2, 4)];
        kv[0].report.kv_usage = Some(0.95);
        assert_eq!(choose(&kv, &[], None, &RULES, 0), Choice::Upstream(1));
        kv[1].report.kv_usage = Some(0.99);
        assert_eq!(choose(&kv, &[], None, &RULES, 0), Choice::Upstream(0));
    }

    #[test]
    fn affinity_is_stable_until_imbalanced() {
        let c: Vec<Candidate> = (0..4u64).map(|k| cand(fnv(k.to_le_bytes()), 0)).collect();
        let key = prefix_key(&[7; 32], 16).unwrap();
        let Choice::Upstream(home) = choose(&c, &[], Some(key), &RULES, 0) else {
            panic!()
        };
        for rotation in 0..8 {
            assert_eq!(
                choose(&c, &[], Some(key), &RULES, rotation),
                Choice::Upstream(home)
            );
        }
        // Different prefixes spread over the upstreams.
        let homes: std::collections::HashSet<_> = (0..64u32)
            .map(|p| choose(&c, &[], prefix_key(&[p; 16], 16), &RULES, 0))
            .collect();
        assert!(homes.len() >= 3, "{homes:?}");
        // Too busy: the least loaded wins instead.
        let mut busy = c.clone();
        busy[home].outstanding = 3;
        assert_ne!(
            choose(&busy, &[], Some(key), &RULES, 0),
            Choice::Upstream(home)
        );
        // Tried already (failover): another upstream.
        assert_ne!(
            choose(&c, &[home], Some(key), &RULES, 0),
            Choice::Upstream(home)
        );
    }

    #[test]
    fn short_prompts_have_no_affinity() {
        assert_eq!(prefix_key(&[1, 2], 4), None);
        assert_eq!(prefix_key(&[1, 2, 3, 4], 0), None);
        assert_eq!(
            prefix_key(&[1, 2, 3, 4, 5], 4),
            prefix_key(&[1, 2, 3, 4, 9], 4)
        );
        assert_ne!(prefix_key(&[1, 2, 3, 4], 4), prefix_key(&[1, 2, 3, 5], 4));
    }
}
