//! The decoder-only transformer shared by the supported families. Family
//! differences are data (which norms, biases, activations, windows), not
//! separate code paths: Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norm) and
//! Gemma 3 text (q/k norm, sandwich norms, GELU, scaled embeddings, sliding
//! window layers with their own rope base).

use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::{ops, Array, Dtype};

use crate::activations;
use crate::cache::{slice, KvCache};
use crate::config::{Family, ModelConfig, RopeScaling};
use crate::layers::{Embedding, Linear, Offsets, Projections, RmsNorm, Rope};
use crate::mask::{self, AttnMask};
use crate::weights::Weights;

mod embeds;
pub use embeds::Replacement;

type R<T> = Result<T, mlx_rs::error::Exception>;

/// Which positions' logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position of every row: `[B, 1, V]`.
    Last,
    /// Every position: `[B, L, V]` (verification of drafted tokens).
    All,
}

struct Attention {
    /// q, k and v projections.
    qkv: Projections,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    rope: Rope,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
}

struct Mlp {
    /// gate and up projections.
    gate_up: Projections,
    down: Linear,
    gelu: bool,
}

struct Layer {
    attn: Attention,
    mlp: Mlp,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    /// Gemma's sandwich norms around the MLP.
    pre_ff_norm: Option<RmsNorm>,
    post_ff_norm: Option<RmsNorm>,
    window: Option<i32>,
}

pub struct Model {
    pub config: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// Gemma multiplies embeddings by sqrt(hidden), rounded to bf16.
    embed_scale: Option<f32>,
}

