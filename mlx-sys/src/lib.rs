//! Raw mlx-c bindings (see build.rs for how mlx-c and libmlx are found).
#![allow(non_upper_case_globals)]
#![allow(non_camel_case_types)]
#![allow(non_snake_case)]
#![allow(clippy::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

#[cfg(mlx_openblas)]
extern "C" {
    fn openblas_get_config() -> *const std::os::raw::c_char;
    fn openblas_get_num_threads() -> std::os::raw::c_int;
    fn mlx_sys_sgemv_forwarded() -> std::os::raw::c_ulong;
}

/// How many of MLX's float32 products this process sent to OpenBLAS's
/// `sgemv` instead of `sgemm` (one row or one column; see
/// `native/sgemv_forward.c`). `None` where MLX uses the wheel's own BLAS.
pub fn sgemv_forwarded() -> Option<u64> {
    #[cfg(mlx_openblas)]
    return Some(unsafe { mlx_sys_sgemv_forwarded() } as u64);
    #[cfg(not(mlx_openblas))]
    None
}

/// Names the BLAS serving MLX's CPU matmuls. Calling it also makes OpenBLAS a
/// direct dependency of the binary (see build.rs), which is what puts it
/// ahead of the wheel's bundled reference BLAS.
pub fn blas_backend() -> String {
    #[cfg(mlx_openblas)]
    unsafe {
        let config = std::ffi::CStr::from_ptr(openblas_get_config()).to_string_lossy();
        format!(
            "{} ({} threads; one-row products through sgemv, {} so far)",
            config.trim(),
            openblas_get_num_threads(),
            mlx_sys_sgemv_forwarded()
        )
    }
    #[cfg(not(mlx_openblas))]
    {
        String::from("bundled with libmlx")
    }
}

#[cfg(mlx_packed_matmul)]
extern "C" {
    fn mlx_sys_cpu_rope(
        res: *mut mlx_array,
        x: mlx_array,
        offset: mlx_array,
        inv_freqs: mlx_array,
        dims: std::os::raw::c_int,
        scale: f32,
        stream: mlx_stream,
        err: *mut std::os::raw::c_char,
        err_len: usize,
    ) -> std::os::raw::c_int;
    fn mlx_sys_cpu_rms_norm(
        res: *mut mlx_array,
        x: mlx_array,
        weight: mlx_array,
        has_weight: std::os::raw::c_int,
        eps: f32,
        stream: mlx_stream,
        err: *mut std::os::raw::c_char,
        err_len: usize,
    ) -> std::os::raw::c_int;
    fn mlx_sys_cpu_add_rms_norm(
        h: *mut mlx_array,
        y: *mut mlx_array,
        x: mlx_array,
        r: mlx_array,
        weight: mlx_array,
        eps: f32,
        stream: mlx_stream,
        err: *mut std::os::raw::c_char,
        err_len: usize,
    ) -> std::os::raw::c_int;
    fn mlx_sys_cpu_heads(
        q: *mut mlx_array,
        k: *mut mlx_array,
        v: *mut mlx_array,
        qkv: mlx_array,
        offset: mlx_array,
        inv_freqs: mlx_array,
        q_norm: mlx_array,
        k_norm: mlx_array,
        has_norms: std::os::raw::c_int,
        eps: f32,
        b: std::os::raw::c_int,
        l: std::os::raw::c_int,
        h: std::os::raw::c_int,
        kh: std::os::raw::c_int,
        dims: std::os::raw::c_int,
        scale: f32,
        stream: mlx_stream,
        err: *mut std::os::raw::c_char,
        err_len: usize,
    ) -> std::os::raw::c_int;
    fn mlx_sys_cpu_gated(
        res: *mut mlx_array,
        x: mlx_array,
        gelu: std::os::raw::c_int,
        stream: mlx_stream,
        err: *mut std::os::raw::c_char,
        err_len: usize,
    ) -> std::os::raw::c_int;
    fn mlx_sys_cpu_attention(
        res: *mut mlx_array,
        q: mlx_array,
        k: mlx_array,
        v: mlx_array,
        mask: mlx_array,
        has_mask: std::os::raw::c_int,
        causal: std::os::raw::c_int,
        scale: f32,
        kernel: std::os::raw::c_int,
        stream: mlx_stream,
        err: *mut std::os::raw::c_char,
        err_len: usize,
    ) -> std::os::raw::c_int;
}

