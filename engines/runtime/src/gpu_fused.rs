//! The chains between a GPU step's products as single CUDA kernels inside
//! the MLX graph (`mlx_fast_cuda_kernel_*`, [`crate::cuda_kernel`]): the
//! host builds and launches each node in microseconds, and these take a
//! Qwen3-4B decode step from 985 nodes to 517 (16 rows; docs/gpu.md).
//! Each kernel repeats MLX's own arithmetic for the ops it replaces
//! (roundings to the activation dtype where MLX rounds), so outputs match
//! MLX's to within a rounding; `examples/fused_check.rs` compares them on
//! a device (docs/gpu.md).
//!
//! - [`heads`]: the stacked q/k/v product's output to attention's heads:
//!   slicing, q and k RMSNorm, RoPE and the head layout, one node where
//!   there were ten a layer; over a paged cache k and v go straight into
//!   the pool ([`heads_into_pool`]), and at one position a row paged
//!   attention's kernel can make the heads itself from the same
//!   [`HeadsOperands`] ([`crate::ragged::paged_attention_from_qkv`]).
//! - [`gated`]: SiLU(gate) * up straight from the stacked gate/up output
//!   (three nodes: two slices and the compiled activation).
//! - [`add_rms_norm`]: the residual add and the next norm, two outputs.
//! - [`kv_write`]: a paged layer's new keys and values into its pool
//!   buffers, in place (one node where two scatters were).
//! - [`product`]: a dense product of 2-16 rows (the gate/up product with
//!   its activation from one row) as one tensor-core kernel, where
//!   cuBLASLt and MLX's vector kernel leave most of the card's bandwidth
//!   unused; [`normed_product`]: the same with the RMSNorm (and the
//!   residual add) before it in the same kernel, for a layer's q/k/v and
//!   gate/up products at 1-4 rows.
//!
//! `GATEWAY_GPU_FUSED=off` keeps MLX's ops; `GATEWAY_GPU_PRODUCT=off`
//! keeps MLX's products (and [`gated`] after the gate/up one);
//! `GATEWAY_GPU_NORMED=off` keeps the norms out of the products.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::cache::Offsets;
use crate::cuda_kernel::{CudaKernel, Launch, TemplateArg};

type R<T> = Result<T, Exception>;

static SWITCHED_OFF: AtomicBool = AtomicBool::new(false);

/// Whether the kernels run on this thread's stream: a GPU stream, and
/// not switched off by `GATEWAY_GPU_FUSED=off` or [`set_enabled`].
pub fn enabled() -> bool {
    static FUSED_OFF: OnceLock<bool> = OnceLock::new();
    !env_off(&FUSED_OFF, "GATEWAY_GPU_FUSED")
        && !SWITCHED_OFF.load(Ordering::Relaxed)
        && crate::mask::on_gpu()
}

/// Whether `var` is `off`, read once into `cell`.
fn env_off(cell: &OnceLock<bool>, var: &str) -> bool {
    env_is(cell, var, "off")
}

/// Whether `var` is `value`, read once into `cell`.
pub(crate) fn env_is(cell: &OnceLock<bool>, var: &str, value: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).is_ok_and(|v| v == value))
}

/// Switches the kernels on or off for the whole process (the device
/// check compares both paths in one process).
pub fn set_enabled(on: bool) {
    SWITCHED_OFF.store(!on, Ordering::Relaxed);
}

static NORMED_SWITCHED_OFF: AtomicBool = AtomicBool::new(false);

/// Switches [`normed_product`] alone on or off for the whole process.
pub fn set_normed(on: bool) {
    NORMED_SWITCHED_OFF.store(!on, Ordering::Relaxed);
}

/// The most rows [`product`] takes: two 8-row tiles. From 32 rows
/// on, re-reading the activations from L2 for every 16 weight rows costs
/// more than cuBLASLt's tiles (scripts/device/skinny_product.py).
const PRODUCT_ROWS: i32 = 16;

/// Whether [`product`] takes `x` and the transposed view `wt` (`[K, N]`)
/// of a dense weight; `gated`: the stacked gate/up weight, whose output
/// is the activation. A plain product of one row stays MLX's: its vector
/// kernel costs the host less a call than ours (5.8 against 6.9 µs to
/// launch, `scripts/device/host_cost.py`), and a one-row step is the
/// host's; from 2 rows MLX takes cuBLASLt, which costs more (14.9 µs at 16
/// rows against 8.2) and reads the weights slower.
pub fn takes_product(x: &Array, wt: &Array, gated: bool) -> bool {
    let fewest = if gated { 1 } else { 2 };
    (fewest..=PRODUCT_ROWS).contains(&crate::layers::rows(x)) && product_fits(x, wt)
}

