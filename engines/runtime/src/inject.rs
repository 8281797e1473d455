//! Fault injection for the tests, by environment variable, counted in
//! model forwards of each engine image (each plugin counts its own):
//! `GATEWAY_INJECT_OOM=3,7` makes the 3rd and 7th forward fail as an
//! allocation failure does, after the forward wrote its KV cache (a failed
//! evaluation leaves the cache unusable the same way);
//! `GATEWAY_INJECT_PANIC=5` makes the 5th panic.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

pub const OOM_ENV: &str = "GATEWAY_INJECT_OOM";
pub const PANIC_ENV: &str = "GATEWAY_INJECT_PANIC";

struct Plan {
    oom: Vec<u64>,
    panic: Vec<u64>,
}

static FORWARDS: AtomicU64 = AtomicU64::new(0);

fn plan() -> &'static Plan {
    static PLAN: OnceLock<Plan> = OnceLock::new();
    PLAN.get_or_init(|| {
        let read = |key| {
            std::env::var(key)
                .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
                .unwrap_or_default()
        };
        Plan {
            oom: read(OOM_ENV),
            panic: read(PANIC_ENV),
        }
    })
}

/// Called once per model forward, after it wrote the KV cache.
pub(crate) fn at_forward() -> anyhow::Result<()> {
    let plan = plan();
    if plan.oom.is_empty() && plan.panic.is_empty() {
        return Ok(());
    }
    let n = FORWARDS.fetch_add(1, Ordering::Relaxed) + 1;
    if plan.panic.contains(&n) {
        panic!("[injected] panic in forward {n} ({PANIC_ENV})");
    }
    if plan.oom.contains(&n) {
        anyhow::bail!("[injected] cudaMallocAsync: out of memory (forward {n}, {OOM_ENV})");
    }
    Ok(())
}
