// attention_forward_i8 — CONTRACT.md §6.10 (§6.6 with the block product P·V in int8), one thread
// per query row r = (b*T + i)*H + h (o's row order; a launch computes the slab R0 ... R0 + grid - 1
// as rows r - R0 of its outputs). q (B,T,H,D), k (B,T,G,D) bf16; vq (B,T,G,D) int8 and
// vs (B,T,G) fp32 are the value rows quantized by attention_vquant. D is a template int.
// prm (int64) = T, H, G, W, R0. Per block of ATTN_BLOCK = 64 keys aligned at absolute key positions:
// mb, m_new = max(m, mb), corr = exp(m - m_new), p_j = exp(s_j - m_new), ps = sum p_j (j ascending,
// from +0) exactly as attention_forward; then t_j = mul(p_j, s_v[j]); if any t_j is NaN, pv = NaN;
// else a = max t_j (all >= +0: exact in any order), s_p = div(a, 127); s_p = +0: pv = +0; else
// q_p[j] = level(mul(t_j, div(1, s_p))) in 0..127, acc[d] = sum_j q_p[j] q_v[j, d] in int32
// (exact: at most 64 terms <= 127^2), pv[d] = mul(i2f(acc[d]), s_p). l = l corr + ps,
// acc = acc corr + pv. Outputs o (rows, D) = acc / l (mul by div(1, l)), lse (rows) = m + log(l).
// Grid (rows).
long T = prm[0], H = prm[1], G = prm[2], W = prm[3], R0 = prm[4];
long ro = (long)thread_position_in_grid.x, r = R0 + ro;
long h = r % H, i = (r / H) % T, b = r / (T * H), g = h / (H / G);
float sc = o1b_load(scale[0]);
float qr[D], acc[D], t[O1B_ATTN_BK];
int qp[O1B_ATTN_BK];
for (int d = 0; d < D; d++) { qr[d] = o1b_bf16_to_f32(q[((b * T + i) * H + h) * D + d]); acc[d] = 0.0f; }
float m = o1b_neg(o1b_inf()), l = 0.0f;
long jlo = (W == 0 || i < W) ? 0 : i - W + 1;
for (long kb = jlo / O1B_ATTN_BK; kb <= i / O1B_ATTN_BK; kb++) {
    long j0 = kb * O1B_ATTN_BK > jlo ? kb * O1B_ATTN_BK : jlo;
    long j1 = kb * O1B_ATTN_BK + O1B_ATTN_BK - 1 < i ? kb * O1B_ATTN_BK + O1B_ATTN_BK - 1 : i;
    float mb = o1b_neg(o1b_inf());
    for (long j = j0; j <= j1; j++) {
        float sdot = 0.0f;
        for (int d = 0; d < D; d++)
            sdot = o1b_add(sdot, o1b_mul(qr[d], o1b_bf16_to_f32(k[((b * T + j) * G + g) * D + d])));
        t[j - j0] = o1b_mul(sdot, sc);
        mb = o1b_max(mb, t[j - j0]);
    }
    float m_new = o1b_max(m, mb);
    float corr = o1b_exp(o1b_sub(m, m_new));
    float ps = 0.0f, a = 0.0f;
    bool bad = false;
    for (long j = j0; j <= j1; j++) {
        float p = o1b_exp(o1b_sub(t[j - j0], m_new));
        ps = o1b_add(ps, p);
        float tj = o1b_mul(p, o1b_load(vs[(b * T + j) * G + g]));
        t[j - j0] = tj;
        bad = bad || o1b_isnan(tj);
        a = o1b_max(a, tj);                 // a NaN t_j is passed over (the block is then non-finite)
    }
    float sp = o1b_div(a, O1B_F(0x42FE0000u) /* 127 */);
    bool zero = (o1b_bits(sp) & 0x7FFFFFFFu) == 0u;
    if (!bad && !zero) {
        float inv = o1b_div(1.0f, sp);
        for (long j = j0; j <= j1; j++) qp[j - j0] = o1b_level(o1b_mul(t[j - j0], inv), O1B_QMAX);  // in 0 ... 127
    }
    l = o1b_add(o1b_mul(l, corr), ps);
    for (int d = 0; d < D; d++) {
        float pv;
        if (bad) {
            pv = o1b_nan();
        } else if (zero) {
            pv = 0.0f;
        } else {
            int ia = 0;
            for (long j = j0; j <= j1; j++) ia += qp[j - j0] * (int)vq[((b * T + j) * G + g) * D + d];
            pv = o1b_mul(o1b_i2f(ia), sp);
        }
        acc[d] = o1b_add(o1b_mul(acc[d], corr), pv);
    }
    m = m_new;
}
float inv = o1b_div(1.0f, l);
for (int d = 0; d < D; d++) o[ro * D + d] = o1b_store(o1b_mul(acc[d], inv));
lse[ro] = o1b_store(o1b_add(m, o1b_log(l)));
