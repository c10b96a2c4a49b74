/* quant.cu — the int8 quantized linear layer (CONTRACT.md §6.9, .contract_parts/int8.md) and its
 * simulated int4 and int6 paths (qmax = QMAX4 = 7, coefficient QW_COEF4; qmax = QMAX6 = 31,
 * coefficient QW_COEF6; the kernels that depend on the level bound take it as their argument qmax,
 * 127, 31 or 7, checked by the host).
 *
 *   weights:    per output row j: S = sum from +0 over k ascending of |w[j,k]|,
 *               s_w[j] = mul(div(S, i2f(K)), coef) (NaN if S is not finite), coef = QW_COEF for
 *               qmax 127, QW_COEF6 for qmax 31, QW_COEF4 for qmax 7
 *   tensors:    s = div(absmax, qmax) (NaN if any element is inf/NaN; a max is exact in any order)
 *   quantize:   q = level(mul(v, div(1, s))) = clamp(rne(.), -qmax, qmax); q = 0 where s is +0 or NaN
 *   int8 GEMM:  acc[i,j] = sum_p A(i,p) B(j,p) in int32 (exact: P <= 2^17, so |acc| < 2^31), on
 *               the tensor cores (imma.cuh)
 *   Hadamard:   in-place butterflies along rows, blocks of QB = 128 rows, stages h = 1, 2, ..., 64
 *               (fp32 add/sub, or exact int32)
 * One warp per row for the weight quantizer (its ordered sum in one lane), one thread per output
 * for the levels; the per-tensor absmax in one launch
 * (each block's largest |v| by a tree of maxes, the last block to finish folds the blocks' partials
 * with another tree and writes the scale: a max is exact in any order); the rotation one warp per 8
 * columns of a block of QB rows (each lane 32 rows: stages h = 1 ... 16 in its registers, h = 32 and
 * 64 with the partner lane's values by shuffles), fused with what produces its input and with the
 * absmax of its output; the GEMM 128 x 128 output tiles per block of 8 warps on the int8
 * tensor-core instruction, staged in shared memory, with the layer's epilogue (y, dx, dW) applied to
 * each sum where it is made. Integer sums are exact in any order; every fp32
 * value comes from the contract helpers in the written order, so the results equal
 * cpu_ref/src/quant.c bit for bit.
 */
#include "contract.cuh"
#include "imma.cuh"

#define QMAX 127
#define QMAX4 7                   /* the simulated int4 path: levels -7 ... 7 in int8 containers */
#define QMAX6 31                  /* the simulated int6 path: levels -31 ... 31 in int8 containers */
#define QB 128                    /* Hadamard block along the contraction dimension */
#define QW_COEF 0x1.6b7612p-3f    /* 2/sqrt(127) rounded to nearest fp32 */
#define QW_COEF4 0x1.83091ep-1f   /* 2/sqrt(7) rounded to nearest fp32 */
#define QW_COEF6 0x1.6fd4e8p-2f   /* 2/sqrt(31) rounded to nearest fp32 */
#define INV_QB 0x1p-7f            /* 1/QB, exact */
#define Q_CHUNK 4096              /* elements per block of the absmax (no result depends on it) */
#define Q_BAD 0xFFFFFFFFu         /* absmax partial of a chunk holding an inf or NaN */
#define QA_THREADS 256            /* threads per block of the absmax and of the rotations */
#define QR_VALS 32                /* rotation: values per lane, rows 32s ... 32s + 31 of its block */
#define QR_COLS 64                /* rotation: columns per block (8 warps of 8 columns x 4 lanes) */
#define QW_ROWS 4                 /* weight quantizer: rows per block, one warp each */
#define QT_TILE 32                /* transposed levels: tile side, threads per row of a block */
#define QT_ROWS 8                 /* transposed levels: rows of threads per block */
#define GI_BM 128                 /* int8 GEMM: rows of A (and of C) per block */
#define GI_BN 128                 /* int8 GEMM: rows of B (columns of C) per block */
#define GI_BK 64                  /* int8 GEMM: contraction step, bytes per staged row */
#define GI_THREADS 256            /* int8 GEMM: 8 warps, 2 x 4, each 64 x 32 of the tile */
#define GI_MI 4                   /* int8 GEMM: 16-row instruction tiles per warp */
#define GI_NI 4                   /* int8 GEMM: 8-column instruction tiles per warp */
static_assert(GI_BM == 2 * 16 * GI_MI && GI_BN == 4 * 8 * GI_NI && GI_THREADS == 8 * 32,
              "int8 GEMM: 2 x 4 warps cover the tile");
static_assert(GI_BM * GI_BK / 16 == 2 * GI_THREADS && GI_BN * GI_BK / 16 == 2 * GI_THREADS,
              "int8 GEMM: each thread stages two 16-byte units of A and two of B per step");

typedef signed char i8;

__device__ __forceinline__ bool o1b_q_finite(float x) { return (o1b_bits(x) & 0x7F800000u) != 0x7F800000u; }

