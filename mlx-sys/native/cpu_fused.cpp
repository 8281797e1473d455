// RoPE, RMSNorm, heads, gated activations and attention as single nodes of the MLX graph on
// the CPU.
//
// MLX's CPU backend has no kernels of its own for `fast::rope`,
// `fast::rms_norm` and `fast::scaled_dot_product_attention`: they run as
// their composed fallbacks, and a RoPE rebuilds its frequencies on every
// call (arange, exp, cos, sin and about 28 nodes each, twice a layer). On
// a small model a decode step is then about 3,500 nodes (the default
// model: 30 layers), and the host's time per node sets the step. These
// primitives compute the same float32 math in one node each: RoPE over
// [B, N, T, D] (any strides, one offset or one per row, the
// non-traditional layout) with the inverse frequencies the caller made
// with MLX's own ops (so the angles are the fallback's to the bit),
// RMSNorm over the last axis (optional weight; also after a residual
// add, both outputs of one node), an attention layer's heads from its
// stacked q/k/v product (split, q and k normed and rotated: three outputs
// of one node), the gated activation of the stacked gate/up product,
// attention over the cache (below). Only float32: the CPU computes in
// float32 (`compute_dtype: auto`); the caller keeps MLX's ops for others.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
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

namespace {
using namespace mlx::core;

// The element offset of [b, n, t, 0] in a 4-D view.
inline int64_t strided4(const array& a, int64_t b, int64_t n, int64_t t) {
  return b * a.strides()[0] + n * a.strides()[1] + t * a.strides()[2];
}

// The element offset of row `r` (counting over every axis but the last).
inline int64_t row_offset(const array& a, int64_t r) {
  int64_t off = 0;
  for (int d = a.ndim() - 2; d >= 0; --d) {
    const int64_t n = a.shape(d);
    off += (r % n) * a.strides()[d];
    r /= n;
  }
  return off;
}

// Allocates `out` (row-major, or dense with `strides` when given),
// registers the arrays with `s`'s CPU encoder (which keeps them alive) and
// runs `body(inputs, out)` there on weak copies.
template <class Body>
void run_on_encoder(Stream s, const std::vector<array>& inputs, array& out, Body body,
                    Strides strides = {}) {
  if (strides.empty()) {
    out.set_data(allocator::malloc(out.nbytes()));
  } else {
    array::Flags flags;
    flags.contiguous = true;
    flags.row_contiguous = false;
    flags.col_contiguous = false;
    out.set_data(allocator::malloc(out.nbytes()), out.size(), std::move(strides), flags);
  }
  auto& encoder = cpu::get_command_encoder(s);
  for (auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  std::vector<array> weak;
  for (auto& in : inputs) weak.push_back(array::unsafe_weak_copy(in));
  encoder.dispatch([weak = std::move(weak), out = array::unsafe_weak_copy(out),
                    body = std::move(body)]() mutable { body(weak, out); });
}

// cos and sin of each rotated pair's angle at one position: `pos *
// inv[i]`, `pos` the token's index plus its row's offset, times the scale.
struct Angles {
  std::vector<float> inv, cs, sn;

  Angles(const array& inv_freqs, int half) : inv(half), cs(half), sn(half) {
    const float* f = inv_freqs.data<float>();
    for (int i = 0; i < half; ++i) inv[i] = f[i * inv_freqs.strides()[0]];
  }

  void at(int t, int offset, float scale) {
    const float pos = (float(t) + float(offset)) * scale;
    for (size_t i = 0; i < inv.size(); ++i) {
      const float theta = pos * inv[i];
      cs[i] = std::cos(theta);
      sn[i] = std::sin(theta);
    }
  }

  // One head's D features (stride `sd`) rotated into `y`: the first
  // `2 * half` as pairs (i, i + half), the rest copied.
  void rotate(const float* row, int64_t sd, float* y, int D) const {
    const int half = int(inv.size());
    for (int i = 0; i < half; ++i) {
      const float x1 = row[i * sd], x2 = row[(i + half) * sd];
      y[i] = x1 * cs[i] - x2 * sn[i];
      y[i + half] = x1 * sn[i] + x2 * cs[i];
    }
    for (int i = 2 * half; i < D; ++i) y[i] = row[i * sd];
  }
};

// Row `r`'s offset: one for every row, or one per row.
inline int row_position(const array& offset, int r) {
  return offset.data<int>()[offset.size() > 1 ? r * offset.strides()[0] : 0];
}

// RMSNorm of D features (stride `sd`) into `y`, times `w` (stride `ws`)
// when given.
inline void norm_row(const float* row, int64_t sd, const float* w, int64_t ws, float eps, float* y,
                     int D) {
  float sum = 0.0f;
  for (int i = 0; i < D; ++i) sum += row[i * sd] * row[i * sd];
  const float norm = 1.0f / std::sqrt(sum / float(D) + eps);
  if (w) {
    for (int i = 0; i < D; ++i) y[i] = (row[i * sd] * norm) * w[i * ws];
  } else {
    for (int i = 0; i < D; ++i) y[i] = row[i * sd] * norm;
  }
}

class CpuRope : public UnaryPrimitive {
 public:
  CpuRope(Stream s, int dims, float scale) : UnaryPrimitive(s), dims_(dims), scale_(scale) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    run_on_encoder(stream(), inputs, out, [dims = dims_, scale = scale_](
                                              const std::vector<array>& weak, array& out) {
      const array& x = weak[0];
      const int B = x.shape(0), N = x.shape(1), T = x.shape(2), D = x.shape(3);
      Angles angles(weak[2], dims / 2);
      const float* src = x.data<float>();
      const int64_t sd = x.strides()[3];
      float* dst = out.data<float>();
      for (int b = 0; b < B; ++b) {
        const int o = row_position(weak[1], b);
        for (int t = 0; t < T; ++t) {
          angles.at(t, o, scale);
          for (int n = 0; n < N; ++n)
            angles.rotate(src + strided4(x, b, n, t), sd,
                          dst + ((int64_t(b) * N + n) * T + t) * D, D);
        }
      }
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[cpu_rope] has no GPU kernel");
  }
  const char* name() const override { return "CpuRope"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const CpuRope&>(other);
    return dims_ == o.dims_ && scale_ == o.scale_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  float scale_;
};

class CpuRmsNorm : public UnaryPrimitive {
 public:
  CpuRmsNorm(Stream s, float eps, bool has_weight)
      : UnaryPrimitive(s), eps_(eps), has_weight_(has_weight) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    run_on_encoder(stream(), inputs, out, [eps = eps_, has_weight = has_weight_](
                                              const std::vector<array>& weak, array& out) {
      const array& x = weak[0];
      const int D = x.shape(-1);
      const int64_t rows = x.size() / D;
      const float* src = x.data<float>();
      const int64_t sd = x.strides().back();
      const float* w = has_weight ? weak[1].data<float>() : nullptr;
      const int64_t ws = has_weight ? weak[1].strides()[0] : 0;
      float* dst = out.data<float>();
      for (int64_t r = 0; r < rows; ++r) norm_row(src + row_offset(x, r), sd, w, ws, eps, dst + r * D, D);
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[cpu_rms_norm] has no GPU kernel");
  }
  const char* name() const override { return "CpuRmsNorm"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const CpuRmsNorm&>(other);
    return eps_ == o.eps_ && has_weight_ == o.has_weight_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
  bool has_weight_;
};

// act(gate) * up over the stacked gate/up product's output ([..., 2I]:
// gate first), SiLU or tanh-approximated GELU, as one node: MLX's ops are
// two slices and the compiled activation.
class CpuGated : public UnaryPrimitive {
 public:
  CpuGated(Stream s, bool gelu) : UnaryPrimitive(s), gelu_(gelu) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    run_on_encoder(stream(), inputs, out, [gelu = gelu_](const std::vector<array>& weak,
                                                          array& out) {
      const array& x = weak[0];
      const int64_t I = out.shape(-1);
      const int64_t rows = out.size() / I;
      const int64_t sd = x.strides().back();
      const float* src = x.data<float>();
      float* dst = out.data<float>();
      const float k = std::sqrt(2.0f / float(M_PI));
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = src + row_offset(x, r);
        float* y = dst + r * I;
        for (int64_t i = 0; i < I; ++i) {
          const float g = row[i * sd], u = row[(i + I) * sd];
          const float act = gelu ? 0.5f * g * (1.0f + std::tanh(k * (g + 0.044715f * g * g * g)))
                                 : g / (1.0f + std::exp(-g));
          y[i] = act * u;
        }
      }
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[cpu_gated] has no GPU kernel");
  }
  const char* name() const override { return "CpuGated"; }
  bool is_equivalent(const Primitive& other) const override {
    return gelu_ == static_cast<const CpuGated&>(other).gelu_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape shape = inputs[0].shape();
    shape.back() /= 2;
    return {shape};
  }

 private:
  bool gelu_;
};

// ------------------------------------------------------------- attention
//
// Scaled-dot-product attention as one node: MLX's CPU backend runs
// `fast::scaled_dot_product_attention` as its composed fallback (the
// scale's Multiply, a Matmul, the mask's Select, Softmax, another Matmul
// and their broadcasts and views: about 12 nodes a layer, on one thread).
// Each (row, head, block of queries) is one item: the queries' scores over
// their keys (lower-right causal and/or a boolean mask), their softmax in
// float32, and the values' weighted sum. Items go to the product kernel's
// pool (the stream's thread and the pool's workers) from a few
// microseconds of work: a decode step's heads from a few dozen positions
// of context, a prefill chunk's blocks; each item's math is the same
// whichever thread runs it.
//
// A block of queries (a prefill chunk's, a verify's) puts one query in each
// lane of a vector and walks the keys a tile at a time: a key's scores for
// every lane are its features broadcast against the queries' (no sums
// across lanes), the softmax is online (each lane's running maximum and
// sum, the accumulated values rescaled when the maximum grows), and each
// value row is read once for all the lanes. One query alone (a decode
// step's) takes a dot product per key instead. One template of each,
// instantiated for AVX-512, AVX2+FMA and portable C++ vectors.

// The packed product kernel's path (0 scalar, 1 AVX2+FMA, 2 AVX-512),
// which `GATEWAY_CPU_KERNEL` caps for both (native/packed_matmul.cpp).
extern "C" int mlx_sys_packed_kernel_chosen(void);
extern "C" int mlx_sys_packed_kernel_best(void);

struct Attention {
  const float *q, *k, *v;
  const bool* mask;  // null: no mask
  int64_t qs[4], ks[4], vs[4], ms[4];  // strides; the mask's 0 on broadcast axes
  int B, H, KH, n, T, D, Dv;
  float scale;
  bool causal;  // query i sees keys up to T - n + i
  float* out;   // [B, n, H, Dv] in memory
};

// Queries per item, so a prefill chunk splits over threads finely enough;
// the widest vector's lanes.
constexpr int QUERY_BLOCK = 16;
// Keys per tile of a block: its scores and its value rows stay in L1.
constexpr int KEY_TILE = 64;
// Queries of an item from which the lanes pay for their width (fewer take
// a dot product per key each).
constexpr int LANES_FROM = 4;
constexpr float NONE = -std::numeric_limits<float>::infinity();
// exp below this is taken as 0 (it is 2e-38: past float's normal range).
constexpr float EXP_FLOOR = -86.0f;

// Per thread: a block's queries, scores, allowed keys and accumulated
// values (lane-major), and one query's scores and sums.
struct Scratch {
  std::vector<float> q, s, o, scores, acc;
  std::vector<uint8_t> allowed;

  void fit(const Attention& a) {
    q.resize(size_t(a.D) * QUERY_BLOCK);
    s.resize(size_t(KEY_TILE) * QUERY_BLOCK);
    o.resize(size_t(a.Dv) * QUERY_BLOCK);
    allowed.resize(size_t(KEY_TILE) * QUERY_BLOCK);
    scores.resize(size_t(a.T) + QUERY_BLOCK);
    acc.resize(a.Dv);
  }
};

#if defined(__GNUC__) && !defined(__clang__)
// The vector types pass by value only inside the target-specific wrappers
// that inline them (`flatten`); GCC warns of the ABI at the end of the file.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

// Portable C++: eight lanes the compiler vectorizes as it can.
struct Portable {
  static constexpr int L = 8, KEYS = 8, DIMS = 8;
  using Each = Portable;  // the vectors of one query's dot products
  struct T {
    float v[L];
  };
  template <class F>
  static T each(F f) {
    T r;
    for (int i = 0; i < L; ++i) r.v[i] = f(i);
    return r;
  }
  static T set1(float x) { return each([&](int) { return x; }); }
  static T zero() { return set1(0.0f); }
  static T load(const float* p) { return each([&](int i) { return p[i]; }); }
  static void store(float* p, T a) { std::memcpy(p, a.v, sizeof a.v); }
  static T add(T a, T b) { return each([&](int i) { return a.v[i] + b.v[i]; }); }
  static T sub(T a, T b) { return each([&](int i) { return a.v[i] - b.v[i]; }); }
  static T mul(T a, T b) { return each([&](int i) { return a.v[i] * b.v[i]; }); }
  static T max(T a, T b) { return each([&](int i) { return std::max(a.v[i], b.v[i]); }); }
  static T fmadd(T a, T b, T c) { return each([&](int i) { return a.v[i] * b.v[i] + c.v[i]; }); }
  static T round(T a) { return each([&](int i) { return std::nearbyint(a.v[i]); }); }
  static T scale2(T p, T n) { return each([&](int i) { return std::ldexp(p.v[i], int(n.v[i])); }); }
  static T zero_below(T x, float lim, T y) {
    return each([&](int i) { return x.v[i] >= lim ? y.v[i] : 0.0f; });
  }
  static T none_below(T s, int first) { return each([&](int i) { return i < first ? NONE : s.v[i]; }); }
  static T none_where_not(T s, const uint8_t* allowed) {
    return each([&](int i) { return allowed[i] ? s.v[i] : NONE; });
  }
  static float sum(T a) {
    float s = 0.0f;
    for (int i = 0; i < L; ++i) s += a.v[i];
    return s;
  }
};

#if defined(__x86_64__)
#define AVX2_TARGET "avx2,fma,f16c"
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"

struct Avx2 {
  static constexpr int L = 8, KEYS = 6, DIMS = 8;
  using Each = Avx2;
  using T = __m256;
  __attribute__((target(AVX2_TARGET))) static T set1(float x) { return _mm256_set1_ps(x); }
  __attribute__((target(AVX2_TARGET))) static T zero() { return _mm256_setzero_ps(); }
  __attribute__((target(AVX2_TARGET))) static T load(const float* p) { return _mm256_loadu_ps(p); }
  __attribute__((target(AVX2_TARGET))) static void store(float* p, T a) { _mm256_storeu_ps(p, a); }
  __attribute__((target(AVX2_TARGET))) static T add(T a, T b) { return _mm256_add_ps(a, b); }
  __attribute__((target(AVX2_TARGET))) static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  __attribute__((target(AVX2_TARGET))) static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  __attribute__((target(AVX2_TARGET))) static T max(T a, T b) { return _mm256_max_ps(a, b); }
  __attribute__((target(AVX2_TARGET))) static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  __attribute__((target(AVX2_TARGET))) static T round(T a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // p * 2^n through the exponent field: n >= -125 and p in [0.5, 2) here.
  __attribute__((target(AVX2_TARGET))) static T scale2(T p, T n) {
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  }
  __attribute__((target(AVX2_TARGET))) static T zero_below(T x, float lim, T y) {
    return _mm256_and_ps(_mm256_cmp_ps(x, set1(lim), _CMP_GE_OQ), y);
  }
  __attribute__((target(AVX2_TARGET))) static T none_below(T s, int first) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_blendv_ps(s, set1(NONE), _mm256_cmp_ps(lane, set1(float(first)), _CMP_LT_OQ));
  }
  __attribute__((target(AVX2_TARGET))) static T none_where_not(T s, const uint8_t* allowed) {
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(allowed)));
    const __m256i off = _mm256_cmpeq_epi32(w, _mm256_setzero_si256());
    return _mm256_blendv_ps(s, set1(NONE), _mm256_castsi256_ps(off));
  }
  __attribute__((target(AVX2_TARGET))) static float sum(T a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
  }
};

struct Avx512 {
  static constexpr int L = 16, KEYS = 8, DIMS = 16;
  // One query's dot products and sums in 8 lanes: in 16, a decode step
  // was 1.4x slower (the sums across a vector, one accumulator row).
  using Each = Avx2;
  using T = __m512;
  __attribute__((target(AVX512_TARGET))) static T set1(float x) { return _mm512_set1_ps(x); }
  __attribute__((target(AVX512_TARGET))) static T zero() { return _mm512_setzero_ps(); }
  __attribute__((target(AVX512_TARGET))) static T load(const float* p) { return _mm512_loadu_ps(p); }
  __attribute__((target(AVX512_TARGET))) static void store(float* p, T a) { _mm512_storeu_ps(p, a); }
  __attribute__((target(AVX512_TARGET))) static T add(T a, T b) { return _mm512_add_ps(a, b); }
  __attribute__((target(AVX512_TARGET))) static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  __attribute__((target(AVX512_TARGET))) static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  __attribute__((target(AVX512_TARGET))) static T max(T a, T b) { return _mm512_max_ps(a, b); }
  __attribute__((target(AVX512_TARGET))) static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  __attribute__((target(AVX512_TARGET))) static T round(T a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  __attribute__((target(AVX512_TARGET))) static T scale2(T p, T n) { return _mm512_scalef_ps(p, n); }
  __attribute__((target(AVX512_TARGET))) static T zero_below(T x, float lim, T y) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(lim), _CMP_GE_OQ), y);
  }
  __attribute__((target(AVX512_TARGET))) static T none_below(T s, int first) {
    const __mmask16 below = first >= L ? 0xffff : __mmask16((1u << first) - 1);
    return _mm512_mask_mov_ps(s, below, set1(NONE));
  }
  __attribute__((target(AVX512_TARGET))) static T none_where_not(T s, const uint8_t* allowed) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(allowed));
    return _mm512_mask_mov_ps(set1(NONE), _mm_test_epi8_mask(b, b), s);
  }
  __attribute__((target(AVX512_TARGET))) static float sum(T a) { return _mm512_reduce_add_ps(a); }
};
#endif

