/* linear.cu — the contract GEMM with bf16 operands and fp32 accumulation (CONTRACT.md §6.1).
 *
 *   C[i,j] (+)= sum_{p=0..P-1} mul(A(i,p), B(p,j))     p ascending, one add per term,
 *   the accumulator starting at +0 (or at the loaded old C[i,j] when accumulating).
 *
 * A(i,p) = A[i*sa_i + p*sa_p] and B(p,j) = B[p*sb_p + j*sb_j], so one kernel serves y = x W^T,
 * dx = dy W, dW = dy^T x and the fused cross-entropy's GEMMs.
 *
 * Register blocking: a block of 16 x 16 threads computes a BM x BN = 128 x 128 tile of C, each thread
 * 8 x 8 outputs (rows ty*4 + {0..3} and 64 + ty*4 + {0..3}, columns likewise with tx), each output one
 * register from its first product to its store. p goes through shared memory in slices of BK = 16
 * values, k-major (As[p][i], Bs[p][j], so a thread reads its 8 + 8 operands of one p as four 128-bit
 * loads), double buffered: the next slice's global loads (one 128-bit load per operand and thread
 * where the data allow) are in flight while this one is computed, and one barrier per slice
 * separates both. A last, partial slice adds only its own values of p (padding is never added).
 * Every output adds the slice's products for p ascending and keeps its accumulator across slices, so
 * the sequence of roundings is the plain loop's; no tile size enters the arithmetic (no split-K, no
 * tensor cores).
 *
 * The FMA tile guard (CONTRACT.md §6.1, implementation notes): while a slice is staged, the block
 * reduces the exponent fields of its nonzero A and B values (the tile's rows and columns, the
 * slice's p) to their minima and maxima, inf and NaN counting as out of range. If
 * minA + minB >= 254 - 126 and maxA + maxB <= 254 + 126 (every product of nonzero operands then
 * lies in [2^-126, 2^128): exact in fp32) and no operand is inf or NaN, the slice's steps are
 * fused multiply-adds with the instruction's own flush (o1b_fma_ftz), which the notes prove equal
 * to add(acc, mul(a, b)); otherwise each step is o1b_add(acc, o1b_mul(a, b)). The decision is per
 * (block tile, slice) and the same for the whole block. (The per-thread atomicMin/atomicMax on
 * shared memory compile to one warp reduction and one atomic per warp.)
 * Launch: block (16, 16), a 1-D grid of ceil(I/BM) * ceil(J/BN) blocks (tile row-major: block b covers
 * rows (b / ceil(J/BN)) * BM.. and columns (b % ceil(J/BN)) * BN..).
 */
#include "contract.cuh"

#define BM 128   /* rows of A (i) per block tile */
#define BN 128   /* columns of B (j) per block tile */
#define BK 16    /* values of p per shared-memory slice, the unit of the FMA guard */
#define GUARD_MIN_SUM 128   /* 254 - 126: minA + minB >= this  =>  every product >= 2^-126 */
#define GUARD_MAX_SUM 380   /* 254 + 126: maxA + maxB <= this  =>  every product < 2^128 */
#define GUARD_OUT 511       /* exponent key of a value outside the guard: zero (min), inf or NaN (max) */

/* One operand's share of each slice for this thread: eight values, staged in the shared slice
 * S[p][row] (k-major). PC (the operand is contiguous along p): row r0 = t/2, p = 8*(t%2) + q, so the
 * eight are adjacent in memory and go to eight rows of S; otherwise row r0 + q with r0 = 8*(t%16),
 * p = t/16: adjacent in memory when the rows are (stride 1), and adjacent in S. Everything that does
 * not change from slice to slice is computed once. */
struct o1b_gemm_operand {
    const bf16 *M;
    i64 s_row, s_p, row, nrow, off;   /* row: the first value's; off: its offset in M at slice 0 */
    int p, sh;                        /* its p in the slice and its index in S */
    bool pc, vec;   /* vec: the eight are adjacent, inside the rows and 16-byte aligned: one load */