/* The level bound qmax (QMAX, QMAX6 or QMAX4) as fp32, and the weight step coefficient it selects. */
__device__ __forceinline__ float o1b_q_maxf(int qmax) { return qmax == QMAX4 ? 7.0f : qmax == QMAX6 ? 31.0f : 127.0f; }
__device__ __forceinline__ float o1b_q_coef(int qmax) {
    return qmax == QMAX4 ? QW_COEF4 : qmax == QMAX6 ? QW_COEF6 : QW_COEF;
}

/* ------------------------------------------------------------------ weight step sizes and levels */
/* Row j's levels q[k] and (if has_clip) clip flags clip[k] from its step sj (stored) and
 * inv = div(1, sj) where sj is finite and nonzero: clip 1 where |t| > qmax, 2 on every element of a
 * NaN-step row, q = 0 where sj is +0 or NaN. Elements k = first, first + stride, ... */
__device__ __forceinline__ void o1b_q_weight_row(i64 K, const bf16 *row, float sj, float inv, i8 *q,
                                                 unsigned char *clip, int has_clip, int qmax, int first,
                                                 int stride) {
    bool none = o1b_isnan(sj) || sj == 0.0f;
    for (i64 k = first; k < K; k += stride) {
        if (none) {
            q[k] = 0;
            if (has_clip) clip[k] = o1b_isnan(sj) ? 2 : 0;
            continue;
        }
        float t = o1b_mul(o1b_bf16_to_f32(row[k]), inv);
        q[k] = o1b_level(t, qmax);
        if (has_clip) clip[k] = o1b_abs_bits(t) > o1b_bits(o1b_q_maxf(qmax)) ? 1 : 0;
    }
}

/* s[j] (stored), q[j, :] and (if has_clip) clip[j, :], one warp per row j (QW_ROWS rows per block):
 * lane 0 sums the row in the contract's order (k ascending) and makes its step, the warp's lanes
 * write the row's levels (consecutive lanes, consecutive elements). */
extern "C" __global__ void __launch_bounds__(32 * QW_ROWS)
o1b_q_weight(i64 M, i64 K, const bf16 *w, float *s, i8 *q, unsigned char *clip, int has_clip, int qmax) {
    int lane = (int)threadIdx.x & 31;
    i64 j = (i64)blockIdx.x * QW_ROWS + ((int)threadIdx.x >> 5);
    if (j >= M) return;                          /* the whole warp: j is the warp's */
    const bf16 *row = w + j * K;
    float sj = 0.0f, inv = 0.0f;
    if (lane == 0) {
        float S = 0.0f;
        for (i64 k = 0; k < K; k++) S = o1b_add(S, o1b_from_bits(o1b_abs_bits(o1b_bf16_to_f32(row[k]))));
        float v = o1b_q_finite(S) ? o1b_mul(o1b_div(S, o1b_i2f((int)K)), o1b_q_coef(qmax)) : o1b_nan();
        inv = (!o1b_isnan(v) && v != 0.0f) ? o1b_div(1.0f, v) : 0.0f;
        sj = o1b_store(v);
        s[j] = sj;
    }
    sj = __shfl_sync(0xFFFFFFFFu, sj, 0);
    inv = __shfl_sync(0xFFFFFFFFu, inv, 0);
    o1b_q_weight_row(K, row, sj, inv, q + j * K, has_clip ? clip + j * K : clip, has_clip, qmax, lane, 32);
}

/* ------------------------------------------------------------------ per-tensor quantization */
/* The value of element i of the tensor: a widened bf16 (is_f32 == 0) or a loaded fp32. */
__device__ __forceinline__ float o1b_q_value(const bf16 *xb, const float *xf, int is_f32, i64 i) {
    return is_f32 ? o1b_load(xf[i]) : o1b_bf16_to_f32(xb[i]);
}

/* m with one more value: the bits of |v| (ordered like the magnitudes), Q_BAD for inf or NaN. */
__device__ __forceinline__ u32 o1b_q_max_bits(u32 m, float v) {
    u32 a = o1b_abs_bits(v);
    a = a >= 0x7F800000u ? Q_BAD : a;
    return a > m ? a : m;
}

/* The largest of the QA_THREADS threads' m: a tree of maxes in shared memory (exact in any order). */
__device__ __forceinline__ u32 o1b_q_block_max(u32 m, u32 *red) {
    int tid = (int)threadIdx.x;
    red[tid] = m;
    __syncthreads();
    for (int h = QA_THREADS / 2; h > 0; h >>= 1) {
        if (tid < h) red[tid] = red[tid + h] > red[tid] ? red[tid + h] : red[tid];
        __syncthreads();
    }
    u32 r = red[0];
    __syncthreads();
    return r;
}

/* Every thread of every block (QA_THREADS each, a 1-D or 2-D grid) with its own maximum m: the block's
 * maximum goes to part[block]; the block that finishes last (counted in *counter, which it sets back
 * to 0 for the next launch: launches on one stream run in order) folds all partials with a tree of
 * maxes and writes sc[0] = s = div(absmax, qmax) (stored; NaN if any value is inf or NaN) and
 * sc[1] = div(1, s) where s is finite and nonzero (else 0). */