/// Whether `native/cpu_fused.cpp`'s CPU nodes are built (not on macOS).
pub fn cpu_fused_built() -> bool {
    cfg!(mlx_packed_matmul)
}

/// Runs a native constructor that reports failure in a message buffer.
#[cfg(mlx_packed_matmul)]
unsafe fn native(
    call: impl FnOnce(*mut std::os::raw::c_char, usize) -> std::os::raw::c_int,
) -> Result<(), String> {
    let mut err = [0 as std::os::raw::c_char; 256];
    match call(err.as_mut_ptr(), err.len()) {
        0 => Ok(()),
        _ => Err(std::ffi::CStr::from_ptr(err.as_ptr())
            .to_string_lossy()
            .into_owned()),
    }
}

/// RoPE of `x` ([B, N, T, D] float32) as one CPU node
/// (`native/cpu_fused.cpp`), non-traditional: pair i of position p turns by
/// `p * scale * inv_freqs[i]`, p the row's `offset` plus the token's index.
/// On success `res` holds the array.
///
/// # Safety
/// Every handle must be a live mlx-c object; `res` an initialised array.
pub unsafe fn cpu_rope(
    res: &mut mlx_array,
    x: mlx_array,
    offset: mlx_array,
    inv_freqs: mlx_array,
    dims: i32,
    scale: f32,
    stream: mlx_stream,
) -> Result<(), String> {
    #[cfg(mlx_packed_matmul)]
    return native(|err, len| {
        mlx_sys_cpu_rope(res, x, offset, inv_freqs, dims, scale, stream, err, len)
    });
    #[cfg(not(mlx_packed_matmul))]
    {
        let _ = (res, x, offset, inv_freqs, dims, scale, stream);
        Err("the CPU nodes are not built here".into())
    }
}

/// `x * rsqrt(mean(x^2, -1) + eps)`, times `weight` when given, as one CPU
/// node (`native/cpu_fused.cpp`), float32.
///
/// # Safety
/// Every handle must be a live mlx-c object; `res` an initialised array.
pub unsafe fn cpu_rms_norm(
    res: &mut mlx_array,
    x: mlx_array,
    weight: Option<mlx_array>,
    eps: f32,
    stream: mlx_stream,
) -> Result<(), String> {
    #[cfg(mlx_packed_matmul)]
    return native(|err, len| {
        mlx_sys_cpu_rms_norm(
            res,
            x,
            weight.unwrap_or(x),
            weight.is_some() as _,
            eps,
            stream,
            err,
            len,
        )
    });
    #[cfg(not(mlx_packed_matmul))]
    {
        let _ = (res, x, weight, eps, stream);
        Err("the CPU nodes are not built here".into())
    }
}

/// `h = x + r` and `y = h * rsqrt(mean(h^2, -1) + eps) * weight` as one
/// CPU node with two outputs (`native/cpu_fused.cpp`), float32.
///
/// # Safety
/// Every handle must be a live mlx-c object; `h` and `y` initialised arrays.
#[allow(clippy::too_many_arguments)]
pub unsafe fn cpu_add_rms_norm(
    h: &mut mlx_array,
    y: &mut mlx_array,
    x: mlx_array,
    r: mlx_array,
    weight: mlx_array,
    eps: f32,
    stream: mlx_stream,
) -> Result<(), String> {
    #[cfg(mlx_packed_matmul)]
    return native(|err, len| mlx_sys_cpu_add_rms_norm(h, y, x, r, weight, eps, stream, err, len));
    #[cfg(not(mlx_packed_matmul))]
    {
        let _ = (h, y, x, r, weight, eps, stream);
        Err("the CPU nodes are not built here".into())
    }
}

/// The shape of an attention layer's heads for [`cpu_heads`]: rows `b` x
/// positions `l`, `heads` query and `kv_heads` key/value heads, RoPE over
/// the first `dims` features of each at position scale `scale`.
#[derive(Debug, Clone, Copy)]
pub struct HeadsShape {
    pub b: i32,
    pub l: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub dims: i32,
    pub scale: f32,
}

