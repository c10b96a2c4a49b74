/* swiglu.c — SwiGLU on the fused gate+up projection (CONTRACT.md §6.5). N = rows, F = hidden.
 *   h = [gate | up] (N, 2F);  out = mul(silu(gate), up),  silu(g) = mul(g, sigmoid(g))
 * Backward, with s = sigmoid(g):
 *   dup   = mul(dout, silu(g))
 *   dgate = mul(mul(dout, up), mul(s, add(1, mul(g, sub(1, s)))))
 * Each row's elements are computed on SIMD lanes (vmath.c), which gives contract.h's bits.
 *
 * The _bf16 forms deliver the output as bf16 (§2's conversion of each stored fp32 output, the
 * bits of f32_to_bf16 of the fp32 op's output): each range computes its rows a few at a time into
 * a scratch block that stays in cache and converts them from there (o1b_rows_to_bf16), so the fp32
 * output never goes to memory and back.
 */
#include <stdatomic.h>

#include "contract.h"
#include "runtime.h"
#include "vmath.h"

typedef struct { int64_t F; const float *h, *dout; float *out, *dh; bf16 *out16; atomic_int failed; } swiglu_args;

/* rows r0 .. r1-1 of the fp32 output into buf (o1b_rows_to_bf16 converts them) */
static void fwd_rows(const void *ctx, int64_t r0, int64_t r1, float *buf) {
    const swiglu_args *a = (const swiglu_args *)ctx;
    o1b_vswiglu_fwd_rows(0, r1 - r0, a->F, a->h + r0 * 2 * a->F, buf);
}
static void bwd_rows(const void *ctx, int64_t r0, int64_t r1, float *buf) {
    const swiglu_args *a = (const swiglu_args *)ctx;
    o1b_vswiglu_bwd_rows(0, r1 - r0, a->F, a->dout + r0 * a->F, a->h + r0 * 2 * a->F, buf);
}
static void fwd_range_bf16(void *ctx, int64_t lo, int64_t hi) {
    swiglu_args *a = (swiglu_args *)ctx;
    if (o1b_rows_to_bf16(lo, hi, a->F, 1, fwd_rows, a, a->out16) != 0) atomic_store(&a->failed, 1);
}
static void bwd_range_bf16(void *ctx, int64_t lo, int64_t hi) {
    swiglu_args *a = (swiglu_args *)ctx;
    if (o1b_rows_to_bf16(lo, hi, 2 * a->F, 1, bwd_rows, a, a->out16) != 0) atomic_store(&a->failed, 1);
}

static void fwd_range(void *ctx, int64_t lo, int64_t hi) {
    const swiglu_args *a = (const swiglu_args *)ctx;
    o1b_vswiglu_fwd_rows(lo, hi, a->F, a->h, a->out);
}
static void bwd_range(void *ctx, int64_t lo, int64_t hi) {
    const swiglu_args *a = (const swiglu_args *)ctx;
    o1b_vswiglu_bwd_rows(lo, hi, a->F, a->dout, a->h, a->dh);
}
O1B_API void o1b_swiglu_forward(int64_t N, int64_t F, const float *h /* (N, 2F) */, float *out /* (N, F) */) {
    swiglu_args a = {F, h, NULL, out, NULL, NULL, 0};
    o1b_parallel_for(N, 8, fwd_range, &a);
}
O1B_API void o1b_swiglu_backward(int64_t N, int64_t F, const float *dout /* (N, F) */,
                                 const float *h /* (N, 2F) */, float *dh /* (N, 2F) */) {
    swiglu_args a = {F, h, dout, NULL, dh, NULL, 0};
    o1b_parallel_for(N, 8, bwd_range, &a);
}
/* As above with bf16 outputs; 0, or -1 when out of memory. */
O1B_API int o1b_swiglu_forward_bf16(int64_t N, int64_t F, const float *h /* (N, 2F) */, bf16 *out /* (N, F) */) {
    swiglu_args a = {F, h, NULL, NULL, NULL, out, 0};
    o1b_parallel_for(N, 8, fwd_range_bf16, &a);
    return atomic_load(&a.failed) ? -1 : 0;
}
O1B_API int o1b_swiglu_backward_bf16(int64_t N, int64_t F, const float *dout /* (N, F) */,
                                     const float *h /* (N, 2F) */, bf16 *dh /* (N, 2F) */) {
    swiglu_args a = {F, h, dout, NULL, NULL, dh, 0};
    o1b_parallel_for(N, 8, bwd_range_bf16, &a);
    return atomic_load(&a.failed) ? -1 : 0;
}
