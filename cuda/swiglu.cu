/* swiglu.cu — SwiGLU on the fused gate+up projection (CONTRACT.md §6.5). N = rows, F = hidden.
 *   h = [gate | up] (N, 2F);  out = mul(silu(gate), up)
 * Backward, with s = sigmoid(gate):  dup = mul(dout, mul(gate, s)),
 *   dgate = mul(mul(dout, up), mul(s, add(1, mul(gate, sub(1, s))))).  One thread per (n, f). */
#include "contract.cuh"

extern "C" __global__ void o1b_swiglu_forward(i64 N, i64 F, const float *h, float *out) {
    i64 e = o1b_gid();
    if (e >= N * F) return;
    i64 n = e / F, f = e % F;
    const float *gate = h + n * 2 * F, *up = gate + F;
    out[e] = o1b_store(o1b_mul(o1b_silu(o1b_load(gate[f])), o1b_load(up[f])));
}

extern "C" __global__ void o1b_swiglu_backward(i64 N, i64 F, const float *dout, const float *h, float *dh) {
    i64 e = o1b_gid();
    if (e >= N * F) return;
    i64 n = e / F, f = e % F;
    const float *gate = h + n * 2 * F, *up = gate + F;
    float g = o1b_load(gate[f]), u = o1b_load(up[f]), d = o1b_load(dout[e]);
    float s = o1b_sigmoid(g), silu = o1b_mul(g, s);
    float dsilu = o1b_mul(s, o1b_add(1.0f, o1b_mul(g, o1b_sub(1.0f, s))));
    dh[n * 2 * F + F + f] = o1b_store(o1b_mul(d, silu));
    dh[n * 2 * F + f] = o1b_store(o1b_mul(o1b_mul(d, u), dsilu));
}
