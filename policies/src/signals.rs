//! The facts a routing decision is made from: what the request asks for and
//! how loaded the engines are right now.

use std::collections::HashMap;

/// One request's view of the world, built by the gateway per request.
///
/// Per-engine maps are keyed by engine name. A loaded engine missing from
/// `engine_active` / `engine_queued` counts as 0 (nothing reported means
/// nothing running). A missing `engine_accept_rate` or `engine_speedup`
/// entry means *unknown*
/// (no drafts measured yet), which is different from 0.0: see the crate
/// docs for how unknown values compare.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Signals {
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    /// Plain greedy decoding (temperature 0, no sampling knobs).
    pub greedy: bool,
    pub has_tools: bool,
    pub has_images: bool,
    /// Requests running on all engines together.
    pub total_active: u64,
    /// Requests waiting for admission on all engines together.
    pub total_queued: u64,
    pub engine_active: HashMap<String, u64>,
    pub engine_queued: HashMap<String, u64>,
    /// Moving-window draft acceptance rate in 0..=1, for speculative engines.
    pub engine_accept_rate: HashMap<String, f64>,
    /// Moving-window speed of a speculative engine relative to plain
    /// decoding (tokens per target forward x decode-step cost / round
    /// cost): above 1.0 speculation pays. Missing means unknown.
    pub engine_speedup: HashMap<String, f64>,
    /// Allocated KV blocks over total blocks, in 0..=1.
    pub kv_pressure: f64,
    /// The model the request names.
    pub model: String,
}
