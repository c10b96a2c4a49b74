// attention_forward_i8 — CONTRACT.md §6.10 (§6.6 with the block product P·V in int8), tiled as
// attention_forward: a threadgroup of AT_NT = 64 threads takes AT_ROWS = 32 query rows of one (b, h)
// (thread t serves row t % 32 as part t / 32) and visits the key blocks of ATTN_BLOCK = 64 keys
// aligned at absolute key positions that its rows see. Per block: k staged in threadgroup memory
// (AT_FT keys at a time, sized from D to fit 32 KiB: 64 up to D = 174);
// the parts compute the scores of the row's participating keys into S; each thread takes the row's
// mb, m_new = max(m, mb), corr = exp(m - m_new); p_j = exp(s_j - m_new) replace the scores; the
// block's value rows vq (int8) and vs (their scales) replace k; ps = sum p_j (j ascending, from +0);
// t_j = mul(p_j, s_v[j]) (recomputed where needed: the same bits); if any t_j is NaN, pv = NaN; else
// a = max t_j (all >= +0: exact in any order), s_p = div(a, 127); s_p = +0: pv = +0; else the
// parts write q_p[j] = level(mul(t_j, div(1, s_p))) (0 ... 127) of their keys into QP, and for each
// of the part's columns d = part + 2c, pv = mul(i2f(sum_j q_p[j] q_v[j, d]), s_p), the sum in int32
// (exact: at most 64 terms <= 127^2). l = l corr + ps, acc = acc corr + pv. Outputs o = acc / l
// (mul by div(1, l)), lse = m + log(l). q (B,T,H,D), k (B,T,G,D) bf16; vq (B,T,G,D) int8 and
// vs (B,T,G) fp32 from attention_vquant. Tiles, slabs, outputs, prm and grid as attention_forward.
#define AT_ROWS 32
#define AT_NT 64
#define AT_NW ((D + 1) / 2)
// KQ: a sub-tile of AT_FT of the block's keys: their k (bf16, two to a word), then their q_v (int8,
// four to a word): one buffer, so that D = 128 needs 26 KiB of threadgroup memory. AT_FT: the
// largest power of two <= 64 whose rows fit 32 KiB beside S, SV and QP; the block (where the sum is
// rescaled) stays 64 keys and the block product's int32 sum is exact in any order.
#define AT_FIXED (4 * AT_ROWS * O1B_ATTN_BK + 4 * O1B_ATTN_BK + AT_ROWS * O1B_ATTN_BK)
constexpr int AT_FT = AT_FIXED + 4 * ((64 * D + 1) / 2) <= 32768 ? 64 : AT_FIXED + 4 * ((32 * D + 1) / 2) <= 32768 ? 32
                    : AT_FIXED + 4 * ((16 * D + 1) / 2) <= 32768 ? 16 : AT_FIXED + 4 * ((8 * D + 1) / 2) <= 32768 ? 8
                    : AT_FIXED + 4 * ((4 * D + 1) / 2) <= 32768 ? 4 : AT_FIXED + 4 * ((2 * D + 1) / 2) <= 32768 ? 2 : 1;
