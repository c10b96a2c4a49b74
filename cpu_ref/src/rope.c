/* rope.c — rotary position embedding, rotate-half pairing (i, i + D/2) (CONTRACT.md §6.4).
 * T = positions, D = head dim (even), Dh = D/2. Tables from the contract's exp/log/sin/cos:
 *   inv_freq_i = exp(neg(mul(mul(i2f(2i), 1/D), log(theta))))
 *   angle_ti = mul(i2f(t), inv_freq_i);  cos_ti = cos(angle), sin_ti = sin(angle)
 */
#include "contract.h"
#include "runtime.h"
#include "vmath.h"

O1B_API void o1b_rope_tables(int64_t T, int64_t D, float theta,
                             float *cos_t,   /* (T, D/2) */
                             float *sin_t) { /* (T, D/2) */
    const int64_t Dh = D / 2;
    const float invD = o1b_div(1.0f, o1b_i2f((int32_t)D)), lt = o1b_log(o1b_load(theta));
    for (int64_t i = 0; i < Dh; i++) {
        float f = o1b_exp(o1b_neg(o1b_mul(o1b_mul(o1b_i2f((int32_t)(2 * i)), invD), lt)));
        for (int64_t t = 0; t < T; t++) {
            float ang = o1b_mul(o1b_i2f((int32_t)t), f);
            cos_t[t * Dh + i] = o1b_store(o1b_cos(ang));
            sin_t[t * Dh + i] = o1b_store(o1b_sin(ang));
        }
    }
}

typedef struct { int64_t T, R, D; const float *x, *cs, *sn; float *y; int backward; } rope_args;

/* Rows are (b, t, head) of x (B, T, R, D); row index -> t = (row / R) % T. Each output
 *   forward:  y1 = x1 c - x2 s,  y2 = x2 c + x1 s;  backward (the transpose): dx1 = dy1 c + dy2 s,
 *   dx2 = dy2 c - dy1 s  (x1 = x[i], x2 = x[i + D/2]) is vmath.c's rope_rows, i on SIMD lanes. */
static void rope_range(void *ctx, int64_t lo, int64_t hi) {
    const rope_args *a = (const rope_args *)ctx;
    o1b_vrope_rows(lo, hi, a->T, a->R, a->D, a->x, a->cs, a->sn, a->y, a->backward);
}
O1B_API void o1b_rope(int64_t B, int64_t T, int64_t R, int64_t D,
                      const float *x,     /* (B, T, R, D)  R = heads; dy in the backward */
                      const float *cos_t, /* (T, D/2) */
                      const float *sin_t, /* (T, D/2) */
                      float *y,           /* (B, T, R, D)  dx in the backward */
                      int backward) {
    rope_args a = {T, R, D, x, cos_t, sin_t, y, backward};
    o1b_parallel_for(B * T * R, 64, rope_range, &a);
}
