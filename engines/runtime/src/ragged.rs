//! Attention over a ragged batch in one CUDA kernel (issue 18).
//!
//! A few queries per row (one for a decode step, a drafted block for a
//! verify, a short prefill chunk) attend to that row's own keys: row `b`
//! starts at column `starts[b]` of the left-padded cache, query `i` of `n`
//! sits at column `total - n + i` and sees keys up to itself (lower-right
//! causal), and a sliding window keeps its last `window` keys. MLX's CUDA
//! backend gives such queries cuDNN's attention, which builds a graph per
//! (rows, queries, keys) shape: a context growing by one token per round,
//! and every new group of prompts, misses it. This kernel takes the rows'
//! starts as data, so one compiled kernel serves every shape.
//!
//! The rule is [`crate::mask::ragged_mask`]'s, which is also the reference:
//! on the CPU, and wherever the kernel does not apply, the same mask goes
//! to MLX's attention. `examples/ragged_check.rs` compares the two on a GPU.

use std::sync::atomic::{AtomicU8, Ordering};

use anyhow::anyhow;
use mlx_rs::{Array, Dtype};

use crate::cuda_kernel::{CudaKernel, Launch, TemplateArg};

/// Most queries per row the kernel takes: a decode step, a verify, and a
/// short prefill chunk (of a padded group, or after a cached prefix).
pub const MAX_QUERIES: i32 = 256;

/// Queries per row the kernel always takes: a decode step or a verify.
const VERIFY_QUERIES: i32 = 16;

/// Most (row, query, key) triples per layer the kernel takes for a prefill
/// chunk. MLX gives such a chunk cuDNN's attention, which builds a graph
/// for each new (rows, queries, keys) shape: 44-1357 ms the first call on
/// an H100, paid again by every new group of prompts and prefix length in
/// a serving run. The kernel builds nothing per shape, but reads each key
/// once per query: about 3 ns a triple, so up to this many it costs at
/// most ~1.5 ms a layer (`examples/ragged_time`, docs/benchmarks.md "First-shape
/// costs and prefill").
const MAX_PREFILL_WORK: i64 = 1 << 19;

/// Whether `n` queries a row over `total` columns of `rows` rows go to the
/// kernel (the rule [`crate::mask::build`] applies).
pub fn takes(rows: i32, n: i32, total: i32) -> bool {
    n <= VERIFY_QUERIES
        || (n <= MAX_QUERIES && rows as i64 * n as i64 * total as i64 <= MAX_PREFILL_WORK)
}

/// Whether MLX's own attention is fused for heads of `dim` on a GPU. MLX
/// 0.32's CUDA backend fuses head widths 64, 96 and 128 only (its vector
/// kernel, and cuDNN up to 128); other widths (Gemma's 256 and 512, Qwen
/// 3.5's 256) run unfused: two matmuls, a softmax and about a dozen views
/// and broadcasts a layer, each a node of the step's graph. For those the
/// kernel takes every step it can ([`crate::mask::build`]).
pub fn mlx_fuses(dim: i32) -> bool {
    matches!(dim, 64 | 96 | 128)
}

/// Warps per block: each takes every `WARPS`-th chunk of 32 keys of its
/// query's range.
const WARPS: i32 = 4;

/// One block per (row, group of `GROUP` query heads sharing a key head,
/// query); the group's queries sit in shared memory, so each key and value
/// row is read once for the whole group (grouped-query attention reads
/// each a quarter as often as a block per query head would). A warp takes
/// 32 keys at a time, one per lane: each lane scores its key against the
/// group's queries (independent loads, no reduction per key), the warp
/// folds the chunk into each head's online softmax with one max and one
/// sum, and then every lane adds the chunk's values into the `D / 32`
/// output elements per head it owns. The warps' partial results are merged
/// through shared memory at the end. Scores and sums are float32 whatever
/// `T` is.
const SOURCE: &str = r#"
    // The output as `[B, heads, n, D]`, or with MERGED as the heads merged
    // into rows (`[B, n, heads, D]`), the output product's input.
#define OUT_AT(g, e) (MERGED ? (((size_t)b * n + qi) * heads + h0 + (g)) * D + (e) \
                             : (((size_t)b * heads + h0 + (g)) * n + qi) * D + (e))
    // Key or value row `j`: with FUSED_HEADS the new position's from
    // shared memory.
