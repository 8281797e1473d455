//! The decoder-only transformer shared by the supported families. Family
//! differences are data (which norms, biases, activations, windows), not
//! separate code paths: Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norm) and
//! Gemma 3 text (q/k norm, sandwich norms, GELU, scaled embeddings, sliding
//! window layers with their own rope base). A layer mixes tokens by
//! attention or, in Qwen 3.5, by a Gated DeltaNet recurrence; its
//! feed-forward part is an MLP or a sparse expert block (Qwen MoE).

use std::sync::atomic::{AtomicU64, Ordering};

use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::{ops, Array, Dtype};

use crate::activations;
use crate::cache::{KvCache, LayerView, Offsets};
use crate::config::{Family, LayerSpec, ModelConfig};
use crate::kv_quant::KvQuant;
use crate::layers::{Embedding, Linear, Projections, RmsNorm, Rope};
use crate::mask::{self, AttnMask};
use crate::weights::Weights;

mod embeds;
mod experts;
pub mod gated_delta;
mod gemma4;
mod mtp_head;
mod sparse_moe;
pub use embeds::Replacement;
pub use mtp_head::MtpHead;

type R<T> = Result<T, mlx_rs::error::Exception>;

/// Which positions' logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position of every row: `[B, 1, V]`.
    Last,
    /// Only position `i` of every row: `[B, 1, V]` (a prefill padded at
    /// the end, see [`crate::generate::prefill`]).
    At(i32),
    /// Every position: `[B, L, V]` (verification of drafted tokens).
    All,
}

struct Attention {
    /// q, k and v projections; q alone where the layer reads another
    /// layer's keys and values, q and k where values are the keys.
    qkv: Projections,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    /// Gemma 4 normalises values too (no learned scale).
    v_norm: Option<f32>,
    rope: Rope,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
    /// The layer whose keys and values this one attends to.
    kv_source: Option<usize>,
    /// Qwen 3.5: q_proj also yields a per-head gate, `out * sigmoid(gate)`.
    gated: bool,
}

/// How a layer mixes information across positions.
enum Mixer {
    Attention(Attention),
    /// Qwen 3.5's linear attention, with a recurrent state in the cache.
    Linear(gated_delta::GatedDeltaNet),
}

/// A layer's feed-forward part.
enum Ffn {
    Dense(Mlp),
    /// Qwen's experts in place of the MLP.
    Sparse(Box<sparse_moe::SparseMoe>),
}

struct Mlp {
    /// gate and up projections.
    gate_up: Projections,
    down: Linear,
    gelu: bool,
}

struct Layer {
    mixer: Mixer,
    mlp: Ffn,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    /// Gemma's sandwich norms around the MLP.
    pre_ff_norm: Option<RmsNorm>,
    post_ff_norm: Option<RmsNorm>,
    window: Option<i32>,
    /// Gemma 4: experts beside the MLP, the per-layer input branch and a
    /// learned scale of the layer's output.
    moe: Option<gemma4::Moe>,
    per_layer: Option<gemma4::PerLayerGate>,
    scalar: Option<Array>,
    /// Gemma 3 clips float16 residual sums.
    clip_f16: bool,
}

pub struct Model {
    pub config: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// Gemma multiplies embeddings by sqrt(hidden) (Gemma 3 rounds it to
    /// bf16 first).
    embed_scale: Option<f32>,
    per_layer_inputs: Option<gemma4::PerLayerInputs>,
    /// `tanh(logits / cap) * cap` (Gemma 4).
    softcap: Option<f32>,
    /// `model.kv_cache`: full-attention layers store keys and values
    /// quantized.
    kv_quant: Option<KvQuant>,
    /// Forwards run, a batched one counting once (see [`Model::forwards`]).
    forwards: AtomicU64,
}

