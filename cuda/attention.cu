/* attention.cu — causal, optionally sliding-window, grouped-query attention, forward and backward
 * (CONTRACT.md §6.6, §6.10; the C reference is cpu_ref/src/attention.c).
 *
 *   B = batch, T = sequence, H = query heads, G = kv heads (query head h reads g = h / (H/G)),
 *   D = head dim, W = window (0: causal only). Key j is visible to query i iff j <= i and
 *   (W == 0 or i - j < W). q (B,T,H,D), k and v (B,T,G,D) bf16; o, dout, dq (B,T,H,D),
 *   dk, dv (B,T,G,D), lse (B,H,T) fp32.
 *
 * The tiled kernels (forward, int8 forward, dq, dk/dv) take the head dim as the compile-time
 * constant ATTN_D (ops.py builds one module per D), so a row's accumulators are registers. A block
 * serves ATTN_ROWS = 64 rows (query rows of one (b, h) for the forward and dq, key rows of one
 * (b, g) for dk/dv) with 2 threads per row (the forward: ATTN_NT = 128) or 4 (the backward:
 * ATTN_BNT = 256): thread t works on row t % 64 as part t / 64. The rows' partners (64 keys of the
 * forward's block, or a backward tile of keys or queries) are staged in shared memory, the parts
 * compute the scores (and the backward's dp) of the row's pairs into shared memory, and then each
 * part keeps the running sums of its own columns d = part + (parts) c.
 * Every output element is still one accumulator, its terms added in the contract's order: the
 * tiles only decide which thread computes a product and where an operand is read from. A row takes
 * part only in the pairs it has (the visible ones; for the forward, the blocks it visits), so no
 * term outside the contract's sum is ever added, not even a zero.
 *
 * Forward: the online softmax over key blocks of ATTN_BLOCK = 64 keys aligned at absolute key
 * positions (a contract constant: it decides where the running sum is rescaled); a block of threads
 * takes the query block qb (rows 64 qb ... 64 qb + 63) and visits the key blocks from the first one
 * its first row sees to qb, staging each block's keys in sub-tiles of ATTN_FWD_TILE (bf16) or
 * ATTN_I8_TILE (int8) keys sized from D to fit 48 KiB of static shared memory (64 keys up to D = 256
 * and D = 148 respectively). Backward: two passes without atomics — dq per query row, dk and dv per
 * key row — recomputing s, p, dp, ds; the backward has no block size in the contract, so its tiles
 * (ATTN_DQ_TILE keys, ATTN_DKV_TILE queries) are sized to fit 48 KiB of static shared memory.
 *
 * The int8 forward (§6.10): the value rows are quantized once, one thread per key row
 * (o1b_attention_vquant: q_v int8, s_v fp32); the forward is the one above with each block's
 * P·V product replaced by t_j = p_j s_v[j], a per-(query row, block) scale s_p = max t_j / 127,
 * int8 weights q_p = level(t_j / s_p) and an exact int32 sum of q_p q_v, dequantized by s_p.
 */
#include "contract.cuh"

#define ATTN_BLOCK 64
/* A module loaded without a head dim (the value-row quantizer or Di alone) builds the tiled
 * kernels for D = 1 and never launches them. */
#ifndef ATTN_D
#define ATTN_D 1
#endif
#define ATTN_NT 128
#define ATTN_ROWS 64
#define ATTN_SHARED 49152                     /* bytes of static shared memory a block may hold */
/* the largest power of two <= 64 of tile rows costing `per` bytes each that fits ATTN_SHARED */
#define ATTN_FIT(per) ((64 * (per) <= ATTN_SHARED) ? 64 : (32 * (per) <= ATTN_SHARED) ? 32 \
                       : (16 * (per) <= ATTN_SHARED) ? 16 : 8)
/* dq: keys per tile (k and v rows bf16, p and dp of 64 query rows) */
#define ATTN_DQ_TILE ATTN_FIT(4 * ATTN_D + 2 * 4 * ATTN_ROWS)
/* dk/dv: queries per tile (q bf16 and dout fp32 rows, lse, Di, p and dp of 64 key rows) */
#define ATTN_DKV_TILE ATTN_FIT(6 * ATTN_D + 8 + 2 * 4 * ATTN_ROWS)
/* forward: keys staged per sub-tile of the 64-key block, the largest power of two <= 64 of key rows
 * costing `per` bytes each that fits ATTN_SHARED beside the block's fixed tiles (`fixed` bytes).
 * Only the staging is split: the block (where the running sum is rescaled) stays 64 keys and each
 * sum still takes its terms in the block's key order. */