/// q `[b, heads, l, D]`, k and v `[b, kv_heads, l, D]` from the stacked
/// q/k/v product `qkv` (`b * l` rows of `(heads + 2 kv_heads) * D`) as one
/// CPU node with three outputs (`native/cpu_fused.cpp`), float32: q and k
/// normed by `norms` (the q and k weights `[D]` and epsilon) when given,
/// then rotated as [`cpu_rope`] does at `offset` (one, or one per row) + t.
///
/// # Safety
/// Every handle must be a live mlx-c object; `q`, `k` and `v` initialised
/// arrays.
#[allow(clippy::too_many_arguments)]
pub unsafe fn cpu_heads(
    q: &mut mlx_array,
    k: &mut mlx_array,
    v: &mut mlx_array,
    qkv: mlx_array,
    offset: mlx_array,
    inv_freqs: mlx_array,
    norms: Option<(mlx_array, mlx_array, f32)>,
    shape: HeadsShape,
    stream: mlx_stream,
) -> Result<(), String> {
    #[cfg(mlx_packed_matmul)]
    return native(|err, len| {
        let (qn, kn, eps) = norms.unwrap_or((qkv, qkv, 0.0));
        let HeadsShape {
            b,
            l,
            heads,
            kv_heads,
            dims,
            scale,
        } = shape;
        mlx_sys_cpu_heads(
            q,
            k,
            v,
            qkv,
            offset,
            inv_freqs,
            qn,
            kn,
            norms.is_some() as _,
            eps,
            b,
            l,
            heads,
            kv_heads,
            dims,
            scale,
            stream,
            err,
            len,
        )
    });
    #[cfg(not(mlx_packed_matmul))]
    {
        let _ = (q, k, v, qkv, offset, inv_freqs, norms, shape, stream);
        Err("the CPU nodes are not built here".into())
    }
}

/// `act(x[..., :I]) * x[..., I:]` of `x` `[..., 2I]` as one CPU node
/// (`native/cpu_fused.cpp`), float32, act SiLU or (`gelu`)
/// tanh-approximated GELU.
///
/// # Safety
/// Every handle must be a live mlx-c object; `res` an initialised array.
pub unsafe fn cpu_gated(
    res: &mut mlx_array,
    x: mlx_array,
    gelu: bool,
    stream: mlx_stream,
) -> Result<(), String> {
    #[cfg(mlx_packed_matmul)]
    return native(|err, len| mlx_sys_cpu_gated(res, x, gelu as _, stream, err, len));
    #[cfg(not(mlx_packed_matmul))]
    {
        let _ = (res, x, gelu, stream);
        Err("the CPU nodes are not built here".into())
    }
}

/// `softmax(q k^T * scale) v` as one CPU node (`native/cpu_fused.cpp`),
/// float32: q `[B, H, n, D]`, k and v `[B, KH, T, D]` (H a multiple of KH);
/// query i sees keys up to `T - n + i` when `causal`, and where `mask`
/// (boolean, broadcastable to `[B, H, n, T]`) is true. `kernel`: 0 scalar,
/// 1 and up SIMD, -1 the one `GATEWAY_CPU_KERNEL` leaves ([`packed_kernels`]).
///
/// # Safety
/// Every handle must be a live mlx-c object; `res` an initialised array.
#[allow(clippy::too_many_arguments)]
pub unsafe fn cpu_attention(
    res: &mut mlx_array,
    q: mlx_array,
    k: mlx_array,
    v: mlx_array,
    mask: Option<mlx_array>,
    causal: bool,
    scale: f32,
    kernel: i32,
    stream: mlx_stream,
) -> Result<(), String> {
    #[cfg(mlx_packed_matmul)]
    return native(|err, len| {
        mlx_sys_cpu_attention(
            res,
            q,
            k,
            v,
            mask.unwrap_or(q),
            mask.is_some() as _,
            causal as _,
            scale,
            kernel,
            stream,
            err,
            len,
        )
    });
    #[cfg(not(mlx_packed_matmul))]
    {
        let _ = (res, q, k, v, mask, causal, scale, kernel, stream);
        Err("the CPU nodes are not built here".into())
    }
}