#ifdef FUSED_HEADS
#define NEW_AT(fresh, j, at) ((j) == qpos ? (fresh) : (at))
#else
#define NEW_AT(fresh, j, at) (at)
#endif
    constexpr int PER = D / 32;
    constexpr int VEC = 16 / sizeof(T);
#ifdef FUSED_HEADS
    // One query a row, its heads made here from the row's q/k/v product.
    const int n = 1;
    const int heads = H;
    const int rows = qkv_shape[0];
#else
    const int n = q_shape[2];
    const int heads = q_shape[1];
    const int rows = q_shape[0];
#endif
    const int kv_heads = KV_HEADS;
    const int total = TOTAL;
    // `splits` blocks share an item (row, head group, query), each over
    // its own share of the keys.
    const int splits = gridDim.x / (rows * (heads / GROUP) * n);
    const int split = blockIdx.x % splits;
    const int slot = blockIdx.x / splits;
    int item = slot;
    const int qi = item % n;
    item /= n;
    const int h0 = (item % (heads / GROUP)) * GROUP;
    const int b = item / (heads / GROUP);
    const int kh = h0 / (heads / kv_heads);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int qpos = total - n + qi;
    const int window = meta[rows];
    const int row_start = meta[b];
    PREPARE
    int lo = row_start;
    if (window > 0 && qpos - window + 1 > lo) lo = qpos - window + 1;
    // A padding query (before its row's start) sees only itself, as the
    // reference mask has it, so no softmax is empty.
    if (lo > qpos) lo = qpos;
    // This block's keys: whole chunks of 32 from `lo`, the last ending at
    // the query.
    const int per_split = ((qpos - lo) / 32 + splits) / splits;
    const int first = lo + split * per_split * 32;
    const int last = min(qpos, first + per_split * 32 - 1);

    __shared__ float qs[GROUP][D];
    const float sc = __int_as_float(SCALE_BITS);
#ifdef FUSED_HEADS
    // A warp a head, as the heads kernel makes them (`norm_rope`): the
    // group's queries, then the row's new key and its value. The block
    // whose keys end at the new position reads them from here (the pool
    // is written in this kernel, so no block reads them from there), and
    // the first such block of their key head writes them to the pool.
    __shared__ __align__(16) T knew[D];
    __shared__ __align__(16) T vnew[D];
    {
        const T* row = qkv + (size_t)b * (H + 2 * KV_HEADS) * D;
        for (int g = warp; g < GROUP + 2; g += WARPS) {
            if (g == GROUP + 1) {
                for (int e = lane; e < D; e += 32) vnew[e] = row[(size_t)(H + KV_HEADS + kh) * D + e];
                continue;
            }
            float x[PER];
            const bool is_q = g < GROUP;
            norm_rope<T, D, HALF, NORM, FREQS>(row + (size_t)(is_q ? h0 + g : H + kh) * D,
                is_q ? qw : kw, freqs, pos[b], lane, __int_as_float(EPS_BITS),
                __int_as_float(LOG2_BASE_BITS), __int_as_float(ROPE_SCALE_BITS), x);
            for (int t = 0; t < PER; t++) {
                const T y = static_cast<T>(x[t]);
                if (is_q) qs[g][lane + 32 * t] = static_cast<float>(y) * sc;
                else knew[lane + 32 * t] = y;
            }
        }
    }
#else
    for (int i = threadIdx.x; i < GROUP * D; i += blockDim.x) {
        const int g = i / D, e = i % D;
        const T* qp = q + b * q_strides[0] + (h0 + g) * q_strides[1] + qi * q_strides[2];
        qs[g][e] = static_cast<float>(qp[e * q_strides[3]]) * sc;
    }
#endif
    __syncthreads();
#ifdef FUSED_HEADS
    if (first <= qpos && qpos <= last && h0 % (heads / kv_heads) == 0) {
        const size_t at = ((size_t)slots[b] * kv_heads + kh) * D;
        for (int e = threadIdx.x; e < D; e += blockDim.x) {
            const_cast<T*>(k)[at + e] = knew[e];
            const_cast<T*>(v)[at + e] = vnew[e];
        }
    }
