// MLX's CPU backend calls cblas_sgemm for every float32 product, one-row
// products (a decode step's x @ W^T) included. OpenBLAS 0.3.21 (Debian 12)
// packs the whole weight matrix into its blocked layout on each such call, so
// a decode step reads and writes every weight twice; its sgemv reads them
// once (measured on the default model's shapes: ~1.6x faster). Newer OpenBLAS
// can forward such calls itself (GEMM_GEMV_FORWARD); this does the same for
// the OpenBLAS the runtime links. The executable defines cblas_sgemm, so the
// dynamic linker binds libmlx's calls here first; everything but a product
// with one row or one column goes on to OpenBLAS unchanged.
#include <stdatomic.h>
#include <stddef.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

// OpenBLAS's own entry points (not interposed: we define neither).
void cblas_sgemv(int order, int trans, int m, int n, float alpha, const float *a, int lda,
                 const float *x, int incx, float beta, float *y, int incy);
void sgemm_(const char *transa, const char *transb, const int *m, const int *n, const int *k,
            const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
            const float *beta, float *c, const int *ldc);

static atomic_ulong forwarded;

// Products of fewer elements than this run on the calling thread.
// OpenBLAS's sgemv splits anything past 9,216 over its threads: a decode
// step's attention (q @ K^T and p @ V per head, 64 x context each) then
// pays a wake-up and a join per product, ~500 a step, and leaves the
// worker spinning on sched_yield.
enum { SMALL = 1 << 16 };

// Four lanes: the x86-64 baseline (SSE) and NEON, no target flags needed.
typedef float v4 __attribute__((vector_size(16)));

static inline v4 load4(const float *p) {
  v4 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline void store4(float *p, v4 v) { __builtin_memcpy(p, &v, sizeof v); }

// y = alpha * op(M) v + y (y already scaled by beta), as `gemv` below.
static void small_gemv(int trans, int rows, int cols, float alpha, const float *m, int ldm,
                       const float *v, int incv, float *y, int incy) {
  if (trans == NO_TRANS) {
    // y_i += alpha * dot(M[i, :], v)
    for (int i = 0; i < rows; i++) {
      const float *r = m + (size_t)i * ldm;
      float s = 0.0f;
      int j = 0;
      if (incv == 1) {
        v4 a0 = {0}, a1 = {0};
        for (; j + 8 <= cols; j += 8) {
          a0 += load4(r + j) * load4(v + j);
          a1 += load4(r + j + 4) * load4(v + j + 4);
        }
        a0 += a1;
        s = (a0[0] + a0[1]) + (a0[2] + a0[3]);
      }
      for (; j < cols; j++) s += r[j] * v[(size_t)j * incv];
      y[(size_t)i * incy] += alpha * s;
    }
  } else {
    // M is cols x rows: y += alpha * sum_j v_j M[j, :]
    for (int j = 0; j < cols; j++) {
      const float *r = m + (size_t)j * ldm;
      const float a = alpha * v[(size_t)j * incv];
      int i = 0;
      if (incy == 1) {
        const v4 av = {a, a, a, a};
        for (; i + 4 <= rows; i += 4) store4(y + i, load4(y + i) + av * load4(r + i));
      }
      for (; i < rows; i++) y[(size_t)i * incy] += a * r[i];
    }
  }
}

// How many products went to sgemv (tests read it).
unsigned long mlx_sys_sgemv_forwarded(void) {
  return atomic_load_explicit(&forwarded, memory_order_relaxed);
}

// y = alpha * op(M) v + beta * y, where op(M) is rows x cols after `trans`.
static void gemv(int trans, int rows, int cols, float alpha, const float *m, int ldm,
                 const float *v, int incv, float beta, float *y, int incy) {
  if (beta == 0.0f) {
    // BLAS lets y be uninitialised when beta is 0; MLX's fresh outputs are.
    // Zero it so no scaling of a stale NaN can leak through.
    for (int i = 0; i < rows; i++) y[(size_t)i * incy] = 0.0f;
  }
  // Row-major storage: op(M) = M when trans is NoTrans (M is rows x cols),
  // else M is cols x rows.
  if ((long)rows * cols < SMALL) {
    if (beta != 0.0f && beta != 1.0f)
      for (int i = 0; i < rows; i++) y[(size_t)i * incy] *= beta;
    small_gemv(trans, rows, cols, alpha, m, ldm, v, incv, y, incy);
  } else if (trans == NO_TRANS)
    cblas_sgemv(ROW_MAJOR, NO_TRANS, rows, cols, alpha, m, ldm, v, incv, beta, y, incy);
  else
    cblas_sgemv(ROW_MAJOR, trans, cols, rows, alpha, m, ldm, v, incv, beta, y, incy);
  atomic_fetch_add_explicit(&forwarded, 1, memory_order_relaxed);
}

void cblas_sgemm(int order, int transa, int transb, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  if (order == ROW_MAJOR && k > 0) {
    if (m == 1) {
      // C (1 x n) = op(A) (1 x k) * op(B) (k x n): c = op(B)^T a.
      int inca = transa == NO_TRANS ? 1 : lda;
      gemv(transb == NO_TRANS ? TRANS : NO_TRANS, n, k, alpha, b, ldb, a, inca, beta, c, 1);
      return;
    }
    if (n == 1) {
      // C (m x 1) = op(A) (m x k) * op(B) (k x 1): c = op(A) b.
      int incb = transb == NO_TRANS ? ldb : 1;
      gemv(transa, m, k, alpha, a, lda, b, incb, beta, c, ldc);
      return;
    }
  }
  // Everything else: OpenBLAS's sgemm through its column-major interface
  // (row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T).
  const char ta = transa == NO_TRANS ? 'N' : 'T';
  const char tb = transb == NO_TRANS ? 'N' : 'T';
  if (order == ROW_MAJOR)
    sgemm_(&tb, &ta, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  else
    sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
