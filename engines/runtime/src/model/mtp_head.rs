//! Qwen 3.5's multi-token-prediction head, shipped inside the target
//! checkpoint under `mtp.*`: `fc` over the normed embedding of the next
//! token beside the normed hidden state of the position before it, then
//! `mtp_num_hidden_layers` gated full-attention decoder layers (the
//! target's MLP kind: dense or experts) with their own keys and values, and
//! a final norm. The target's embedding and output head are shared.
//!
//! Its weights are in Hugging Face's layout whatever the decoder's: every
//! `mtp.*` norm is stored as an offset from 1 (as mlx-vlm's `qwen3_5_mtp`
//! drafter reads them).

use std::path::Path;

use anyhow::Context;
use mlx_rs::{ops, Array};

use super::{Layer, Model, Residual};
use crate::cache::{KvCache, Offsets};
use crate::layers::{Linear, RmsNorm};
use crate::mask;
use crate::weights::Weights;

const PREFIX: &str = "mtp.";

pub struct MtpHead {
    fc: Linear,
    embedding_norm: RmsNorm,
    hidden_norm: RmsNorm,
    layers: Vec<Layer>,
    norm: RmsNorm,
}

// Immutable after load; device work is serialised by the device lock.
unsafe impl Sync for MtpHead {}
unsafe impl Send for MtpHead {}

impl MtpHead {
    /// The head `dir`'s checkpoint ships for `target`, in the target's
    /// compute dtype; `None` when it ships none (no `mtp.*` tensors). One
    /// that is there but incomplete or misshapen fails, naming the tensor.
    pub fn load(target: &Model, dir: &Path) -> anyhow::Result<Option<Self>> {
        let cfg = &target.config;
        let Some(hybrid) = &cfg.hybrid else {
            return Ok(None);
        };
        let mut w = Weights::from_dir(dir)?;
        let others: Vec<String> = w
            .remaining()
            .filter(|n| !n.starts_with(PREFIX))
            .cloned()
            .collect();
        for name in others {
            w.take_optional(&name);
        }
        if w.remaining().next().is_none() {
            return Ok(None);
        }
        anyhow::ensure!(
            hybrid.mtp_layers > 0,
            "{}: the checkpoint has `mtp.*` tensors but its config sets no mtp_num_hidden_layers",
            dir.display()
        );
        w.cast_floats(target.dtype())?;
        // A decoder layer as the target's full-attention ones, experts
        // wherever the target has them.
        let first_full = hybrid.full_attention.iter().position(|&f| f).unwrap_or(0);
        let mut spec = cfg.layer(first_full as i32);
        spec.linear = false;
        spec.sparse_moe = cfg.sparse_moe.is_some();
        let h = cfg.hidden_size;
        let norm = |w: &mut Weights, name: &str| {
            RmsNorm::load_sized(w, &format!("{PREFIX}{name}"), h, cfg.rms_norm_eps, true)
        };
        let head = (|| -> anyhow::Result<Self> {
            let fc = format!("{PREFIX}fc");
            Ok(Self {
                fc: Linear::load_checked(&mut w, &fc, cfg.quant_for(&fc), h, 2 * h)?,
                embedding_norm: norm(&mut w, "pre_fc_norm_embedding")?,
                hidden_norm: norm(&mut w, "pre_fc_norm_hidden")?,
                layers: (0..hybrid.mtp_layers)
                    .map(|i| Layer::load(&mut w, cfg, &format!("{PREFIX}layers.{i}"), &spec, true))
                    .collect::<anyhow::Result<_>>()?,
                norm: norm(&mut w, "norm")?,
            })
        })()
        .with_context(|| format!("the MTP head of {}", dir.display()))?;
        if let Some(extra) = w.remaining().next() {
            tracing::warn!(weight = %extra, "unused MTP head weight in the checkpoint");
        }
        // Materialised now: a graph left lazy here would belong to this
        // thread's stream, not the worker's.
        mlx_rs::transforms::eval(head.parameters())?;
        Ok(Some(head))
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of keys and values one position takes in the head's cache of
    /// `target`'s checkpoint (0 when its config declares no head).
    pub fn kv_bytes_per_token(target: &Model) -> usize {
        let cfg = &target.config;
        let layers = cfg.hybrid.as_ref().map_or(0, |h| h.mtp_layers) as usize;
        layers * 2 * (cfg.num_kv_heads * cfg.head_dim) as usize * target.activation_bytes()
    }

    /// A cache for one sequence's head layers.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len(), 1)
    }

    /// Runs `tokens` `[1, L]`, each beside `hidden` `[1, L, H]` (the hidden
    /// state of the position before it), at positions `position..`,
    /// appending their keys and values to `cache`. Returns the head's normed
    /// output `[1, L, H]`: the target's output head reads it, and drafting
    /// feeds it back as the next position's hidden state.
    pub fn forward(
        &self,
        target: &Model,
        tokens: &Array,
        hidden: &Array,
        cache: &mut KvCache,
        position: i32,
    ) -> anyhow::Result<Array> {
        let n = tokens.dim(1);
        let embedded = self.embedding_norm.forward(&target.embed(tokens)?)?;
        let hidden = self.hidden_norm.forward(hidden)?;
        let mut h = Residual::Sum(
            self.fc
                .forward(&ops::concatenate(&[embedded, hidden], -1)?)?,
        );
        let mask = mask::build(cache, n, None, super::attention_fused(&self.layers));
        let offsets = Offsets::Scalar(position);
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer
                .forward(h, (1, n), (&mask, None), &offsets, cache, i, None, None)?
                .0;
        }
        cache.advance(n);
        Ok(h.normed(&self.norm)?.1)
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut all = Vec::new();
        self.fc.collect(&mut all);
        self.embedding_norm.collect(&mut all);
        self.hidden_norm.collect(&mut all);
        for l in &self.layers {
            l.collect(&mut all);
        }
        self.norm.collect(&mut all);
        all
    }
}