#define ATTN_FIT_KEYS(per, fixed) ((fixed) + 64 * (per) <= ATTN_SHARED ? 64 : (fixed) + 32 * (per) <= ATTN_SHARED ? 32 \
    : (fixed) + 16 * (per) <= ATTN_SHARED ? 16 : (fixed) + 8 * (per) <= ATTN_SHARED ? 8                         \
    : (fixed) + 4 * (per) <= ATTN_SHARED ? 4 : (fixed) + 2 * (per) <= ATTN_SHARED ? 2 : 1)
/* bf16: k (then v) rows bf16; the fixed tile is S (fp32 scores of 64 rows x 64 keys) */
#define ATTN_FWD_FIXED (4 * ATTN_ROWS * ATTN_BLOCK)
#define ATTN_FWD_TILE ATTN_FIT_KEYS(2 * ATTN_D, ATTN_FWD_FIXED)
/* int8: k rows bf16 and q_v rows int8; fixed: S, s_v of the block (fp32), q_p (int8, 64 x 64) */
#define ATTN_I8_FIXED (4 * ATTN_ROWS * ATTN_BLOCK + 4 * ATTN_BLOCK + ATTN_ROWS * ATTN_BLOCK)
#define ATTN_I8_TILE ATTN_FIT_KEYS(3 * ATTN_D, ATTN_I8_FIXED)
#define ATTN_NW ((ATTN_D + 1) / 2)            /* words of a bf16 row packed two to a word */
#define ATTN_NC ((ATTN_D + 1) / 2)            /* forward: columns per part, d = part + 2c */
/* dq and dk/dv: four parts per row (ATTN_BNT = 256 threads), so that a thread holding a whole fp32
 * row for its dot products keeps a quarter of the row's accumulators: no spills at D = 128 */
#define ATTN_BP 4
#define ATTN_BNT (ATTN_BP * ATTN_ROWS)
#define ATTN_BNC ((ATTN_D + ATTN_BP - 1) / ATTN_BP)   /* columns per part: d = part + 4c */

/* a (row, partner) cell of a 64 x n score tile (n a power of two <= 64), rotated by the row so
 * that the 32 rows of a warp reading one partner hit 32 banks */
#define ATTN_CELL(r, c, n) ((r) * (n) + (((c) + (r)) & ((n) - 1)))

__device__ __forceinline__ i64 first_key(i64 i, i64 W) { return (W == 0 || i < W) ? 0 : i - W + 1; }
__device__ __forceinline__ i64 last_query(i64 j, i64 T, i64 W) {
    return W == 0 ? T - 1 : (j + W - 1 < T - 1 ? j + W - 1 : T - 1);
}
__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 imax(i64 a, i64 b) { return a > b ? a : b; }

/* element d of a bf16 row packed two to a word, widened */
__device__ __forceinline__ float packed_bf16(const u32 *w, int d) {
    return o1b_bf16_to_f32((bf16)((d & 1) ? w[d >> 1] >> 16 : w[d >> 1] & 0xFFFFu));
}
__device__ __forceinline__ void pack_row(u32 *w, const bf16 *row, bool ok) {
#pragma unroll
    for (int c = 0; c < ATTN_NW; c++) {
        u32 lo = ok ? (u32)row[2 * c] : 0u, hi = (ok && 2 * c + 1 < ATTN_D) ? (u32)row[2 * c + 1] : 0u;
        w[c] = lo | (hi << 16);
    }
}
/* dot = sum from +0 over d ascending of mul(a[d], b[d]): a packed bf16, b a bf16 row (shared) */
__device__ __forceinline__ float dot_packed(const u32 *a, const bf16 *b) {
    float acc = 0.0f;
#pragma unroll
    for (int d = 0; d < ATTN_D; d++) acc = o1b_add(acc, o1b_mul(packed_bf16(a, d), o1b_bf16_to_f32(b[d])));
    return acc;
}
/* the same with a loaded fp32 row a (its bits in words) and a bf16 row b */
__device__ __forceinline__ float dot_bits_bf16(const u32 *a, const bf16 *b) {
    float acc = 0.0f;
#pragma unroll
    for (int d = 0; d < ATTN_D; d++) acc = o1b_add(acc, o1b_mul(__uint_as_float(a[d]), o1b_bf16_to_f32(b[d])));
    return acc;
}
/* the same with a packed bf16 row a and a loaded fp32 row b (shared) */
__device__ __forceinline__ float dot_packed_f32(const u32 *a, const float *b) {
    float acc = 0.0f;
#pragma unroll
    for (int d = 0; d < ATTN_D; d++) acc = o1b_add(acc, o1b_mul(b[d], packed_bf16(a, d)));
    return acc;
}

