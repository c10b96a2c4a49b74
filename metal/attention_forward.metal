// attention_forward — CONTRACT.md §6.6, one thread per query row r = (b*T + i)*H + h (o's row
// order); a launch computes the rows R0 ... R0 + grid - 1 (a slab, metal/slabs.py) and writes them
// as rows r - R0 of its outputs. q (B,T,H,D), k and v (B,T,G,D) bf16; head dim D is a template
// int. prm (int64) = T, H, G, W, R0.
// Online softmax over key blocks of ATTN_BLOCK = 64 keys aligned at absolute key positions:
// per block, mb = max of the scores, m_new = max(m, mb), corr = exp(m - m_new), p_j = exp(s_j - m_new),
// ps = sum p_j, pv[d] = sum p_j v_jd (j ascending, from +0); l = l corr + ps, acc = acc corr + pv.
// Outputs o (rows, D) = acc / l (mul by div(1, l)), lse (rows) = m + log(l). Grid (rows).
long T = prm[0], H = prm[1], G = prm[2], W = prm[3], R0 = prm[4];
long ro = (long)thread_position_in_grid.x, r = R0 + ro;
long h = r % H, i = (r / H) % T, b = r / (T * H), g = h / (H / G);
float sc = o1b_load(scale[0]);
float qv[D], acc[D], pv[D], s[O1B_ATTN_BK];
for (int d = 0; d < D; d++) { qv[d] = o1b_bf16_to_f32(q[((b * T + i) * H + h) * D + d]); acc[d] = 0.0f; }
float m = o1b_neg(o1b_inf()), l = 0.0f;
long jlo = (W == 0 || i < W) ? 0 : i - W + 1;
for (long kb = jlo / O1B_ATTN_BK; kb <= i / O1B_ATTN_BK; kb++) {
    long j0 = kb * O1B_ATTN_BK > jlo ? kb * O1B_ATTN_BK : jlo;
    long j1 = kb * O1B_ATTN_BK + O1B_ATTN_BK - 1 < i ? kb * O1B_ATTN_BK + O1B_ATTN_BK - 1 : i;
    float mb = o1b_neg(o1b_inf());
    for (long j = j0; j <= j1; j++) {
        float sdot = 0.0f;
        for (int d = 0; d < D; d++)
            sdot = o1b_add(sdot, o1b_mul(qv[d], o1b_bf16_to_f32(k[((b * T + j) * G + g) * D + d])));
        s[j - j0] = o1b_mul(sdot, sc);
        mb = o1b_max(mb, s[j - j0]);
    }
    float m_new = o1b_max(m, mb);
    float corr = o1b_exp(o1b_sub(m, m_new));
    float ps = 0.0f;
    for (int d = 0; d < D; d++) pv[d] = 0.0f;
    for (long j = j0; j <= j1; j++) {
        float p = o1b_exp(o1b_sub(s[j - j0], m_new));
        ps = o1b_add(ps, p);
        for (int d = 0; d < D; d++)
            pv[d] = o1b_add(pv[d], o1b_mul(p, o1b_bf16_to_f32(v[((b * T + j) * G + g) * D + d])));
    }
    l = o1b_add(o1b_mul(l, corr), ps);
    for (int d = 0; d < D; d++) acc[d] = o1b_add(o1b_mul(acc[d], corr), pv[d]);
    m = m_new;
}
float inv = o1b_div(1.0f, l);
for (int d = 0; d < D; d++) o[ro * D + d] = o1b_store(o1b_mul(acc[d], inv));
lse[ro] = o1b_store(o1b_add(m, o1b_log(l)));
