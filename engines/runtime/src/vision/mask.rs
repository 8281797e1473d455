//! The attention mask of a prompt chunk holding images whose tokens attend
//! to each other bidirectionally (Hugging Face's Gemma 3): a query sees the
//! keys at or before it, and every key of its own image; on sliding-window
//! layers, only keys less than `window` positions back. One sequence, no
//! padding (image requests prefill alone).

use mlx_rs::Array;

use crate::cache::KvCache;
use crate::mask::AttnMask;

/// Mask for `n` new queries appended to `cache` (before the cache grows);
/// `blocks` are the images' absolute `[start, end)` spans.
pub fn with_image_blocks(
    cache: &KvCache,
    n: i32,
    window: Option<i32>,
    blocks: &[(i32, i32)],
) -> AttnMask {
    debug_assert!(cache.batch_size() == 1 && cache.left_padding().iter().all(|&p| p == 0));
    let past = cache.len();
    let total = past + n;
    let block_of = |p: i32| blocks.iter().position(|&(s, e)| s <= p && p < e);
    let mut data = Vec::with_capacity((n * total) as usize);
    for q in 0..n {
        let qpos = past + q;
        let own = block_of(qpos);
        for k in 0..total {
            let same_image = own.is_some() && own == block_of(k);
            let in_window = window.is_none_or(|w| qpos - k < w);
            data.push((k <= qpos || same_image) && in_window);
        }
    }
    AttnMask::Array(Array::from_slice(&data, &[1, 1, n, total]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(mask: AttnMask) -> Vec<Vec<bool>> {
        let AttnMask::Array(a) = mask else {
            panic!("an array mask")
        };
        let total = a.dim(3) as usize;
        a.as_slice::<bool>()
            .chunks(total)
            .map(|r| r.to_vec())
            .collect()
    }

    #[test]
    fn image_tokens_see_their_whole_image() {
        let cache = KvCache::new(1, 1);
        // Positions 1..3 are one image.
        let m = rows(with_image_blocks(&cache, 4, None, &[(1, 3)]));
        assert_eq!(m[0], [true, false, false, false]);
        assert_eq!(m[1], [true, true, true, false]);
        assert_eq!(m[2], [true, true, true, false]);
        assert_eq!(m[3], [true, true, true, true]);
        // A window of 2 cuts what is further back, not the image ahead.
        let m = rows(with_image_blocks(&cache, 4, Some(2), &[(1, 3)]));
        assert_eq!(m[1], [true, true, true, false]);
        assert_eq!(m[3], [false, false, true, true]);
    }
}
