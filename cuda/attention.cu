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
 *
 * The int8 forward (§6.10): the value rows are quantized once, one thread per key row
 * (o1b_attention_vquant: q_v int8, s_v fp32); the forward is the one above with each block's
 * P·V product replaced by t_j = p_j s_v[j], a per-(query row, block) scale s_p = max t_j / 127,
 * int8 weights q_p = level(t_j / s_p) and an exact int32 sum of q_p q_v, dequantized by s_p.
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

/* s[j - j0] = mul(dot(q_i, k_j), scale) for the keys j0..j1 of a block (key j's row at
 * k + (row0 + j*G)*D); returns their max (the written comparison: a NaN score is passed over). */
__device__ __forceinline__ float block_scores(const bf16 *qi, const bf16 *k, i64 row0, i64 G, i64 D, i64 j0, i64 j1,
                                              float sc, float *s) {
    float mb = o1b_neg(o1b_inf());
    for (i64 j = j0; j <= j1; j++) {
        s[j - j0] = o1b_mul(dot_bf16(qi, k + (row0 + j * G) * D, D), sc);
        mb = o1b_max(mb, s[j - j0]);
    }
    return mb;
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
        float mb = block_scores(qi, k, (b * T) * G + g, G, D, j0, j1, sc, s);
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

/* §6.10 value rows: one thread per key row r = (b*T + j)*G + g of v (n = B*T*G rows of D values).
 * s = NaN and q = 0 if any value is inf/NaN; else s = div(max |v|, 127) (the max on the bits:
 * exact); s = +0: q = 0; else q = level(mul(v, div(1, s))). sv[r] = s (stored). */
extern "C" __global__ void o1b_attention_vquant(i64 n, i64 D, const bf16 *v, signed char *qv, float *sv) {
    i64 r = o1b_gid();
    if (r >= n) return;
    const bf16 *row = v + r * D;
    u32 m = 0u;
    bool bad = false;
    for (i64 d = 0; d < D; d++) {
        u32 a = o1b_abs_bits(o1b_bf16_to_f32(row[d]));
        bad = bad || a >= 0x7F800000u;
        m = a > m ? a : m;
    }
    float s = bad ? o1b_nan() : o1b_div(__uint_as_float(m), 127.0f);
    bool ok = !bad && o1b_abs_bits(s) != 0u;
    float inv = ok ? o1b_div(1.0f, s) : 0.0f;
    for (i64 d = 0; d < D; d++)
        qv[r * D + d] = (signed char)(ok ? o1b_level(o1b_mul(o1b_bf16_to_f32(row[d]), inv), 127) : 0);
    sv[r] = o1b_store(s);
}

/* §6.10 forward, one thread per r = (b*H + h)*T + i; qv (B,T,G,D) int8 and sv (B,T,G) fp32 from
 * o1b_attention_vquant. Per block: the scores, mb, m_new, corr, p_j and ps of §6.6; then
 * t_j = mul(p_j, s_v[j]); any t_j NaN: pv = NaN; else a = max t_j (t_j >= +0), s_p = div(a, 127);
 * s_p = +0: pv = +0; else q_p[j] = level(mul(t_j, div(1, s_p))), pv[d] = mul(i2f(sum_j q_p[j] q_v[j,d]),
 * s_p) with the sum in int32 (exact). The row's accumulator lives in its own o row. */
extern "C" __global__ void o1b_attention_forward_i8(i64 B, i64 T, i64 H, i64 G, i64 D, i64 W, float scale,
                                                    const bf16 *q, const bf16 *k, const signed char *qv,
                                                    const float *sv, float *o, float *lse) {
    i64 r = o1b_gid();
    if (r >= B * H * T) return;
    const i64 i = r % T, h = (r / T) % H, b = r / (T * H), rep = H / G, g = h / rep;
    const float sc = o1b_load(scale);
    const bf16 *qi = q + ((b * T + i) * H + h) * D;
    float *acc = o + ((b * T + i) * H + h) * D;
    float t[ATTN_BLOCK];
    signed char qp[ATTN_BLOCK];
    float m = o1b_neg(o1b_inf()), l = 0.0f;
    for (i64 d = 0; d < D; d++) acc[d] = 0.0f;
    const i64 jlo = first_key(i, W);
    for (i64 kb = jlo / ATTN_BLOCK; kb <= i / ATTN_BLOCK; kb++) {
        i64 j0 = kb * ATTN_BLOCK > jlo ? kb * ATTN_BLOCK : jlo;
        i64 j1 = kb * ATTN_BLOCK + ATTN_BLOCK - 1 < i ? kb * ATTN_BLOCK + ATTN_BLOCK - 1 : i;
        float mb = block_scores(qi, k, (b * T) * G + g, G, D, j0, j1, sc, t);
        float m_new = o1b_max(m, mb);
        float corr = o1b_exp(o1b_sub(m, m_new));          /* exp(-inf) = +0 on the first block */
        float ps = 0.0f, a = 0.0f;
        bool bad = false;
        for (i64 j = j0; j <= j1; j++) {
            float p = o1b_exp(o1b_sub(t[j - j0], m_new));
            ps = o1b_add(ps, p);
            float tj = o1b_mul(p, o1b_load(sv[(b * T + j) * G + g]));
            t[j - j0] = tj;
            bad = bad || o1b_isnan(tj);
            a = o1b_max(a, tj);                           /* a NaN t_j is passed over */
        }
        float sp = o1b_div(a, 127.0f);
        bool zero = o1b_abs_bits(sp) == 0u;
        if (!bad && !zero) {
            float inv = o1b_div(1.0f, sp);
            for (i64 j = j0; j <= j1; j++) qp[j - j0] = o1b_level(o1b_mul(t[j - j0], inv), 127);
        }
        l = o1b_add(o1b_mul(l, corr), ps);
        for (i64 d = 0; d < D; d++) {
            float pv;
            if (bad) {
                pv = o1b_nan();
            } else if (zero) {
                pv = 0.0f;
            } else {
                int ia = 0;                               /* exact: at most 64 terms of |.| <= 127^2 */
                for (i64 j = j0; j <= j1; j++) ia += (int)qp[j - j0] * (int)qv[((b * T + j) * G + g) * D + d];
                pv = o1b_mul(o1b_i2f(ia), sp);
            }
            acc[d] = o1b_add(o1b_mul(acc[d], corr), pv);
        }
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
