//! Attention masks. Boolean masks (true = attend) so masked scores get the
//! kernel's own negative fill rather than a hand-picked constant.

use mlx_rs::Array;

use crate::cache::KvCache;

pub enum AttnMask {
    /// Every query sees every key (single-token decode within the window).
    None,
    /// Lower-right aligned causal mask, computed inside the kernel.
    Causal,
    Array(Array),
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
        return if n == 1 { AttnMask::None } else { AttnMask::Causal };
    }
    let pads = cache.left_padding();
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
