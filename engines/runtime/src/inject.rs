//! Fault injection for the tests, by environment variable, counted in
//! model forwards of each engine image (each plugin counts its own):
//!
//! * `GATEWAY_INJECT_OOM=3,7,20-24` makes the 3rd, the 7th and the 20th to
//!   24th forward fail as an allocation failure does, after the forward
//!   wrote its KV cache (a failed evaluation leaves the cache unusable the
//!   same way);
//! * `GATEWAY_INJECT_OOM_BURST=4:6` makes the first forward of at least 4
//!   rows and the 5 after it fail the same way: memory that does not come
//!   back while a batch is full;
//! * `GATEWAY_INJECT_PANIC=5` makes the 5th panic, and
//!   `GATEWAY_INJECT_PANIC_ON=batched-worker:/tmp/now` the first forward
//!   on the thread of that name once the file `/tmp/now` exists (a panic
//!   mid-batch in one engine, when the test chooses);
//! * `GATEWAY_INJECT_FREE_MB=512` makes the device report 512 MiB free
//!   ([`crate::memory::device_free`]), for the startup budget check.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

pub const OOM_ENV: &str = "GATEWAY_INJECT_OOM";
pub const OOM_BURST_ENV: &str = "GATEWAY_INJECT_OOM_BURST";
pub const PANIC_ENV: &str = "GATEWAY_INJECT_PANIC";
pub const PANIC_ON_ENV: &str = "GATEWAY_INJECT_PANIC_ON";
pub const FREE_MEMORY_ENV: &str = "GATEWAY_INJECT_FREE_MB";

struct Plan {
    oom: Vec<(u64, u64)>,
    /// Rows that start the burst, and how many forwards it fails.
    burst: Option<(usize, u64)>,
    panic: Vec<(u64, u64)>,
    /// The thread whose forward panics, and the file that arms it.
    panic_on: Option<(String, PathBuf)>,
}

impl Plan {
    fn is_empty(&self) -> bool {
        self.oom.is_empty()
            && self.burst.is_none()
            && self.panic.is_empty()
            && self.panic_on.is_none()
    }
}

static FORWARDS: AtomicU64 = AtomicU64::new(0);
/// The forward that started the burst (0: not yet).
static BURST_FROM: AtomicU64 = AtomicU64::new(0);
/// The armed panic happened (it happens once).
static ARMED_PANICKED: AtomicBool = AtomicBool::new(false);

/// `3,7,20-24`: inclusive ranges of forward numbers.
fn ranges(text: &str) -> Vec<(u64, u64)> {
    text.split(',')
        .filter_map(|part| {
            let part = part.trim();
            match part.split_once('-') {
                Some((a, b)) => Some((a.trim().parse().ok()?, b.trim().parse().ok()?)),
                None => part.parse().ok().map(|n| (n, n)),
            }
        })
        .collect()
}

fn plan() -> &'static Plan {
    static PLAN: OnceLock<Plan> = OnceLock::new();
    PLAN.get_or_init(|| {
        let read = |key| std::env::var(key).map(|v| ranges(&v)).unwrap_or_default();
        // `a:b`
        let pair = |key| {
            let v = std::env::var(key).ok()?;
            v.split_once(':')
                .map(|(a, b)| (a.trim().to_owned(), b.to_owned()))
        };
        Plan {
            oom: read(OOM_ENV),
            burst: pair(OOM_BURST_ENV)
                .and_then(|(rows, n)| Some((rows.parse().ok()?, n.trim().parse().ok()?))),
            panic: read(PANIC_ENV),
            panic_on: pair(PANIC_ON_ENV).map(|(thread, path)| (thread, PathBuf::from(path))),
        }
    })
}

fn within(ranges: &[(u64, u64)], n: u64) -> bool {
    ranges.iter().any(|&(a, b)| (a..=b).contains(&n))
}

/// Called once per model forward of `rows` rows, after it wrote the KV
/// cache.
pub(crate) fn at_forward(rows: usize) -> anyhow::Result<()> {
    let plan = plan();
    if plan.is_empty() {
        return Ok(());
    }
    let n = FORWARDS.fetch_add(1, Ordering::Relaxed) + 1;
    if within(&plan.panic, n) {
        panic!("[injected] panic in forward {n} ({PANIC_ENV})");
    }
    if let Some((thread, armed)) = &plan.panic_on {
        if std::thread::current().name() == Some(thread.as_str())
            && armed.exists()
            && !ARMED_PANICKED.swap(true, Ordering::Relaxed)
        {
            panic!("[injected] panic in forward {n} on {thread} ({PANIC_ON_ENV})");
        }
    }
    let in_burst = plan.burst.is_some_and(|(min_rows, count)| {
        if rows >= min_rows {
            let _ = BURST_FROM.compare_exchange(0, n, Ordering::Relaxed, Ordering::Relaxed);
        }
        let from = BURST_FROM.load(Ordering::Relaxed);
        from > 0 && n < from + count
    });
    if in_burst || within(&plan.oom, n) {
        anyhow::bail!("[injected] cudaMallocAsync: out of memory (forward {n}, {OOM_ENV})");
    }
    Ok(())
}

/// The free memory `GATEWAY_INJECT_FREE_MB` makes the device report.
pub(crate) fn free_memory() -> Option<u64> {
    let mb: u64 = std::env::var(FREE_MEMORY_ENV).ok()?.trim().parse().ok()?;
    Some(mb << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_numbers_and_ranges() {
        assert_eq!(ranges("3, 7,20-24,x"), vec![(3, 3), (7, 7), (20, 24)]);
        assert!(within(&ranges("20-24"), 24) && !within(&ranges("20-24"), 25));
    }
}
