//! Attention masks. Boolean masks (true = attend) so masked scores get the
//! kernel's own negative fill rather than a hand-picked constant.

use std::cell::Cell;

use mlx_rs::Array;

use crate::cache::KvCache;
use crate::cpu_fused::KeysSeen;

pub enum AttnMask {
    /// Every query sees every key (single-token decode within the window).
    None,
    /// Lower-right aligned causal mask, computed inside the kernel.
    Causal,
    Array(Array),
    /// Queries over a left-padded batch, or a block over a grown sequence
    /// (a verify, a prefill chunk after a cached prefix), as many as
    /// [`crate::ragged::takes`]: [`ragged_mask`]'s rule, run by one CUDA
    /// kernel on a GPU ([`crate::ragged`]) and as that mask elsewhere.
    Ragged(Ragged),
}

pub struct Ragged {
    /// Row `b`'s first real key column (its left padding).
    pub starts: Vec<i32>,
    pub window: Option<i32>,
    /// `starts` and `window` as the kernel reads them.
    pub meta: Array,
    /// Whether the kernel runs it (on a GPU stream); else the mask does.
    pub kernel: bool,
}

impl AttnMask {
    /// The mask as one boolean array broadcastable to `[B, 1, n, total]`
    /// (`None`: attend everywhere), for attention that is not a fused
    /// kernel (the quantized KV cache's).
    pub fn as_array(&self, n: i32, total: i32) -> anyhow::Result<Option<Array>> {
        Ok(match self {
            AttnMask::None => None,
            AttnMask::Causal => Some(ragged_mask(&[0], n, total, None)),
            AttnMask::Array(m) => Some(m.clone()),
            AttnMask::Ragged(r) => Some(ragged_mask(&r.starts, n, total, r.window)),
        })
    }

    /// The keys each of `n` queries over `total` columns sees, for the
    /// CPU's attention node ([`crate::cpu_fused::attention`]); `None` for
    /// the GPU kernel's masks and masks that are not boolean.
    pub fn keys_seen(&self, n: i32, total: i32) -> Option<KeysSeen> {
        Some(match self {
            AttnMask::None => KeysSeen::All,
            AttnMask::Causal => KeysSeen::Causal,
            AttnMask::Array(m) if m.dtype() == mlx_rs::Dtype::Bool => KeysSeen::Mask(m.clone()),
            AttnMask::Array(_) => return None,
            AttnMask::Ragged(r) if r.kernel => return None,
            AttnMask::Ragged(r) => KeysSeen::Mask(ragged_mask(&r.starts, n, total, r.window)),
        })
    }
}

/// Which attention a few queries over a padded batch (or a verify) get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RaggedAttention {
    /// The kernel on GPU streams, the mask array elsewhere.
    Auto,
    /// [`AttnMask::Ragged`] on any device (tests exercise it on the CPU,
    /// where its reference path runs).
    Always,
    /// Mask arrays and MLX's causal attention only.
    Never,
}

thread_local! {
    static RAGGED: Cell<RaggedAttention> = const { Cell::new(RaggedAttention::Auto) };
}

/// Overrides the choice on this thread.
pub fn set_ragged_attention(mode: RaggedAttention) {
    RAGGED.with(|m| m.set(mode));
}

/// `Some(kernel?)` when `n` queries a row over `total` columns of `rows`
/// rows attend as [`AttnMask::Ragged`].
fn ragged(rows: i32, n: i32, total: i32, gpu: bool) -> Option<bool> {
    if !crate::ragged::takes(rows, n, total) {
        return None;
    }
    match RAGGED.with(Cell::get) {
        RaggedAttention::Never => None,
        RaggedAttention::Always => Some(gpu),
        RaggedAttention::Auto => gpu.then_some(true),
    }
}

/// Mask for `n` new queries appended to `cache` (before the cache grows).
/// `window` limits each query to the last `window` positions (Gemma 3
/// sliding layers). `fused`: whether MLX fuses attention for the layers'
/// head widths ([`crate::ragged::mlx_fuses`]); where it does not, a GPU
/// gives even a plain sequence's step to the ragged kernel.
pub fn build(cache: &KvCache, n: i32, window: Option<i32>, fused: bool) -> AttnMask {
    build_on(cache, n, window, fused, on_gpu())
}

