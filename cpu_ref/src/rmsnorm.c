/* rmsnorm.c — RMSNorm with or without gain (CONTRACT.md §6.3). The gain-free form is also the
 * per-head QK-norm (rows = B*T*heads, C = head dim). N = rows, C = channels.
 *
 *   ss = sum_c x_c*x_c (c ascending, from +0);  r = rsqrt(add(mul(ss, 1/C), eps))
 *   y_c = mul(mul(x_c, r), g_c)   (without gain: y_c = mul(x_c, r))
 */
#include <stdatomic.h>

#include "contract.h"
#include "runtime.h"
#include "vmath.h"

typedef struct {
    int64_t N, C; const float *x; const bf16 *g; float eps; float *y; float *rstd;
    const float *dy; float *dx;
    bf16 *y16; atomic_int failed;
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
    norm_args a = {N, C, x, g, o1b_load(eps), y, rstd, NULL, NULL, NULL, 0};
    o1b_parallel_for(N, 16, fwd_range, &a);
}

/* y as bf16 (§2's conversion of each stored y): a range's rows a few at a time into a scratch block
 * that stays in cache, converted from there (o1b_rows_to_bf16); 16 rows a group, since vmath.c
 * takes the rows' sums a vector of rows at a time. rstd is written as by the fp32 op. */
static void fwd_rows(const void *ctx, int64_t r0, int64_t r1, float *buf) {
    const norm_args *a = (const norm_args *)ctx;
    o1b_vrms_forward(0, r1 - r0, a->C, a->x + r0 * a->C, a->g, a->eps, inv_count(a->C), buf, a->rstd + r0);
}
static void fwd_range_bf16(void *ctx, int64_t lo, int64_t hi) {
    norm_args *a = (norm_args *)ctx;
    if (o1b_rows_to_bf16(lo, hi, a->C, 16, fwd_rows, a, a->y16) != 0) atomic_store(&a->failed, 1);
}
/* As o1b_rmsnorm_forward with y (N, C) bf16; 0, or -1 when out of memory. */
O1B_API int o1b_rmsnorm_forward_bf16(int64_t N, int64_t C, const float *x, const bf16 *g, float eps,
                                     bf16 *y, float *rstd) {
    norm_args a = {N, C, x, g, o1b_load(eps), NULL, rstd, NULL, NULL, y, 0};
    o1b_parallel_for(N, 16, fwd_range_bf16, &a);
    return atomic_load(&a.failed) ? -1 : 0;
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
    norm_args a = {N, C, x, g, 0.0f, NULL, (float *)rstd, dy, dx, NULL, 0};
    o1b_parallel_for(N, 16, bwd_range, &a);
    if (g && dg) {
        norm_args b = {N, C, x, g, 0.0f, dg, (float *)rstd, dy, NULL, NULL, 0};
        o1b_parallel_for(C, 16, dg_range, &b);
    }
}