/// The operands [`product`] and [`normed_product`] read, at any rows.
fn product_fits(x: &Array, wt: &Array) -> bool {
    static PRODUCT_OFF: OnceLock<bool> = OnceLock::new();
    let dtype = x.dtype();
    !env_off(&PRODUCT_OFF, "GATEWAY_GPU_PRODUCT")
        && matches!(dtype, Dtype::Bfloat16 | Dtype::Float16)
        && wt.dtype() == dtype
        && wt.ndim() == 2
        && *x.shape().last().unwrap_or(&0) == wt.dim(0)
        && wt.dim(0) % 32 == 0
        && wt.dim(1) % 32 == 0
        && enabled()
}

/// `x @ w.T` as one tensor-core kernel (`kernels/skinny_product.cu`), `wt`
/// the transposed view of the row-major `[N, K]` weight, for what
/// [`takes_product`] takes; `gated`: `w` stacks gate and up (`[2 * F, K]`)
/// and the output is `silu(x @ gate.T) * (x @ up.T)`. MLX's products at
/// these rows leave most of the card's bandwidth unused; this one reads
/// each weight byte once, with K split over a block's warps. Its sums run
/// in another order than cuBLAS's, so a product may differ from MLX's by a
/// rounding of `T`.
pub fn product(x: &Array, wt: &Array, gated: bool) -> R<Array> {
    let rows = crate::layers::rows(x);
    let dtype = x.dtype();
    let (k, n) = (wt.dim(0), wt.dim(1));
    let x2 = match x.ndim() {
        2 => x.clone(),
        _ => x.reshape(&[rows, k])?,
    };
    let features = if gated { n / 2 } else { n };
    let mut shape = x.shape().to_vec();
    *shape.last_mut().unwrap() = features;
    let templates = [
        TemplateArg::Dtype("T", dtype),
        TemplateArg::Int("BF16", (dtype == Dtype::Bfloat16) as i32),
        TemplateArg::Int("GATED", gated as i32),
        TemplateArg::Int("MT", (rows + 7) / 8),
        TemplateArg::Int("WK", PRODUCT_WARPS),
        TemplateArg::Int("U", 1),
    ];
    // A block per 16 output features.
    let launch = Launch {
        outputs: &[(&shape, dtype)],
        grid_threads: features / 16 * 32 * PRODUCT_WARPS,
        block_threads: 32 * PRODUCT_WARPS,
        templates: &templates,
        init: None,
    };
    Ok(run(&PRODUCT, &[&x2, wt], &launch, "product")?.remove(0))
}

/// Warps a block of [`product`] splits K over.
const PRODUCT_WARPS: i32 = 16;

/// The most rows [`normed_product`] takes. Every block stages the normed
/// rows from L2, so the staging reads grow with the rows while a block's
/// weight bytes do not: on an H200 one row is faster fused (a 4B decode
/// step of 229 nodes, not 301), 16 rows slower (docs/gpu.md).
const NORMED_ROWS: i32 = 4;

/// The most shared memory [`normed_product`] asks for a block: what an
/// A100 grants (H100 and H200: 227 KB).
const NORMED_SHARED_BYTES: i32 = 160 * 1024;