__device__ void o1b_q_absmax_finish(u32 m, u32 *part, u32 *counter, float *sc, int qmax) {
    __shared__ u32 red[QA_THREADS];
    __shared__ int last;
    int tid = (int)threadIdx.x;
    i64 nb = (i64)gridDim.x * gridDim.y, b = (i64)blockIdx.y * gridDim.x + blockIdx.x;
    m = o1b_q_block_max(m, red);
    if (tid == 0) {
        part[b] = m;
        __threadfence();                 /* the partial is visible to every block before it is counted */
        last = atomicAdd(counter, 1u) == (u32)(nb - 1);
        if (last) __threadfence();       /* acquire: the partials counted before it are seen by the reads below */
    }
    __syncthreads();
    if (!last) return;                   /* the whole block leaves together */
    u32 a = 0u;
    for (i64 c = tid; c < nb; c += QA_THREADS) {
        u32 p = ((volatile const u32 *)part)[c];
        a = p > a ? p : a;
    }
    a = o1b_q_block_max(a, red);
    if (tid == 0) {
        float s = a == Q_BAD ? o1b_nan() : o1b_div(o1b_from_bits(a), o1b_q_maxf(qmax));
        sc[1] = (!o1b_isnan(s) && s != 0.0f) ? o1b_div(1.0f, s) : 0.0f;
        sc[0] = o1b_store(s);
        *counter = 0u;
    }
}

/* The per-tensor scale of n values (bf16 or fp32) in one launch: block b takes the Q_CHUNK elements
 * from b Q_CHUNK, its threads strided by QA_THREADS (coalesced). Grid max(1, ceil(n / Q_CHUNK)). */
extern "C" __global__ void __launch_bounds__(QA_THREADS)
o1b_q_absmax(i64 n, const bf16 *xb, const float *xf, int is_f32, u32 *part, u32 *counter, float *sc, int qmax) {
    i64 c0 = (i64)blockIdx.x * Q_CHUNK, end = c0 + Q_CHUNK < n ? c0 + Q_CHUNK : n;
    u32 m = 0u;
    for (i64 i = c0 + threadIdx.x; i < end; i += QA_THREADS) m = o1b_q_max_bits(m, o1b_q_value(xb, xf, is_f32, i));
    o1b_q_absmax_finish(m, part, counter, sc, qmax);
}

extern "C" __global__ void o1b_q_tensor_levels(i64 n, const bf16 *xb, const float *xf, int is_f32,
                                               const float *sc, i8 *q, int qmax) {
    i64 i = o1b_gid();
    if (i >= n) return;
    float s = sc[0];
    q[i] = (o1b_isnan(s) || s == 0.0f) ? (i8)0 : o1b_level(o1b_mul(o1b_q_value(xb, xf, is_f32, i), sc[1]), qmax);
}

/* The same levels of an fp32 tensor f (R, C), written transposed: qt[c*R + r] is the level of
 * f[r*C + c]. The backward GEMMs contract over the rows of their operands; transposed, the
 * contraction is the contiguous dimension, which the GEMM stages with 16-byte loads. Data movement
 * only: the same values as o1b_q_tensor_levels. Blocks of QT_TILE x 8 threads transpose
 * QT_TILE x QT_TILE tiles through shared memory (grid (ceil(C/QT_TILE), ceil(R/QT_TILE))), so the
 * reads of f (along c) and the writes of qt (along r) are both contiguous across a warp. */
extern "C" __global__ void o1b_q_tensor_levels_t(i64 R, i64 C, const float *f, const float *sc, i8 *qt, int qmax) {
    __shared__ i8 tile[QT_TILE][QT_TILE + 4];   /* [c][r]; the pad spreads a warp's writes over all banks */
    int tx = (int)threadIdx.x, ty = (int)threadIdx.y;
    i64 r0 = (i64)blockIdx.y * QT_TILE, c0 = (i64)blockIdx.x * QT_TILE;
    float s = sc[0];
    bool zero = o1b_isnan(s) || s == 0.0f;
    for (int k = ty; k < QT_TILE; k += QT_ROWS) {
        i64 r = r0 + k, c = c0 + tx;
        tile[tx][k] = (zero || r >= R || c >= C) ? (i8)0 : o1b_level(o1b_mul(o1b_load(f[r * C + c]), sc[1]), qmax);
    }
    __syncthreads();
    for (int k = ty; k < QT_TILE; k += QT_ROWS) {
        i64 c = c0 + k, r = r0 + tx;
        if (r < R && c < C) qt[c * R + r] = tile[k][tx];
    }
}

