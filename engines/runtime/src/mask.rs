//! Attention masks. Boolean masks (true = attend) so masked scores get the
//! kernel's own negative fill rather than a hand-picked constant.

use std::cell::Cell;

use mlx_rs::Array;

use crate::cache::KvCache;

pub enum AttnMask {
    /// Every query sees every key (single-token decode within the window).
    None,
    /// Lower-right aligned causal mask, computed inside the kernel.
    Causal,
    Array(Array),
    /// Single-token decode on a GPU: row `b` attends to keys
    /// `[starts[b], total)`. One fused attention kernel per row beats the
    /// masked attention, which MLX's CUDA backend runs unfused.
    RowStarts(Vec<i32>),
    /// A few causal queries of one unpadded sequence on a GPU (verifying
    /// drafted tokens): query `i` attends to the first `past + i + 1` keys,
    /// one single-query kernel each. The causal path builds and caches a
    /// cuDNN graph per (queries, keys) shape, so a verify whose context
    /// grows every round would build one per round and wear out MLX CUDA's
    /// SDPA cache.
    CausalRows {
        past: i32,
    },
}

impl AttnMask {
    /// The mask as one boolean array broadcastable to `[B, 1, n, total]`
    /// (`None`: attend everywhere), for attention that is not a fused
    /// kernel (the quantized KV cache's).
    pub fn as_array(&self, n: i32, total: i32) -> anyhow::Result<Option<Array>> {
        let causal = |past: i32| {
            let data: Vec<bool> = (0..n)
                .flat_map(|q| (0..total).map(move |k| k <= past + q))
                .collect();
            Array::from_slice(&data, &[n, total])
        };
        Ok(match self {
            AttnMask::None => None,
            AttnMask::Causal => Some(causal(total - n)),
            AttnMask::CausalRows { past } => Some(causal(*past)),
            AttnMask::Array(m) => Some(m.clone()),
            AttnMask::RowStarts(starts) => {
                let data: Vec<bool> = starts
                    .iter()
                    .flat_map(|&s| (0..total).map(move |k| k >= s))
                    .collect();
                Some(Array::from_slice(
                    &data,
                    &[starts.len() as i32, 1, 1, total],
                ))
            }
        })
    }
}

/// When single-token decode of a padded batch attends row by row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowAttention {
    /// On GPU streams for batches of up to `ROW_ATTENTION_MAX_BATCH`
    /// rows: there one fused kernel per row beats MLX CUDA's unfused masked
    /// attention; past it the per-row launches cost more (measured on an
    /// H100 with a Qwen3-4B shape: faster at 2 and 4 rows, slower at 8+).
    Auto,
    Always,
    Never,
}

pub const ROW_ATTENTION_MAX_BATCH: usize = 4;

/// Most queries verified with [`AttnMask::CausalRows`].
pub const CAUSAL_ROWS_MAX: i32 = 16;

thread_local! {
    static ROW_ATTENTION: Cell<RowAttention> = const { Cell::new(RowAttention::Auto) };
}

/// Overrides the choice on this thread (tests exercise both paths on any
/// device).
pub fn set_row_attention(mode: RowAttention) {
    ROW_ATTENTION.with(|m| m.set(mode));
}

fn row_attention(batch: usize) -> bool {
    match ROW_ATTENTION.with(Cell::get) {
        RowAttention::Always => true,
        RowAttention::Never => false,
        RowAttention::Auto => batch <= ROW_ATTENTION_MAX_BATCH && on_gpu(),
    }
}

/// Mask for `n` new queries appended to `cache` (before the cache grows).
/// `window` limits each query to the last `window` positions (Gemma 3
/// sliding layers).
pub fn build(cache: &KvCache, n: i32, window: Option<i32>) -> AttnMask {
    let past = cache.len();
    let total = past + n;
    let padded = cache.batch_size() > 1 || cache.left_padding().iter().any(|&p| p > 0);
    let window_bites = window.is_some_and(|w| total > w);
    if !padded && !window_bites {
        return match n {
            1 => AttnMask::None,
            _ if past > 0 && n <= CAUSAL_ROWS_MAX && row_attention(1) => {
                AttnMask::CausalRows { past }
            }
            _ => AttnMask::Causal,
        };
    }
    let pads = cache.left_padding();
    if n == 1 && row_attention(pads.len()) {
        let starts = pads
            .iter()
            .map(|&p| p.max(window.map_or(0, |w| total - w)))
            .collect();
        return AttnMask::RowStarts(starts);
    }
    let mut data = Vec::with_capacity(pads.len() * (n * total) as usize);
    for &pad in pads {
        for q in 0..n {
            let qpos = past + q;
            for k in 0..total {
                let causal = k <= qpos;
                // A padding query still sees itself, so no softmax row is
                // empty (an all-masked row would produce NaN that can leak
                // through 0 * NaN in the value product).
                let real = k >= pad || k == qpos;
                let in_window = window.is_none_or(|w| qpos - k < w);
                data.push(causal && real && in_window);
            }
        }
    }
    AttnMask::Array(Array::from_slice(&data, &[pads.len() as i32, 1, n, total]))
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
