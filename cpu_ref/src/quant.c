/* quant.c — the int8 quantized linear layer (CONTRACT.md §6.9, .contract_parts/int8.md).
 *
 *   weights:     per output row j: S = sum_k |w[j,k]| (fp32, k ascending), s_w[j] = mul(div(S, K), QW_COEF)
 *   tensors:     s = div(absmax, 127) (a max is exact in any order)
 *   quantize:    q = clamp(rne(mul(v, div(1, s))), -127, 127)
 *   int8 GEMM:   acc[i,j] = sum_p A[i,p] B[j,p] in int32 (exact: P <= 2^17, so |acc| < 2^31)
 *   forward:     y = mul(mul(i2f(acc), s_x), s_w[j])
 *   backward:    both gradient GEMMs in int8 after a Walsh-Hadamard rotation (blocks of QB = 128,
 *                unnormalized fp32 butterflies; the 1/QB enters the dequantization as one mul).
 * Integer sums are exact, so neither the thread count, the SIMD level nor any tiling changes a
 * bit; every fp32 value is produced by the contract's primitive operations in a written order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "contract.h"
#include "runtime.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define O1B_Q_X86 1
#endif

#define QMAX 127
#define QB 128                          /* Hadamard block along the contraction dimension */
#define QB_LOG2 7
#define QW_COEF 0x1.6b7612p-3f          /* 2/sqrt(127) rounded to nearest fp32 */
#define INV_QB 0x1p-7f                  /* 1/QB */
#define Q_MAX_P (1 << 17)               /* contraction length bound: 2^17 * 127^2 < 2^31 */

/* int32 -> fp32, IEEE round to nearest even (C's conversion in the default rounding mode);
 * never subnormal. Exact for |i| <= 2^24. */
static inline float o1b_i2f_rne(int32_t i) { return (float)i; }

static inline int is_finite(float x) { return (o1b_bits(x) & 0x7F800000u) != 0x7F800000u; }

/* Round to nearest integer, ties to even, then clamp to [-127, 127]. t is finite or NaN is
 * excluded by the callers (scale NaN rows/tensors never reach here). */
static inline int8_t rne_clamp(float t) {
    if (t >= 127.0f) return 127;
    if (t <= -127.0f) return -127;
    /* |t| < 127 < 2^22: adding and subtracting 1.5*2^23 rounds to an integer, ties to even. */
    float r = (t + O1B_ROUND_MAGIC) - O1B_ROUND_MAGIC;
    return (int8_t)(int)r;
}

/* ------------------------------------------------------------------ scales and quantization */
/* s from a row/tensor's statistics; returns 0 (zero scale), 1 (finite), 2 (NaN) */
static inline int scale_kind(float s) {
    if (s != s) return 2;
    return s == 0.0f ? 0 : 1;
}

typedef struct { int64_t M, K; const bf16 *w; int8_t *q; float *s; uint8_t *clip; } qw_args;

static void qw_rows(void *ctx, int64_t lo, int64_t hi) {
    const qw_args *a = (const qw_args *)ctx;
    float kf = o1b_i2f((int32_t)a->K);
    for (int64_t j = lo; j < hi; j++) {
        const bf16 *row = a->w + j * a->K;
        float S = 0.0f;
        for (int64_t k = 0; k < a->K; k++) S = o1b_add(S, fabsf(o1b_bf16_to_f32(row[k])));
        float s = is_finite(S) ? o1b_mul(o1b_div(S, kf), QW_COEF) : o1b_nan();
        int8_t *q = a->q + j * a->K;
        uint8_t *c = a->clip ? a->clip + j * a->K : NULL;
        int kind = scale_kind(s);
        if (kind != 1) {
            memset(q, 0, (size_t)a->K);
            if (c) memset(c, kind == 2 ? 2 : 0, (size_t)a->K);
        } else {
            float inv = o1b_div(1.0f, s);
            for (int64_t k = 0; k < a->K; k++) {
                float t = o1b_mul(o1b_bf16_to_f32(row[k]), inv);
                q[k] = rne_clamp(t);
                if (c) c[k] = fabsf(t) > 127.0f;
            }
        }
        a->s[j] = o1b_store(s);
    }
}

