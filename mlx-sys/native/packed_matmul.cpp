// y = x @ dequantize(w)^T over MLX affine 4- and 8-bit weights, as a node of
// the MLX graph (a `Primitive` with its own `eval_cpu`).
//
// MLX's CPU `quantized_matmul` makes one pass over the packed weights per
// row of x, on one thread. This kernel reads each packed weight row once per
// call whatever the number of rows (up to 8 rows share one unpacking; more
// rows re-read the row from L1), splits the output columns over every core,
// and has AVX2+FMA and AVX-512 paths chosen by CPUID, plus a scalar one.
// On this project's 2-core machine a decode step's products are bound by
// instructions per weight, not by memory (one thread streams ~45 GB/s; the
// products read ~15), so the AVX-512 path for up to Q4_ROWS rows of 4-bit
// weights looks each weight up in its group's 16 values (`vpermps`)
// instead of converting and scaling it (`span_avx512_q4`).
// From LANES_ROWS rows (a batched step, a verify block, a prefill chunk)
// the AVX-512 path instead puts 16 output columns in the lanes of a vector
// and keeps a vector of sums per row (`span_avx512_lanes`).
// Activations are fp32 (others are cast around the node), scales and
// biases fp16 or fp32: the loader keeps the fp16 of GGUF files and of
// half-precision checkpoints, since a step streams them with the weights
// (in fp32 they are a third of its bytes at 4 bits, group 32). Each weight
// is dequantized as `scale * q + bias` in fp32, as MLX's `dequantize`
// does, and the sums run in fp32. With int8 activations instead (the
// caller's choice), each row is rounded per block of 32 and multiplied by
// integer dot products, `b * sum(x)` taken from the exact sums: as
// llama.cpp's Q4_1 x Q8_1, at one row no faster here than the 4-bit
// lookup in fp32, so fp32 stays the default (docs/benchmarks.md, issue 41).
//
// Kernels: 0 scalar, 1 AVX2+FMA, 2 AVX-512. `GATEWAY_CPU_KERNEL` (scalar,
// avx2, avx512) caps the automatic choice; `GATEWAY_CPU_THREADS` sets the
// worker count (default: the CPUs this process may run on).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sched.h>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/c/array.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/stream.h"
#include "mlx/c/stream.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

extern "C" int mlx_sys_cpu_threads(void);

