/* random.c — Philox4x32-10 blocks and truncated-normal initialization (CONTRACT.md §5). */
#include "contract.h"
#include "runtime.h"

/* out[4i .. 4i+3] = Philox block at (seed, stream, index0 + i, sub). */
O1B_API void o1b_philox_fill(uint64_t seed, uint32_t stream, uint64_t index0, uint32_t sub,
                             int64_t nblocks, uint32_t *out) {
    for (int64_t i = 0; i < nblocks; i++) o1b_philox_block(seed, stream, index0 + (uint64_t)i, sub, out + 4 * i);
}

/* Element i: for attempt a = 0, 1, ..., 63 take the block (seed, stream, index0 + i, a); its
 * words make two Box-Muller pairs (w0, w1) and (w2, w3):
 *   u1 = mul(i2f((w >> 8) + 1), 2^-24) in (0, 1],  u2 = mul(i2f(w' >> 8), 2^-24) in [0, 1)
 *   rad = sqrt(mul(-2, log(u1))),  th = mul(2pi, u2),  z = mul(rad, cos(th)) then mul(rad, sin(th))
 * The first of z0, z1, z2, z3 (in that order) with |z| <= 2 gives mul(z, sigma). After 64
 * attempts (probability 0.0455^256) the value is +0. */
static float trunc_normal_one(uint64_t seed, uint32_t stream, uint64_t index, float sigma) {
    for (uint32_t a = 0; a < 64; a++) {
        uint32_t w[4];
        o1b_philox_block(seed, stream, index, a, w);
        for (int pair = 0; pair < 2; pair++) {
            float u1 = o1b_mul(o1b_i2f((int32_t)((w[2 * pair] >> 8) + 1)), 0x1p-24f);
            float u2 = o1b_mul(o1b_i2f((int32_t)(w[2 * pair + 1] >> 8)), 0x1p-24f);
            float rad = o1b_sqrt(o1b_mul(-2.0f, o1b_log(u1)));
            float th = o1b_mul(0x1.921fb6p2f, u2);
            float z = o1b_mul(rad, o1b_cos(th));
            if (fabsf(z) <= 2.0f) return o1b_mul(z, sigma);
            z = o1b_mul(rad, o1b_sin(th));
            if (fabsf(z) <= 2.0f) return o1b_mul(z, sigma);
        }
    }
    return 0.0f;
}

typedef struct { uint64_t seed; uint32_t stream; uint64_t index0; float sigma; float *out; } tn_args;
static void tn_range(void *ctx, int64_t lo, int64_t hi) {
    const tn_args *a = (const tn_args *)ctx;
    for (int64_t i = lo; i < hi; i++)
        a->out[i] = o1b_store(trunc_normal_one(a->seed, a->stream, a->index0 + (uint64_t)i, a->sigma));
}
O1B_API void o1b_trunc_normal(uint64_t seed, uint32_t stream, uint64_t index0, float sigma,
                              int64_t n, float *out) {
    tn_args a = {seed, stream, index0, o1b_load(sigma), out};
    o1b_parallel_for(n, 1024, tn_range, &a);
}