/* w (M, K) bf16 -> q (M, K) int8, s (M) fp32; clip (M, K) optional: 1 where |t| > 127,
 * 2 on every element of a row with a NaN scale. */
static void quant_weight_rows(int64_t M, int64_t K, const bf16 *w, int8_t *q, float *s, uint8_t *clip) {
    qw_args a = {M, K, w, q, s, clip};
    o1b_parallel_for(M, 1 + (1 << 15) / (K > 0 ? K : 1), qw_rows, &a);
}
O1B_API void o1b_quant_weight_rows(int64_t M, int64_t K, const bf16 *w, int8_t *q, float *s) {
    quant_weight_rows(M, K, w, q, s, NULL);
}

/* absmax of fp32 values (flushed): returns NaN if any is NaN or inf. */
static float absmax_f32(const float *v, int64_t n) {
    float m = 0.0f; int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(v[i]);
        bad |= !(a <= 0x1.fffffep127f);
        m = a > m ? a : m;
    }
    return bad ? o1b_nan() : m;
}
static float tensor_scale(float amax) {
    if (amax != amax) return o1b_nan();
    return o1b_div(amax, 127.0f);        /* +0 if amax is 0 or the quotient flushes */
}

typedef struct { const float *v; int8_t *q; float inv; } qt_args;
static void qt_range(void *ctx, int64_t lo, int64_t hi) {
    const qt_args *a = (const qt_args *)ctx;
    for (int64_t i = lo; i < hi; i++) a->q[i] = rne_clamp(o1b_mul(a->v[i], a->inv));
}
/* v (n) fp32, already flushed -> q (n) int8, returns the scale. */
static float quant_tensor_f32(const float *v, int64_t n, int8_t *q) {
    float s = tensor_scale(absmax_f32(v, n));
    if (scale_kind(s) != 1) { memset(q, 0, (size_t)n); return s; }
    qt_args a = {v, q, o1b_div(1.0f, s)};
    o1b_parallel_for(n, 1 << 16, qt_range, &a);
    return s;
}

typedef struct { const bf16 *x; float *f; } widen_args;
static void widen_range(void *ctx, int64_t lo, int64_t hi) {
    const widen_args *a = (const widen_args *)ctx;
    for (int64_t i = lo; i < hi; i++) a->f[i] = o1b_bf16_to_f32(a->x[i]);
}
static float *widen_bf16(const bf16 *x, int64_t n) {
    float *f = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!f) return NULL;
    widen_args a = {x, f};
    o1b_parallel_for(n, 1 << 16, widen_range, &a);
    return f;
}

/* x (n) bf16 -> q (n) int8, *s. Returns 0 on allocation failure. */
static int quant_tensor_bf16(const bf16 *x, int64_t n, int8_t *q, float *s) {
    float *f = widen_bf16(x, n);
    if (!f) return 0;
    *s = quant_tensor_f32(f, n, q);
    free(f);
    return 1;
}
O1B_API int o1b_quant_tensor(int64_t n, const bf16 *x, int8_t *q, float *s) {
    float sc;
    if (!quant_tensor_bf16(x, n, q, &sc)) return -1;
    *s = o1b_store(sc);
    return 0;
}
O1B_API int o1b_quant_tensor_f32(int64_t n, const float *v, int8_t *q, float *s) {
    float *f = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!f) return -1;
    for (int64_t i = 0; i < n; i++) f[i] = o1b_load(v[i]);
    *s = o1b_store(quant_tensor_f32(f, n, q));
    free(f);
    return 0;
}

/* ------------------------------------------------------------------ Walsh-Hadamard rotation */
/* Rows [r0, r0 + QB) of a (R, C) row-major matrix form one block; the butterfly stages
 * h = 1, 2, ..., QB/2 combine rows i and i + h (i & h == 0) into (add(a, b), sub(a, b)),
 * elementwise over the C columns. Integer version: the same in int32 (exact). */