impl Model {
    pub fn load(config: ModelConfig, mut w: Weights) -> anyhow::Result<Self> {
        let cfg = &config;
        let gemma3 = cfg.family == Family::Gemma3;
        let gemma = gemma3 || cfg.family == Family::Gemma4;
        // Hugging Face's Qwen 3.5 stores the decoder's norms as offsets
        // from 1 (MLX conversions fold the 1 in); its convolution weights
        // are in PyTorch's layout, which tells the two apart.
        let plus_one_norms = gemma3
            || cfg.hybrid.as_ref().is_some_and(|h| {
                let first = h.full_attention.iter().position(|&f| !f);
                first.is_some_and(|i| {
                    w.peek(&format!("model.layers.{i}.linear_attn.conv1d.weight"))
                        .is_some_and(|c| c.ndim() == 3 && c.dim(-1) != 1)
                })
            });
        let g4 = cfg.gemma4.as_ref();
        let h = cfg.hidden_size;
        let layers = (0..cfg.num_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                Layer::load(&mut w, cfg, &p, &cfg.layer(i), plus_one_norms)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let embed_prefix = "model.embed_tokens";
        let embed = Embedding::load_checked(
            &mut w,
            embed_prefix,
            cfg.quant_for(embed_prefix),
            cfg.vocab_size,
            h,
        )?;
        let final_norm =
            RmsNorm::load_sized(&mut w, "model.norm", h, cfg.rms_norm_eps, plus_one_norms)?;
        let lm_head = if w.contains("lm_head.weight") && !(cfg.tie_word_embeddings && gemma) {
            let quant = cfg.quant_for("lm_head");
            Some(Linear::load_checked(
                &mut w,
                "lm_head",
                quant,
                cfg.vocab_size,
                h,
            )?)
        } else {
            None
        };
        let per_layer_inputs = match g4.and_then(|g| g.per_layer_input) {
            Some((width, vocab)) => Some(gemma4::PerLayerInputs::load(&mut w, cfg, width, vocab)?),
            None => None,
        };
        let sqrt_hidden = (h as f32).sqrt();
        let embed_scale = match cfg.family {
            Family::Gemma3 => Some(half::bf16::from_f32(sqrt_hidden).to_f32()),
            Family::Gemma4 => Some(sqrt_hidden),
            _ => None,
        };
        let leftover: Vec<_> = w
            .remaining()
            // Rope tables are recomputed; Qwen 3.5's MTP head is a drafter's.
            .filter(|n| !n.contains("rotary_emb") && !n.starts_with("mtp."))
            .cloned()
            .collect();
        if !leftover.is_empty() {
            tracing::warn!(count = leftover.len(), first = %leftover[0], "unused weights in checkpoint");
        }
        Ok(Self {
            softcap: g4.and_then(|g| g.final_logit_softcapping),
            config,
            embed,
            layers,
            norm: final_norm,
            lm_head,
            embed_scale,
            per_layer_inputs,
            kv_quant: None,
            forwards: AtomicU64::new(0),
        })
    }

    /// Stores full-attention keys and values quantized (`model.kv_cache`)
    /// in every cache made from now on; fails, naming the setting, for one
    /// this build or this model's head size cannot serve.
    pub fn set_kv_quant(&mut self, kv: Option<KvQuant>) -> anyhow::Result<()> {
        if let Some(q) = kv {
            q.check().map_err(anyhow::Error::msg)?;
            for i in 0..self.config.num_layers {
                if self.config.kv_quant_for(i, kv).is_some() {
                    q.fits(self.config.layer(i).head_dim)
                        .map_err(anyhow::Error::msg)?;
                }
            }
        }
        self.kv_quant = kv;
        Ok(())
    }

    pub fn kv_quant(&self) -> Option<KvQuant> {
        self.kv_quant
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
        if let Some(p) = &self.per_layer_inputs {
            p.collect(&mut all);
        }
        all
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn new_cache(&self, batch: usize) -> KvCache {
        self.new_padded_cache(vec![0; batch])
    }

    /// A batch cache for prompts left-padded by `left_pad` columns each.
    pub fn new_padded_cache(&self, left_pad: Vec<i32>) -> KvCache {
        KvCache::with_formats(self.kv_formats(), left_pad)
    }

    /// [`Model::new_padded_cache`] with its keys and values in `pool`.
    pub fn new_paged_cache(&self, pool: &crate::paged::PagePool, left_pad: Vec<i32>) -> KvCache {
        KvCache::paged(pool, self.kv_formats(), left_pad)
    }

    /// Each layer's KV storage format.
    fn kv_formats(&self) -> Vec<Option<crate::KvQuant>> {
        (0..self.config.num_layers)
            .map(|i| self.config.kv_quant_for(i, self.kv_quant))
            .collect()
    }

    /// Whether some layers keep a recurrent state instead of keys and
    /// values (Qwen 3.5): such a cache cannot be cut back to an arbitrary
    /// earlier position, only rolled back within its last forward.
    pub fn is_hybrid(&self) -> bool {
        self.config.hybrid.is_some()
    }

    /// Bytes of one sequence's recurrent state (0 without linear layers).
    pub fn state_bytes_per_sequence(&self) -> usize {
        self.config
            .state_bytes_per_sequence(self.activation_bytes())
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

    /// Forwards this model has run (prefill chunks, decode steps, verifies;
    /// a batched one counts once): how the tests see rows run together.
    pub fn forwards(&self) -> u64 {
        self.forwards.load(Ordering::Relaxed)
    }

    /// Bytes of K+V one token occupies in this model's cache.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.config
            .kv_bytes_per_token(self.activation_bytes(), self.kv_quant)
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
        let h = self.embed(tokens)?;
        let fused = attention_fused(&self.layers);
        let global_mask = mask::build(cache, n, None, fused);
        let window_mask = self
            .config
            .sliding_window
            .map(|w| mask::build(cache, n, Some(w), fused));
        self.run_layers(
            tokens,
            h,
            (&global_mask, window_mask.as_ref()),
            cache,
            which,
            taps,
        )
    }

    /// Everything after the input embeddings `h` of `tokens`: the layers
    /// (with the full-attention and sliding-window masks), the final norm
    /// and the output head.
    fn run_layers(
        &self,
        tokens: &Array,
        h: Array,
        (global_mask, window_mask): (&AttnMask, Option<&AttnMask>),
        cache: &mut KvCache,
        which: Logits,
        taps: &Taps,
    ) -> anyhow::Result<Tapped> {
        self.forwards.fetch_add(1, Ordering::Relaxed);
        let (b, n) = (tokens.dim(0), tokens.dim(1));
        let hidden = h.dim(-1);
        // The layers carry the residual stream as `[B * L, hidden]` rows:
        // a product of a 2-D input needs none of the Flatten and Unflatten
        // nodes MLX adds around a 3-D one (four products a layer).
        let rows = [b * n, hidden];
        let per_layer = match &self.per_layer_inputs {
            Some(p) => {
                let p = p.forward(tokens, &h)?;
                Some(p.reshape(&[b * n, p.dim(2), p.dim(3)])?)
            }
            None => None,
        };
        let mut h = Residual::Sum(h.reshape(&rows)?);
        let offsets = cache.offsets();
        let ssm_mask = padding_mask(cache, n);
        let mut tapped = Vec::with_capacity(taps.layers.len());
        // Keys and values of this pass per layer, for layers that share them.
        let mut kvs: Vec<Option<LayerView>> = vec![None; self.layers.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            let mask = match (&layer.window, window_mask) {
                (Some(_), Some(m)) => m,
                _ => global_mask,
            };
            let shared = match &layer.mixer {
                Mixer::Attention(a) => a.kv_source.and_then(|s| kvs[s].clone()),
                Mixer::Linear(_) => None,
            };
            let input = match &per_layer {
                Some(p) => Some(p.take_axis(Array::from_int(i as i32), 1)?),
                None => None,
            };
            let masks = (mask, ssm_mask.as_ref());
            let (out, kv) =
                layer.forward(h, (b, n), masks, &offsets, cache, i, shared, input.as_ref())?;
            h = out;
            kvs[i] = kv;
            if taps.layers.contains(&i) {
                let sum = h.sum()?;
                tapped.push(sum.clone());
                h = Residual::Sum(sum);
            }
        }
        cache.advance(n);
        crate::inject::at_forward(b as usize)?;
        let normed = h.normed(&self.norm)?.1.reshape(&[b, n, hidden])?;
        let logits = match which {
            Logits::Last if n > 1 => self.logits(&position(&normed, n - 1)?)?,
            Logits::At(i) => self.logits(&position(&normed, i)?)?,
            _ => self.logits(&normed)?,
        };
        let layers = if tapped.is_empty() {
            None
        } else {
            Some(ops::concatenate(&tapped, -1)?.reshape(&[b, n, -1])?)
        };
        Ok(Tapped {
            logits,
            layers,
            final_hidden: taps.final_hidden.then_some(normed),
        })
    }

    /// Whether [`Model::forward_mixed`] takes this model: attention layers
    /// only (a linear-attention layer's recurrence and Gemma 4's per-layer
    /// inputs run in separate forwards).
    pub fn mixes(&self) -> bool {
        self.per_layer_inputs.is_none()
            && self
                .layers
                .iter()
                .all(|l| matches!(l.mixer, Mixer::Attention(_)))
    }

    /// Several sequences' tokens in one forward: every segment's `[B, L]`
    /// tokens become rows of one residual stream, so each product (q/k/v,
    /// output, MLP, head) runs once over all of them, while attention runs
    /// per segment against its own cache (its positions, its mask). A
    /// decode batch is one segment of `[B, 1]`, a prompt chunk one of
    /// `[1, L]`. Returns, per segment that asked, the logits of every
    /// row's last position (`[B, 1, V]` float32). Only for a model that
    /// [`Model::mixes`].
    pub fn forward_mixed(
        &self,
        segments: &mut [Segment<'_>],
    ) -> anyhow::Result<Vec<Option<Array>>> {
        anyhow::ensure!(
            self.mixes(),
            "this model's layers do not run mixed forwards"
        );
        anyhow::ensure!(!segments.is_empty(), "a mixed forward of no segments");
        self.forwards.fetch_add(1, Ordering::Relaxed);
        let fused = attention_fused(&self.layers);
        let mut first_row = 0;
        let layouts: Vec<SegmentLayout> = segments
            .iter()
            .map(|s| {
                let (b, n) = (s.tokens.dim(0), s.tokens.dim(1));
                let layout = SegmentLayout {
                    rows: (b, n),
                    first_row,
                    global_mask: mask::build(s.cache, n, None, fused),
                    window_mask: self
                        .config
                        .sliding_window
                        .map(|w| mask::build(s.cache, n, Some(w), fused)),
                    offsets: s.cache.offsets(),
                };
                first_row += b * n;
                layout
            })
            .collect();
        let flat = segments
            .iter()
            .map(|s| s.tokens.reshape(&[1, -1]))
            .collect::<R<Vec<_>>>()?;
        let h = self.embed(&ops::concatenate(&flat, 1)?)?;
        let hidden = h.dim(-1);
        let mut h = Residual::Sum(h.reshape(&[first_row, hidden])?);
        // Keys and values of this pass per segment and layer, for layers
        // that share them.
        let mut kvs: Vec<Vec<Option<LayerView>>> =
            vec![vec![None; segments.len()]; self.layers.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            let Mixer::Attention(a) = &layer.mixer else {
                unreachable!("checked by mixes()");
            };
            let shared = match a.kv_source {
                Some(s) => kvs[s].clone(),
                None => vec![None; segments.len()],
            };
            let own_kv = shared.iter().all(Option::is_none);
            let (x, input) = a.input(h, &layer.input_norm, own_kv)?;
            let (r, kv) = a.forward_mixed(
                input,
                segments,
                &layouts,
                layer.window.is_some(),
                i,
                &shared,
            )?;
            h = layer.feed_forward(&x, &r, None)?;
            kvs[i] = kv.into_iter().map(Some).collect();
        }
        for (s, l) in segments.iter_mut().zip(&layouts) {
            s.cache.advance(l.rows.1);
        }
        // Counted as wide as its widest segment (the decode batch's rows),
        // as that batch's own forward would be.
        let widest = layouts.iter().map(|l| l.rows.0).max().unwrap_or(0);
        crate::inject::at_forward(widest as usize)?;
        // The head reads only each asking segment's rows' last positions,
        // all in one product.
        let last: Vec<i32> = segments
            .iter()
            .zip(&layouts)
            .filter(|(s, _)| s.logits)
            .flat_map(|(_, l)| {
                let (b, n) = l.rows;
                (0..b).map(move |j| l.first_row + j * n + n - 1)
            })
            .collect();
        if last.is_empty() {
            return Ok(vec![None; segments.len()]);
        }
        let picked = h
            .sum()?
            .take_axis(Array::from_slice(&last, &[last.len() as i32]), 0)?;
        let logits = self.logits(&self.norm.forward(&picked)?)?;
        let mut per_segment = Vec::with_capacity(segments.len());
        let mut at = 0;
        for (s, l) in segments.iter().zip(&layouts) {
            if !s.logits {
                per_segment.push(None);
                continue;
            }
            let b = l.rows.0;
            let idx: Vec<i32> = (at..at + b).collect();
            let rows = logits.take_axis(Array::from_slice(&idx, &[b]), 0)?;
            per_segment.push(Some(rows.reshape(&[b, 1, -1])?));
            at += b;
        }
        Ok(per_segment)
    }

    /// Token embeddings as the first layer sees them (Gemma's scale applied).
    pub fn embed(&self, tokens: &Array) -> anyhow::Result<Array> {
        self.scale_embeddings(self.embed.forward(tokens)?)
    }

    fn scale_embeddings(&self, h: Array) -> anyhow::Result<Array> {
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
        let mut logits = match &self.lm_head {
            Some(head) => head.forward(h)?,
            None => self.embed.as_linear(h)?,
        };
        if let Some(cap) = self.softcap {
            let cap = Array::from_f32(cap).as_dtype(logits.dtype())?;
            logits = ops::tanh(logits.divide(&cap)?)?.multiply(&cap)?;
        }
        Ok(logits.as_dtype(Dtype::Float32)?)
    }

    /// Layer `i`'s attention geometry, for drafters that attend into the
    /// target's cache; `None` for a linear-attention layer.
    pub fn attention_info(&self, i: usize) -> Option<AttentionInfo<'_>> {
        let Mixer::Attention(a) = &self.layers[i].mixer else {
            return None;
        };
        Some(AttentionInfo {
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            owns_kv: a.kv_source.is_none(),
            window: self.layers[i].window,
            rope: &a.rope,
        })
    }
}

/// One sequence's (or one batch's) part of a mixed forward
/// ([`Model::forward_mixed`]).
pub struct Segment<'a> {
    /// `[B, L]` int32, appended to `cache`.
    pub tokens: Array,
    pub cache: &'a mut KvCache,
    /// Whether the forward returns the logits of its rows' last positions.
    pub logits: bool,
}

/// Where a segment's rows sit in a mixed forward's stream, and what its
/// attention needs from its cache (read before any layer writes it).
struct SegmentLayout {
    /// (B, L).
    rows: (i32, i32),
    first_row: i32,
    global_mask: AttnMask,
    window_mask: Option<AttnMask>,
    offsets: Offsets,
}

impl SegmentLayout {
    /// The mask a layer of this segment attends under (`windowed`: a
    /// sliding-window layer, where the segment has a window mask).
    fn mask(&self, windowed: bool) -> &AttnMask {
        match (windowed, &self.window_mask) {
            (true, Some(m)) => m,
            _ => &self.global_mask,
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
    /// `[B, L, hidden]`, every position whichever logits were asked for.
    pub final_hidden: Option<Array>,
}

pub struct AttentionInfo<'a> {
    pub kv_heads: i32,
    pub head_dim: i32,
    /// Whether the layer's keys and values are in the cache (Gemma 4's
    /// KV-shared layers attend to an earlier layer's).
    pub owns_kv: bool,
    pub window: Option<i32>,
    pub rope: &'a Rope,
}

/// `[B, n]`, false where the `n` new columns of a row are its left
/// padding; `None` when no new column is padding. Linear-attention layers
/// skip those positions so padding never enters a row's state.
fn padding_mask(cache: &KvCache, n: i32) -> Option<Array> {
    let past = cache.len();
    let pads = cache.left_padding();
    if pads.iter().all(|&p| p <= past) {
        return None;
    }
    let data: Vec<bool> = pads
        .iter()
        .flat_map(|&p| (0..n).map(move |i| past + i >= p))
        .collect();
    Some(Array::from_slice(&data, &[pads.len() as i32, n]))
}

/// Position `i` of every row of `h` (`[B, L, D]` to `[B, 1, D]`).
fn position(h: &Array, i: i32) -> R<Array> {
    h.take_axis(Array::from_slice(&[i], &[1]), 1)
}

impl Layer {
    /// Decoder layer `p` (`model.layers.N`, or Qwen 3.5's MTP head's
    /// `mtp.layers.N`) as `spec` describes it.
    fn load(
        w: &mut Weights,
        cfg: &ModelConfig,
        p: &str,
        spec: &LayerSpec,
        plus_one_norms: bool,
    ) -> anyhow::Result<Self> {
        let gemma3 = cfg.family == Family::Gemma3;
        let gemma = gemma3 || cfg.family == Family::Gemma4;
        let g4 = cfg.gemma4.as_ref();
        let eps = cfg.rms_norm_eps;
        let h = cfg.hidden_size;
        let linear = |w: &mut Weights, name: &str, out: i32, inp: i32| {
            Linear::load_checked(w, name, cfg.quant_for(name), out, inp)
        };
        let norm = |w: &mut Weights, name: &str, dims: i32| {
            RmsNorm::load_sized(w, name, dims, eps, plus_one_norms)
        };
        let (hd, kvh) = (spec.head_dim, spec.kv_heads);
        let mixer = if spec.linear {
            Mixer::Linear(gated_delta::GatedDeltaNet::load(
                w,
                cfg,
                &format!("{p}.linear_attn"),
            )?)
        } else {
            let attn = format!("{p}.self_attn");
            let q_width = cfg.num_heads * hd * if spec.gated_attention { 2 } else { 1 };
            let mut qkv = vec![linear(w, &format!("{attn}.q_proj"), q_width, h)?];
            let own_kv = spec.kv_source.is_none();
            if own_kv {
                qkv.push(linear(w, &format!("{attn}.k_proj"), kvh * hd, h)?);
                if !spec.k_eq_v {
                    qkv.push(linear(w, &format!("{attn}.v_proj"), kvh * hd, h)?);
                }
            } else {
                // Hugging Face checkpoints keep the projections of layers
                // that reuse another layer's keys and values; nothing reads
                // them.
                for unused in ["k_proj", "v_proj", "k_norm"] {
                    for part in ["weight", "scales", "biases"] {
                        w.take_optional(&format!("{attn}.{unused}.{part}"));
                    }
                }
            }
            let (q_norm, k_norm) = if cfg.has_qk_norm() {
                (
                    Some(norm(w, &format!("{attn}.q_norm"), hd)?),
                    own_kv
                        .then(|| norm(w, &format!("{attn}.k_norm"), hd))
                        .transpose()?,
                )
            } else {
                (None, None)
            };
            Mixer::Attention(Attention {
                qkv: Projections::new(qkv)?,
                o: linear(w, &format!("{attn}.o_proj"), h, cfg.num_heads * hd)?,
                q_norm,
                k_norm,
                v_norm: (g4.is_some() && own_kv).then_some(eps),
                rope: Rope::new(spec.rotary_dims, spec.rope_base, &spec.rope_scaling),
                heads: cfg.num_heads,
                kv_heads: kvh,
                head_dim: hd,
                scale: cfg.attention_scale(hd),
                kv_source: spec.kv_source,
                gated: spec.gated_attention,
            })
        };
        let mlp = match &cfg.sparse_moe {
            Some(m) if spec.sparse_moe => Ffn::Sparse(Box::new(sparse_moe::SparseMoe::load(
                w,
                cfg,
                m,
                &format!("{p}.mlp"),
            )?)),
            _ => Ffn::Dense(Mlp::load(w, cfg, &format!("{p}.mlp"), spec.intermediate)?),
        };
        let moe = match g4.and_then(|g| g.moe) {
            Some(m) => Some(gemma4::Moe::load(w, cfg, m, p)?),
            None => None,
        };
        let per_layer = match g4.and_then(|g| g.per_layer_input) {
            Some((width, _)) => Some(gemma4::PerLayerGate::load(w, cfg, p, width)?),
            None => None,
        };
        let scalar = match g4 {
            Some(_) => Some(w.take_shaped(&format!("{p}.layer_scalar"), &[1])?),
            None => None,
        };
        Ok(Layer {
            mixer,
            mlp,
            input_norm: norm(w, &format!("{p}.input_layernorm"), h)?,
            post_attn_norm: norm(w, &format!("{p}.post_attention_layernorm"), h)?,
            pre_ff_norm: gemma
                .then(|| norm(w, &format!("{p}.pre_feedforward_layernorm"), h))
                .transpose()?,
            post_ff_norm: gemma
                .then(|| norm(w, &format!("{p}.post_feedforward_layernorm"), h))
                .transpose()?,
            window: spec.window,
            moe,
            per_layer,
            scalar,
            clip_f16: gemma3,
        })
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        match &self.mixer {
            Mixer::Attention(a) => {
                a.qkv.collect(out);
                a.o.collect(out);
                for norm in [&a.q_norm, &a.k_norm].into_iter().flatten() {
                    norm.collect(out);
                }
            }
            Mixer::Linear(l) => l.collect(out),
        }
        match &self.mlp {
            Ffn::Dense(m) => m.collect(out),
            Ffn::Sparse(m) => m.collect(out),
        }
        for norm in [&self.pre_ff_norm, &self.post_ff_norm]
            .into_iter()
            .flatten()
        {
            norm.collect(out);
        }
        self.input_norm.collect(out);
        self.post_attn_norm.collect(out);
        if let Some(m) = &self.moe {
            m.collect(out);
        }
        if let Some(p) = &self.per_layer {
            p.collect(out);
        }
        out.extend(self.scalar.as_ref());
    }