/* rows [r0, r0 + n) of one head's bf16 rows into dst[n][ATTN_D] (row r starts at src + r * step);
 * rows past `last` are zeros (never read). */
__device__ __forceinline__ void stage_bf16(bf16 *dst, const bf16 *src, i64 step, i64 r0, int n, i64 last,
                                           int nthreads) {
    for (int e = threadIdx.x; e < n * ATTN_D; e += nthreads) {
        int rr = e / ATTN_D, d = e % ATTN_D;
        dst[e] = r0 + rr <= last ? src[(r0 + rr) * step + d] : (bf16)0;
    }
}

/* The forward of one query block, both precisions (I8: the §6.10 block product from qv, sv). The
 * block's keys are staged FT at a time (a power of two dividing 64): k for the scores, then v (or
 * q_v) for the block product, whose per-column sums run over the sub-tiles in key order. */
template <bool I8, int FT>
__device__ __forceinline__ void forward_block(i64 T, i64 H, i64 G, i64 W, float scale, const bf16 *q,
                                              const bf16 *k, const bf16 *v, const signed char *qv,
                                              const float *sv, float *o, float *lse,
                                              bf16 *Ks, float *S, signed char *QV, float *SV, signed char *QP) {
    const int t = threadIdx.x, rr = t % ATTN_ROWS, part = t / ATTN_ROWS;
    const int half = (FT + 1) / 2;                          /* a part's share of a sub-tile's keys */
    const i64 qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z, g = h / (H / G);
    const i64 i0 = qb * ATTN_BLOCK, ilast = imin(T - 1, i0 + ATTN_BLOCK - 1), i = i0 + rr;
    const bool row = i < T;
    const float sc = o1b_load(scale);
    const i64 qrow = ((b * T + i) * H + h) * ATTN_D, kstep = G * ATTN_D;
    const bf16 *kg = k + (b * T * G + g) * ATTN_D, *vg = I8 ? k : v + (b * T * G + g) * ATTN_D;
    u32 qw[ATTN_NW];
    pack_row(qw, q + (row ? qrow : 0), row);
    float acc[ATTN_NC];
#pragma unroll
    for (int c = 0; c < ATTN_NC; c++) acc[c] = 0.0f;
    float m = o1b_neg(o1b_inf()), l = 0.0f;
    const i64 jlo = row ? first_key(i, W) : 0;
    for (i64 kb = first_key(i0, W) / ATTN_BLOCK; kb <= ilast / ATTN_BLOCK; kb++) {
        const i64 kbase = kb * ATTN_BLOCK;
        /* the row visits the blocks from its first visible key's to its own */
        const bool visit = row && kb >= jlo / ATTN_BLOCK && kb <= i / ATTN_BLOCK;
        const int c0 = (int)(imax(kbase, jlo) - kbase), c1 = (int)(imin(kbase + ATTN_BLOCK - 1, i) - kbase);
        if (I8)
            for (int jj = t; jj < ATTN_BLOCK; jj += ATTN_NT)
                SV[jj] = kbase + jj <= ilast ? o1b_load(sv[(b * T + kbase + jj) * G + g]) : 0.0f;
        /* scores s_j = mul(dot(q_i, k_j), scale), this part's keys of each sub-tile */
#pragma unroll
        for (int s0 = 0; s0 < ATTN_BLOCK; s0 += FT) {
            stage_bf16(Ks, kg, kstep, kbase + s0, FT, ilast, ATTN_NT);
            __syncthreads();
            if (visit)
                for (int jj = s0 + part * half; jj < s0 + FT && jj < s0 + (part + 1) * half; jj++)
                    if (jj >= c0 && jj <= c1)
                        S[ATTN_CELL(rr, jj, ATTN_BLOCK)] = o1b_mul(dot_packed(qw, Ks + (jj - s0) * ATTN_D), sc);
            __syncthreads();
        }
        /* the scores are done with k: the first sub-tile of v (or q_v) */
        if (!I8) stage_bf16(Ks, vg, kstep, kbase, FT, ilast, ATTN_NT);
        else
            for (int e = t; e < FT * ATTN_D; e += ATTN_NT) {
                int jj = e / ATTN_D, d = e % ATTN_D;
                QV[e] = kbase + jj <= ilast ? qv[((b * T + kbase + jj) * G + g) * ATTN_D + d] : (signed char)0;
            }
        float mb = o1b_neg(o1b_inf());
        if (visit)
            for (int jj = c0; jj <= c1; jj++) mb = o1b_max(mb, S[ATTN_CELL(rr, jj, ATTN_BLOCK)]);
        const float m_new = o1b_max(m, mb);
        const float corr = o1b_exp(o1b_sub(m, m_new));    /* exp(-inf) = +0 on the first block */
        __syncthreads();                                    /* every score read before p replaces it */
        if (visit)
            for (int jj = part * (ATTN_BLOCK / 2); jj < (part + 1) * (ATTN_BLOCK / 2); jj++)
                if (jj >= c0 && jj <= c1) {
                    float *cell = &S[ATTN_CELL(rr, jj, ATTN_BLOCK)];
                    *cell = o1b_exp(o1b_sub(*cell, m_new));
                }
        __syncthreads();
        float ps = 0.0f;
        if (visit)
            for (int jj = c0; jj <= c1; jj++) ps = o1b_add(ps, S[ATTN_CELL(rr, jj, ATTN_BLOCK)]);
        /* i8: t_j = mul(p_j, s_v[j]) (recomputed where needed: same bits); a = max t_j (t_j >= +0) */
        float a = 0.0f, sp = 0.0f, inv = 0.0f;
        bool bad = false, zero = true;
        if (I8) {
            if (visit) {
                for (int jj = c0; jj <= c1; jj++) {
                    float tj = o1b_mul(S[ATTN_CELL(rr, jj, ATTN_BLOCK)], SV[jj]);
                    bad = bad || o1b_isnan(tj);
                    a = o1b_max(a, tj);                     /* a NaN t_j is passed over */
                }
                sp = o1b_div(a, 127.0f);
                zero = o1b_abs_bits(sp) == 0u;
                if (!bad && !zero) {
                    inv = o1b_div(1.0f, sp);
                    for (int jj = part * (ATTN_BLOCK / 2); jj < (part + 1) * (ATTN_BLOCK / 2); jj++)
                        if (jj >= c0 && jj <= c1)
                            QP[ATTN_CELL(rr, jj, ATTN_BLOCK)] =
                                o1b_level(o1b_mul(o1b_mul(S[ATTN_CELL(rr, jj, ATTN_BLOCK)], SV[jj]), inv), 127);
                }
            }
            __syncthreads();
        }
        /* the block product per column d = part + 2c: pv = sum over j ascending from +0 of
         * mul(p_j, v_jd) (bf16), or the exact int32 sum of q_p[j] q_v[j, d] (i8), over the sub-tiles */
        float pv[ATTN_NC];
        int ia[ATTN_NC];
#pragma unroll
        for (int s0 = 0; s0 < ATTN_BLOCK; s0 += FT) {
            if (s0 > 0) {
                __syncthreads();                            /* the previous sub-tile read */
                if (!I8) stage_bf16(Ks, vg, kstep, kbase + s0, FT, ilast, ATTN_NT);
                else
                    for (int e = t; e < FT * ATTN_D; e += ATTN_NT) {
                        int jj = e / ATTN_D, d = e % ATTN_D;
                        QV[e] = kbase + s0 + jj <= ilast ? qv[((b * T + kbase + s0 + jj) * G + g) * ATTN_D + d]
                                                         : (signed char)0;
                    }
                __syncthreads();
            }
            const int j0 = c0 > s0 ? c0 : s0, j1 = c1 < s0 + FT - 1 ? c1 : s0 + FT - 1;
            if (visit) {
#pragma unroll
                for (int c = 0; c < ATTN_NC; c++) {
                    const int d = part + 2 * c;
                    if (d < ATTN_D) {
                        /* the running sums in scalars, kept in the arrays only between sub-tiles
                         * (with one sub-tile the arrays are never used: no extra registers) */
                        float pc = s0 == 0 ? 0.0f : pv[c];
                        int ic = s0 == 0 ? 0 : ia[c];       /* exact: at most 64 terms of |.| <= 127^2 */
                        if (!I8) {
                            for (int jj = j0; jj <= j1; jj++)
                                pc = o1b_add(pc, o1b_mul(S[ATTN_CELL(rr, jj, ATTN_BLOCK)],
                                                         o1b_bf16_to_f32(Ks[(jj - s0) * ATTN_D + d])));
                        } else if (!bad && !zero) {
                            for (int jj = j0; jj <= j1; jj++)
                                ic += (int)QP[ATTN_CELL(rr, jj, ATTN_BLOCK)] * (int)QV[(jj - s0) * ATTN_D + d];
                        }
                        if (s0 + FT == ATTN_BLOCK) {        /* the block's last sub-tile */
                            const float p = !I8 ? pc : bad ? o1b_nan() : zero ? 0.0f : o1b_mul(o1b_i2f(ic), sp);
                            acc[c] = o1b_add(o1b_mul(acc[c], corr), p);
                        } else if (!I8) {
                            pv[c] = pc;
                        } else {
                            ia[c] = ic;
                        }
                    }
                }
            }
        }
        if (visit) {
            l = o1b_add(o1b_mul(l, corr), ps);
            m = m_new;
        }
        __syncthreads();                                    /* before the next block's staging */
    }
    if (row) {
        const float inv_l = o1b_div(1.0f, l);
#pragma unroll
        for (int c = 0; c < ATTN_NC; c++) {
            const int d = part + 2 * c;
            if (d < ATTN_D) o[qrow + d] = o1b_store(o1b_mul(acc[c], inv_l));
        }
        if (part == 0) lse[(b * H + h) * T + i] = o1b_store(o1b_add(m, o1b_log(l)));
    }
}

