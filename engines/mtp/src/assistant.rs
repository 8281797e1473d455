//! The assistant drafter network and its per-sequence state.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use mlx_rs::{fast, ops, Array, Dtype};
use runtime::cache::Offsets;
use runtime::layers::{Embedding, GatedMlp, Linear, RmsNorm};
use runtime::model::{Tapped, Taps};
use runtime::slices::slice;
use runtime::weights::Weights;
use runtime::{KvCache, Model};
use speculative::{DraftSource, DraftState, Proposal};

use crate::checkpoint::AssistantConfig;
use crate::masked_head::MaskedHead;

struct Layer {
    q: Linear,
    o: Linear,
    q_norm: RmsNorm,
    mlp: GatedMlp,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ff_norm: RmsNorm,
    post_ff_norm: RmsNorm,
    scalar: Array,
    /// The target layer whose cache this layer reads.
    target_layer: usize,
    /// Its sliding window (the drafter's declared one, else the target
    /// layer's), `None` for a full layer.
    window: Option<i32>,
    head_dim: i32,
}

struct Net {
    cfg: AssistantConfig,
    pre_projection: Linear,
    post_projection: Linear,
    embed: Embedding,
    /// The centroid-masked head over `embed`, where the checkpoint asks for
    /// it (`use_ordered_embeddings`); else `embed` is the dense tied head.
    masked: Option<MaskedHead>,
    norm: RmsNorm,
    layers: Vec<Layer>,
    /// `sqrt(backbone_hidden_size)`, applied to the target's embeddings.
    embed_scale: f32,
}

// Immutable after load; device work is serialised by the device lock.
unsafe impl Sync for Net {}
unsafe impl Send for Net {}

/// A loaded assistant bound to its target and its draft length.
#[derive(Clone)]
pub struct Assistant {
    net: Arc<Net>,
    draft_tokens: usize,
}

/// The target layers an assistant reads: the last sliding-window layer for
/// its sliding layers and the last global layer for its full ones, of the
/// layers that hold keys and values of their own (Gemma 4's KV-shared
/// layers hold none).
fn bind(target: &Model, sliding: bool) -> usize {
    let n = target.num_layers();
    let last = |want_window: bool| {
        (0..n).rev().find(|&i| {
            target
                .attention_info(i)
                .is_some_and(|info| info.owns_kv && info.window.is_some() == want_window)
        })
    };
    if sliding {
        last(true).or(last(false)).unwrap_or(n - 1)
    } else {
        last(false).unwrap_or(n - 1)
    }
}