namespace {
using namespace mlx::core;

enum Kernel { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

struct Problem {
  const float* x;     // m x k, row-major
  const uint32_t* w;  // n x k * bits / 32
  const void* s;      // n x k / group: fp16 bits (`half`) or fp32
  const void* b;      // n x k / group, as `s`
  bool half;
  float* y;           // m x n
  int m, n, k, group, bits;
  // Int8 activations (null for fp32 ones), from `quantize_rows`: each row
  // in blocks of 32 as round(x / d) with d = max|x| / 127 per block, the
  // 4-bit layout's blocks reordered even elements first (its nibble order).
  const int8_t* xq = nullptr;  // m x k
  const float* xd = nullptr;   // m x (k / 32) x 8: each block's d, 8 times
  const float* xs = nullptr;   // m x (k / group): each group's sum of x
};

constexpr int QBLOCK = 32;  // activations per int8 scale

// Where element `i` of a block sits in its int8 copy.
inline int qpos(int i, int bits) { return bits == 4 ? (i & 1) * 16 + (i >> 1) : i; }


// A scale or bias as fp32: fp16 bits (exact), or fp32 as it is. The x86
// paths use F16C's `_cvtsh_ss` (`wide_f16c`).
inline float wide(float v) { return v; }
inline float wide(uint16_t h) {
  float16_t v;
  std::memcpy(&v, &h, sizeof h);
  return float(v);
}
#if defined(__x86_64__)
__attribute__((target("f16c"))) inline float wide_f16c(float v) { return v; }
__attribute__((target("f16c"))) inline float wide_f16c(uint16_t h) { return _cvtsh_ss(h); }
#endif

// The same span for either type of scales and biases.
#define BOTH_SCALES(NAME)                                   \
  void NAME(const Problem& p, int o0, int o1) {             \
    if (p.half) NAME##_as<uint16_t>(p, o0, o1);             \
    else NAME##_as<float>(p, o0, o1);                       \
  }

// ---------------------------------------------------------------- scalar

template <typename S>
void span_scalar_as(const Problem& p, int o0, int o1) {
  const int per_word = 32 / p.bits;
  const uint32_t mask = (1u << p.bits) - 1;
  const int words = p.k / per_word, groups = p.k / p.group;
  for (int o = o0; o < o1; ++o) {
    const uint32_t* wr = p.w + size_t(o) * words;
    const S* sr = static_cast<const S*>(p.s) + size_t(o) * groups;
    const S* br = static_cast<const S*>(p.b) + size_t(o) * groups;
    for (int r = 0; r < p.m; ++r) {
      const float* xr = p.x + size_t(r) * p.k;
      float acc = 0.0f;
      for (int g = 0; g < groups; ++g) {
        for (int i = g * p.group; i < (g + 1) * p.group; ++i) {
          uint32_t q = (wr[i / per_word] >> ((i % per_word) * p.bits)) & mask;
          acc += (wide(sr[g]) * float(q) + wide(br[g])) * xr[i];
        }
      }
      p.y[size_t(r) * p.n + o] = acc;
    }
  }
}

// Int8 activations: y = sum_g s_g * sum_{blocks j of g} d_j * dot(q_j, xq_j)
// + b_g * sum(x_g). The bias term uses the exact sums, so the only error
// is the activations' rounding to d_j / 2 each (and fp32 sums).
template <typename S>
void span_scalar_int8_as(const Problem& p, int o0, int o1) {
  const int per_word = 32 / p.bits;
  const uint32_t mask = (1u << p.bits) - 1;
  const int words = p.k / per_word, groups = p.k / p.group, blocks = p.k / QBLOCK;
  for (int o = o0; o < o1; ++o) {
    const uint32_t* wr = p.w + size_t(o) * words;
    const S* sr = static_cast<const S*>(p.s) + size_t(o) * groups;
    const S* br = static_cast<const S*>(p.b) + size_t(o) * groups;
    for (int r = 0; r < p.m; ++r) {
      const int8_t* xr = p.xq + size_t(r) * p.k;
      const float* dr = p.xd + size_t(r) * blocks * 8;
      const float* sum = p.xs + size_t(r) * groups;
      float acc = 0.0f;
      for (int j = 0; j < blocks; ++j) {
        int32_t dot = 0;
        for (int i = 0; i < QBLOCK; ++i) {
          const int e = j * QBLOCK + i;
          const int32_t q = (wr[e / per_word] >> ((e % per_word) * p.bits)) & mask;
          dot += q * xr[j * QBLOCK + qpos(i, p.bits)];
        }
        acc += wide(sr[j * QBLOCK / p.group]) * dr[j * 8] * float(dot);
      }
      for (int g = 0; g < groups; ++g) acc += wide(br[g]) * sum[g];
      p.y[size_t(r) * p.n + o] = acc;
    }
  }
}

BOTH_SCALES(span_scalar)
BOTH_SCALES(span_scalar_int8)
#undef BOTH_SCALES

// Rows of x to int8 (see Problem); `xd` repeats each scale 8 times so a
// vector of 16 lanes covering two blocks loads both.
void quantize_rows(const float* x, int m, int k, int group, int bits, int8_t* xq, float* xd,
                   float* xs) {
  const int blocks = k / QBLOCK, groups = k / group;
  for (int r = 0; r < m; ++r) {
    const float* xr = x + size_t(r) * k;
    for (int j = 0; j < blocks; ++j) {
      const float* xb = xr + j * QBLOCK;
      float amax = 0.0f;
      for (int i = 0; i < QBLOCK; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* qb = xq + size_t(r) * k + j * QBLOCK;
      for (int i = 0; i < QBLOCK; ++i) {
        const float v = std::nearbyint(xb[i] * id);
        qb[qpos(i, bits)] = int8_t(std::max(-127.0f, std::min(127.0f, v)));
      }
      for (int l = 0; l < 8; ++l) xd[(size_t(r) * blocks + j) * 8 + l] = d;
    }
    for (int g = 0; g < groups; ++g) {
      double sum = 0.0;
      for (int i = g * group; i < (g + 1) * group; ++i) sum += xr[i];
      xs[size_t(r) * groups + g] = float(sum);
    }
  }
}

#if defined(__x86_64__)
// `quantize_rows` with AVX-512: the same values (round to nearest even, as
// nearbyint in the default rounding mode), group sums in fp32.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void quantize_rows_avx512(
    const float* x, int m, int k, int group, int bits, int8_t* xq, float* xd, float* xs) {
  const int blocks = k / QBLOCK, per_group = group / QBLOCK;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 lim = _mm512_set1_ps(127.0f);
  for (int r = 0; r < m; ++r) {
    __m512 gsum = _mm512_setzero_ps();
    for (int j = 0; j < blocks; ++j) {
      const float* xb = x + size_t(r) * k + j * QBLOCK;
      const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512 vid = _mm512_set1_ps(id);
      __m512 lo = _mm512_mul_ps(a, vid), hi = _mm512_mul_ps(b, vid);
      if (bits == 4) {
        const __m512 e = _mm512_permutex2var_ps(lo, even, hi), o = _mm512_permutex2var_ps(lo, odd, hi);
        lo = e;
        hi = o;
      }
      lo = _mm512_min_ps(_mm512_max_ps(lo, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
      hi = _mm512_min_ps(_mm512_max_ps(hi, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
      int8_t* qb = xq + size_t(r) * k + j * QBLOCK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(lo)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(hi)));
      _mm256_storeu_ps(xd + (size_t(r) * blocks + j) * 8, _mm256_set1_ps(d));
      gsum = _mm512_add_ps(gsum, _mm512_add_ps(a, b));
      if ((j + 1) % per_group == 0) {
        xs[size_t(r) * (k / group) + j / per_group] = _mm512_reduce_add_ps(gsum);
        gsum = _mm512_setzero_ps();
      }
    }
  }
}

// ------------------------------------------------------------------ AVX2

__attribute__((target("avx2,fma,f16c"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One output column `o` for rows r0..r0+R. A independent accumulators per
// row hide the FMA latency when R is small; a group (32/64/128 weights) is
// 4, 8 or 16 vectors of 8, so A <= 4 divides it. The loops over R and A are
// unrolled so the accumulators stay in registers.
template <int R, int BITS, typename S>
__attribute__((target("avx2,fma,f16c"))) void block_avx2(const Problem& p, int o, int r0) {
  constexpr int A = R == 1 ? 4 : R < 4 ? 2 : 1;
  constexpr int WORDS = BITS / 4;  // packed words per vector of 8 weights
  const int groups = p.k / p.group, steps = p.group / (8 * A);
  const size_t ldx = size_t(p.k);
  const uint32_t* wp = p.w + size_t(o) * (p.k * BITS / 32);
  const S* sr = static_cast<const S*>(p.s) + size_t(o) * groups;
  const S* br = static_cast<const S*>(p.b) + size_t(o) * groups;
  const float* xp = p.x + size_t(r0) * ldx;
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(0xF);
  __m256 acc[R][A];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const __m256 sc = _mm256_set1_ps(wide_f16c(sr[g])), bi = _mm256_set1_ps(wide_f16c(br[g]));
    for (int st = 0; st < steps; ++st, wp += A * WORDS, xp += 8 * A) {
#pragma GCC unroll 4
      for (int a = 0; a < A; ++a) {
        __m256i q;
        if constexpr (BITS == 4) {
          q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(wp[a])), shifts), mask);
        } else {
          q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp + a * WORDS)));
        }
        const __m256 wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sc, bi);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          acc[r][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp + r * ldx + 8 * a), acc[r][a]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m256 t = acc[r][0];
#pragma GCC unroll 4
    for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[r][a]);
    p.y[size_t(r0 + r) * p.n + o] = hsum256(t);
  }
}

// ---------------------------------------------------------------- AVX-512

// 16 weights of a 4-bit row, weight i's nibble in the low 4 bits of lane i
// (the bits above it left as they are: `vpermps` reads only those 4).
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline __m512i nibbles16(
    const uint32_t* wp) {
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m128i two = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp));
  return _mm512_srlv_epi32(_mm512_permutexvar_epi32(spread, _mm512_castsi128_si512(two)), shifts);
}

// A 4-bit group's 16 weight values `scale * q + bias`, the fp32 rounding
// of each as MLX's `dequantize` makes it, for `vpermps` to look up.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline __m512 q4_table(__m512 sc,
                                                                                          __m512 bi) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(levels, sc, bi);
}

// Unpacks 16 weights of a packed row (4 or 8 bits) to int32 lanes.
template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline __m512i unpack16(
    const uint32_t* wp) {
  if constexpr (BITS == 4) {
    return _mm512_and_si512(nibbles16(wp), _mm512_set1_epi32(0xF));
  } else {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
  }
}


// 16 fp16 or fp32 scales (or biases) as fp32.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline __m512 load16(const uint16_t* v) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline __m512 load16(const float* v) {
  return _mm512_loadu_ps(v);
}

