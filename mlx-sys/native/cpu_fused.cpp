// RoPE and RMSNorm as single nodes of the MLX graph on the CPU.
//
// MLX's CPU backend has no kernels of its own for `fast::rope` and
// `fast::rms_norm`: they run as their composed fallbacks, and a RoPE
// rebuilds its frequencies on every call (arange, exp, cos, sin and about
// 28 nodes each, twice a layer). On a small model a decode step is then
// about 3,500 nodes (the default model: 30 layers), and the host's time
// per node sets the step. These primitives compute the same float32 math
// in one node each: RoPE over [B, N, T, D] (any strides, one offset or one
// per row, the non-traditional layout) with the inverse frequencies the
// caller made with MLX's own ops (so the angles are the fallback's to the
// bit), RMSNorm over the last axis (optional weight). Only float32: the CPU computes in
// float32 (`compute_dtype: auto`); the caller keeps MLX's ops for others.
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

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

// Allocates `out`, registers the arrays with `s`'s CPU encoder (which keeps
// them alive) and runs `body(inputs, out)` there on weak copies.
template <class Body>
void run_on_encoder(Stream s, const std::vector<array>& inputs, array& out, Body body) {
  out.set_data(allocator::malloc(out.nbytes()));
  auto& encoder = cpu::get_command_encoder(s);
  for (auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  std::vector<array> weak;
  for (auto& in : inputs) weak.push_back(array::unsafe_weak_copy(in));
  encoder.dispatch([weak = std::move(weak), out = array::unsafe_weak_copy(out),
                    body = std::move(body)]() mutable { body(weak, out); });
}

class CpuRope : public UnaryPrimitive {
 public:
  CpuRope(Stream s, int dims, float scale) : UnaryPrimitive(s), dims_(dims), scale_(scale) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    run_on_encoder(stream(), inputs, out, [dims = dims_, scale = scale_](
                                              const std::vector<array>& weak, array& out) {
      const array& x = weak[0];
      const array& offset = weak[1];
      const int B = x.shape(0), N = x.shape(1), T = x.shape(2), D = x.shape(3);
      const int half = dims / 2;
      std::vector<float> inv(half);
      const float* f = weak[2].data<float>();
      for (int i = 0; i < half; ++i) inv[i] = f[i * weak[2].strides()[0]];
      const int* off = offset.data<int>();
      const bool per_row = offset.size() > 1;
      const float* src = x.data<float>();
      const int64_t sd = x.strides()[3];
      float* dst = out.data<float>();
      std::vector<float> cs(half), sn(half);
      for (int b = 0; b < B; ++b) {
        const int o = off[per_row ? b * offset.strides()[0] : 0];
        for (int t = 0; t < T; ++t) {
          const float pos = (float(t) + float(o)) * scale;
          for (int i = 0; i < half; ++i) {
            const float theta = pos * inv[i];
            cs[i] = std::cos(theta);
            sn[i] = std::sin(theta);
          }
          for (int n = 0; n < N; ++n) {
            const float* row = src + strided4(x, b, n, t);
            float* y = dst + ((int64_t(b) * N + n) * T + t) * D;
            for (int i = 0; i < half; ++i) {
              const float x1 = row[i * sd], x2 = row[(i + half) * sd];
              y[i] = x1 * cs[i] - x2 * sn[i];
              y[i + half] = x1 * sn[i] + x2 * cs[i];
            }
            for (int i = dims; i < D; ++i) y[i] = row[i * sd];
          }
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
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = src + row_offset(x, r);
        float* y = dst + r * D;
        float sum = 0.0f;
        for (int i = 0; i < D; ++i) sum += row[i * sd] * row[i * sd];
        const float norm = 1.0f / std::sqrt(sum / float(D) + eps);
        if (w) {
          for (int i = 0; i < D; ++i) y[i] = (row[i * sd] * norm) * w[i * ws];
        } else {
          for (int i = 0; i < D; ++i) y[i] = row[i * sd] * norm;
        }
      }
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

void need_float32(const array& a, const char* what) {
  if (a.dtype() != float32) throw std::invalid_argument(std::string(what) + " must be float32");
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
    need_float32(f, "inv_freqs");
    if (a.ndim() != 4) throw std::invalid_argument("x must be [B, N, T, D]");
    if (dims <= 0 || dims % 2 || dims > a.shape(3))
      throw std::invalid_argument("dims must be even and at most D");
    if (o.size() != 1 && o.size() != size_t(a.shape(0)))
      throw std::invalid_argument("one offset, or one per row");
    if (f.ndim() != 1 || f.shape(0) != dims / 2)
      throw std::invalid_argument("inv_freqs must be [dims / 2]");
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
}
