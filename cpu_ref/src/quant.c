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
 *
 * This file is the portable code (and the public entry points). Where the CPU has AVX-512 VNNI
 * (and the SIMD level is not capped below 2), the layer and the int8 GEMM run in quant_vnni.c
 * instead: the same values in fewer passes; tests/ops/test_quant.py holds both to the numpy spec.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")  /* lets the selects below if-convert; no value changes */
#endif
#include "contract.h"
#include "quant.h"
#include "runtime.h"

/* ------------------------------------------------------------------ branch-free helpers */
/* The loops below are written as selects on bit patterns so the compiler vectorizes them; each
 * gives exactly the contract primitive's result. o1b_mul differs from a flushed IEEE product
 * only when |a*b| rounds to exactly 2^-126 (the exact product decides there): such a case sets
 * `bad`, and the caller recomputes its range with the scalar primitives. */
static inline float qflush(float x) {
    uint32_t u = qbits(x);
    return qfrom((u & 0x7F800000u) == 0 ? (u & 0x80000000u) : u);
}
static inline float qstore(float x) {      /* o1b_store: flush, then canonical NaN */
    uint32_t u = qbits(x);
    u = (u & 0x7F800000u) == 0 ? (u & 0x80000000u) : u;
    return qfrom((u & 0x7FFFFFFFu) > 0x7F800000u ? O1B_NAN_BITS : u);
}
#define QMUL(r, a, b, bad) do { float r_ = (a) * (b); uint32_t u_ = qbits(r_); \
    (bad) |= (uint32_t)((u_ & 0x7FFFFFFFu) == 0x00800000u); \
    (r) = qfrom((u_ & 0x7F800000u) == 0 ? (u_ & 0x80000000u) : u_); } while (0)
/* o1b_level_q for any non-NaN t (clamping first changes nothing: qm, an integer, rounds to itself). */
static inline int8_t qrne(float t, float qm) {
    t = t > qm ? qm : t;
    t = t < -qm ? -qm : t;
    /* t + 1.5*2^23 has ulp 1 here, so its low bits are the rounded integer (as in o1b_level_q) */
    return (int8_t)(qbits(t + O1B_ROUND_MAGIC) - 0x4B400000u);
}

/* ------------------------------------------------------------------ scales and quantization */

typedef struct { int64_t M, K; const bf16 *w; int8_t *q; float *s; uint8_t *clip; int qmax; } qw_args;

#define QW_R 8   /* rows summed side by side (each row's sum stays k-ascending) */
static void qw_rows(void *ctx, int64_t lo, int64_t hi) {
    const qw_args *a = (const qw_args *)ctx;
    int64_t K = a->K;
    const float qm = (float)a->qmax;
    for (int64_t j0 = lo; j0 < hi; j0 += QW_R) {
        int nr = hi - j0 < QW_R ? (int)(hi - j0) : QW_R;
        float S[QW_R] = {0};
        if (nr == QW_R) {
            const bf16 *rw[QW_R];
            for (int r = 0; r < QW_R; r++) rw[r] = a->w + (j0 + r) * K;
            for (int64_t k = 0; k < K; k++)
                for (int r = 0; r < QW_R; r++)
                    S[r] = qflush(S[r] + qfrom(((uint32_t)rw[r][k] & 0x7FFFu) < 0x80u ? 0u
                                                : ((uint32_t)rw[r][k] & 0x7FFFu) << 16));
        } else {
            for (int r = 0; r < nr; r++) {
                const bf16 *row = a->w + (j0 + r) * K;
                for (int64_t k = 0; k < K; k++) S[r] = o1b_add(S[r], fabsf(o1b_bf16_to_f32(row[k])));
            }
        }
        for (int r = 0; r < nr; r++) {
            int64_t j = j0 + r;
            const bf16 *row = a->w + j * K;
            float s = weight_scale_q(S[r], K, a->qmax);
            int8_t *q = a->q + j * K;
            uint8_t *c = a->clip ? a->clip + j * K : NULL;
            int kind = scale_kind(s);
            if (kind != 1) {
                memset(q, 0, (size_t)K);
                if (c) memset(c, kind == 2 ? 2 : 0, (size_t)K);
            } else {
                float inv = o1b_div(1.0f, s);
                uint32_t bad = 0;
                if (c) {
                    for (int64_t k = 0; k < K; k++) {
                        float t; QMUL(t, qflush(qfrom((uint32_t)row[k] << 16)), inv, bad);
                        q[k] = qrne(t, qm);
                        c[k] = (uint8_t)(fabsf(t) > qm);
                    }
                } else {
                    for (int64_t k = 0; k < K; k++) {
                        float t; QMUL(t, qflush(qfrom((uint32_t)row[k] << 16)), inv, bad);
                        q[k] = qrne(t, qm);
                    }
                }
                if (bad)
                    for (int64_t k = 0; k < K; k++) {
                        float t = o1b_mul(o1b_bf16_to_f32(row[k]), inv);
                        q[k] = o1b_level_q(t, a->qmax);
                        if (c) c[k] = fabsf(t) > qm;
                    }
            }
            a->s[j] = o1b_store(s);
        }
    }
}

