// float16/bfloat16 accessors that mlx-c compiles only on Arm. MLX defines its
// own 16-bit float16_t/bfloat16_t on every platform; these wrap them with the
// same C signatures the bindings declare (16-bit storage, returned by value).
#include <cstdint>
#include <cstring>
#include <exception>

#include "mlx/c/array.h"
#include "mlx/c/error.h"
#include "mlx/c/private/array.h"

namespace {
template <typename T>
int item_bits(uint16_t* res, const mlx_array arr) {
  try {
    T value = mlx_array_get_(arr).item<T>();
    std::memcpy(res, &value, sizeof(uint16_t));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

template <typename T>
const uint16_t* data_bits(const mlx_array arr) {
  try {
    return reinterpret_cast<const uint16_t*>(mlx_array_get_(arr).data<T>());
  } catch (std::exception& e) {
    mlx_error(e.what());
    return nullptr;
  }
}
}  // namespace

extern "C" int mlx_array_item_float16(uint16_t* res, const mlx_array arr) {
  return item_bits<mlx::core::float16_t>(res, arr);
}
extern "C" int mlx_array_item_bfloat16(uint16_t* res, const mlx_array arr) {
  return item_bits<mlx::core::bfloat16_t>(res, arr);
}
extern "C" const uint16_t* mlx_array_data_float16(const mlx_array arr) {
  return data_bits<mlx::core::float16_t>(arr);
}
extern "C" const uint16_t* mlx_array_data_bfloat16(const mlx_array arr) {
  return data_bits<mlx::core::bfloat16_t>(arr);
}
