// One head of the stacked q/k/v product, `src`, as a warp makes it for
// attention: lane l holds features l + 32 t in `x`. With NORM, MLX's
// rms_norm by `w` (float sum of squares, rsqrt(mean + eps), the normed
// value rounded to T and multiplied by the weight in T); then MLX's rope
// at `position` (float angle scale * position * inv_freq, float
// rotation): the first 2 * HALF features rotated in pairs (e, e + HALF),
// by the reciprocals of `freqs` (FREQS) or exp2(-e / HALF * log2(base)),
// the rest passed through. The caller rounds to T.
template <typename T, int D, int HALF, int NORM, int FREQS>
__device__ inline void norm_rope(const T* src, const T* w, const float* freqs, int position,
                                 int lane, float eps, float log2_base, float scale,
                                 float (&x)[D / 32]) {
  constexpr int PER = D / 32;
  constexpr int HP = HALF / 32;
  for (int t = 0; t < PER; t++) x[t] = static_cast<float>(src[lane + 32 * t]);
  if (NORM) {
    float ss = 0.f;
    for (int t = 0; t < PER; t++) ss += x[t] * x[t];
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffff, ss, off);
    const float nrm = rsqrt(ss / D + eps);
    for (int t = 0; t < PER; t++) {
      const T y = static_cast<T>(x[t] * nrm);
      x[t] = static_cast<float>(static_cast<T>(w[lane + 32 * t] * y));
    }
  }
  const float at = scale * static_cast<float>(position);
  for (int t = 0; t < HP; t++) {
    const int e = lane + 32 * t;
    float inv;
    if (FREQS) {
      inv = 1.0 / freqs[e];
    } else {
      const float dd = static_cast<float>(e) / static_cast<float>(HALF);
      inv = exp2(-dd * log2_base);
    }
    const float theta = at * inv;
    const float c = cos(theta);
    const float sn = sin(theta);
    const float x1 = x[t];
    const float x2 = x[t + HP];
    x[t] = x1 * c - x2 * sn;
    x[t + HP] = x1 * sn + x2 * c;
  }
}