/* w (M, K) bf16 -> q (M, K) int8, s (M) fp32; clip (M, K) optional: 1 where |t| > 127,
 * 2 on every element of a row with a NaN scale. */
static void quant_weight_rows(int64_t M, int64_t K, const bf16 *w, int8_t *q, float *s, uint8_t *clip,
                              int qmax) {
    qw_args a = {M, K, w, q, s, clip, qmax};
    o1b_parallel_for(M, 1 + (1 << 15) / (K > 0 ? K : 1), qw_rows, &a);
}
O1B_API void o1b_quant_weight_rows(int64_t M, int64_t K, const bf16 *w, int8_t *q, float *s) {
    quant_weight_rows(M, K, w, q, s, NULL, QMAX);
}


/* Per-tensor absmax, split into chunks (a max is exact in any order). Sources: flushed fp32
 * (kind 0), bf16 (kind 1, flushed on widening), int32 (kind 2, exact in fp32). Computed on the
 * bit patterns of |v|, whose integer order is the float order; NaN/inf -> NaN. */
#define AM_CHUNKS 64
typedef struct { const void *v; int kind; int64_t n, per; uint32_t *mx, *bad; } am_args;
static void am_range(void *ctx, int64_t lo, int64_t hi) {
    const am_args *a = (const am_args *)ctx;
    for (int64_t ch = lo; ch < hi; ch++) {
        int64_t i0 = ch * a->per, i1 = i0 + a->per < a->n ? i0 + a->per : a->n;
        uint32_t m = 0, bad = 0;
        if (a->kind == 0) {
            const uint32_t *v = (const uint32_t *)a->v;
            for (int64_t i = i0; i < i1; i++) {
                uint32_t u = v[i] & 0x7FFFFFFFu;
                bad |= (uint32_t)(u >= 0x7F800000u);
                m = u > m ? u : m;
            }
        } else if (a->kind == 1) {
            const bf16 *v = (const bf16 *)a->v;
            for (int64_t i = i0; i < i1; i++) {
                uint32_t u = (uint32_t)v[i] & 0x7FFFu;
                bad |= (uint32_t)(u >= 0x7F80u);
                u = u < 0x80u ? 0u : u;
                m = u > m ? u : m;
            }
            m <<= 16;
        } else {
            const int32_t *v = (const int32_t *)a->v;
            for (int64_t i = i0; i < i1; i++) {
                int32_t x = v[i], ax = x < 0 ? -x : x;
                m = (uint32_t)ax > m ? (uint32_t)ax : m;
            }
            m = qbits((float)(int32_t)m);
        }
        a->mx[ch] = m; a->bad[ch] = bad;
    }
}
static float absmax_any(const void *v, int kind, int64_t n) {
    uint32_t mx[AM_CHUNKS], bad[AM_CHUNKS];
    int64_t per = (n + AM_CHUNKS - 1) / AM_CHUNKS;
    if (per < 4096) per = 4096;
    int64_t nch = (n + per - 1) / per;
    am_args a = {v, kind, n, per, mx, bad};
    o1b_parallel_for(nch, 1, am_range, &a);
    uint32_t m = 0, b = 0;
    for (int64_t c = 0; c < nch; c++) { m = mx[c] > m ? mx[c] : m; b |= bad[c]; }
    return b ? o1b_nan() : qfrom(m);
}

