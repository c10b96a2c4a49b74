// attention_dkv — §6.6 backward pass 2, tiled: a threadgroup of AT_NT = 128 threads takes AT_ROWS = 32
// key rows j0 ... j0 + 31 of one (b, g) (thread t serves key row t % 32 as part t / 32) and walks,
// for the heads h of group g ascending, the queries its keys are seen by in tiles of AT_NQ queries
// (a power of two <= 64 that fits 32 KiB of threadgroup memory), q, dout, lse and Di staged in
// threadgroup memory. For each visible pair: parts 0 and 1 compute p = exp(sub(mul(dot(q_i, k_j),
// scale), lse_i)) (holding k_j), parts 2 and 3 dp = sum_d mul(dout_id, v_jd) (holding v_j), for the
// even and the odd queries; then every thread takes, for i ascending, ds = mul(p, sub(dp, Di)) and
// adds, for each of its columns d = part + 4c,
// mul(ds, q_id) to dk's accumulator and mul(p, dout_id) to dv's (from +0, h ascending, then
// i = j ... ihi(j) ascending); dk = mul(S_d, scale), dv = its sum. Only visible pairs are added.
// Tiles are numbered (b G + g) nkb + kb; a launch computes the tiles t0 ... t0 + groups - 1 and writes
// tile row (tile - t0) 32 + rr of dk and dv (rows, D); rows past T are zeros. D is a template int.
// prm = T, H, G, W, t0. Grid (groups * 128), threadgroup 128.
#define AT_ROWS 32
#define AT_NT 128
#define AT_NW ((D + 1) / 2)
#define AT_NC ((D + 3) / 4)
// the tile: the largest power of two <= 64 of rows of 6 D + 264 bytes within 32 KiB
constexpr int AT_NQ = 64 * (6 * D + 8 + 8 * AT_ROWS) <= 32768 ? 64 : 32 * (6 * D + 8 + 8 * AT_ROWS) <= 32768 ? 32
                    : 16 * (6 * D + 8 + 8 * AT_ROWS) <= 32768 ? 16 : 8;
threadgroup ushort Qs[AT_NQ * D];
threadgroup float DO[AT_NQ * D];
threadgroup float L[AT_NQ];
threadgroup float DI[AT_NQ];
threadgroup float P[AT_ROWS * AT_NQ];
threadgroup float DP[AT_ROWS * AT_NQ];
long T = prm[0], H = prm[1], G = prm[2], W = prm[3], t0 = prm[4];
long nkb = (T + AT_ROWS - 1) / AT_ROWS, tile = t0 + (long)threadgroup_position_in_grid.x;
int t = (int)thread_index_in_threadgroup, rr = t % AT_ROWS, part = t / AT_ROWS, odd = part % 2;
long kb = tile % nkb, g = (tile / nkb) % G, b = tile / (nkb * G), rep = H / G;
long j0 = kb * AT_ROWS, j = j0 + rr, jlast = j0 + AT_ROWS - 1 < T - 1 ? j0 + AT_ROWS - 1 : T - 1;
bool row = j < T;
long orow = (tile - t0) * AT_ROWS + rr, kbase = ((b * T + j) * G + g) * D;
float sc = o1b_load(scale[0]);
uint mine[AT_NW];                   // parts 0, 1: k_j; 2, 3: v_j; bf16 packed two to a word
for (int c = 0; c < AT_NW; c++) {
    uint lo = row ? (uint)(part < 2 ? k[kbase + 2 * c] : v[kbase + 2 * c]) : 0u;
    uint hi = (row && 2 * c + 1 < D) ? (uint)(part < 2 ? k[kbase + 2 * c + 1] : v[kbase + 2 * c + 1]) : 0u;
    mine[c] = lo | (hi << 16);
}
float dka[AT_NC], dva[AT_NC];       // columns d = part + 4c
for (int c = 0; c < AT_NC; c++) { dka[c] = 0.0f; dva[c] = 0.0f; }
long ihi = !row ? -1 : W == 0 ? T - 1 : (j + W - 1 < T - 1 ? j + W - 1 : T - 1);
long imax = W == 0 ? T - 1 : (jlast + W - 1 < T - 1 ? jlast + W - 1 : T - 1);
for (long h = g * rep; h < (g + 1) * rep; h++) {
    for (long i0 = j0; i0 <= imax; i0 += AT_NQ) {
        int c0 = (int)((i0 > j ? i0 : j) - i0), c1 = (int)((i0 + AT_NQ - 1 < ihi ? i0 + AT_NQ - 1 : ihi) - i0);
        for (int e = t; e < AT_NQ * D; e += AT_NT) {
            long i = i0 + e / D;
            Qs[e] = i <= imax ? q[((b * T + i) * H + h) * D + e % D] : (ushort)0;
            DO[e] = i <= imax ? o1b_load(dout[((b * T + i) * H + h) * D + e % D]) : 0.0f;
        }
        for (int ii = t; ii < AT_NQ; ii += AT_NT) {
            L[ii] = i0 + ii <= imax ? o1b_load(lse[(b * H + h) * T + i0 + ii]) : 0.0f;
            DI[ii] = i0 + ii <= imax ? Di[(b * H + h) * T + i0 + ii] : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (row) {
            for (int ii = c0; ii <= c1; ii++) {
                if ((ii & 1) != odd) continue;
                float sdot = 0.0f;
                for (int d = 0; d < D; d++) {
                    ushort x = (ushort)((d & 1) ? mine[d >> 1] >> 16 : mine[d >> 1] & 0xFFFFu);
                    float y = part < 2 ? o1b_bf16_to_f32(Qs[ii * D + d]) : DO[ii * D + d];
                    sdot = o1b_add(sdot, o1b_mul(o1b_bf16_to_f32(x), y));
                }
                if (part < 2)
                    P[rr * AT_NQ + ((ii + rr) & (AT_NQ - 1))] = o1b_exp(o1b_sub(o1b_mul(sdot, sc), L[ii]));
                else
                    DP[rr * AT_NQ + ((ii + rr) & (AT_NQ - 1))] = sdot;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (row) {
            for (int ii = c0; ii <= c1; ii++) {
                float p = P[rr * AT_NQ + ((ii + rr) & (AT_NQ - 1))];
                float ds = o1b_mul(p, o1b_sub(DP[rr * AT_NQ + ((ii + rr) & (AT_NQ - 1))], DI[ii]));
                for (int c = 0; c < AT_NC; c++) {
                    int d = part + 4 * c;
                    if (d >= D) continue;
                    dka[c] = o1b_add(dka[c], o1b_mul(ds, o1b_bf16_to_f32(Qs[ii * D + d])));
                    dva[c] = o1b_add(dva[c], o1b_mul(p, DO[ii * D + d]));
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
}
for (int c = 0; c < AT_NC; c++) {
    int d = part + 4 * c;
    if (d >= D) continue;
    dk[orow * D + d] = row ? o1b_store(o1b_mul(dka[c], sc)) : 0.0f;
    dv[orow * D + d] = row ? o1b_store(dva[c]) : 0.0f;
}
