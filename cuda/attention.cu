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
 * part keeps the running sums of its own columns d = part (columns per part) + c.
 * The arithmetic runs on hardware flush-to-zero steps where CONTRACT.md §6.6's implementation notes
 * prove them the contract's (ftz.cuh): the scores' bf16 dot products on fma.rn.ftz for a row and a
 * staged tile passing §6.1's guard, ATTN_NB partners at a time; the other products and sums on
 * mul.rn.ftz / add.rn.ftz for each term passing the product guard (its fp32 factor against the least
 * exponent of the staged tile), and exp on o1b_exp_ftz; anything else on the checked o1b_mul/o1b_add.
 * A staged tile's guard keys are folded while staging (warp shuffles, one shared word per warp).
 * Every output element is still one accumulator, its terms added in the contract's order: the
 * tiles only decide which thread computes a product and where an operand is read from. A row takes
 * part only in the pairs it has (the visible ones; for the forward, the blocks it visits), so no
 * term outside the contract's sum is ever added, not even a zero.
 *
 * Forward: the online softmax over key blocks of ATTN_BLOCK = 64 keys aligned at absolute key
 * positions (a contract constant: it decides where the running sum is rescaled); a block of threads
 * takes the query block qb (rows 64 qb ... 64 qb + 63) and visits the key blocks from the first one
 * its first row sees to qb, staging each block's keys (widened to fp32) in sub-tiles of ATTN_FWD_TILE
 * (bf16) or ATTN_I8_TILE (int8) keys sized from D to fit 48 KiB of static shared memory (64 keys up to
 * D = 127 and D = 88 respectively, 32 at the presets' D = 128). Backward: two passes without atomics — dq per query row, dk and dv per
 * key row — recomputing s, p, dp, ds; the backward has no block size in the contract, so its tiles
 * (ATTN_DQ_TILE keys, ATTN_DKV_TILE queries) are sized to fit 48 KiB of static shared memory.
 *
 * The int8 forward (§6.10): the value rows are quantized once, one thread per key row
 * (o1b_attention_vquant: q_v int8, s_v fp32); the forward is the one above with each block's
 * P·V product replaced by t_j = p_j s_v[j], a per-(query row, block) scale s_p = max t_j / 127,
 * int8 weights q_p = level(t_j / s_p) and an exact int32 sum of q_p q_v, dequantized by s_p.
 */
#include "ftz.cuh"

#define ATTN_BLOCK 64
/* A module loaded without a head dim (the value-row quantizer or Di alone) builds the tiled
 * kernels for D = 1 and never launches them. */
#ifndef ATTN_D
#define ATTN_D 1
#endif
#define ATTN_NT 128
#define ATTN_ROWS 64
#define ATTN_SHARED 49152                     /* bytes of static shared memory a block may hold */
#define ATTN_SLOT_BYTES (4 * 8)               /* the guard keys of a staged tile, one int per warp (<= 8) */
/* The backward's tiles: the largest power of two <= 64 of rows costing `per` bytes each that fits
 * ATTN_SHARED beside the guard slots, 8 at least (above that D the kernel does not compile). */
/* dq: keys per tile (k rows fp32, v rows bf16, p and dp of 64 query rows), beside the guard slots */
#define ATTN_DQ_PER (6 * ATTN_D + 2 * 4 * ATTN_ROWS)
#define ATTN_DQ_TILE ((ATTN_SLOT_BYTES + 64 * ATTN_DQ_PER <= ATTN_SHARED) ? 64                                \
    : (ATTN_SLOT_BYTES + 32 * ATTN_DQ_PER <= ATTN_SHARED) ? 32 : (ATTN_SLOT_BYTES + 16 * ATTN_DQ_PER <= ATTN_SHARED) ? 16 : 8)
/* dk/dv: queries per tile (q rows widened to fp32, dout rows fp32, lse, Di, p and dp of 64 key rows);
 * its 8-row minimum sets the head-dim limit (cuda/ops.py ATTN_MAX_HEAD_DIM) */
#define ATTN_DKV_PER (8 * ATTN_D + 8 + 2 * 4 * ATTN_ROWS)
#define ATTN_DKV_TILE ((ATTN_SLOT_BYTES + 64 * ATTN_DKV_PER <= ATTN_SHARED) ? 64                              \
    : (ATTN_SLOT_BYTES + 32 * ATTN_DKV_PER <= ATTN_SHARED) ? 32 : (ATTN_SLOT_BYTES + 16 * ATTN_DKV_PER <= ATTN_SHARED) ? 16 : 8)
/* forward: keys staged per sub-tile of the 64-key block, the largest power of two <= 64 of key rows
 * costing `per` bytes each that fits ATTN_SHARED beside the block's fixed tiles (`fixed` bytes).
 * Only the staging is split: the block (where the running sum is rescaled) stays 64 keys and each
 * sum still takes its terms in the block's key order. */
#define ATTN_FIT_KEYS(per, fixed) ((fixed) + 64 * (per) <= ATTN_SHARED ? 64 : (fixed) + 32 * (per) <= ATTN_SHARED ? 32 \
    : (fixed) + 16 * (per) <= ATTN_SHARED ? 16 : (fixed) + 8 * (per) <= ATTN_SHARED ? 8                         \
    : (fixed) + 4 * (per) <= ATTN_SHARED ? 4 : (fixed) + 2 * (per) <= ATTN_SHARED ? 2 : 1)