typedef struct { float *f; int32_t *n; int64_t C; } rot_args;
static void rot_blocks(void *ctx, int64_t lo, int64_t hi) {
    const rot_args *a = (const rot_args *)ctx;
    for (int64_t blk = lo; blk < hi; blk++)
        for (int h = 1; h < QB; h <<= 1)
            for (int i = 0; i < QB; i++) {
                if (i & h) continue;
                int64_t r0 = (blk * QB + i) * a->C, r1 = (blk * QB + i + h) * a->C;
                if (a->f) {
                    float *x = a->f + r0, *y = a->f + r1;
                    for (int64_t c = 0; c < a->C; c++) {
                        float u = x[c], v = y[c];
                        x[c] = o1b_add(u, v); y[c] = o1b_sub(u, v);
                    }
                } else {
                    int32_t *x = a->n + r0, *y = a->n + r1;
                    for (int64_t c = 0; c < a->C; c++) {
                        int32_t u = x[c], v = y[c];
                        x[c] = u + v; y[c] = u - v;
                    }
                }
            }
}
/* Rotate along the rows (R a multiple of QB). */
static void rotate_rows_f32(float *f, int64_t R, int64_t C) {
    rot_args a = {f, NULL, C};
    o1b_parallel_for(R / QB, 1, rot_blocks, &a);
}
static void rotate_rows_i32(int32_t *n, int64_t R, int64_t C) {
    rot_args a = {NULL, n, C};
    o1b_parallel_for(R / QB, 1, rot_blocks, &a);
}
static int64_t pad_qb(int64_t n) { return (n + QB - 1) / QB * QB; }

/* Public: rotate a (R, C) fp32 matrix along its rows in place, R a multiple of QB (values are
 * flushed first). */
O1B_API void o1b_hadamard_rows(int64_t R, int64_t C, float *f) {
    for (int64_t i = 0; i < R * C; i++) f[i] = o1b_load(f[i]);
    rotate_rows_f32(f, R, C);
    for (int64_t i = 0; i < R * C; i++) f[i] = o1b_store(f[i]);
}
O1B_API void o1b_hadamard_rows_i32(int64_t R, int64_t C, int32_t *n) { rotate_rows_i32(n, R, C); }

/* ------------------------------------------------------------------ int8 GEMM (exact int32) */
/* C[i,j] = sum_p A[i*P + p] * B[j*P + p], int32 (NT form: both operands contiguous along p). */
typedef struct { int64_t I, J, P; const int8_t *A, *B; int32_t *C; int64_t P4; const uint8_t *Au;
                 const int8_t *Bp; const int32_t *colsum; } i8_args;

static void i8_rows_portable(void *ctx, int64_t lo, int64_t hi) {
    const i8_args *g = (const i8_args *)ctx;
    for (int64_t i = lo; i < hi; i++) {
        const int8_t *a = g->A + i * g->P;
        for (int64_t j = 0; j < g->J; j++) {
            const int8_t *b = g->B + j * g->P;
            int32_t acc = 0;
            for (int64_t p = 0; p < g->P; p++) acc += (int32_t)a[p] * (int32_t)b[p];
            g->C[i * g->J + j] = acc;
        }
    }
}

#if defined(O1B_Q_X86)
#define O1B_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define MR 8
/* Packed: Au (I rounded to MR, P4) u8 = a + 128 (padding 128, i.e. a zero);
 * Bp: for each panel of 32 columns, for each group of 4 p: 32 columns x 4 bytes (padding 0).
 * sum (a + 128) b = sum a b + 128 sum b, so acc = dot - 128 colsum[j] (exact mod 2^32). */
