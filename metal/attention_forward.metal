// attention_forward — CONTRACT.md §6.6, tiled: a threadgroup of AT_NT = 64 threads takes AT_ROWS = 32
// query rows i0 ... i0 + 31 of one (b, h) (a tile; thread t serves row t % 32 as part t / 32) and
// visits the key blocks of ATTN_BLOCK = 64 keys aligned at absolute key positions from the first one
// its first row sees to its last row's. Per block: k staged in threadgroup memory (AT_FT keys at a
// time, a power of two sized from D to fit 32 KiB: 64 up to D = 192); the two parts
// compute the scores of the row's participating keys (keys 32 part ... 32 part + 31 of the block)
// into S; each thread then takes the row's mb = max of the scores, m_new = max(m, mb),
// corr = exp(m - m_new); p_j = exp(s_j - m_new) replace the scores; v replaces k; ps = sum p_j and,
// for each of the part's columns d = part + 2c, pv = sum p_j v_jd (j ascending, from +0);
// l = l corr + ps, acc = acc corr + pv. A row visits only the blocks that hold its visible keys and
// adds only their terms. Outputs o = acc / l (mul by div(1, l)), lse = m + log(l).
// Tiles are numbered (b H + h) nqb + qb (nqb = ceil(T / 32)); a launch computes the tiles
// t0 ... t0 + groups - 1 (a slab, metal/ops.py) and writes tile row (tile - t0) 32 + rr of its
// outputs o (rows, D) and lse (rows); rows past T are zeros. q (B,T,H,D), k and v (B,T,G,D) bf16;
// D is a template int. prm (int64) = T, H, G, W, t0. Grid (groups * 64), threadgroup 64.
#define AT_ROWS 32
#define AT_NT 64
#define AT_NW ((D + 1) / 2)
// keys staged per sub-tile of AT_FT (the largest power of two <= 64 whose bf16 rows fit 32 KiB
// beside S); the block (where the sum is rescaled) stays 64 keys, the sums take its keys in order
constexpr int AT_FT = 4 * AT_ROWS * O1B_ATTN_BK + 64 * 2 * D <= 32768 ? 64
                    : 4 * AT_ROWS * O1B_ATTN_BK + 32 * 2 * D <= 32768 ? 32
                    : 4 * AT_ROWS * O1B_ATTN_BK + 16 * 2 * D <= 32768 ? 16
                    : 4 * AT_ROWS * O1B_ATTN_BK + 8 * 2 * D <= 32768 ? 8
                    : 4 * AT_ROWS * O1B_ATTN_BK + 4 * 2 * D <= 32768 ? 4
                    : 4 * AT_ROWS * O1B_ATTN_BK + 2 * 2 * D <= 32768 ? 2 : 1;
threadgroup ushort Ks[AT_FT * D];                       // k of a sub-tile, then its v
threadgroup float S[AT_ROWS * O1B_ATTN_BK];             // scores, then p
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
        for (int e = t; e < AT_FT * D; e += AT_NT) {
            long j = kbase + s0 + e / D;
            Ks[e] = j <= ilast ? k[((b * T + j) * G + g) * D + e % D] : (ushort)0;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (visit) {
            int half = (AT_FT + 1) / 2;                 // a part's share of the sub-tile's keys
            for (int jj = s0 + part * half; jj < s0 + AT_FT && jj < s0 + (part + 1) * half; jj++) {
                if (jj < c0 || jj > c1) continue;
                float sdot = 0.0f;
                for (int d = 0; d < D; d++) {
                    ushort qd = (ushort)((d & 1) ? qw[d >> 1] >> 16 : qw[d >> 1] & 0xFFFFu);
                    sdot = o1b_add(sdot, o1b_mul(o1b_bf16_to_f32(qd), o1b_bf16_to_f32(Ks[(jj - s0) * D + d])));
                }
                S[rr * O1B_ATTN_BK + ((jj + rr) & (O1B_ATTN_BK - 1))] = o1b_mul(sdot, sc);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (int e = t; e < AT_FT * D; e += AT_NT) {        // the scores are done with k: v's first sub-tile
        long j = kbase + e / D;
        Ks[e] = j <= ilast ? v[((b * T + j) * G + g) * D + e % D] : (ushort)0;
    }
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
    // pv = sum over j ascending from +0 of mul(p_j, v_jd) per column, over the sub-tiles of v
    float pv[AT_NW];
    for (int s0 = 0; s0 < O1B_ATTN_BK; s0 += AT_FT) {
        if (s0 > 0) {
            threadgroup_barrier(mem_flags::mem_threadgroup);     // the previous sub-tile read
            for (int e = t; e < AT_FT * D; e += AT_NT) {
                long j = kbase + s0 + e / D;
                Ks[e] = j <= ilast ? v[((b * T + j) * G + g) * D + e % D] : (ushort)0;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        if (!visit) continue;
        int j0 = c0 > s0 ? c0 : s0, j1 = c1 < s0 + AT_FT - 1 ? c1 : s0 + AT_FT - 1;
        for (int c = 0; c < AT_NW; c++) {
            int d = part + 2 * c;
            if (d >= D) continue;
            float pc = s0 == 0 ? 0.0f : pv[c];          // in the array only between sub-tiles
            for (int jj = j0; jj <= j1; jj++)
                pc = o1b_add(pc, o1b_mul(S[rr * O1B_ATTN_BK + ((jj + rr) & (O1B_ATTN_BK - 1))],
                                         o1b_bf16_to_f32(Ks[(jj - s0) * D + d])));
            if (s0 + AT_FT == O1B_ATTN_BK) acc[c] = o1b_add(o1b_mul(acc[c], corr), pc);
            else pv[c] = pc;
        }
    }
    if (visit) {
        float ps = 0.0f;
        for (int jj = c0; jj <= c1; jj++) ps = o1b_add(ps, S[rr * O1B_ATTN_BK + ((jj + rr) & (O1B_ATTN_BK - 1))]);
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
