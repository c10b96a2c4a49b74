/* rope.cu — rotary position embedding, rotate-half pairing (i, i + D/2) (CONTRACT.md §6.4).
 * T = positions, D = head dim (even), Dh = D/2. */
#include "contract.cuh"

/* cos[t, i], sin[t, i] for t < T, i < Dh; one thread per (t, i):
 *   f_i = exp(neg(mul(mul(i2f(2i), 1/D), log(theta)))),  a = mul(i2f(t), f_i). */
extern "C" __global__ void o1b_rope_tables(i64 T, i64 D, float theta, float *cos_t, float *sin_t) {
    const i64 Dh = D / 2;
    i64 e = o1b_gid();
    if (e >= T * Dh) return;
    i64 t = e / Dh, i = e % Dh;
    const float invD = o1b_div(1.0f, o1b_i2f((int)D)), lt = o1b_log(o1b_load(theta));
    float f = o1b_exp(o1b_neg(o1b_mul(o1b_mul(o1b_i2f((int)(2 * i)), invD), lt)));
    float ang = o1b_mul(o1b_i2f((int)t), f);
    cos_t[e] = o1b_store(o1b_cos(ang));
    sin_t[e] = o1b_store(o1b_sin(ang));
}

/* x (B, T, R, D), R heads; one thread per (row, i), row = (b, t, head), t = (row / R) % T.
 * forward:  y1 = x1 c - x2 s,  y2 = x2 c + x1 s;  backward (the transpose): dx1 = dy1 c + dy2 s,
 * dx2 = dy2 c - dy1 s. */
extern "C" __global__ void o1b_rope(i64 rows, i64 T, i64 R, i64 D, const float *x, const float *cos_t,
                                    const float *sin_t, float *y, int backward) {
    const i64 Dh = D / 2;
    i64 e = o1b_gid();
    if (e >= rows * Dh) return;
    i64 row = e / Dh, i = e % Dh, t = (row / R) % T;
    const float *xr = x + row * D;
    float *yr = y + row * D;
    float x1 = o1b_load(xr[i]), x2 = o1b_load(xr[i + Dh]);
    float c = o1b_load(cos_t[t * Dh + i]), s = o1b_load(sin_t[t * Dh + i]);
    if (!backward) {
        yr[i] = o1b_store(o1b_sub(o1b_mul(x1, c), o1b_mul(x2, s)));
        yr[i + Dh] = o1b_store(o1b_add(o1b_mul(x2, c), o1b_mul(x1, s)));
    } else {
        yr[i] = o1b_store(o1b_add(o1b_mul(x1, c), o1b_mul(x2, s)));
        yr[i + Dh] = o1b_store(o1b_sub(o1b_mul(x2, c), o1b_mul(x1, s)));
    }
}