impl Model {
    pub fn load(config: ModelConfig, mut w: Weights) -> anyhow::Result<Self> {
        let cfg = &config;
        let q = cfg.quantization;
        let gemma = cfg.family == Family::Gemma3;
        let eps = cfg.rms_norm_eps;
        let mut layers = Vec::with_capacity(cfg.num_layers as usize);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let window = cfg.layer_window(i);
            let (base, scaling) = if window.is_some() {
                (cfg.rope_local_theta, RopeScaling::None)
            } else {
                (cfg.rope_theta, cfg.rope_scaling.clone())
            };
            let (q_norm, k_norm) = if cfg.has_qk_norm() {
                (
                    Some(RmsNorm::load(
                        &mut w,
                        &format!("{p}.self_attn.q_norm"),
                        eps,
                        gemma,
                    )?),
                    Some(RmsNorm::load(
                        &mut w,
                        &format!("{p}.self_attn.k_norm"),
                        eps,
                        gemma,
                    )?),
                )
            } else {
                (None, None)
            };
            let scale = cfg
                .query_pre_attn_scalar
                .unwrap_or(cfg.head_dim as f32)
                .powf(-0.5);
            layers.push(Layer {
                attn: Attention {
                    qkv: Projections::new(vec![
                        Linear::load(&mut w, &format!("{p}.self_attn.q_proj"), q)?,
                        Linear::load(&mut w, &format!("{p}.self_attn.k_proj"), q)?,
                        Linear::load(&mut w, &format!("{p}.self_attn.v_proj"), q)?,
                    ])?,
                    o: Linear::load(&mut w, &format!("{p}.self_attn.o_proj"), q)?,
                    q_norm,
                    k_norm,
                    rope: Rope::new(cfg, base, &scaling),
                    heads: cfg.num_heads,
                    kv_heads: cfg.num_kv_heads,
                    head_dim: cfg.head_dim,
                    scale,
                },
                mlp: Mlp {
                    gate_up: Projections::new(vec![
                        Linear::load(&mut w, &format!("{p}.mlp.gate_proj"), q)?,
                        Linear::load(&mut w, &format!("{p}.mlp.up_proj"), q)?,
                    ])?,
                    down: Linear::load(&mut w, &format!("{p}.mlp.down_proj"), q)?,
                    gelu: gemma,
                },
                input_norm: RmsNorm::load(&mut w, &format!("{p}.input_layernorm"), eps, gemma)?,
                post_attn_norm: RmsNorm::load(
                    &mut w,
                    &format!("{p}.post_attention_layernorm"),
                    eps,
                    gemma,
                )?,
                pre_ff_norm: if gemma {
                    Some(RmsNorm::load(
                        &mut w,
                        &format!("{p}.pre_feedforward_layernorm"),
                        eps,
                        true,
                    )?)
                } else {
                    None
                },
                post_ff_norm: if gemma {
                    Some(RmsNorm::load(
                        &mut w,
                        &format!("{p}.post_feedforward_layernorm"),
                        eps,
                        true,
                    )?)
                } else {
                    None
                },
                window,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", q)?;
        let norm = RmsNorm::load(&mut w, "model.norm", eps, gemma)?;
        let lm_head = if w.contains("lm_head.weight") && !(cfg.tie_word_embeddings && gemma) {
            Some(Linear::load(&mut w, "lm_head", q)?)
        } else {
            None
        };
        let embed_scale =
            gemma.then(|| half::bf16::from_f32((cfg.hidden_size as f32).sqrt()).to_f32());
        let leftover: Vec<_> = w
            .remaining()
            .filter(|n| !n.contains("rotary_emb"))
            .cloned()
            .collect();
        if !leftover.is_empty() {
            tracing::warn!(count = leftover.len(), first = %leftover[0], "unused weights in checkpoint");
        }
        Ok(Self {
            config,
            embed,
            layers,
            norm,
            lm_head,
            embed_scale,
        })
    }

    /// Every weight array, in an order fixed by the model's structure.
    pub fn parameters(&self) -> Vec<&Array> {
        let mut all: Vec<&Array> = Vec::new();
        self.embed.collect(&mut all);
        for l in &self.layers {
            l.collect(&mut all);
        }
        self.norm.collect(&mut all);
        if let Some(h) = &self.lm_head {
            h.collect(&mut all);
        }
        all
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn new_cache(&self, batch: usize) -> KvCache {
        KvCache::new(self.layers.len(), batch)
    }

    pub fn dtype(&self) -> Dtype {
        self.embed.dtype()
    }

    /// Bytes of one activation value (K and V are cached in this dtype).
    pub fn activation_bytes(&self) -> usize {
        match self.dtype() {
            Dtype::Float32 => 4,
            Dtype::Float16 | Dtype::Bfloat16 => 2,
            other => unreachable!("activations are floating point, not {other:?}"),
        }
    }

    /// Bytes of K+V one token occupies in this model's cache.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.config.kv_bytes_per_token(self.activation_bytes())
    }

    /// Runs `tokens` (`[B, L]` int32) through the model, appending their keys
    /// and values to `cache`, and returns logits as float32.
    pub fn forward(
        &self,
        tokens: &Array,
        cache: &mut KvCache,
        which: Logits,
    ) -> anyhow::Result<Array> {
        Ok(self
            .forward_tapped(tokens, cache, which, &Taps::default())?
            .logits)
    }

    /// [`Model::forward`] that also hands back the hidden states speculative
    /// drafters read: the outputs of chosen layers (concatenated along the
    /// feature axis, every position) and the final normed hidden state.
    pub fn forward_tapped(
        &self,
        tokens: &Array,
        cache: &mut KvCache,
        which: Logits,
        taps: &Taps,
    ) -> anyhow::Result<Tapped> {
        let n = tokens.dim(1);
        let mut h = self.embed(tokens)?;
        let global_mask = mask::build(cache, n, None);
        let window_mask = self
            .config
            .sliding_window
            .map(|w| mask::build(cache, n, Some(w)));
        let offsets = cache.offsets();
        let mut tapped = Vec::with_capacity(taps.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let mask = match (&layer.window, &window_mask) {
                (Some(_), Some(m)) => m,
                _ => &global_mask,
            };
            h = layer.forward(&h, mask, &offsets, cache, i)?;
            if taps.layers.contains(&i) {
                tapped.push(h.clone());
            }
        }
        cache.advance(n);
        let mut h = self.norm.forward(&h)?;
        if which == Logits::Last && n > 1 {
            h = last_position(&h)?;
        }
        let logits = self.logits(&h)?;
        let layers = if tapped.is_empty() {
            None
        } else {
            Some(ops::concatenate(&tapped, -1)?)
        };
        Ok(Tapped {
            logits,
            layers,
            final_hidden: taps.final_hidden.then_some(h),
        })
    }

    /// Token embeddings as the first layer sees them (Gemma's scale applied).
    pub fn embed(&self, tokens: &Array) -> anyhow::Result<Array> {
        let h = self.embed.forward(tokens)?;
        Ok(match self.embed_scale {
            Some(scale) => h.multiply(Array::from_f32(scale).as_dtype(h.dtype())?)?,
            None => h,
        })
    }

    /// Raw rows of the embedding table (no family scale).
    pub fn embed_unscaled(&self, tokens: &Array) -> anyhow::Result<Array> {
        Ok(self.embed.forward(tokens)?)
    }

    /// Float32 logits from final normed hidden states.
    pub fn logits(&self, h: &Array) -> anyhow::Result<Array> {
        let logits = match &self.lm_head {
            Some(head) => head.forward(h)?,
            None => self.embed.as_linear(h)?,
        };
        Ok(logits.as_dtype(Dtype::Float32)?)
    }

    /// Layer `i`'s attention geometry, for drafters that attend into the
    /// target's cache.
    pub fn attention_info(&self, i: usize) -> AttentionInfo<'_> {
        let a = &self.layers[i].attn;
        AttentionInfo {
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            window: self.layers[i].window,
            rope: &a.rope,
        }
    }
}

/// Which hidden states [`Model::forward_tapped`] returns.
#[derive(Debug, Clone, Default)]
pub struct Taps {
    /// Layer indices whose outputs are returned, in ascending order.
    pub layers: Vec<usize>,
    /// The final normed hidden state (what the output head reads).
    pub final_hidden: bool,
}

pub struct Tapped {
    pub logits: Array,
    /// `[B, L, hidden * layers.len()]`.
    pub layers: Option<Array>,
    /// `[B, L, hidden]` (or `[B, 1, hidden]` with [`Logits::Last`]).
    pub final_hidden: Option<Array>,
}

pub struct AttentionInfo<'a> {
    pub kv_heads: i32,
    pub head_dim: i32,
    pub window: Option<i32>,
    pub rope: &'a Rope,
}