/* q = level(mul(v, inv)) from fp32 (kind 0, flushed), bf16 (1) or int32 (2). */
typedef struct { const void *v; int kind; int8_t *q; float inv; int qmax; } qt_args;
static void qt_range(void *ctx, int64_t lo, int64_t hi) {
    const qt_args *a = (const qt_args *)ctx;
    float inv = a->inv, qm = (float)a->qmax;
    uint32_t bad = 0;
    if (a->kind == 0) {
        const float *v = (const float *)a->v;
        for (int64_t i = lo; i < hi; i++) { float t; QMUL(t, v[i], inv, bad); a->q[i] = qrne(t, qm); }
    } else if (a->kind == 1) {
        const bf16 *v = (const bf16 *)a->v;
        for (int64_t i = lo; i < hi; i++) {
            float t; QMUL(t, qflush(qfrom((uint32_t)v[i] << 16)), inv, bad); a->q[i] = qrne(t, qm);
        }
    } else {
        const int32_t *v = (const int32_t *)a->v;
        for (int64_t i = lo; i < hi; i++) { float t; QMUL(t, (float)v[i], inv, bad); a->q[i] = qrne(t, qm); }
    }
    if (bad)
        for (int64_t i = lo; i < hi; i++) {
            float x = a->kind == 0 ? ((const float *)a->v)[i]
                    : a->kind == 1 ? o1b_bf16_to_f32(((const bf16 *)a->v)[i])
                    : o1b_i2f(((const int32_t *)a->v)[i]);
            a->q[i] = o1b_level_q(o1b_mul(x, inv), a->qmax);
        }
}
static float quant_tensor_any(const void *v, int kind, int64_t n, int8_t *q, int qmax) {
    float s = tensor_scale_q(absmax_any(v, kind, n), qmax);
    if (scale_kind(s) != 1) { memset(q, 0, (size_t)n); return s; }
    qt_args a = {v, kind, q, o1b_div(1.0f, s), qmax};
    o1b_parallel_for(n, 1 << 14, qt_range, &a);
    return s;
}
/* v (n) fp32, already flushed -> q (n) int8, returns the scale. */
static float quant_tensor_f32(const float *v, int64_t n, int8_t *q, int qmax) { return quant_tensor_any(v, 0, n, q, qmax); }

/* x (n) bf16 -> q (n) int8, *s. Returns 0 on allocation failure (none is needed now). */
static int quant_tensor_bf16(const bf16 *x, int64_t n, int8_t *q, float *s, int qmax) {
    *s = quant_tensor_any(x, 1, n, q, qmax);
    return 1;
}
O1B_API int o1b_quant_tensor(int64_t n, const bf16 *x, int8_t *q, float *s) {
    float sc;
    if (!quant_tensor_bf16(x, n, q, &sc, QMAX)) return -1;
    *s = o1b_store(sc);
    return 0;
}
O1B_API int o1b_quant_tensor_f32(int64_t n, const float *v, int8_t *q, float *s) {
    float *f = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!f) return -1;
    for (int64_t i = 0; i < n; i++) f[i] = o1b_load(v[i]);
    *s = o1b_store(quant_tensor_f32(f, n, q, QMAX));
    free(f);
    return 0;
}

