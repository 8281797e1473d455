// MLX's silu(g) * u as its compiled kernel computes it, each op in T:
// sigmoid(g) = g < 0 ? y : 1 - y with y = 1 / (1 + exp(|g|)), then
// g * sigmoid(g), then * u.
template <typename T>
__device__ T silu_mul(T g, T u) {
  const T one = static_cast<T>(1.0f);
  const T ag = static_cast<T>(fabsf(static_cast<float>(g)));
  const T e = static_cast<T>(expf(static_cast<float>(ag)));
  const T den = static_cast<T>(static_cast<float>(one) + static_cast<float>(e));
  const T y = static_cast<T>(static_cast<float>(one) / static_cast<float>(den));
  const T sg = static_cast<float>(g) < 0.f ? y : static_cast<T>(1.0f - static_cast<float>(y));
  const T act = static_cast<T>(static_cast<float>(g) * static_cast<float>(sg));
  return static_cast<T>(static_cast<float>(act) * static_cast<float>(u));
}