/* bf16: k (then v) rows widened to fp32; the fixed tile is S (fp32 scores of 64 rows x 64 keys) */
#define ATTN_FWD_FIXED (4 * ATTN_ROWS * ATTN_BLOCK + ATTN_SLOT_BYTES)
#define ATTN_FWD_TILE ATTN_FIT_KEYS(4 * ATTN_D, ATTN_FWD_FIXED)
/* int8: k rows fp32 and q_v rows int8; fixed: S, s_v of the block (fp32), q_p (int8, 64 x 64) */
#define ATTN_I8_FIXED (4 * ATTN_ROWS * ATTN_BLOCK + 4 * ATTN_BLOCK + ATTN_ROWS * ATTN_BLOCK + ATTN_SLOT_BYTES)
#define ATTN_I8_TILE ATTN_FIT_KEYS(5 * ATTN_D, ATTN_I8_FIXED)
#define ATTN_NW ((ATTN_D + 1) / 2)            /* words of a bf16 row packed two to a word */
#define ATTN_NC ((ATTN_D + 1) / 2)            /* forward: columns per part, d = part ATTN_NC + c */
/* dq and dk/dv: four parts per row (ATTN_BNT = 256 threads), each keeping a quarter of the row's
 * accumulators beside the row it holds for its dot products */
#define ATTN_BP 4
#define ATTN_BNT (ATTN_BP * ATTN_ROWS)
#define ATTN_BNC ((ATTN_D + ATTN_BP - 1) / ATTN_BP)   /* columns per part: d = part ATTN_BNC + c */
/* Values per shared-memory load in the inner loops: 16 bytes (8 bf16, 4 fp32) where every row (and
 * a part's first column) is 16-byte aligned, else 4 bytes (2 bf16) where it is word aligned, else one. */
#define ATTN_VB (ATTN_D % 8 == 0 ? 8 : ATTN_D % 2 == 0 ? 2 : 1)           /* bf16 partner rows, whole */
#define ATTN_VF (ATTN_D % 4 == 0 ? 4 : 1)                                 /* fp32 partner rows, whole */
#define ATTN_VCF(nc) (ATTN_D % 4 == 0 && (nc) % 4 == 0 ? 4 : 1)
#define ATTN_NB 4                             /* partner rows per register block of dot products */

/* a (row, partner) cell of a 64 x n score tile (n a power of two <= 64), rotated by the row so
 * that the 32 rows of a warp reading one partner hit 32 banks */
#define ATTN_CELL(r, c, n) ((r) * (n) + (((c) + (r)) & ((n) - 1)))