#endif
    // Rows of whole aligned 16-byte vectors are read as such.
    const bool vec_k = ESTRIDE(k_strides) == 1 && reinterpret_cast<size_t>(k) % 16 == 0
        && ROWS_ALIGNED(k_strides, VEC);
    float o[GROUP][PER];
    float m[GROUP];
    float s[GROUP];
    for (int g = 0; g < GROUP; g++) {
        for (int i = 0; i < PER; i++) o[g][i] = 0.f;
        m[g] = -1e30f;
        s[g] = 0.f;
    }
    for (int c0 = first + warp * 32; c0 <= last; c0 += WARPS * 32) {
        const int j = c0 + lane;
        float d[GROUP];
        for (int g = 0; g < GROUP; g++) d[g] = -1e30f;
        if (j <= last) {
            const T* kr = NEW_AT(knew, j, k + KEY_AT(k_strides, j));
            float acc[GROUP];
            for (int g = 0; g < GROUP; g++) acc[g] = 0.f;
            if (vec_k) {
                const uint4* kv = reinterpret_cast<const uint4*>(kr);
                for (int u = 0; u < D / VEC; u++) {
                    uint4 raw = kv[u];
                    const T* e = reinterpret_cast<const T*>(&raw);
                    for (int i = 0; i < VEC; i++) {
                        const float x = static_cast<float>(e[i]);
                        for (int g = 0; g < GROUP; g++) acc[g] += qs[g][u * VEC + i] * x;
                    }
                }
            } else {
                for (int i = 0; i < D; i++) {
                    const float x = static_cast<float>(kr[i * ESTRIDE(k_strides)]);
                    for (int g = 0; g < GROUP; g++) acc[g] += qs[g][i] * x;
                }
            }
            for (int g = 0; g < GROUP; g++) d[g] = acc[g];
        }
        float p[GROUP];
        for (int g = 0; g < GROUP; g++) {
            float cm = d[g];
            for (int off = 16; off > 0; off /= 2) cm = fmaxf(cm, __shfl_xor_sync(0xffffffff, cm, off));
            const float mn = fmaxf(m[g], cm);
            const float corr = __expf(m[g] - mn);
            p[g] = j <= last ? __expf(d[g] - mn) : 0.f;
            float ps = p[g];
            for (int off = 16; off > 0; off /= 2) ps += __shfl_xor_sync(0xffffffff, ps, off);
            s[g] = s[g] * corr + ps;
            for (int i = 0; i < PER; i++) o[g][i] *= corr;
            m[g] = mn;
        }
        // The chunk's value rows in batches of VB whose loads are all issued
        // before any is used: one memory latency a batch, not one a key,
        // which set the kernel's time at a few rows. Keys past the chunk's
        // last read its last row again and weigh 0 (their lanes' p).
        const int count = min(32, last - c0 + 1);
        constexpr int VB = PER <= 4 ? 8 : 4;
        for (int t0 = 0; t0 < count; t0 += VB) {
            float val[VB][PER];
#pragma unroll
            for (int u = 0; u < VB; u++) {
                const int c = c0 + min(t0 + u, count - 1);
                const T* vr = NEW_AT(vnew, c, v + KEY_AT(v_strides, c));
#pragma unroll
                for (int i = 0; i < PER; i++) {
                    val[u][i] = static_cast<float>(vr[(lane * PER + i) * ESTRIDE(v_strides)]);
                }
            }
#pragma unroll
            for (int u = 0; u < VB; u++) {
                for (int g = 0; g < GROUP; g++) {
                    const float pt = __shfl_sync(0xffffffff, p[g], t0 + u);
                    for (int i = 0; i < PER; i++) o[g][i] += pt * val[u][i];
                }
            }
        }
    }
    __shared__ float wm[WARPS][GROUP];
    __shared__ float ws[WARPS][GROUP];
    __shared__ float wo[WARPS][GROUP][D];
    for (int g = 0; g < GROUP; g++) {
        if (lane == 0) {
            wm[warp][g] = m[g];
            ws[warp][g] = s[g];
        }
        for (int i = 0; i < PER; i++) {
            wo[warp][g][lane * PER + i] = o[g][i];
        }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < GROUP * D; x += blockDim.x) {
        const int g = x / D, e = x % D;
        float big = -1e30f;
        for (int w = 0; w < WARPS; w++) big = fmaxf(big, wm[w][g]);
        float sum = 0.f;
        float acc = 0.f;
        for (int w = 0; w < WARPS; w++) {
            const float f = __expf(wm[w][g] - big);
            sum += ws[w][g] * f;
            acc += wo[w][g][e] * f;
        }
#ifdef SPLIT
        float* pp = part + ((size_t)blockIdx.x * GROUP + g) * (D + 2);
        pp[e] = acc;
        if (e == 0) {
            pp[D] = big;
            pp[D + 1] = sum;
        }
#else
        out[OUT_AT(g, e)] = static_cast<T>(acc / sum);
#endif
    }
