/* adamw.cu — the fused AdamW step (CONTRACT.md §6.7), one thread per element. Host scalars are
 * computed by mlx_open1b.hostmath.adamw_scalars (§8).
 *   m = add(mul(b1, m), mul(omb1, g));  v = add(mul(b2, v), mul(omb2, mul(g, g)))
 *   u = div(mul(m, bc1), add(sqrt(mul(v, bc2)), eps));  p = bf16(sub(mul(p, decay), mul(lr, u))) */
#include "contract.cuh"

extern "C" __global__ void o1b_adamw_step(i64 n, bf16 *p, const float *g, float *m, float *v,
                                          float lr, float b1, float b2, float omb1, float omb2,
                                          float eps, float decay, float bc1, float bc2) {
    i64 i = o1b_gid();
    if (i >= n) return;
    lr = o1b_load(lr); b1 = o1b_load(b1); b2 = o1b_load(b2); omb1 = o1b_load(omb1);
    omb2 = o1b_load(omb2); eps = o1b_load(eps); decay = o1b_load(decay);
    bc1 = o1b_load(bc1); bc2 = o1b_load(bc2);
    float gi = o1b_load(g[i]);
    float mi = o1b_add(o1b_mul(b1, o1b_load(m[i])), o1b_mul(omb1, gi));
    float vi = o1b_add(o1b_mul(b2, o1b_load(v[i])), o1b_mul(omb2, o1b_mul(gi, gi)));
    float u = o1b_div(o1b_mul(mi, bc1), o1b_add(o1b_sqrt(o1b_mul(vi, bc2)), eps));
    float pn = o1b_sub(o1b_mul(o1b_bf16_to_f32(p[i]), decay), o1b_mul(lr, u));
    m[i] = o1b_store(mi);
    v[i] = o1b_store(vi);
    p[i] = o1b_f32_to_bf16(pn);
}
