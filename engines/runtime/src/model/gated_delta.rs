//! Qwen 3.5's linear-attention layers: Gated DeltaNet. A causal depthwise
//! convolution over q, k and v, then the gated delta rule, a recurrence
//! whose per-sequence state replaces keys and values:
//!
//! ```text
//! S = S * g;  S = S + k (beta (v - S k))^T;  y = S q
//! ```
//!
//! The state lives in the cache ([`Recurrent`]) beside the other layers'
//! keys and values. Positions a mask marks as padding change neither the
//! convolution's inputs (zeroed) nor the state (kept), so left padding of a
//! batch is not folded into any row's state.

use mlx_rs::{fast, nn, ops, Array, Dtype};

use crate::cache::{slice, KvCache, Recurrent, Steps, MAX_ROLLBACK_STEPS};
use crate::config::{HybridConfig, ModelConfig};
use crate::layers::{Linear, Projections, RmsNorm};
use crate::weights::Weights;

type R<T> = Result<T, mlx_rs::error::Exception>;

/// The l2-norm epsilon of q and k (Qwen 3.5's reference value).
const QK_EPS: f32 = 1e-6;

pub(super) struct GatedDeltaNet {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    proj: Projections,
    /// `[conv_dim, kernel, 1]`: one filter per channel.
    conv: Array,
    /// `-exp(A_log)` in float32: the decay rate per value head.
    neg_a: Array,
    dt_bias: Array,
    /// Gated RMSNorm over each value head.
    norm: RmsNorm,
    out: Linear,
    geometry: HybridConfig,
}

impl GatedDeltaNet {
    pub fn load(w: &mut Weights, cfg: &ModelConfig, p: &str) -> anyhow::Result<Self> {
        let g = cfg
            .hybrid
            .clone()
            .expect("a linear layer has a hybrid config");
        let h = cfg.hidden_size;
        let (key_dim, value_dim) = (
            g.key_heads * g.key_head_dim,
            g.value_heads * g.value_head_dim,
        );
        let conv_dim = g.conv_dim();
        let linear = |w: &mut Weights, n: &str, out: i32, inp: i32| {
            let name = format!("{p}.{n}");
            Linear::load_checked(w, &name, cfg.quant_for(&name), out, inp)
        };
        let proj = Projections::new(vec![
            linear(w, "in_proj_qkv", 2 * key_dim + value_dim, h)?,
            linear(w, "in_proj_z", value_dim, h)?,
            linear(w, "in_proj_b", g.value_heads, h)?,
            linear(w, "in_proj_a", g.value_heads, h)?,
        ])?;
        let conv = w.take(&format!("{p}.conv1d.weight"))?;
        let conv = if conv.shape() == [conv_dim, 1, g.conv_kernel] {
            // Hugging Face (PyTorch) layout.
            conv.swap_axes(1, 2)?
        } else {
            w.check_shape(
                &format!("{p}.conv1d.weight"),
                &conv,
                &[conv_dim, g.conv_kernel, 1],
            )?;
            conv
        };
        let a_log = w.take_shaped(&format!("{p}.A_log"), &[g.value_heads])?;
        let neg_a = ops::exp(a_log.as_dtype(Dtype::Float32)?)?.negative()?;
        Ok(Self {
            proj,
            conv,
            neg_a,
            dt_bias: w.take_shaped(&format!("{p}.dt_bias"), &[g.value_heads])?,
            norm: RmsNorm::load_sized(
                w,
                &format!("{p}.norm"),
                g.value_head_dim,
                cfg.rms_norm_eps,
                false,
            )?,
            out: linear(w, "out_proj", h, value_dim)?,
            geometry: g,
        })
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.proj.collect(out);
        out.extend([&self.conv, &self.neg_a, &self.dt_bias]);
        self.norm.collect(out);
        self.out.collect(out);
    }