#ifdef SPLIT
    // The item's last block to finish merges every block's partial
    // softmax (their writes are visible after the fence and the count).
    __threadfence();
    __syncthreads();
    __shared__ bool merges;
    if (threadIdx.x == 0) merges = atomicAdd(&count[slot], 1) == splits - 1;
    __syncthreads();
    if (!merges) return;
    __threadfence();
    for (int x = threadIdx.x; x < GROUP * D; x += blockDim.x) {
        const int g = x / D, e = x % D;
        const float* p0 = part + ((size_t)slot * splits * GROUP + g) * (D + 2);
        const size_t step = (size_t)GROUP * (D + 2);
        float big = -1e30f;
        for (int t = 0; t < splits; t++) big = fmaxf(big, __ldcg(p0 + t * step + D));
        float sum = 0.f;
        float acc = 0.f;
        for (int t = 0; t < splits; t++) {
            const float f = __expf(__ldcg(p0 + t * step + D) - big);
            sum += __ldcg(p0 + t * step + D + 1) * f;
            acc += __ldcg(p0 + t * step + e) * f;
        }
        out[OUT_AT(g, e)] = static_cast<T>(acc / sum);
    }
#endif
"#;

/// The contiguous cache's layout: `k`, `v` are `[B, kv_heads, total, D]`.
const CONTIGUOUS: &str = r#"
#define KV_HEADS (k_shape[1])
#define TOTAL (k_shape[2])
#define PREPARE
#define KEY_AT(st, j) ((size_t)b * st[0] + (size_t)kh * st[1] + (size_t)(j) * st[2])
#define ESTRIDE(st) (st[3])
#define ROWS_ALIGNED(st, n) (st[0] % (n) == 0 && st[1] % (n) == 0 && st[2] % (n) == 0)
"#;

/// A paged cache's layout (`crate::paged`): `k`, `v` are the pool's
/// `[slots, kv_heads, D]`, row `b`'s position `p` lies in block
/// `tables[b][p / BLOCK]`, and columns before the row's start (padding)
/// in block 0, as `paged::slot` has it. The row's table is read into
/// shared memory first: a key's slot is then no second dependent read
/// from global memory in the key loop.
const PAGED: &str = r#"
#define KV_HEADS (k_shape[1])
#define TOTAL (meta[rows + 1])
#define PREPARE \
    __shared__ int table[MAX_TABLE]; \
    for (int i = threadIdx.x; i < tables_shape[1]; i += blockDim.x) \
        table[i] = tables[b * tables_shape[1] + i]; \
    __syncthreads();
#define SLOT(j) ((j) < row_start ? (j) % BLOCK \
    : table[((j) - row_start) / BLOCK] * BLOCK + ((j) - row_start) % BLOCK)
#define KEY_AT(st, j) ((size_t)SLOT(j) * st[0] + (size_t)kh * st[1])
#define ESTRIDE(st) (st[2])
#define ROWS_ALIGNED(st, n) (st[0] % (n) == 0 && st[1] % (n) == 0)
"#;

/// Most blocks in a row's table the paged kernel takes (its shared-memory
/// copy): 32,768 positions of 16-position blocks.
pub const MAX_TABLE: i32 = 2048;