    /// The layer's output and the keys and values it attended to (none
    /// for a linear-attention layer). `x`: `rows` = (B, L) positions, as
    /// `[B * L, hidden]` or `[B, L, hidden]` (the output keeps its shape).
    /// `masks`: the attention mask and the linear layers' padding mask.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: Residual,
        rows: (i32, i32),
        (mask, padding): (&AttnMask, Option<&Array>),
        offsets: &Offsets,
        cache: &mut KvCache,
        idx: usize,
        shared_kv: Option<LayerView>,
        per_layer_input: Option<&Array>,
    ) -> anyhow::Result<(Residual, Option<LayerView>)> {
        let (r, x, kv) = match &self.mixer {
            Mixer::Attention(a) => {
                let (x, input) = a.input(x, &self.input_norm, shared_kv.is_none())?;
                let (r, kv) = a.forward(input, rows, mask, offsets, cache, idx, shared_kv)?;
                (r, x, Some(kv))
            }
            Mixer::Linear(l) => {
                let (x, normed) = x.normed(&self.input_norm)?;
                (l.forward(&normed, rows, padding, cache, idx)?, x, None)
            }
        };
        Ok((self.feed_forward(&x, &r, per_layer_input)?, kv))
    }

    /// Everything after the mixer: `x` plus the mixer's output `r`, the
    /// feed-forward part and its residual (with Gemma's sandwich norms,
    /// experts, per-layer input and scale). Without sandwich norms the
    /// last residual add is left to the next norm.
    fn feed_forward(&self, x: &Array, r: &Array, per_layer_input: Option<&Array>) -> R<Residual> {
        let add = |a: &Array, b: &Array| -> R<Array> {
            if self.clip_f16 {
                residual(a, b)
            } else {
                a.add(b)
            }
        };
        let (Some(pre), Some(post)) = (&self.pre_ff_norm, &self.post_ff_norm) else {
            if let Ffn::Dense(mlp) = &self.mlp {
                let fused = mlp.gated_dense().and_then(|wt| {
                    crate::gpu_fused::normed_product(
                        x,
                        Some(r),
                        self.post_attn_norm.parts(),
                        wt,
                        true,
                    )
                });
                if let Some(fused) = fused {
                    let (h, activation) = fused?;
                    return Ok(Residual::Pending(h, mlp.down.forward(&activation)?));
                }
            }
            let (h, normed) = self.post_attn_norm.forward_added(x, r)?;
            let r = self.mlp.forward(&normed)?;
            return Ok(Residual::Pending(h, r));
        };
        let h = add(x, &self.post_attn_norm.forward(r)?)?;
        let mut r = self.mlp.forward(&pre.forward(&h)?)?;
        if let Some(moe) = &self.moe {
            r = moe.post_mlp_norm.forward(&r)?.add(moe.forward(&h)?)?;
        }
        let mut h = add(&h, &post.forward(&r)?)?;
        if let (Some(gate), Some(input)) = (&self.per_layer, per_layer_input) {
            h = gate.forward(&h, input)?;
        }
        if let Some(s) = &self.scalar {
            h = h.multiply(s)?;
        }
        Ok(Residual::Sum(h))
    }
}

/// The residual stream between layers: `h`, or `h + r` not yet added, so
/// that the norm reading it adds it in its own node
/// ([`RmsNorm::forward_added`]: one node on the CPU where the add and the
/// norm are two).
enum Residual {
    Sum(Array),
    Pending(Array, Array),
}

impl Residual {
    /// The stream, added, and its norm by `norm`.
    fn normed(self, norm: &RmsNorm) -> R<(Array, Array)> {
        match self {
            Residual::Sum(h) => {
                let normed = norm.forward(&h)?;
                Ok((h, normed))
            }
            Residual::Pending(h, r) => norm.forward_added(&h, &r),
        }
    }

