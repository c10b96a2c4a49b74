/* swiglu.c — SwiGLU on the fused gate+up projection (CONTRACT.md §6.5). N = rows, F = hidden.
 *   h = [gate | up] (N, 2F);  out = mul(silu(gate), up),  silu(g) = mul(g, sigmoid(g))
 * Backward, with s = sigmoid(g):
 *   dup   = mul(dout, silu(g))
 *   dgate = mul(mul(dout, up), mul(s, add(1, mul(g, sub(1, s)))))
 * Each row's elements are computed on SIMD lanes (vmath.c), which gives contract.h's bits.
 */
#include "contract.h"
#include "runtime.h"
#include "vmath.h"

typedef struct { int64_t F; const float *h, *dout; float *out, *dh; } swiglu_args;

static void fwd_range(void *ctx, int64_t lo, int64_t hi) {
    const swiglu_args *a = (const swiglu_args *)ctx;
    o1b_vswiglu_fwd_rows(lo, hi, a->F, a->h, a->out);
}
static void bwd_range(void *ctx, int64_t lo, int64_t hi) {
    const swiglu_args *a = (const swiglu_args *)ctx;
    o1b_vswiglu_bwd_rows(lo, hi, a->F, a->dout, a->h, a->dh);
}
O1B_API void o1b_swiglu_forward(int64_t N, int64_t F, const float *h /* (N, 2F) */, float *out /* (N, F) */) {
    swiglu_args a = {F, h, NULL, out, NULL};
    o1b_parallel_for(N, 8, fwd_range, &a);
}
O1B_API void o1b_swiglu_backward(int64_t N, int64_t F, const float *dout /* (N, F) */,
                                 const float *h /* (N, 2F) */, float *dh /* (N, 2F) */) {
    swiglu_args a = {F, h, dout, NULL, dh};
    o1b_parallel_for(N, 8, bwd_range, &a);
}