/* ------------------------------------------------------------------ int8 GEMM */
/* C[i*J + j] = sum_p A[i*sa_i + p*sa_p] * B[j*sb_j + p*sb_p] in int32, exactly.
 *
 * Grid (ceil(I/GI_BM), ceil(J/GI_BN)) of GI_THREADS threads: block (x, y) computes the tile
 * i0 = 128x ... i0 + 127, j0 = 128y ... j0 + 127 of C; warp w the 64 x 32 part wm = w >> 2 (rows),
 * wn = w & 3 (columns), as GI_MI x GI_NI = 4 x 4 instruction tiles of 16 x 8 (64 int32 accumulators
 * per lane). The contraction runs in steps of GI_BK = 64: the block stages the step's 64 bytes of its
 * 128 rows of A and of B in shared memory, +0 outside the matrices (edge tiles: zeros add nothing, so
 * padding is exact), while it loads the next step's into registers. (128 x 128 tiles: each staged
 * byte feeds 128 multiply-adds, twice as many as 64 x 64 tiles.)
 *
 * Which instruction slot holds which p: lane (g, t) = (lane >> 2, lane & 3) feeds instruction
 * s (0, 1) of a step with bytes 16t + 8s ... 16t + 8s + 7 of the step: the low 4 in its slots
 * 4t ... 4t + 3 (registers a0/a1, b0), the high 4 in slots 16 + 4t ... (a2/a3, b1), in A and in B
 * alike. So every product pairs A(i, p) with B(j, p), and each p of the step is in exactly one slot
 * of one instruction; where a p sits does not change an exact integer sum.
 * Shared memory, laid out so that each fragment is one 16-byte load, without moves or bank
 * conflicts (the 8 lanes of a phase read 128 distinct banks' bytes):
 *   B: row r of the step at bytes 64r (p contiguous): lane (g, t) loads bytes 16t ... 16t + 15 of
 *      row g of its 8-row tile: words 2s, 2s + 1 are b0, b1 of instruction s.
 *   A: 16-byte units, unit u = 64 m + 8 g + 4 (s ^ (g & 1)) + t for rows 16m + g and 16m + g + 8
 *      (m the 16-row tile), bytes 16t + 8s ... + 7: words (row g low 4, row g + 8 low 4, row g high 4,
 *      row g + 8 high 4) = a0 ... a3 of instruction s. The XOR spreads the two s of a row pair over
 *      both halves of the banks.
 * Staging: thread tid fills A units tid and tid + 256 (two 8-byte loads each, from rows R and R + 8)
 * and B pieces tid and tid + 256 (row c >> 2, bytes 16 (c & 3), one 16-byte load each).
 *
 * The sums wrap modulo 2^32 (the instruction has no .satfinite); exact anyway, as §6.9's bounds keep
 * |acc| < 2^31 at every step of every order. */

/* The n (8 or 16) bytes p ... p + n - 1 of row `row` of M (rows x P, strides s_row, s_p) as n/4 words,
 * +0 outside. VEC: p contiguous (s_p = 1), 16-byte aligned rows, P a multiple of 16: one load. */
template <bool VEC, int NW>
__device__ __forceinline__ void o1b_gi_fetch(u32 *r, const i8 *M, i64 rows, i64 P, i64 s_row, i64 s_p,
                                             i64 row, i64 p) {
    if (VEC) {
        if (row < rows && p < P) {
            if (NW == 4) o1b_load16(r, M + row * s_row + p);
            else o1b_load8(r, M + row * s_row + p);
        } else {
            for (int w = 0; w < NW; w++) r[w] = 0u;
        }
        return;
    }
    for (int w = 0; w < NW; w++) {
        u32 v = 0u;
        for (int e = 0; e < 4; e++) {
            i64 q = p + 4 * w + e;
            if (row < rows && q < P) v |= (u32)(unsigned char)M[row * s_row + q * s_p] << (8 * e);
        }
        r[w] = v;
    }
}

/* A unit u's rows (16m + g, + 8) and first byte 16t + 8s in the step. */
__device__ __forceinline__ int o1b_gi_unit_row(int u) { return 16 * (u >> 6) + ((u >> 3) & 7); }
__device__ __forceinline__ int o1b_gi_unit_byte(int u) {
    return 16 * (u & 3) + 8 * (((u >> 2) & 1) ^ ((u >> 3) & 1));
}

/* Thread tid's share of one step, from global memory into registers: A units tid, tid + GI_THREADS
 * (rows R and R + 8, 8 bytes each) and B pieces tid, tid + GI_THREADS (16 bytes). */
template <bool VEC>
__device__ __forceinline__ void o1b_gi_stage_load(u32 ga[2][4], u32 gb[2][4], const i8 *Ab, i64 ri, i64 sa_i,
                                                  i64 sa_p, const i8 *Bb, i64 rj, i64 sb_j, i64 sb_p, i64 P,
                                                  i64 p0, int tid) {
    for (int h = 0; h < 2; h++) {
        int c = tid + GI_THREADS * h, R = o1b_gi_unit_row(c);
        u32 lo[2], hi[2];
        o1b_gi_fetch<VEC, 2>(lo, Ab, ri, P, sa_i, sa_p, R, p0 + o1b_gi_unit_byte(c));
        o1b_gi_fetch<VEC, 2>(hi, Ab, ri, P, sa_i, sa_p, R + 8, p0 + o1b_gi_unit_byte(c));
        ga[h][0] = lo[0]; ga[h][1] = hi[0]; ga[h][2] = lo[1]; ga[h][3] = hi[1];
        o1b_gi_fetch<VEC, 4>(gb[h], Bb, rj, P, sb_j, sb_p, c >> 2, p0 + 16 * (c & 3));
    }
}