/// `norm(x + r) @ w.T` (`r: None`: `norm(x)`; `gated`: the stacked gate/up
/// weight and the activation, as [`product`]) and `x + r`, as one kernel:
/// the norm's node folded into the product's, for 1-4 rows. `norm` is the
/// RMSNorm's weight and epsilon, computed as [`add_rms_norm`] computes it.
/// Returns `(x + r, product)`; `None` where the kernel does not apply (and
/// under `GATEWAY_GPU_NORMED=off` or [`set_normed`]).
pub fn normed_product(
    x: &Array,
    r: Option<&Array>,
    (norm_weight, eps): (&Array, f32),
    wt: &Array,
    gated: bool,
) -> Option<R<(Array, Array)>> {
    static NORMED_OFF: OnceLock<bool> = OnceLock::new();
    let rows = crate::layers::rows(x);
    let dtype = x.dtype();
    let (k, n) = (*x.shape().last()?, *wt.shape().last()?);
    let tiles = (rows + 7) / 8;
    let ns = if gated { 2 } else { 1 };
    // The normed rows and the norm's weight, each padded by 8; the warps'
    // partial sums reuse them after the product.
    let shared = ((rows + 1) * (k + 8) * 2).max(PRODUCT_WARPS * ns * tiles * 8 * 16 * 4);
    if env_off(&NORMED_OFF, "GATEWAY_GPU_NORMED")
        || NORMED_SWITCHED_OFF.load(Ordering::Relaxed)
        || !(1..=NORMED_ROWS).contains(&rows)
        || !product_fits(x, wt)
        || norm_weight.dtype() != dtype
        || norm_weight.size() != k as usize
        || r.is_some_and(|r| r.shape() != x.shape() || r.dtype() != dtype)
        || shared > NORMED_SHARED_BYTES
    {
        return None;
    }
    Some((|| {
        let flat = |a: &Array| match a.ndim() {
            2 => Ok(a.clone()),
            _ => a.reshape(&[rows, k]),
        };
        let x2 = flat(x)?;
        let r2 = match r {
            Some(r) => flat(r)?,
            None => x2.clone(),
        };
        let features = if gated { n / 2 } else { n };
        let mut shape = x.shape().to_vec();
        *shape.last_mut().unwrap() = features;
        let sum_shape = [rows, if r.is_some() { k } else { 1 }];
        let templates = [
            TemplateArg::Dtype("T", dtype),
            TemplateArg::Int("BF16", (dtype == Dtype::Bfloat16) as i32),
            TemplateArg::Int("GATED", gated as i32),
            TemplateArg::Int("MT", tiles),
            TemplateArg::Int("WK", PRODUCT_WARPS),
            TemplateArg::Int("U", 1),
            TemplateArg::Int("ADD", r.is_some() as i32),
            TemplateArg::Int("EPS_BITS", float_bits(eps)?),
            TemplateArg::Int("KS", k),
        ];
        let launch = Launch {
            outputs: &[(&shape, dtype), (&sum_shape, dtype)],
            grid_threads: features / 16 * 32 * PRODUCT_WARPS,
            block_threads: 32 * PRODUCT_WARPS,
            templates: &templates,
            init: None,
        };
        let mut out = NORMED_PRODUCT.with(|kernels| {
            let mut kernels = kernels.borrow_mut();
            let kernel = kernels.entry(shared).or_insert_with(|| {
                CudaKernel::with_shared_memory(
                    "skinny_normed_product",
                    &["x", "r", "nw", "wt"],
                    &["y", "h"],
                    &format!("#define SKINNY_NORMED\n{PRODUCT_SOURCE}"),
                    SILU_MUL,
                    false,
                    shared,
                )
                .map_err(|e| format!("{e:#}"))
            });
            apply(
                kernel,
                &[&x2, &r2, norm_weight, wt],
                &launch,
                "norm and product",
            )
        })?;
        let y = out.remove(0);
        let h = match r {
            Some(_) => out.remove(0).reshape(x.shape())?,
            None => x.clone(),
        };
        Ok((h, y))
    })())
}

fn float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::Bfloat16 | Dtype::Float16 | Dtype::Float32)
}

/// The rotary embedding [`heads`] applies: `dims` rotated features (the
/// rest pass through), MLX's `exp2(-i / half * log2(base))` inverse
/// frequencies or the reciprocals of `freqs`, positions times `scale`.
pub struct RopeSpec<'a> {
    pub dims: i32,
    pub base: Option<f32>,
    pub scale: f32,
    pub freqs: Option<&'a Array>,
}

/// What [`heads`] needs of an attention layer.
pub struct HeadsSpec<'a> {
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    /// The q and k norms' weights and epsilon (Qwen 3, Gemma), or none.
    pub norms: Option<(&'a Array, &'a Array, f32)>,
    pub rope: RopeSpec<'a>,
}

impl HeadsSpec<'_> {
    /// Whether the norms (if any) have weights of `dtype`.
    pub fn norms_of(&self, dtype: Dtype) -> bool {
        self.norms
            .is_none_or(|(qw, kw, _)| qw.dtype() == dtype && kw.dtype() == dtype)
    }
}

/// Whether [`heads`] takes a layer of `spec` over activations of `dtype`.
pub fn takes_heads(dtype: Dtype, spec: &HeadsSpec) -> bool {
    let rope = &spec.rope;
    enabled()
        && float(dtype)
        && spec.head_dim % 32 == 0
        && spec.head_dim <= 256
        && rope.dims % 64 == 0
        && rope.dims <= spec.head_dim
        && (rope.base.is_some() || rope.freqs.is_some())
        && spec.norms_of(dtype)
}

/// q `[B, heads, L, D]`, k and v `[B, kv_heads, L, D]` from the stacked
/// projection's `[B * L, (heads + 2 * kv_heads) * D]` rows (`rows` =
/// (B, L)): q and k normed (when the layer has norms) and rotated at
/// their rows' positions. With `kv_rows`, k and v are `[B * L, 1, kv_heads,
/// D]` instead: a paged pool's scatter takes them as they are
/// ([`crate::KvCache::update_rows`]), with no reshape node between. For a
/// layer [`takes_heads`] takes.
pub fn heads(
    qkv: &Array,
    rows: (i32, i32),
    spec: &HeadsSpec,
    offsets: &Offsets,
    kv_rows: bool,
) -> R<(Array, Array, Array)> {
    let mut out = launch_heads(qkv, rows, spec, offsets, HeadsKv::Out { kv_rows })?;
    let v = out.pop().unwrap();
    let k = out.pop().unwrap();
    Ok((out.pop().unwrap(), k, v))
}