/* ------------------------------------------------------------------ Walsh-Hadamard rotation */
/* Rows [r0, r0 + QB) of a (R, C) row-major matrix form one block; the butterfly stages
 * h = 1, 2, ..., QB/2 combine rows i and i + h (i & h == 0) into (add(a, b), sub(a, b)),
 * elementwise over the C columns. Integer version: the same in int32 (exact). Columns are
 * independent, so the work is split over (block, column tile). */
#define ROT_CT 256
typedef struct { float *f; int32_t *n; int64_t C, ntile; } rot_args;
static void rot_blocks(void *ctx, int64_t lo, int64_t hi) {
    const rot_args *a = (const rot_args *)ctx;
    for (int64_t task = lo; task < hi; task++) {
        int64_t blk = task / a->ntile, c0 = (task % a->ntile) * ROT_CT;
        int64_t c1 = c0 + ROT_CT < a->C ? c0 + ROT_CT : a->C;
        for (int h = 1; h < QB; h <<= 1)
            for (int i = 0; i < QB; i++) {
                if (i & h) continue;
                int64_t r0 = (blk * QB + i) * a->C, r1 = (blk * QB + i + h) * a->C;
                if (a->f) {
                    float *x = a->f + r0, *y = a->f + r1;
                    for (int64_t c = c0; c < c1; c++) {
                        float u = x[c], v = y[c];
                        x[c] = qflush(u + v); y[c] = qflush(u - v);
                    }
                } else {
                    int32_t *x = a->n + r0, *y = a->n + r1;
                    for (int64_t c = c0; c < c1; c++) {
                        int32_t u = x[c], v = y[c];
                        x[c] = u + v; y[c] = u - v;
                    }
                }
            }
    }
}
/* Rotate along the rows (R a multiple of QB). */
static void rotate_rows_f32(float *f, int64_t R, int64_t C) {
    int64_t nt = C > 0 ? (C + ROT_CT - 1) / ROT_CT : 1;
    rot_args a = {f, NULL, C, nt};
    o1b_parallel_for(R / QB * nt, 1, rot_blocks, &a);
}
static void rotate_rows_i32(int32_t *n, int64_t R, int64_t C) {
    int64_t nt = C > 0 ? (C + ROT_CT - 1) / ROT_CT : 1;
    rot_args a = {NULL, n, C, nt};
    o1b_parallel_for(R / QB * nt, 1, rot_blocks, &a);
}

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
typedef struct { int64_t I, J, P; const int8_t *A, *B; int32_t *C; } i8_args;

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

static void gemm_i8(int64_t I, int64_t J, int64_t P, const int8_t *A, const int8_t *B, int32_t *C) {
    if (o1b_gemm_i8_vnni(I, J, P, A, B, C)) return;      /* quant_vnni.c, when the CPU has it */
    i8_args g = {I, J, P, A, B, C};
    int64_t per = J * (P > 0 ? P : 1);
    o1b_parallel_for(I, 1 + (1 << 18) / (per > 0 ? per : 1), i8_rows_portable, &g);
}
O1B_API void o1b_gemm_i8(int64_t I, int64_t J, int64_t P, const int8_t *A, const int8_t *B, int32_t *C) {
    gemm_i8(I, J, P, A, B, C);
}
O1B_API int o1b_gemm_i8_has_vnni(void) { return o1b_q_vnni_available(); }