static O1B_VNNI void i8_rows_vnni(void *ctx, int64_t lo, int64_t hi) {
    const i8_args *g = (const i8_args *)ctx;
    int64_t P4 = g->P4, np = (g->J + 31) / 32;
    for (int64_t jp = 0; jp < np; jp++) {
        const int8_t *bp = g->Bp + jp * 32 * P4;
        int64_t j0 = jp * 32, nj = g->J - j0 < 32 ? g->J - j0 : 32;
        __m512i cs0 = _mm512_loadu_si512(g->colsum + j0), cs1 = _mm512_loadu_si512(g->colsum + j0 + 16);
        cs0 = _mm512_slli_epi32(cs0, 7); cs1 = _mm512_slli_epi32(cs1, 7);
        for (int64_t ib = lo; ib < hi; ib++) {
            int64_t i0 = ib * MR;
            const uint8_t *ap = g->Au + i0 * P4;
            __m512i c[MR][2];
            for (int r = 0; r < MR; r++) { c[r][0] = _mm512_setzero_si512(); c[r][1] = _mm512_setzero_si512(); }
            for (int64_t p = 0; p < P4; p += 4) {
                __m512i b0 = _mm512_loadu_si512(bp + p * 32), b1 = _mm512_loadu_si512(bp + p * 32 + 64);
                for (int r = 0; r < MR; r++) {
                    int32_t a4; memcpy(&a4, ap + r * P4 + p, 4);
                    __m512i av = _mm512_set1_epi32(a4);
                    c[r][0] = _mm512_dpbusd_epi32(c[r][0], av, b0);
                    c[r][1] = _mm512_dpbusd_epi32(c[r][1], av, b1);
                }
            }
            for (int r = 0; r < MR && i0 + r < g->I; r++) {
                int32_t *dst = g->C + (i0 + r) * g->J + j0;
                __m512i v0 = _mm512_sub_epi32(c[r][0], cs0), v1 = _mm512_sub_epi32(c[r][1], cs1);
                __mmask16 m0 = nj >= 16 ? 0xFFFF : (__mmask16)((1u << nj) - 1);
                __mmask16 m1 = nj >= 32 ? 0xFFFF : nj <= 16 ? 0 : (__mmask16)((1u << (nj - 16)) - 1);
                _mm512_mask_storeu_epi32(dst, m0, v0);
                _mm512_mask_storeu_epi32(dst + 16, m1, v1);
            }
        }
    }
}
static int has_vnni(void) {
    __builtin_cpu_init();
    return o1b_simd_level() >= 2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
}
static int gemm_i8_vnni(int64_t I, int64_t J, int64_t P, const int8_t *A, const int8_t *B, int32_t *C) {
    int64_t P4 = (P + 3) / 4 * 4, Ip = (I + MR - 1) / MR * MR, Jp = (J + 31) / 32 * 32;
    uint8_t *Au = (uint8_t *)malloc((size_t)(Ip * P4 > 0 ? Ip * P4 : 1));
    int8_t *Bp = (int8_t *)malloc((size_t)(Jp * P4 > 0 ? Jp * P4 : 1));
    int32_t *cs = (int32_t *)calloc((size_t)Jp, sizeof(int32_t));
    if (!Au || !Bp || !cs) { free(Au); free(Bp); free(cs); return 0; }
    memset(Au, 128, (size_t)(Ip * P4));
    for (int64_t i = 0; i < I; i++)
        for (int64_t p = 0; p < P; p++) Au[i * P4 + p] = (uint8_t)(A[i * P + p] + 128);
    memset(Bp, 0, (size_t)(Jp * P4));
    for (int64_t j = 0; j < J; j++) {
        int64_t jp = j / 32, jl = j % 32;
        int8_t *dst = Bp + jp * 32 * P4;
        int32_t s = 0;
        for (int64_t p = 0; p < P; p++) {
            dst[(p / 4) * 128 + jl * 4 + (p % 4)] = B[j * P + p];
            s += B[j * P + p];
        }
        cs[j] = s;
    }
    i8_args g = {I, J, P, A, B, C, P4, Au, Bp, cs};
    o1b_parallel_for(Ip / MR, 1 + (1 << 18) / ((J * P4 * MR) > 0 ? J * P4 * MR : 1) , i8_rows_vnni, &g);
    free(Au); free(Bp); free(cs);
    return 1;
}
#endif

static void gemm_i8(int64_t I, int64_t J, int64_t P, const int8_t *A, const int8_t *B, int32_t *C) {
#if defined(O1B_Q_X86)
    if (has_vnni() && gemm_i8_vnni(I, J, P, A, B, C)) return;
#endif
    i8_args g = {I, J, P, A, B, C, 0, NULL, NULL, NULL};
    int64_t per = J * (P > 0 ? P : 1);
    o1b_parallel_for(I, 1 + (1 << 18) / (per > 0 ? per : 1), i8_rows_portable, &g);
}
O1B_API void o1b_gemm_i8(int64_t I, int64_t J, int64_t P, const int8_t *A, const int8_t *B, int32_t *C) {
    gemm_i8(I, J, P, A, B, C);
}
O1B_API int o1b_gemm_i8_has_vnni(void) {
#if defined(O1B_Q_X86)
    return has_vnni();
#else
    return 0;
#endif
}

