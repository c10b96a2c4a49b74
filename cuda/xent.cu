/* xent.cu — fused, vocabulary-chunked cross-entropy + z-loss (CONTRACT.md §6.8; the C reference is
 * cpu_ref/src/xent.c). N = rows, C = channels, V = vocabulary, L = the chunk's length.
 *
 * The host walks the chunks of XENT_CHUNK = 1024 vocabulary entries in order (a contract constant:
 * the online logsumexp rescales at chunk boundaries). Per chunk the logits z (N, L) come from the
 * contract GEMM kernel of linear.cu (linear_forward's bits); the kernels here do the per-row work,
 * one thread per row, v ascending inside the chunk. The backward's dh and dw are GEMMs on the
 * bf16 dz of each chunk (dh continues one accumulator across chunks; dw rows are per chunk). */
#include "contract.cuh"

/* One chunk of the online logsumexp: m, s running max and sum, zt the target logit. */
extern "C" __global__ void o1b_xent_chunk_forward(i64 N, i64 v0, i64 L, const float *z, const int *targets,
                                                  float *m, float *s, float *zt) {
    i64 n = o1b_gid();
    if (n >= N) return;
    const float *zr = z + n * L;
    float cm = o1b_neg(o1b_inf());                      /* a NaN logit is passed over here ... */
    for (i64 v = 0; v < L; v++) cm = o1b_max(cm, o1b_load(zr[v]));
    float m_old = m[n];
    float m_new = o1b_max(m_old, cm);
    float corr = o1b_exp(o1b_sub(m_old, m_new));        /* exp(-inf) = +0 on the first chunk */
    float cs = 0.0f;
    for (i64 v = 0; v < L; v++) cs = o1b_add(cs, o1b_exp(o1b_sub(o1b_load(zr[v]), m_new)));   /* ... NaN here */
    s[n] = o1b_add(o1b_mul(s[n], corr), cs);
    m[n] = m_new;
    i64 t = (i64)targets[n] - v0;
    if (t >= 0 && t < L) zt[n] = o1b_load(zr[t]);
}

/* m = -inf, s = +0, zt = +0 for every row. */
extern "C" __global__ void o1b_xent_init(i64 N, float *m, float *s, float *zt) {
    i64 n = o1b_gid();
    if (n >= N) return;
    m[n] = o1b_neg(o1b_inf()); s[n] = 0.0f; zt[n] = 0.0f;
}

/* lse = add(m, log(s)); ce = sub(lse, zt); loss = add(ce, mul(zcoef, mul(lse, lse))). */
extern "C" __global__ void o1b_xent_final(i64 N, const float *m, const float *s, const float *zt, float zcoef,
                                          float *loss, float *lse, float *ce) {
    i64 n = o1b_gid();
    if (n >= N) return;
    float l = o1b_add(m[n], o1b_log(s[n]));
    float c = o1b_sub(l, zt[n]);
    float zl = o1b_mul(o1b_load(zcoef), o1b_mul(l, l));
    lse[n] = o1b_store(l);
    ce[n] = o1b_store(c);
    loss[n] = o1b_store(o1b_add(c, zl));
}

/* dz[n, v] = bf16(mul(g, dloss[n])), g = mul(exp(sub(z, lse)), coef) minus 1 at the target,
 * coef = add(1, mul(mul(2, zcoef), lse)). One thread per (n, v) of the chunk. */
extern "C" __global__ void o1b_xent_chunk_backward(i64 N, i64 v0, i64 L, const float *z, const int *targets,
                                                   float zcoef, const float *lse, const float *dloss, bf16 *dz) {
    i64 e = o1b_gid();
    if (e >= N * L) return;
    i64 n = e / L, v = e % L;
    float two_zcoef = o1b_mul(2.0f, o1b_load(zcoef));
    float l = o1b_load(lse[n]), dl = o1b_load(dloss[n]);
    float coef = o1b_add(1.0f, o1b_mul(two_zcoef, l));
    float pv = o1b_exp(o1b_sub(o1b_load(z[e]), l));
    float g = o1b_mul(pv, coef);
    if (v == (i64)targets[n] - v0) g = o1b_sub(g, 1.0f);
    dz[e] = o1b_f32_to_bf16(o1b_mul(g, dl));
}