/* The same for VEC operands, with the thread's row pointers and row checks made once (p in int:
 * P <= Q_MAX_P, checked by the host). */
struct o1b_gi_rows {
    const i8 *a[4], *b[2];      /* A: unit h's rows R, R + 8 at [2h], [2h + 1]; B: piece h's row */
    bool ina[4], inb[2];        /* the row exists */
    int oa[2], ob[2];           /* the pieces' first byte in the step */
};

__device__ __forceinline__ void o1b_gi_rows_init(o1b_gi_rows &s, const i8 *Ab, i64 ri, i64 sa_i, const i8 *Bb,
                                                 i64 rj, i64 sb_j, int tid) {
    for (int h = 0; h < 2; h++) {
        int c = tid + GI_THREADS * h, R = o1b_gi_unit_row(c);
        s.oa[h] = o1b_gi_unit_byte(c);
        s.ob[h] = 16 * (c & 3);
        for (int x = 0; x < 2; x++) {
            s.ina[2 * h + x] = R + 8 * x < ri;
            s.a[2 * h + x] = s.ina[2 * h + x] ? Ab + (R + 8 * x) * sa_i + s.oa[h] : Ab;
        }
        s.inb[h] = (c >> 2) < rj;
        s.b[h] = s.inb[h] ? Bb + (i64)(c >> 2) * sb_j + s.ob[h] : Bb;
    }
}

__device__ __forceinline__ void o1b_gi_stage_load_vec(u32 ga[2][4], u32 gb[2][4], const o1b_gi_rows &s, int P,
                                                      int p0) {
    for (int h = 0; h < 2; h++) {
        u32 r[2][2];
        for (int x = 0; x < 2; x++) {
            r[x][0] = r[x][1] = 0u;
            if (s.ina[2 * h + x] && p0 + s.oa[h] < P) o1b_load8(r[x], s.a[2 * h + x] + p0);
        }
        ga[h][0] = r[0][0]; ga[h][1] = r[1][0]; ga[h][2] = r[0][1]; ga[h][3] = r[1][1];
        for (int w = 0; w < 4; w++) gb[h][w] = 0u;
        if (s.inb[h] && p0 + s.ob[h] < P) o1b_load16(gb[h], s.b[h] + p0);
    }
}

template <bool VEC, class OUT>
__device__ __forceinline__ void o1b_gemm_i8_tile(i64 I, i64 J, i64 P, const i8 *A, i64 sa_i, i64 sa_p,
                                                 const i8 *B, i64 sb_j, i64 sb_p, const OUT &out, u32 *As,
                                                 u32 *Bs) {
    int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    int wm = warp >> 2, wn = warp & 3;
    i64 i0 = (i64)blockIdx.x * GI_BM, j0 = (i64)blockIdx.y * GI_BN;
    const i8 *Ab = A + i0 * sa_i, *Bb = B + j0 * sb_j;
    i64 ri = I - i0, rj = J - j0;          /* rows of A and of B left from this tile on */
    int acc[GI_MI][GI_NI][4];
    for (int mi = 0; mi < GI_MI; mi++)
        for (int ni = 0; ni < GI_NI; ni++)
            for (int c = 0; c < 4; c++) acc[mi][ni][c] = 0;
    u32 ga[2][4], gb[2][4];
    o1b_gi_rows rows;
    if (VEC) {
        o1b_gi_rows_init(rows, Ab, ri, sa_i, Bb, rj, sb_j, tid);
        o1b_gi_stage_load_vec(ga, gb, rows, (int)P, 0);
    } else {
        o1b_gi_stage_load<VEC>(ga, gb, Ab, ri, sa_i, sa_p, Bb, rj, sb_j, sb_p, P, 0, tid);
    }
    for (i64 p0 = 0; p0 < P; p0 += GI_BK) {
        for (int h = 0; h < 2; h++) {
            o1b_store16(&As[4 * (tid + GI_THREADS * h)], ga[h]);
            o1b_store16(&Bs[4 * (tid + GI_THREADS * h)], gb[h]);
        }
        __syncthreads();
        if (p0 + GI_BK < P) {
            if (VEC) o1b_gi_stage_load_vec(ga, gb, rows, (int)P, (int)p0 + GI_BK);
            else o1b_gi_stage_load<VEC>(ga, gb, Ab, ri, sa_i, sa_p, Bb, rj, sb_j, sb_p, P, p0 + GI_BK, tid);
        }
        u32 fa[GI_MI][2][4], fb[GI_NI][4];        /* [16-row tile][instruction][word]; [8-row tile][word] */
        for (int mi = 0; mi < GI_MI; mi++)
            for (int s = 0; s < 2; s++)
                o1b_load16(fa[mi][s], &As[4 * (64 * (GI_MI * wm + mi) + 8 * g + 4 * (s ^ (g & 1)) + t)]);
        for (int ni = 0; ni < GI_NI; ni++) o1b_load16(fb[ni], &Bs[16 * (8 * GI_NI * wn + 8 * ni + g) + 4 * t]);
        for (int s = 0; s < 2; s++)
            for (int mi = 0; mi < GI_MI; mi++)
                for (int ni = 0; ni < GI_NI; ni++) o1b_mma_s8_16x8x32(acc[mi][ni], fa[mi][s], &fb[ni][2 * s]);
        __syncthreads();
    }
    /* unrolled: the accumulators stay in registers (an epilogue's loop indexing them would move them
     * all to local memory) */
#pragma unroll
    for (int mi = 0; mi < GI_MI; mi++)
#pragma unroll
        for (int ni = 0; ni < GI_NI; ni++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                i64 i = i0 + 16 * GI_MI * wm + 16 * mi + g + 8 * (c >> 1);
                i64 j = j0 + 8 * GI_NI * wn + 8 * ni + 2 * t + (c & 1);
                if (i < I && j < J) out.put(i, j, J, acc[mi][ni][c]);
            }
}