/// [`heads`] writing k and v straight into a paged layer's pool buffers at
/// the forward's slots, in place (`target`, [`crate::KvCache::pool_target`]):
/// q, and the write's token ([`crate::paged::split_written`]), which the
/// layer's reads take. One node where the heads and the pool's write were
/// two.
pub fn heads_into_pool(
    qkv: &Array,
    rows: (i32, i32),
    spec: &HeadsSpec,
    offsets: &Offsets,
    target: &crate::cache::PoolTarget,
) -> R<(Array, Array)> {
    let (hkv, d) = (spec.kv_heads, spec.head_dim);
    let (b, l) = rows;
    for buf in [&target.keys, &target.values] {
        if buf.ndim() != 3 || buf.dim(1) != hkv || buf.dim(2) != d || buf.dtype() != qkv.dtype() {
            return Err(Exception::custom(format!(
                "fused heads: pool buffer {:?} {:?} does not hold {hkv} heads of {d} in {:?}",
                buf.shape(),
                buf.dtype(),
                qkv.dtype()
            )));
        }
    }
    if target.slots.size() != (b * l) as usize {
        return Err(Exception::custom(format!(
            "fused heads: {} slots for {b} x {l} positions",
            target.slots.size()
        )));
    }
    let mut out = launch_heads(qkv, rows, spec, offsets, HeadsKv::Pool(target))?;
    let written = out.pop().unwrap();
    Ok((out.pop().unwrap(), written))
}

/// Where [`launch_heads`] puts k and v.
enum HeadsKv<'a> {
    /// As outputs: `[B, kv_heads, L, D]`, or with `kv_rows` the pool's
    /// rows `[B * L, 1, kv_heads, D]`.
    Out { kv_rows: bool },
    /// Into pool buffers in place.
    Pool(&'a crate::cache::PoolTarget),
}

fn launch_heads(
    qkv: &Array,
    (b, l): (i32, i32),
    spec: &HeadsSpec,
    offsets: &Offsets,
    kv: HeadsKv,
) -> R<Vec<Array>> {
    let (h, hkv, d) = (spec.heads, spec.kv_heads, spec.head_dim);
    let dtype = qkv.dtype();
    let width = (h + 2 * hkv) * d;
    if qkv.size() != (b * l * width) as usize {
        return Err(Exception::custom(format!(
            "fused heads: {:?} is not {b} x {l} rows of {width}",
            qkv.shape()
        )));
    }
    let qkv = match qkv.ndim() {
        2 => qkv.clone(),
        _ => qkv.reshape(&[b * l, width])?,
    };
    let operands = heads_operands(&qkv, b, spec, offsets)?;
    let slots = b * l * (h + 2 * hkv);
    let kv_rows = matches!(kv, HeadsKv::Out { kv_rows: true });
    let mut templates = vec![TemplateArg::Dtype("T", dtype), TemplateArg::Int("D", d)];
    templates.extend(operands.templates);
    templates.push(TemplateArg::Int("KV_ROWS", kv_rows as i32));
    let kv_shape = match kv_rows {
        true => [b * l, 1, hkv, d],
        false => [b, hkv, l, d],
    };
    let q_shape = [b, h, l, d];
    let out = [
        (&q_shape[..], dtype),
        (&kv_shape[..], dtype),
        (&kv_shape[..], dtype),
    ];
    let pool_out = [(&q_shape[..], dtype), (&[1][..], Dtype::Int32)];
    let mut launch = Launch {
        outputs: &out,
        grid_threads: round_up(slots * 32, BLOCK),
        block_threads: BLOCK,
        templates: &templates,
        init: None,
    };
    let [qw, kw, pos, freqs] = &operands.arrays;
    let inputs = [&qkv, qw, kw, pos, freqs];
    match kv {
        HeadsKv::Out { .. } => run(&HEADS, &inputs, &launch, "heads"),
        HeadsKv::Pool(t) => {
            launch.outputs = &pool_out;
            let after = t.after.as_ref().unwrap_or(&t.slots);
            let inputs = [&inputs[..], &[&t.keys, &t.values, &t.slots, after]].concat();
            run(&HEADS_POOL, &inputs, &launch, "heads into the pool")
        }
    }
}

/// What the heads kernels read besides the q/k/v rows: the q and k
/// norms' weights, the rows' positions and the rotation's frequencies
/// (any array, unread, where the layer has none), and the template arguments
/// that give the layer's heads, norm and rotation. [`heads`] and the paged
/// attention that makes its heads itself
/// ([`crate::ragged::paged_attention_from_qkv`]) read them alike.
pub(crate) struct HeadsOperands {
    /// `qw`, `kw`, `pos`, `freqs`, the kernels' inputs of those names.
    pub arrays: [Array; 4],
    pub templates: Vec<TemplateArg<'static>>,
}

