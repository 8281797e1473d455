//! Start-up bursts through every local engine. On a GPU, MLX compiles some
//! kernels the first time a shape needs them (NVRTC, about 2 s each, kept
//! in its on-disk cache), and the model's own warm-up
//! (`runtime::generate::warm_up`) runs one sequence only: a server's first
//! burst then paid for a group of prompts prefilled together and for rows
//! leaving the batch (an H200, Qwen3-4B shape: the first c=16 burst waited
//! 2.2 s for its first token and 2.5 s more for its last, the second 0.1 s;
//! docs/benchmarks.md, "First-shape costs and prefill"). These bursts
//! meet those shapes before the first client:
//! prompts of spread lengths arriving together, answers of spread lengths
//! so rows leave one by one and several at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_core::{Event, GenerateRequest};
use tokio::sync::mpsc::error::TryRecvError;

use super::EngineEntry;

/// The prefix-cache scope of the bursts' requests: no client's requests
/// carry it, so what they leave in the cache is never served.
const SCOPE: &str = "\u{0}gateway-warm-up";

/// Requests per burst, one burst after another.
const BURSTS: [usize; 4] = [1, 3, 16, 64];

/// The longest one burst may take before the rest are given up.
const BURST_LIMIT: Duration = Duration::from_secs(120);

/// Kinds left out: `remote` (its work is another server's) and the
/// speculative engines, whose routing signals (`engine_accept_rate.NAME`)
/// and draft sizing learn from the traffic they serve: random prompts would
/// teach them that drafts never pay. Their single-sequence shapes are the
/// model warm-up's.
const NOT_WARMED: [&str; 3] = ["remote", "dflash", "mtp"];

/// Runs [`BURSTS`] through each engine but [`NOT_WARMED`]. A request an
/// engine refuses (the fast path while it serves another, a full pool) is
/// skipped; nothing here fails the start. Returns the time it took.
pub fn warm_engines(engines: &[Arc<EngineEntry>], vocab: u32) -> Duration {
    let started = Instant::now();
    for entry in engines
        .iter()
        .filter(|e| !NOT_WARMED.contains(&e.kind.as_str()))
    {
        for (b, &size) in BURSTS.iter().enumerate() {
            let streams: Vec<_> = (0..size)
                .filter_map(|i| entry.submit(request(b * 97 + i, vocab)).ok())
                .collect();
            // Each burst has its own limit, whatever the engines before it took.
            if !drain(streams, Instant::now() + BURST_LIMIT) {
                tracing::warn!(engine = %entry.name, burst = size, "warm-up burst given up");
                break;
            }
        }
    }
    started.elapsed()
}

/// The `i`th request: 24 to 311 prompt tokens, 4 to 24 answer tokens (no
/// stop token, so every answer runs to its length).
fn request(i: usize, vocab: u32) -> GenerateRequest {
    let len = 24 + (i * 37) % 288;
    let prompt = (0..len)
        .map(|j| ((i * 131 + j * 7919 + 1000) % vocab.max(1) as usize) as u32)
        .collect();
    let mut req = GenerateRequest::new(prompt, 4 + (i as u32 * 5) % 21);
    req.cache_scope = Some(SCOPE.to_string());
    req
}

/// Reads every stream to its end; false when `deadline` passed first (the
/// rest are cancelled by dropping their streams).
fn drain(mut streams: Vec<engine_core::EventStream>, deadline: Instant) -> bool {
    while !streams.is_empty() {
        if Instant::now() > deadline {
            return false;
        }
        streams.retain_mut(|s| loop {
            match s.try_recv() {
                Ok(Event::Finished(_) | Event::Error(_)) | Err(TryRecvError::Disconnected) => {
                    break false
                }
                Ok(_) => continue,
                Err(TryRecvError::Empty) => break true,
            }
        });
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}
