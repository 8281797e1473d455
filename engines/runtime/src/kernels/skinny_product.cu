// y[M, N] = x[M, K] @ w[N, K]^T for a few rows (M <= 8 * MT), bf16 or fp16
// operands, fp32 accumulation on the tensor cores (mma m16n8k16). The
// weight is passed as `wt`, its transposed view [K, N] (what the model
// keeps), whose buffer is `w` row-major. With GATED, w stacks a gate and
// an up projection ([2 * F, K]) and y[M, F] = silu(gate) * up, each
// product rounded to T first and the activation in T as MLX computes it.
//
// A block owns 16 output features (weight rows n0..n0+15) and splits K
// over its WK warps in chunks of 32. Each lane loads 16 contiguous bytes
// of a weight row and of an x row a chunk, and the chunk's K order is
// permuted the same way in both operands (the mma sums over K in any
// order), so the fragments come straight from global memory: no shared
// memory on the way in, every weight byte read once. The warps' partial
// sums meet in shared memory in a fixed order (deterministic results).
// Template arguments: T, BF16 (else fp16), GATED, MT (8-row tiles), WK
// (warps), U (chunks a warp has in flight).
//
// With SKINNY_NORMED defined, the operand is RMSNorm(x + r) (ADD) or
// RMSNorm(x) with weight nw, made by the block in shared memory before the
// product (MLX's arithmetic as gpu_fused::add_rms_norm's kernel has it), and block 0 writes x + r to h: the norm's node folded
// into the product's. Extra template arguments: ADD, EPS_BITS, KS (= K).
constexpr int NS = GATED ? 2 : 1;  // weight row sets: the gate's, the up's
const int K = wt_shape[0];
const int N = wt_shape[1];
const int F = N / NS;  // output features
const int M = x_shape[0];
const long xs = x_strides[0];
bool layout_ok = wt_strides[0] == 1 && x_strides[1] == 1;
#ifdef SKINNY_NORMED
const long rs = r_strides[0];
layout_ok = layout_ok && K == KS && M <= WK && r_strides[1] == 1 && xs % 8 == 0 && rs % 8 == 0 &&
    ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(r) | reinterpret_cast<size_t>(nw)) & 15) == 0;
#endif
if (!layout_ok) {
  // Not the layout this kernel reads: a NaN output rather than a wrong one.
  for (long i = blockIdx.x * blockDim.x + threadIdx.x; i < (long)M * F; i += gridDim.x * blockDim.x)
    if (i < (long)M * F) y[i] = static_cast<T>(__int_as_float(0x7fc00000));
  return;
}
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int g = lane >> 2;
const int t = lane & 3;
const int n0 = blockIdx.x * 16;
const unsigned short* wb = reinterpret_cast<const unsigned short*>(wt);
#ifndef SKINNY_NORMED
const unsigned short* xb = reinterpret_cast<const unsigned short*>(x);
#endif
const unsigned short* w0 = wb + (size_t)(n0 + g) * K + t * 8;
const unsigned short* w1 = w0 + (size_t)8 * K;
const size_t set = (size_t)F * K;  // from a gate row to its up row
float acc[NS][MT][4];
#pragma unroll
for (int j = 0; j < NS; j++)
#pragma unroll
  for (int i = 0; i < MT; i++) acc[j][i][0] = acc[j][i][1] = acc[j][i][2] = acc[j][i][3] = 0.f;
