// attention_dq — §6.6 backward pass 1, tiled: a threadgroup of AT_NT = 128 threads takes AT_ROWS = 32
// query rows i0 ... i0 + 31 of one (b, h) (thread t serves row t % 32 as part t / 32) and walks the
// keys its rows see in tiles of AT_NK keys (a power of two <= 64 that fits 32 KiB of threadgroup
// memory; the backward has no block size in the contract), k and v staged in threadgroup memory.
// For each visible pair: parts 0 and 1 compute p = exp(sub(mul(dot(q_i, k_j), scale), lse_i))
// (holding q_i), parts 2 and 3 dp = sum_d mul(dout_id, v_jd) (holding dout_i), for the even and the
// odd keys; then every thread takes, for j ascending, ds = mul(p, sub(dp, Di)) and adds mul(ds, k_jd)
// to the accumulator of each of its columns d = part + 4c (from +0); dq = mul(S_d, scale). Only
// visible pairs are added.
// lse and Di are (B,H,T). Tiles are numbered (b H + h) nqb + qb; a launch computes the tiles t0 ...
// t0 + groups - 1 and writes tile row (tile - t0) 32 + rr of dq (rows, D); rows past T are zeros.
// D is a template int. prm = T, H, G, W, t0. Grid (groups * 128), threadgroup 128.
#define AT_ROWS 32
#define AT_NT 128
#define AT_NW ((D + 1) / 2)
#define AT_NC ((D + 3) / 4)
// the tile: the largest power of two <= 64 of rows of 4 D + 256 bytes within 32 KiB
constexpr int AT_NK = 64 * (4 * D + 8 * AT_ROWS) <= 32768 ? 64 : 32 * (4 * D + 8 * AT_ROWS) <= 32768 ? 32
                    : 16 * (4 * D + 8 * AT_ROWS) <= 32768 ? 16 : 8;
threadgroup ushort Ks[AT_NK * D];
threadgroup ushort Vs[AT_NK * D];
threadgroup float P[AT_ROWS * AT_NK];
threadgroup float DP[AT_ROWS * AT_NK];
long T = prm[0], H = prm[1], G = prm[2], W = prm[3], t0 = prm[4];
long nqb = (T + AT_ROWS - 1) / AT_ROWS, tile = t0 + (long)threadgroup_position_in_grid.x;
int t = (int)thread_index_in_threadgroup, rr = t % AT_ROWS, part = t / AT_ROWS, odd = part % 2;
long qb = tile % nqb, h = (tile / nqb) % H, b = tile / (nqb * H), g = h / (H / G);
long i0 = qb * AT_ROWS, i = i0 + rr, ilast = i0 + AT_ROWS - 1 < T - 1 ? i0 + AT_ROWS - 1 : T - 1;
bool row = i < T;
long orow = (tile - t0) * AT_ROWS + rr, base = ((b * T + i) * H + h) * D, lrow = (b * H + h) * T + i;
float sc = o1b_load(scale[0]);
float li = row ? o1b_load(lse[lrow]) : 0.0f, di = row ? Di[lrow] : 0.0f;
uint mine[D];                       // parts 0, 1: q_i, bf16 packed two to a word; 2, 3: dout_i's bits
if (part < 2) {
    for (int c = 0; c < AT_NW; c++) {
        uint lo = row ? (uint)q[base + 2 * c] : 0u;
        uint hi = (row && 2 * c + 1 < D) ? (uint)q[base + 2 * c + 1] : 0u;
        mine[c] = lo | (hi << 16);
    }
} else {
    for (int d = 0; d < D; d++) mine[d] = row ? o1b_bits(o1b_load(dout[base + d])) : 0u;
}
float acc[AT_NC];                   // columns d = part + 4c
for (int c = 0; c < AT_NC; c++) acc[c] = 0.0f;
long jlo = !row ? 0 : (W == 0 || i < W) ? 0 : i - W + 1;
long jfirst = (W == 0 || i0 < W) ? 0 : i0 - W + 1;
for (long j0 = jfirst / AT_NK * AT_NK; j0 <= ilast; j0 += AT_NK) {
    int c0 = (int)((j0 > jlo ? j0 : jlo) - j0), c1 = (int)((j0 + AT_NK - 1 < i ? j0 + AT_NK - 1 : i) - j0);
    for (int e = t; e < AT_NK * D; e += AT_NT) {
        long j = j0 + e / D;
        Ks[e] = j <= ilast ? k[((b * T + j) * G + g) * D + e % D] : (ushort)0;
        Vs[e] = j <= ilast ? v[((b * T + j) * G + g) * D + e % D] : (ushort)0;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (row) {
        for (int jj = c0; jj <= c1; jj++) {
            if ((jj & 1) != odd) continue;
            float sdot = 0.0f;
            if (part < 2) {
                for (int d = 0; d < D; d++) {
                    ushort qd = (ushort)((d & 1) ? mine[d >> 1] >> 16 : mine[d >> 1] & 0xFFFFu);
                    sdot = o1b_add(sdot, o1b_mul(o1b_bf16_to_f32(qd), o1b_bf16_to_f32(Ks[jj * D + d])));
                }
                P[rr * AT_NK + ((jj + rr) & (AT_NK - 1))] = o1b_exp(o1b_sub(o1b_mul(sdot, sc), li));
            } else {
                for (int d = 0; d < D; d++)
                    sdot = o1b_add(sdot, o1b_mul(o1b_from_bits(mine[d]), o1b_bf16_to_f32(Vs[jj * D + d])));
                DP[rr * AT_NK + ((jj + rr) & (AT_NK - 1))] = sdot;
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (row) {
        for (int jj = c0; jj <= c1; jj++) {
            int cell = rr * AT_NK + ((jj + rr) & (AT_NK - 1));
            float ds = o1b_mul(P[cell], o1b_sub(DP[cell], di));
            for (int c = 0; c < AT_NC; c++) {
                int d = part + 4 * c;
                if (d < D) acc[c] = o1b_add(acc[c], o1b_mul(ds, o1b_bf16_to_f32(Ks[jj * D + d])));
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
for (int c = 0; c < AT_NC; c++) {
    int d = part + 4 * c;
    if (d < D) dq[orow * D + d] = row ? o1b_store(o1b_mul(acc[c], sc)) : 0.0f;
}