constexpr int AT_KW = (AT_FT * D + 1) / 2;
threadgroup uint KQ[AT_KW];
threadgroup float S[AT_ROWS * O1B_ATTN_BK];             // scores, then p
threadgroup float SV[O1B_ATTN_BK];                      // s_v of the block's keys
threadgroup char QP[AT_ROWS * O1B_ATTN_BK];             // q_p (0 ... 127)
long T = prm[0], H = prm[1], G = prm[2], W = prm[3], t0 = prm[4];
long nqb = (T + AT_ROWS - 1) / AT_ROWS, tile = t0 + (long)threadgroup_position_in_grid.x;
int t = (int)thread_index_in_threadgroup, rr = t % AT_ROWS, part = t / AT_ROWS;
long qb = tile % nqb, h = (tile / nqb) % H, b = tile / (nqb * H), g = h / (H / G);
long i0 = qb * AT_ROWS, i = i0 + rr, ilast = i0 + AT_ROWS - 1 < T - 1 ? i0 + AT_ROWS - 1 : T - 1;
bool row = i < T;
long orow = (tile - t0) * AT_ROWS + rr;
float sc = o1b_load(scale[0]);
uint qw[AT_NW];                                         // q_i, bf16 packed two to a word
for (int c = 0; c < AT_NW; c++) {
    uint lo = row ? (uint)q[((b * T + i) * H + h) * D + 2 * c] : 0u;
    uint hi = (row && 2 * c + 1 < D) ? (uint)q[((b * T + i) * H + h) * D + 2 * c + 1] : 0u;
    qw[c] = lo | (hi << 16);
}
float acc[AT_NW];                                       // columns d = part + 2c
for (int c = 0; c < AT_NW; c++) acc[c] = 0.0f;
float m = o1b_neg(o1b_inf()), l = 0.0f;
long jlo = !row ? 0 : (W == 0 || i < W) ? 0 : i - W + 1;
long jfirst = (W == 0 || i0 < W) ? 0 : i0 - W + 1;
for (long kb = jfirst / O1B_ATTN_BK; kb <= ilast / O1B_ATTN_BK; kb++) {
    long kbase = kb * O1B_ATTN_BK;
    bool visit = row && kb >= jlo / O1B_ATTN_BK && kb <= i / O1B_ATTN_BK;
    int c0 = (int)((kbase > jlo ? kbase : jlo) - kbase);
    int c1 = (int)((kbase + O1B_ATTN_BK - 1 < i ? kbase + O1B_ATTN_BK - 1 : i) - kbase);
    for (int s0 = 0; s0 < O1B_ATTN_BK; s0 += AT_FT) {
        for (int w = t; w < AT_KW; w += AT_NT) {
            uint word = 0u;
            for (int e = 2 * w; e < 2 * w + 2 && e < AT_FT * D; e++) {
                long j = kbase + s0 + e / D;
                uint x = j <= ilast ? (uint)k[((b * T + j) * G + g) * D + e % D] : 0u;
                word |= x << ((e & 1) << 4);
            }
            KQ[w] = word;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (visit) {
            int half = (AT_FT + 1) / 2;                 // a part's share of the sub-tile's keys
            for (int jj = s0 + part * half; jj < s0 + AT_FT && jj < s0 + (part + 1) * half; jj++) {
                if (jj < c0 || jj > c1) continue;
                float sdot = 0.0f;
                for (int d = 0; d < D; d++) {
                    ushort qd = (ushort)((d & 1) ? qw[d >> 1] >> 16 : qw[d >> 1] & 0xFFFFu);
                    int e = (jj - s0) * D + d;
                    ushort kd = (ushort)((KQ[e >> 1] >> ((e & 1) << 4)) & 0xFFFFu);
                    sdot = o1b_add(sdot, o1b_mul(o1b_bf16_to_f32(qd), o1b_bf16_to_f32(kd)));
                }
                S[rr * O1B_ATTN_BK + ((jj + rr) & (O1B_ATTN_BK - 1))] = o1b_mul(sdot, sc);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (int w = t; w < (AT_FT * D + 3) / 4; w += AT_NT) {    // the scores are done with k: q_v's first sub-tile
        uint word = 0u;
        for (int e = 4 * w; e < 4 * w + 4 && e < AT_FT * D; e++) {
            long j = kbase + e / D;
            uint x = j <= ilast ? (uint)(vq[((b * T + j) * G + g) * D + e % D] & 0xFF) : 0u;
            word |= x << ((e & 3) << 3);
        }
        KQ[w] = word;
    }
    for (int jj = t; jj < O1B_ATTN_BK; jj += AT_NT)
        SV[jj] = kbase + jj <= ilast ? o1b_load(vs[(b * T + kbase + jj) * G + g]) : 0.0f;
    float mb = o1b_neg(o1b_inf());
    if (visit)
        for (int jj = c0; jj <= c1; jj++) mb = o1b_max(mb, S[rr * O1B_ATTN_BK + ((jj + rr) & (O1B_ATTN_BK - 1))]);
    float m_new = o1b_max(m, mb);
    float corr = o1b_exp(o1b_sub(m, m_new));             // exp(-inf) = +0 on the first block
    threadgroup_barrier(mem_flags::mem_threadgroup);     // every score read before p replaces it
    if (visit)
        for (int jj = part * (O1B_ATTN_BK / 2); jj < (part + 1) * (O1B_ATTN_BK / 2); jj++)
            if (jj >= c0 && jj <= c1) {
                int cell = rr * O1B_ATTN_BK + ((jj + rr) & (O1B_ATTN_BK - 1));
                S[cell] = o1b_exp(o1b_sub(S[cell], m_new));
            }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float ps = 0.0f, a = 0.0f, sp = 0.0f;
    bool bad = false, zero = true;
    if (visit) {
        for (int jj = c0; jj <= c1; jj++) ps = o1b_add(ps, S[rr * O1B_ATTN_BK + ((jj + rr) & (O1B_ATTN_BK - 1))]);
        for (int jj = c0; jj <= c1; jj++) {
            float tj = o1b_mul(S[rr * O1B_ATTN_BK + ((jj + rr) & (O1B_ATTN_BK - 1))], SV[jj]);
            bad = bad || o1b_isnan(tj);
            a = o1b_max(a, tj);             // a NaN t_j is passed over (the block is then non-finite)
        }
        sp = o1b_div(a, O1B_F(0x42FE0000u) /* 127 */);
        zero = (o1b_bits(sp) & 0x7FFFFFFFu) == 0u;
        if (!bad && !zero) {
            float inv = o1b_div(1.0f, sp);
            for (int jj = part * (O1B_ATTN_BK / 2); jj < (part + 1) * (O1B_ATTN_BK / 2); jj++)
                if (jj >= c0 && jj <= c1) {
                    int cell = rr * O1B_ATTN_BK + ((jj + rr) & (O1B_ATTN_BK - 1));
                    QP[cell] = (char)o1b_level(o1b_mul(o1b_mul(S[cell], SV[jj]), inv), O1B_QMAX);
                }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    int ia[AT_NW];                                      // per column, over the sub-tiles of q_v
    for (int s0 = 0; s0 < O1B_ATTN_BK; s0 += AT_FT) {
        if (s0 > 0) {
            threadgroup_barrier(mem_flags::mem_threadgroup);     // the previous sub-tile read
            for (int w = t; w < (AT_FT * D + 3) / 4; w += AT_NT) {
                uint word = 0u;
                for (int e = 4 * w; e < 4 * w + 4 && e < AT_FT * D; e++) {
                    long j = kbase + s0 + e / D;
                    uint x = j <= ilast ? (uint)(vq[((b * T + j) * G + g) * D + e % D] & 0xFF) : 0u;
                    word |= x << ((e & 3) << 3);
                }
                KQ[w] = word;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        if (!visit) continue;
        int j0 = c0 > s0 ? c0 : s0, j1 = c1 < s0 + AT_FT - 1 ? c1 : s0 + AT_FT - 1;
        for (int c = 0; c < AT_NW; c++) {
            int d = part + 2 * c;
            if (d >= D) continue;
            int ic = s0 == 0 ? 0 : ia[c];               // in the array only between sub-tiles
            if (!bad && !zero) {
                for (int jj = j0; jj <= j1; jj++) {
                    int e = (jj - s0) * D + d;
                    int x = (int)((KQ[e >> 2] >> ((e & 3) << 3)) & 0xFFu);
                    ic += (int)QP[rr * O1B_ATTN_BK + ((jj + rr) & (O1B_ATTN_BK - 1))] * (x >= 128 ? x - 256 : x);
                }
            }
            if (s0 + AT_FT == O1B_ATTN_BK) {            // the block's last sub-tile
                float pv = bad ? o1b_nan() : zero ? 0.0f : o1b_mul(o1b_i2f(ic), sp);
                acc[c] = o1b_add(o1b_mul(acc[c], corr), pv);
            } else {
                ia[c] = ic;
            }
        }
    }
    if (visit) {
        l = o1b_add(o1b_mul(l, corr), ps);
        m = m_new;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);     // before the next block's staging
}
float inv = o1b_div(1.0f, l);
for (int c = 0; c < AT_NW; c++) {
    int d = part + 2 * c;
    if (d < D) o[orow * D + d] = row ? o1b_store(o1b_mul(acc[c], inv)) : 0.0f;
}
if (part == 0) lse[orow] = row ? o1b_store(o1b_add(m, o1b_log(l))) : 0.0f;
