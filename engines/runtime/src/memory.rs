//! Device memory: what the device has, what MLX holds, the limits the
//! server keeps, and out-of-memory as a recoverable condition.
//!
//! MLX keeps the buffers it frees in a cache for reuse; without limits a
//! server's process grows to the whole device. [`apply_limits`] bounds both
//! what MLX may allocate and what it may keep cached. An allocation that
//! fails anyway (another process took the memory, a step larger than
//! measured) surfaces as an error of the step that made it:
//! [`is_out_of_memory`] recognises it, so engines free MLX's cache, give
//! work back and retry instead of failing their requests as internal
//! errors.

use std::ffi::CString;

use engine_core::StreamError;

/// What MLX holds, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MlxMemory {
    /// Live arrays (weights, KV, activations in flight).
    pub active: u64,
    /// Freed buffers MLX keeps for reuse.
    pub cache: u64,
    /// Highest `active` since start (or the last reset).
    pub peak: u64,
    /// The allocation limit MLX enforces.
    pub limit: u64,
}

/// What MLX holds now.
pub fn mlx_memory() -> MlxMemory {
    let read = |f: unsafe extern "C" fn(*mut usize) -> std::os::raw::c_int| {
        let mut v = 0usize;
        // SAFETY: the getters only write the out-parameter.
        unsafe { f(&mut v) };
        v as u64
    };
    MlxMemory {
        active: read(mlx_sys::mlx_get_active_memory),
        cache: read(mlx_sys::mlx_get_cache_memory),
        peak: read(mlx_sys::mlx_get_peak_memory),
        limit: read(mlx_sys::mlx_get_memory_limit),
    }
}

/// Total memory of the default device: the GPU's own on CUDA and Metal,
/// the machine's RAM on the CPU backend. `None` when it cannot be read.
pub fn device_total() -> Option<u64> {
    device_info_size(&["total_memory", "memory_size"]).or_else(|| meminfo("MemTotal:"))
}

/// Memory of the default device free now, for any process: CUDA's own
/// figure, the machine's available RAM (`MemAvailable`) on the CPU
/// backend. `None` where neither can be read (Metal reports no free
/// figure). Memory this process holds is not in it.
pub fn device_free() -> Option<u64> {
    crate::inject::free_memory()
        .or_else(|| device_info_size(&["free_memory"]))
        .or_else(|| meminfo("MemAvailable:"))
}

fn device_info_size(keys: &[&str]) -> Option<u64> {
    // SAFETY: mlx-c's device-info calls read a device handle and fill an
    // info object we free before returning.
    unsafe {
        let mut dev = mlx_sys::mlx_device_new();
        if mlx_sys::mlx_get_default_device(&mut dev) != 0 {
            mlx_sys::mlx_device_free(dev);
            return None;
        }
        let mut info = mlx_sys::mlx_device_info_new();
        let found = if mlx_sys::mlx_device_info_get(&mut info, dev) == 0 {
            keys.iter().find_map(|key| {
                let key = CString::new(*key).ok()?;
                let mut exists = false;
                mlx_sys::mlx_device_info_has_key(&mut exists, info, key.as_ptr());
                let mut is_string = true;
                mlx_sys::mlx_device_info_is_string(&mut is_string, info, key.as_ptr());
                if !exists || is_string {
                    return None;
                }
                let mut value = 0usize;
                (mlx_sys::mlx_device_info_get_size(&mut value, info, key.as_ptr()) == 0)
                    .then_some(value as u64)
            })
        } else {
            None
        };
        mlx_sys::mlx_device_info_free(info);
        mlx_sys::mlx_device_free(dev);
        found
    }
}

/// A `/proc/meminfo` figure (Linux), in bytes.
fn meminfo(key: &str) -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Bounds what MLX may allocate (`limit`) and keep cached (`cache`).
pub fn apply_limits(limit: u64, cache: u64) {
    let mut previous = 0usize;
    // SAFETY: plain setters of MLX's allocator.
    unsafe {
        mlx_sys::mlx_set_memory_limit(&mut previous, limit as usize);
        mlx_sys::mlx_set_cache_limit(&mut previous, cache as usize);
    }
}

/// Returns MLX's cached buffers to the device (after an allocation failed).
pub fn release_cache() {
    // SAFETY: no arguments; MLX frees only buffers no array uses.
    unsafe { mlx_sys::mlx_clear_cache() };
}

/// Restarts the peak figure (after the startup measurement).
pub fn reset_peak() {
    // SAFETY: no arguments.
    unsafe { mlx_sys::mlx_reset_peak_memory() };
}

/// Whether `error` is an allocation failure: MLX's CUDA (`cudaMalloc...
/// out of memory`), Metal (`Resource limit exceeded`, a buffer over the
/// maximum size) and CPU (`Unable to allocate`) allocators, and
/// [`crate::inject`]'s.
pub fn is_out_of_memory(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        let text = cause.to_string().to_ascii_lowercase();
        [
            "out of memory",
            "unable to allocate",
            "resource limit",
            "greater than the maximum allowed buffer size",
        ]
        .iter()
        .any(|p| text.contains(p))
    })
}

/// The stream error for a sequence whose step failed: out of memory is the
/// server being full (503, retry later; MLX's cache is released so the
/// next step has room), anything else an internal error.
pub fn failed_step(error: &anyhow::Error) -> StreamError {
    if is_out_of_memory(error) {
        release_cache();
        StreamError::Overloaded("the server is out of memory for this request; retry later".into())
    } else {
        StreamError::Internal(format!("generation failed: {error}"))
    }
}

/// A readable figure for logs.
pub fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_the_allocators_failures() {
        for msg in [
            "cudaMallocAsync(&data, size, stream) failed: out of memory",
            "[malloc] Unable to allocate 1024 bytes.",
            "[metal::malloc] Resource limit (499000) exceeded.",
        ] {
            let e = anyhow::anyhow!("{msg}").context("batched step");
            assert!(is_out_of_memory(&e), "{msg}");
            assert!(matches!(failed_step(&e), StreamError::Overloaded(_)));
        }
        let e = anyhow::anyhow!("shape mismatch");
        assert!(!is_out_of_memory(&e));
        assert!(matches!(failed_step(&e), StreamError::Internal(_)));
    }

    #[test]
    fn reads_the_device_and_mlx() {
        let total = device_total().expect("the device's size");
        assert!(device_free().is_some_and(|free| free > 0 && free <= total));
        let before = mlx_memory();
        let a = mlx_rs::Array::from_slice(&[1.0f32; 1024], &[1024]);
        mlx_rs::transforms::eval([&a]).unwrap();
        assert!(mlx_memory().active >= before.active);
    }
}
