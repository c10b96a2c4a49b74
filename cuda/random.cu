/* random.cu — Philox4x32-10 blocks and the truncated-normal initializer (CONTRACT.md §5). */
#include "contract.cuh"

/* out[4i .. 4i+3] = the block at (seed, stream, index0 + i, sub); one thread per block. */
extern "C" __global__ void o1b_philox_fill(u64 seed, u32 stream, u64 index0, u32 sub, i64 nblocks, u32 *out) {
    i64 i = o1b_gid();
    if (i >= nblocks) return;
    u32 w[4];
    o1b_philox_block(seed, stream, index0 + (u64)i, sub, w);
    for (int k = 0; k < 4; k++) out[4 * i + k] = w[k];
}

/* Element i: attempts a = 0..63 of the block (seed, stream, index0 + i, a), Box-Muller pairs
 * (w0, w1) then (w2, w3), cos candidate then sin candidate; the first |z| <= 2 gives mul(z, sigma);
 * +0 if all 256 fail. One thread per element. */
__device__ float o1b_trunc_normal_one(u64 seed, u32 stream, u64 index, float sigma) {
    for (u32 a = 0; a < 64; a++) {
        u32 w[4];
        o1b_philox_block(seed, stream, index, a, w);
        for (int pair = 0; pair < 2; pair++) {
            float u1 = o1b_mul(o1b_i2f((int)((w[2 * pair] >> 8) + 1)), 0x1p-24f);
            float u2 = o1b_mul(o1b_i2f((int)(w[2 * pair + 1] >> 8)), 0x1p-24f);
            float rad = o1b_sqrt(o1b_mul(-2.0f, o1b_log(u1)));
            float th = o1b_mul(0x1.921fb6p2f, u2);
            float z = o1b_mul(rad, o1b_cos(th));
            if (o1b_abs_bits(z) <= 0x40000000u) return o1b_mul(z, sigma);   /* |z| <= 2 */
            z = o1b_mul(rad, o1b_sin(th));
            if (o1b_abs_bits(z) <= 0x40000000u) return o1b_mul(z, sigma);
        }
    }
    return 0.0f;
}

extern "C" __global__ void o1b_trunc_normal(u64 seed, u32 stream, u64 index0, float sigma, i64 n, float *out) {
    i64 i = o1b_gid();
    if (i >= n) return;
    out[i] = o1b_store(o1b_trunc_normal_one(seed, stream, index0 + (u64)i, o1b_load(sigma)));
}