/* Grid (ceil(T / 64), H, B), blocks of ATTN_NT threads. */
extern "C" __global__ void o1b_attention_forward(i64 B, i64 T, i64 H, i64 G, i64 W, float scale,
                                                 const bf16 *q, const bf16 *k, const bf16 *v,
                                                 float *o, float *lse) {
    __shared__ bf16 Ks[ATTN_FWD_TILE * ATTN_D];             /* k of a sub-tile, then its v */
    __shared__ float S[ATTN_ROWS * ATTN_BLOCK];             /* scores, then p */
    forward_block<false, ATTN_FWD_TILE>(T, H, G, W, scale, q, k, v, 0, 0, o, lse, Ks, S, 0, 0, 0);
}

/* §6.10 forward; qv (B,T,G,D) int8 and sv (B,T,G) fp32 from o1b_attention_vquant. Per block: the
 * scores, mb, m_new, corr, p_j and ps of §6.6; then t_j = mul(p_j, s_v[j]); any t_j NaN: pv = NaN;
 * else a = max t_j (t_j >= +0), s_p = div(a, 127); s_p = +0: pv = +0; else q_p[j] =
 * level(mul(t_j, div(1, s_p))), pv[d] = mul(i2f(sum_j q_p[j] q_v[j,d]), s_p) with the sum in int32
 * (exact). Grid (ceil(T / 64), H, B), blocks of ATTN_NT threads. */