// exp(x) for x <= 0, 0 below EXP_FLOOR: x = n ln2 + r with |r| <= ln2 / 2
// (ln2 in two parts so n ln2 is exact), exp(r) by Cephes' `expf`
// polynomial (within about 1 unit in the last place), times 2^n.
template <class V>
inline typename V::T exp_nonpositive(const typename V::T& x) {
  const auto xc = V::max(x, V::set1(EXP_FLOOR));
  const auto n = V::round(V::mul(xc, V::set1(1.44269504088896341f)));
  auto r = V::fmadd(n, V::set1(-0.693359375f), xc);
  r = V::fmadd(n, V::set1(2.12194440e-4f), r);
  auto p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  p = V::fmadd(p, V::mul(r, r), V::add(r, V::set1(1.0f)));
  return V::zero_below(x, EXP_FLOOR, V::scale2(p, n));
}

template <class V>
inline float dot(const float* a, const float* b, int d) {
  constexpr int L = V::L;
  auto acc0 = V::zero(), acc1 = V::zero();
  int i = 0;
  for (; i + 2 * L <= d; i += 2 * L) {
    acc0 = V::fmadd(V::load(a + i), V::load(b + i), acc0);
    acc1 = V::fmadd(V::load(a + i + L), V::load(b + i + L), acc1);
  }
  for (; i + L <= d; i += L) acc0 = V::fmadd(V::load(a + i), V::load(b + i), acc0);
  float s = V::sum(V::add(acc0, acc1));
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

template <class V>
inline void axpy(float* y, float p, const float* x, int d) {
  constexpr int L = V::L;
  const auto pv = V::set1(p);
  int i = 0;
  for (; i + L <= d; i += L) V::store(y + i, V::fmadd(pv, V::load(x + i), V::load(y + i)));
  for (; i < d; ++i) y[i] += p * x[i];
}

inline const float* key_base(const Attention& a, int b, int h, const float* base, const int64_t* s) {
  return base + b * s[0] + h / (a.H / a.KH) * s[1];
}

inline float* out_row(const Attention& a, int b, int h, int i) {
  return a.out + ((int64_t(b) * a.n + i) * a.H + h) * a.Dv;
}

// Queries [q0, q1) of head h of row b, one at a time: the scores, their
// exponentials a vector at a time, the values' weighted sum.
template <class V>
void attend_each(const Attention& a, int b, int h, int q0, int q1, Scratch& w) {
  constexpr int L = V::L;
  const float* kb = key_base(a, b, h, a.k, a.ks);
  const float* vb = key_base(a, b, h, a.v, a.vs);
  const bool k_dense = a.ks[3] == 1, v_dense = a.vs[3] == 1;
  float* qrow = w.q.data();
  float* scores = w.scores.data();
  float* acc = w.acc.data();
  for (int i = q0; i < q1; ++i) {
    const float* qp = a.q + b * a.qs[0] + h * a.qs[1] + i * a.qs[2];
    for (int d = 0; d < a.D; ++d) qrow[d] = qp[d * a.qs[3]] * a.scale;
    const int end = a.causal ? std::min(a.T, a.T - a.n + i + 1) : a.T;
    const bool* mrow = a.mask ? a.mask + b * a.ms[0] + h * a.ms[1] + i * a.ms[2] : nullptr;
    float top = NONE;
    for (int j = 0; j < end; ++j) {
      if (mrow && !mrow[j * a.ms[3]]) {
        scores[j] = NONE;
        continue;
      }
      const float* kr = kb + j * a.ks[2];
      float s;
      if (k_dense) {
        s = dot<V>(qrow, kr, a.D);
      } else {
        s = 0.0f;
        for (int d = 0; d < a.D; ++d) s += qrow[d] * kr[d * a.ks[3]];
      }
      scores[j] = s;
      top = std::max(top, s);
    }
    float* y = out_row(a, b, h, i);
    if (top == NONE) {  // every key masked: nothing to attend to
      std::fill(y, y + a.Dv, 0.0f);
      continue;
    }
    // Whole vectors: the tail's lanes past `end` are masked.
    const int padded = (end + L - 1) / L * L;
    std::fill(scores + end, scores + padded, NONE);
    auto sums = V::zero();
    for (int j = 0; j < padded; j += L) {
      const auto p = exp_nonpositive<V>(V::sub(V::load(scores + j), V::set1(top)));
      V::store(scores + j, p);
      sums = V::add(sums, p);
    }
    std::fill(acc, acc + a.Dv, 0.0f);
    for (int j = 0; j < end; ++j) {
      const float p = scores[j];
      if (p == 0.0f) continue;
      const float* vr = vb + j * a.vs[2];
      if (v_dense) {
        axpy<V>(acc, p, vr, a.Dv);
      } else {
        for (int d = 0; d < a.Dv; ++d) acc[d] += p * vr[d * a.vs[3]];
      }
    }
    const float inv = 1.0f / V::sum(sums);
    for (int d = 0; d < a.Dv; ++d) y[d] = acc[d] * inv;
  }
}

// Queries [g0, g1) (at most L) of head h of row b in the lanes of a
// vector, over tiles of keys with an online softmax. `Dense`: k's and v's
// features adjacent (the cache's layout), so offsets within a row are
// constants. The loops over a tile's KEYS keys and DIMS features are
// unrolled so their sums stay in registers: at -O2 GCC kept them in
// memory, a load and a store per FMA.
template <class V, bool Dense>
void attend_lanes(const Attention& a, int b, int h, int g0, int g1, Scratch& w) {
  using T = typename V::T;
  constexpr int L = V::L;
  const int lanes = g1 - g0;
  const float* kb = key_base(a, b, h, a.k, a.ks);
  const float* vb = key_base(a, b, h, a.v, a.vs);
  const int64_t kj = a.ks[2], vj = a.vs[2];
  const int64_t kd = Dense ? 1 : a.ks[3], vd = Dense ? 1 : a.vs[3];
  float *qt = w.q.data(), *st = w.s.data(), *ot = w.o.data();
  uint8_t* allowed = w.allowed.data();
  // Feature d of every lane's query side by side (scaled; idle lanes 0).
  for (int d = 0; d < a.D; ++d)
    for (int i = 0; i < L; ++i)
      qt[d * L + i] = i < lanes ? a.q[b * a.qs[0] + h * a.qs[1] + (g0 + i) * a.qs[2] + d * a.qs[3]] * a.scale
                                : 0.0f;
  std::fill(ot, ot + size_t(a.Dv) * L, 0.0f);
  // Causal: lane i sees keys up to `last + i`; none of the lanes past
  // `last + lanes - 1`.
  const int last = a.T - a.n + g0;
  const int end = a.causal ? std::min(a.T, last + lanes) : a.T;
  T top = V::set1(NONE), total = V::zero();
  for (int j0 = 0; j0 < end; j0 += KEY_TILE) {
    const int tk = std::min(KEY_TILE, end - j0);
    // Scores: key j's features broadcast against the lanes', KEYS keys at
    // a time.
    int jj = 0;
    for (; jj + V::KEYS <= tk; jj += V::KEYS) {
      T acc[V::KEYS];
#pragma GCC unroll 16
      for (int r = 0; r < V::KEYS; ++r) acc[r] = V::zero();
      const float* kr = kb + (j0 + jj) * kj;
      for (int d = 0; d < a.D; ++d) {
        const T qv = V::load(qt + d * L);
#pragma GCC unroll 16
        for (int r = 0; r < V::KEYS; ++r) acc[r] = V::fmadd(V::set1(kr[r * kj + d * kd]), qv, acc[r]);
      }
#pragma GCC unroll 16
      for (int r = 0; r < V::KEYS; ++r) V::store(st + (jj + r) * L, acc[r]);
    }
    for (; jj < tk; ++jj) {
      T acc = V::zero();
      const float* kr = kb + (j0 + jj) * kj;
      for (int d = 0; d < a.D; ++d) acc = V::fmadd(V::set1(kr[d * kd]), V::load(qt + d * L), acc);
      V::store(st + jj * L, acc);
    }
    if (a.mask) {
      for (int j = 0; j < tk; ++j)
        for (int i = 0; i < L; ++i)
          allowed[j * L + i] =
              i < lanes && a.mask[b * a.ms[0] + h * a.ms[1] + (g0 + i) * a.ms[2] + (j0 + j) * a.ms[3]];
    }
    // Masks, then the tile's maximum per lane.
    T tile_top = V::set1(NONE);
    for (int j = 0; j < tk; ++j) {
      T s = V::load(st + j * L);
      if (a.causal && j0 + j > last) s = V::none_below(s, j0 + j - last);
      if (a.mask) s = V::none_where_not(s, allowed + j * L);
      V::store(st + j * L, s);
      tile_top = V::max(tile_top, s);
    }
    // Online softmax: exponents from the new maximum (a finite stand-in
    // where a lane has seen only masked keys), the sums and accumulated
    // values so far rescaled to it.
    const T new_top = V::max(top, tile_top);
    const T from = V::max(new_top, V::set1(-std::numeric_limits<float>::max()));
    const T rescale = exp_nonpositive<V>(V::sub(top, from));
    top = new_top;
    T sum = V::zero();
    for (int j = 0; j < tk; ++j) {
      const T p = exp_nonpositive<V>(V::sub(V::load(st + j * L), from));
      V::store(st + j * L, p);
      sum = V::add(sum, p);
    }
    total = V::fmadd(total, rescale, sum);
    // Values: DIMS features of every lane's sum at a time, each value
    // feature broadcast against the lanes' weights.
    int d0 = 0;
    for (; d0 + V::DIMS <= a.Dv; d0 += V::DIMS) {
      T acc[V::DIMS];
#pragma GCC unroll 16
      for (int r = 0; r < V::DIMS; ++r) acc[r] = V::mul(V::load(ot + (d0 + r) * L), rescale);
      for (int j = 0; j < tk; ++j) {
        const T p = V::load(st + j * L);
        const float* vr = vb + (j0 + j) * vj + d0 * vd;
#pragma GCC unroll 16
        for (int r = 0; r < V::DIMS; ++r) acc[r] = V::fmadd(V::set1(vr[r * vd]), p, acc[r]);
      }
#pragma GCC unroll 16
      for (int r = 0; r < V::DIMS; ++r) V::store(ot + (d0 + r) * L, acc[r]);
    }
    for (; d0 < a.Dv; ++d0) {
      T acc = V::mul(V::load(ot + d0 * L), rescale);
      for (int j = 0; j < tk; ++j)
        acc = V::fmadd(V::set1(vb[(j0 + j) * vj + d0 * vd]), V::load(st + j * L), acc);
      V::store(ot + d0 * L, acc);
    }
  }
  float sums[L];
  V::store(sums, total);
  for (int i = 0; i < lanes; ++i) {
    // Every key masked: nothing to attend to.
    const float inv = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;
    float* y = out_row(a, b, h, g0 + i);
    for (int d = 0; d < a.Dv; ++d) y[d] = ot[d * L + i] * inv;
  }
}

template <class V>
inline void attend(const Attention& a, int b, int h, int q0, int q1, Scratch& w) {
  if (q1 - q0 < LANES_FROM) return attend_each<typename V::Each>(a, b, h, q0, q1, w);
  const bool dense = a.ks[3] == 1 && a.vs[3] == 1;
  for (int g = q0; g < q1; g += V::L) {
    if (dense) {
      attend_lanes<V, true>(a, b, h, g, std::min(q1, g + V::L), w);
    } else {
      attend_lanes<V, false>(a, b, h, g, std::min(q1, g + V::L), w);
    }
  }
}

// One function per path; `flatten` inlines the vector operations into
// the wrapper that has their instruction set.
using AttendFn = void (*)(const Attention&, int, int, int, int, Scratch&);

void attend_portable(const Attention& a, int b, int h, int q0, int q1, Scratch& w) {
  attend<Portable>(a, b, h, q0, q1, w);
}

#if defined(__x86_64__)
__attribute__((target(AVX2_TARGET), flatten)) void attend_avx2(const Attention& a, int b, int h,
                                                               int q0, int q1, Scratch& w) {
  attend<Avx2>(a, b, h, q0, q1, w);
}

__attribute__((target(AVX512_TARGET), flatten)) void attend_avx512(const Attention& a, int b,
                                                                   int h, int q0, int q1,
                                                                   Scratch& w) {
  attend<Avx512>(a, b, h, q0, q1, w);
}
#endif

AttendFn attend_path(int kernel) {
#if defined(__x86_64__)
  if (kernel >= 2) return attend_avx512;
  if (kernel == 1) return attend_avx2;
#endif
  return attend_portable;
}

// The product kernel's pool (packed_matmul.cpp), whose workers wait hot
// between a step's nodes.
extern "C" void mlx_sys_cpu_parallel(int64_t n, int64_t chunk,
                                     void (*task)(void*, int64_t, int64_t), void* context);

// Query-score products (times the head width) from which a call hands its
// items to the pool: a few microseconds of work, where handing over costs
// about one. A decode step's heads take it from a few dozen positions on.
constexpr int64_t THREADED_WORK = int64_t(1) << 15;

struct AttentionCall {
  const Attention& a;
  AttendFn attend;
  int blocks;
  int64_t items;

  // Item i counted from the last: the causal mask makes a block's work
  // grow with its index, and taking the largest first evens the threads'
  // shares.
  void run(int64_t i) const {
    thread_local Scratch scratch;
    scratch.fit(a);
    const int64_t item = items - 1 - i;
    const int blk = int(item % blocks);
    const int h = int(item / blocks % a.H), b = int(item / blocks / a.H);
    attend(a, b, h, blk * QUERY_BLOCK, std::min(a.n, (blk + 1) * QUERY_BLOCK), scratch);
  }
};

void attention(const Attention& a, int kernel) {
  const int blocks = (a.n + QUERY_BLOCK - 1) / QUERY_BLOCK;
  const AttentionCall call{a, attend_path(kernel), blocks, int64_t(a.B) * a.H * blocks};
  const int64_t work = int64_t(a.B) * a.H * a.n * a.T * (a.D + a.Dv);
  if (work < THREADED_WORK) {
    for (int64_t i = 0; i < call.items; ++i) call.run(i);
    return;
  }
  // One item a claim: a decode step has as few as one per head.
  mlx_sys_cpu_parallel(call.items, 1, [](void* c, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) static_cast<const AttentionCall*>(c)->run(i);
  }, const_cast<AttentionCall*>(&call));
}