__device__ __forceinline__ i64 first_key(i64 i, i64 W) { return (W == 0 || i < W) ? 0 : i - W + 1; }
__device__ __forceinline__ i64 last_query(i64 j, i64 T, i64 W) {
    return W == 0 ? T - 1 : (j + W - 1 < T - 1 ? j + W - 1 : T - 1);
}
__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 imax(i64 a, i64 b) { return a > b ? a : b; }
__device__ __forceinline__ int imin32(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax32(int a, int b) { return a > b ? a : b; }

/* element d of a bf16 row packed two to a word, widened */
__device__ __forceinline__ float packed_bf16(const u32 *w, int d) {
    return o1b_bf16_to_f32((bf16)((d & 1) ? w[d >> 1] >> 16 : w[d >> 1] & 0xFFFFu));
}
/* the same without §2's flush: the fp32 bits of the widened bf16 (a hardware .ftz step flushes it) */
__device__ __forceinline__ u32 packed_bits(const u32 *w, int d) {
    return (d & 1) ? (w[d >> 1] & 0xFFFF0000u) : (w[d >> 1] << 16);
}
__device__ __forceinline__ void pack_row(u32 *w, const bf16 *row, bool ok) {
#pragma unroll
    for (int c = 0; c < ATTN_NW; c++) {
        u32 lo = ok ? (u32)row[2 * c] : 0u, hi = (ok && 2 * c + 1 < ATTN_D) ? (u32)row[2 * c + 1] : 0u;
        w[c] = lo | (hi << 16);
    }
}
/* the guard keys (ftz.cuh) of a packed bf16 row */
__device__ __forceinline__ void packed_keys(const u32 *w, int &lo, int &hi) {
    lo = 255; hi = 0;
#pragma unroll
    for (int d = 0; d < ATTN_D; d++) {
        const u32 u = packed_bits(w, d);
        lo = imin32(lo, o1b_key_lo(u)); hi = imax32(hi, o1b_key_hi(u));
    }
}
/* The checked dot products, the contract's steps: dot = sum from +0 over d ascending of mul(a[d], b[d]),
 * a an fp32 row of global memory (loaded: flushed) and b a bf16 row (shared) */
__device__ __forceinline__ float dot_load_bf16(const float *a, const bf16 *b) {
    float acc = 0.0f;
#pragma unroll
    for (int d = 0; d < ATTN_D; d++) acc = o1b_add(acc, o1b_mul(o1b_load(a[d]), o1b_bf16_to_f32(b[d])));
    return acc;
}
/* the same with a packed bf16 row a and a loaded fp32 row b (shared) */
__device__ __forceinline__ float dot_packed_f32(const u32 *a, const float *b) {
    float acc = 0.0f;
#pragma unroll
    for (int d = 0; d < ATTN_D; d++) acc = o1b_add(acc, o1b_mul(b[d], packed_bf16(a, d)));
    return acc;
}

/* V consecutive bf16 of shared memory (16-byte aligned for V = 8, word aligned for V = 2) as words;
 * element e of them as the fp32 bits of its widening (unflushed) */
template <int V>
__device__ __forceinline__ void ld_bf16(const bf16 *p, u32 *w) {
    if constexpr (V == 8) {
        const uint4 x = *reinterpret_cast<const uint4 *>(p);
        w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w;
    } else if constexpr (V == 2) {
        w[0] = *reinterpret_cast<const u32 *>(p);
    } else {
        w[0] = (u32)p[0];
    }
}
template <int V>
__device__ __forceinline__ u32 bf16_bits(const u32 *w, int e) {
    if constexpr (V == 1) return w[0] << 16;
    else return (e & 1) ? (w[e >> 1] & 0xFFFF0000u) : (w[e >> 1] << 16);
}
/* V consecutive fp32 of shared memory (16-byte aligned for V = 4) as their bits */
template <int V>
__device__ __forceinline__ void ld_f32(const float *p, u32 *w) {
    if constexpr (V == 4) {
        const uint4 x = *reinterpret_cast<const uint4 *>(p);
        w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w;
    } else {
        w[0] = __float_as_uint(p[0]);
    }
}

/* NB dot products at once (a register block): out[n] = sum from +0 over d ascending of a[d] b_n[d],
 * a a row in registers (packed bf16 words, or fp32 bits if A_F32), b_n = b + n * stride a partner row
 * in shared memory (bf16, or fp32 if B_F32). FMA: each step is fma.rn.ftz, which is the contract's
 * add(acc, mul(a, b)) for bf16 x bf16 under the §6.1 tile guard (o1b_fma_guard); else each step is
 * add.rn.ftz(acc, mul.rn.ftz(a, b)), the contract's under the product guard (ftz.cuh). Each dot
 * product is one accumulator taking its terms d ascending; the block only shares the loads of a[d]. */
template <int NB, bool A_F32, bool B_F32, bool FMA>
__device__ __forceinline__ void dots_fast(const u32 *a, const void *b, int stride, float *out) {
    constexpr int V = B_F32 ? ATTN_VF : ATTN_VB;
    constexpr int NWD = B_F32 ? V : (V + 1) / 2;
    float acc[NB];
#pragma unroll
    for (int n = 0; n < NB; n++) acc[n] = 0.0f;
#pragma unroll
    for (int d0 = 0; d0 < ATTN_D; d0 += V) {
        u32 w[NB][NWD];
#pragma unroll
        for (int n = 0; n < NB; n++) {
            if constexpr (B_F32) ld_f32<V>((const float *)b + n * stride + d0, w[n]);
            else ld_bf16<V>((const bf16 *)b + n * stride + d0, w[n]);
        }
#pragma unroll
        for (int e = 0; e < V; e++) {
            const float x = __uint_as_float(A_F32 ? a[d0 + e] : packed_bits(a, d0 + e));
#pragma unroll
            for (int n = 0; n < NB; n++) {
                const float y = __uint_as_float(B_F32 ? w[n][e] : bf16_bits<V>(w[n], e));
                acc[n] = FMA ? o1b_fma_ftz(x, y, acc[n]) : o1b_add_ftz(acc[n], o1b_mul_ftz(x, y));
            }
        }
    }
#pragma unroll
    for (int n = 0; n < NB; n++) out[n] = acc[n];
}

/* The guard keys of the values a warp staged, min lo / max hi / min lo2 over its 32 lanes, written by
 * lane 0 to slot[warp] as lo | hi << 8 | lo2 << 18 (lo, lo2 <= 255, hi <= 1000). Every lane of every
 * warp of the block calls it; the block reads the slots after a barrier (keys_from_slots). */
__device__ __forceinline__ void keys_to_slot(int lo, int hi, int lo2, int *slot) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        const int a = __shfl_sync(0xFFFFFFFFu, lo, lane ^ m), b = __shfl_sync(0xFFFFFFFFu, hi, lane ^ m),
                  c = __shfl_sync(0xFFFFFFFFu, lo2, lane ^ m);
        lo = imin32(lo, a); hi = imax32(hi, b); lo2 = imin32(lo2, c);
    }
    if (lane == 0) slot[threadIdx.x >> 5] = lo | (hi << 8) | (lo2 << 18);
}
__device__ __forceinline__ void keys_from_slots(const int *slot, int nwarps, int &lo, int &hi, int &lo2) {
    lo = 255; hi = 0; lo2 = 255;
    for (int w = 0; w < nwarps; w++) {
        const int x = slot[w];
        lo = imin32(lo, x & 0xFF); hi = imax32(hi, (x >> 8) & 0x3FF); lo2 = imin32(lo2, (x >> 18) & 0xFF);
    }
}

/* rows [r0, r0 + n) of one head's bf16 rows into dst[n][ATTN_D] (row r starts at src + r * step);
 * rows past `last` are zeros (never read). The staging thread's guard keys of what it stored are
 * folded into lo, hi (zeros are left out of them). */
__device__ __forceinline__ void stage_bf16(bf16 *dst, const bf16 *src, i64 step, i64 r0, int n, i64 last,
                                           int nthreads, int &lo, int &hi) {
    for (int e = threadIdx.x; e < n * ATTN_D; e += nthreads) {
        int rr = e / ATTN_D, d = e % ATTN_D;
        const bf16 x = r0 + rr <= last ? src[(r0 + rr) * step + d] : (bf16)0;
        dst[e] = x;
        lo = imin32(lo, o1b_key_lo((u32)x << 16)); hi = imax32(hi, o1b_key_hi((u32)x << 16));
    }
}

/* the same into fp32 rows, widened by §2 (flushed): the partners of fused steps (no unpacking in the
 * inner loops) and of the checked ones alike */
__device__ __forceinline__ void stage_f32(float *dst, const bf16 *src, i64 step, i64 r0, int n, i64 last,
                                          int nthreads, int &lo, int &hi) {
    for (int e = threadIdx.x; e < n * ATTN_D; e += nthreads) {
        int rr = e / ATTN_D, d = e % ATTN_D;
        const bf16 x = r0 + rr <= last ? src[(r0 + rr) * step + d] : (bf16)0;
        dst[e] = o1b_bf16_to_f32(x);
        lo = imin32(lo, o1b_key_lo((u32)x << 16)); hi = imax32(hi, o1b_key_hi((u32)x << 16));
    }
}