// A vector's two 256-bit halves added.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline __m256 halves(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The sums of four vectors' lanes, [sum a, sum b, sum c, sum d]. A column
// alone is reduced as `sum4(a, a, a, a)[0]`, so its sum is the same to the
// bit whether its neighbours were computed with it or not.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline __m128 sum4(__m512 a, __m512 b,
                                                                                      __m512 c, __m512 d) {
  const __m256 t =
      _mm256_hadd_ps(_mm256_hadd_ps(halves(a), halves(b)), _mm256_hadd_ps(halves(c), halves(d)));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Up to 16 scales (or biases) from `v` as fp32 into `out`.
template <typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline void widen16(const S* v, int n,
                                                                                       float* out) {
  if (n == 16) {
    _mm512_store_ps(out, load16(v));
  } else {
    for (int i = 0; i < n; ++i) out[i] = wide_f16c(v[i]);
  }
}

// One group of `block_avx512_q4_as` for C columns: its weights times R
// rows into `acc`, `wp` and `xp` moved past it.
template <int R, int C, int A, int PER_GROUP>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) inline void q4_group(
    const uint32_t* (&wp)[C], const float*& xp, size_t ldx, const __m512 (&table)[C], __m512 (&acc)[R][C][A]) {
  const __m512i low = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
  const __m512i high = _mm512_setr_epi32(16, 16, 16, 16, 20, 20, 20, 20, 24, 24, 24, 24, 28, 28, 28, 28);
#pragma GCC unroll 4
  for (int j = 0; j < PER_GROUP; ++j, xp += 32) {
    __m512 w0[C], w1[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i four = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp[c])));
      wp[c] += 4;
      w0[c] = _mm512_permutexvar_ps(_mm512_srlv_epi32(four, low), table[c]);
      w1[c] = _mm512_permutexvar_ps(_mm512_srlv_epi32(four, high), table[c]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_loadu_ps(xp + r * ldx), x1 = _mm512_loadu_ps(xp + r * ldx + 16);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[r][c][0] = _mm512_fmadd_ps(w0[c], x0, acc[r][c][0]);
        acc[r][c][A - 1] = _mm512_fmadd_ps(w1[c], x1, acc[r][c][A - 1]);
      }
    }
  }
}

// Columns o..o+C of 4-bit weights for R rows, 32 weights at a time: their
// 16 bytes broadcast to each 128-bit lane of a vector and shifted per lane
// give two vectors whose lanes' low 4 bits are weight (l % 4) * 8 + l / 4
// and that + 4 (the packed order of four words); `vpermps` then looks each
// nibble up in `q4_table`. Rows of x come in the same order (`q4_order`).
// Three instructions per 16 weights where unpacking, converting and
// scaling took five; the scales and biases of 16 groups are widened at
// once (scalar loads, conversions and broadcasts per group cost as much as
// the group's products), each group's picked out by a permute for one
// column, or for C columns loaded from the stack as broadcasts, which
// leaves the permute unit to the weights. C columns side by side (from 2
// rows) share each load of x and are reduced together (`sum4`); a lone
// row keeps two sums a column (A), so its chains of FMAs do not bound it.
// PER_GROUP: blocks of 32 in a group.
template <int R, int C, int PER_GROUP, typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void block_avx512_q4_as(
    const Problem& p, int o) {
  static_assert(C == 1 || C == 4, "sum4 stores one or four columns");
  constexpr int A = R == 1 ? 2 : 1;
  const int groups = p.k / p.group;
  const size_t ldx = size_t(p.k);
  const uint32_t* wp[C];
  const S* sr[C];
  const S* br[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    wp[c] = p.w + size_t(o + c) * (p.k / 8);
    sr[c] = static_cast<const S*>(p.s) + size_t(o + c) * groups;
    br[c] = static_cast<const S*>(p.b) + size_t(o + c) * groups;
  }
  const float* xp = p.x;
  __m512 acc[R][C][A];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
      for (int a = 0; a < A; ++a) acc[r][c][a] = _mm512_setzero_ps();
  if constexpr (C > 1) {
    alignas(64) float scale[C][16], bias[C][16];
    for (int g0 = 0; g0 < groups; g0 += 16) {
      const int n = std::min(16, groups - g0);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        widen16(sr[c] + g0, n, scale[c]);
        widen16(br[c] + g0, n, bias[c]);
      }
      for (int i = 0; i < n; ++i) {
        __m512 table[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) table[c] = q4_table(_mm512_set1_ps(scale[c][i]), _mm512_set1_ps(bias[c][i]));
        q4_group<R, C, A, PER_GROUP>(wp, xp, ldx, table, acc);
      }
    }
  } else {
    int g = 0;
    for (; g + 16 <= groups; g += 16) {
      const __m512 sc = load16(sr[0] + g), bi = load16(br[0] + g);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const __m512i at = _mm512_set1_epi32(i);
        const __m512 table[1] = {q4_table(_mm512_permutexvar_ps(at, sc), _mm512_permutexvar_ps(at, bi))};
        q4_group<R, C, A, PER_GROUP>(wp, xp, ldx, table, acc);
      }
    }
    for (; g < groups; ++g) {
      const __m512 table[1] = {q4_table(_mm512_set1_ps(wide_f16c(sr[0][g])), _mm512_set1_ps(wide_f16c(br[0][g])))};
      q4_group<R, C, A, PER_GROUP>(wp, xp, ldx, table, acc);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m512 t[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) t[c] = A == 1 ? acc[r][c][0] : _mm512_add_ps(acc[r][c][0], acc[r][c][A - 1]);
    float* y = p.y + size_t(r) * p.n + o;
    if constexpr (C == 4) _mm_storeu_ps(y, sum4(t[0], t[1], t[2], t[3]));
    else *y = _mm_cvtss_f32(sum4(t[0], t[0], t[0], t[0]));
  }
}

template <int R, int C, typename S>
void block_avx512_q4(const Problem& p, int o) {
  switch (p.group) {
    case 32: return block_avx512_q4_as<R, C, 1, S>(p, o);
    case 64: return block_avx512_q4_as<R, C, 2, S>(p, o);
    default: return block_avx512_q4_as<R, C, 4, S>(p, o);
  }
}

// Up to this many rows, 4-bit products on the AVX-512 path take
// `block_avx512_q4`: with four columns at a time it measured 1.15-1.45x
// `block_avx512` at 2-6 rows, and at 2-4 rows it is as fast as the lanes
// span or faster; at 5 and 6 rows (a verify of 4 or 5 drafts) its sums,
// 4 columns a row, outgrow the 32 vector registers and the lanes span
// takes 0.68-0.75x its time (docs/benchmarks.md, `examples/step_products`).
constexpr int Q4_ROWS = 4;
// Columns `block_avx512_q4` takes at once; `run_span` hands out chunks of
// whole blocks, so which columns go alone (the last n % Q4_COLUMNS) does
// not depend on the threads.
constexpr int Q4_COLUMNS = 4;