/* (R,C) -> (C,R), split over the destination rows. */
typedef struct { const int8_t *src; int64_t R, C; int8_t *dst; } tr_args;
static void tr_range(void *ctx, int64_t lo, int64_t hi) {
    const tr_args *a = (const tr_args *)ctx;
    int64_t R = a->R, C = a->C;
    for (int64_t c0 = lo; c0 < hi; c0 += 32)
        for (int64_t r0 = 0; r0 < R; r0 += 32)
            for (int64_t c = c0; c < hi && c < c0 + 32; c++) {
                int8_t *d = a->dst + c * R;
                const int8_t *s = a->src + c;
                int64_t r1 = r0 + 32 < R ? r0 + 32 : R;
                for (int64_t r = r0; r < r1; r++) d[r] = s[r * C];
            }
}
static void transpose_i8(const int8_t *src, int64_t R, int64_t C, int8_t *dst) {
    tr_args a = {src, R, C, dst};
    o1b_parallel_for(C, 32, tr_range, &a);
}

/* y[i, j] = store(mul(...mul(mul(i2f(acc), c0), c1)..., cw[j])) chains, over rows. */
typedef struct { int64_t J; const int32_t *acc; float *y; float c[3]; int nc; const float *cw;
                 const uint8_t *clip; } dq_args;
static float dq_exact(const dq_args *a, int64_t idx, int64_t j) {
    float v = o1b_i2f_acc(a->acc[idx]);
    if (a->nc == 1 && a->cw) return o1b_store(o1b_mul(o1b_mul(v, a->c[0]), a->cw[j]));
    for (int t = 0; t < a->nc; t++) v = o1b_mul(v, a->c[t]);
    if (a->cw) v = o1b_mul(v, a->cw[j]);
    v = o1b_mul(v, INV_QB);
    if (a->clip) return a->clip[idx] == 2 ? o1b_nan() : a->clip[idx] ? 0.0f : o1b_store(v);
    return o1b_store(v);
}
static void dq_rows(void *ctx, int64_t lo, int64_t hi) {
    const dq_args *a = (const dq_args *)ctx;
    int64_t J = a->J;
    float c0 = a->c[0], c1 = a->c[1], c2 = a->c[2];
    for (int64_t i = lo; i < hi; i++) {
        const int32_t *ac = a->acc + i * J;
        float *y = a->y + i * J;
        uint32_t bad = 0;
        /* (float)ac[j] is C's int32 -> fp32 conversion (IEEE, round to nearest even), which
         * equals o1b_i2f_acc (CONTRACT.md §6.9); dq_exact uses the definition itself. */
        if (a->nc == 1) {                   /* forward: (acc * sx) * sw[j] */
            for (int64_t j = 0; j < J; j++) {
                float v; QMUL(v, (float)ac[j], c0, bad); QMUL(v, v, a->cw[j], bad);
                y[j] = qstore(v);
            }
        } else if (a->nc == 2) {            /* dx: ((acc * sg) * sr) * 1/QB */
            for (int64_t j = 0; j < J; j++) {
                float v; QMUL(v, (float)ac[j], c0, bad); QMUL(v, v, c1, bad); QMUL(v, v, INV_QB, bad);
                y[j] = qstore(v);
            }
        } else {                            /* dw: (((acc * sd) * sr) * sx) * 1/QB, clip masks */
            const uint8_t *cl = a->clip + i * J;
            for (int64_t j = 0; j < J; j++) {
                float v; QMUL(v, (float)ac[j], c0, bad); QMUL(v, v, c1, bad); QMUL(v, v, c2, bad);
                QMUL(v, v, INV_QB, bad);
                uint32_t u = qbits(qstore(v));
                u = cl[j] == 2 ? O1B_NAN_BITS : cl[j] ? 0u : u;
                y[j] = qfrom(u);
            }
        }
        if (bad)
            for (int64_t j = 0; j < J; j++) y[j] = dq_exact(a, i * J + j, j);
    }
}
static void dequant(int64_t I, int64_t J, const int32_t *acc, float *y, int nc, const float *c,
                    const float *cw, const uint8_t *clip) {
    dq_args a = {J, acc, y, {c[0], nc > 1 ? c[1] : 0.0f, nc > 2 ? c[2] : 0.0f}, nc, cw, clip};
    o1b_parallel_for(I, 1 + (1 << 14) / (J > 0 ? J : 1), dq_rows, &a);
}

