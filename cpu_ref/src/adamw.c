/* adamw.c — the fused AdamW step (CONTRACT.md §6.7). bf16 params are widened to fp32, moments
 * are fp32, and the param is rounded back to bf16 once. Host scalars (bc1 = 1/(1-b1^t), ...)
 * are computed by the caller as the contract's host arithmetic prescribes (§8).
 *   m = add(mul(b1, m), mul(omb1, g))          omb1 = 1 - b1
 *   v = add(mul(b2, v), mul(omb2, mul(g, g)))  omb2 = 1 - b2
 *   u = div(mul(m, bc1), add(sqrt(mul(v, bc2)), eps))
 *   p = bf16(sub(mul(p, decay), mul(lr, u)))   decay = 1 - lr*wd (1 without weight decay)
 */
#include "contract.h"
#include "runtime.h"
#include "vmath.h"

typedef struct { bf16 *p; const float *g; float *m, *v; float k[9]; } adamw_args;

/* The elements on SIMD lanes (vmath.c: contract.h's bits, the formulas above). */
static void adamw_range(void *ctx, int64_t lo, int64_t hi) {
    const adamw_args *a = (const adamw_args *)ctx;
    o1b_vadamw(hi - lo, a->p + lo, a->g + lo, a->m + lo, a->v + lo, a->k);
}
O1B_API void o1b_adamw_step(int64_t n,
                            bf16 *p,          /* (n,) params, updated in place */
                            const float *g,   /* (n,) gradient (already averaged and clipped) */
                            float *m,         /* (n,) first moment, in place */
                            float *v,         /* (n,) second moment, in place */
                            float lr, float b1, float b2, float omb1, float omb2, float eps,
                            float decay, float bc1, float bc2) {
    adamw_args a = {p, g, m, v, {o1b_load(lr), o1b_load(b1), o1b_load(b2), o1b_load(omb1),
                    o1b_load(omb2), o1b_load(eps), o1b_load(decay), o1b_load(bc1), o1b_load(bc2)}};
    o1b_parallel_for(n, 4096, adamw_range, &a);
}
