/* reduce.cu — the canonical sum of squares, the binary-carry tree fold and the clipping
 * coefficient (CONTRACT.md §7). */
#include "contract.cuh"

#define NORM_BLOCK 4096   /* contract constant: elements per sequential block */

/* out[b] = sum from +0 over block b's elements ascending of mul(x, x); one thread per block. */
extern "C" __global__ void o1b_sumsq_blocks(i64 n, const float *x, float *out) {
    i64 b = o1b_gid(), nb = (n + NORM_BLOCK - 1) / NORM_BLOCK;
    if (b >= nb) return;
    i64 end = (b + 1) * NORM_BLOCK < n ? (b + 1) * NORM_BLOCK : n;
    float acc = 0.0f;
    for (i64 i = b * NORM_BLOCK; i < end; i++) { float v = o1b_load(x[i]); acc = o1b_add(acc, o1b_mul(v, v)); }
    out[b] = o1b_store(acc);
}

/* The binary-carry tree fold of v[0..n-1] into out[0]; one thread (the fold is a short sequential
 * stack walk over block partials). The lower-index operand is always on the left. */
extern "C" __global__ void o1b_treefold(i64 n, const float *v, float *out) {
    if (o1b_gid() != 0) return;
    float val[64]; int lvl[64]; int top = 0;
    for (i64 i = 0; i < n; i++) {
        float part = o1b_load(v[i]); int level = 0;
        while (top > 0 && lvl[top - 1] == level) { part = o1b_add(val[--top], part); level++; }
        val[top] = part; lvl[top++] = level;
    }
    float acc = 0.0f;
    if (top > 0) {
        acc = val[0];
        for (int s = 1; s < top; s++) acc = o1b_add(acc, val[s]);
    }
    out[0] = o1b_store(acc);
}

/* out[0] = div(max_norm, add(norm, 1e-6)); the caller scales the gradient only when it is < 1. */
extern "C" __global__ void o1b_clip_coef(float norm, float max_norm, float *out) {
    if (o1b_gid() != 0) return;
    out[0] = o1b_store(o1b_div(o1b_load(max_norm), o1b_add(o1b_load(norm), 0x1.0c6f7ap-20f)));
}