    /// The stream, added, and `norm(stream) @ w.T` (`gated`: the stacked
    /// gate/up weight's activation) by one GPU kernel
    /// ([`crate::gpu_fused::normed_product`]); `None` where it does not
    /// apply.
    fn normed_product(&self, norm: &RmsNorm, wt: &Array, gated: bool) -> Option<R<(Array, Array)>> {
        let (h, r) = self.parts();
        crate::gpu_fused::normed_product(h, r, norm.parts(), wt, gated)
    }

    /// The stream and what is still to be added to it.
    fn parts(&self) -> (&Array, Option<&Array>) {
        match self {
            Residual::Sum(h) => (h, None),
            Residual::Pending(h, r) => (h, Some(r)),
        }
    }

    /// The stream, added.
    fn sum(self) -> R<Array> {
        match self {
            Residual::Sum(h) => Ok(h),
            Residual::Pending(h, r) => h.add(&r),
        }
    }
}

/// Whether MLX fuses attention for every attention layer's head width
/// ([`crate::ragged::mlx_fuses`]).
fn attention_fused(layers: &[Layer]) -> bool {
    layers.iter().all(|l| match &l.mixer {
        Mixer::Attention(a) => crate::ragged::mlx_fuses(a.head_dim),
        Mixer::Linear(_) => true,
    })
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

/// One layer's q, k and v projections of a row stream (and Qwen 3.5's
/// gate): `[rows, width]` each, or `[B, L, width]` for such an input.
struct Projected {
    q: Array,
    /// None where the layer reads another layer's keys and values.
    k: Option<Array>,
    v: Option<Array>,
    gate: Option<Array>,
}

impl Projected {
    /// The rows of each segment (split at `bounds`), for a stream of 2-D
    /// rows.
    fn split(self, bounds: &[i32]) -> R<Vec<Projected>> {
        let parts = |a: Option<Array>| -> R<Vec<Option<Array>>> {
            Ok(match a {
                Some(a) => a
                    .split_at_indices(bounds, 0)?
                    .into_iter()
                    .map(Some)
                    .collect(),
                None => vec![None; bounds.len() + 1],
            })
        };
        let q = self.q.split_at_indices(bounds, 0)?;
        let (k, v, gate) = (parts(self.k)?, parts(self.v)?, parts(self.gate)?);
        Ok(q.into_iter()
            .zip(k)
            .zip(v)
            .zip(gate)
            .map(|(((q, k), v), gate)| Projected { q, k, v, gate })
            .collect())
    }
}

/// What an attention layer starts from: the normed stream, or its stacked
/// q/k/v product made from the stream with the norm in one GPU kernel.
enum AttnInput {
    Normed(Array),
    Qkv(Array),
}

impl Attention {
    /// The residual stream `x`, added, and this layer's [`AttnInput`] from
    /// it: the q/k/v product with `norm` in it where the heads come from
    /// the stacked product (`own_kv`: the layer writes its own keys and
    /// values) and [`crate::gpu_fused::normed_product`] takes it.
    fn input(&self, x: Residual, norm: &RmsNorm, own_kv: bool) -> R<(Array, AttnInput)> {
        let dtype = x.parts().0.dtype();
        let stacked = self
            .qkv
            .stacked_dense()
            .filter(|_| self.takes_fused_heads(dtype, own_kv));
        if let Some(fused) = stacked.and_then(|wt| x.normed_product(norm, wt, false)) {
            let (h, qkv) = fused?;
            return Ok((h, AttnInput::Qkv(qkv)));
        }
        let (h, normed) = x.normed(norm)?;
        Ok((h, AttnInput::Normed(normed)))
    }

    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: AttnInput,
        rows: (i32, i32),
        mask: &AttnMask,
        offsets: &Offsets,
        cache: &mut KvCache,
        idx: usize,
        shared_kv: Option<LayerView>,
    ) -> anyhow::Result<(Array, LayerView)> {
        let qkv = match x {
            AttnInput::Qkv(qkv) => qkv,
            AttnInput::Normed(x) if self.takes_fused_heads(x.dtype(), shared_kv.is_none()) => {
                self.qkv.joined(&x).expect("stacked projections")?
            }
            AttnInput::Normed(x) => {
                let p = self.project(&x)?;
                let (heads, kv) = self.attend(p, rows, mask, offsets, cache, idx, shared_kv)?;
                return Ok((self.o.forward(&heads)?, kv));
            }
        };
        let out_shape = merged_shape(&qkv, self.heads * self.head_dim);
        let (heads, kv) = self.attend_fused(&qkv, rows, mask, offsets, cache, idx, &out_shape)?;
        Ok((self.o.forward(&heads)?, kv))
    }

    /// [`Attention::forward`] of a mixed forward's rows (`[rows, hidden]`):
    /// one q/k/v product and one output product over every segment's
    /// rows, attention per segment against its own cache.
    fn forward_mixed(
        &self,
        x: AttnInput,
        segments: &mut [Segment<'_>],
        layouts: &[SegmentLayout],
        windowed: bool,
        idx: usize,
        shared_kv: &[Option<LayerView>],
    ) -> anyhow::Result<(Array, Vec<LayerView>)> {
        // Each segment's heads as its forward alone makes them (the same
        // node, so the same numbers), over one stacked product of every row.
        let qkv = match x {
            AttnInput::Qkv(qkv) => qkv,
            AttnInput::Normed(x)
                if self.takes_fused_heads(x.dtype(), shared_kv.iter().all(Option::is_none)) =>
            {
                self.qkv.joined(&x).expect("stacked projections")?
            }
            AttnInput::Normed(x) => {
                return self
                    .forward_mixed_projected(&x, segments, layouts, windowed, idx, shared_kv)
            }
        };
        let bounds: Vec<i32> = layouts[1..].iter().map(|l| l.first_row).collect();
        let parts = qkv.split_at_indices(&bounds, 0)?;
        let mut heads = Vec::with_capacity(parts.len());
        let mut kvs = Vec::with_capacity(parts.len());
        for ((qkv, segment), layout) in parts.iter().zip(segments).zip(layouts) {
            let out_shape = merged_shape(qkv, self.heads * self.head_dim);
            let (h, kv) = self.attend_fused(
                qkv,
                layout.rows,
                layout.mask(windowed),
                &layout.offsets,
                segment.cache,
                idx,
                &out_shape,
            )?;
            heads.push(h);
            kvs.push(kv);
        }
        Ok((self.o.forward(&ops::concatenate(&heads, 0)?)?, kvs))
    }

    /// [`Attention::forward_mixed`] by separate q, k and v projections.
    fn forward_mixed_projected(
        &self,
        x: &Array,
        segments: &mut [Segment<'_>],
        layouts: &[SegmentLayout],
        windowed: bool,
        idx: usize,
        shared_kv: &[Option<LayerView>],
    ) -> anyhow::Result<(Array, Vec<LayerView>)> {
        let bounds: Vec<i32> = layouts[1..].iter().map(|l| l.first_row).collect();
        let parts = self.project(x)?.split(&bounds)?;
        let mut heads = Vec::with_capacity(parts.len());
        let mut kvs = Vec::with_capacity(parts.len());
        for (((p, segment), layout), shared) in
            parts.into_iter().zip(segments).zip(layouts).zip(shared_kv)
        {
            let (h, kv) = self.attend(
                p,
                layout.rows,
                layout.mask(windowed),
                &layout.offsets,
                segment.cache,
                idx,
                shared.clone(),
            )?;
            heads.push(h);
            kvs.push(kv);
        }
        Ok((self.o.forward(&ops::concatenate(&heads, 0)?)?, kvs))
    }

    /// Whether the heads come from the stacked product in one kernel (GPU)
    /// or node (CPU) for activations of `dtype` ([`Attention::attend_fused`]);
    /// `own_kv`: the layer writes its own keys and values (one that reads
    /// another layer's takes the separate projections).
    fn takes_fused_heads(&self, dtype: Dtype, own_kv: bool) -> bool {
        own_kv
            && self.heads_spec().is_some_and(|spec| {
                crate::gpu_fused::takes_heads(dtype, &spec)
                    || crate::cpu_fused::takes_heads(dtype, &spec)
            })
    }

    /// Attention of `(b, l)` positions from their stacked q/k/v product
    /// `qkv` (`[B * L, width]`), its heads made in one kernel or node and
    /// written to `cache`: the heads merged as rows of `out_shape`, for the
    /// output product. For a layer [`Attention::takes_fused_heads`] takes.
    #[allow(clippy::too_many_arguments)]
    fn attend_fused(
        &self,
        qkv: &Array,
        rows: (i32, i32),
        mask: &AttnMask,
        offsets: &Offsets,
        cache: &mut KvCache,
        idx: usize,
        out_shape: &[i32],
    ) -> anyhow::Result<(Array, LayerView)> {
        let spec = self.heads_spec().expect("a layer with fused heads");
        let on_gpu = crate::gpu_fused::takes_heads(qkv.dtype(), &spec);
        // On the GPU a paged layer's keys and values go straight into the
        // pool, or, at the layer's first write, come out as the pool's
        // rows, written with no reshape between.
        if on_gpu {
            if let Some(target) = cache.pool_target(idx, qkv.dtype(), rows.1)? {
                // One position a row under the ragged kernel: the heads are
                // made, and the pool written, in attention's own kernel.
                let in_attention = match mask {
                    AttnMask::Ragged(r)
                        if rows.1 == 1 && r.kernel && crate::ragged::heads_in_attention() =>
                    {
                        cache.pool_read().map(|read| (r, read))
                    }
                    _ => None,
                };
                if let Some((r, read)) = in_attention.filter(|(_, read)| {
                    crate::ragged::takes_heads_in_attention(
                        &spec,
                        qkv.dtype(),
                        &target,
                        &read.tables,
                    )
                }) {
                    let out = crate::ragged::paged_attention_from_qkv(
                        qkv, &spec, offsets, &target, self.scale, &r.meta, &read, out_shape,
                    )?;
                    let kv = cache.wrote_pool(idx, target, out.clone())?;
                    return Ok((out, kv));
                }
                let (q, written) =
                    crate::gpu_fused::heads_into_pool(qkv, rows, &spec, offsets, &target)?;
                let kv = cache.wrote_pool(idx, target, written)?;
                return self.attention(q, None, kv, mask, rows.1, out_shape);
            }
        }
        let as_rows = on_gpu && cache.takes_rows(idx);
        let (q, k, v) = if on_gpu {
            crate::gpu_fused::heads(qkv, rows, &spec, offsets, as_rows)?
        } else {
            let inv = self.rope.cpu_inverse_frequencies()?;
            crate::cpu_fused::heads(qkv, rows, &spec, offsets, inv)?
        };
        let kv = match as_rows {
            true => cache.update_rows(idx, k, v, rows.1)?,
            false => cache.update(idx, k, v)?,
        };
        self.attention(q, None, kv, mask, rows.1, out_shape)
    }

    /// The q, k and v (and gate) projections of `x`.
    fn project(&self, x: &Array) -> R<Projected> {
        let out_shape = merged_shape(x, self.heads * self.head_dim);
        let mut qkv = self.qkv.forward(x)?.into_iter();
        let q = qkv.next().unwrap();
        let (q, gate) = match self.gated {
            true => {
                let halves =
                    ops::split_equal(&q.reshape(&[-1, self.heads, 2 * self.head_dim])?, 2, -1)?;
                let gate = halves[1].reshape(&out_shape)?;
                (halves[0].reshape(&out_shape)?, Some(gate))
            }
            false => (q, None),
        };
        let k = qkv.next();
        // Without v_proj the values are the keys before their norm and
        // rotation.
        let v = qkv.next().or_else(|| k.clone());
        Ok(Projected { q, k, v, gate })
    }

    /// Attention of `(b, l)` positions' projections `p` against `cache`
    /// (after writing their keys and values to it, unless the layer reads
    /// `shared_kv`): the heads merged as rows of `p.q`'s shape, gated,
    /// before the output product.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        p: Projected,
        (b, l): (i32, i32),
        mask: &AttnMask,
        offsets: &Offsets,
        cache: &mut KvCache,
        idx: usize,
        shared_kv: Option<LayerView>,
    ) -> anyhow::Result<(Array, LayerView)> {
        let out_shape = p.q.shape().to_vec();
        let gate = p.gate;
        // `[B, n, L, head_dim]`. One position a row needs no Transpose:
        // `[B, 1, n, D]` and `[B, n, 1, D]` lay the data out alike.
        let heads = |t: Array, n: i32, norm: &Option<RmsNorm>| -> R<Array> {
            let split = match l {
                1 => [b, n, 1, self.head_dim],
                _ => [b, l, n, self.head_dim],
            };
            let mut t = t.reshape(&split)?;
            if let Some(norm) = norm {
                t = norm.forward(&t)?;
            }
            match l {
                1 => Ok(t),
                _ => t.transpose_axes(&[0, 2, 1, 3]),
            }
        };
        let q = heads(p.q, self.heads, &self.q_norm)?;
        let q = self.rope.forward(&q, offsets)?;
        let kv = match shared_kv {
            Some(kv) => kv,
            None => {
                let (Some(k_raw), Some(v_raw)) = (p.k, p.v) else {
                    anyhow::bail!("layer {idx} reads another layer's keys and values, none given");
                };
                let k = heads(k_raw, self.kv_heads, &self.k_norm)?;
                let mut v = heads(v_raw, self.kv_heads, &None)?;
                if let Some(eps) = self.v_norm {
                    v = crate::cpu_fused::rms_norm(&v, None, eps)?;
                }
                let k = self.rope.forward(&k, offsets)?;
                cache.update(idx, k, v)?
            }
        };
        self.attention(q, gate, kv, mask, l, &out_shape)
    }

    /// The layout the fused heads ([`crate::gpu_fused::heads`],
    /// [`crate::cpu_fused::heads`]) need: q, k and v stacked in one product
    /// (no gate, no value norm), q and k both normed or neither.
    fn heads_spec(&self) -> Option<crate::gpu_fused::HeadsSpec<'_>> {
        let (q, k, d) = (self.heads, self.kv_heads, self.head_dim);
        if self.gated || self.v_norm.is_some() || self.qkv.stacked_sizes()? != [q * d, k * d, k * d]
        {
            return None;
        }
        let norms = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => {
                let ((qw, eps), (kw, k_eps)) = (qn.parts(), kn.parts());
                (eps == k_eps).then_some(Some((qw, kw, eps)))?
            }
            (None, None) => None,
            _ => return None,
        };
        Some(crate::gpu_fused::HeadsSpec {
            heads: q,
            kv_heads: k,
            head_dim: d,
            norms,
            rope: self.rope.spec(),
        })
    }