impl Assistant {
    pub fn load(dir: &Path, target: &Model, draft_tokens: usize) -> anyhow::Result<Self> {
        let cfg = AssistantConfig::load(dir, &target.config)?;
        let mut w = Weights::from_dir(dir)?;
        // The drafter computes in the target's compute dtype.
        w.cast_floats(target.dtype())?;
        let q = cfg.quantization;
        let eps = cfg.rms_norm_eps;
        let net = (|| -> anyhow::Result<Net> {
            let layers = cfg
                .sliding
                .iter()
                .enumerate()
                .map(|(i, &sliding)| -> anyhow::Result<Layer> {
                    let p = format!("model.layers.{i}");
                    let norm = |w: &mut Weights, n: &str| {
                        RmsNorm::load(w, &format!("{p}.{n}"), eps, false)
                    };
                    let target_layer = bind(target, sliding);
                    // Its queries meet the target's cached keys head for head.
                    let info = target
                        .attention_info(target_layer)
                        .context("the target has no attention layer to read")?;
                    let head_dim = cfg.layer_head_dim(sliding);
                    anyhow::ensure!(
                        head_dim == info.head_dim,
                        "layer {i}: the drafter's head size ({head_dim}) differs from target layer {target_layer}'s ({})",
                        info.head_dim
                    );
                    anyhow::ensure!(
                        cfg.num_heads % info.kv_heads == 0,
                        "layer {i}: the drafter's {} query heads do not group over target layer {target_layer}'s {} KV heads",
                        cfg.num_heads,
                        info.kv_heads
                    );
                    Ok(Layer {
                        q: Linear::load(&mut w, &format!("{p}.self_attn.q_proj"), q)?,
                        o: Linear::load(&mut w, &format!("{p}.self_attn.o_proj"), q)?,
                        q_norm: norm(&mut w, "self_attn.q_norm")?,
                        mlp: GatedMlp::load(&mut w, &format!("{p}.mlp"), q, true)?,
                        input_norm: norm(&mut w, "input_layernorm")?,
                        post_attn_norm: norm(&mut w, "post_attention_layernorm")?,
                        pre_ff_norm: norm(&mut w, "pre_feedforward_layernorm")?,
                        post_ff_norm: norm(&mut w, "post_feedforward_layernorm")?,
                        scalar: w.take(&format!("{p}.layer_scalar"))?,
                        target_layer,
                        window: match sliding {
                            true => cfg.sliding_window.or(info.window),
                            false => None,
                        },
                        head_dim,
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            Ok(Net {
                pre_projection: Linear::load(&mut w, "pre_projection", q)?,
                post_projection: Linear::load(&mut w, "post_projection", q)?,
                embed: Embedding::load(&mut w, "model.embed_tokens", q)?,
                masked: cfg
                    .ordered_embeddings
                    .map(|o| MaskedHead::load(&mut w, &cfg, o))
                    .transpose()?,
                norm: RmsNorm::load(&mut w, "model.norm", eps, false)?,
                layers,
                embed_scale: (cfg.backbone_hidden_size as f32).sqrt(),
                cfg: cfg.clone(),
            })
        })()
        .with_context(|| format!("drafter checkpoint {}", dir.display()))?;
        // Materialise now: a graph left lazy here would belong to this
        // thread's stream, not the worker's.
        net.eval()?;
        if let Some(extra) = w.remaining().next() {
            tracing::warn!(weight = %extra, "unused weight in the drafter checkpoint");
        }
        Ok(Self {
            net: Arc::new(net),
            draft_tokens: draft_tokens.max(1),
        })
    }
}

impl Assistant {
    /// What [`DraftState::propose`] drafts, with each step's float32
    /// logits, from an explicit target hidden state (the oracle test's
    /// hook: the engine keeps that state itself).
    pub fn draft_with_logits(
        &self,
        target: &Model,
        cache: &KvCache,
        hidden: &Array,
        last: u32,
        k: usize,
    ) -> anyhow::Result<(Array, Vec<Array>)> {
        self.net.draft(target, cache, hidden, last, k)
    }
}

impl DraftSource for Assistant {
    fn taps(&self) -> Taps {
        Taps {
            layers: Vec::new(),
            final_hidden: true,
        }
    }

    fn max_draft(&self) -> usize {
        self.draft_tokens
    }

    fn start(&self) -> Box<dyn DraftState> {
        Box::new(State {
            net: self.net.clone(),
            hidden: None,
        })
    }
}

/// The target's final hidden state at the newest token's predecessor (the
/// position whose logits chose the newest token).
struct State {
    net: Arc<Net>,
    hidden: Option<Array>,
}

impl DraftState for State {
    fn observe(&mut self, _: &Model, out: &Tapped, rows: Range<i32>) -> anyhow::Result<()> {
        let h = out
            .final_hidden
            .as_ref()
            .context("the target forward returned no final hidden state")?;
        // Prefill returns only the last position; a verify returns them all.
        let row = if h.dim(1) == 1 { 0 } else { rows.end - 1 };
        self.hidden = Some(slice(h, &[0, row, 0], &[1, row + 1, h.dim(2)])?);
        Ok(())
    }

    fn propose(
        &mut self,
        target: &Model,
        cache: &KvCache,
        history: &[u32],
        k: usize,
    ) -> anyhow::Result<Proposal> {
        let hidden = self.hidden.clone().context("no target hidden state yet")?;
        let last = *history.last().context("empty history")?;
        let (drafts, _) = self.net.draft(target, cache, &hidden, last, k)?;
        Ok(Proposal::Lazy(drafts))
    }
}

impl Net {
    /// k drafts `[1, k]` after `last`, from the target's final normed
    /// hidden state `hidden` `[1, 1, backbone]` at the last cached
    /// position, with each step's float32 logits `[1, 1, V]`.
    fn draft(
        &self,
        target: &Model,
        cache: &KvCache,
        hidden: &Array,
        last: u32,
        k: usize,
    ) -> anyhow::Result<(Array, Vec<Array>)> {
        let net = self;
        let mut hidden = hidden.clone();
        // All draft queries sit at the last cached position (the token whose
        // hidden state the drafter reads), as Hugging Face's and mlx-vlm's
        // assistants place them; the newest token is not in the cache yet.
        let position = cache.len() - 1;
        // Each layer's view of the target cache, the same for all k steps: a
        // sliding layer sees what the target's own window would at that
        // position, the last `window` keys.
        let views = net
            .layers
            .iter()
            .map(|l| -> anyhow::Result<(Array, Array)> {
                let (k, v) = cache
                    .layer_kv(l.target_layer)?
                    .context("the target cache is empty")?;
                Ok(match l.window {
                    Some(w) if k.dim(2) > w => {
                        let s = k.shape().to_vec();
                        let from = s[2] - w;
                        (
                            slice(&k, &[0, 0, from, 0], &[s[0], s[1], s[2], s[3]])?,
                            slice(&v, &[0, 0, from, 0], &[s[0], s[1], s[2], s[3]])?,
                        )
                    }
                    _ => (k, v),
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut token = Array::from_slice(&[last as i32], &[1, 1]);
        let mut drafts = Vec::with_capacity(k);
        let mut all_logits = Vec::with_capacity(k);
        for _ in 0..k {
            let x = target.embed_unscaled(&token)?;
            let x = x.multiply(Array::from_f32(net.embed_scale).as_dtype(x.dtype())?)?;
            let xh = ops::concatenate(&[x, hidden.as_dtype(net.dtype())?], -1)?;
            let mut h = net.pre_projection.forward(&xh)?;
            for (layer, (keys, values)) in net.layers.iter().zip(&views) {
                h = layer.forward(net, target, &h, keys, values, position)?;
            }
            let h = net.norm.forward(&h)?;
            let (next, logits) = match &net.masked {
                Some(m) => m.forward(&net.embed, &h)?,
                None => {
                    let logits = net.embed.as_linear(&h)?.as_dtype(Dtype::Float32)?;
                    let next = ops::indexing::argmax_axis(&logits, -1, None)?;
                    (next, logits)
                }
            };
            hidden = net.post_projection.forward(&h)?;
            token = next.reshape(&[1, 1])?.as_dtype(Dtype::Int32)?;
            drafts.push(token.clone());
            all_logits.push(logits);
        }
        Ok((ops::concatenate(&drafts, 1)?, all_logits))
    }

    fn dtype(&self) -> Dtype {
        self.embed.dtype()
    }

    fn eval(&self) -> anyhow::Result<()> {
        let mut all = Vec::new();
        self.pre_projection.collect(&mut all);
        self.post_projection.collect(&mut all);
        self.embed.collect(&mut all);
        if let Some(m) = &self.masked {
            m.collect(&mut all);
        }
        self.norm.collect(&mut all);
        for l in &self.layers {
            l.q.collect(&mut all);
            l.o.collect(&mut all);
            l.mlp.collect(&mut all);
            for n in [
                &l.q_norm,
                &l.input_norm,
                &l.post_attn_norm,
                &l.pre_ff_norm,
                &l.post_ff_norm,
            ] {
                n.collect(&mut all);
            }
            all.push(&l.scalar);
        }
        mlx_rs::transforms::eval(all)?;
        Ok(())
    }
}

impl Layer {
    fn forward(
        &self,
        net: &Net,
        target: &Model,
        x: &Array,
        keys: &Array,
        values: &Array,
        position: i32,
    ) -> anyhow::Result<Array> {
        let cfg = &net.cfg;
        let (b, l) = (x.dim(0), x.dim(1));
        let h = self.input_norm.forward(x)?;
        let q = self
            .q_norm
            .forward(
                &self
                    .q
                    .forward(&h)?
                    .reshape(&[b, l, cfg.num_heads, self.head_dim])?,
            )?
            .transpose_axes(&[0, 2, 1, 3])?;
        // Queries rotate like the target layer's keys they meet.
        let q = target
            .attention_info(self.target_layer)
            .expect("bound to an attention layer at load")
            .rope
            .forward(&q, &Offsets::Scalar(position))?;
        let att = fast::scaled_dot_product_attention(
            &q,
            &keys.as_dtype(q.dtype())?,
            &values.as_dtype(q.dtype())?,
            // Gemma 4 attends unscaled: its queries and keys are normed.
            1.0,
            None,
            None,
        )?;
        let att = self
            .o
            .forward(&att.transpose_axes(&[0, 2, 1, 3])?.reshape(&[
                b,
                l,
                cfg.num_heads * self.head_dim,
            ])?)?;
        let h = x.add(&self.post_attn_norm.forward(&att)?)?;
        let r = self.mlp.forward(&self.pre_ff_norm.forward(&h)?)?;
        let h = h.add(&self.post_ff_norm.forward(&r)?)?;
        Ok(h.multiply(&self.scalar)?)
    }
}