/* ------------------------------------------------------------------ the quantized linear layer */
/* qmax: 127 (int8), 31 (the simulated int6 path) or 7 (the simulated int4 path); the VNNI fast
 * path is int8 only. */
/* W's operands held for later calls on the same unchanged W (quant_vnni.c); NULL where the
 * portable code runs (qmax other than QMAX, no VNNI path) or memory is short: then every call
 * computes them, with the same bits. The caller must not change W while it holds them. */
O1B_API void *o1b_qweights_new(int64_t M, int64_t K, const bf16 *w, int qmax) {
    return qmax == QMAX ? (void *)o1b_qweights_new_vnni(M, K, w) : NULL;
}
O1B_API void o1b_qweights_free(void *pw) { o1b_qweights_free_vnni((o1b_qweights *)pw); }
O1B_API int64_t o1b_qweights_bytes(const void *pw) { return o1b_qweights_bytes_vnni((const o1b_qweights *)pw); }

/* pw: W's held operands (o1b_qweights_new on this W) or NULL; -2 if they are another W's. */
O1B_API int o1b_qlinear_forward_q(int64_t N, int64_t K, int64_t M, const bf16 *x, const bf16 *w, float *y,
                                  int qmax, const void *pw) {
    const o1b_qweights *q = (const o1b_qweights *)pw;
    if (q && !o1b_qweights_fits_vnni(q, w, M, K)) return -2;
    o1b_qweights_forget_x(q);           /* the VNNI path notes this x's s_x; the portable one none */
    if (qmax == QMAX && o1b_qlinear_forward_vnni(N, K, M, x, w, y, q)) return 0;   /* quant_vnni.c: the same bits */
    int8_t *qx = (int8_t *)malloc((size_t)(N * K > 0 ? N * K : 1));
    int8_t *qw = (int8_t *)malloc((size_t)(M * K > 0 ? M * K : 1));
    float *sw = (float *)malloc((size_t)(M > 0 ? M : 1) * sizeof(float));
    int32_t *acc = (int32_t *)malloc((size_t)(N * M > 0 ? N * M : 1) * sizeof(int32_t));
    float sx; int rc = -1;
    if (!qx || !qw || !sw || !acc || !quant_tensor_bf16(x, N * K, qx, &sx, qmax)) goto out;
    quant_weight_rows(M, K, w, qw, sw, NULL, qmax);
    gemm_i8(N, M, K, qx, qw, acc);
    dequant(N, M, acc, y, 1, &sx, sw, NULL);
    rc = 0;
out:
    free(qx); free(qw); free(sw); free(acc);
    return rc;
}

/* g[m * N + n] = mul(bf16(dy[n * M + m]), sw[m]) (sw NULL: the plain widened value), m < M. */
typedef struct { int64_t N, M; const bf16 *dy; const float *sw; float *g; } gt_args;
static void gt_range(void *ctx, int64_t lo, int64_t hi) {
    const gt_args *a = (const gt_args *)ctx;
    int64_t N = a->N, M = a->M;
    for (int64_t n0 = 0; n0 < N; n0 += 64) {
        int64_t n1 = n0 + 64 < N ? n0 + 64 : N;
        for (int64_t m = lo; m < hi; m++) {
            float s = a->sw[m], *g = a->g + m * N;
            const bf16 *d = a->dy + m;
            uint32_t bad = 0;
            for (int64_t n = n0; n < n1; n++) {
                float v; QMUL(v, qflush(qfrom((uint32_t)d[n * M] << 16)), s, bad);
                g[n] = v;
            }
            if (bad)
                for (int64_t n = n0; n < n1; n++) g[n] = o1b_mul(o1b_bf16_to_f32(d[n * M]), s);
        }
    }
}
typedef struct { const bf16 *x; float *f; } widen_args;
static void widen_range(void *ctx, int64_t lo, int64_t hi) {
    const widen_args *a = (const widen_args *)ctx;
    for (int64_t i = lo; i < hi; i++) a->f[i] = qflush(qfrom((uint32_t)a->x[i] << 16));
}
typedef struct { const int8_t *q; int32_t *r; } w32_args;
static void w32_range(void *ctx, int64_t lo, int64_t hi) {
    const w32_args *a = (const w32_args *)ctx;
    for (int64_t i = lo; i < hi; i++) a->r[i] = a->q[i];
}