/// Whether the kernel takes these operands: float keys and values (the
/// quantized cache is dequantized before attention on a GPU), a head
/// width of whole warps, at most [`MAX_QUERIES`] queries, and query heads
/// a multiple of the key heads.
pub fn applies(q: &Array, k: &Array) -> bool {
    fits(Shape::of(q), k)
}

/// [`applies`] for a paged layer's pool buffers (`[slots, kv_heads, D]`)
/// and its rows' block `tables`.
pub fn applies_paged(q: &Array, k: &Array, tables: &Array) -> bool {
    fits_paged(Shape::of(q), k, tables)
}

/// The queries' side of a launch: `[B, heads, n, D]` in `dtype`.
struct Shape {
    heads: i32,
    n: i32,
    d: i32,
    dtype: Dtype,
}

impl Shape {
    fn of(q: &Array) -> Self {
        Self {
            heads: q.dim(1),
            n: q.dim(2),
            d: q.dim(3),
            dtype: q.dtype(),
        }
    }
}

fn fits_paged(q: Shape, k: &Array, tables: &Array) -> bool {
    k.ndim() == 3 && k.dim(2) == q.d && tables.dim(1) <= MAX_TABLE && fits(q, k)
}

fn fits(q: Shape, k: &Array) -> bool {
    let kv_heads = k.dim(1);
    matches!(q.dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && k.dtype() == q.dtype
        && q.d % 32 == 0
        && q.d <= 512
        && q.n <= MAX_QUERIES
        && kv_heads > 0
        && q.heads % kv_heads == 0
}

/// The row starts, window and total columns as the kernels read them:
/// `[starts..., window, total]` (window 0: none).
pub fn meta(starts: &[i32], window: Option<i32>, total: i32) -> Array {
    let mut data = starts.to_vec();
    data.push(window.unwrap_or(0));
    data.push(total);
    Array::from_slice(&data, &[data.len() as i32])
}

/// `softmax(q k^T * scale + mask) v` for `q` `[B, heads, n, D]` and `k`, `v`
/// `[B, kv_heads, total, D]` (strided views are read in place), under the
/// ragged mask that `meta` describes. Returns `[B, heads, n, D]`, or with
/// `merged` the heads merged into rows of that shape (`[B, n, heads * D]`
/// in memory): the output product's input, with no transpose or reshape
/// node between.
pub fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    meta: &Array,
    merged: Option<&[i32]>,
) -> anyhow::Result<Array> {
    let kernels = Kernels {
        whole: &CONTIGUOUS_KERNEL,
        split: &CONTIGUOUS_SPLIT_KERNEL,
    };
    launch(kernels, Queries::Heads(q), k, v, meta, scale, None, merged)
}

/// [`attention`] over a paged layer: `k`, `v` are the pool's buffers
/// (`[slots, kv_heads, D]`), `read` says where each row's columns lie and
/// `written` is the token of their last in-place write, which the kernel
/// takes as an input so that it runs after the write.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    meta: &Array,
    read: &crate::cache::PagedRead,
    written: Option<&Array>,
    merged: Option<&[i32]>,
) -> anyhow::Result<Array> {
    let kernels = Kernels {
        whole: &PAGED_KERNEL,
        split: &PAGED_SPLIT_KERNEL,
    };
    launch(
        kernels,
        Queries::Heads(q),
        k,
        v,
        meta,
        scale,
        Some((read, written)),
        merged,
    )
}

/// Whether [`paged_attention_from_qkv`] is switched on
/// (`GATEWAY_GPU_HEADS_IN_ATTENTION=on`, or [`set_heads_in_attention`]).
/// Off by default until `examples/fused_check` has compared it with the
/// heads kernel and attention apart on a device (docs/gpu.md).
pub fn heads_in_attention() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    match HEADS_IN_ATTENTION.load(Ordering::Relaxed) {
        SWITCHED_ON => true,
        SWITCHED_OFF => false,
        _ => crate::gpu_fused::env_is(&ON, "GATEWAY_GPU_HEADS_IN_ATTENTION", "on"),
    }
}

