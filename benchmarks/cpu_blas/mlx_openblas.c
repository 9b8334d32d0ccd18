/* MLX's Linux CPU wheel (mlx-cpu) multiplies matrices through the reference BLAS it bundles:
 * a 300 x 1,536 x 8,960 float32 matmul runs at a few GFLOP/s on a 2-core machine, where numpy's
 * OpenBLAS runs it at 180. numpy's wheel carries that OpenBLAS under prefixed, 64-bit-integer
 * names (scipy_cblas_sgemm64_ ...), which libmlx.so cannot bind to, so this file gives it the
 * three names it asks for (cblas_sgemm, cblas_dgemm, cblas_cgemm: `nm -D libmlx.so | grep " U cblas"`)
 * and passes each call on, its 32-bit sizes widened. Loaded ahead of libmlx.so (LD_PRELOAD),
 * MLX's float32 matmuls run in OpenBLAS; built and checked by benchmarks/cpu_blas.sh. */
#include <stdint.h>

typedef int64_t blas_int;

void scipy_cblas_sgemm64_(int order, int trans_a, int trans_b, blas_int m, blas_int n, blas_int k, float alpha,
                          const float *a, blas_int lda, const float *b, blas_int ldb, float beta, float *c, blas_int ldc);
void scipy_cblas_dgemm64_(int order, int trans_a, int trans_b, blas_int m, blas_int n, blas_int k, double alpha,
                          const double *a, blas_int lda, const double *b, blas_int ldb, double beta, double *c, blas_int ldc);
void scipy_cblas_cgemm64_(int order, int trans_a, int trans_b, blas_int m, blas_int n, blas_int k, const void *alpha,
                          const void *a, blas_int lda, const void *b, blas_int ldb, const void *beta, void *c, blas_int ldc);

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  scipy_cblas_sgemm64_(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int trans_a, int trans_b, int m, int n, int k, double alpha, const double *a, int lda,
                 const double *b, int ldb, double beta, double *c, int ldc) {
  scipy_cblas_dgemm64_(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int trans_a, int trans_b, int m, int n, int k, const void *alpha, const void *a, int lda,
                 const void *b, int ldb, const void *beta, void *c, int ldc) {
  scipy_cblas_cgemm64_(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