fn last_position(h: &Array) -> R<Array> {
    let n = h.dim(1);
    h.take_axis(Array::from_slice(&[n - 1], &[1]), 1)
}

impl Layer {
    fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        let a = &self.attn;
        a.qkv.collect(out);
        self.mlp.gate_up.collect(out);
        a.o.collect(out);
        self.mlp.down.collect(out);
        for norm in [&a.q_norm, &a.k_norm, &self.pre_ff_norm, &self.post_ff_norm]
            .into_iter()
            .flatten()
        {
            norm.collect(out);
        }
        self.input_norm.collect(out);
        self.post_attn_norm.collect(out);
    }

    fn forward(
        &self,
        x: &Array,
        mask: &AttnMask,
        offsets: &Offsets,
        cache: &mut KvCache,
        idx: usize,
    ) -> anyhow::Result<Array> {
        let r = self
            .attn
            .forward(&self.input_norm.forward(x)?, mask, offsets, cache, idx)?;
        match (&self.pre_ff_norm, &self.post_ff_norm) {
            (Some(pre), Some(post)) => {
                let h = residual(x, &self.post_attn_norm.forward(&r)?)?;
                let r = self.mlp.forward(&pre.forward(&h)?)?;
                Ok(residual(&h, &post.forward(&r)?)?)
            }
            _ => {
                let h = x.add(&r)?;
                let r = self.mlp.forward(&self.post_attn_norm.forward(&h)?)?;
                Ok(h.add(&r)?)
            }
        }
    }
}

