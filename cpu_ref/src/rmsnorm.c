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

/* Rows per step: the rows' sums (sum of squares, the backward's dot) run with rows on SIMD
 * lanes (vmath.c), each in c order. */
#define ROWS 64

static void fwd_range(void *ctx, int64_t lo, int64_t hi) {
    const norm_args *a = (const norm_args *)ctx;
    const float invC = inv_count(a->C);
    float sums[ROWS];
    for (int64_t n = lo; n < hi; n++) {
        const float *x = a->x + n * a->C;
        if ((n - lo) % ROWS == 0) {
            int64_t m = hi - n < ROWS ? hi - n : ROWS;
            o1b_vrow_dots(m, a->C, x, x, NULL, sums);   /* ss = sum_c mul(x_c, x_c) */
        }
        float ss = sums[(n - lo) % ROWS];
        float r = o1b_rsqrt(o1b_add(o1b_mul(ss, invC), a->eps));
        a->rstd[n] = o1b_store(r);
        o1b_vrms_scale(a->C, x, r, a->g, a->y + n * a->C);
    }
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
    const float invC = inv_count(a->C);
    float dots[ROWS];
    for (int64_t n = lo; n < hi; n++) {
        const float *x = a->x + n * a->C, *dy = a->dy + n * a->C;
        if ((n - lo) % ROWS == 0) {
            int64_t m = hi - n < ROWS ? hi - n : ROWS;
            o1b_vrow_dots(m, a->C, dy, x, a->g, dots);
        }
        float r = o1b_load(a->rstd[n]), dot = dots[(n - lo) % ROWS];
        float b = o1b_mul(o1b_mul(dot, o1b_mul(o1b_mul(r, r), r)), invC);
        o1b_vrms_dx(a->C, dy, x, a->g, r, b, a->dx + n * a->C);
    }
}
/* dg_c = sum over rows n ascending of mul(dy[n,c], mul(x[n,c], r_n)) — a column sum, so threads
 * split the columns and each walks the rows in order, its columns on SIMD lanes (the unstored
 * accumulators live in dg until the last row). */
static void dg_range(void *ctx, int64_t lo, int64_t hi) {
    const norm_args *a = (const norm_args *)ctx;
    float *dg = a->y;   /* reused slot: the dg output */
    for (int64_t c = lo; c < hi; c++) dg[c] = 0.0f;
    for (int64_t n = 0; n < a->N; n++)
        o1b_vrms_dg_row(hi - lo, a->dy + n * a->C + lo, a->x + n * a->C + lo, o1b_load(a->rstd[n]),
                        dg + lo);
    for (int64_t c = lo; c < hi; c++) dg[c] = o1b_store(dg[c]);
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
