/* attention.cu — causal, optionally sliding-window, grouped-query attention, forward and backward
 * (CONTRACT.md §6.6; the C reference is cpu_ref/src/attention.c).
 *
 *   B = batch, T = sequence, H = query heads, G = kv heads (query head h reads g = h / (H/G)),
 *   D = head dim, W = window (0: causal only). Key j is visible to query i iff j <= i and
 *   (W == 0 or i - j < W). q (B,T,H,D), k and v (B,T,G,D) bf16; o, dout, dq (B,T,H,D),
 *   dk, dv (B,T,G,D), lse (B,H,T) fp32.
 *
 * Forward: one thread per query row (b, h, i): the online softmax over key blocks of ATTN_BLOCK =
 * 64 keys aligned at absolute key positions (a contract constant: it decides where the running sum
 * is rescaled). The row's accumulator lives in its own o row and its per-block pv in a scratch row.
 * Backward: two passes without atomics, each output element summed by one thread in the written
 * order — dq per query row (b, h, i), dk and dv per key row (b, g, j) — recomputing s, p, dp, ds.
 */
#include "contract.cuh"

#define ATTN_BLOCK 64

__device__ __forceinline__ i64 first_key(i64 i, i64 W) { return (W == 0 || i < W) ? 0 : i - W + 1; }
__device__ __forceinline__ i64 last_query(i64 j, i64 T, i64 W) {
    return W == 0 ? T - 1 : (j + W - 1 < T - 1 ? j + W - 1 : T - 1);
}

/* dot = sum from +0 over d ascending of mul(a[d], b[d]), both bf16 widened. */
__device__ __forceinline__ float dot_bf16(const bf16 *a, const bf16 *b, i64 D) {
    float acc = 0.0f;
    for (i64 d = 0; d < D; d++) acc = o1b_add(acc, o1b_mul(o1b_bf16_to_f32(a[d]), o1b_bf16_to_f32(b[d])));
    return acc;
}
/* the same with an fp32 first operand (loaded) and a bf16 second. */
__device__ __forceinline__ float dot_f32_bf16(const float *a, const bf16 *b, i64 D) {
    float acc = 0.0f;
    for (i64 d = 0; d < D; d++) acc = o1b_add(acc, o1b_mul(o1b_load(a[d]), o1b_bf16_to_f32(b[d])));
    return acc;
}

/* pv: scratch (B*H*T, D). One thread per r = (b*H + h)*T + i. */
extern "C" __global__ void o1b_attention_forward(i64 B, i64 T, i64 H, i64 G, i64 D, i64 W, float scale,
                                                 const bf16 *q, const bf16 *k, const bf16 *v,
                                                 float *o, float *lse, float *pv) {
    i64 r = o1b_gid();
    if (r >= B * H * T) return;
    const i64 i = r % T, h = (r / T) % H, b = r / (T * H), rep = H / G, g = h / rep;
    const float sc = o1b_load(scale);
    const bf16 *qi = q + ((b * T + i) * H + h) * D;
    float *acc = o + ((b * T + i) * H + h) * D, *pvr = pv + r * D;
    float s[ATTN_BLOCK];
    float m = o1b_neg(o1b_inf()), l = 0.0f;
    for (i64 d = 0; d < D; d++) acc[d] = 0.0f;
    const i64 jlo = first_key(i, W);
    for (i64 kb = jlo / ATTN_BLOCK; kb <= i / ATTN_BLOCK; kb++) {
        i64 j0 = kb * ATTN_BLOCK > jlo ? kb * ATTN_BLOCK : jlo;
        i64 j1 = kb * ATTN_BLOCK + ATTN_BLOCK - 1 < i ? kb * ATTN_BLOCK + ATTN_BLOCK - 1 : i;
        float mb = o1b_neg(o1b_inf());
        for (i64 j = j0; j <= j1; j++) {
            s[j - j0] = o1b_mul(dot_bf16(qi, k + ((b * T + j) * G + g) * D, D), sc);
            mb = o1b_max(mb, s[j - j0]);
        }
        float m_new = o1b_max(m, mb);
        float corr = o1b_exp(o1b_sub(m, m_new));          /* exp(-inf) = +0 on the first block */
        float ps = 0.0f;
        for (i64 d = 0; d < D; d++) pvr[d] = 0.0f;
        for (i64 j = j0; j <= j1; j++) {
            float p = o1b_exp(o1b_sub(s[j - j0], m_new));
            ps = o1b_add(ps, p);
            const bf16 *vj = v + ((b * T + j) * G + g) * D;
            for (i64 d = 0; d < D; d++) pvr[d] = o1b_add(pvr[d], o1b_mul(p, o1b_bf16_to_f32(vj[d])));
        }
        l = o1b_add(o1b_mul(l, corr), ps);
        for (i64 d = 0; d < D; d++) acc[d] = o1b_add(o1b_mul(acc[d], corr), pvr[d]);
        m = m_new;
    }
    float inv = o1b_div(1.0f, l);
    for (i64 d = 0; d < D; d++) acc[d] = o1b_store(o1b_mul(acc[d], inv));
    lse[r] = o1b_store(o1b_add(m, o1b_log(l)));
}

