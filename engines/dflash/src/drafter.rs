//! The DFlash drafter network and its per-sequence state.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use mlx_rs::fast;
use mlx_rs::{ops, Array, Dtype};
use runtime::cache::Offsets;
use runtime::layers::{GatedMlp, Linear, RmsNorm, Rope};
use runtime::model::{Tapped, Taps};
use runtime::slices::slice;
use runtime::weights::Weights;
use runtime::{KvCache, Model};
use speculative::{DraftSource, DraftState, Proposal};

use crate::checkpoint::DflashConfig;

type R<T> = Result<T, mlx_rs::error::Exception>;

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
}

struct Layer {
    attn: Attention,
    mlp: GatedMlp,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
}

struct Net {
    cfg: DflashConfig,
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<Layer>,
    norm: RmsNorm,
    rope: Rope,
}

// Weights are immutable after load and device work is serialised by the
// shared device lock (as for the target model).
unsafe impl Sync for Net {}
unsafe impl Send for Net {}

/// A loaded DFlash drafter bound to its target.
#[derive(Clone)]
pub struct Dflash {
    net: Arc<Net>,
    max_draft: usize,
}

impl Dflash {
    /// Loads the checkpoint at `dir`, checked against `target`; drafts
    /// `block_size - 1` tokens per round, or `draft_tokens` when fewer.
    pub fn load(dir: &Path, target: &Model, draft_tokens: Option<usize>) -> anyhow::Result<Self> {
        let cfg = DflashConfig::load(dir, &target.config)?;
        let mut w = Weights::from_dir(dir)?;
        // The drafter computes in the target's compute dtype.
        w.cast_floats(target.dtype())?;
        let q = cfg.quantization;
        let eps = cfg.rms_norm_eps;
        let load = |w: &mut Weights| -> anyhow::Result<Net> {
            let layers = (0..cfg.num_layers)
                .map(|i| -> anyhow::Result<Layer> {
                    let p = format!("layers.{i}");
                    let a = format!("{p}.self_attn");
                    Ok(Layer {
                        attn: Attention {
                            q: Linear::load(w, &format!("{a}.q_proj"), q)?,
                            k: Linear::load(w, &format!("{a}.k_proj"), q)?,
                            v: Linear::load(w, &format!("{a}.v_proj"), q)?,
                            o: Linear::load(w, &format!("{a}.o_proj"), q)?,
                            q_norm: RmsNorm::load(w, &format!("{a}.q_norm"), eps, false)?,
                            k_norm: RmsNorm::load(w, &format!("{a}.k_norm"), eps, false)?,
                        },
                        mlp: GatedMlp::load(w, &format!("{p}.mlp"), q, false)?,
                        input_norm: RmsNorm::load(w, &format!("{p}.input_layernorm"), eps, false)?,
                        post_attn_norm: RmsNorm::load(
                            w,
                            &format!("{p}.post_attention_layernorm"),
                            eps,
                            false,
                        )?,
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            Ok(Net {
                fc: Linear::load(w, "fc", q)?,
                hidden_norm: RmsNorm::load(w, "hidden_norm", eps, false)?,
                norm: RmsNorm::load(w, "norm", eps, false)?,
                rope: Rope::plain(cfg.head_dim, cfg.rope_theta),
                layers,
                cfg: cfg.clone(),
            })
        };
        let net = load(&mut w).with_context(|| format!("drafter checkpoint {}", dir.display()))?;
        // Materialise now: a graph left lazy here would belong to this
        // thread's stream, not the worker's.
        net.eval()?;
        if let Some(extra) = w.remaining().next() {
            tracing::warn!(weight = %extra, "unused weight in the drafter checkpoint");
        }
        Ok(Self {
            max_draft: (cfg.block_size - 1).min(draft_tokens.unwrap_or(usize::MAX)),
            net: Arc::new(net),
        })
    }

    pub fn config(&self) -> &DflashConfig {
        &self.net.cfg
    }

    /// A sequence's draft state; with `trace` it keeps each round's
    /// drafter logits for [`State::last_logits`] (the oracle test's hook).
    pub fn state(&self, trace: bool) -> State {
        State {
            net: self.net.clone(),
            cache: KvCache::new(self.net.layers.len(), 1),
            windows: vec![None; self.net.layers.len()],
            pending: Vec::new(),
            trace: trace.then_some(None),
        }
    }
}

impl Net {
    fn eval(&self) -> anyhow::Result<()> {
        let mut all = Vec::new();
        self.fc.collect(&mut all);
        self.hidden_norm.collect(&mut all);
        self.norm.collect(&mut all);
        for l in &self.layers {
            let a = &l.attn;
            for lin in [&a.q, &a.k, &a.v, &a.o] {
                lin.collect(&mut all);
            }
            for n in [&a.q_norm, &a.k_norm, &l.input_norm, &l.post_attn_norm] {
                n.collect(&mut all);
            }
            l.mlp.collect(&mut all);
        }
        mlx_rs::transforms::eval(all)?;
        Ok(())
    }
}

impl DraftSource for Dflash {
    fn taps(&self) -> Taps {
        Taps {
            layers: self.net.cfg.target_layer_ids.clone(),
            final_hidden: false,
        }
    }

    fn max_draft(&self) -> usize {
        self.max_draft
    }

    fn start(&self) -> Box<dyn DraftState> {
        Box::new(self.state(false))
    }
}

/// The drafter's cache holds keys and values of the projected target
/// context (its full-attention layers'; `windows` holds the sliding
/// layers' recent ones, see [`Attention::window_context`]); `pending` is
/// committed context not yet fed to it. The cache's length counts every
/// context position, which is where the next ones are rotated to.
pub struct State {
    net: Arc<Net>,
    cache: KvCache,
    windows: Vec<Option<(Array, Array)>>,
    pending: Vec<Array>,
    /// The last round's logits, when traced.
    trace: Option<Option<Array>>,
}

impl State {
    /// The last round's drafter logits `[1, k, V]`, when traced.
    pub fn last_logits(&self) -> Option<&Array> {
        self.trace.as_ref().and_then(Option::as_ref)
    }
}

impl DraftState for State {
    fn observe(&mut self, _: &Model, out: &Tapped, rows: Range<i32>) -> anyhow::Result<()> {
        let hidden = out
            .layers
            .as_ref()
            .context("the target forward returned no tapped layers")?;
        let d = hidden.dim(2);
        self.pending
            .push(slice(hidden, &[0, rows.start, 0], &[1, rows.end, d])?);
        Ok(())
    }

    fn propose(
        &mut self,
        target: &Model,
        _: &KvCache,
        history: &[u32],
        k: usize,
    ) -> anyhow::Result<Proposal> {
        let net = &*self.net;
        let last = *history.last().context("empty history")?;
        let mut block = vec![last as i32];
        block.extend(std::iter::repeat_n(net.cfg.mask_token_id as i32, k));
        let block = Array::from_slice(&block, &[1, k as i32 + 1]);
        let ctx = match self.pending.len() {
            0 => None,
            1 => Some(self.pending.remove(0)),
            _ => Some(ops::concatenate(&std::mem::take(&mut self.pending), 1)?),
        };
        let ctx = match ctx {
            Some(c) => Some(net.hidden_norm.forward(&net.fc.forward(&c)?)?),
            None => None,
        };
        // Context positions continue the drafter cache; the block starts
        // right after them, at the newest token's position.
        let ctx_start = self.cache.len();
        let block_start = ctx_start + ctx.as_ref().map_or(0, |c| c.dim(1));
        let mut x = target.embed(&block)?;
        for (i, layer) in net.layers.iter().enumerate() {
            let ctx = LayerContext {
                new: ctx.as_ref(),
                cache: &mut self.cache,
                window: &mut self.windows[i],
                idx: i,
                start: ctx_start,
            };
            x = layer.forward(net, &x, ctx, block_start)?;
        }
        if let Some(c) = &ctx {
            self.cache.advance(c.dim(1));
        }
        let h = net
            .norm
            .forward(&slice(&x, &[0, 1, 0], &[1, k as i32 + 1, x.dim(2)])?)?;
        let logits = target.logits(&h)?;
        let drafts = ops::indexing::argmax_axis(&logits, -1, None)?.as_dtype(Dtype::Int32)?;
        if let Some(trace) = &mut self.trace {
            *trace = Some(logits);
        }
        Ok(Proposal::Lazy(drafts))
    }
}

/// One layer's view of the drafter's context: the positions new this
/// round (projected target hidden states, from position `start`) and what
/// it kept of earlier ones.
struct LayerContext<'a> {
    new: Option<&'a Array>,
    cache: &'a mut KvCache,
    window: &'a mut Option<(Array, Array)>,
    idx: usize,
    start: i32,
}

impl Layer {
    fn forward(
        &self,
        net: &Net,
        x: &Array,
        ctx: LayerContext,
        block_start: i32,
    ) -> anyhow::Result<Array> {
        let h = self.input_norm.forward(x)?;
        let h = x.add(&self.attn.forward(net, &h, ctx, block_start)?)?;
        let r = self.mlp.forward(&self.post_attn_norm.forward(&h)?)?;
        Ok(h.add(&r)?)
    }
}

impl Attention {
    fn forward(
        &self,
        net: &Net,
        x: &Array,
        ctx: LayerContext,
        block_start: i32,
    ) -> anyhow::Result<Array> {
        let cfg = &net.cfg;
        let (b, l) = (x.dim(0), x.dim(1));
        let q = net.rope.forward(
            &self.heads(cfg, self.q.forward(x)?, cfg.num_heads, Some(&self.q_norm))?,
            &Offsets::Scalar(block_start),
        )?;
        let (k_block, v_block) = self.keys_values(net, x, block_start)?;
        let context = match cfg.windows[ctx.idx] {
            Some(w) => Self::window_context(self, net, ctx, w)?,
            None => match ctx.new {
                Some(c) => {
                    let (k, v) = self.keys_values(net, c, ctx.start)?;
                    Some(ctx.cache.update(ctx.idx, k, v)?.dense()?)
                }
                None => ctx.cache.layer_kv(ctx.idx)?,
            },
        };
        let (keys, values) = match context {
            Some((k, v)) => (
                ops::concatenate(&[k, k_block], 2)?,
                ops::concatenate(&[v, v_block], 2)?,
            ),
            None => (k_block, v_block),
        };
        // No mask: the block attends to all its context and to itself both
        // ways.
        let scale = (cfg.head_dim as f32).powf(-0.5);
        let out = fast::scaled_dot_product_attention(&q, &keys, &values, scale, None, None)?;
        let out =
            out.transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[b, l, cfg.num_heads * cfg.head_dim])?;
        Ok(self.o.forward(&out)?)
    }

    /// A sliding layer's context, as mlx-vlm's DFlash drafter has it (a
    /// rotating cache of `window - 1` positions): the last `window - 1` of
    /// the new positions after the last `window - 2` earlier ones it kept.
    /// It keeps the last `window - 2` of them for the next round.
    fn window_context(
        &self,
        net: &Net,
        ctx: LayerContext,
        w: i32,
    ) -> anyhow::Result<Option<(Array, Array)>> {
        let last = |t: &Array, n: i32| -> anyhow::Result<Array> {
            let s = t.shape().to_vec();
            match s[2] > n {
                true => slice(t, &[0, 0, s[2] - n, 0], &[s[0], s[1], s[2], s[3]]),
                false => Ok(t.clone()),
            }
        };
        let Some(c) = ctx.new else {
            return Ok(ctx.window.clone());
        };
        let skip = (c.dim(1) - (w - 1)).max(0);
        let c = slice(c, &[0, skip, 0], &[c.dim(0), c.dim(1), c.dim(2)])?;
        let (k, v) = self.keys_values(net, &c, ctx.start + skip)?;
        let (k, v) = match ctx.window.take() {
            Some((ok, ov)) => (
                ops::concatenate(&[ok, k], 2)?,
                ops::concatenate(&[ov, v], 2)?,
            ),
            None => (k, v),
        };
        *ctx.window = Some((last(&k, w - 2)?, last(&v, w - 2)?));
        Ok(Some((k, v)))
    }

    /// Rotated keys and values of `x` `[1, L, hidden]` from position `pos`.
    fn keys_values(&self, net: &Net, x: &Array, pos: i32) -> anyhow::Result<(Array, Array)> {
        let cfg = &net.cfg;
        let k = net.rope.forward(
            &self.heads(
                cfg,
                self.k.forward(x)?,
                cfg.num_kv_heads,
                Some(&self.k_norm),
            )?,
            &Offsets::Scalar(pos),
        )?;
        let v = self.heads(cfg, self.v.forward(x)?, cfg.num_kv_heads, None)?;
        Ok((k, v))
    }

    /// `[1, L, n * head_dim]` to `[1, n, L, head_dim]`, normed per head.
    fn heads(&self, cfg: &DflashConfig, t: Array, n: i32, norm: Option<&RmsNorm>) -> R<Array> {
        let (b, len) = (t.dim(0), t.dim(1));
        let mut t = t.reshape(&[b, len, n, cfg.head_dim])?;
        if let Some(norm) = norm {
            t = norm.forward(&t)?;
        }
        t.transpose_axes(&[0, 2, 1, 3])
    }
}
