/* reduce.c — the canonical sum of squares, the binary-carry tree fold, and clipping
 * (CONTRACT.md §7).
 * A tensor's sum of squares is cut into blocks of NORM_BLOCK consecutive elements; each block
 * is summed sequentially from +0; the block partials (of all tensors, in canonical tensor
 * order) are combined by the tree fold. Blocks make the sum parallel and accurate; the fold's
 * pairing is fixed by block index alone. */
#include "contract.h"
#include "runtime.h"
#include "vmath.h"

#define O1B_NORM_BLOCK 4096

typedef struct { int64_t n; const float *x; float *out; } ss_args;

/* Whole blocks on SIMD lanes, each summed in order (vmath.c). */
static void ss_range(void *ctx, int64_t lo, int64_t hi) {
    const ss_args *a = (const ss_args *)ctx;
    o1b_vsumsq_blocks(lo, hi, a->n, O1B_NORM_BLOCK, a->x, a->out);
}
O1B_API int64_t o1b_norm_block(void) { return O1B_NORM_BLOCK; }
/* out[b] = sum of squares of block b; out has ceil(n / NORM_BLOCK) entries. */
O1B_API void o1b_sumsq_blocks(int64_t n, const float *x, float *out) {
    ss_args a = {n, x, out};
    o1b_parallel_for((n + O1B_NORM_BLOCK - 1) / O1B_NORM_BLOCK, 16, ss_range, &a);
}

/* The binary-carry tree fold (paper App. A, Algorithm 2) of v[0..n-1]: push each value; while
 * the top of the stack holds a block of the same level, pop it and add it on the LEFT; at the
 * end combine the leftover blocks from the bottom of the stack (largest, lowest indices)
 * upwards, the accumulated lower-index part always on the left. n = 0 gives +0. */
O1B_API float o1b_treefold(int64_t n, const float *v) {
    float val[64]; int lvl[64]; int top = 0;
    for (int64_t i = 0; i < n; i++) {
        float part = o1b_load(v[i]); int level = 0;
        while (top > 0 && lvl[top - 1] == level) { part = o1b_add(val[--top], part); level++; }
        val[top] = part; lvl[top++] = level;
    }
    if (top == 0) return 0.0f;
    float acc = val[0];
    for (int s = 1; s < top; s++) acc = o1b_add(acc, val[s]);
    return o1b_store(acc);
}

/* Global-norm clipping coefficient: c = div(max_norm, add(norm, 1e-6)); the caller scales the
 * gradient by c only when c < 1 (a NaN norm gives a NaN c, which the caller treats as a skip). */
O1B_API float o1b_clip_coef(float norm, float max_norm) {
    return o1b_store(o1b_div(o1b_load(max_norm), o1b_add(o1b_load(norm), 0x1.0c6f7ap-20f)));
}
O1B_API float o1b_scalar_sqrt(float x) { return o1b_store(o1b_sqrt(o1b_load(x))); }