    __device__ __forceinline__ void init(const bf16 *M_, i64 s_row_, i64 s_p_, i64 row0, i64 nrow_, int t) {
        M = M_; s_row = s_row_; s_p = s_p_; nrow = nrow_;
        pc = s_p == 1;
        row = row0 + (pc ? t >> 1 : (t & 15) << 3);
        p = pc ? (t & 1) << 3 : t >> 4;
        off = row * s_row + p * s_p;
        sh = p * BM + (int)(row - row0);
        vec = (pc || s_row == 1) && row + (pc ? 0 : 7) < nrow && ((unsigned long long)(M + off) & 15u) == 0u;
    }
    /* The eight values of the slice at p0 as four words (value q in bits 16*(q%2).. of word q/2),
     * zeros outside the matrix. M + off + p0*s_p keeps the alignment of M + off: p0 is a multiple of
     * 16, 32 bytes of bf16. */
    __device__ __forceinline__ void fetch(u32 w[4], i64 p0, i64 P) const {
        if (vec && p0 + BK <= P) {
            uint4 d = *reinterpret_cast<const uint4 *>(M + off + p0 * s_p);
            w[0] = d.x; w[1] = d.y; w[2] = d.z; w[3] = d.w;
            return;
        }
        u32 v[8];
#pragma unroll
        for (int q = 0; q < 8; q++) {
            i64 r = row + (pc ? 0 : q), c = p0 + p + (pc ? q : 0);
            v[q] = (r < nrow && c < P) ? (u32)M[r * s_row + c * s_p] : 0u;
        }
#pragma unroll
        for (int k = 0; k < 4; k++) w[k] = v[2 * k] | (v[2 * k + 1] << 16);
    }
    /* The fetched values into the shared slice S, widened but not flushed (a subnormal stays one:
     * fma.rn.ftz reads it as the zero of its sign, as §2's flush would, and the exact path flushes
     * what it reads); the guard's keys over the values' exponent fields (bits 23-30 of the widened
     * value): lo = min of the field less one (a zero gives 0xFFFFFFFF: never the minimum of a nonzero
     * one), hi = max. PC is pc, as a constant: the stores' offsets are then immediates. */
    template <bool PC>
    __device__ __forceinline__ void stage(float *S, const u32 w[4], u32 &lo, u32 &hi) const {
        u32 f[8];
#pragma unroll
        for (int k = 0; k < 4; k++) { f[2 * k] = w[k] << 16; f[2 * k + 1] = w[k] & 0xFFFF0000u; }
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const u32 e = f[q] & 0x7F800000u;
            lo = e - 1u < lo ? e - 1u : lo;
            hi = e > hi ? e : hi;
        }
        if (PC) {
#pragma unroll
            for (int q = 0; q < 8; q++) S[sh + q * BM] = __uint_as_float(f[q]);
        } else {
            *reinterpret_cast<float4 *>(S + sh) = make_float4(__uint_as_float(f[0]), __uint_as_float(f[1]),
                                                              __uint_as_float(f[2]), __uint_as_float(f[3]));
            *reinterpret_cast<float4 *>(S + sh + 4) = make_float4(__uint_as_float(f[4]), __uint_as_float(f[5]),
                                                                  __uint_as_float(f[6]), __uint_as_float(f[7]));
        }
    }
    __device__ __forceinline__ void stage(float *S, const u32 w[4], u32 &lo, u32 &hi) const {
        if (pc) stage<true>(S, w, lo, hi);
        else stage<false>(S, w, lo, hi);
    }
};

/* The guard's exponent range of one operand from its keys: lo = the least exponent field of a
 * nonzero value (GUARD_OUT if none), hi = the greatest (GUARD_OUT if one is inf or NaN). */
__device__ __forceinline__ void o1b_gemm_range(u32 lo_key, u32 hi_key, int &lo, int &hi) {
    lo = lo_key == 0xFFFFFFFFu ? GUARD_OUT : (int)((lo_key + 1u) >> 23);
    hi = (int)(hi_key >> 23);
    hi = hi == 0xFF ? GUARD_OUT : hi;
}

/* One p of the slice for the thread's 8 x 8 outputs: a = As[p][its rows], b = Bs[p][its columns]. */
template <bool FAST>
__device__ __forceinline__ void o1b_gemm_step(float (&acc)[8][8], const float *arow, const float *brow,
                                              int tx, int ty) {
    float a[8], b[8];
    float4 v = *reinterpret_cast<const float4 *>(arow + ty * 4);
    a[0] = v.x; a[1] = v.y; a[2] = v.z; a[3] = v.w;
    v = *reinterpret_cast<const float4 *>(arow + 64 + ty * 4);
    a[4] = v.x; a[5] = v.y; a[6] = v.z; a[7] = v.w;
    v = *reinterpret_cast<const float4 *>(brow + tx * 4);
    b[0] = v.x; b[1] = v.y; b[2] = v.z; b[3] = v.w;
    v = *reinterpret_cast<const float4 *>(brow + 64 + tx * 4);
    b[4] = v.x; b[5] = v.y; b[6] = v.z; b[7] = v.w;
    if (!FAST) {
#pragma unroll
        for (int k = 0; k < 8; k++) { a[k] = o1b_flush(a[k]); b[k] = o1b_flush(b[k]); }
    }
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int c = 0; c < 8; c++)
            acc[r][c] = FAST ? o1b_fma_ftz(a[r], b[c], acc[r][c]) : o1b_add(acc[r][c], o1b_mul(a[r], b[c]));
}

