//! The continuous-batching engine: one scheduler thread owns the decode
//! batch; new requests are prefilled in chunks under a per-step token budget
//! and merged into the running batch without draining it, finished rows
//! leave at once, and every row samples with its own parameters.

mod admit;
mod config;
mod device;
mod engine;
mod plan;
mod queue;
mod row;
mod scheduler;

pub use config::BatchedConfig;
pub use engine::BatchedEngine;