class CpuAttention : public UnaryPrimitive {
 public:
  CpuAttention(Stream s, float scale, bool causal, bool has_mask, int kernel)
      : UnaryPrimitive(s), scale_(scale), causal_(causal), has_mask_(has_mask), kernel_(kernel) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    // Heads apart in memory, rows of heads together: `[B, n, H, Dv]`
    // behind the `[B, H, n, Dv]` shape, so moving the heads back beside
    // each other for the output projection is a view, not a copy.
    const Shape& sh = out.shape();
    const int64_t n = sh[2], H = sh[1], Dv = sh[3];
    Strides strides{n * H * Dv, Dv, H * Dv, 1};
    run_on_encoder(
        stream(), inputs, out,
        [scale = scale_, causal = causal_, has_mask = has_mask_, kernel = kernel_](
            const std::vector<array>& weak, array& out) {
          const array &q = weak[0], &k = weak[1], &v = weak[2];
          Attention a{};
          a.q = q.data<float>();
          a.k = k.data<float>();
          a.v = v.data<float>();
          for (int d = 0; d < 4; ++d) {
            a.qs[d] = q.strides()[d];
            a.ks[d] = k.strides()[d];
            a.vs[d] = v.strides()[d];
          }
          if (has_mask) {
            const array& m = weak[3];
            a.mask = m.data<bool>();
            for (int d = 0; d < 4; ++d) a.ms[d] = m.shape(d) == 1 ? 0 : m.strides()[d];
          }
          a.B = q.shape(0);
          a.H = q.shape(1);
          a.n = q.shape(2);
          a.D = q.shape(3);
          a.KH = k.shape(1);
          a.T = k.shape(2);
          a.Dv = v.shape(3);
          a.scale = scale;
          a.causal = causal;
          a.out = out.data<float>();
          attention(a, kernel);
        },
        std::move(strides));
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[cpu_attention] has no GPU kernel");
  }
  const char* name() const override { return "CpuAttention"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const CpuAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && has_mask_ == o.has_mask_ &&
           kernel_ == o.kernel_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape shape = inputs[0].shape();
    shape.back() = inputs[2].shape(3);
    return {shape};
  }

 private:
  float scale_;
  bool causal_, has_mask_;
  int kernel_;
};