/// [`HeadsOperands`] of the q/k/v rows `qkv` of `b` rows of a layer of
/// `spec`.
pub(crate) fn heads_operands(
    qkv: &Array,
    b: i32,
    spec: &HeadsSpec,
    offsets: &Offsets,
) -> R<HeadsOperands> {
    let rope = &spec.rope;
    let pos = match offsets {
        Offsets::Scalar(o) => scalar_positions(*o, b),
        Offsets::PerRow(o) => o.as_dtype(Dtype::Int32)?,
    };
    // Unread without norms: any array of the rows' dtype.
    let (qw, kw, eps) = match spec.norms {
        Some((qw, kw, eps)) => (qw.clone(), kw.clone(), eps),
        None => (qkv.clone(), qkv.clone(), 0.0),
    };
    let freqs = match rope.freqs {
        Some(f) => f.as_dtype(Dtype::Float32)?,
        None => Array::from_slice(&[1.0f32], &[1]),
    };
    let log2_base = rope.base.map_or(0.0, f32::log2);
    let templates = vec![
        TemplateArg::Int("H", spec.heads),
        TemplateArg::Int("HKV", spec.kv_heads),
        TemplateArg::Int("HALF", rope.dims / 2),
        TemplateArg::Int("NORM", spec.norms.is_some() as i32),
        TemplateArg::Int("FREQS", rope.freqs.is_some() as i32),
        TemplateArg::Int("EPS_BITS", float_bits(eps)?),
        TemplateArg::Int("LOG2_BASE_BITS", float_bits(log2_base)?),
        TemplateArg::Int("ROPE_SCALE_BITS", float_bits(rope.scale)?),
    ];
    Ok(HeadsOperands {
        arrays: [qw, kw, pos, freqs],
        templates,
    })
}

/// Whether [`heads_into_pool`] writes activations of `dtype` into a
/// layer's pool `buffers`.
pub fn takes_pool_heads(buffers: &[Array], dtype: Dtype) -> bool {
    enabled() && buffers.len() == 2 && buffers.iter().all(|b| b.dtype() == dtype && b.ndim() == 3)
}

/// Whether [`kv_write`] writes `parts` into a paged layer's `buffers`: a
/// GPU stream, a keys and a values buffer (`[slots, kv_heads, width]`) of
/// a float dtype, parts in either layout [`crate::paged::PagePool::write`]
/// takes.
pub fn takes_kv_write(buffers: &[Array], parts: &[Array]) -> bool {
    // Not switched off with the fused kernels: a layer's writes stay in
    // place once they are (`paged::LayerBuffers`).
    crate::mask::on_gpu()
        && buffers.len() == 2
        && parts.len() == 2
        && buffers.iter().all(|b| float(b.dtype()) && b.ndim() == 3)
        && parts.iter().all(|p| p.ndim() == 4)
}

/// Writes a forward's keys and values (`parts`: `[B, kv_heads, n, width]`
/// each, or with `as_rows` the pool's rows `[B * n, 1, kv_heads, width]`)
/// into a paged layer's `buffers` at `slots` (`[B * n]` int32), in place:
/// one node for both, where MLX's scatter is one a buffer (and a new array
/// each). MLX sees the buffers as inputs only, so what it returns is the
/// write's token: what reads the buffers after the write takes it as an
/// input (the paged attention kernel, [`ordered`] gathers' indices), and
/// `after`, the layer's previous token, orders this write after the one
/// before. For what [`takes_kv_write`] takes.
pub fn kv_write(
    buffers: &[Array],
    parts: &[Array],
    as_rows: bool,
    slots: &Array,
    after: Option<&Array>,
) -> R<Array> {
    let dtype = buffers[0].dtype();
    let (heads, width) = (buffers[0].dim(1), buffers[0].dim(2));
    let n = slots.size() as i32;
    let rows = |p: &Array| -> R<Array> {
        let s = p.shape();
        let (count, h) = match as_rows {
            true => (s[0], s[2]),
            false => (s[0] * s[2], s[1]),
        };
        if count != n || h != heads || s[3] != width {
            return Err(Exception::custom(format!(
                "KV write: {s:?} is not {n} rows of {heads} heads of {width} ({})",
                if as_rows { "as rows" } else { "as heads" }
            )));
        }
        p.as_dtype(dtype)
    };
    let (k, v) = (rows(&parts[0])?, rows(&parts[1])?);
    let templates = [
        TemplateArg::Dtype("T", dtype),
        TemplateArg::Int("KV_ROWS", as_rows as i32),
    ];
    let launch = Launch {
        outputs: &[(&[1], Dtype::Int32)],
        grid_threads: round_up(2 * n * heads * width, BLOCK),
        block_threads: BLOCK,
        templates: &templates,
        init: None,
    };
    let after = after.unwrap_or(slots);
    let inputs = [&buffers[0], &buffers[1], &k, &v, slots, after];
    Ok(run(&KV_WRITE, &inputs, &launch, "KV write")?.remove(0))
}