static void transpose_i8(const int8_t *src, int64_t R, int64_t C, int8_t *dst) {  /* (R,C)->(C,R) */
    for (int64_t r0 = 0; r0 < R; r0 += 64)
        for (int64_t c0 = 0; c0 < C; c0 += 64)
            for (int64_t r = r0; r < R && r < r0 + 64; r++)
                for (int64_t c = c0; c < C && c < c0 + 64; c++) dst[c * R + r] = src[r * C + c];
}

/* ------------------------------------------------------------------ the quantized linear layer */
O1B_API int o1b_qlinear_forward(int64_t N, int64_t K, int64_t M, const bf16 *x, const bf16 *w, float *y) {
    int8_t *qx = (int8_t *)malloc((size_t)(N * K > 0 ? N * K : 1));
    int8_t *qw = (int8_t *)malloc((size_t)(M * K > 0 ? M * K : 1));
    float *sw = (float *)malloc((size_t)(M > 0 ? M : 1) * sizeof(float));
    int32_t *acc = (int32_t *)malloc((size_t)(N * M > 0 ? N * M : 1) * sizeof(int32_t));
    float sx; int rc = -1;
    if (!qx || !qw || !sw || !acc || !quant_tensor_bf16(x, N * K, qx, &sx)) goto out;
    quant_weight_rows(M, K, w, qw, sw, NULL);
    gemm_i8(N, M, K, qx, qw, acc);
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < M; j++)
            y[i * M + j] = o1b_store(o1b_mul(o1b_mul(o1b_i2f_rne(acc[i * M + j]), sx), sw[j]));
    rc = 0;
out:
    free(qx); free(qw); free(sw); free(acc);
    return rc;
}