/* Di[r] = sum over d ascending of mul(dout, o) (both loaded), r = (b*H + h)*T + i. */
extern "C" __global__ void o1b_attention_di(i64 B, i64 T, i64 H, i64 D, const float *dout, const float *o,
                                            float *Di) {
    i64 r = o1b_gid();
    if (r >= B * H * T) return;
    const i64 i = r % T, h = (r / T) % H, b = r / (T * H);
    const i64 base = ((b * T + i) * H + h) * D;
    float acc = 0.0f;
    for (i64 d = 0; d < D; d++) acc = o1b_add(acc, o1b_mul(o1b_load(dout[base + d]), o1b_load(o[base + d])));
    Di[r] = acc;
}

/* p = exp(sub(mul(s, scale), lse)),  ds = mul(p, sub(dp, Di)). */
__device__ __forceinline__ void p_ds(float s, float dp, float scale, float lse, float Di, float *p, float *ds) {
    *p = o1b_exp(o1b_sub(o1b_mul(s, scale), lse));
    *ds = o1b_mul(*p, o1b_sub(dp, Di));
}

/* Pass 1, one thread per query row r = (b*H + h)*T + i: dq_i = mul(sum_{visible j asc} ds_ij k_j, scale).
 * The accumulator lives in the row's dq. */
extern "C" __global__ void o1b_attention_dq(i64 B, i64 T, i64 H, i64 G, i64 D, i64 W, float scale,
                                            const float *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                                            const float *lse, const float *Di, float *dq) {
    i64 r = o1b_gid();
    if (r >= B * H * T) return;
    const i64 i = r % T, h = (r / T) % H, b = r / (T * H), rep = H / G, g = h / rep;
    const float sc = o1b_load(scale), l = o1b_load(lse[r]), di = Di[r];
    const i64 base = ((b * T + i) * H + h) * D;
    float *acc = dq + base;
    for (i64 d = 0; d < D; d++) acc[d] = 0.0f;
    for (i64 j = first_key(i, W); j <= i; j++) {
        const bf16 *kj = k + ((b * T + j) * G + g) * D, *vj = v + ((b * T + j) * G + g) * D;
        float p, ds;
        p_ds(dot_bf16(q + base, kj, D), dot_f32_bf16(dout + base, vj, D), sc, l, di, &p, &ds);
        for (i64 d = 0; d < D; d++) acc[d] = o1b_add(acc[d], o1b_mul(ds, o1b_bf16_to_f32(kj[d])));
    }
    for (i64 d = 0; d < D; d++) acc[d] = o1b_store(o1b_mul(acc[d], sc));
}

/* Pass 2, one thread per key row r = (b*G + g)*T + j:
 *   dk_j = mul(sum_{h in group asc, then i = j .. ihi(j) asc} ds_hij q_hi, scale)
 *   dv_j =     sum_{the same order}                            p_hij dout_hi
 * The accumulators live in the row's dk and dv. */
extern "C" __global__ void o1b_attention_dkv(i64 B, i64 T, i64 H, i64 G, i64 D, i64 W, float scale,
                                             const float *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                                             const float *lse, const float *Di, float *dk, float *dv) {
    i64 r = o1b_gid();
    if (r >= B * G * T) return;
    const i64 j = r % T, g = (r / T) % G, b = r / (T * G), rep = H / G;
    const float sc = o1b_load(scale);
    const i64 kbase = ((b * T + j) * G + g) * D;
    const bf16 *kj = k + kbase, *vj = v + kbase;
    float *dka = dk + kbase, *dva = dv + kbase;
    for (i64 d = 0; d < D; d++) { dka[d] = 0.0f; dva[d] = 0.0f; }
    const i64 ilast = last_query(j, T, W);
    for (i64 h = g * rep; h < (g + 1) * rep; h++) {
        for (i64 i = j; i <= ilast; i++) {
            const i64 qbase = ((b * T + i) * H + h) * D, qr = (b * H + h) * T + i;
            float p, ds;
            p_ds(dot_bf16(q + qbase, kj, D), dot_f32_bf16(dout + qbase, vj, D), sc, o1b_load(lse[qr]), Di[qr],
                 &p, &ds);
            for (i64 d = 0; d < D; d++) {
                dka[d] = o1b_add(dka[d], o1b_mul(ds, o1b_bf16_to_f32(q[qbase + d])));
                dva[d] = o1b_add(dva[d], o1b_mul(p, o1b_load(dout[qbase + d])));
            }
        }
    }
    for (i64 d = 0; d < D; d++) {
        dka[d] = o1b_store(o1b_mul(dka[d], sc));
        dva[d] = o1b_store(dva[d]);
    }
}