/// A copy of the int32 `index` that MLX's CUDA graph makes only after the
/// node `after` is an output of has run: a gather by it reads the pool
/// after [`kv_write`]'s write (MLX orders a graph's kernels by the buffers
/// they share, so the gather must read one the write made).
pub fn ordered(index: &Array, after: &Array) -> R<Array> {
    let n = index.size() as i32;
    let launch = Launch {
        outputs: &[(index.shape(), Dtype::Int32)],
        grid_threads: round_up(n.max(1), BLOCK),
        block_threads: BLOCK,
        templates: &[],
        init: None,
    };
    let index = index.as_dtype(Dtype::Int32)?;
    Ok(run(&ORDERED, &[&index, after], &launch, "ordered index")?.remove(0))
}

/// Whether [`gated`] takes activations of `dtype`.
pub fn takes_gated(dtype: Dtype) -> bool {
    enabled() && float(dtype)
}

/// `silu(gate) * up` from the stacked gate/up product's `[.., 2 * n]`
/// (gate first), as `[.., n]`, for a dtype [`takes_gated`] takes.
pub fn gated(gate_up: &Array) -> R<Array> {
    let dtype = gate_up.dtype();
    let mut shape = gate_up.shape().to_vec();
    let n = shape.last().copied().unwrap_or(0) / 2;
    *shape.last_mut().unwrap() = n;
    let rows = (gate_up.size() / (2 * n.max(1)) as usize) as i32;
    let flat = gate_up.reshape(&[rows, 2 * n])?;
    let templates = [TemplateArg::Dtype("T", dtype)];
    let launch = Launch {
        outputs: &[(&shape, dtype)],
        grid_threads: round_up(rows * n, BLOCK),
        block_threads: BLOCK,
        templates: &templates,
        init: None,
    };
    Ok(run(&GATED, &[&flat], &launch, "gated")?.remove(0))
}

/// `x + r` and its RMSNorm with `weight`, as MLX's add and `rms_norm`
/// compute them. `None` where the kernel does not apply.
pub fn add_rms_norm(x: &Array, r: &Array, weight: &Array, eps: f32) -> Option<R<(Array, Array)>> {
    let dtype = x.dtype();
    let n = *x.shape().last()?;
    if !enabled()
        || !float(dtype)
        || r.dtype() != dtype
        || weight.dtype() != dtype
        || x.shape() != r.shape()
        || weight.size() != n as usize
        || n > MAX_NORM_WIDTH
    {
        return None;
    }
    let rows = (x.size() / n as usize) as i32;
    Some((|| {
        let templates = [
            TemplateArg::Dtype("T", dtype),
            TemplateArg::Int("EPS_BITS", float_bits(eps)?),
            TemplateArg::Int("PT", (n + NORM_BLOCK - 1) / NORM_BLOCK),
        ];
        let launch = Launch {
            outputs: &[(x.shape(), dtype), (x.shape(), dtype)],
            grid_threads: rows * NORM_BLOCK,
            block_threads: NORM_BLOCK,
            templates: &templates,
            init: None,
        };
        let mut out = run(&ADD_NORM, &[x, r, weight], &launch, "add + rms_norm")?;
        let y = out.pop().unwrap();
        Ok((out.pop().unwrap(), y))
    })())
}

/// A float constant as a kernel's template argument (read back with
/// `__int_as_float`): the same kernel instance every call, and no host
/// array to upload a call. MLX names the instance after its integer
/// arguments, so they must not be negative.
pub(crate) fn float_bits(x: f32) -> R<i32> {
    match x.is_sign_negative() {
        false => Ok(x.to_bits() as i32),
        true => Err(Exception::custom(format!(
            "a kernel constant must not be negative, got {x}"
        ))),
    }
}

/// The positions `[o; b]` of a forward whose rows all start at `o`: made
/// once and shared by its layers' [`heads`] calls, not once a layer.
fn scalar_positions(o: i32, b: i32) -> Array {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(i32, i32, Array)>> = const { std::cell::RefCell::new(None) };
    }
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        match last.as_ref() {
            Some((at, rows, pos)) if (*at, *rows) == (o, b) => pos.clone(),
            _ => {
                let pos = Array::from_slice(&vec![o; b as usize], &[b]);
                *last = Some((o, b, pos.clone()));
                pos
            }
        }
    })
}

const SILU_MUL: &str = include_str!("kernels/silu_mul.cuh");
pub(crate) const NORM_ROPE: &str = include_str!("kernels/norm_rope.cuh");

const BLOCK: i32 = 128;
const NORM_BLOCK: i32 = 256;
/// The widest row [`add_rms_norm`] takes: 64 elements a thread in
/// registers.
const MAX_NORM_WIDTH: i32 = 64 * NORM_BLOCK;