auto mma = [](float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  if (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
// Registers hold the next U chunks' weights while the current ones meet
// the tensor cores, so a warp always has a load in flight.
const int stride = WK * 32 * U;
#define SKINNY_LOAD(kb, r0, r1)                                                          \
  _Pragma("unroll") for (int j = 0; j < NS; j++)                                         \
  _Pragma("unroll") for (int u = 0; u < U; u++) {                                        \
    const int k = (kb) + u * 32;                                                         \
    r0[j][u] = k < K ? __ldcs(reinterpret_cast<const uint4*>(w0 + j * set + k)) : make_uint4(0, 0, 0, 0); \
    r1[j][u] = k < K ? __ldcs(reinterpret_cast<const uint4*>(w1 + j * set + k)) : make_uint4(0, 0, 0, 0); \
  }
uint4 a0[NS][U], a1[NS][U];
SKINNY_LOAD(warp * 32 * U, a0, a1)
#ifdef SKINNY_NORMED
// The normed rows, made while the first weights are on their way, in three
// steps so that the block meets global memory's latency once: every thread
// copies vectors of x (+ r) and of nw (as row M) into shared memory; warp
// m sums row m's squares; every thread scales. Rows are padded by 8
// elements so their fragments spread over the banks.
extern __shared__ uint4 skinny_smem[];
__shared__ float row_norm[WK];
unsigned short* normed = reinterpret_cast<unsigned short*>(skinny_smem);
constexpr int KP = KS + 8;
constexpr int VECS = KS / 8;  // 16-byte vectors a row
#pragma unroll 4
for (int i = threadIdx.x; i < (M + 1) * VECS; i += WK * 32) {
  const int m = i / VECS, c = (i % VECS) * 8;
  uint4 hv;
  if (m == M) {
    hv = *reinterpret_cast<const uint4*>(nw + c);
  } else {
    hv = *reinterpret_cast<const uint4*>(x + m * xs + c);
    if (ADD) {
      const uint4 rv = *reinterpret_cast<const uint4*>(r + m * rs + c);
      const T* re = reinterpret_cast<const T*>(&rv);
      T* he = reinterpret_cast<T*>(&hv);
#pragma unroll
      for (int e = 0; e < 8; e++) he[e] = static_cast<T>(static_cast<float>(he[e]) + static_cast<float>(re[e]));
      if (blockIdx.x == 0) *reinterpret_cast<uint4*>(h + (size_t)m * KS + c) = hv;
    }
  }
  *reinterpret_cast<uint4*>(normed + m * KP + c) = hv;
}
__syncthreads();
if (warp < M) {
  const T* hr = reinterpret_cast<const T*>(normed + warp * KP);
  float ss = 0.f;
  for (int c = lane * 8; c < KS; c += 256) {
    const uint4 hv = *reinterpret_cast<const uint4*>(hr + c);
    const T* he = reinterpret_cast<const T*>(&hv);
#pragma unroll
    for (int e = 0; e < 8; e++) {
      const float f = static_cast<float>(he[e]);
      ss += f * f;
    }
  }
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffff, ss, off);
  if (lane == 0) row_norm[warp] = rsqrt(ss / KS + __int_as_float(EPS_BITS));
}
__syncthreads();
#pragma unroll 4
for (int i = threadIdx.x; i < M * VECS; i += WK * 32) {
  const int m = i / VECS, c = (i % VECS) * 8;
  T* hr = reinterpret_cast<T*>(normed + m * KP + c);
  uint4 hv = *reinterpret_cast<const uint4*>(hr);
  const uint4 wv = *reinterpret_cast<const uint4*>(normed + M * KP + c);
  T* he = reinterpret_cast<T*>(&hv);
  const T* we = reinterpret_cast<const T*>(&wv);
  const float nrm = row_norm[m];
#pragma unroll
  for (int e = 0; e < 8; e++) {
    const T v = static_cast<T>(static_cast<float>(he[e]) * nrm);
    he[e] = static_cast<T>(static_cast<float>(we[e]) * static_cast<float>(v));
  }
  *reinterpret_cast<uint4*>(hr) = hv;
}
__syncthreads();
#define SKINNY_X(m, k) (*reinterpret_cast<const uint4*>(normed + (m) * KP + (k) + t * 8))
#else
#define SKINNY_X(m, k) (*reinterpret_cast<const uint4*>(xb + (m) * xs + (k) + t * 8))
#endif
for (int kb = warp * 32 * U; kb < K; kb += stride) {
  uint4 n0r[NS][U], n1r[NS][U];
  SKINNY_LOAD(kb + stride, n0r, n1r)
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int k = kb + u * 32;
    if (k >= K) break;
    uint4 b[MT];
#pragma unroll
    for (int i = 0; i < MT; i++) {
      const int m = i * 8 + g;
      b[i] = m < M ? SKINNY_X(m, k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < NS; j++)
#pragma unroll
      for (int i = 0; i < MT; i++) {
        mma(acc[j][i], a0[j][u].x, a1[j][u].x, a0[j][u].y, a1[j][u].y, b[i].x, b[i].y);
        mma(acc[j][i], a0[j][u].z, a1[j][u].z, a0[j][u].w, a1[j][u].w, b[i].z, b[i].w);
      }
  }
#pragma unroll
  for (int j = 0; j < NS; j++)
#pragma unroll
    for (int u = 0; u < U; u++) {
      a0[j][u] = n0r[j][u];
      a1[j][u] = n1r[j][u];
    }
}
// acc[j][i] holds set j's y[m][n] for m = 8i + 2t (+1), n = n0 + g (+8).
#ifdef SKINNY_NORMED
__syncthreads();  // every warp is done with the normed rows
auto part = reinterpret_cast<float (*)[NS][MT * 8][16]>(skinny_smem);
#else
__shared__ float part[WK][NS][MT * 8][16];
#endif
#pragma unroll
for (int j = 0; j < NS; j++)
#pragma unroll
  for (int i = 0; i < MT; i++) {
    part[warp][j][i * 8 + 2 * t][g] = acc[j][i][0];
    part[warp][j][i * 8 + 2 * t + 1][g] = acc[j][i][1];
    part[warp][j][i * 8 + 2 * t][g + 8] = acc[j][i][2];
    part[warp][j][i * 8 + 2 * t + 1][g + 8] = acc[j][i][3];
  }
__syncthreads();
for (int idx = threadIdx.x; idx < MT * 8 * 16; idx += blockDim.x) {
  const int m = idx / 16, c = idx % 16;
  if (m >= M) break;
  float s[NS];
#pragma unroll
  for (int j = 0; j < NS; j++) {
    s[j] = 0.f;
#pragma unroll
    for (int v = 0; v < WK; v++) s[j] += part[v][j][m][c];
  }
  T out;
  if (GATED) {
    // silu_mul (silu_mul.cuh) on the products rounded to T, as MLX.
    out = silu_mul(static_cast<T>(s[0]), static_cast<T>(s[NS - 1]));
  } else {
    out = static_cast<T>(s[0]);
  }
  y[(size_t)m * F + n0 + c] = out;
}