    /// Attention of the heads `q` (`[B, heads, L, D]`) over the layer's
    /// keys and values `kv`: the heads merged as rows of `out_shape`,
    /// gated, before the output product.
    fn attention(
        &self,
        q: Array,
        gate: Option<Array>,
        kv: LayerView,
        mask: &AttnMask,
        l: i32,
        out_shape: &[i32],
    ) -> anyhow::Result<(Array, LayerView)> {
        let out_shape = out_shape.to_vec();
        let dequantized;
        let (k, v) = match &kv {
            LayerView::Dense(k, v) => (k, v),
            // A paged layer: the kernel reads the rows' blocks in place;
            // elsewhere attention reads a gathered copy.
            LayerView::Paged {
                keys,
                values,
                written,
                read,
            } => match mask {
                AttnMask::Ragged(r)
                    if r.kernel && crate::ragged::applies_paged(&q, keys, &read.tables) =>
                {
                    let out = crate::ragged::paged_attention(
                        &q,
                        keys,
                        values,
                        self.scale,
                        &r.meta,
                        read,
                        written.as_ref(),
                        Some(&out_shape),
                    )?;
                    return Ok((gated_rows(out, gate.as_ref())?, kv));
                }
                _ => {
                    dequantized = kv.dense()?;
                    (&dequantized.0, &dequantized.1)
                }
            },
            // MLX's CUDA backend has no quantized matmul for attention's
            // shapes (a 513-position prefill fails on the H100): on the GPU
            // attention reads a dequantized copy, one layer at a time.
            LayerView::Quantized { .. } if crate::mask::on_gpu() => {
                dequantized = kv.dense()?;
                (&dequantized.0, &dequantized.1)
            }
            LayerView::Quantized {
                quant,
                keys,
                values,
            } => {
                let mask = mask.as_array(l, keys[0].dim(2))?;
                let out = quant.attention(&q, keys, values, self.scale, mask.as_ref())?;
                return Ok((merge_heads(out, gate.as_ref(), &out_shape)?, kv));
            }
        };
        // The CPU's one-node attention where it takes them, else MLX's.
        if crate::cpu_fused::enabled() {
            let seen = mask.keys_seen(l, k.dim(2));
            if let Some(seen) = seen.filter(|s| crate::cpu_fused::takes_attention(&q, k, v, s)) {
                let out = crate::cpu_fused::attention(&q, k, v, self.scale, &seen, None)?;
                return Ok((merge_heads(out, gate.as_ref(), &out_shape)?, kv));
            }
        }
        let out = match mask {
            AttnMask::None => fast::scaled_dot_product_attention(&q, k, v, self.scale, None, None)?,
            AttnMask::Causal => fast::scaled_dot_product_attention(
                &q,
                k,
                v,
                self.scale,
                ScaledDotProductAttentionMask::Causal,
                None,
            )?,
            AttnMask::Array(m) => {
                fast::scaled_dot_product_attention(&q, k, v, self.scale, m, None)?
            }
            AttnMask::Ragged(r) if r.kernel && crate::ragged::applies(&q, k) => {
                let out =
                    crate::ragged::attention(&q, k, v, self.scale, &r.meta, Some(&out_shape))?;
                return Ok((gated_rows(out, gate.as_ref())?, kv));
            }
            AttnMask::Ragged(r) => {
                let m = mask::ragged_mask(&r.starts, l, k.dim(2), r.window);
                fast::scaled_dot_product_attention(&q, k, v, self.scale, &m, None)?
            }
        };
        Ok((merge_heads(out, gate.as_ref(), &out_shape)?, kv))
    }
}

