//! The fast path: one exclusive request, greedy or sampled, at the speed
//! of the raw model loop (no batching bookkeeping, next step queued before
//! the current token is read; one step at a time where each pick follows
//! the token before it: a grammar, penalties). It starts from the longest
//! prefix the shared prefix cache holds and publishes its sequence (prompt
//! and answer) when it ends, so a chat's next turn prefills only its new
//! tokens. When other work arrives it hands the running sequence, KV and
//! all, to the batched engine and the stream goes on.

mod engine;
mod worker;

pub use engine::FastpathEngine;
