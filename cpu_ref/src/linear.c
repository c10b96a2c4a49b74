/* linear.c — the contract GEMM with bf16 operands and fp32 accumulation (CONTRACT.md §6.1),
 * and the linear layer built on it.
 *
 *   C[i,j] (+)= sum_{p=0..P-1} A(i,p) * B(p,j)     p ascending, one rounding per add,
 *   the accumulator starting at +0 (or at the old C[i,j] when accumulating).
 *
 * A(i,p) = A[i*sa_i + p*sa_p] and B(p,j) = B[p*sb_p + j*sb_j] are bf16, so one kernel serves
 * y = x W^T, dx = dy W and dW = dy^T x. Threads split the rows i; the sum over p is never split,
 * so the bits do not depend on the thread count or on any tile size.
 */
#include "contract.h"
#include "gemm.h"
#include "runtime.h"

typedef struct {
    int64_t I, J, P;
    const bf16 *A; int64_t sa_i, sa_p;
    const bf16 *B; int64_t sb_p, sb_j;
    float *C; int64_t ldc; int accumulate;
} gemm_args;

/* The straightforward loop: the definition, kept beside the fast kernels and tested against them. */
static void gemm_rows_simple(void *ctx, int64_t lo, int64_t hi) {
    const gemm_args *g = (const gemm_args *)ctx;
    for (int64_t i = lo; i < hi; i++)
        for (int64_t j = 0; j < g->J; j++) {
            float acc = g->accumulate ? o1b_load(g->C[i * g->ldc + j]) : 0.0f;
            for (int64_t p = 0; p < g->P; p++) {
                float a = o1b_bf16_to_f32(g->A[i * g->sa_i + p * g->sa_p]);
                float b = o1b_bf16_to_f32(g->B[p * g->sb_p + j * g->sb_j]);
                acc = o1b_add(acc, o1b_mul(a, b));
            }
            g->C[i * g->ldc + j] = o1b_store(acc);
        }
}

void o1b_gemm_simple(int64_t I, int64_t J, int64_t P, const bf16 *A, int64_t sa_i, int64_t sa_p,
                     const bf16 *B, int64_t sb_p, int64_t sb_j, float *C, int64_t ldc, int accumulate) {
    gemm_args g = {I, J, P, A, sa_i, sa_p, B, sb_p, sb_j, C, ldc, accumulate};
    int64_t per_row = J * (P > 0 ? P : 1);
    o1b_parallel_for(I, 1 + (1 << 16) / (per_row > 0 ? per_row : 1), gemm_rows_simple, &g);
}

static int g_gemm_impl = 1;   /* 1: fast (packed, SIMD), 0: the straightforward loop */
O1B_API void o1b_set_gemm_impl(int fast) { __atomic_store_n(&g_gemm_impl, fast, __ATOMIC_RELAXED); }

void o1b_gemm(int64_t I, int64_t J, int64_t P, const bf16 *A, int64_t sa_i, int64_t sa_p,
              const bf16 *B, int64_t sb_p, int64_t sb_j, float *C, int64_t ldc, int accumulate) {
    if (__atomic_load_n(&g_gemm_impl, __ATOMIC_RELAXED) && o1b_gemm_fast(I, J, P, A, sa_i, sa_p, B, sb_p, sb_j, C, ldc, accumulate)) return;
    o1b_gemm_simple(I, J, P, A, sa_i, sa_p, B, sb_p, sb_j, C, ldc, accumulate);
}

/* N = rows (tokens), K = in features, M = out features. */
O1B_API void o1b_linear_forward(int64_t N, int64_t K, int64_t M,
                                const bf16 *x,   /* (N, K) */
                                const bf16 *w,   /* (M, K) */
                                float *y) {      /* (N, M)  y = x W^T */
    o1b_gemm(N, M, K, x, K, 1, w, 1, K, y, M, 0);
}

O1B_API void o1b_linear_backward(int64_t N, int64_t K, int64_t M,
                                 const bf16 *dy,  /* (N, M) */
                                 const bf16 *x,   /* (N, K) */
                                 const bf16 *w,   /* (M, K) */
                                 float *dx,       /* (N, K)  dx = dy W, sum over m ascending; may be NULL */
                                 float *dw) {     /* (M, K)  dW = dy^T x, sum over n ascending; may be NULL */
    if (dx) o1b_gemm(N, K, M, dy, M, 1, w, K, 1, dx, K, 0);
    if (dw) o1b_gemm(M, K, N, dy, 1, M, x, K, 1, dw, K, 0);
}