// Rows R > 1 take Q4_COLUMNS columns at a time (the last n % Q4_COLUMNS
// alone); a lone row one, whose two sums a column already fill the
// pipes (several columns measured slower).
template <int R, typename S>
void span_avx512_q4_rows(const Problem& p, int o0, int o1) {
  int o = o0;
  if constexpr (R > 1)
    for (; o + Q4_COLUMNS <= o1; o += Q4_COLUMNS) block_avx512_q4<R, Q4_COLUMNS, S>(p, o);
  for (; o < o1; ++o) block_avx512_q4<R, 1, S>(p, o);
}

template <typename S>
void span_avx512_q4_as(const Problem& p, int o0, int o1) {
  switch (p.m) {
    case 1: return span_avx512_q4_rows<1, S>(p, o0, o1);
    case 2: return span_avx512_q4_rows<2, S>(p, o0, o1);
    case 3: return span_avx512_q4_rows<3, S>(p, o0, o1);
    default: return span_avx512_q4_rows<4, S>(p, o0, o1);
  }
}

void span_avx512_q4(const Problem& p, int o0, int o1) {
  if (p.half) span_avx512_q4_as<uint16_t>(p, o0, o1);
  else span_avx512_q4_as<float>(p, o0, o1);
}

// Rows of x (m x k) with each block of 32 in `block_avx512_q4`'s order.
void q4_order(const float* x, int m, int k, float* out) {
  for (size_t b = 0; b < size_t(m) * k; b += 32)
    for (int l = 0; l < 16; ++l) {
      out[b + l] = x[b + (l % 4) * 8 + l / 4];
      out[b + 16 + l] = x[b + (l % 4) * 8 + 4 + l / 4];
    }
}

template <int R, int BITS, typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void block_avx512(
    const Problem& p, int o, int r0) {
  // A group is 2, 4 or 8 vectors of 16.
  constexpr int A = R < 4 ? 2 : 1;
  constexpr int WORDS = BITS / 2;  // packed words per vector of 16 weights
  const int groups = p.k / p.group, steps = p.group / (16 * A);
  const size_t ldx = size_t(p.k);
  const uint32_t* wp = p.w + size_t(o) * (p.k * BITS / 32);
  const S* sr = static_cast<const S*>(p.s) + size_t(o) * groups;
  const S* br = static_cast<const S*>(p.b) + size_t(o) * groups;
  const float* xp = p.x + size_t(r0) * ldx;
  __m512 acc[R][A];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int a = 0; a < A; ++a) acc[r][a] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const __m512 sc = _mm512_set1_ps(wide_f16c(sr[g])), bi = _mm512_set1_ps(wide_f16c(br[g]));
    for (int st = 0; st < steps; ++st, wp += A * WORDS, xp += 16 * A) {
#pragma GCC unroll 2
      for (int a = 0; a < A; ++a) {
        const __m512 wv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(unpack16<BITS>(wp + a * WORDS)), sc, bi);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          acc[r][a] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + r * ldx + 16 * a), acc[r][a]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m512 t = acc[r][0];
#pragma GCC unroll 2
    for (int a = 1; a < A; ++a) t = _mm512_add_ps(t, acc[r][a]);
    p.y[size_t(r0 + r) * p.n + o] = _mm512_reduce_add_ps(t);
  }
}

// ------------------------------------------------------- int8 activations

// The bias term of int8 products, sum_g b_g * sum(x_g), per row: plain
// loads in four independent sums (masked vector loads of a row's few
// biases cost more than the row's whole product on Zen 4). Explicit FMAs:
// the compiler contracted `+= b * s` for one type of scales and not the
// other at some row counts, and fp16 and fp32 scales must give one sum.
template <int R, typename S>
__attribute__((target("avx2,fma,f16c"))) inline void bias_term(const Problem& p, const S* br, int r0, int groups, float* out) {
  float sum[R][4] = {};
  int g = 0;
  for (; g + 4 <= groups; g += 4)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* xs = p.xs + size_t(r0 + r) * groups + g;
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) sum[r][l] = std::fma(wide_f16c(br[g + l]), xs[l], sum[r][l]);
    }
  for (; g < groups; ++g)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sum[r][0] = std::fma(wide_f16c(br[g]), p.xs[size_t(r0 + r) * groups + g], sum[r][0]);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = (sum[r][0] + sum[r][1]) + (sum[r][2] + sum[r][3]);
}

// One output column `o`, rows r0..r0+R, over int8 activations: per block of
// 32, unsigned weights times signed activations summed in int16 pairs
// (vpmaddubsw, at most 2 * 15 * 127 for 4 bits) or int16 products (8 bits,
// vpmaddwd), then scaled by s_g * d_j into fp32 lanes.
template <int R, int BITS, typename S>
__attribute__((target("avx2,fma,f16c"))) void block_avx2_int8(const Problem& p, int o, int r0) {
  const int groups = p.k / p.group, blocks = p.k / QBLOCK;
  const int gshift = __builtin_ctz(p.group / QBLOCK);  // block j is in group j >> gshift
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(p.w + size_t(o) * (p.k * BITS / 32));
  const S* sr = static_cast<const S*>(p.s) + size_t(o) * groups;
  const S* br = static_cast<const S*>(p.b) + size_t(o) * groups;
  const __m256i low = _mm256_set1_epi8(0xF);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  float tail[R];
  bias_term<R, S>(p, br, r0, groups, tail);
  for (int j = 0; j < blocks; ++j, wp += QBLOCK * BITS / 8) {
    const float s = wide_f16c(sr[j >> gshift]);
    __m256i q0, q1;
    if constexpr (BITS == 4) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp));
      q0 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
    } else {
      q0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
      q1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const size_t row = size_t(r0 + r);
      const int8_t* xb = p.xq + row * p.k + j * QBLOCK;
      __m256i dot;
      if constexpr (BITS == 4) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
        dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, xv), ones);
      } else {
        const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb)));
        const __m256i x1 =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 16)));
        dot = _mm256_add_epi32(_mm256_madd_epi16(q0, x0), _mm256_madd_epi16(q1, x1));
      }
      const float d = p.xd[(row * blocks + j) * 8];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s * d), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) p.y[size_t(r0 + r) * p.n + o] = hsum256(acc[r]) + tail[r];
}

