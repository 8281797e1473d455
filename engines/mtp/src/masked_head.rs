//! The centroid-masked output head of the smallest Gemma 4 assistants
//! (`use_ordered_embeddings`, weights `masked_embedding.centroids` and
//! `masked_embedding.token_ordering`), as Hugging Face's
//! `Gemma4AssistantMaskedEmbedder` and mlx-vlm's `MaskedEmbedder` compute
//! it: the centroids score the vocabulary's clusters, and only the tokens
//! of the `top_k` best clusters are scored against the tied embeddings.

use anyhow::{ensure, Context};
use mlx_rs::{ops, Array, Dtype};
use runtime::layers::{Embedding, Linear};
use runtime::slices::slice;
use runtime::weights::Weights;

use crate::checkpoint::{AssistantConfig, OrderedEmbeddings};

pub(crate) struct MaskedHead {
    centroids: Linear,
    /// `[num_centroids, vocab / num_centroids]`: each cluster's token ids.
    ordering: Array,
    top_k: i32,
    vocab: i32,
}

impl MaskedHead {
    pub fn load(
        w: &mut Weights,
        cfg: &AssistantConfig,
        o: OrderedEmbeddings,
    ) -> anyhow::Result<Self> {
        let centroids = Linear::load_checked(
            w,
            "masked_embedding.centroids",
            cfg.quantization,
            o.num_centroids,
            cfg.hidden_size,
        )?;
        let name = "masked_embedding.token_ordering";
        let ordering = w.take_shaped(name, &[cfg.vocab_size])?;
        ensure!(
            !ordering.dtype().is_inexact(),
            "tensor `{name}` in {} has dtype {:?}, expected integer token ids",
            w.file_of(name),
            ordering.dtype()
        );
        // Ids index the embeddings unchecked on the device: refuse any
        // outside the vocabulary here.
        let ends =
            ops::stack(&[ordering.min(None)?, ordering.max(None)?], 0)?.as_dtype(Dtype::Int64)?;
        mlx_rs::transforms::eval([&ends])?;
        let (lo, hi) = (ends.as_slice::<i64>()[0], ends.as_slice::<i64>()[1]);
        ensure!(
            lo >= 0 && hi < cfg.vocab_size as i64,
            "tensor `{name}` in {} holds ids from {lo} to {hi}, outside the vocabulary of {}",
            w.file_of(name),
            cfg.vocab_size
        );
        let ordering = ordering
            .as_dtype(Dtype::Int32)?
            .reshape(&[o.num_centroids, -1])
            .with_context(|| format!("tensor `{name}`"))?;
        Ok(Self {
            centroids,
            ordering,
            top_k: o.top_k,
            vocab: cfg.vocab_size,
        })
    }

    /// The greedy token `[B, L]` (int32) and the float32 logits `[B, L, V]`
    /// of the normed hidden states `h` `[B, L, H]`: the selected tokens'
    /// `h . embedding`, every other token the smallest of those minus one,
    /// so that it loses every argmax and sampling draw (the reference's
    /// value). The token is the best selected one, as the reference's
    /// greedy path picks it, without the full logits.
    pub fn forward(&self, embed: &Embedding, h: &Array) -> anyhow::Result<(Array, Array)> {
        let (b, l) = (h.dim(0), h.dim(1));
        let scores = self.centroids.forward(h)?;
        let c = scores.dim(-1);
        let top = ops::argpartition_axis(&scores, c - self.top_k, -1)?;
        let top = slice(&top, &[0, 0, c - self.top_k], &[b, l, c])?;
        // [B, L, top_k * tokens per cluster]
        let ids = self.ordering.take_axis(&top, 0)?.reshape(&[b, l, -1])?;
        let rows = embed.forward(&ids)?;
        let selected = h
            .expand_dims(-2)?
            .matmul(rows.swap_axes(-1, -2)?)?
            .reshape(&[b, l, -1])?;
        let best = ops::indexing::argmax_axis(&selected, -1, true)?;
        let token = ids.take_along_axis(&best, -1)?.reshape(&[b, l])?;
        let mask = selected
            .min(None)?
            .subtract(Array::from_f32(1.0).as_dtype(selected.dtype())?)?;
        let logits = ops::broadcast_to(&mask, &[b, l, self.vocab])?
            .put_along_axis(&ids, &selected, -1)?
            .as_dtype(Dtype::Float32)?;
        Ok((token, logits))
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.centroids.collect(out);
        out.push(&self.ordering);
    }
}