/// Whether [`paged_attention_from_qkv`] takes a layer of `spec` over the
/// pool `target` in a forward of one position a row with blocks `tables`:
/// [`applies_paged`]'s operands.
pub fn takes_heads_in_attention(
    spec: &crate::gpu_fused::HeadsSpec,
    dtype: Dtype,
    target: &crate::cache::PoolTarget,
    tables: &Array,
) -> bool {
    let queries = Shape {
        heads: spec.heads,
        n: 1,
        d: spec.head_dim,
        dtype,
    };
    target.keys.dim(1) == spec.kv_heads && fits_paged(queries, &target.keys, tables)
}

/// [`set_heads_in_attention`]'s switch: unset (the environment decides),
/// on or off.
static HEADS_IN_ATTENTION: AtomicU8 = AtomicU8::new(0);
const SWITCHED_ON: u8 = 1;
const SWITCHED_OFF: u8 = 2;

/// Switches [`paged_attention_from_qkv`] on or off for the whole process
/// (the device check compares it with the heads kernel and attention
/// apart).
pub fn set_heads_in_attention(on: bool) {
    let state = if on { SWITCHED_ON } else { SWITCHED_OFF };
    HEADS_IN_ATTENTION.store(state, Ordering::Relaxed);
}

/// [`paged_attention`] of one position a row straight from its stacked
/// q/k/v product `qkv` (`[B, (heads + 2 * kv_heads) * D]`): the kernel
/// makes the heads as [`crate::gpu_fused::heads_into_pool`] does (the
/// same arithmetic, so the same numbers) and writes the position's key and
/// value into `target`, so one node does what the heads kernel and
/// attention did. Returns the heads merged as rows of `merged`; that
/// output is also the pool write's token. For what
/// [`takes_heads_in_attention`] takes, while [`heads_in_attention`].
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_from_qkv(
    qkv: &Array,
    spec: &crate::gpu_fused::HeadsSpec,
    offsets: &crate::cache::Offsets,
    target: &crate::cache::PoolTarget,
    scale: f32,
    meta: &Array,
    read: &crate::cache::PagedRead,
    merged: &[i32],
) -> anyhow::Result<Array> {
    let b = read.rows;
    let width = (spec.heads + 2 * spec.kv_heads) * spec.head_dim;
    anyhow::ensure!(
        qkv.size() == (b * width) as usize && target.slots.size() == b as usize,
        "heads in attention: {:?} is not {b} rows of {width} ({} slots)",
        qkv.shape(),
        target.slots.size()
    );
    let qkv = match qkv.ndim() {
        2 => qkv.clone(),
        _ => qkv.reshape(&[b, width])?,
    };
    let operands = crate::gpu_fused::heads_operands(&qkv, b, spec, offsets)?;
    let kernels = Kernels {
        whole: &PAGED_HEADS_KERNEL,
        split: &PAGED_HEADS_SPLIT_KERNEL,
    };
    let stacked = Stacked {
        qkv: &qkv,
        heads: spec.heads,
        head_dim: spec.head_dim,
        operands: &operands,
        slots: &target.slots,
    };
    launch(
        kernels,
        Queries::Stacked(stacked),
        &target.keys,
        &target.values,
        meta,
        scale,
        Some((read, target.after.as_ref())),
        Some(merged),
    )
}

/// Query heads a block takes: the most that share a key head (dividing
/// the `ratio` of query heads to key heads), at most 8, whose outputs stay
/// within 32 registers a lane (`GROUP * D / 32`); the group's keys and
/// values are read once.
fn group(ratio: i32, d: i32) -> i32 {
    let per = d / 32;
    (1..=ratio)
        .rev()
        .find(|g| ratio % g == 0 && g * per <= 32 && *g <= 8)
        .unwrap_or(1)
}

/// Blocks a launch aims at: about two per streaming multiprocessor of an
/// H100 or H200 (132), so that a few rows' long contexts keep the GPU busy.
const TARGET_BLOCKS: i32 = 256;

/// Blocks sharing one (row, head group, query) when `items` of them attend
/// to `total` keys: enough to reach [`TARGET_BLOCKS`], each keeping at
/// least a chunk of 32 keys for every warp (1: no split).
fn splits(items: i32, total: i32) -> i32 {
    let chunks_per_block = (total + 32 * WARPS - 1) / (32 * WARPS);
    (TARGET_BLOCKS / items.max(1))
        .clamp(1, 32)
        .min(chunks_per_block.max(1))
}