// The same with AVX-512 VNNI: two blocks (64 weights) per vpdpbusd. A 4-bit
// pair of blocks is 32 bytes [P0, P1]; lanes [P0, P0, P1, P1], the odd
// lanes shifted by a nibble and all masked to 4 bits, are block 0's even
// and odd elements then block 1's: the order of the int8 copy.
template <int R, int BITS, typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) void block_avx512_int8(
    const Problem& p, int o, int r0) {
  const int groups = p.k / p.group, blocks = p.k / QBLOCK;
  const int gshift = __builtin_ctz(p.group / QBLOCK);  // block j is in group j >> gshift
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(p.w + size_t(o) * (p.k * BITS / 32));
  const S* sr = static_cast<const S*>(p.s) + size_t(o) * groups;
  const S* br = static_cast<const S*>(p.b) + size_t(o) * groups;
  const __m512i low = _mm512_set1_epi8(0xF);
  const __m512i nibble = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  float tail[R];
  bias_term<R, S>(p, br, r0, groups, tail);
  int j = 0;
  for (; j + 2 <= blocks; j += 2, wp += 2 * QBLOCK * BITS / 8) {
    const __m512 sv = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(wide_f16c(sr[j >> gshift]))),
                           _mm256_castps_pd(_mm256_set1_ps(wide_f16c(sr[(j + 1) >> gshift]))), 1));
    __m512i q;
    if constexpr (BITS == 4) {
      const __m512i two = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)));
      q = _mm512_and_si512(
          _mm512_srlv_epi64(_mm512_shuffle_i64x2(two, two, _MM_SHUFFLE(1, 1, 0, 0)), nibble), low);
    } else {
      q = _mm512_loadu_si512(wp);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const size_t row = size_t(r0 + r);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q,
                                              _mm512_loadu_si512(p.xq + row * p.k + j * QBLOCK));
      const __m512 dv = _mm512_loadu_ps(p.xd + (row * blocks + j) * 8);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv, dv), acc[r]);
    }
  }
  if (j < blocks) {  // an odd number of blocks: the last one alone
    const float s = wide_f16c(sr[j >> gshift]);
    __m256i q;
    if constexpr (BITS == 4) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp));
      q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0xF));
    } else {
      q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const size_t row = size_t(r0 + r);
      const __m256i dot = _mm256_dpbusd_epi32(
          _mm256_setzero_si256(), q,
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xq + row * p.k + j * QBLOCK)));
      const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s * p.xd[(row * blocks + j) * 8]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(t));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) p.y[size_t(r0 + r) * p.n + o] = _mm512_reduce_add_ps(acc[r]) + tail[r];
}

constexpr int ROW_BLOCK = 8;

// Output columns o0..o1 for every row, rows in blocks of ROW_BLOCK: the
// packed row of `o` is read from memory once and stays in L1 for the next
// block.
#define DEFINE_SPAN(NAME, BLOCK)                                            \
  template <int BITS, typename S>                                           \
  void NAME##_bits(const Problem& p, int o0, int o1) {                      \
    for (int o = o0; o < o1; ++o) {                                         \
      for (int r0 = 0; r0 < p.m; r0 += ROW_BLOCK) {                         \
        switch (std::min(ROW_BLOCK, p.m - r0)) {                            \
          case 1: BLOCK<1, BITS, S>(p, o, r0); break;                          \
          case 2: BLOCK<2, BITS, S>(p, o, r0); break;                          \
          case 3: BLOCK<3, BITS, S>(p, o, r0); break;                          \
          case 4: BLOCK<4, BITS, S>(p, o, r0); break;                          \
          case 5: BLOCK<5, BITS, S>(p, o, r0); break;                          \
          case 6: BLOCK<6, BITS, S>(p, o, r0); break;                          \
          case 7: BLOCK<7, BITS, S>(p, o, r0); break;                          \
          default: BLOCK<8, BITS, S>(p, o, r0); break;                         \
        }                                                                   \
      }                                                                     \
    }                                                                       \
  }                                                                         \
  void NAME(const Problem& p, int o0, int o1) {                             \
    if (p.half) {                                                           \
      if (p.bits == 4) NAME##_bits<4, uint16_t>(p, o0, o1);                 \
      else NAME##_bits<8, uint16_t>(p, o0, o1);                             \
    } else {                                                                \
      if (p.bits == 4) NAME##_bits<4, float>(p, o0, o1);                    \
      else NAME##_bits<8, float>(p, o0, o1);                                \
    }                                                                       \
  }

DEFINE_SPAN(span_avx2, block_avx2)
DEFINE_SPAN(span_avx512, block_avx512)
DEFINE_SPAN(span_avx2_int8, block_avx2_int8)
DEFINE_SPAN(span_avx512_int8, block_avx512_int8)
#undef DEFINE_SPAN

// ------------------------------------------ many rows: columns in lanes

// From LANES_ROWS rows (a batched decode step, a verify block, a prefill
// chunk; 4-bit weights from Q4_ROWS + 1) the AVX-512 path turns the
// product around: a vector holds 16
// output columns, each row of x (up to LANES_BLOCK at a time) keeps one
// vector of sums, and each weight vector (one position of k for the 16
// columns) is multiplied by every row's activation there, broadcast from
// memory. Per 16 weights that is one FMA a row and four instructions to
// make the vector, with no fp32 panel written and read back and no
// horizontal sums (the register tiles this replaced ran 1.1-2.3x slower
// at 16 to 512 rows; docs/benchmarks.md). The 16 columns' packed words,
// scales and biases come in 16 x 16 blocks transposed in registers, so a
// 32-bit lane holds one column's. Each sum runs over k in order in one
// lane: a column's result does not depend on its neighbours, the row
// count or the threads.
constexpr int LANES_ROWS = 4;
// Rows `lanes_block` takes at once: a vector of sums each.
constexpr int LANES_BLOCK = 16;
// Columns `lanes_block` takes at once; `run_span` hands out whole panels.
constexpr int PANEL = 16;

