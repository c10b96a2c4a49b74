/* gemm.h — the contract GEMM entry points (linear.c) and the fast kernels (gemm_fast.c). */
#ifndef O1B_GEMM_H
#define O1B_GEMM_H
#include <stdint.h>
#include "contract.h"

/* C[i,j] (+)= sum_p A(i,p) B(p,j), p ascending; see linear.c. */
void o1b_gemm(int64_t I, int64_t J, int64_t P, const bf16 *A, int64_t sa_i, int64_t sa_p,
              const bf16 *B, int64_t sb_p, int64_t sb_j, float *C, int64_t ldc, int accumulate);
void o1b_gemm_simple(int64_t I, int64_t J, int64_t P, const bf16 *A, int64_t sa_i, int64_t sa_p,
                     const bf16 *B, int64_t sb_p, int64_t sb_j, float *C, int64_t ldc, int accumulate);
/* Returns 0 when it does not handle the case (then o1b_gemm uses the simple loop). */
int o1b_gemm_fast(int64_t I, int64_t J, int64_t P, const bf16 *A, int64_t sa_i, int64_t sa_p,
                  const bf16 *B, int64_t sb_p, int64_t sb_j, float *C, int64_t ldc, int accumulate);
#endif