/// `x`'s shape with its last axis `width`: the merged heads' rows of a
/// stream of `x`'s rows.
fn merged_shape(x: &Array, width: i32) -> Vec<i32> {
    let mut shape = x.shape()[..x.ndim() - 1].to_vec();
    shape.push(width);
    shape
}

/// The heads' `[B, heads, L, head_dim]` as rows of `shape`, gated per head
/// where the layer has a gate (Qwen 3.5), for the output product.
fn merge_heads(heads: Array, gate: Option<&Array>, shape: &[i32]) -> R<Array> {
    let out = match heads.dim(2) {
        1 => heads.reshape(shape)?,
        _ => heads.transpose_axes(&[0, 2, 1, 3])?.reshape(shape)?,
    };
    gated_rows(out, gate)
}

/// Merged heads' rows, gated per head where the layer has a gate.
fn gated_rows(rows: Array, gate: Option<&Array>) -> R<Array> {
    match gate {
        Some(gate) => rows.multiply(ops::sigmoid(gate)?),
        None => Ok(rows),
    }
}

impl Ffn {
    fn forward(&self, x: &Array) -> R<Array> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::Sparse(m) => m.forward(x),
        }
    }
}

impl Mlp {
    /// `{p}.{gate,up,down}_proj` of width `inter`; GELU in Gemma's.
    fn load(w: &mut Weights, cfg: &ModelConfig, p: &str, inter: i32) -> anyhow::Result<Self> {
        let h = cfg.hidden_size;
        let linear = |w: &mut Weights, name: &str, out: i32, inp: i32| {
            Linear::load_checked(w, name, cfg.quant_for(name), out, inp)
        };
        Ok(Self {
            gate_up: Projections::new(vec![
                linear(w, &format!("{p}.gate_proj"), inter, h)?,
                linear(w, &format!("{p}.up_proj"), inter, h)?,
            ])?,
            down: linear(w, &format!("{p}.down_proj"), h, inter)?,
            gelu: matches!(cfg.family, Family::Gemma3 | Family::Gemma4),
        })
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.gate_up.collect(out);
        self.down.collect(out);
    }