// A 16 x 16 block of 32-bit lanes transposed: lane j of v[i] goes to lane
// i of v[j].
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) inline void transpose16(
    __m512i (&v)[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  // Each 128-bit lane of v[4a + b] now holds, for rows 4a..4a+3, one
  // column of each group of four (b = 0: columns 0, 4, 8, 12; ...).
#pragma GCC unroll 4
  for (int a = 0; a < 16; a += 4) {
    v[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    v[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    v[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    v[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  // The 128-bit lanes of four row-quads gathered per column.
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {
    const __m512i even0 = _mm512_shuffle_i32x4(v[b], v[4 + b], 0x88);
    const __m512i odd0 = _mm512_shuffle_i32x4(v[b], v[4 + b], 0xdd);
    const __m512i even1 = _mm512_shuffle_i32x4(v[8 + b], v[12 + b], 0x88);
    const __m512i odd1 = _mm512_shuffle_i32x4(v[8 + b], v[12 + b], 0xdd);
    t[b] = _mm512_shuffle_i32x4(even0, even1, 0x88);       // column b
    t[b + 8] = _mm512_shuffle_i32x4(even0, even1, 0xdd);   // column b + 8
    t[b + 4] = _mm512_shuffle_i32x4(odd0, odd1, 0x88);     // column b + 4
    t[b + 12] = _mm512_shuffle_i32x4(odd0, odd1, 0xdd);    // column b + 12
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}

// Up to 16 groups' scales (or biases) of 16 columns from `v` (one row of
// `stride` a column, `cols` of them), as fp32 with the columns in lanes:
// out[g] is group g of every column.
template <typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) inline void groups16(
    const S* v, size_t stride, int cols, int n, float (&out)[16][16]) {
  const __mmask16 take = __mmask16((1u << n) - 1);
  __m512i t[16];
#pragma GCC unroll 16
  for (int c = 0; c < 16; ++c) {
    if (c >= cols) {
      t[c] = _mm512_setzero_si512();
    } else if constexpr (std::is_same_v<S, uint16_t>) {
      t[c] = _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(take, v + c * stride)));
    } else {
      t[c] = _mm512_castps_si512(_mm512_maskz_loadu_ps(take, v + c * stride));
    }
  }
  transpose16(t);
#pragma GCC unroll 16
  for (int g = 0; g < 16; ++g) _mm512_store_si512(out[g], t[g]);
}

// Rows r0..r0+R (x as `lanes_order` lays it out) times columns o..o+cols
// (at most 16).
template <int R, int BITS, typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void lanes_block(
    const Problem& p, int o, int cols, int r0) {
  constexpr int PER_WORD = 32 / BITS;
  const int words = p.k / PER_WORD, groups = p.k / p.group;
  const int group_words = p.group / PER_WORD;  // a power of two
  const int group_shift = __builtin_ctz(group_words);
  const uint32_t* w = p.w + size_t(o) * words;
  const S* s = static_cast<const S*>(p.s) + size_t(o) * groups;
  const S* b = static_cast<const S*>(p.b) + size_t(o) * groups;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  const float* x = p.x + size_t(r0) * p.k;  // [k][R]
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) float scale[16][16], bias[16][16];
  alignas(64) uint32_t word[16][16];
  const int ahead = std::max(0, std::min(16, p.n - o - 16));  // next columns to prefetch
  for (int g0 = 0; g0 < groups; g0 += 16) {
    const int ng = std::min(16, groups - g0);
#pragma GCC unroll 16
    for (int c = 0; c < ahead; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(s + size_t(16 + c) * groups + g0), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + size_t(16 + c) * groups + g0), _MM_HINT_T0);
    }
    groups16(s + g0, groups, cols, ng, scale);
    groups16(b + g0, groups, cols, ng, bias);
    const int w1 = (g0 + ng) * group_words;
    for (int w0 = g0 * group_words; w0 < w1; w0 += 16) {
      const int nw = std::min(16, w1 - w0);
      const __mmask16 take = __mmask16((1u << nw) - 1);
      // The next 16 columns' same words, for their call: each column's
      // few lines are too short a stream for the hardware to prefetch.
#pragma GCC unroll 16
      for (int c = 0; c < ahead; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(w + size_t(16 + c) * words + w0), _MM_HINT_T0);
      __m512i t[16];
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c)
        t[c] = c < cols ? _mm512_maskz_loadu_epi32(take, w + size_t(c) * words + w0) : _mm512_setzero_si512();
      transpose16(t);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) _mm512_store_si512(word[j], t[j]);
      for (int j = 0; j < nw; ++j) {
        const int g = ((w0 + j) >> group_shift) - g0;
        const __m512 sc = _mm512_load_ps(scale[g]), bi = _mm512_load_ps(bias[g]);
        const __m512i packed = _mm512_load_si512(word[j]);
        const float* xi = x + size_t(w0 + j) * PER_WORD * R;
#pragma GCC unroll 8
        for (int e = 0; e < PER_WORD; ++e) {
          const __m512i q = _mm512_and_si512(_mm512_srli_epi32(packed, e * BITS), mask);
          const __m512 wv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), sc, bi);
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wv, _mm512_set1_ps(xi[e * R + r]), acc[r]);
        }
      }
    }
  }
  const __mmask16 keep = __mmask16((1u << cols) - 1);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(p.y + size_t(r0 + r) * p.n + o, keep, acc[r]);
}

// Rows of x (m x k, k a multiple of 16) in blocks of LANES_BLOCK, each
// block [k][rows]: one position's activations of every row of a block side
// by side, for `lanes_block` to broadcast.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void lanes_order(const float* x, int m,
                                                                                    int k, float* out) {
  for (int r0 = 0; r0 < m; r0 += LANES_BLOCK) {
    const int rows = std::min(LANES_BLOCK, m - r0);
    const __mmask16 keep = __mmask16((1u << rows) - 1);
    float* block = out + size_t(r0) * k;
    for (int i = 0; i < k; i += 16) {
      __m512i t[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r)
        t[r] = r < rows ? _mm512_loadu_si512(x + size_t(r0 + r) * k + i) : _mm512_setzero_si512();
      transpose16(t);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) _mm512_mask_storeu_epi32(block + size_t(i + j) * rows, keep, t[j]);
    }
  }
}

// Columns a span takes in turn: each block of rows meets all of them, so
// their packed weights (256 KB at 4 bits for k = 2048) stay in L2
// while a block of x stays in L1 or L2. Panels outside row blocks would
// stream all of a prefill chunk's x once a panel.
constexpr int LANES_COLUMNS = 256;

template <int BITS, typename S>
void span_avx512_lanes_as(const Problem& p, int o0, int o1) {
  for (int c0 = o0; c0 < o1; c0 += LANES_COLUMNS) {
    const int c1 = std::min(o1, c0 + LANES_COLUMNS);
    for (int r0 = 0; r0 < p.m; r0 += LANES_BLOCK) {
      for (int o = c0; o < c1; o += PANEL) {
        const int cols = std::min(PANEL, c1 - o);
        switch (std::min(LANES_BLOCK, p.m - r0)) {
          case 1: lanes_block<1, BITS, S>(p, o, cols, r0); break;
          case 2: lanes_block<2, BITS, S>(p, o, cols, r0); break;
          case 3: lanes_block<3, BITS, S>(p, o, cols, r0); break;
          case 4: lanes_block<4, BITS, S>(p, o, cols, r0); break;
          case 5: lanes_block<5, BITS, S>(p, o, cols, r0); break;
          case 6: lanes_block<6, BITS, S>(p, o, cols, r0); break;
          case 7: lanes_block<7, BITS, S>(p, o, cols, r0); break;
          case 8: lanes_block<8, BITS, S>(p, o, cols, r0); break;
          case 9: lanes_block<9, BITS, S>(p, o, cols, r0); break;
          case 10: lanes_block<10, BITS, S>(p, o, cols, r0); break;
          case 11: lanes_block<11, BITS, S>(p, o, cols, r0); break;
          case 12: lanes_block<12, BITS, S>(p, o, cols, r0); break;
          case 13: lanes_block<13, BITS, S>(p, o, cols, r0); break;
          case 14: lanes_block<14, BITS, S>(p, o, cols, r0); break;
          case 15: lanes_block<15, BITS, S>(p, o, cols, r0); break;
          default: lanes_block<16, BITS, S>(p, o, cols, r0); break;
        }
      }
    }
  }
}