#[cfg(mlx_packed_matmul)]
extern "C" {
    fn mlx_sys_graph_nodes(
        outs: *const mlx_array,
        n: usize,
        histogram: *mut std::os::raw::c_char,
        len: usize,
    ) -> usize;
}

/// The operations evaluating `outputs` would run (`native/graph_nodes.cpp`):
/// their count and, per primitive name, how many, most frequent first.
/// `None` where the native helpers are not built.
///
/// # Safety
/// Every handle must be a live mlx-c array.
pub unsafe fn graph_nodes(outputs: &[mlx_array]) -> Option<(usize, Vec<(String, usize)>)> {
    #[cfg(mlx_packed_matmul)]
    {
        let mut text = vec![0 as std::os::raw::c_char; 8192];
        let nodes = mlx_sys_graph_nodes(
            outputs.as_ptr(),
            outputs.len(),
            text.as_mut_ptr(),
            text.len(),
        );
        let text = std::ffi::CStr::from_ptr(text.as_ptr()).to_string_lossy();
        let by_name = text
            .lines()
            .filter_map(|l| l.rsplit_once(' '))
            .filter_map(|(name, n)| Some((name.to_string(), n.parse().ok()?)))
            .collect();
        Some((nodes, by_name))
    }
    #[cfg(not(mlx_packed_matmul))]
    {
        let _ = outputs;
        None
    }
}

#[cfg(mlx_packed_matmul)]
extern "C" {
    fn mlx_sys_packed_kernel_best() -> std::os::raw::c_int;
    fn mlx_sys_packed_kernel_chosen() -> std::os::raw::c_int;
    fn mlx_sys_packed_matmul(
        res: *mut mlx_array,
        x: mlx_array,
        w: mlx_array,
        scales: mlx_array,
        biases: mlx_array,
        group_size: std::os::raw::c_int,
        bits: std::os::raw::c_int,
        kernel: std::os::raw::c_int,
        activation_bits: std::os::raw::c_int,
        stream: mlx_stream,
        err: *mut std::os::raw::c_char,
        err_len: usize,
    ) -> std::os::raw::c_int;
}

/// The packed-weight product kernels of `native/packed_matmul.cpp` this CPU
/// runs, as `(best, chosen)`: 0 scalar, 1 AVX2+FMA, 2 AVX-512; `chosen` is
/// `best` capped by `GATEWAY_CPU_KERNEL`. `None` where they are not built
/// (macOS, whose MLX has Metal and Accelerate).
pub fn packed_kernels() -> Option<(i32, i32)> {
    #[cfg(mlx_packed_matmul)]
    return Some(unsafe { (mlx_sys_packed_kernel_best(), mlx_sys_packed_kernel_chosen()) });
    #[cfg(not(mlx_packed_matmul))]
    None
}

/// `x @ dequantize(w, scales, biases)^T` (MLX affine, 4 or 8 bits, groups of
/// 32/64/128) as a lazy graph node computed by `native/packed_matmul.cpp`
/// with `kernel` (see [`packed_kernels`]; -1: the chosen one), the
/// activations as fp32 (`activation_bits` 32) or rounded to int8 per block
/// of 32 (8). On success `res` holds the new array.
///
/// # Safety
/// Every handle must be a live mlx-c object; `res` an initialised array.
pub unsafe fn packed_matmul(
    res: &mut mlx_array,
    x: mlx_array,
    w: mlx_array,
    scales: mlx_array,
    biases: mlx_array,
    group_size: i32,
    bits: i32,
    kernel: i32,
    activation_bits: i32,
    stream: mlx_stream,
) -> Result<(), String> {
    #[cfg(mlx_packed_matmul)]
    return native(|err, len| {
        mlx_sys_packed_matmul(
            res,
            x,
            w,
            scales,
            biases,
            group_size,
            bits,
            kernel,
            activation_bits,
            stream,
            err,
            len,
        )
    });
    #[cfg(not(mlx_packed_matmul))]
    {
        let _ = (
            res,
            x,
            w,
            scales,
            biases,
            group_size,
            bits,
            kernel,
            activation_bits,
            stream,
        );
        Err("packed-weight kernels are not built on this platform".into())
    }
}