fn round_up(n: i32, m: i32) -> i32 {
    (n + m - 1) / m * m
}

fn run(
    kernel: &'static std::thread::LocalKey<Result<CudaKernel, String>>,
    inputs: &[&Array],
    launch: &Launch,
    what: &str,
) -> R<Vec<Array>> {
    kernel.with(|k| apply(k, inputs, launch, what))
}

/// `kernel` (or the error it was built with) applied to `inputs`.
fn apply(
    kernel: &Result<CudaKernel, String>,
    inputs: &[&Array],
    launch: &Launch,
    what: &str,
) -> R<Vec<Array>> {
    let kernel = kernel.as_ref().map_err(|e| Exception::custom(e.clone()))?;
    kernel
        .apply(inputs, launch)
        .ok_or_else(|| Exception::custom(format!("MLX could not apply the fused {what} kernel")))
}

/// One warp per (row, head slot): slots `0..H` are q heads, then `HKV` k
/// heads, then `HKV` v heads; q and k heads normed and rotated by
/// `norm_rope` (kernels/norm_rope.cuh: MLX's `rms_norm` and `rope`) and
/// rounded to `T`.
const HEADS_SOURCE: &str = r#"
    constexpr int PER = D / 32;
    constexpr int S = H + 2 * HKV;
    const int lane = threadIdx.x % 32;
    const long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int rows = qkv_shape[0];
    const int batch = pos_shape[0];
    const int L = rows / batch;
    if (warp >= (long)rows * S) return;
    const int r = warp / S, s = warp % S;
    const int b = r / L, i = r % L;
    const T* src = qkv + (size_t)r * S * D + (size_t)s * D;
    // k and v as `[B, HKV, L, D]`, or with KV_ROWS as the pool's rows
    // (`[B * L, 1, HKV, D]`: row r's heads together), or with POOL into
    // the pool buffers' slots, through the inputs' pointers (the write
    // `heads_into_pool` documents).
    if (s >= H + HKV) {
        const int kh = s - H - HKV;
#ifdef POOL
        T* dst = const_cast<T*>(v_pool) + ((size_t)slots[r] * HKV + kh) * D;
#else
        T* dst = v_out + (KV_ROWS ? ((size_t)r * HKV + kh) * D : (((size_t)b * HKV + kh) * L + i) * D);
#endif
        for (int t = 0; t < PER; t++) dst[lane + 32 * t] = src[lane + 32 * t];
        return;
    }
    const bool is_q = s < H;
    float x[PER];
    norm_rope<T, D, HALF, NORM, FREQS>(src, is_q ? qw : kw, freqs, pos[b] + i, lane,
        __int_as_float(EPS_BITS), __int_as_float(LOG2_BASE_BITS), __int_as_float(ROPE_SCALE_BITS), x);
#ifdef POOL
    T* dst = is_q ? q_out + (((size_t)b * H + s) * L + i) * D
          : const_cast<T*>(k_pool) + ((size_t)slots[r] * HKV + (s - H)) * D;
#else
    T* dst = is_q ? q_out + (((size_t)b * H + s) * L + i) * D
          : k_out + (KV_ROWS ? ((size_t)r * HKV + (s - H)) * D
                             : (((size_t)b * HKV + (s - H)) * L + i) * D);
#endif
    for (int t = 0; t < PER; t++) dst[lane + 32 * t] = static_cast<T>(x[t]);
"#;

/// One thread an output: `silu_mul` (kernels/silu_mul.cuh) of the stacked
/// halves.
const GATED_SOURCE: &str = r#"
    const int n = gate_up_shape[1] / 2;
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)gate_up_shape[0] * n) return;
    const long r = idx / n, c = idx % n;
    out[idx] = silu_mul(gate_up[r * 2 * n + c], gate_up[r * 2 * n + n + c]);
"#;

/// One block a row: `h = x + r` rounded to `T`, then MLX's `rms_norm` of
/// `h` (float sum of squares, `rsqrt(mean + eps)`, rounded to `T`, times
/// the weight in `T`). A thread holds its `PT` elements (`j = tid + t *
/// blockDim`) in registers and issues each pass's loads together, unrolled:
/// a row is one block, so at a few rows the kernel's time is its memory
/// latencies, one a pass rather than one an element.
const ADD_NORM_SOURCE: &str = r#"
    const int n = weight_shape[0];
    const long row = blockIdx.x;
    const T* xr = x + row * n;
    const T* rr = r + row * n;
    T* hr = h + row * n;
    T* yr = y + row * n;
    float xv[PT], rv[PT], wv[PT];