extern "C" __global__ void __launch_bounds__(256) o1b_gemm(i64 I, i64 J, i64 P,
                                                         const bf16 *A, i64 sa_i, i64 sa_p,
                                                         const bf16 *B, i64 sb_p, i64 sb_j,
                                                         float *C, i64 ldc, int accumulate) {
    __shared__ __align__(16) float As[2][BK][BM];   /* As[s][p][r] = A(i0 + r, p0 + p), widened */
    __shared__ __align__(16) float Bs[2][BK][BN];   /* Bs[s][p][c] = B(p0 + p, j0 + c), widened */
    __shared__ int guard[3][4];                     /* per slice: min, max exponent of A; of B */
    const int tx = threadIdx.x, ty = threadIdx.y, t = ty * 16 + tx;
    const i64 ntj = (J + BN - 1) / BN, i0 = ((i64)blockIdx.x / ntj) * BM, j0 = ((i64)blockIdx.x % ntj) * BN;

    /* Who stages what: 4 values of A and 4 of B per thread and slice, read along the operand's
     * contiguous dimension (p when its stride is 1, else rows or columns). */
    o1b_gemm_operand opa, opb;
    opa.init(A, sa_i, sa_p, i0, I, t);
    opb.init(B, sb_j, sb_p, j0, J, t);

    float acc[8][8];
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int c = 0; c < 8; c++) {
            i64 i = i0 + (r < 4 ? ty * 4 + r : 64 + ty * 4 + r - 4), j = j0 + (c < 4 ? tx * 4 + c : 64 + tx * 4 + c - 4);
            acc[r][c] = (accumulate && i < I && j < J) ? o1b_load(C[i * ldc + j]) : 0.0f;
        }
    /* threads all of whose outputs lie outside C skip the products (they still stage and wait) */
    const bool active = i0 + ty * 4 < I && j0 + tx * 4 < J;

    if (t == 0) { guard[0][0] = GUARD_OUT; guard[0][1] = 0; guard[0][2] = GUARD_OUT; guard[0][3] = 0; }
    __syncthreads();
    u32 va[4], vb[4];
    opa.fetch(va, 0, P);
    opb.fetch(vb, 0, P);
    int slot = 0;   /* guard[slot] serves slice s; three slots, so that the reset of the one after
                     * next is separated by a barrier from its last read and its next writes */
    for (i64 p0 = 0, s = 0; p0 < P; p0 += BK, s++) {
        const int st = (int)(s & 1), next = slot == 2 ? 0 : slot + 1;
        u32 lo_a = 0xFFFFFFFFu, hi_a = 0u, lo_b = 0xFFFFFFFFu, hi_b = 0u;
        opa.stage(&As[st][0][0], va, lo_a, hi_a);
        opb.stage(&Bs[st][0][0], vb, lo_b, hi_b);
        int loA, hiA, loB, hiB;
        o1b_gemm_range(lo_a, hi_a, loA, hiA);
        o1b_gemm_range(lo_b, hi_b, loB, hiB);
        atomicMin(&guard[slot][0], loA); atomicMax(&guard[slot][1], hiA);
        atomicMin(&guard[slot][2], loB); atomicMax(&guard[slot][3], hiB);
        if (t == 0) { guard[next][0] = GUARD_OUT; guard[next][1] = 0; guard[next][2] = GUARD_OUT; guard[next][3] = 0; }
        __syncthreads();
        if (p0 + BK < P) {   /* the next slice's loads, in flight during this slice's products */
            opa.fetch(va, p0 + BK, P);
            opb.fetch(vb, p0 + BK, P);
        }
        const bool fast = guard[slot][0] + guard[slot][2] >= GUARD_MIN_SUM
                          && guard[slot][1] + guard[slot][3] <= GUARD_MAX_SUM;
        const int n = P - p0 < BK ? (int)(P - p0) : BK;   /* padding p is never added */
        if (active) {
            if (fast && n == BK) {
#pragma unroll
                for (int p = 0; p < BK; p++) o1b_gemm_step<true>(acc, As[st][p], Bs[st][p], tx, ty);
            } else if (fast) {
#pragma unroll 1
                for (int p = 0; p < n; p++) o1b_gemm_step<true>(acc, As[st][p], Bs[st][p], tx, ty);
            } else {
#pragma unroll 1
                for (int p = 0; p < n; p++) o1b_gemm_step<false>(acc, As[st][p], Bs[st][p], tx, ty);
            }
        }
        slot = next;
    }
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int c = 0; c < 8; c++) {
            i64 i = i0 + (r < 4 ? ty * 4 + r : 64 + ty * 4 + r - 4), j = j0 + (c < 4 ? tx * 4 + c : 64 + tx * 4 + c - 4);
            if (i < I && j < J) C[i * ldc + j] = o1b_store(acc[r][c]);
        }
}