    /// `x`: `[B, S, hidden]`; `mask`: `[B, S]`, false at padding. Reads and
    /// replaces layer `idx`'s recurrent state in `cache`.
    pub fn forward(
        &self,
        x: &Array,
        mask: Option<&Array>,
        cache: &mut KvCache,
        idx: usize,
    ) -> anyhow::Result<Array> {
        let g = &self.geometry;
        let (b, s) = (x.dim(0), x.dim(1));
        let key_dim = g.key_heads * g.key_head_dim;
        let mut parts = self.proj.forward(x)?.into_iter();
        let (mut qkv, z, beta_in, a) = (
            parts.next().unwrap(),
            parts.next().unwrap(),
            parts.next().unwrap(),
            parts.next().unwrap(),
        );
        let z = z.reshape(&[b, s, g.value_heads, g.value_head_dim])?;
        let before = match cache.recurrent(idx) {
            Some(r) => r.clone(),
            None => Recurrent {
                conv: ops::zeros_dtype(&[b, g.conv_kernel - 1, g.conv_dim()], x.dtype())?,
                ssm: ops::zeros_dtype(
                    &[b, g.value_heads, g.value_head_dim, g.key_head_dim],
                    Dtype::Float32,
                )?,
            },
        };
        if let Some(m) = mask {
            qkv = ops::select(
                m.expand_dims(-1)?,
                &qkv,
                Array::from_f32(0.0).as_dtype(qkv.dtype())?,
            )?;
        }
        let conv_input = ops::concatenate(&[&before.conv, &qkv], 1)?;
        let conv_out = nn::silu(ops::conv1d(&conv_input, &self.conv, 1, 0, 1, g.conv_dim())?)?;
        let qkv = ops::split_at_indices(&conv_out, &[key_dim, 2 * key_dim], -1)?;
        let heads = |t: &Array, n: i32, d: i32| t.reshape(&[b, s, n, d]);
        let q = heads(&qkv[0], g.key_heads, g.key_head_dim)?;
        let k = heads(&qkv[1], g.key_heads, g.key_head_dim)?;
        let v = heads(&qkv[2], g.value_heads, g.value_head_dim)?;
        // L2-normalised q and k, the readout scale folded into q (as an RMS
        // norm: its epsilon scaled to the mean).
        let inv = (g.key_head_dim as f32).powf(-0.5);
        let eps = QK_EPS * inv * inv;
        let q = fast::rms_norm(&q, None, eps)?.multiply(Array::from_f32(inv * inv))?;
        let k = fast::rms_norm(&k, None, eps)?.multiply(Array::from_f32(inv))?;
        let (q, k) = (self.repeat_heads(&q)?, self.repeat_heads(&k)?);
        let beta = ops::sigmoid(&beta_in)?;
        let decay = ops::exp(self.neg_a.multiply(nn::softplus(a.add(&self.dt_bias)?)?)?)?;
        let keep_steps = cache.keeps_steps() && s <= MAX_ROLLBACK_STEPS;
        let mut state = before.ssm.clone();
        let mut ys = Vec::with_capacity(s as usize);
        let mut steps = Vec::new();
        // Each position's slices, as views (no gather kernel per step).
        let positions = |x: &Array| -> Result<Vec<Array>, mlx_rs::error::Exception> {
            match s {
                1 => Ok(vec![x.clone()]),
                _ => ops::split_equal(x, s, 1),
            }
        };
        let (qs, ks, vs) = (positions(&q)?, positions(&k)?, positions(&v)?);
        let (decays, betas) = (positions(&decay)?, positions(&beta)?);
        let masks = mask.map(positions).transpose()?;
        for t in 0..s as usize {
            let at = |x: &Array| x.squeeze_axes(&[1]);
            let (qt, kt, vt) = (at(&qs[t])?, at(&ks[t])?, at(&vs[t])?);
            let old = state.clone();
            state = state.multiply(at(&decays[t])?.expand_dims_axes(&[-1, -2])?)?;
            let kt = kt.expand_dims(-2)?;
            let remembered = state.multiply(&kt)?.sum_axis(-1, false)?;
            let delta = vt
                .subtract(&remembered)?
                .multiply(at(&betas[t])?.expand_dims(-1)?)?;
            state = state.add(kt.multiply(delta.expand_dims(-1)?)?)?;
            let y = state.multiply(qt.expand_dims(-2)?)?.sum_axis(-1, false)?;
            if let Some(m) = &masks {
                let real = m[t].reshape(&[b, 1, 1, 1])?;
                state = ops::select(&real, &state, &old)?;
            }
            ys.push(y.as_dtype(x.dtype())?);
            if keep_steps {
                steps.push(state.clone());
            }
        }
        let keep = g.conv_kernel - 1;
        let total = conv_input.dim(1);
        let conv_state = slice(
            &conv_input,
            &[0, total - keep, 0],
            &[b, total, g.conv_dim()],
        )?;
        let after = Recurrent {
            conv: conv_state,
            ssm: state,
        };
        let steps = keep_steps.then(|| Steps {
            before,
            conv_input,
            ssm: steps,
        });
        cache.set_recurrent(idx, after, steps);
        let y = ops::stack(&ys, 1)?;
        let normed = self.norm.forward(&y)?;
        let gated = nn::silu(z.as_dtype(Dtype::Float32)?)?
            .multiply(normed.as_dtype(Dtype::Float32)?)?
            .as_dtype(y.dtype())?;
        Ok(self.out.forward(&gated.reshape(&[b, s, -1])?)?)
    }

    /// `[B, S, key_heads, D]` to `[B, S, value_heads, D]`: each key head
    /// serves `value_heads / key_heads` consecutive value heads.
    fn repeat_heads(&self, x: &Array) -> R<Array> {
        let g = &self.geometry;
        let r = g.value_heads / g.key_heads;
        if r == 1 {
            return Ok(x.clone());
        }
        let s = x.shape().to_vec();
        ops::broadcast_to(x.expand_dims(-2)?, &[s[0], s[1], s[2], r, s[3]])?.reshape(&[
            s[0],
            s[1],
            g.value_heads,
            s[3],
        ])
    }
}
