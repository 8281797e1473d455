//! RoPE, RMSNorm, gated activations, attention and an attention layer's
//! heads (split, normed and rotated) as one graph node each on the CPU
//! (`mlx-sys/native/cpu_fused.cpp`). MLX runs `fast::rope`,
//! `fast::rms_norm` and `fast::scaled_dot_product_attention` there as their
//! composed fallbacks, about 28, 10 and 12 nodes a call (a RoPE rebuilds
//! its frequencies every time), so the default model's decode step was
//! ~3,500 nodes and the host's time per node a large part of it. Same
//! float32 math; elsewhere (a GPU, other dtypes, `GATEWAY_CPU_FUSED=off`)
//! MLX's own ops run.

use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, TryIndexOp};
use mlx_rs::{fast, Array, Dtype, Stream};

use crate::cache::Offsets;
use crate::packed::CpuKernel;

/// Whether products of this process take the fused nodes: on the CPU,
/// where they are built, unless `GATEWAY_CPU_FUSED=off`.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        mlx_sys::cpu_fused_built()
            && crate::compute::on_cpu()
            && std::env::var("GATEWAY_CPU_FUSED").map_or(true, |v| v != "off")
    })
}

fn takes(arrays: &[Option<&Array>]) -> bool {
    enabled() && arrays.iter().flatten().all(|a| a.dtype() == Dtype::Float32)
}

/// `fast::rms_norm`, one node on the CPU.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array, Exception> {
    if !takes(&[Some(x), weight]) {
        return fast::rms_norm(x, weight, eps);
    }
    native_node("cpu node", |res, stream| unsafe {
        mlx_sys::cpu_rms_norm(res, x.as_ptr(), weight.map(|w| w.as_ptr()), eps, stream)
    })
}

/// `h = x + r` and `rms_norm(h, weight, eps)`: one node with both outputs
/// on the CPU, an add and [`rms_norm`] elsewhere.
pub fn add_rms_norm(
    x: &Array,
    r: &Array,
    weight: &Array,
    eps: f32,
) -> Result<(Array, Array), Exception> {
    if !takes(&[Some(x), Some(r), Some(weight)]) || x.shape() != r.shape() {
        let h = x.add(r)?;
        let y = rms_norm(&h, Some(weight), eps)?;
        return Ok((h, y));
    }
    let [h, y] = native_nodes("cpu add + rms_norm", |[h, y], stream| unsafe {
        mlx_sys::cpu_add_rms_norm(h, y, x.as_ptr(), r.as_ptr(), weight.as_ptr(), eps, stream)
    })?;
    Ok((h, y))
}

/// Whether [`rope`] takes `x`: float32 [B, N, T, D] on the CPU.
pub fn takes_rope(x: &Array) -> bool {
    takes(&[Some(x)]) && x.ndim() == 4
}

/// The inverse frequencies `fast::rope`'s fallback computes, with MLX's
/// own ops (so the angles are the same to the bit): `exp(-i * (ln(base) /
/// half))`, or the reciprocals of given `freqs`. Evaluated here, once per
/// rotary layer.
pub fn inverse_frequencies(
    dims: i32,
    base: Option<f32>,
    freqs: Option<&Array>,
) -> Result<Array, Exception> {
    let half = dims / 2;
    let inv = match (freqs, base) {
        (Some(freqs), _) => freqs.reciprocal()?,
        (None, Some(base)) => Array::arange::<_, f32>(0, -half, -1)?
            .multiply(Array::from_f32(base.ln() / half as f32))?
            .exp()?,
        (None, None) => return Err(Exception::custom("rope needs a base or frequencies")),
    };
    inv.eval()?;
    Ok(inv)
}

/// `fast::rope` (non-traditional) of `x` ([B, N, T, D]) at `offset` (one
/// position, or one per row, int) with [`inverse_frequencies`], one node;
/// only where [`takes_rope`].
pub fn rope(
    x: &Array,
    dims: i32,
    scale: f32,
    offset: &Array,
    inv_freqs: &Array,
) -> Result<Array, Exception> {
    native_node("cpu node", |res, stream| unsafe {
        mlx_sys::cpu_rope(
            res,
            x.as_ptr(),
            offset.as_ptr(),
            inv_freqs.as_ptr(),
            dims,
            scale,
            stream,
        )
    })
}

/// Whether [`heads`] takes a layer of `spec` over activations of `dtype`:
/// float32 on the CPU (its norms' weights too).
pub fn takes_heads(dtype: Dtype, spec: &crate::gpu_fused::HeadsSpec) -> bool {
    enabled() && dtype == Dtype::Float32 && spec.norms_of(dtype)
}