/// [`build`] for a GPU (`gpu`) or the CPU.
fn build_on(cache: &KvCache, n: i32, window: Option<i32>, fused: bool, gpu: bool) -> AttnMask {
    let past = cache.len();
    let total = past + n;
    let pads = cache.left_padding();
    let padded = cache.batch_size() > 1 || pads.iter().any(|&p| p > 0);
    let window_bites = window.is_some_and(|w| total > w);
    // One unpadded sequence within its window: MLX's own kernels, except
    // for a verify's block (a causal block over a grown context), a paged
    // cache on a GPU, whose blocks only the ragged kernel reads in place
    // (MLX's would read a gathered copy, four more nodes a layer), and
    // heads MLX does not fuse.
    let plain = !padded && !window_bites;
    // MLX's own mask for it: none for one query, causal (aligned to the
    // last key) for several.
    let mlx_plain = || match n {
        1 => AttnMask::None,
        _ => AttnMask::Causal,
    };
    let kernel_first = gpu && (!fused || cache.page_pool().is_some());
    if plain && (n == 1 || past == 0) && !kernel_first {
        return mlx_plain();
    }
    match ragged(cache.batch_size() as i32, n, total, gpu) {
        Some(kernel) => AttnMask::Ragged(Ragged {
            meta: crate::ragged::meta(pads, window, total),
            starts: pads.to_vec(),
            window,
            kernel,
        }),
        None if plain => mlx_plain(),
        None => AttnMask::Array(ragged_mask(pads, n, total, window)),
    }
}

/// The ragged rule, `[B, 1, n, total]` (true = attend): query `q` of row
/// `b` sits at column `total - n + q` and sees keys from its row's start
/// up to itself, within the last `window`. A padding query (before its
/// row's start) still sees itself, so no softmax row is empty (an
/// all-masked row would produce NaN that can leak through 0 * NaN in the
/// value product).
pub fn ragged_mask(starts: &[i32], n: i32, total: i32, window: Option<i32>) -> Array {
    let past = total - n;
    let mut data = Vec::with_capacity(starts.len() * (n * total) as usize);
    for &start in starts {
        for q in 0..n {
            let qpos = past + q;
            for k in 0..total {
                let causal = k <= qpos;
                let real = k >= start || k == qpos;
                let in_window = window.is_none_or(|w| qpos - k < w);
                data.push(causal && real && in_window);
            }
        }
    }
    Array::from_slice(&data, &[starts.len() as i32, 1, n, total])
}

/// Whether ops issued now run on a GPU stream.
pub fn on_gpu() -> bool {
    let stream = mlx_rs::Stream::thread_local_or_default();
    unsafe {
        let mut device = mlx_sys::mlx_device_new();
        let mut kind = mlx_sys::mlx_device_type__MLX_CPU;
        let gpu = mlx_sys::mlx_stream_get_device(&mut device, stream.as_ptr()) == 0
            && mlx_sys::mlx_device_get_type(&mut kind, device) == 0
            && kind == mlx_sys::mlx_device_type__MLX_GPU;
        mlx_sys::mlx_device_free(device);
        gpu
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_row(len: i32) -> KvCache {
        let mut cache = KvCache::with_formats(vec![None], vec![0]);
        cache.advance(len);
        cache
    }

    fn kernel(mask: &AttnMask) -> Option<bool> {
        match mask {
            AttnMask::Ragged(r) => Some(r.kernel),
            _ => None,
        }
    }

    #[test]
    fn a_gpu_gives_plain_steps_of_heads_mlx_does_not_fuse_to_the_kernel() {
        let cache = one_row(40);
        // Heads MLX fuses: its own kernels, on a GPU as on the CPU.
        assert!(matches!(
            build_on(&cache, 1, None, true, true),
            AttnMask::None
        ));
        // Heads it does not: a decode step and a verify go to the kernel.
        assert_eq!(kernel(&build_on(&cache, 1, None, false, true)), Some(true));
        assert_eq!(kernel(&build_on(&cache, 8, None, false, true)), Some(true));
        // The CPU has no kernel.
        assert!(matches!(
            build_on(&cache, 1, None, false, false),
            AttnMask::None
        ));
        // A short prefill goes to the kernel, one past its budget to MLX.
        let fresh = one_row(0);
        assert_eq!(
            kernel(&build_on(&fresh, 100, None, false, true)),
            Some(true)
        );
        assert!(matches!(
            build_on(&fresh, 300, None, false, true),
            AttnMask::Causal
        ));
        assert!(matches!(
            build_on(&fresh, 100, None, true, true),
            AttnMask::Causal
        ));
    }
}