/// The kernels of one layout: whole items, and items split over blocks.
struct Kernels {
    whole: &'static std::thread::LocalKey<Result<CudaKernel, String>>,
    split: &'static std::thread::LocalKey<Result<CudaKernel, String>>,
}

/// Where a launch's queries come from.
enum Queries<'a> {
    /// Heads, `[B, heads, n, D]`.
    Heads(&'a Array),
    /// One position a row's stacked q/k/v product (`FUSED_HEADS`).
    Stacked(Stacked<'a>),
}

struct Stacked<'a> {
    /// `[B, (heads + 2 * kv_heads) * D]`.
    qkv: &'a Array,
    heads: i32,
    head_dim: i32,
    operands: &'a crate::gpu_fused::HeadsOperands,
    /// `[B]`: each row's new position's slot in the pool.
    slots: &'a Array,
}

/// Runs the layout's kernel on its inputs: `q, k, v, meta`, and for a
/// paged layer its block tables, its block size a template argument (the
/// scale too, as its bits: no host array a call). A few items over many
/// keys (one sequence's step at a long context) are split over several
/// blocks, the last of which merges their softmaxes.
#[allow(clippy::too_many_arguments)]
fn launch(
    kernels: Kernels,
    queries: Queries,
    k: &Array,
    v: &Array,
    meta: &Array,
    scale: f32,
    paged: Option<(&crate::cache::PagedRead, Option<&Array>)>,
    merged: Option<&[i32]>,
) -> anyhow::Result<Array> {
    let (b, heads, n, d, dtype) = match &queries {
        Queries::Heads(q) => (q.dim(0), q.dim(1), q.dim(2), q.dim(3), q.dtype()),
        Queries::Stacked(s) => (s.qkv.dim(0), s.heads, 1, s.head_dim, s.qkv.dtype()),
    };
    let total = paged.map_or(k.dim(2), |(read, _)| read.total);
    let kv_heads = k.dim(1);
    let grouped = group(heads / kv_heads, d);
    let split = splits(b * (heads / grouped) * n, total);
    // Unsplit, grouped heads leave fewer blocks: for a few rows a block per
    // query head keeps more of the GPU busy.
    let group = match split == 1 && b * n * kv_heads < 32 {
        true => 1,
        false => grouped,
    };
    let items = b * (heads / group) * n;
    let mut templates = vec![
        TemplateArg::Dtype("T", dtype),
        TemplateArg::Int("D", d),
        TemplateArg::Int("WARPS", WARPS),
        TemplateArg::Int("GROUP", group),
        TemplateArg::Int("SCALE_BITS", crate::gpu_fused::float_bits(scale)?),
        TemplateArg::Int("MERGED", merged.is_some() as i32),
    ];
    let mut inputs = vec![
        match &queries {
            Queries::Heads(q) => *q,
            Queries::Stacked(s) => s.qkv,
        },
        k,
        v,
        meta,
    ];
    if let Some((read, written)) = paged {
        templates.push(TemplateArg::Int("BLOCK", read.block));
        templates.push(TemplateArg::Int("MAX_TABLE", MAX_TABLE));
        inputs.push(&read.tables);
        // Unread: it orders the kernel after the pool's in-place write.
        inputs.push(written.unwrap_or(&read.tables));
    }
    if let Queries::Stacked(s) = &queries {
        templates.extend(s.operands.templates.iter().cloned());
        inputs.extend(s.operands.arrays.iter());
        inputs.push(s.slots);
    }
    let out_shape = merged.map_or_else(|| vec![b, heads, n, d], <[i32]>::to_vec);
    anyhow::ensure!(
        out_shape.iter().product::<i32>() == b * heads * n * d,
        "merged attention output {out_shape:?} does not hold {b} x {n} rows of {heads} heads of {d}"
    );
    let part_shape = [items * split * group * (d + 2)];
    let count_shape = [items];
    let outputs = [
        (&out_shape[..], dtype),
        (&part_shape[..], Dtype::Float32),
        (&count_shape[..], Dtype::Int32),
    ];
    let launch = Launch {
        outputs: if split > 1 { &outputs } else { &outputs[..1] },
        grid_threads: items * split * WARPS * 32,
        block_threads: WARPS * 32,
        templates: &templates,
        // The split kernel's block counts start at zero.
        init: (split > 1).then_some(0.0),
    };
    let kernel = if split > 1 {
        kernels.split
    } else {
        kernels.whole
    };
    kernel
        .with(|kernel| {
            let kernel = kernel.as_ref().map_err(|e| anyhow!("{e}"))?;
            Ok::<_, anyhow::Error>(kernel.apply(&inputs, &launch).map(|mut o| o.remove(0)))
        })?
        .ok_or_else(|| {
            anyhow!(
                "the ragged attention kernel could not be applied ({b} rows, {heads} heads, {n} queries, head width {d}, {dtype:?})"
            )
        })
}