/// Gemma's residual add, clipped in float16 to avoid overflow to inf.
fn residual(x: &Array, y: &Array) -> R<Array> {
    if x.dtype() != Dtype::Float16 {
        return x.add(y);
    }
    let bound = Array::from_f32(65504.0);
    let sum = x
        .as_dtype(Dtype::Float32)?
        .add(y.as_dtype(Dtype::Float32)?)?;
    ops::clip(&sum, (&bound.negative()?, &bound))?.as_dtype(Dtype::Float16)
}

impl Attention {
    fn forward(
        &self,
        x: &Array,
        mask: &AttnMask,
        offsets: &Offsets,
        cache: &mut KvCache,
        idx: usize,
    ) -> anyhow::Result<Array> {
        let (b, l) = (x.dim(0), x.dim(1));
        let heads = |t: Array, n: i32, norm: &Option<RmsNorm>| -> R<Array> {
            let mut t = t.reshape(&[b, l, n, self.head_dim])?;
            if let Some(norm) = norm {
                t = norm.forward(&t)?;
            }
            t.transpose_axes(&[0, 2, 1, 3])
        };
        let mut qkv = self.qkv.forward(x)?.into_iter();
        let (q, k, v) = (
            qkv.next().unwrap(),
            qkv.next().unwrap(),
            qkv.next().unwrap(),
        );
        let q = heads(q, self.heads, &self.q_norm)?;
        let k = heads(k, self.kv_heads, &self.k_norm)?;
        let v = heads(v, self.kv_heads, &None)?;
        let q = self.rope.forward(&q, offsets)?;
        let k = self.rope.forward(&k, offsets)?;
        let (k, v) = cache.update(idx, k, v)?;
        let out = match mask {
            AttnMask::None => {
                fast::scaled_dot_product_attention(&q, &k, &v, self.scale, None, None)?
            }
            AttnMask::Causal => fast::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                self.scale,
                ScaledDotProductAttentionMask::Causal,
                None,
            )?,
            AttnMask::Array(m) => {
                fast::scaled_dot_product_attention(&q, &k, &v, self.scale, m, None)?
            }
            AttnMask::RowStarts(starts) => {
                let total = k.dim(2);
                let rows = starts
                    .iter()
                    .enumerate()
                    .map(|(r, &from)| -> anyhow::Result<Array> {
                        let r = r as i32;
                        let qs = q.shape();
                        let ks = k.shape();
                        let qr = slice(&q, &[r, 0, 0, 0], &[r + 1, qs[1], qs[2], qs[3]])?;
                        let kr = slice(&k, &[r, 0, from, 0], &[r + 1, ks[1], total, ks[3]])?;
                        let vr = slice(&v, &[r, 0, from, 0], &[r + 1, ks[1], total, ks[3]])?;
                        Ok(fast::scaled_dot_product_attention(
                            &qr, &kr, &vr, self.scale, None, None,
                        )?)
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                ops::concatenate(&rows, 0)?
            }
            AttnMask::CausalRows { past } => {
                let (qs, ks) = (q.shape().to_vec(), k.shape().to_vec());
                let rows = (0..qs[2])
                    .map(|i| -> anyhow::Result<Array> {
                        let qi = slice(&q, &[0, 0, i, 0], &[qs[0], qs[1], i + 1, qs[3]])?;
                        let end = past + i + 1;
                        let ki = slice(&k, &[0, 0, 0, 0], &[ks[0], ks[1], end, ks[3]])?;
                        let vi = slice(&v, &[0, 0, 0, 0], &[ks[0], ks[1], end, ks[3]])?;
                        Ok(fast::scaled_dot_product_attention(
                            &qi, &ki, &vi, self.scale, None, None,
                        )?)
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                ops::concatenate(&rows, 2)?
            }
        };
        let out =
            out.transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[b, l, self.heads * self.head_dim])?;
        Ok(self.o.forward(&out)?)
    }
}

impl Mlp {
    fn forward(&self, x: &Array) -> R<Array> {
        let mut gu = self.gate_up.forward(x)?.into_iter();
        let (g, u) = (gu.next().unwrap(), gu.next().unwrap());
        self.down.forward(&activations::gated(&g, &u, self.gelu)?)
    }
}