void span_avx512_lanes(const Problem& p, int o0, int o1) {
  if (p.half) {
    if (p.bits == 4) span_avx512_lanes_as<4, uint16_t>(p, o0, o1);
    else span_avx512_lanes_as<8, uint16_t>(p, o0, o1);
  } else {
    if (p.bits == 4) span_avx512_lanes_as<4, float>(p, o0, o1);
    else span_avx512_lanes_as<8, float>(p, o0, o1);
  }
}
#endif  // __x86_64__

int best_kernel() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // F16C reads the fp16 scales and biases (every AVX2 CPU has it).
  if (!__builtin_cpu_supports("f16c")) return SCALAR;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
#endif
  return SCALAR;
}

// The best kernel the CPU runs, capped by GATEWAY_CPU_KERNEL.
int chosen_kernel() {
  static const int chosen = [] {
    int best = best_kernel();
    const char* want = std::getenv("GATEWAY_CPU_KERNEL");
    if (!want || !*want) return best;
    std::string w(want);
    int cap = w == "scalar" ? SCALAR : w == "avx2" ? AVX2 : AVX512;
    return std::min(best, cap);
  }();
  return chosen;
}

// ------------------------------------------------------------- thread pool

using Span = void (*)(const Problem&, int, int);

// Work over items [i0, i1) of a call, with the call's context.
using Task = void (*)(void* context, int64_t i0, int64_t i1);

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool(threads_wanted());  // never destroyed: workers outlive exit
    return *pool;
  }

  int threads() const { return workers_ + 1; }

  // Runs `task` over items [0, n) in `chunk`-item pieces.
  void run(int64_t n, int64_t chunk, Task task, void* context) {
    const uint64_t chunks = (uint64_t(n) + chunk - 1) / chunk;
    if (workers_ == 0 || chunks <= 1 || chunks >= (1u << 20)) {
      task(context, 0, n);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mutex_);
    n_ = n;
    task_ = task;
    context_ = context;
    chunk_ = chunk;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ((ticket_.load(std::memory_order_relaxed) >> 40) + 1) & 0xFFFFFF;
    ticket_.store(gen << 40 | chunks << 20, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lk(mutex_); }
      wake_.notify_all();
    }
    work(gen);
    while (done_.load(std::memory_order_acquire) != chunks) pause();
  }

 private:
  explicit Pool(int threads) : workers_(threads - 1) {
    for (int i = 0; i < workers_; ++i) std::thread([this] { loop(); }).detach();
  }

  static int threads_wanted() { return mlx_sys_cpu_threads(); }

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  // Claims and runs chunks of generation `gen` until none is left.
  void work(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = t & 0xFFFFF, chunks = (t >> 20) & 0xFFFFF;
      if ((t >> 40) != gen || next >= chunks) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      // The call cannot finish before this chunk is done: its state holds.
      const int64_t i0 = int64_t(next) * chunk_;
      task_(context_, i0, std::min(n_, i0 + chunk_));
      done_.fetch_add(1, std::memory_order_acq_rel);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void loop() {
    uint64_t seen = 0;
    auto generation = [&] { return ticket_.load(std::memory_order_seq_cst) >> 40; };
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (generation() == seen) {
        pause();
        if (++spins % 64 != 0) continue;
        // Hand the core to any other runnable thread (on 2 cores the
        // graph-building caller and MLX's stream thread need both).
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(200)) {
          std::unique_lock<std::mutex> lk(mutex_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lk, [&] { return generation() != seen; });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
      seen = generation();
      work(seen);
    }
  }

  const int workers_;
  std::mutex run_mutex_, mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<uint64_t> done_{0};
  std::atomic<int> sleepers_{0};
  int64_t n_ = 0;
  Task task_ = nullptr;
  void* context_ = nullptr;
  int64_t chunk_ = 1;
};

// Whether the AVX-512 path can take int8 activations (vpdpbusd); without
// it they take the AVX2 one.
bool has_vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

void run_span(const Problem& p, Span span) {
  Pool& pool = Pool::get();
  // Two chunks a thread, taken in turn, so a thread slowed by other work on
  // its core takes fewer; whole panels for the lanes span. More, smaller
  // chunks cost a one-row step's many small products more in claims than
  // they gain in balance: eight a thread decoded the default model 10-15%
  // slower on two quiet cores, the same at 16 rows and in prefill
  // (docs/benchmarks.md, "Two chunks a thread").
  int chunk = std::max(4, p.n / (pool.threads() * 2));
#if defined(__x86_64__)
  if (span == span_avx512_lanes) chunk = (chunk + PANEL - 1) / PANEL * PANEL;
  if (span == span_avx512_q4) chunk = (chunk + Q4_COLUMNS - 1) / Q4_COLUMNS * Q4_COLUMNS;
#endif
  struct Call {
    const Problem& p;
    Span span;
  } call{p, span};
  pool.run(p.n, chunk, [](void* c, int64_t o0, int64_t o1) {
    auto& call = *static_cast<Call*>(c);
    call.span(call.p, int(o0), int(o1));
  }, &call);
}

void compute(const Problem& p, int kernel) {
  Span span = p.xq ? span_scalar_int8 : span_scalar;
#if defined(__x86_64__)
  static const bool vnni = has_vnni();
  if (p.xq) {
    if (kernel == AVX512 && vnni) span = span_avx512_int8;
    else if (kernel >= AVX2) span = span_avx2_int8;
  } else {
    if (kernel == AVX512) span = p.m >= LANES_ROWS ? span_avx512_lanes : span_avx512;
    if (kernel == AVX512 && p.bits == 4 && p.m <= Q4_ROWS) span = span_avx512_q4;
    if (kernel == AVX2) span = span_avx2;
  }
  // The spans that read x in an order of their own.
  void (*order)(const float*, int, int, float*) =
      span == span_avx512_q4 ? q4_order : span == span_avx512_lanes ? lanes_order : nullptr;
  if (order) {
    // Scratch of the stream's thread (workers read it within this call).
    thread_local std::vector<float> ordered;
    ordered.resize(size_t(p.m) * p.k);
    order(p.x, p.m, p.k, ordered.data());
    Problem q = p;
    q.x = ordered.data();
    return run_span(q, span);
  }
#endif
  run_span(p, span);
}

// ---------------------------------------------------------------- primitive