#pragma unroll
    for (int t = 0; t < PT; t++) {
        const int j = threadIdx.x + t * blockDim.x;
        xv[t] = j < n ? static_cast<float>(xr[j]) : 0.f;
        rv[t] = j < n ? static_cast<float>(rr[j]) : 0.f;
        wv[t] = j < n ? static_cast<float>(weight[j]) : 0.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int t = 0; t < PT; t++) {
        const int j = threadIdx.x + t * blockDim.x;
        if (j < n) {
            const T v = static_cast<T>(xv[t] + rv[t]);
            hr[j] = v;
            xv[t] = static_cast<float>(v);
            ss += xv[t] * xv[t];
        }
    }
    __shared__ float part[32];
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffff, ss, off);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.f;
        for (int off = 16; off > 0; off /= 2) t += __shfl_xor_sync(0xffffffff, t, off);
        if (threadIdx.x == 0) part[0] = t;
    }
    __syncthreads();
    const float nrm = rsqrt(part[0] / n + __int_as_float(EPS_BITS));
#pragma unroll
    for (int t = 0; t < PT; t++) {
        const int j = threadIdx.x + t * blockDim.x;
        if (j < n) {
            const T v = static_cast<T>(xv[t] * nrm);
            yr[j] = static_cast<T>(wv[t] * static_cast<float>(v));
        }
    }
"#;

/// One thread an element of the keys, then of the values: row `i` of the
/// parts goes to slot `slots[i]` of its pool buffer, written through the
/// input's pointer (the write [`kv_write`] documents). Rows are read by
/// their strides, so views need no copy first.
const KV_WRITE_SOURCE: &str = r#"
    const int H = k_pool_shape[1], W = k_pool_shape[2];
    const long per = (long)H * W;
    const long n = slots_shape[0];
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= 2 * n * per) return;
    const bool is_v = idx >= n * per;
    const long e = is_v ? idx - n * per : idx;
    const long i = e / per;
    const int j = (e % per) / W, c = e % W;
    const auto& st = is_v ? v_rows_strides : k_rows_strides;
    long from;
    if (KV_ROWS) {
        from = i * st[0] + j * st[2] + c * st[3];
    } else {
        const long L = k_rows_shape[2];
        from = (i / L) * st[0] + j * st[1] + (i % L) * st[2] + c * st[3];
    }
    T* pool = const_cast<T*>(is_v ? v_pool : k_pool);
    pool[(long)slots[i] * per + (long)j * W + c] = (is_v ? v_rows : k_rows)[from];
"#;

const PRODUCT_SOURCE: &str = include_str!("kernels/skinny_product.cu");

thread_local! {
    /// [`normed_product`]'s kernel by the shared memory it is made with.
    static NORMED_PRODUCT: std::cell::RefCell<std::collections::HashMap<i32, Result<CudaKernel, String>>> =
        Default::default();
    static PRODUCT: Result<CudaKernel, String> = CudaKernel::new(
        "skinny_product",
        &["x", "wt"],
        &["y"],
        PRODUCT_SOURCE,
        SILU_MUL,
        false,
    )
    .map_err(|e| format!("{e:#}"));
    static HEADS: Result<CudaKernel, String> = CudaKernel::new(
        "fused_heads",
        &["qkv", "qw", "kw", "pos", "freqs"],
        &["q_out", "k_out", "v_out"],
        HEADS_SOURCE,
        NORM_ROPE,
        true,
    )
    .map_err(|e| format!("{e:#}"));
    static HEADS_POOL: Result<CudaKernel, String> = CudaKernel::new(
        "fused_heads_pool",
        &["qkv", "qw", "kw", "pos", "freqs", "k_pool", "v_pool", "slots", "after"],
        &["q_out", "written"],
        &format!("#define POOL\n{HEADS_SOURCE}"),
        NORM_ROPE,
        true,
    )
    .map_err(|e| format!("{e:#}"));
    static GATED: Result<CudaKernel, String> = CudaKernel::new(
        "fused_gated",
        &["gate_up"],
        &["out"],
        GATED_SOURCE,
        SILU_MUL,
        true,
    )
    .map_err(|e| format!("{e:#}"));
    static ORDERED: Result<CudaKernel, String> = CudaKernel::new(
        "ordered_index",
        &["index", "after"],
        &["out"],
        "const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < index_shape[0]) out[i] = index[i];",
        "",
        true,
    )
    .map_err(|e| format!("{e:#}"));
    static KV_WRITE: Result<CudaKernel, String> = CudaKernel::new(
        "kv_write",
        &["k_pool", "v_pool", "k_rows", "v_rows", "slots", "after"],
        &["written"],
        KV_WRITE_SOURCE,
        "",
        false,
    )
    .map_err(|e| format!("{e:#}"));
    static ADD_NORM: Result<CudaKernel, String> = CudaKernel::new(
        "fused_add_rms_norm",
        &["x", "r", "weight"],
        &["h", "y"],
        ADD_NORM_SOURCE,
        "",
        true,
    )
    .map_err(|e| format!("{e:#}"));
}
