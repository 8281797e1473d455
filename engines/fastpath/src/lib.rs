//! The fast path: one exclusive plain-greedy request at the speed of the
//! raw model loop (no batching bookkeeping, next step queued before the
//! current token is read). When other work arrives it hands the running
//! sequence, KV and all, to the batched engine and the stream goes on.

mod eligibility;
mod engine;
mod worker;

pub use eligibility::check as check_eligibility;
pub use engine::FastpathEngine;