extern "C" __global__ void o1b_attention_forward_i8(i64 B, i64 T, i64 H, i64 G, i64 W, float scale,
                                                    const bf16 *q, const bf16 *k, const signed char *qv,
                                                    const float *sv, float *o, float *lse) {
    __shared__ bf16 Ks[ATTN_I8_TILE * ATTN_D];
    __shared__ float S[ATTN_ROWS * ATTN_BLOCK];
    __shared__ signed char QV[ATTN_I8_TILE * ATTN_D];
    __shared__ float SV[ATTN_BLOCK];
    __shared__ signed char QP[ATTN_ROWS * ATTN_BLOCK];
    forward_block<true, ATTN_I8_TILE>(T, H, G, W, scale, q, k, 0, qv, sv, o, lse, Ks, S, QV, SV, QP);
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

/* Pass 1: dq_i = mul(sum_{visible j asc} ds_ij k_j, scale), ds = mul(p, sub(dp, Di)),
 * p = exp(sub(mul(dot(q_i, k_j), scale), lse_i)), dp = dot(dout_i, v_j). Parts 0 and 1 of a row
 * compute its p (holding q_i packed), parts 2 and 3 its dp (holding dout_i), for the even and the
 * odd keys of a tile; then each of the four parts adds the terms of its columns.
 * Grid (ceil(T / 64), H, B), blocks of ATTN_BNT threads. */
extern "C" __global__ void o1b_attention_dq(i64 B, i64 T, i64 H, i64 G, i64 W, float scale,
                                            const float *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                                            const float *lse, const float *Di, float *dq) {
    const int NK = ATTN_DQ_TILE;
    __shared__ bf16 Ks[NK * ATTN_D], Vs[NK * ATTN_D];
    __shared__ float P[ATTN_ROWS * NK], DP[ATTN_ROWS * NK];
    const int t = threadIdx.x, rr = t % ATTN_ROWS, part = t / ATTN_ROWS, dp_role = part / 2, odd = part % 2;
    const i64 qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z, g = h / (H / G);
    const i64 i0 = qb * ATTN_ROWS, ilast = imin(T - 1, i0 + ATTN_ROWS - 1), i = i0 + rr;
    const bool row = i < T;
    const float sc = o1b_load(scale);
    const i64 base = ((b * T + i) * H + h) * ATTN_D, r = (b * H + h) * T + i;
    const float li = row ? o1b_load(lse[r]) : 0.0f, di = row ? Di[r] : 0.0f;
    u32 mine[ATTN_D];                   /* parts 0, 1: q_i packed (ATTN_NW words); 2, 3: dout_i loaded */
    if (!dp_role) {
        pack_row(mine, q + (row ? base : 0), row);
    } else {
#pragma unroll
        for (int d = 0; d < ATTN_D; d++) mine[d] = row ? __float_as_uint(o1b_load(dout[base + d])) : 0u;
    }
    float acc[ATTN_BNC];
#pragma unroll
    for (int c = 0; c < ATTN_BNC; c++) acc[c] = 0.0f;
    const i64 jlo = row ? first_key(i, W) : 0;
    const bf16 *kg = k + (b * T * G + g) * ATTN_D, *vg = v + (b * T * G + g) * ATTN_D;
    for (i64 j0 = first_key(i0, W) / NK * NK; j0 <= ilast; j0 += NK) {
        const int c0 = (int)(imax(j0, jlo) - j0), c1 = (int)(imin(j0 + NK - 1, i) - j0);
        stage_bf16(Ks, kg, G * ATTN_D, j0, NK, ilast, ATTN_BNT);
        stage_bf16(Vs, vg, G * ATTN_D, j0, NK, ilast, ATTN_BNT);
        __syncthreads();
        if (row)
            for (int jj = c0; jj <= c1; jj++) {
                if ((jj & 1) != odd) continue;
                if (!dp_role)
                    P[ATTN_CELL(rr, jj, NK)] =
                        o1b_exp(o1b_sub(o1b_mul(dot_packed(mine, Ks + jj * ATTN_D), sc), li));
                else
                    DP[ATTN_CELL(rr, jj, NK)] = dot_bits_bf16(mine, Vs + jj * ATTN_D);
            }
        __syncthreads();
        if (row)
            for (int jj = c0; jj <= c1; jj++) {
                const float ds = o1b_mul(P[ATTN_CELL(rr, jj, NK)], o1b_sub(DP[ATTN_CELL(rr, jj, NK)], di));
#pragma unroll
                for (int c = 0; c < ATTN_BNC; c++) {
                    const int d = part + ATTN_BP * c;
                    if (d < ATTN_D) acc[c] = o1b_add(acc[c], o1b_mul(ds, o1b_bf16_to_f32(Ks[jj * ATTN_D + d])));
                }
            }
        __syncthreads();
    }
    if (row) {
#pragma unroll
        for (int c = 0; c < ATTN_BNC; c++) {
            const int d = part + ATTN_BP * c;
            if (d < ATTN_D) dq[base + d] = o1b_store(o1b_mul(acc[c], sc));
        }
    }
}

/* Pass 2, per key row j of head g:
 *   dk_j = mul(sum_{h in group asc, then i = j .. ihi(j) asc} ds_hij q_hi, scale)
 *   dv_j =     sum_{the same order}                            p_hij dout_hi
 * Parts 0 and 1 of a row compute its p (holding k_j packed), parts 2 and 3 its dp (holding v_j
 * packed), for the even and the odd queries of a tile; then each of the four parts adds the terms
 * of its columns. Grid (ceil(T / 64), G, B), blocks of ATTN_BNT threads. */
extern "C" __global__ void o1b_attention_dkv(i64 B, i64 T, i64 H, i64 G, i64 W, float scale,
                                             const float *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                                             const float *lse, const float *Di, float *dk, float *dv) {
    const int NQ = ATTN_DKV_TILE;
    __shared__ bf16 Qs[NQ * ATTN_D];
    __shared__ float DO[NQ * ATTN_D], L[NQ], DI[NQ];
    __shared__ float P[ATTN_ROWS * NQ], DP[ATTN_ROWS * NQ];
    const int t = threadIdx.x, rr = t % ATTN_ROWS, part = t / ATTN_ROWS, dp_role = part / 2, odd = part % 2;
    const i64 kt = blockIdx.x, g = blockIdx.y, b = blockIdx.z, rep = H / G;
    const i64 j0 = kt * ATTN_ROWS, jlast = imin(T - 1, j0 + ATTN_ROWS - 1), j = j0 + rr;
    const bool row = j < T;
    const float sc = o1b_load(scale);
    const i64 kbase = ((b * T + j) * G + g) * ATTN_D;
    u32 mine[ATTN_NW];                  /* parts 0, 1: k_j packed; 2, 3: v_j packed */
    pack_row(mine, (dp_role ? v : k) + (row ? kbase : 0), row);
    float dka[ATTN_BNC], dva[ATTN_BNC];
#pragma unroll
    for (int c = 0; c < ATTN_BNC; c++) { dka[c] = 0.0f; dva[c] = 0.0f; }
    const i64 ihi = row ? last_query(j, T, W) : -1, imax_ = last_query(jlast, T, W);
    for (i64 h = g * rep; h < (g + 1) * rep; h++) {
        const bf16 *qh = q + (b * T * H + h) * ATTN_D;
        const float *dh = dout + (b * T * H + h) * ATTN_D, *lh = lse + (b * H + h) * T, *Dh = Di + (b * H + h) * T;
        for (i64 i0 = j0; i0 <= imax_; i0 += NQ) {
            const int c0 = (int)(imax(i0, j) - i0), c1 = (int)(imin(i0 + NQ - 1, ihi) - i0);
            stage_bf16(Qs, qh, H * ATTN_D, i0, NQ, imax_, ATTN_BNT);
            for (int e = t; e < NQ * ATTN_D; e += ATTN_BNT) {
                int ii = e / ATTN_D, d = e % ATTN_D;
                DO[e] = i0 + ii <= imax_ ? o1b_load(dh[(i0 + ii) * H * ATTN_D + d]) : 0.0f;
            }
            for (int ii = t; ii < NQ; ii += ATTN_BNT) {
                L[ii] = i0 + ii <= imax_ ? o1b_load(lh[i0 + ii]) : 0.0f;
                DI[ii] = i0 + ii <= imax_ ? Dh[i0 + ii] : 0.0f;
            }
            __syncthreads();
            if (row)
                for (int ii = c0; ii <= c1; ii++) {
                    if ((ii & 1) != odd) continue;
                    if (!dp_role)
                        P[ATTN_CELL(rr, ii, NQ)] =
                            o1b_exp(o1b_sub(o1b_mul(dot_packed(mine, Qs + ii * ATTN_D), sc), L[ii]));
                    else
                        DP[ATTN_CELL(rr, ii, NQ)] = dot_packed_f32(mine, DO + ii * ATTN_D);
                }
            __syncthreads();
            if (row)
                for (int ii = c0; ii <= c1; ii++) {
                    const float p = P[ATTN_CELL(rr, ii, NQ)];
                    const float ds = o1b_mul(p, o1b_sub(DP[ATTN_CELL(rr, ii, NQ)], DI[ii]));
#pragma unroll
                    for (int c = 0; c < ATTN_BNC; c++) {
                        const int d = part + ATTN_BP * c;
                        if (d < ATTN_D) {
                            dka[c] = o1b_add(dka[c], o1b_mul(ds, o1b_bf16_to_f32(Qs[ii * ATTN_D + d])));
                            dva[c] = o1b_add(dva[c], o1b_mul(p, DO[ii * ATTN_D + d]));
                        }
                    }
                }
            __syncthreads();
        }
    }
    if (row) {
#pragma unroll
        for (int c = 0; c < ATTN_BNC; c++) {
            const int d = part + ATTN_BP * c;
            if (d < ATTN_D) {
                dk[kbase + d] = o1b_store(o1b_mul(dka[c], sc));
                dv[kbase + d] = o1b_store(dva[c]);
            }
        }
    }
}