/* The forward of one query block, both precisions (I8: the §6.10 block product from qv, sv). The
 * block's keys are staged FT at a time (a power of two dividing 64): k for the scores, then v (or
 * q_v) for the block product, whose per-column sums run over the sub-tiles in key order. A part owns
 * the columns d = part ATTN_NC + c. The scores of a row's keys are computed ATTN_NB at a time on
 * fma.rn.ftz where the row's q and the sub-tile's k pass §6.1's guard, the bf16 block product on
 * mul.rn.ftz / add.rn.ftz for each key whose p passes the product guard with the sub-tile's v; the
 * contract's checked mul and add everywhere else (CONTRACT.md §6.6 implementation notes). */
template <bool I8, int FT>
__device__ __forceinline__ void forward_block(i64 T, i64 H, i64 G, i64 W, float scale, const bf16 *q,
                                              const bf16 *k, const bf16 *v, const signed char *qv,
                                              const float *sv, float *o, float *lse,
                                              float *Ks, float *S, signed char *QV, float *SV, signed char *QP,
                                              int *SLOT) {
    const int t = threadIdx.x, rr = t % ATTN_ROWS, part = t / ATTN_ROWS;
    const int half = (FT + 1) / 2;                          /* a part's share of a sub-tile's keys */
    const i64 qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z, g = h / (H / G);
    const i64 i0 = qb * ATTN_BLOCK, ilast = imin(T - 1, i0 + ATTN_BLOCK - 1), i = i0 + rr;
    const bool row = i < T;
    const float sc = o1b_load(scale);
    const i64 qrow = ((b * T + i) * H + h) * ATTN_D, kstep = G * ATTN_D;
    const bf16 *kg = k + (b * T * G + g) * ATTN_D, *vg = I8 ? k : v + (b * T * G + g) * ATTN_D;
    int qlo, qhi;
    {
        u32 qw[ATTN_NW];
        pack_row(qw, q + (row ? qrow : 0), row);
        packed_keys(qw, qlo, qhi);
    }
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
        /* q is read again for each block (from cache) rather than held through the block product */
        u32 qw[ATTN_NW];
        pack_row(qw, q + (row ? qrow : 0), row);
        /* scores s_j = mul(dot(q_i, k_j), scale), this part's keys of each sub-tile */
#pragma unroll
        for (int s0 = 0; s0 < ATTN_BLOCK; s0 += FT) {
            int lo = 255, hi = 0;
            stage_f32(Ks, kg, kstep, kbase + s0, FT, ilast, ATTN_NT, lo, hi);
            keys_to_slot(lo, hi, 255, SLOT);
            __syncthreads();
            if (visit) {
                int klo, khi, unused;
                keys_from_slots(SLOT, ATTN_NT / 32, klo, khi, unused);
                const int ja = c0 > s0 + part * half ? c0 : s0 + part * half;
                const int jend = s0 + FT < s0 + (part + 1) * half ? s0 + FT : s0 + (part + 1) * half;
                const int jb = c1 < jend - 1 ? c1 : jend - 1;
                if (o1b_fma_guard(qlo, qhi, klo, khi)) {
                    int jj = ja;
                    for (; jj + ATTN_NB - 1 <= jb; jj += ATTN_NB) {
                        float d4[ATTN_NB];
                        dots_fast<ATTN_NB, false, true, true>(qw, Ks + (jj - s0) * ATTN_D, ATTN_D, d4);
#pragma unroll
                        for (int n = 0; n < ATTN_NB; n++) S[ATTN_CELL(rr, jj + n, ATTN_BLOCK)] = o1b_mul_inl(d4[n], sc);
                    }
                    for (; jj <= jb; jj++) {
                        float d1[1];
                        dots_fast<1, false, true, true>(qw, Ks + (jj - s0) * ATTN_D, ATTN_D, d1);
                        S[ATTN_CELL(rr, jj, ATTN_BLOCK)] = o1b_mul_inl(d1[0], sc);
                    }
                } else {
                    for (int jj = ja; jj <= jb; jj++)
                        S[ATTN_CELL(rr, jj, ATTN_BLOCK)] = o1b_mul(dot_packed_f32(qw, Ks + (jj - s0) * ATTN_D), sc);
                }
            }
            __syncthreads();
        }
        /* the scores are done with k: the first sub-tile of v (or q_v) */
        {
            int lo = 255, hi = 0;
            if (!I8) stage_f32(Ks, vg, kstep, kbase, FT, ilast, ATTN_NT, lo, hi);
            else
                for (int e = t; e < FT * ATTN_D; e += ATTN_NT) {
                    int jj = e / ATTN_D, d = e % ATTN_D;
                    QV[e] = kbase + jj <= ilast ? qv[((b * T + kbase + jj) * G + g) * ATTN_D + d] : (signed char)0;
                }
            keys_to_slot(lo, hi, 255, SLOT);
        }
        float mb = o1b_neg(o1b_inf());
        if (visit)
            for (int jj = c0; jj <= c1; jj++) mb = o1b_max(mb, S[ATTN_CELL(rr, jj, ATTN_BLOCK)]);
        const float m_new = o1b_max(m, mb);
        const float corr = o1b_exp_ftz(o1b_sub(m, m_new));    /* exp(-inf) = +0 on the first block */
        __syncthreads();                                    /* every score read before p replaces it */
        if (visit)
            for (int jj = part * (ATTN_BLOCK / 2); jj < (part + 1) * (ATTN_BLOCK / 2); jj++)
                if (jj >= c0 && jj <= c1) {
                    float *cell = &S[ATTN_CELL(rr, jj, ATTN_BLOCK)];
                    *cell = o1b_exp_ftz(o1b_sub(*cell, m_new));
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
        /* the block product per column d = part ATTN_NC + c: pv = sum over j ascending from +0 of
         * mul(p_j, v_jd) (bf16), or the exact int32 sum of q_p[j] q_v[j, d] (i8), over the sub-tiles */
        float pv[ATTN_NC];
        int ia[ATTN_NC];
#pragma unroll
        for (int c = 0; c < ATTN_NC; c++) { pv[c] = 0.0f; ia[c] = 0; }
        const int cbase = part * ATTN_NC;
#pragma unroll
        for (int s0 = 0; s0 < ATTN_BLOCK; s0 += FT) {
            if (s0 > 0) {
                __syncthreads();                            /* the previous sub-tile read */
                int lo = 255, hi = 0;
                if (!I8) stage_f32(Ks, vg, kstep, kbase + s0, FT, ilast, ATTN_NT, lo, hi);
                else
                    for (int e = t; e < FT * ATTN_D; e += ATTN_NT) {
                        int jj = e / ATTN_D, d = e % ATTN_D;
                        QV[e] = kbase + s0 + jj <= ilast ? qv[((b * T + kbase + s0 + jj) * G + g) * ATTN_D + d]
                                                         : (signed char)0;
                    }
                keys_to_slot(lo, hi, 255, SLOT);
            }
            __syncthreads();                                /* the sub-tile and its keys staged */
            const int j0 = c0 > s0 ? c0 : s0, j1 = c1 < s0 + FT - 1 ? c1 : s0 + FT - 1;
            if (visit && !I8) {
                int vlo, unused, unused2;
                keys_from_slots(SLOT, ATTN_NT / 32, vlo, unused, unused2);
                constexpr int VA = ATTN_VCF(ATTN_NC);
                for (int jj = j0; jj <= j1; jj++) {
                    const float pj = S[ATTN_CELL(rr, jj, ATTN_BLOCK)];
                    const float *vr = Ks + (jj - s0) * ATTN_D + cbase;
                    if (o1b_key_lo(__float_as_uint(pj)) + vlo >= 128) {
#pragma unroll
                        for (int c0v = 0; c0v < ATTN_NC; c0v += VA) {
                            u32 w[VA];
                            if (ATTN_D % 2 == 0 || cbase + c0v < ATTN_D) ld_f32<VA>(vr + c0v, w);
#pragma unroll
                            for (int e = 0; e < VA; e++)
                                if (ATTN_D % 2 == 0 || cbase + c0v + e < ATTN_D)
                                    pv[c0v + e] = o1b_add_ftz(pv[c0v + e], o1b_mul_ftz(pj, __uint_as_float(w[e])));
                        }
                    } else {
#pragma unroll
                        for (int c = 0; c < ATTN_NC; c++)
                            if (ATTN_D % 2 == 0 || cbase + c < ATTN_D) pv[c] = o1b_add(pv[c], o1b_mul(pj, vr[c]));
                    }
                }
            }
            if (visit && I8 && !bad && !zero) {
#pragma unroll
                for (int c = 0; c < ATTN_NC; c++)
                    if (ATTN_D % 2 == 0 || cbase + c < ATTN_D) {
                        int ic = ia[c];                     /* exact: at most 64 terms of |.| <= 127^2 */
                        for (int jj = j0; jj <= j1; jj++)
                            ic += (int)QP[ATTN_CELL(rr, jj, ATTN_BLOCK)] * (int)QV[(jj - s0) * ATTN_D + cbase + c];
                        ia[c] = ic;
                    }
            }
        }
        if (visit) {
#pragma unroll
            for (int c = 0; c < ATTN_NC; c++)
                if (ATTN_D % 2 == 0 || cbase + c < ATTN_D) {
                    const float p = !I8 ? pv[c] : bad ? o1b_nan() : zero ? 0.0f : o1b_mul(o1b_i2f(ia[c]), sp);
                    acc[c] = o1b_add(o1b_mul(acc[c], corr), p);
                }
            l = o1b_add(o1b_mul(l, corr), ps);
            m = m_new;
        }
        __syncthreads();                                    /* before the next block's staging */
    }
    if (row) {
        const float inv_l = o1b_div(1.0f, l);
#pragma unroll
        for (int c = 0; c < ATTN_NC; c++) {
            const int d = part * ATTN_NC + c;
            if (d < ATTN_D) o[qrow + d] = o1b_store(o1b_mul(acc[c], inv_l));
        }
        if (part == 0) lse[(b * H + h) * T + i] = o1b_store(o1b_add(m, o1b_log(l)));
    }
}

