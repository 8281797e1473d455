//! The forward pass with some positions' input embeddings replaced: image
//! soft tokens, whose rows come from the vision tower instead of the
//! embedding table. Everything after the embedding is `forward`'s.

use mlx_rs::{ops, Array};

use super::{Logits, Model, Taps};
use crate::cache::KvCache;
use crate::config::Family;
use crate::mask;
use crate::vision::mask as image_mask;

/// Positions of a `[1, L]` chunk whose embeddings are replaced: `mask` is
/// `[1, L, 1]` bool, `rows` is `[1, L, hidden]` (ignored where `mask` is
/// false). `blocks`: absolute `[start, end)` spans of images whose tokens
/// attend to each other bidirectionally (each whole within this chunk or
/// before it); empty for causal attention throughout.
pub struct Replacement {
    pub mask: Array,
    pub rows: Array,
    pub blocks: Vec<(i32, i32)>,
}

impl Model {
    /// `forward` for one sequence whose embeddings at `replace.mask` are
    /// `replace.rows`. The family's embedding scale (Gemma) applies to the
    /// replaced rows too, as in mlx-vlm, whose tower output is divided by
    /// the scale beforehand. Replaced positions read the per-layer input
    /// table (Gemma 4 E2B/E4B) at id 0, as the references do for soft
    /// tokens. Image blocks open both kinds of layer for Gemma 3 (Hugging
    /// Face's mask); Gemma 4 keeps its full-attention layers causal and
    /// opens only the sliding ones (Hugging Face's
    /// `create_masks_for_vision_model`).
    pub fn forward_replacing(
        &self,
        tokens: &Array,
        replace: &Replacement,
        cache: &mut KvCache,
        which: Logits,
    ) -> anyhow::Result<Array> {
        let n = tokens.dim(1);
        let text = self.embed.forward(tokens)?;
        let rows = replace.rows.as_dtype(text.dtype())?;
        let h = self.scale_embeddings(ops::select(&replace.mask, &rows, &text)?)?;
        let blocks = &replace.blocks;
        let global_causal = self.config.family == Family::Gemma4;
        let fused = super::attention_fused(&self.layers);
        let build = |window: Option<i32>| {
            if blocks.is_empty() || (window.is_none() && global_causal) {
                mask::build(cache, n, window, fused)
            } else {
                image_mask::with_image_blocks(cache, n, window, blocks)
            }
        };
        let soft = replace.mask.squeeze_axes(&[2])?;
        let layer_tokens =
            ops::select(&soft, Array::from_int(0).as_dtype(tokens.dtype())?, tokens)?;
        let global_mask = build(None);
        let window_mask = self.config.sliding_window.map(|w| build(Some(w)));
        let taps = Taps::default();
        let masks = (&global_mask, window_mask.as_ref());
        Ok(self
            .run_layers(&layer_tokens, h, masks, cache, which, &taps)?
            .logits)
    }
}
