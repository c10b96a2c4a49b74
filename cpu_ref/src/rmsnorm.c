/* rmsnorm.c — RMSNorm with or without gain (CONTRACT.md §6.3). The gain-free form is also the
 * per-head QK-norm (rows = B*T*heads, C = head dim). N = rows, C = channels.
 *
 *   ss = sum_c x_c*x_c (c ascending, from +0);  r = rsqrt(add(mul(ss, 1/C), eps))
 *   y_c = mul(mul(x_c, r), g_c)   (without gain: y_c = mul(x_c, r))
 */
#include "contract.h"
#include "runtime.h"
#include "vmath.h"

typedef struct {
    int64_t N, C; const float *x; const bf16 *g; float eps; float *y; float *rstd;
    const float *dy; float *dx;
} norm_args;

static float inv_count(int64_t C) { return o1b_div(1.0f, o1b_i2f((int32_t)C)); }

/* Rows on threads; within a range, vmath.c takes them a vector of rows at a time (the sums and
 * row scalars on SIMD lanes, each row's sum in c order). */
static void fwd_range(void *ctx, int64_t lo, int64_t hi) {
    const norm_args *a = (const norm_args *)ctx;
    o1b_vrms_forward(lo, hi, a->C, a->x, a->g, a->eps, inv_count(a->C), a->y, a->rstd);
}
O1B_API void o1b_rmsnorm_forward(int64_t N, int64_t C,
                                 const float *x,  /* (N, C) */
                                 const bf16 *g,   /* (C,) gain, or NULL */
                                 float eps,
                                 float *y,        /* (N, C) */
                                 float *rstd) {   /* (N,)  r, kept for the backward */
    norm_args a = {N, C, x, g, o1b_load(eps), y, rstd, NULL, NULL};
    o1b_parallel_for(N, 16, fwd_range, &a);
}

/* dx_j = sub(mul(t_j, r), mul(x_j, b)),  t_j = mul(dy_j, g_j) (or dy_j),
 * b = mul(mul(dot, mul(mul(r, r), r)), 1/C),  dot = sum_c mul(t_c, x_c) (c ascending). */
static void bwd_range(void *ctx, int64_t lo, int64_t hi) {
    const norm_args *a = (const norm_args *)ctx;
    o1b_vrms_backward(lo, hi, a->C, a->dy, a->x, a->g, a->rstd, inv_count(a->C), a->dx);
}
/* dg_c = sum over rows n ascending of mul(dy[n,c], mul(x[n,c], r_n)) — a column sum, so threads
 * split the columns and each walks the rows in order, its columns on SIMD lanes (the accumulators
 * of a block of columns stay in registers over every row). */
static void dg_range(void *ctx, int64_t lo, int64_t hi) {
    const norm_args *a = (const norm_args *)ctx;
    o1b_vrms_dg(lo, hi, a->N, a->C, a->dy, a->x, a->rstd, a->y /* reused slot: the dg output */);
}
O1B_API void o1b_rmsnorm_backward(int64_t N, int64_t C,
                                  const float *dy,   /* (N, C) */
                                  const float *x,    /* (N, C) */
                                  const bf16 *g,     /* (C,) or NULL */
                                  const float *rstd, /* (N,) */
                                  float *dx,         /* (N, C) */
                                  float *dg) {       /* (C,) or NULL (only with a gain) */
    norm_args a = {N, C, x, g, 0.0f, NULL, (float *)rstd, dy, dx};
    o1b_parallel_for(N, 16, bwd_range, &a);
    if (g && dg) {
        norm_args b = {N, C, x, g, 0.0f, dg, (float *)rstd, dy, NULL};
        o1b_parallel_for(C, 16, dg_range, &b);
    }
}
