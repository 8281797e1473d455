//! Images in the prompt (Gemma 3 and Gemma 4 vision): the towers that turn
//! pixels into soft-token embeddings, and the helpers engines use to put
//! those embeddings into a prompt chunk's input.

pub mod config;
pub mod gemma4;
pub mod mask;
pub mod tower;

use engine_core::ImageInput;
use mlx_rs::Array;

pub use config::{Preprocess, Resize, TowerKind, VisionConfig};
pub use tower::VisionTower;

use crate::model::Replacement;

/// The replaced embeddings of prompt positions `[start, start + len)`, or
/// `None` when no image overlaps them (plain token forward then).
pub fn replacement(images: &[ImageInput], start: usize, len: usize) -> Option<Replacement> {
    let end = start + len;
    let overlapping: Vec<&ImageInput> = images
        .iter()
        .filter(|im| (im.start as usize) < end && im.end() as usize > start)
        .collect();
    let width = overlapping.first()?.width as usize;
    let blocks = overlapping
        .iter()
        .filter(|im| im.bidirectional)
        .map(|im| (im.start as i32, im.end() as i32))
        .collect();
    let mut mask = vec![false; len];
    let mut rows = vec![0f32; len * width];
    for im in overlapping {
        let from = (im.start as usize).max(start);
        let to = (im.end() as usize).min(end);
        for pos in from..to {
            let row = pos - im.start as usize;
            let at = pos - start;
            mask[at] = true;
            rows[at * width..(at + 1) * width]
                .copy_from_slice(&im.embeddings[row * width..(row + 1) * width]);
        }
    }
    Some(Replacement {
        mask: Array::from_slice(&mask, &[1, len as i32, 1]),
        rows: Array::from_slice(&rows, &[1, len as i32, width as i32]),
        blocks,
    })
}

/// Where a prefill chunk `[start, proposed)` must end so that it does not
/// cut an image whose tokens attend bidirectionally: past the end of such
/// an image, never before `proposed`.
pub fn chunk_end(images: &[ImageInput], start: usize, proposed: usize) -> usize {
    images
        .iter()
        .filter(|im| {
            im.bidirectional && (im.start as usize) < proposed && im.end() as usize > proposed
        })
        .map(|im| im.end() as usize)
        .fold(proposed, usize::max)
        .max(start)
}

/// Runs of `image_token` in `prompt`: `(start, length)` of every image's
/// soft tokens, in order.
pub fn image_spans(prompt: &[u32], image_token: u32) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut i = 0;
    while i < prompt.len() {
        if prompt[i] == image_token {
            let start = i;
            while i < prompt.len() && prompt[i] == image_token {
                i += 1;
            }
            spans.push((start, i - start));
        } else {
            i += 1;
        }
    }
    spans
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn image(start: u32, tokens: u32, base: f32) -> ImageInput {
        let width = 2;
        ImageInput {
            start,
            tokens,
            width,
            embeddings: Arc::new((0..tokens * width).map(|i| base + i as f32).collect()),
            bidirectional: false,
        }
    }

    #[test]
    fn spans_are_runs_of_the_image_token() {
        assert_eq!(image_spans(&[1, 9, 9, 2, 9, 9, 9], 9), vec![(1, 2), (4, 3)]);
        assert!(image_spans(&[1, 2, 3], 9).is_empty());
    }

    #[test]
    fn chunks_end_after_bidirectional_images() {
        let mut images = [image(2, 3, 0.0), image(7, 2, 0.0)];
        assert_eq!(chunk_end(&images, 0, 3), 3);
        images[0].bidirectional = true;
        assert_eq!(chunk_end(&images, 0, 3), 5);
        assert_eq!(chunk_end(&images, 0, 5), 5);
        assert_eq!(chunk_end(&images, 3, 8), 8);
        images[1].bidirectional = true;
        assert_eq!(chunk_end(&images, 3, 8), 9);
    }

    #[test]
    fn replacement_covers_only_the_chunk() {
        let images = [image(2, 3, 100.0), image(7, 2, 200.0)];
        assert!(replacement(&images, 0, 2).is_none());
        // Positions 3..8 cut the first image after its first row and the
        // second before its last.
        let r = replacement(&images, 3, 5).unwrap();
        assert_eq!(r.mask.as_slice::<bool>(), &[true, true, false, false, true]);
        let rows = r.rows.as_slice::<f32>();
        assert_eq!(&rows[0..4], &[102.0, 103.0, 104.0, 105.0]);
        assert_eq!(&rows[8..10], &[200.0, 201.0]);
    }
}
