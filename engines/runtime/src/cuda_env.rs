//! Defaults for MLX's CUDA kernel caches, applied before MLX starts.
//!
//! MLX's CUDA backend keeps LRU caches of compiled attention graphs
//! (`MLX_CUDA_SDPA_CACHE_SIZE`, 256) and CUDA graphs
//! (`MLX_CUDA_GRAPH_CACHE_SIZE`, 400), and counts every miss over the
//! process's life: past twice the capacity, every further miss throws
//! ("Cache thrashing is happening"), failing the request that hit it. A
//! long-lived server that sees many prompt lengths, or verifies drafts at
//! ever-growing context lengths, gets there. The defaults below make the
//! caches larger and turn the lifetime check off (eviction still works).
//! An operator's own setting of any of these always wins. The variables are
//! read only by the CUDA backend; on a CPU they do nothing.

const DEFAULTS: &[(&str, &str)] = &[
    ("MLX_CUDA_SDPA_CACHE_SIZE", "2048"),
    ("MLX_CUDA_GRAPH_CACHE_SIZE", "2000"),
    ("MLX_ENABLE_CACHE_THRASHING_CHECK", "0"),
];

/// Sets the defaults that are unset. Call at the top of `main`, before any
/// other thread starts or MLX runs (the environment is process-global).
pub fn apply_defaults() {
    for (name, value) in DEFAULTS {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
}
