/* rmsnorm.cu — RMSNorm with or without gain, and QK-norm (CONTRACT.md §6.3). N = rows, C = channels.
 *   ss = sum_c mul(x_c, x_c) (c ascending, from +0);  r = rsqrt(add(mul(ss, 1/C), eps))
 *   y_c = mul(mul(x_c, r), g_c)   (without gain: mul(x_c, r))
 * One thread per row (forward, dx) or per column (dg); every sum runs in the written order. */
#include "contract.cuh"

__device__ __forceinline__ float inv_count(i64 C) { return o1b_div(1.0f, o1b_i2f((int)C)); }

extern "C" __global__ void o1b_rmsnorm_forward(i64 N, i64 C, const float *x, const bf16 *g, int has_g,
                                               float eps, float *y, float *rstd) {
    i64 n = o1b_gid();
    if (n >= N) return;
    const float invC = inv_count(C), e = o1b_load(eps);
    const float *xr = x + n * C;
    float ss = 0.0f;
    for (i64 c = 0; c < C; c++) { float v = o1b_load(xr[c]); ss = o1b_add(ss, o1b_mul(v, v)); }
    float r = o1b_rsqrt(o1b_add(o1b_mul(ss, invC), e));
    rstd[n] = o1b_store(r);
    for (i64 c = 0; c < C; c++) {
        float v = o1b_mul(o1b_load(xr[c]), r);
        if (has_g) v = o1b_mul(v, o1b_bf16_to_f32(g[c]));
        y[n * C + c] = o1b_store(v);
    }
}

/* dx_c = sub(mul(t_c, r), mul(x_c, b)),  t_c = mul(dy_c, g_c) (or dy_c),
 * b = mul(mul(dot, mul(mul(r, r), r)), 1/C),  dot = sum_c mul(t_c, x_c) (c ascending). */
extern "C" __global__ void o1b_rmsnorm_backward_dx(i64 N, i64 C, const float *dy, const float *x,
                                                   const bf16 *g, int has_g, const float *rstd, float *dx) {
    i64 n = o1b_gid();
    if (n >= N) return;
    const float invC = inv_count(C);
    const float *xr = x + n * C, *dyr = dy + n * C;
    float r = o1b_load(rstd[n]), dot = 0.0f;
    for (i64 c = 0; c < C; c++) {
        float t = o1b_load(dyr[c]);
        if (has_g) t = o1b_mul(t, o1b_bf16_to_f32(g[c]));
        dot = o1b_add(dot, o1b_mul(t, o1b_load(xr[c])));
    }
    float b = o1b_mul(o1b_mul(dot, o1b_mul(o1b_mul(r, r), r)), invC);
    for (i64 c = 0; c < C; c++) {
        float t = o1b_load(dyr[c]);
        if (has_g) t = o1b_mul(t, o1b_bf16_to_f32(g[c]));
        dx[n * C + c] = o1b_store(o1b_sub(o1b_mul(t, r), o1b_mul(o1b_load(xr[c]), b)));
    }
}

/* dg_c = sum over rows n ascending of mul(dy[n,c], mul(x[n,c], r_n)): one thread per column. */
extern "C" __global__ void o1b_rmsnorm_backward_dg(i64 N, i64 C, const float *dy, const float *x,
                                                   const float *rstd, float *dg) {
    i64 c = o1b_gid();
    if (c >= C) return;
    float acc = 0.0f;
    for (i64 n = 0; n < N; n++) {
        float xr = o1b_mul(o1b_load(x[n * C + c]), o1b_load(rstd[n]));
        acc = o1b_add(acc, o1b_mul(o1b_load(dy[n * C + c]), xr));
    }
    dg[c] = o1b_store(acc);
}