/* Grid (ceil(T / 64), H, B), blocks of ATTN_NT threads. */
extern "C" __global__ void o1b_attention_forward(i64 B, i64 T, i64 H, i64 G, i64 W, float scale,
                                                 const bf16 *q, const bf16 *k, const bf16 *v,
                                                 float *o, float *lse) {
    __shared__ __align__(16) float Ks[ATTN_FWD_TILE * ATTN_D];  /* k of a sub-tile, then its v (fp32) */
    __shared__ float S[ATTN_ROWS * ATTN_BLOCK];             /* scores, then p */
    __shared__ int SLOT[ATTN_NT / 32];                      /* the staged sub-tile's guard keys per warp */
    forward_block<false, ATTN_FWD_TILE>(T, H, G, W, scale, q, k, v, 0, 0, o, lse, Ks, S, 0, 0, 0, SLOT);
}

/* §6.10 forward; qv (B,T,G,D) int8 and sv (B,T,G) fp32 from o1b_attention_vquant. Per block: the
 * scores, mb, m_new, corr, p_j and ps of §6.6; then t_j = mul(p_j, s_v[j]); any t_j NaN: pv = NaN;
 * else a = max t_j (t_j >= +0), s_p = div(a, 127); s_p = +0: pv = +0; else q_p[j] =
 * level(mul(t_j, div(1, s_p))), pv[d] = mul(i2f(sum_j q_p[j] q_v[j,d]), s_p) with the sum in int32
 * (exact). Grid (ceil(T / 64), H, B), blocks of ATTN_NT threads. */