    /// The stacked gate/up weight a GPU kernel of ours reads with the
    /// SiLU activation (`[in, 2 * inter]`); `None` for GELU's MLPs, or
    /// separate, quantized or biased projections.
    fn gated_dense(&self) -> Option<&Array> {
        self.gate_up.stacked_dense().filter(|_| !self.gelu)
    }

    fn forward(&self, x: &Array) -> R<Array> {
        // On the GPU, one kernel for the product and the activation at a
        // few rows, one from the stacked product to the activation beyond.
        if !self.gelu {
            let fused = self.gated_dense();
            if let Some(wt) = fused.filter(|wt| crate::gpu_fused::takes_product(x, wt, true)) {
                return self.down.forward(&crate::gpu_fused::product(x, wt, true)?);
            }
            if crate::gpu_fused::takes_gated(x.dtype()) {
                if let Some(gu) = self.gate_up.joined(x) {
                    return self.down.forward(&crate::gpu_fused::gated(&gu?)?);
                }
            }
        }
        // On the CPU, one node from the stacked product to the activation.
        if crate::cpu_fused::enabled() {
            if let Some(gu) = self.gate_up.joined(x) {
                return self
                    .down
                    .forward(&crate::cpu_fused::gated_halves(&gu?, self.gelu)?);
            }
        }
        let mut gu = self.gate_up.forward(x)?.into_iter();
        let (g, u) = (gu.next().unwrap(), gu.next().unwrap());
        self.down.forward(&activations::gated(&g, &u, self.gelu)?)
    }
}