class PackedMatmul : public UnaryPrimitive {
 public:
  PackedMatmul(Stream s, int group, int bits, int kernel, bool int8)
      : UnaryPrimitive(s), group_(group), bits_(bits), kernel_(kernel), int8_(int8) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const array& x = inputs[0];
    const array& w = inputs[1];
    const array& s = inputs[2];
    const array& b = inputs[3];
    for (const array* a : {&w, &s, &b}) {
      if (!a->flags().row_contiguous)
        throw std::runtime_error("[packed_matmul] weights, scales and biases must be row-contiguous");
    }
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_input_array(s);
    encoder.set_input_array(b);
    encoder.set_output_array(out);
    const int k = x.shape(-1);
    Problem p{nullptr,
              w.data<uint32_t>(),
              s.data<void>(),
              b.data<void>(),
              s.dtype() == float16,
              out.data<float>(),
              int(x.size() / k),
              int(w.shape(0)),
              k,
              group_,
              bits_};
    encoder.dispatch([p, x = array::unsafe_weak_copy(x), kernel = kernel_, int8 = int8_]() mutable {
      std::vector<float> gathered;
      if (x.flags().row_contiguous) {
        p.x = x.data<float>();
      } else {
        // A strided view (rare: linears see fresh activations): copy it.
        gathered.resize(x.size());
        const float* base = x.data<float>();
        const int nd = x.ndim();
        std::vector<int> at(nd, 0);
        for (size_t i = 0; i < x.size(); ++i) {
          int64_t off = 0;
          for (int d = 0; d < nd; ++d) off += int64_t(at[d]) * x.strides()[d];
          gathered[i] = base[off];
          for (int d = nd - 1; d >= 0; --d) {
            if (++at[d] < x.shape(d)) break;
            at[d] = 0;
          }
        }
        p.x = gathered.data();
      }
      if (int8) {
        // Scratch of the stream's thread, reused by every call on it.
        thread_local std::vector<int8_t> xq;
        thread_local std::vector<float> xd, xs;
        xq.resize(size_t(p.m) * p.k);
        xd.resize(size_t(p.m) * (p.k / QBLOCK) * 8);
        xs.resize(size_t(p.m) * (p.k / p.group));
#if defined(__x86_64__)
        if (kernel == AVX512)
          quantize_rows_avx512(p.x, p.m, p.k, p.group, p.bits, xq.data(), xd.data(), xs.data());
        else
#endif
          quantize_rows(p.x, p.m, p.k, p.group, p.bits, xq.data(), xd.data(), xs.data());
        p.xq = xq.data();
        p.xd = xd.data();
        p.xs = xs.data();
      }
      compute(p, kernel);
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[packed_matmul] has no GPU kernel");
  }

  const char* name() const override { return "PackedMatmul"; }

  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const PackedMatmul&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && kernel_ == o.kernel_ && int8_ == o.int8_;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_, bits_, kernel_;
  bool int8_;
};

array packed_matmul(array x, array w, array scales, array biases, int group, int bits, int kernel,
                    int activation_bits, Stream s) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
  if (activation_bits != 32 && activation_bits != 8)
    throw std::invalid_argument("activations must be 32-bit floats or int8");
  if (group != 32 && group != 64 && group != 128)
    throw std::invalid_argument("group size must be 32, 64 or 128");
  if (kernel < 0) kernel = chosen_kernel();
  if (kernel > best_kernel()) throw std::invalid_argument("this CPU cannot run that kernel");
  if (w.ndim() != 2 || w.dtype() != uint32) throw std::invalid_argument("w must be 2-D uint32");
  if (x.ndim() < 1) throw std::invalid_argument("x must have at least one axis");
  const int n = w.shape(0), k = w.shape(1) * 32 / bits;
  if (x.shape(-1) != k)
    throw std::invalid_argument("x has " + std::to_string(x.shape(-1)) + " features, w has " +
                                std::to_string(k));
  const Shape groups{n, k / group};
  if (scales.shape() != groups || biases.shape() != groups)
    throw std::invalid_argument("scales and biases must be [out, in / group_size]");
  const Dtype dtype = x.dtype();
  if (!issubdtype(dtype, floating)) throw std::invalid_argument("x must be floating point");
  auto f32 = [&](const array& a) { return a.dtype() == float32 ? a : astype(a, float32, s); };
  // Scales and biases are read as fp16 or fp32 (others are widened).
  const Dtype sdtype = scales.dtype() == float16 ? float16 : float32;
  auto as_scales = [&](const array& a) { return a.dtype() == sdtype ? a : astype(a, sdtype, s); };
  Shape shape = x.shape();
  shape.back() = n;
  array y(std::move(shape), float32, std::make_shared<PackedMatmul>(s, group, bits, kernel, activation_bits == 8),
          {f32(x), w, as_scales(scales), as_scales(biases)});
  return dtype == float32 ? y : astype(y, dtype, s);
}
}  // namespace

extern "C" {

// Threads for the CPU's native kernels (this product, cpu_fused.cpp's
// attention): `GATEWAY_CPU_THREADS`, else the CPUs this process may run on.
int mlx_sys_cpu_threads(void) {
  static const int threads = [] {
    if (const char* s = std::getenv("GATEWAY_CPU_THREADS")) {
      const int n = std::atoi(s);
      if (n > 0) return n;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1, int(std::thread::hardware_concurrency()));
  }();
  return threads;
}

// Workers that spin briefly between calls (a decode step's products come
// tens of microseconds apart) and then sleep; the calling thread works too.
// Work is handed out in chunks of output columns through one atomic ticket
// (generation | chunk count | next chunk), so the caller never waits for a
// worker that has not started: on a loaded machine a descheduled worker
// simply takes no chunk, and one that wakes after the call finds the
// generation moved on without touching the finished call's state.

// Runs `task` over items [0, n) on the kernel's pool, `chunk` items at a
// time, the calling thread working too (cpu_fused.cpp's attention).
void mlx_sys_cpu_parallel(int64_t n, int64_t chunk, void (*task)(void*, int64_t, int64_t),
                          void* context) {
  Pool::get().run(n, std::max<int64_t>(chunk, 1), task, context);
}

// The best kernel this CPU runs (0 scalar, 1 AVX2+FMA, 2 AVX-512).
int mlx_sys_packed_kernel_best(void) { return best_kernel(); }

// The kernel used when none is named: the best, capped by GATEWAY_CPU_KERNEL.
int mlx_sys_packed_kernel_chosen(void) { return chosen_kernel(); }

// res = x @ dequantize(w, scales, biases)^T with `kernel` (-1: the chosen
// one), the activations as fp32 (`activation_bits` 32) or rounded to int8
// per block of 32 (8). Returns 0, or 1 with the reason in `err`.
int mlx_sys_packed_matmul(mlx_array* res, const mlx_array x, const mlx_array w,
                          const mlx_array scales, const mlx_array biases, int group_size, int bits,
                          int kernel, int activation_bits, const mlx_stream s, char* err,
                          size_t err_len) {
  try {
    mlx_array_set_(*res, packed_matmul(mlx_array_get_(x), mlx_array_get_(w),
                                       mlx_array_get_(scales), mlx_array_get_(biases),
                                       group_size, bits, kernel, activation_bits,
                                       mlx_stream_get_(s)));
    return 0;
  } catch (std::exception& e) {
    if (err && err_len) {
      std::strncpy(err, e.what(), err_len - 1);
      err[err_len - 1] = '\0';
    }
    return 1;
  }
}
}