extern "C" __global__ void o1b_attention_forward_i8(i64 B, i64 T, i64 H, i64 G, i64 W, float scale,
                                                    const bf16 *q, const bf16 *k, const signed char *qv,
                                                    const float *sv, float *o, float *lse) {
    __shared__ __align__(16) float Ks[ATTN_I8_TILE * ATTN_D];
    __shared__ float S[ATTN_ROWS * ATTN_BLOCK];
    __shared__ signed char QV[ATTN_I8_TILE * ATTN_D];
    __shared__ float SV[ATTN_BLOCK];
    __shared__ signed char QP[ATTN_ROWS * ATTN_BLOCK];
    __shared__ int SLOT[ATTN_NT / 32];
    forward_block<true, ATTN_I8_TILE>(T, H, G, W, scale, q, k, 0, qv, sv, o, lse, Ks, S, QV, SV, QP, SLOT);
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
 * odd keys of a tile, ATTN_NB keys at a time on the hardware .ftz steps where the guards pass (p:
 * §6.1's, q_i against the tile's k; dp: the product guard, dout_i against the tile's v); then each of
 * the four parts adds the terms of its columns d = part ATTN_BNC + c, on mul.rn.ftz / add.rn.ftz for
 * each key whose ds passes the product guard with the tile's k.
 * Grid (ceil(T / 64), H, B), blocks of ATTN_BNT threads. */
extern "C" __global__ void o1b_attention_dq(i64 B, i64 T, i64 H, i64 G, i64 W, float scale,
                                            const float *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                                            const float *lse, const float *Di, float *dq) {
    const int NK = ATTN_DQ_TILE;
    __shared__ __align__(16) float Ks[NK * ATTN_D];   /* widened (fp32): no unpacking in the inner loops */
    __shared__ __align__(16) bf16 Vs[NK * ATTN_D];
    __shared__ float P[ATTN_ROWS * NK], DP[ATTN_ROWS * NK];
    __shared__ int SLOT[ATTN_BNT / 32];
    const int t = threadIdx.x, rr = t % ATTN_ROWS, part = t / ATTN_ROWS, dp_role = part / 2, odd = part % 2;
    const i64 qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z, g = h / (H / G);
    const i64 i0 = qb * ATTN_ROWS, ilast = imin(T - 1, i0 + ATTN_ROWS - 1), i = i0 + rr;
    const bool row = i < T;
    const float sc = o1b_load(scale);
    const i64 base = ((b * T + i) * H + h) * ATTN_D, r = (b * H + h) * T + i;
    const float li = row ? o1b_load(lse[r]) : 0.0f, di = row ? Di[r] : 0.0f;
    /* parts 0, 1: q_i packed in registers; 2, 3: dout_i read where used (from cache: a whole fp32 row
     * in registers beside q_i's and the accumulators would spill) */
    u32 mine[ATTN_NW];
    const u32 *drow = reinterpret_cast<const u32 *>(dout + (row ? base : 0));
    int mlo = 255, mhi = 0;             /* the row's guard keys */
    if (!dp_role) {
        pack_row(mine, q + (row ? base : 0), row);
        packed_keys(mine, mlo, mhi);
    } else {
#pragma unroll
        for (int c = 0; c < ATTN_NW; c++) mine[c] = 0u;
        if (row)
            for (int d = 0; d < ATTN_D; d++) mlo = imin32(mlo, o1b_key_lo(drow[d]));
    }
    float acc[ATTN_BNC];
#pragma unroll
    for (int c = 0; c < ATTN_BNC; c++) acc[c] = 0.0f;
    const int cbase = part * ATTN_BNC;
    const i64 jlo = row ? first_key(i, W) : 0;
    const bf16 *kg = k + (b * T * G + g) * ATTN_D, *vg = v + (b * T * G + g) * ATTN_D;
    for (i64 j0 = first_key(i0, W) / NK * NK; j0 <= ilast; j0 += NK) {
        const int c0 = (int)(imax(j0, jlo) - j0), c1 = (int)(imin(j0 + NK - 1, i) - j0);
        {
            int klo = 255, khi = 0, vlo = 255, vhi = 0;
            stage_f32(Ks, kg, G * ATTN_D, j0, NK, ilast, ATTN_BNT, klo, khi);
            stage_bf16(Vs, vg, G * ATTN_D, j0, NK, ilast, ATTN_BNT, vlo, vhi);
            keys_to_slot(klo, khi, vlo, SLOT);
        }
        __syncthreads();
        int klo, khi, vlo;
        keys_from_slots(SLOT, ATTN_BNT / 32, klo, khi, vlo);
        if (row) {
            const int ja = c0 + ((c0 & 1) != odd), jb = c1;      /* this part's keys: ja, ja + 2, ... <= jb */
            const bool fast = !dp_role ? o1b_fma_guard(mlo, mhi, klo, khi) : mlo + vlo >= 128;
            if (fast) {
                int jj = ja;
                for (; jj + 2 * (ATTN_NB - 1) <= jb; jj += 2 * ATTN_NB) {
                    float d4[ATTN_NB];
                    if (!dp_role) dots_fast<ATTN_NB, false, true, true>(mine, Ks + jj * ATTN_D, 2 * ATTN_D, d4);
                    else dots_fast<ATTN_NB, true, false, false>(drow, Vs + jj * ATTN_D, 2 * ATTN_D, d4);
#pragma unroll
                    for (int n = 0; n < ATTN_NB; n++) {
                        if (!dp_role) P[ATTN_CELL(rr, jj + 2 * n, NK)] = o1b_exp_ftz(o1b_sub(o1b_mul_inl(d4[n], sc), li));
                        else DP[ATTN_CELL(rr, jj + 2 * n, NK)] = d4[n];
                    }
                }
                for (; jj <= jb; jj += 2) {
                    float d1[1];
                    if (!dp_role) {
                        dots_fast<1, false, true, true>(mine, Ks + jj * ATTN_D, ATTN_D, d1);
                        P[ATTN_CELL(rr, jj, NK)] = o1b_exp_ftz(o1b_sub(o1b_mul_inl(d1[0], sc), li));
                    } else {
                        dots_fast<1, true, false, false>(drow, Vs + jj * ATTN_D, ATTN_D, d1);
                        DP[ATTN_CELL(rr, jj, NK)] = d1[0];
                    }
                }
            } else {
                for (int jj = ja; jj <= jb; jj += 2) {
                    if (!dp_role)
                        P[ATTN_CELL(rr, jj, NK)] = o1b_exp_ftz(o1b_sub(o1b_mul_inl(dot_packed_f32(mine, Ks + jj * ATTN_D), sc), li));
                    else
                        DP[ATTN_CELL(rr, jj, NK)] = dot_load_bf16(dout + base, Vs + jj * ATTN_D);
                }
            }
        }
        __syncthreads();
        if (row) {
            constexpr int VA = ATTN_VCF(ATTN_BNC);
            for (int jj = c0; jj <= c1; jj++) {
                const float ds = o1b_mul_inl(P[ATTN_CELL(rr, jj, NK)], o1b_sub(DP[ATTN_CELL(rr, jj, NK)], di));
                const float *kr = Ks + jj * ATTN_D + cbase;
                if (o1b_key_lo(__float_as_uint(ds)) + klo >= 128) {
#pragma unroll
                    for (int c0v = 0; c0v < ATTN_BNC; c0v += VA) {
                        u32 w[VA];
                        if (ATTN_D % ATTN_BP == 0 || cbase + c0v < ATTN_D) ld_f32<VA>(kr + c0v, w);
#pragma unroll
                        for (int e = 0; e < VA; e++)
                            if (ATTN_D % ATTN_BP == 0 || cbase + c0v + e < ATTN_D)
                                acc[c0v + e] = o1b_add_ftz(acc[c0v + e], o1b_mul_ftz(ds, __uint_as_float(w[e])));
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < ATTN_BNC; c++)
                        if (ATTN_D % ATTN_BP == 0 || cbase + c < ATTN_D) acc[c] = o1b_add(acc[c], o1b_mul(ds, kr[c]));
                }
            }
        }
        __syncthreads();
    }
    if (row) {
#pragma unroll
        for (int c = 0; c < ATTN_BNC; c++) {
            const int d = cbase + c;
            if (d < ATTN_D) dq[base + d] = o1b_store(o1b_mul(acc[c], sc));
        }
    }
}

/* Pass 2, per key row j of head g:
 *   dk_j = mul(sum_{h in group asc, then i = j .. ihi(j) asc} ds_hij q_hi, scale)
 *   dv_j =     sum_{the same order}                            p_hij dout_hi
 * Parts 0 and 1 of a row compute its p (holding k_j packed), parts 2 and 3 its dp (holding v_j
 * packed), for the even and the odd queries of a tile, ATTN_NB at a time on the hardware .ftz steps
 * where the guards pass (p: §6.1's, k_j against the tile's q; dp: the product guard, v_j against the
 * tile's dout); then each of the four parts adds the terms of its columns d = part ATTN_BNC + c, on
 * mul.rn.ftz / add.rn.ftz for each query whose ds (for dk) or p (for dv) passes the product guard
 * with the tile's q or dout. Grid (ceil(T / 64), G, B), blocks of ATTN_BNT threads. */
extern "C" __global__ void o1b_attention_dkv(i64 B, i64 T, i64 H, i64 G, i64 W, float scale,
                                             const float *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                                             const float *lse, const float *Di, float *dk, float *dv) {
    const int NQ = ATTN_DKV_TILE;
    __shared__ __align__(16) float Qs[NQ * ATTN_D];   /* widened (fp32): no unpacking in the inner loops */
    __shared__ __align__(16) float DO[NQ * ATTN_D];
    __shared__ float L[NQ], DI[NQ];
    __shared__ float P[ATTN_ROWS * NQ], DP[ATTN_ROWS * NQ];
    __shared__ int SLOT[ATTN_BNT / 32];
    const int t = threadIdx.x, rr = t % ATTN_ROWS, part = t / ATTN_ROWS, dp_role = part / 2, odd = part % 2;
    const i64 kt = blockIdx.x, g = blockIdx.y, b = blockIdx.z, rep = H / G;
    const i64 j0 = kt * ATTN_ROWS, jlast = imin(T - 1, j0 + ATTN_ROWS - 1), j = j0 + rr;
    const bool row = j < T;
    const float sc = o1b_load(scale);
    const i64 kbase = ((b * T + j) * G + g) * ATTN_D;
    u32 mine[ATTN_NW];                  /* parts 0, 1: k_j packed; 2, 3: v_j packed */
    pack_row(mine, (dp_role ? v : k) + (row ? kbase : 0), row);
    int mlo, mhi;
    packed_keys(mine, mlo, mhi);
    float dka[ATTN_BNC], dva[ATTN_BNC];
#pragma unroll
    for (int c = 0; c < ATTN_BNC; c++) { dka[c] = 0.0f; dva[c] = 0.0f; }
    const int cbase = part * ATTN_BNC;
    const i64 ihi = row ? last_query(j, T, W) : -1, imax_ = last_query(jlast, T, W);
    for (i64 h = g * rep; h < (g + 1) * rep; h++) {
        const bf16 *qh = q + (b * T * H + h) * ATTN_D;
        const float *dh = dout + (b * T * H + h) * ATTN_D, *lh = lse + (b * H + h) * T, *Dh = Di + (b * H + h) * T;
        for (i64 i0 = j0; i0 <= imax_; i0 += NQ) {
            const int c0 = (int)(imax(i0, j) - i0), c1 = (int)(imin(i0 + NQ - 1, ihi) - i0);
            {
                int qlo = 255, qhi = 0, dlo = 255;
                stage_f32(Qs, qh, H * ATTN_D, i0, NQ, imax_, ATTN_BNT, qlo, qhi);
                for (int e = t; e < NQ * ATTN_D; e += ATTN_BNT) {
                    int ii = e / ATTN_D, d = e % ATTN_D;
                    const float x = i0 + ii <= imax_ ? o1b_load(dh[(i0 + ii) * H * ATTN_D + d]) : 0.0f;
                    DO[e] = x;
                    dlo = imin32(dlo, o1b_key_lo(__float_as_uint(x)));
                }
                keys_to_slot(qlo, qhi, dlo, SLOT);
            }
            for (int ii = t; ii < NQ; ii += ATTN_BNT) {
                L[ii] = i0 + ii <= imax_ ? o1b_load(lh[i0 + ii]) : 0.0f;
                DI[ii] = i0 + ii <= imax_ ? Dh[i0 + ii] : 0.0f;
            }
            __syncthreads();
            int qlo, qhi, dlo;
            keys_from_slots(SLOT, ATTN_BNT / 32, qlo, qhi, dlo);
            if (row) {
                const int ia = c0 + ((c0 & 1) != odd), ib = c1;  /* this part's queries: ia, ia + 2, ... <= ib */
                const bool fast = !dp_role ? o1b_fma_guard(mlo, mhi, qlo, qhi) : mlo + dlo >= 128;
                if (fast) {
                    int ii = ia;
                    for (; ii + 2 * (ATTN_NB - 1) <= ib; ii += 2 * ATTN_NB) {
                        float d4[ATTN_NB];
                        if (!dp_role) dots_fast<ATTN_NB, false, true, true>(mine, Qs + ii * ATTN_D, 2 * ATTN_D, d4);
                        else dots_fast<ATTN_NB, false, true, false>(mine, DO + ii * ATTN_D, 2 * ATTN_D, d4);
#pragma unroll
                        for (int n = 0; n < ATTN_NB; n++) {
                            if (!dp_role) P[ATTN_CELL(rr, ii + 2 * n, NQ)] = o1b_exp_ftz(o1b_sub(o1b_mul_inl(d4[n], sc), L[ii + 2 * n]));
                            else DP[ATTN_CELL(rr, ii + 2 * n, NQ)] = d4[n];
                        }
                    }
                    for (; ii <= ib; ii += 2) {
                        float d1[1];
                        if (!dp_role) {
                            dots_fast<1, false, true, true>(mine, Qs + ii * ATTN_D, ATTN_D, d1);
                            P[ATTN_CELL(rr, ii, NQ)] = o1b_exp_ftz(o1b_sub(o1b_mul_inl(d1[0], sc), L[ii]));
                        } else {
                            dots_fast<1, false, true, false>(mine, DO + ii * ATTN_D, ATTN_D, d1);
                            DP[ATTN_CELL(rr, ii, NQ)] = d1[0];
                        }
                    }
                } else {
                    for (int ii = ia; ii <= ib; ii += 2) {
                        if (!dp_role)
                            P[ATTN_CELL(rr, ii, NQ)] =
                                o1b_exp_ftz(o1b_sub(o1b_mul_inl(dot_packed_f32(mine, Qs + ii * ATTN_D), sc), L[ii]));
                        else
                            DP[ATTN_CELL(rr, ii, NQ)] = dot_packed_f32(mine, DO + ii * ATTN_D);
                    }
                }
            }
            __syncthreads();
            if (row) {
                constexpr int VF = ATTN_VCF(ATTN_BNC);
                for (int ii = c0; ii <= c1; ii++) {
                    const float p = P[ATTN_CELL(rr, ii, NQ)];
                    const float ds = o1b_mul_inl(p, o1b_sub(DP[ATTN_CELL(rr, ii, NQ)], DI[ii]));
                    const float *qr = Qs + ii * ATTN_D + cbase;
                    const float *dr = DO + ii * ATTN_D + cbase;
                    if (o1b_key_lo(__float_as_uint(ds)) + qlo >= 128) {
#pragma unroll
                        for (int c0v = 0; c0v < ATTN_BNC; c0v += VF) {
                            u32 w[VF];
                            if (cbase + c0v < ATTN_D) ld_f32<VF>(qr + c0v, w);
#pragma unroll
                            for (int e = 0; e < VF; e++)
                                if (cbase + c0v + e < ATTN_D)
                                    dka[c0v + e] = o1b_add_ftz(dka[c0v + e], o1b_mul_ftz(ds, __uint_as_float(w[e])));
                        }
                    } else {
#pragma unroll
                        for (int c = 0; c < ATTN_BNC; c++)
                            if (cbase + c < ATTN_D) dka[c] = o1b_add(dka[c], o1b_mul(ds, qr[c]));
                    }
                    if (o1b_key_lo(__float_as_uint(p)) + dlo >= 128) {
#pragma unroll
                        for (int c0v = 0; c0v < ATTN_BNC; c0v += VF) {
                            u32 w[VF];
                            if (cbase + c0v < ATTN_D) ld_f32<VF>(dr + c0v, w);
#pragma unroll
                            for (int e = 0; e < VF; e++)
                                if (cbase + c0v + e < ATTN_D)
                                    dva[c0v + e] = o1b_add_ftz(dva[c0v + e], o1b_mul_ftz(p, __uint_as_float(w[e])));
                        }
                    } else {
#pragma unroll
                        for (int c = 0; c < ATTN_BNC; c++)
                            if (cbase + c < ATTN_D) dva[c] = o1b_add(dva[c], o1b_mul(p, dr[c]));
                    }
                }
            }
            __syncthreads();
        }
    }
    if (row) {
#pragma unroll
        for (int c = 0; c < ATTN_BNC; c++) {
            const int d = cbase + c;
            if (d < ATTN_D) {
                dk[kbase + d] = o1b_store(o1b_mul(dka[c], sc));
                dv[kbase + d] = o1b_store(dva[c]);
            }
        }
    }
}
