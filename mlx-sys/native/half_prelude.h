/* Bindgen prelude for targets without Arm half-precision scalars. mlx-c
 * declares the float16/bfloat16 accessors only where the compiler has those
 * types; mlx-rs uses them everywhere, so declare them with 16-bit storage
 * types (the real functions live in half_accessors.cpp). */
#include <stdint.h>
#define HAS_FLOAT16
#define HAS_BFLOAT16
typedef struct float16_t { uint16_t bits; } float16_t;
typedef uint16_t bfloat16_t;