template <class OUT>
__device__ __forceinline__ void o1b_gemm_i8_run(i64 I, i64 J, i64 P, const i8 *A, i64 sa_i, i64 sa_p,
                                                const i8 *B, i64 sb_j, i64 sb_p, const OUT &out, u32 *As,
                                                u32 *Bs) {
    bool vec = sa_p == 1 && sb_p == 1 && (sa_i & 15) == 0 && (sb_j & 15) == 0 && (P & 15) == 0
               && ((unsigned long long)A & 15u) == 0 && ((unsigned long long)B & 15u) == 0;
    if (vec) o1b_gemm_i8_tile<true>(I, J, P, A, sa_i, sa_p, B, sb_j, sb_p, out, As, Bs);
    else o1b_gemm_i8_tile<false>(I, J, P, A, sa_i, sa_p, B, sb_j, sb_p, out, As, Bs);
}

/* What the GEMM writes for each output (i, j) of its int32 sum acc: the sum itself (o1b_gemm_i8), or
 * the quantized layer's epilogue (o1b_qgemm_y, _dx, _dw: the per-element formulas below, applied
 * where the sum is made instead of a pass over a stored int32 matrix; the same operations). */
struct o1b_gi_int {
    int *c;
    __device__ __forceinline__ void put(i64 i, i64 j, i64 J, int a) const { c[i * J + j] = a; }
};
/* y[i,j] = mul(mul(i2f(acc[i,j]), s_x), s_w[j]). */
struct o1b_gi_y {
    float *y; float sx; const float *sw;
    __device__ __forceinline__ void put(i64 i, i64 j, i64 J, int a) const {
        y[i * J + j] = o1b_store(o1b_mul(o1b_mul(o1b_i2f_acc(a), sx), sw[j]));
    }
};
/* dx = mul(mul(mul(i2f(acc), s_G), s_R), INV_QB). */
struct o1b_gi_dx {
    float *dx; float sg, sr;
    __device__ __forceinline__ void put(i64 i, i64 j, i64 J, int a) const {
        dx[i * J + j] = o1b_store(o1b_mul(o1b_mul(o1b_mul(o1b_i2f_acc(a), sg), sr), INV_QB));
    }
};
/* dW = mul(mul(mul(mul(i2f(acc), s_D), s_X), s_x), INV_QB); +0 where clipped, NaN on a NaN row. */
struct o1b_gi_dw {
    float *dw; float sd, sX, sx; const unsigned char *clip;
    __device__ __forceinline__ void put(i64 i, i64 j, i64 J, int a) const {
        i64 t = i * J + j;
        float v = o1b_mul(o1b_mul(o1b_mul(o1b_mul(o1b_i2f_acc(a), sd), sX), sx), INV_QB);
        dw[t] = clip[t] == 2 ? o1b_nan() : clip[t] ? 0.0f : o1b_store(v);
    }
};

#define O1B_GI_SHARED                                         \
    __shared__ __align__(16) u32 As[GI_BM * GI_BK / 4];       \
    __shared__ __align__(16) u32 Bs[GI_BN * GI_BK / 4]

extern "C" __global__ void o1b_gemm_i8(i64 I, i64 J, i64 P, const i8 *A, i64 sa_i, i64 sa_p,
                                       const i8 *B, i64 sb_j, i64 sb_p, int *C) {
    O1B_GI_SHARED;
    o1b_gemm_i8_run(I, J, P, A, sa_i, sa_p, B, sb_j, sb_p, o1b_gi_int{C}, As, Bs);
}