// h = x + r and RMSNorm(h) * weight in one pass and one node (two
// outputs): a layer's residual add and the norm that reads it.
class CpuAddRmsNorm : public Primitive {
 public:
  CpuAddRmsNorm(Stream s, float eps) : Primitive(s), eps_(eps) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    for (auto& o : outputs) o.set_data(allocator::malloc(o.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    for (auto& o : outputs) encoder.set_output_array(o);
    encoder.dispatch([x = array::unsafe_weak_copy(inputs[0]), r = array::unsafe_weak_copy(inputs[1]),
                      w = array::unsafe_weak_copy(inputs[2]),
                      h = array::unsafe_weak_copy(outputs[0]),
                      y = array::unsafe_weak_copy(outputs[1]), eps = eps_]() mutable {
      const int D = x.shape(-1);
      const int64_t rows = x.size() / D;
      const int64_t xs = x.strides().back(), rs = r.strides().back(), ws = w.strides()[0];
      const float *xp = x.data<float>(), *rp = r.data<float>(), *wp = w.data<float>();
      float *hp = h.data<float>(), *yp = y.data<float>();
      for (int64_t row = 0; row < rows; ++row) {
        const float* xr = xp + row_offset(x, row);
        const float* rr = rp + row_offset(r, row);
        float* hr = hp + row * D;
        for (int i = 0; i < D; ++i) hr[i] = xr[i * xs] + rr[i * rs];
        norm_row(hr, 1, wp, ws, eps, yp + row * D, D);
      }
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[cpu_add_rms_norm] has no GPU kernel");
  }
  const char* name() const override { return "CpuAddRmsNorm"; }
  bool is_equivalent(const Primitive& other) const override {
    return eps_ == static_cast<const CpuAddRmsNorm&>(other).eps_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape(), inputs[0].shape()};
  }

 private:
  float eps_;
};

// An attention layer's heads from its stacked q/k/v product, one node with
// three outputs: q [B, H, L, D], k and v [B, KH, L, D] from the product's
// B * L rows of (H + 2 KH) * D features, q and k normed (when the layer
// has q/k norms) and rotated at their rows' positions. The unfused chain
// is three slices, three reshapes (and transposes), two norms and two
// RoPEs a layer; the same float32 math (`norm_row`, `Angles`), and each
// position's angles made once for q and k.
class CpuHeads : public Primitive {
 public:
  CpuHeads(Stream s, int B, int L, int H, int KH, int dims, float scale, float eps, bool norms)
      : Primitive(s), B_(B), L_(L), H_(H), KH_(KH), dims_(dims), scale_(scale), eps_(eps),
        norms_(norms) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    for (auto& o : outputs) o.set_data(allocator::malloc(o.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    for (auto& o : outputs) encoder.set_output_array(o);
    std::vector<array> weak;
    for (auto& in : inputs) weak.push_back(array::unsafe_weak_copy(in));
    for (auto& o : outputs) weak.push_back(array::unsafe_weak_copy(o));
    encoder.dispatch([weak = std::move(weak), B = B_, L = L_, H = H_, KH = KH_, dims = dims_,
                      scale = scale_, eps = eps_, norms = norms_]() mutable {
      const array& qkv = weak[0];
      const int D = qkv.shape(-1) / (H + 2 * KH);
      const int64_t sd = qkv.strides().back();
      const float* src = qkv.data<float>();
      const float *qw = nullptr, *kw = nullptr;
      int64_t qws = 0, kws = 0;
      if (norms) {
        qw = weak[3].data<float>();
        qws = weak[3].strides()[0];
        kw = weak[4].data<float>();
        kws = weak[4].strides()[0];
      }
      const size_t first_out = norms ? 5 : 3;
      float* q = weak[first_out].data<float>();
      float* k = weak[first_out + 1].data<float>();
      float* v = weak[first_out + 2].data<float>();
      Angles angles(weak[2], dims / 2);
      std::vector<float> normed(D);
      // One head of row (b, t): normed when `w`, then rotated into `y`.
      auto head = [&](const float* row, const float* w, int64_t ws, float* y) {
        if (!w) return angles.rotate(row, sd, y, D);
        norm_row(row, sd, w, ws, eps, normed.data(), D);
        angles.rotate(normed.data(), 1, y, D);
      };
      for (int b = 0; b < B; ++b) {
        const int o = row_position(weak[1], b);
        for (int t = 0; t < L; ++t) {
          const float* row = src + row_offset(qkv, int64_t(b) * L + t);
          angles.at(t, o, scale);
          for (int n = 0; n < H; ++n)
            head(row + int64_t(n) * D * sd, qw, qws, q + ((int64_t(b) * H + n) * L + t) * D);
          for (int n = 0; n < KH; ++n) {
            const int64_t at = ((int64_t(b) * KH + n) * L + t) * D;
            head(row + int64_t(H + n) * D * sd, kw, kws, k + at);
            const float* vr = row + int64_t(H + KH + n) * D * sd;
            for (int i = 0; i < D; ++i) v[at + i] = vr[i * sd];
          }
        }
      }
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[cpu_heads] has no GPU kernel");
  }
  const char* name() const override { return "CpuHeads"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const CpuHeads&>(other);
    return B_ == o.B_ && L_ == o.L_ && H_ == o.H_ && KH_ == o.KH_ && dims_ == o.dims_ &&
           scale_ == o.scale_ && eps_ == o.eps_ && norms_ == o.norms_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    const int D = inputs[0].shape(-1) / (H_ + 2 * KH_);
    return {{B_, H_, L_, D}, {B_, KH_, L_, D}, {B_, KH_, L_, D}};
  }

 private:
  int B_, L_, H_, KH_, dims_;
  float scale_, eps_;
  bool norms_;
};

void need_float32(const array& a, const char* what) {
  if (a.dtype() != float32) throw std::invalid_argument(std::string(what) + " must be float32");
}

// A rotation's inputs: `dims` of D features turned, at one offset or one
// per row of B, by `inv_freqs` [dims / 2] (float32).
void check_rotation(const array& offset, const array& inv_freqs, int dims, int D, int B) {
  need_float32(inv_freqs, "inv_freqs");
  if (dims <= 0 || dims % 2 || dims > D) throw std::invalid_argument("dims must be even and at most D");
  if (offset.size() != 1 && offset.size() != size_t(B))
    throw std::invalid_argument("one offset, or one per row");
  if (inv_freqs.ndim() != 1 || inv_freqs.shape(0) != dims / 2)
    throw std::invalid_argument("inv_freqs must be [dims / 2]");
}

int fail(const std::exception& e, char* err, size_t err_len) {
  if (err && err_len) {
    std::strncpy(err, e.what(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return 1;
}
}  // namespace

extern "C" {

// res = RoPE of x ([B, N, T, D] float32) over its first `dims` features
// at positions (`offset` (int: one, or one per row) + t) * `scale`, with
// `inv_freqs` (float32 [dims / 2]): the angle of pair i is position *
// inv_freqs[i].
int mlx_sys_cpu_rope(mlx_array* res, const mlx_array x, const mlx_array offset,
                     const mlx_array inv_freqs, int dims, float scale, const mlx_stream s,
                     char* err, size_t err_len) {
  try {
    Stream st = mlx_stream_get_(s);
    array a = mlx_array_get_(x);
    array o = astype(mlx_array_get_(offset), int32, st);
    array f = mlx_array_get_(inv_freqs);
    need_float32(a, "x");
    if (a.ndim() != 4) throw std::invalid_argument("x must be [B, N, T, D]");
    check_rotation(o, f, dims, a.shape(3), a.shape(0));
    mlx_array_set_(*res, array(a.shape(), float32, std::make_shared<CpuRope>(st, dims, scale),
                               {a, o, f}));
    return 0;
  } catch (std::exception& e) {
    return fail(e, err, err_len);
  }
}

// res = x * rsqrt(mean(x^2, -1) + eps) (* weight when `has_weight`), float32.
int mlx_sys_cpu_rms_norm(mlx_array* res, const mlx_array x, const mlx_array weight,
                         int has_weight, float eps, const mlx_stream s, char* err,
                         size_t err_len) {
  try {
    Stream st = mlx_stream_get_(s);
    array a = mlx_array_get_(x);
    need_float32(a, "x");
    if (a.ndim() < 1) throw std::invalid_argument("x needs an axis");
    std::vector<array> inputs{a};
    if (has_weight) {
      array w = mlx_array_get_(weight);
      need_float32(w, "weight");
      if (w.ndim() != 1 || w.shape(0) != a.shape(-1))
        throw std::invalid_argument("weight must be [D]");
      inputs.push_back(w);
    }
    mlx_array_set_(*res, array(a.shape(), float32,
                               std::make_shared<CpuRmsNorm>(st, eps, has_weight != 0),
                               std::move(inputs)));
    return 0;
  } catch (std::exception& e) {
    return fail(e, err, err_len);
  }
}

// res = softmax(q k^T * scale [masked]) v over q [B, H, n, D], k [B, KH,
// T, D] and v [B, KH, T, Dv] (float32, H a multiple of KH): query i sees
// keys up to T - n + i when `causal`, and where `mask` (bool, [B or 1, H
// or 1, n, T]) is true when `has_mask`. `kernel`: the path (0 scalar, 1
// and up SIMD; -1 the chosen one).
int mlx_sys_cpu_attention(mlx_array* res, const mlx_array q, const mlx_array k,
                          const mlx_array v, const mlx_array mask, int has_mask, int causal,
                          float scale, int kernel, const mlx_stream s, char* err,
                          size_t err_len) {
  try {
    Stream st = mlx_stream_get_(s);
    array qa = mlx_array_get_(q), ka = mlx_array_get_(k), va = mlx_array_get_(v);
    need_float32(qa, "q");
    need_float32(ka, "k");
    need_float32(va, "v");
    if (qa.ndim() != 4 || ka.ndim() != 4 || va.ndim() != 4)
      throw std::invalid_argument("q, k and v must be [B, heads, L, D]");
    const int B = qa.shape(0), H = qa.shape(1), n = qa.shape(2), T = ka.shape(2);
    if (ka.shape(0) != B || va.shape(0) != B || va.shape(1) != ka.shape(1) ||
        va.shape(2) != T || ka.shape(3) != qa.shape(3))
      throw std::invalid_argument("k and v must be [B, kv_heads, T, D] to q's [B, heads, n, D]");
    if (ka.shape(1) < 1 || H % ka.shape(1))
      throw std::invalid_argument("heads must be a multiple of kv heads");
    if (causal && n > T) throw std::invalid_argument("causal attention needs n <= T");
    if (kernel < 0) kernel = mlx_sys_packed_kernel_chosen();
    if (kernel > mlx_sys_packed_kernel_best())
      throw std::invalid_argument("this CPU cannot run that kernel");
    std::vector<array> inputs{qa, ka, va};
    if (has_mask) {
      array m = mlx_array_get_(mask);
      if (m.dtype() != bool_) throw std::invalid_argument("the mask must be boolean");
      if (m.ndim() != 4) throw std::invalid_argument("the mask must be 4-D");
      const int want[4] = {B, H, n, T};
      for (int d = 0; d < 4; ++d)
        if (m.shape(d) != 1 && m.shape(d) != want[d])
          throw std::invalid_argument("the mask must broadcast to [B, heads, n, T]");
      inputs.push_back(m);
    }
    Shape shape{B, H, n, va.shape(3)};
    mlx_array_set_(*res, array(std::move(shape), float32,
                               std::make_shared<CpuAttention>(st, scale, causal != 0,
                                                              has_mask != 0, kernel),
                               std::move(inputs)));
    return 0;
  } catch (std::exception& e) {
    return fail(e, err, err_len);
  }
}

// res = act(x[..., :I]) * x[..., I:] of x [..., 2I] (float32), act SiLU or
// (when `gelu`) tanh-approximated GELU.
int mlx_sys_cpu_gated(mlx_array* res, const mlx_array x, int gelu, const mlx_stream s, char* err,
                      size_t err_len) {
  try {
    Stream st = mlx_stream_get_(s);
    array a = mlx_array_get_(x);
    need_float32(a, "x");
    if (a.ndim() < 1 || a.shape(-1) % 2) throw std::invalid_argument("x must be [..., 2I]");
    Shape shape = a.shape();
    shape.back() /= 2;
    mlx_array_set_(*res, array(std::move(shape), float32, std::make_shared<CpuGated>(st, gelu != 0),
                               {a}));
    return 0;
  } catch (std::exception& e) {
    return fail(e, err, err_len);
  }
}

// h = x + r and y = h * rsqrt(mean(h^2, -1) + eps) * weight, float32, x
// and r of one shape, weight [D].
int mlx_sys_cpu_add_rms_norm(mlx_array* h, mlx_array* y, const mlx_array x, const mlx_array r,
                             const mlx_array weight, float eps, const mlx_stream s, char* err,
                             size_t err_len) {
  try {
    Stream st = mlx_stream_get_(s);
    array a = mlx_array_get_(x), b = mlx_array_get_(r), w = mlx_array_get_(weight);
    need_float32(a, "x");
    need_float32(b, "r");
    need_float32(w, "weight");
    if (a.ndim() < 1 || a.shape() != b.shape()) throw std::invalid_argument("x and r must be one shape");
    if (w.ndim() != 1 || w.shape(0) != a.shape(-1)) throw std::invalid_argument("weight must be [D]");
    auto outs = array::make_arrays({a.shape(), a.shape()}, {float32, float32},
                                   std::make_shared<CpuAddRmsNorm>(st, eps), {a, b, w});
    mlx_array_set_(*h, outs[0]);
    mlx_array_set_(*y, outs[1]);
    return 0;
  } catch (std::exception& e) {
    return fail(e, err, err_len);
  }
}

// q [B, H, L, D], k and v [B, KH, L, D] (float32) from the stacked q/k/v
// product `qkv` (B * L rows of (H + 2 KH) * D, float32): q and k normed
// by `q_norm` / `k_norm` ([D], eps) when `has_norms`, then rotated over
// their first `dims` features as `mlx_sys_cpu_rope` does at positions
// `offset` (one, or one per row) + t.
int mlx_sys_cpu_heads(mlx_array* q, mlx_array* k, mlx_array* v, const mlx_array qkv,
                      const mlx_array offset, const mlx_array inv_freqs, const mlx_array q_norm,
                      const mlx_array k_norm, int has_norms, float eps, int B, int L, int H,
                      int KH, int dims, float scale, const mlx_stream s, char* err,
                      size_t err_len) {
  try {
    Stream st = mlx_stream_get_(s);
    array x = mlx_array_get_(qkv);
    array o = astype(mlx_array_get_(offset), int32, st);
    array f = mlx_array_get_(inv_freqs);
    need_float32(x, "qkv");
    if (B < 1 || L < 1 || H < 1 || KH < 1) throw std::invalid_argument("rows and heads must be positive");
    const int64_t width = x.ndim() ? x.shape(-1) : 0;
    if (width % (H + 2 * KH) || int64_t(x.size()) != int64_t(B) * L * width)
      throw std::invalid_argument("qkv must be B * L rows of (H + 2 KH) * D");
    const int D = int(width / (H + 2 * KH));
    check_rotation(o, f, dims, D, B);
    std::vector<array> inputs{x, o, f};
    if (has_norms) {
      for (const mlx_array& n : {q_norm, k_norm}) {
        array w = mlx_array_get_(n);
        need_float32(w, "norm weight");
        if (w.ndim() != 1 || w.shape(0) != D) throw std::invalid_argument("norm weights must be [D]");
        inputs.push_back(w);
      }
    }
    auto outs = array::make_arrays(
        {{B, H, L, D}, {B, KH, L, D}, {B, KH, L, D}}, {float32, float32, float32},
        std::make_shared<CpuHeads>(st, B, L, H, KH, dims, scale, eps, has_norms != 0),
        std::move(inputs));
    mlx_array_set_(*q, outs[0]);
    mlx_array_set_(*k, outs[1]);
    mlx_array_set_(*v, outs[2]);
    return 0;
  } catch (std::exception& e) {
    return fail(e, err, err_len);
  }
}
}