/// The split kernels' partial results (`[blocks, GROUP, D + 2]`: the
/// output's sums, then the softmax's max and sum) and each item's count of
/// finished blocks.
const SPLIT: &str = "#define SPLIT\n";

/// The heads made in the kernel from the stacked q/k/v product, and the
/// new position's key and value written to the pool there
/// ([`paged_attention_from_qkv`]).
const FUSED_HEADS: &str = "#define FUSED_HEADS\n";

fn kernel(name: &str, layout: &str, split: bool, heads: bool) -> Result<CudaKernel, String> {
    let mut inputs = vec![if heads { "qkv" } else { "q" }, "k", "v", "meta"];
    if layout == PAGED {
        inputs.extend(["tables", "written"]);
    }
    if heads {
        inputs.extend(["qw", "kw", "pos", "freqs", "slots"]);
    }
    let outputs: &[&str] = if split {
        &["out", "part", "count"]
    } else {
        &["out"]
    };
    let prefix = if split { SPLIT } else { "" };
    let (fused, header) = match heads {
        true => (FUSED_HEADS, crate::gpu_fused::NORM_ROPE),
        false => ("", ""),
    };
    CudaKernel::new(
        name,
        &inputs,
        outputs,
        &format!("{prefix}{fused}{layout}{SOURCE}"),
        header,
        false,
    )
    .map_err(|e| format!("{e:#}"))
}

thread_local! {
    static CONTIGUOUS_KERNEL: Result<CudaKernel, String> =
        kernel("ragged_attention", CONTIGUOUS, false, false);
    static CONTIGUOUS_SPLIT_KERNEL: Result<CudaKernel, String> =
        kernel("ragged_attention_split", CONTIGUOUS, true, false);
    static PAGED_KERNEL: Result<CudaKernel, String> =
        kernel("paged_attention", PAGED, false, false);
    static PAGED_SPLIT_KERNEL: Result<CudaKernel, String> =
        kernel("paged_attention_split", PAGED, true, false);
    static PAGED_HEADS_KERNEL: Result<CudaKernel, String> =
        kernel("paged_attention_heads", PAGED, false, true);
    static PAGED_HEADS_SPLIT_KERNEL: Result<CudaKernel, String> =
        kernel("paged_attention_heads_split", PAGED, true, true);
}

#[cfg(test)]
mod tests {
    use super::{splits, takes};

    #[test]
    fn few_items_over_long_contexts_are_split_over_blocks() {
        // One Qwen3-4B row (8 groups of 4 query heads): whole at 128 keys,
        // split to 128 blocks at 2,000.
        assert_eq!(splits(8, 128), 1);
        assert_eq!(splits(8, 2000), 16);
        // A verify of 8 at 2,000 keys, and 16 rows of a batch.
        assert_eq!(splits(64, 2000), 4);
        assert_eq!(splits(128, 128), 1);
        assert_eq!(splits(128, 2000), 2);
        // Enough items already: never split.
        assert_eq!(splits(512, 32_768), 1);
    }

    #[test]
    fn decode_steps_and_verifies_always_go_to_the_kernel_prefill_chunks_within_its_budget() {
        assert!(takes(64, 1, 32_768));
        assert!(takes(16, 16, 4096));
        // A group of short prompts, as a burst of chat requests brings.
        assert!(takes(12, 160, 160));
        // A chunk after a long cached prefix, a long prompt, a wide group.
        assert!(!takes(1, 256, 8192));
        assert!(!takes(1, 257, 257));
        assert!(!takes(64, 64, 256));
    }
}