/* The layer's three GEMMs with their epilogues (the scales are sc[0] of the operands' scale arrays). */
extern "C" __global__ void o1b_qgemm_y(i64 I, i64 J, i64 P, const i8 *A, i64 sa_i, i64 sa_p, const i8 *B,
                                       i64 sb_j, i64 sb_p, const float *scx, const float *sw, float *y) {
    O1B_GI_SHARED;
    o1b_gemm_i8_run(I, J, P, A, sa_i, sa_p, B, sb_j, sb_p, o1b_gi_y{y, scx[0], sw}, As, Bs);
}

extern "C" __global__ void o1b_qgemm_dx(i64 I, i64 J, i64 P, const i8 *A, i64 sa_i, i64 sa_p, const i8 *B,
                                        i64 sb_j, i64 sb_p, const float *scg, const float *scr, float *dx) {
    O1B_GI_SHARED;
    o1b_gemm_i8_run(I, J, P, A, sa_i, sa_p, B, sb_j, sb_p, o1b_gi_dx{dx, scg[0], scr[0]}, As, Bs);
}

extern "C" __global__ void o1b_qgemm_dw(i64 I, i64 J, i64 P, const i8 *A, i64 sa_i, i64 sa_p, const i8 *B,
                                        i64 sb_j, i64 sb_p, const float *scd, const float *scX, const float *scx,
                                        const unsigned char *clip, float *dw) {
    O1B_GI_SHARED;
    o1b_gemm_i8_run(I, J, P, A, sa_i, sa_p, B, sb_j, sb_p, o1b_gi_dw{dw, scd[0], scX[0], scx[0], clip}, As, Bs);
}

/* ------------------------------------------------------------------ Walsh-Hadamard rotation */
/* Along the rows of an (Rp, C) matrix, Rp a multiple of QB: for each block of QB rows and each column,
 * stages h = 1, 2, ..., 64 in this order, each (v[i], v[i + h]) = (add(v[i], v[i + h]), sub(v[i], v[i + h]))
 * for every i < QB with (i & h) = 0 (fp32, or exact int32). The pairs of one stage are disjoint, so
 * how a stage is spread over threads changes no bit.
 *
 * Grid (ceil(C / QR_COLS), Rp / QB) of QA_THREADS threads: lane l of warp w holds column
 * QR_COLS x + 8w + (l & 7) and rows 32s ... 32s + 31 of block y, s = l >> 3 (a warp's access to one k
 * reads 8 consecutive columns of 4 rows: whole 32-byte sectors). Stages 1 ... 16 pair rows of the same
 * lane; stage 32 pairs lane l with l ^ 8 and stage 64 with l ^ 16 (shuffles). Lanes past the last
 * column hold zeros and store nothing, but take part in the shuffles (every lane of a warp must). */
__device__ __forceinline__ float o1b_q_bfly_add(float a, float b) { return o1b_add(a, b); }
__device__ __forceinline__ float o1b_q_bfly_sub(float a, float b) { return o1b_sub(a, b); }
__device__ __forceinline__ int o1b_q_bfly_add(int a, int b) { return a + b; }
__device__ __forceinline__ int o1b_q_bfly_sub(int a, int b) { return a - b; }

template <class T>
__device__ __forceinline__ void o1b_q_butterflies(T v[QR_VALS]) {
    int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int h = 1; h < QR_VALS; h <<= 1) {
#pragma unroll
        for (int k = 0; k < QR_VALS; k++) {
            if (k & h) continue;
            T a = v[k], b = v[k + h];
            v[k] = o1b_q_bfly_add(a, b);
            v[k + h] = o1b_q_bfly_sub(a, b);
        }
    }
#pragma unroll
    for (int x = 8; x <= 16; x <<= 1) {        /* h = 32, 64: the partner rows are in lane l ^ x */
        bool upper = (lane & x) != 0;          /* this lane holds v[i + h], the partner v[i] */
#pragma unroll
        for (int k = 0; k < QR_VALS; k++) {
            T o = __shfl_sync(0xFFFFFFFFu, v[k], lane ^ x);
            v[k] = upper ? o1b_q_bfly_sub(o, v[k]) : o1b_q_bfly_add(v[k], o);
        }
    }
}

/* This thread's column and first row (the rows are r0 + k, k < QR_VALS). */
__device__ __forceinline__ i64 o1b_q_rot_col(void) {
    return (i64)blockIdx.x * QR_COLS + 8 * ((int)threadIdx.x >> 5) + ((int)threadIdx.x & 7);
}
__device__ __forceinline__ i64 o1b_q_rot_row0(void) {
    return (i64)blockIdx.y * QB + 32 * (((int)threadIdx.x & 31) >> 3);
}

/* The rotated values stored to f (Rp, C) (o1b_store), and the largest of their |bits|. */
__device__ __forceinline__ u32 o1b_q_rot_store(float v[QR_VALS], i64 Rp, i64 C, float *f) {
    i64 c = o1b_q_rot_col(), r0 = o1b_q_rot_row0();
    u32 m = 0u;
    if (c >= C) return m;
#pragma unroll
    for (int k = 0; k < QR_VALS; k++) {
        float u = o1b_store(v[k]);
        m = o1b_q_max_bits(m, u);
        if (r0 + k < Rp) f[(r0 + k) * C + c] = u;
    }
    return m;
}

