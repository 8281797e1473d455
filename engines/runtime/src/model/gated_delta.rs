//! Qwen 3.5's linear-attention layers: Gated DeltaNet. A causal depthwise
//! convolution over q, k and v, then the gated delta rule, a recurrence
//! whose per-sequence state replaces keys and values:
//!
//! ```text
//! S = S * g;  S = S + (beta (v - S k)) k^T;  y = S q
//! ```
//!
//! The state lives in the cache ([`Recurrent`]) beside the other layers'
//! keys and values. Positions a mask marks as padding change neither the
//! convolution's inputs (zeroed) nor the state (decay 1, beta 0), so left
//! padding of a batch is not folded into any row's state.
//!
//! The rule runs in one of two forms with the same result: a loop over
//! positions ([`delta_rule_steps`]: decode, and verify forwards whose
//! per-position states rollback keeps) or chunk by chunk with matrix
//! products ([`delta_rule_chunked`]: prefill).

use std::cell::RefCell;

use mlx_rs::transforms::compile::compile;
use mlx_rs::{fast, nn, ops, Array, Dtype};

use crate::activations::{call as fused, Fused};
use crate::cache::{KvCache, Recurrent, Steps, MAX_ROLLBACK_STEPS};
use crate::config::{HybridConfig, ModelConfig};
use crate::layers::{Linear, Projections, RmsNorm};
use crate::slices::slice;
use crate::weights::Weights;

type R<T> = Result<T, mlx_rs::error::Exception>;

/// The l2-norm epsilon of q and k (Qwen 3.5's reference value).
const QK_EPS: f32 = 1e-6;

// The element-wise parts of a decode step as compiled (fused) kernels, as
// mlx-lm compiles its step: on a GPU every unfused op is a kernel launch,
// and one token's step is small (measured on an H100: about a tenth less
// device time per Qwen3.5-4B step, docs/benchmarks.md).

/// `[neg_a, a, dt_bias]` to the log decay `neg_a * softplus(a + dt_bias)`.
fn log_decay_kernel(args: &[Array]) -> Vec<Array> {
    let log_decay = nn::softplus(args[1].add(&args[2]).expect("broadcast add"))
        .and_then(|sp| args[0].multiply(sp))
        .expect("log decay");
    vec![log_decay]
}

/// One position of the rule: `[q, k, v, log_decay, beta, state]` (each
/// without the position axis) to `[y, state]`.
fn step_kernel(args: &[Array]) -> Vec<Array> {
    let step = || -> R<Vec<Array>> {
        let [q, k, v, log_decay, beta, state] = args else {
            unreachable!("six inputs")
        };
        let decay = ops::exp(log_decay)?.expand_dims_axes(&[-1, -2])?;
        let state = state.multiply(decay)?;
        let k = k.expand_dims(-2)?;
        let remembered = state.multiply(&k)?.sum_axis(-1, false)?;
        let delta = v.subtract(&remembered)?.multiply(beta.expand_dims(-1)?)?;
        let state = state.add(k.multiply(delta.expand_dims(-1)?)?)?;
        let y = state.multiply(q.expand_dims(-2)?)?.sum_axis(-1, false)?;
        Ok(vec![y, state])
    };
    step().expect("delta rule step")
}

/// `[z, normed]` to `silu(z) * normed` in float32, in `normed`'s dtype.
fn gate_kernel(args: &[Array]) -> Vec<Array> {
    let f32 = |a: &Array| a.as_dtype(Dtype::Float32);
    let gated = f32(&args[0])
        .and_then(|z| nn::silu(z))
        .and_then(|z| z.multiply(f32(&args[1])?))
        .and_then(|g| g.as_dtype(args[1].dtype()))
        .expect("output gate");
    vec![gated]
}

thread_local! {
    // Compiled once per thread. The step is traced per shape (its
    // reductions and expansions are not shapeless); shapes are fixed
    // through a decode.
    static LOG_DECAY: RefCell<Fused> = RefCell::new(Box::new(compile(log_decay_kernel, true)));
    static STEP: RefCell<Fused> = RefCell::new(Box::new(compile(step_kernel, false)));
    static GATE: RefCell<Fused> = RefCell::new(Box::new(compile(gate_kernel, true)));
}

/// Positions per chunk of the chunked form (a power of two: the
/// triangular inverse doubles its blocks up to it).
pub const CHUNK: i32 = 64;