/// q `[B, heads, L, D]`, k and v `[B, kv_heads, L, D]` from the stacked
/// q/k/v product's `B * L` rows (`rows` = (B, L)), q and k normed (when
/// the layer has norms) and rotated at their rows' positions with
/// [`inverse_frequencies`] `inv_freqs`: one node where the unfused chain
/// is ten a layer (three slices, three reshapes, two norms or none, two
/// RoPEs), the same float32 math as [`rms_norm`] and [`rope`]. Only where
/// [`takes_heads`].
pub fn heads(
    qkv: &Array,
    (b, l): (i32, i32),
    spec: &crate::gpu_fused::HeadsSpec,
    offsets: &Offsets,
    inv_freqs: &Array,
) -> Result<(Array, Array, Array), Exception> {
    let offset = offsets.to_array();
    let shape = mlx_sys::HeadsShape {
        b,
        l,
        heads: spec.heads,
        kv_heads: spec.kv_heads,
        dims: spec.rope.dims,
        scale: spec.rope.scale,
    };
    let norms = spec
        .norms
        .map(|(qw, kw, eps)| (qw.as_ptr(), kw.as_ptr(), eps));
    let [q, k, v] = native_nodes("cpu heads", |[q, k, v], stream| unsafe {
        mlx_sys::cpu_heads(
            q,
            k,
            v,
            qkv.as_ptr(),
            offset.as_ptr(),
            inv_freqs.as_ptr(),
            norms,
            shape,
            stream,
        )
    })?;
    Ok((q, k, v))
}

/// `act(gate) * up` of a stacked gate/up product's output `gu` (`[..., 2I]`,
/// gate first; SiLU, or tanh-approximated GELU when `gelu`): one node on
/// the CPU for float32, where MLX's ops are two slices and the compiled
/// activation ([`crate::activations::gated`], which runs elsewhere).
pub fn gated_halves(gu: &Array, gelu: bool) -> Result<Array, Exception> {
    if !takes(&[Some(gu)]) {
        let half = gu.dim(-1) / 2;
        let gate = gu.try_index((Ellipsis, ..half))?;
        let up = gu.try_index((Ellipsis, half..))?;
        return crate::activations::gated(&gate, &up, gelu);
    }
    native_node("cpu gated", |res, stream| unsafe {
        mlx_sys::cpu_gated(res, gu.as_ptr(), gelu, stream)
    })
}

/// Which keys each of attention's `n` queries sees of `T`.
pub enum KeysSeen {
    All,
    /// Query i sees keys up to `T - n + i` (the last query sees all).
    Causal,
    /// Where the boolean mask (broadcastable to `[B, heads, n, T]`) is true.
    Mask(Array),
}

/// Whether [`attention`] takes `q`, `k` and `v` (float32 `[B, heads, L, D]`
/// on the CPU) with `seen` (a mask must be boolean), unless
/// `GATEWAY_CPU_ATTENTION=off` keeps MLX's attention (the other nodes
/// stay; compared in docs/benchmarks.md, "Nodes per step" under "Where a
/// CPU decode step goes").
pub fn takes_attention(q: &Array, k: &Array, v: &Array, seen: &KeysSeen) -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("GATEWAY_CPU_ATTENTION").is_ok_and(|v| v == "off"));
    let mask_fits = match seen {
        KeysSeen::Mask(m) => m.dtype() == Dtype::Bool && m.ndim() <= 4,
        _ => true,
    };
    !off && takes(&[Some(q), Some(k), Some(v)])
        && [q, k, v].iter().all(|a| a.ndim() == 4)
        && mask_fits
}

/// `fast::scaled_dot_product_attention(q, k, v, scale, mask)`, one node,
/// on the product kernel's threads where the work pays for it (a decode
/// step's heads past a few dozen positions, a prefill chunk); `kernel`
/// names the path (`None`: the one `GATEWAY_CPU_KERNEL` leaves). Only
/// where [`takes_attention`].
pub fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    seen: &KeysSeen,
    kernel: Option<CpuKernel>,
) -> Result<Array, Exception> {
    let mask = match seen {
        KeysSeen::Mask(m) if m.ndim() < 4 => {
            let mut shape = vec![1; 4 - m.ndim()];
            shape.extend_from_slice(m.shape());
            Some(m.reshape(&shape)?)
        }
        KeysSeen::Mask(m) => Some(m.clone()),
        _ => None,
    };
    native_node("cpu attention", |res, stream| unsafe {
        mlx_sys::cpu_attention(
            res,
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            mask.as_ref().map(|m| m.as_ptr()),
            matches!(seen, KeysSeen::Causal),
            scale,
            kernel.map_or(-1, |k| k as i32),
            stream,
        )
    })
}

/// An array made by one of `mlx-sys/native`'s constructors on this
/// thread's stream (`build` gets the result slot and the stream); its
/// failure becomes an `Exception` that starts with `what`.
pub(crate) fn native_node(
    what: &str,
    build: impl FnOnce(&mut mlx_sys::mlx_array, mlx_sys::mlx_stream) -> Result<(), String>,
) -> Result<Array, Exception> {
    let [out] = native_nodes(what, |[res], stream| build(res, stream))?;
    Ok(out)
}

/// [`native_node`] of a constructor with `N` outputs.
fn native_nodes<const N: usize>(
    what: &str,
    build: impl FnOnce(&mut [mlx_sys::mlx_array; N], mlx_sys::mlx_stream) -> Result<(), String>,
) -> Result<[Array; N], Exception> {
    let stream = Stream::thread_local_or_default();
    unsafe {
        let mut res = [(); N].map(|_| mlx_sys::mlx_array_new());
        match build(&mut res, stream.as_ptr()) {
            Ok(()) => Ok(res.map(|r| Array::from_ptr(r))),
            Err(e) => {
                res.into_iter().for_each(|r| {
                    mlx_sys::mlx_array_free(r);
                });
                Err(Exception::custom(format!("{what}: {e}")))
            }
        }
    }
}