/* f (R, C) fp32, R a multiple of QB, rotated in place (the hadamard_rows op): values loaded with
 * o1b_load, stored with o1b_store. */
extern "C" __global__ void __launch_bounds__(QA_THREADS) o1b_hadamard_rows(i64 R, i64 C, float *f) {
    i64 c = o1b_q_rot_col(), r0 = o1b_q_rot_row0();
    float v[QR_VALS];
#pragma unroll
    for (int k = 0; k < QR_VALS; k++) v[k] = c < C ? o1b_load(f[(r0 + k) * C + c]) : 0.0f;
    o1b_q_butterflies(v);
    o1b_q_rot_store(v, R, C, f);
}

/* The dW operand D: d (Np, M) = dy (N, M) widened, +0 rows n >= N, rotated; then its scale (sc,
 * o1b_q_absmax_finish). Grid (ceil(M / QR_COLS), Np / QB). */
extern "C" __global__ void __launch_bounds__(QA_THREADS)
o1b_q_rotate_d(i64 N, i64 Np, i64 M, const bf16 *dy, float *d, u32 *part, u32 *counter, float *sc, int qmax) {
    i64 c = o1b_q_rot_col(), r0 = o1b_q_rot_row0();
    float v[QR_VALS];
#pragma unroll
    for (int k = 0; k < QR_VALS; k++) v[k] = c < M && r0 + k < N ? o1b_bf16_to_f32(dy[(r0 + k) * M + c]) : 0.0f;
    o1b_q_butterflies(v);
    o1b_q_absmax_finish(o1b_q_rot_store(v, Np, M, d), part, counter, sc, qmax);
}

/* The dx operand G, transposed: g (Mp, N), g[m, n] = mul(dy[n, m], s_w[m]) for m < M, +0 rows m >= M,
 * rotated; then its scale. The block's dy values (QR_COLS rows n x QB columns m) are staged through
 * shared memory, read along m (coalesced). Grid (ceil(N / QR_COLS), Mp / QB). */
#define QG_PAD 2                  /* the staged tile's row pad (bf16): spreads a warp's reads over the banks */
extern "C" __global__ void __launch_bounds__(QA_THREADS)
o1b_q_rotate_g(i64 N, i64 M, i64 Mp, const bf16 *dy, const float *sw, float *g, u32 *part, u32 *counter,
               float *sc, int qmax) {
    __shared__ bf16 tile[QR_COLS][QB + QG_PAD];      /* [n - n0][m - m0] */
    int tid = (int)threadIdx.x;
    i64 n0 = (i64)blockIdx.x * QR_COLS, m0 = (i64)blockIdx.y * QB;
    for (int e = tid; e < QR_COLS * QB; e += QA_THREADS) {
        i64 n = n0 + e / QB, m = m0 + e % QB;
        tile[e / QB][e % QB] = n < N && m < M ? dy[n * M + m] : (bf16)0;
    }
    __syncthreads();
    i64 c = o1b_q_rot_col(), r0 = o1b_q_rot_row0();
    int cl = (int)(c - n0), k0 = (int)(r0 - m0);
    float v[QR_VALS];
#pragma unroll
    for (int k = 0; k < QR_VALS; k++)
        v[k] = c < N && r0 + k < M ? o1b_load(o1b_mul(o1b_bf16_to_f32(tile[cl][k0 + k]), sw[r0 + k])) : 0.0f;
    o1b_q_butterflies(v);
    o1b_q_absmax_finish(o1b_q_rot_store(v, Mp, N, g), part, counter, sc, qmax);
}

/* The rotated integer operands (R in the dx GEMM, X in the dW GEMM): q (R, C) int8, +0 rows r >= R,
 * rotated in int32 (|values| <= 127 QB: exact), f (Rp, C) = i2f (exact: < 2^24); then its scale.
 * Grid (ceil(C / QR_COLS), Rp / QB). */
extern "C" __global__ void __launch_bounds__(QA_THREADS)
o1b_q_rotate_i8(i64 R, i64 Rp, i64 C, const i8 *q, float *f, u32 *part, u32 *counter, float *sc, int qmax) {
    i64 c = o1b_q_rot_col(), r0 = o1b_q_rot_row0();
    int v[QR_VALS];
#pragma unroll
    for (int k = 0; k < QR_VALS; k++) v[k] = c < C && r0 + k < R ? (int)q[(r0 + k) * C + c] : 0;
    o1b_q_butterflies(v);
    float u[QR_VALS];
#pragma unroll
    for (int k = 0; k < QR_VALS; k++) u[k] = o1b_i2f(v[k]);
    o1b_q_absmax_finish(o1b_q_rot_store(u, Rp, C, f), part, counter, sc, qmax);
}