/* dx (N, K) and dW (M, K); either may be NULL. */
O1B_API int o1b_qlinear_backward(int64_t N, int64_t K, int64_t M, const bf16 *dy, const bf16 *x,
                                 const bf16 *w, float *dx, float *dw) {
    int rc = -1;
    int64_t Mp = pad_qb(M), Np = pad_qb(N);
    int8_t *qw = NULL, *qx = NULL, *qa = NULL, *qb = NULL, *ta = NULL, *tb = NULL;
    float *sw = NULL, *g = NULL, *f = NULL;
    int32_t *ri = NULL, *acc = NULL;
    uint8_t *clip = NULL;
    qw = (int8_t *)malloc((size_t)(M * K > 0 ? M * K : 1));
    sw = (float *)malloc((size_t)(M > 0 ? M : 1) * sizeof(float));
    clip = (uint8_t *)malloc((size_t)(M * K > 0 ? M * K : 1));
    if (!qw || !sw || !clip) goto out;
    quant_weight_rows(M, K, w, qw, sw, clip);
    if (dx) {
        /* G (N, Mp): g = mul(dy, s_w[m]), zero padded, rotated along m. Transposed for the row
         * rotation: rotate G^T (Mp, N) along its rows. */
        g = (float *)calloc((size_t)(Mp * N > 0 ? Mp * N : 1), sizeof(float));
        ri = (int32_t *)calloc((size_t)(Mp * K > 0 ? Mp * K : 1), sizeof(int32_t));
        f = (float *)malloc((size_t)(Mp * (N > K ? N : K) > 0 ? Mp * (N > K ? N : K) : 1) * sizeof(float));
        qa = (int8_t *)malloc((size_t)(Mp * N > 0 ? Mp * N : 1));
        qb = (int8_t *)malloc((size_t)(Mp * K > 0 ? Mp * K : 1));
        ta = (int8_t *)malloc((size_t)(Mp * N > 0 ? Mp * N : 1));
        tb = (int8_t *)malloc((size_t)(Mp * K > 0 ? Mp * K : 1));
        acc = (int32_t *)malloc((size_t)(N * K > 0 ? N * K : 1) * sizeof(int32_t));
        if (!g || !ri || !f || !qa || !qb || !ta || !tb || !acc) goto out;
        for (int64_t n = 0; n < N; n++)
            for (int64_t m = 0; m < M; m++)
                g[m * N + n] = o1b_mul(o1b_bf16_to_f32(dy[n * M + m]), sw[m]);
        rotate_rows_f32(g, Mp, N);
        float sg = quant_tensor_f32(g, Mp * N, qa);             /* (Mp, N) */
        for (int64_t i = 0; i < M * K; i++) ri[i] = qw[i];
        rotate_rows_i32(ri, Mp, K);
        for (int64_t i = 0; i < Mp * K; i++) f[i] = o1b_i2f(ri[i]);
        float sr = quant_tensor_f32(f, Mp * K, qb);              /* (Mp, K) */
        transpose_i8(qa, Mp, N, ta);                            /* (N, Mp) */
        transpose_i8(qb, Mp, K, tb);                            /* (K, Mp) */
        gemm_i8(N, K, Mp, ta, tb, acc);
        for (int64_t i = 0; i < N * K; i++)
            dx[i] = o1b_store(o1b_mul(o1b_mul(o1b_mul(o1b_i2f_rne(acc[i]), sg), sr), INV_QB));
        free(g); free(ri); free(f); free(qa); free(qb); free(ta); free(tb); free(acc);
        g = NULL; ri = NULL; f = NULL; qa = qb = ta = tb = NULL; acc = NULL;
    }
    if (dw) {
        float sx;
        qx = (int8_t *)malloc((size_t)(N * K > 0 ? N * K : 1));
        g = (float *)calloc((size_t)(Np * M > 0 ? Np * M : 1), sizeof(float));
        ri = (int32_t *)calloc((size_t)(Np * K > 0 ? Np * K : 1), sizeof(int32_t));
        f = (float *)malloc((size_t)(Np * K > 0 ? Np * K : 1) * sizeof(float));
        qa = (int8_t *)malloc((size_t)(Np * M > 0 ? Np * M : 1));
        qb = (int8_t *)malloc((size_t)(Np * K > 0 ? Np * K : 1));
        ta = (int8_t *)malloc((size_t)(Np * M > 0 ? Np * M : 1));
        tb = (int8_t *)malloc((size_t)(Np * K > 0 ? Np * K : 1));
        acc = (int32_t *)malloc((size_t)(M * K > 0 ? M * K : 1) * sizeof(int32_t));
        if (!qx || !g || !ri || !f || !qa || !qb || !ta || !tb || !acc) goto out;
        if (!quant_tensor_bf16(x, N * K, qx, &sx)) goto out;
        for (int64_t i = 0; i < N * M; i++) g[i] = o1b_bf16_to_f32(dy[i]);   /* (Np, M) */
        rotate_rows_f32(g, Np, M);
        float sd = quant_tensor_f32(g, Np * M, qa);
        for (int64_t i = 0; i < N * K; i++) ri[i] = qx[i];
        rotate_rows_i32(ri, Np, K);
        for (int64_t i = 0; i < Np * K; i++) f[i] = o1b_i2f(ri[i]);
        float sr = quant_tensor_f32(f, Np * K, qb);
        transpose_i8(qa, Np, M, ta);                            /* (M, Np) */
        transpose_i8(qb, Np, K, tb);                            /* (K, Np) */
        gemm_i8(M, K, Np, ta, tb, acc);
        for (int64_t i = 0; i < M * K; i++) {
            float v = o1b_mul(o1b_mul(o1b_mul(o1b_mul(o1b_i2f_rne(acc[i]), sd), sr), sx), INV_QB);
            dw[i] = clip[i] == 2 ? o1b_nan() : clip[i] ? 0.0f : o1b_store(v);
        }
    }
    rc = 0;
out:
    free(qw); free(sw); free(clip); free(qx); free(qa); free(qb); free(ta); free(tb);
    free(g); free(f); free(ri); free(acc);
    return rc;
}

O1B_API int o1b_quant_constants(int32_t *out) {   /* QMAX, QB, Q_MAX_P */
    out[0] = QMAX; out[1] = QB; out[2] = Q_MAX_P;
    return 0;
}