/* dx (N, K) and dW (M, K); either may be NULL. same_x (with held weights pw): the caller's word
 * that x is the array the last forward on pw was given, unchanged since; then that forward's s_x
 * (the same function of the same x) is taken instead of x's absmax again. */
O1B_API int o1b_qlinear_backward_q(int64_t N, int64_t K, int64_t M, const bf16 *dy, const bf16 *x,
                                   const bf16 *w, float *dx, float *dw, int qmax, const void *pw, int same_x) {
    const o1b_qweights *q = (const o1b_qweights *)pw;
    if (q && !o1b_qweights_fits_vnni(q, w, M, K)) return -2;
    if (qmax == QMAX && o1b_qlinear_backward_vnni(N, K, M, dy, x, w, dx, dw, q, same_x)) return 0;   /* the same bits */
    int rc = -1;
    int64_t Mp = pad_qb(M), Np = pad_qb(N);
    int8_t *qw = NULL, *qx = NULL, *qa = NULL, *qb = NULL, *ta = NULL, *tb = NULL;
    float *sw = NULL, *g = NULL;
    int32_t *ri = NULL, *acc = NULL;
    uint8_t *clip = NULL;
    qw = (int8_t *)malloc((size_t)(M * K > 0 ? M * K : 1));
    sw = (float *)malloc((size_t)(M > 0 ? M : 1) * sizeof(float));
    clip = dw ? (uint8_t *)malloc((size_t)(M * K > 0 ? M * K : 1)) : NULL;
    if (!qw || !sw || (dw && !clip)) goto out;
    quant_weight_rows(M, K, w, qw, sw, clip, qmax);
    if (dx) {
        /* G (N, Mp): g = mul(dy, s_w[m]), zero padded, rotated along m. Transposed for the row
         * rotation: rotate G^T (Mp, N) along its rows. */
        g = (float *)malloc((size_t)(Mp * N > 0 ? Mp * N : 1) * sizeof(float));
        ri = (int32_t *)malloc((size_t)(Mp * K > 0 ? Mp * K : 1) * sizeof(int32_t));
        qa = (int8_t *)malloc((size_t)(Mp * N > 0 ? Mp * N : 1));
        qb = (int8_t *)malloc((size_t)(Mp * K > 0 ? Mp * K : 1));
        ta = (int8_t *)malloc((size_t)(Mp * N > 0 ? Mp * N : 1));
        tb = (int8_t *)malloc((size_t)(Mp * K > 0 ? Mp * K : 1));
        acc = (int32_t *)malloc((size_t)(N * K > 0 ? N * K : 1) * sizeof(int32_t));
        if (!g || !ri || !qa || !qb || !ta || !tb || !acc) goto out;
        gt_args ga = {N, M, dy, sw, g};
        o1b_parallel_for(M, 1 + (1 << 14) / (N > 0 ? N : 1), gt_range, &ga);
        memset(g + M * N, 0, (size_t)((Mp - M) * N) * sizeof(float));
        rotate_rows_f32(g, Mp, N);
        float sg = quant_tensor_f32(g, Mp * N, qa, qmax);       /* (Mp, N) */
        w32_args wa = {qw, ri};
        o1b_parallel_for(M * K, 1 << 15, w32_range, &wa);
        memset(ri + M * K, 0, (size_t)((Mp - M) * K) * sizeof(int32_t));
        rotate_rows_i32(ri, Mp, K);
        float sr = quant_tensor_any(ri, 2, Mp * K, qb, qmax);    /* (Mp, K) */
        transpose_i8(qa, Mp, N, ta);                            /* (N, Mp) */
        transpose_i8(qb, Mp, K, tb);                            /* (K, Mp) */
        gemm_i8(N, K, Mp, ta, tb, acc);
        float cc[2] = {sg, sr};
        dequant(N, K, acc, dx, 2, cc, NULL, NULL);
        free(g); free(ri); free(qa); free(qb); free(ta); free(tb); free(acc);
        g = NULL; ri = NULL; qa = qb = ta = tb = NULL; acc = NULL;
    }
    if (dw) {
        float sx;
        qx = (int8_t *)malloc((size_t)(N * K > 0 ? N * K : 1));
        g = (float *)malloc((size_t)(Np * M > 0 ? Np * M : 1) * sizeof(float));
        ri = (int32_t *)malloc((size_t)(Np * K > 0 ? Np * K : 1) * sizeof(int32_t));
        qa = (int8_t *)malloc((size_t)(Np * M > 0 ? Np * M : 1));
        qb = (int8_t *)malloc((size_t)(Np * K > 0 ? Np * K : 1));
        ta = (int8_t *)malloc((size_t)(Np * M > 0 ? Np * M : 1));
        tb = (int8_t *)malloc((size_t)(Np * K > 0 ? Np * K : 1));
        acc = (int32_t *)malloc((size_t)(M * K > 0 ? M * K : 1) * sizeof(int32_t));
        if (!qx || !g || !ri || !qa || !qb || !ta || !tb || !acc) goto out;
        if (!quant_tensor_bf16(x, N * K, qx, &sx, qmax)) goto out;
        widen_args wa = {dy, g};
        o1b_parallel_for(N * M, 1 << 15, widen_range, &wa);     /* (Np, M) */
        memset(g + N * M, 0, (size_t)((Np - N) * M) * sizeof(float));
        rotate_rows_f32(g, Np, M);
        float sd = quant_tensor_f32(g, Np * M, qa, qmax);
        w32_args ra = {qx, ri};
        o1b_parallel_for(N * K, 1 << 15, w32_range, &ra);
        memset(ri + N * K, 0, (size_t)((Np - N) * K) * sizeof(int32_t));
        rotate_rows_i32(ri, Np, K);
        float sr = quant_tensor_any(ri, 2, Np * K, qb, qmax);
        transpose_i8(qa, Np, M, ta);                            /* (M, Np) */
        transpose_i8(qb, Np, K, tb);                            /* (K, Np) */
        gemm_i8(M, K, Np, ta, tb, acc);
        float cc[3] = {sd, sr, sx};
        dequant(M, K, acc, dw, 3, cc, NULL, clip);
    }
    rc = 0;
out:
    free(qw); free(sw); free(clip); free(qx); free(qa); free(qb); free(ta); free(tb);
    free(g); free(ri); free(acc);
    return rc;
}

O1B_API int o1b_qlinear_forward(int64_t N, int64_t K, int64_t M, const bf16 *x, const bf16 *w, float *y) {
    return o1b_qlinear_forward_q(N, K, M, x, w, y, QMAX, NULL);
}
O1B_API int o1b_qlinear_backward(int64_t N, int64_t K, int64_t M, const bf16 *dy, const bf16 *x,
                                 const bf16 *w, float *dx, float *dw) {
    return o1b_qlinear_backward_q(N, K, M, dy, x, w, dx, dw, QMAX, NULL, 0);
}

O1B_API int o1b_quant_constants(int32_t *out) {   /* QMAX, QB, Q_MAX_P */
    out[0] = QMAX; out[1] = QB; out[2] = Q_MAX_P;
    return 0;
}