/// Forwards of at least this many positions (without per-position states
/// to keep) take the chunked form; shorter ones loop, which is cheaper
/// there (measured on the CPU, see docs/qwen35.md).
pub const CHUNKED_FROM: i32 = 8;

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

    /// `x`: `(b, s)` positions as `[B * S, hidden]` or `[B, S, hidden]`
    /// (the output keeps its shape); `mask`: `[B, S]`, false at padding.
    /// Reads and replaces layer `idx`'s recurrent state in `cache`.
    pub fn forward(
        &self,
        x: &Array,
        (b, s): (i32, i32),
        mask: Option<&Array>,
        cache: &mut KvCache,
        idx: usize,
    ) -> anyhow::Result<Array> {
        let g = &self.geometry;
        let mut out_shape = x.shape()[..x.ndim() - 1].to_vec();
        out_shape.push(-1);
        let x = &x.reshape(&[b, s, -1])?;
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
        let mut inputs = DeltaInputs {
            q: self.repeat_heads(&q)?,
            k: self.repeat_heads(&k)?,
            v,
            log_decay: fused(&LOG_DECAY, &[self.neg_a.clone(), a, self.dt_bias.clone()])?.remove(0),
            beta: ops::sigmoid(&beta_in)?,
        };
        if let Some(m) = mask {
            inputs = inputs.masked(m)?;
        }
        let keep_steps = cache.keeps_steps() && s <= MAX_ROLLBACK_STEPS;
        let (y, state, steps) = if keep_steps || s < CHUNKED_FROM {
            delta_rule_steps(&inputs, &before.ssm, keep_steps)?
        } else {
            let (y, state) = delta_rule_chunked(&inputs, &before.ssm)?;
            (y, state, Vec::new())
        };
        let y = y.as_dtype(x.dtype())?;
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
        let normed = self.norm.forward(&y)?;
        let gated = fused(&GATE, &[z, normed])?.remove(0);
        Ok(self.out.forward(&gated.reshape(&out_shape)?)?)
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

/// The gated delta rule's per-position inputs, one set per value head.
pub struct DeltaInputs {
    /// `[B, S, H, Dk]`: l2-normed queries (the readout scale folded in).
    pub q: Array,
    /// `[B, S, H, Dk]`: l2-normed keys.
    pub k: Array,
    /// `[B, S, H, Dv]`.
    pub v: Array,
    /// `[B, S, H]`, float32: the log of each position's decay g (<= 0).
    pub log_decay: Array,
    /// `[B, S, H]`: each position's write strength.
    pub beta: Array,
}

impl DeltaInputs {
    /// Padding (false in `mask`, `[B, S]`) as decay 1 and beta 0: such a
    /// position leaves the state exactly as it was (`S * 1 + k * 0`), in
    /// both forms of the rule.
    pub fn masked(self, mask: &Array) -> R<Self> {
        let m = mask.expand_dims(-1)?;
        let zero = |a: &Array| Array::from_f32(0.0).as_dtype(a.dtype());
        Ok(Self {
            log_decay: ops::select(&m, &self.log_decay, zero(&self.log_decay)?)?,
            beta: ops::select(&m, &self.beta, zero(&self.beta)?)?,
            ..self
        })
    }
}

/// The rule position by position from `state` (`[B, H, Dv, Dk]`,
/// float32): the outputs `[B, S, H, Dv]` (float32), the final state and,
/// with `keep_steps`, the state after each position.
pub fn delta_rule_steps(
    x: &DeltaInputs,
    state: &Array,
    keep_steps: bool,
) -> R<(Array, Array, Vec<Array>)> {
    let s = x.q.dim(1);
    // Each position's slices, as views (no gather kernel per step).
    let positions = |x: &Array| -> R<Vec<Array>> {
        match s {
            1 => Ok(vec![x.clone()]),
            _ => ops::split_equal(x, s, 1),
        }
    };
    let (qs, ks, vs) = (positions(&x.q)?, positions(&x.k)?, positions(&x.v)?);
    let (decays, betas) = (positions(&x.log_decay)?, positions(&x.beta)?);
    let mut state = state.clone();
    let mut ys = Vec::with_capacity(s as usize);
    let mut steps = Vec::new();
    for t in 0..s as usize {
        let at = |x: &Array| x.squeeze_axes(&[1]);
        let args = [
            qs[t].clone(),
            ks[t].clone(),
            vs[t].clone(),
            decays[t].clone(),
            betas[t].clone(),
        ]
        .iter()
        .map(at)
        .chain([Ok(state)])
        .collect::<R<Vec<_>>>()?;
        let mut out = fused(&STEP, &args)?.into_iter();
        ys.push(out.next().unwrap());
        state = out.next().unwrap();
        if keep_steps {
            steps.push(state.clone());
        }
    }
    Ok((ops::stack(&ys, 1)?, state, steps))
}

/// The rule chunk by chunk, the same result as [`delta_rule_steps`]
/// (without per-position states) in float32: `(y, final state)`.
///
/// Per head, with the state written `S = S0 + sum_i w_i k_i^T` over a
/// chunk's positions (decays aside), the update `S_t = g_t S_{t-1} +
/// beta_t (v_t - g_t S_{t-1} k_t) k_t^T` makes each `w_t` depend on the
/// earlier ones. With `c_t` the cumulative log decay within the chunk,
/// `gamma_t = exp(c_t)` and `A[t][i] = beta_t exp(c_t - c_i) k_t.k_i`
/// (i < t, strictly lower triangular), the chunk's `W` (rows `w_t`) solves
///
/// ```text
/// (I + A) W = diag(beta) (V - diag(gamma) K S0^T)
/// W = U - Wk S0^T,  U = T diag(beta) V,  Wk = T diag(beta gamma) K,  T = (I + A)^-1
/// Y = diag(gamma) Q S0^T + P W = P U + (diag(gamma) Q - P Wk) S0^T
///     with P[t][i] = exp(c_t - c_i) q_t.k_i (i <= t)
/// S_C = gamma_C S0 + W^T diag(exp(c_C - c_i)) K = S0 G + H
///     with G = gamma_C I - Wk^T Kd,  H = U^T Kd,  Kd = diag(exp(c_C - c_i)) K
/// ```
///
/// Everything but the `S0` products is independent of the state, so it
/// runs for all chunks at once; the chunks then chain one `S G + H` each.
/// Decays enter only as `exp` of differences `c_t - c_i <= 0` (nothing
/// divides by a vanishing cumulative product).
pub fn delta_rule_chunked(x: &DeltaInputs, state: &Array) -> anyhow::Result<(Array, Array)> {
    let (b, s, h, dk, dv) = (x.q.dim(0), x.q.dim(1), x.q.dim(2), x.k.dim(3), x.v.dim(3));
    let c = CHUNK.min((s as u32).next_power_of_two() as i32);
    let n = (s + c - 1) / c;
    let pad = n * c - s;
    // [B, S, H, ..] to [B, H, N, C, ..] in float32; the positions padded
    // on at the end are zeros: beta 0 and decay 1, i.e. no change.
    let chunks = |a: &Array| -> R<Array> {
        let a = a.as_dtype(Dtype::Float32)?;
        let nd = a.ndim();
        let a = if pad > 0 {
            let mut width = vec![(0, 0); nd];
            width[1] = (0, pad);
            ops::pad(&a, &width[..], None::<Array>, None)?
        } else {
            a
        };
        if nd == 4 {
            a.reshape(&[b, n, c, h, a.dim(3)])?
                .transpose_axes(&[0, 3, 1, 2, 4])
        } else {
            a.reshape(&[b, n, c, h])?.transpose_axes(&[0, 3, 1, 2])
        }
    };
    let (q, k, v) = (chunks(&x.q)?, chunks(&x.k)?, chunks(&x.v)?);
    let (beta, cum) = (
        chunks(&x.beta)?,
        chunks(&x.log_decay)?.cumsum(-1, false, true)?,
    );
    let gamma = ops::exp(&cum)?;
    let col = |a: &Array| a.expand_dims(-1);
    // exp(c_t - c_i) at and below the diagonal, 0 above (the difference
    // there is positive and may overflow, so it is never exponentiated).
    let lower = Array::tri::<bool>(c, None, None)?;
    let decay = ops::exp(ops::select(
        &lower,
        col(&cum)?.subtract(cum.expand_dims(-2)?)?,
        Array::from_f32(f32::NEG_INFINITY),
    )?)?;
    let t = unit_lower_inverse(&k, &cum, &beta)?;
    let u = t.matmul(v.multiply(col(&beta)?)?)?;
    let wk = t.matmul(k.multiply(col(&beta.multiply(&gamma)?)?)?)?;
    let p = decay.multiply(q.matmul(k.swap_axes(-1, -2)?)?)?;
    let pu = p.matmul(&u)?;
    let q_eff = q.multiply(col(&gamma)?)?.subtract(p.matmul(&wk)?)?;
    let last = slice(&cum, &[0, 0, 0, c - 1], &[b, h, n, c])?;
    let kd = k.multiply(col(&ops::exp(last.subtract(&cum)?)?)?)?;
    let carry_in = u.swap_axes(-1, -2)?.matmul(&kd)?;
    let carry = Array::eye::<f32>(dk, None, None)?
        .multiply(col(&ops::exp(&last)?)?)?
        .subtract(wk.swap_axes(-1, -2)?.matmul(&kd)?)?;
    let per_chunk = |a: &Array| -> R<Vec<Array>> {
        match n {
            1 => Ok(vec![a.squeeze_axes(&[2])?]),
            _ => ops::split_equal(a, n, 2)?
                .iter()
                .map(|x| x.squeeze_axes(&[2]))
                .collect(),
        }
    };
    let (carry, carry_in) = (per_chunk(&carry)?, per_chunk(&carry_in)?);
    let mut state = state.clone();
    let mut starts = Vec::with_capacity(n as usize);
    for (g, add) in carry.iter().zip(&carry_in) {
        starts.push(state.clone());
        state = state.matmul(g)?.add(add)?;
    }
    let starts = ops::stack(&starts, 2)?;
    let y = pu.add(q_eff.matmul(starts.swap_axes(-1, -2)?)?)?;
    let y = y
        .transpose_axes(&[0, 2, 3, 1, 4])?
        .reshape(&[b, n * c, h, dv])?;
    let y = match pad {
        0 => y,
        _ => slice(&y, &[0, 0, 0, 0], &[b, s, h, dv])?,
    };
    Ok((y, state))
}

/// `T = (I + A)^-1` per chunk (`[B, H, N, C, C]`) for the strictly lower
/// triangular `A[t][i] = beta_t exp(c_t - c_i) k_t.k_i`, by doubling
/// diagonal blocks: with the inverses `X11`, `X22` of two neighbouring
/// blocks known, their union's is `[[X11, 0], [-X22 A21 X11, X22]]`.
/// log2(C) rounds of batched products; as stable as substitution, unlike
/// the Neumann product `(I - A)(I + A^2)..`, whose powers of A grow
/// combinatorially when keys repeat before they cancel.
fn unit_lower_inverse(k: &Array, cum: &Array, beta: &Array) -> R<Array> {
    let (b, h, n, c, dk) = (k.dim(0), k.dim(1), k.dim(2), k.dim(3), k.dim(4));
    let mut inv = ops::ones::<f32>(&[b, h, n, c, 1, 1])?;
    let mut m = 1;
    while m < c {
        let pairs = c / (2 * m);
        // The first and second block of each pair along the chunk.
        let halves = |a: &Array, tail: &[i32]| -> R<(Array, Array)> {
            let shape: Vec<i32> = [b, h, n, pairs, 2, m].iter().chain(tail).copied().collect();
            let mut two = ops::split_equal(&a.reshape(&shape)?, 2, 4)?.into_iter();
            let first = two.next().unwrap().squeeze_axes(&[4])?;
            let second = two.next().unwrap().squeeze_axes(&[4])?;
            Ok((first, second))
        };
        let (k1, k2) = halves(k, &[dk])?;
        let (c1, c2) = halves(cum, &[])?;
        let (_, beta2) = halves(beta, &[])?;
        let (x11, x22) = halves(&inv, &[m])?;
        let a21 = beta2
            .expand_dims(-1)?
            .multiply(ops::exp(
                c2.expand_dims(-1)?.subtract(c1.expand_dims(-2)?)?,
            )?)?
            .multiply(k2.matmul(k1.swap_axes(-1, -2)?)?)?;
        let x21 = x22.matmul(&a21)?.matmul(&x11)?.negative()?;
        let top = ops::concatenate(&[&x11, &ops::zeros_like(&x11)?], -1)?;
        let bottom = ops::concatenate(&[&x21, &x22], -1)?;
        inv = ops::concatenate(&[&top, &bottom], -2)?;
        m *= 2;
    }
    inv.reshape(&[b, h, n, c, c])
}
