/* vmath.h — the contract's software functions (contract.h, CONTRACT.md §4) on SIMD lanes, and the
 * array loops of the hot ops built on them (vmath.c). Every lane runs the scalar helper's
 * sequence of operations, so each result equals contract.h's bit for bit; a vector in which some
 * lane needs the scalar helper's rare path (a product or quotient that rounds to exactly 2^-126,
 * whose flush the exact value decides) is recomputed lane by lane with contract.h. */
#ifndef O1B_VMATH_H
#define O1B_VMATH_H

#include <stdint.h>

#include "contract.h"

enum { O1B_FN_EXP, O1B_FN_LOG, O1B_FN_SIN, O1B_FN_COS, O1B_FN_SQRT, O1B_FN_RSQRT, O1B_FN_SIGMOID,
       O1B_FN_SILU };

/* 1: the SIMD forms (the default), 0: contract.h's scalar loops (tests compare the two). */
int o1b_vmath_on(void);

/* y[i] = store(f(load(x[i]))) for the function numbered fn (the enum above), i in [0, n). */
void o1b_vmap(int fn, int64_t n, const float *x, float *y);
/* e[i] = exp(sub(load(z[i]), m)) (unstored: a NaN result is exp's canonical NaN). */
void o1b_vexp_sub(int64_t n, const float *z, float m, float *e);
/* Lanes are rows: for rows k in [0, n) whose logits of one chunk are column k of zt (L rows of
 * ldz floats, zt[v * ldz + k]):
 *   mn[k] = max(m[k], cm), cm = max_{v ascending} load(zt[v * ldz + k]) from -inf  (o1b_max)
 *   cs[k] = sum_{v ascending} exp(sub(load(zt[v * ldz + k]), mn[k])) from +0 (unstored) */
void o1b_vexpsum_cols(int64_t n, int64_t L, const float *zt, int64_t ldz, const float *m, float *mn,
                      float *cs);
/* The cross-entropy gradient of every logit of a chunk as if not the target, lanes are rows: for
 * rows k in [0, n) whose logits of one chunk are column k of zt (L rows of ldz floats), each row
 * with its own lse[k], coef[k], dl[k] (loaded),
 *   dzt[v * ldd + k] = f32_to_bf16(mul(mul(exp(sub(load(zt[v * ldz + k]), lse[k])), coef[k]), dl[k])) */
void o1b_vxent_grad_cols(int64_t n, int64_t L, const float *zt, int64_t ldz, const float *lse,
                         const float *coef, const float *dl, bf16 *dzt, int64_t ldd);
/* SwiGLU (swiglu.c) on rows [lo, hi) of h = [gate | up] (2F floats a row), each row's i in [0, F):
 *   forward:  out[i] = store(mul(silu(load(g[i])), load(u[i])))  (out: F a row)
 *   backward: s = sigmoid(g): dup[i] = store(mul(d, mul(g, s))),
 *             dgate[i] = store(mul(mul(d, u), mul(s, add(1, mul(g, sub(1, s))))))  (loads of d, g, u;
 *             dout: F a row, dh = [dgate | dup]: 2F a row) */
void o1b_vswiglu_fwd_rows(int64_t lo, int64_t hi, int64_t F, const float *h, float *out);
void o1b_vswiglu_bwd_rows(int64_t lo, int64_t hi, int64_t F, const float *dout, const float *h,
                          float *dh);
/* y[i] = add(y[i], mul(a, x[i])) for i in [0, n) (operands already flushed, unstored). */
void o1b_vaxpy(int64_t n, float a, const float *x, float *y);
/* out[r] = sum_{d = 0..D-1 ascending} mul(x[d], rows_t[d * ld + r]), each sum from +0, for
 * r in [0, n): n dot products of x with the columns of a transposed block (flushed operands). */
void o1b_vdots_t(int64_t n, int64_t D, const float *x, const float *rows_t, int64_t ld, float *out);
/* The AdamW step of elements [0, n) (adamw.c, CONTRACT.md §6.7); k = {lr, b1, b2, omb1, omb2,
 * eps, decay, bc1, bc2}, loaded by the caller. */
void o1b_vadamw(int64_t n, bf16 *p, const float *g, float *m, float *v, const float *k);
/* RMSNorm (rmsnorm.c, CONTRACT.md §6.3) over rows n in [lo, hi) of C values, g NULL without a
 * gain; every sum over c ascending from +0, eps and invC = 1/C loaded:
 *   forward:  ss = sum_c mul(load(x_c), load(x_c)),  r = rsqrt(add(mul(ss, invC), eps)),
 *             rstd[n] = store(r),  y_c = store(mul(mul(load(x_c), r), g_c))  (without gain mul(load(x_c), r))
 *   backward: t_c = mul(load(dy_c), g_c) or load(dy_c),  dot = sum_c mul(t_c, load(x_c)),
 *             r = load(rstd[n]),  b = mul(mul(dot, mul(mul(r, r), r)), invC),
 *             dx_c = store(sub(mul(t_c, r), mul(load(x_c), b)))
 * and the gain's column sums for c in [lo, hi) over every row n ascending:
 *   dg[c] = store(sum_n mul(load(dy[n C + c]), mul(load(x[n C + c]), load(rstd[n])))) */
void o1b_vrms_forward(int64_t lo, int64_t hi, int64_t C, const float *x, const bf16 *g, float eps,
                      float invC, float *y, float *rstd);
void o1b_vrms_backward(int64_t lo, int64_t hi, int64_t C, const float *dy, const float *x,
                       const bf16 *g, const float *rstd, float invC, float *dx);
void o1b_vrms_dg(int64_t lo, int64_t hi, int64_t N, int64_t C, const float *dy, const float *x,
                 const float *rstd, float *dg);

/* RoPE rows [lo, hi) of x (B, T, R, D) (rope.c); i of a row on lanes. */
void o1b_vrope_rows(int64_t lo, int64_t hi, int64_t T, int64_t R, int64_t D, const float *x,
                    const float *cs, const float *sn, float *y, int backward);
/* dst[c] = store(sum_{t < n ascending} load(src[pos[t] * C + c])) from +0 for c < C (the embedding
 * backward's row of one token id), c on lanes. */
void o1b_vsum_rows(int64_t n, const int64_t *pos, const float *src, int64_t C, float *dst);
/* out[b] = store(sum_{i ascending} mul(v, v)), v = load(x[i]) over block b's B elements (the last
 * block ends at n), for blocks [lo, hi) (reduce.c), whole blocks on lanes. */
void o1b_vsumsq_blocks(int64_t lo, int64_t hi, int64_t n, int64_t B, const float *x, float *out);
/* Elements [lo, hi) of the small elementwise ops (mathfn.c):
 *   y[i] = f32_to_bf16(x[i]),  y[i] = store(bf16_to_f32(x[i])),
 *   out[i] = store(add(load(a[i]), load(b[i]))) (out may be a),  a[i] = store(mul(load(a[i]), s))
 *   (s loaded) */
void o1b_vto_bf16(int64_t lo, int64_t hi, const float *x, bf16 *y);
/* Rows [lo, hi) of an op's fp32 output of `width` floats a row, delivered as bf16 at out16 (row r at
 * out16 + r width): rows(ctx, r0, r1, buf) computes rows r0 .. r1-1 into buf (row r0 first), a
 * multiple of `group` rows at a time (the last chunk may be short) into a scratch block of about
 * 32 KiB, which stays in cache, and o1b_vto_bf16 converts them from there. width <= 0: rows is
 * called once for the whole range with a buffer it must not write. 0, or -1 when the scratch
 * cannot be had. */
int o1b_rows_to_bf16(int64_t lo, int64_t hi, int64_t width, int64_t group,
                     void (*rows)(const void *ctx, int64_t r0, int64_t r1, float *buf), const void *ctx,
                     bf16 *out16);
void o1b_vto_f32(int64_t lo, int64_t hi, const bf16 *x, float *y);
void o1b_vadd(int64_t lo, int64_t hi, const float *a, const float *b, float *out);
void o1b_vscale_inplace(int64_t lo, int64_t hi, float *a, float s);

/* attention.c's widening: n rows of D values (row r at h + r ld, bf16, or at f + r ld, fp32) to
 * out (n, D) contiguous, widened (bf16) and flushed, as o1b_bf16_to_f32 / o1b_load do (bits moved);
 * out_t: NULL, or the same transposed, out_t[d ldt + r] = out[r D + d]; elo, ehi: both NULL, or
 * both set for each row's exponent range (below: lo = 255, hi = 0 for a row of zeros). */
void o1b_vwiden_rows(int64_t n, int64_t D, const bf16 *h, const float *f, int64_t ld, float *out,
                     float *out_t, int64_t ldt, int32_t *elo, int32_t *ehi);
/* out[r] = sum_{d ascending} mul(load(a[r lda + d]), load(b[r ldb + d])) from +0, unstored, for
 * r < n (rows on lanes, as the RMSNorm rows' dots; attention's Di). */
void o1b_vdot_rows(int64_t n, int64_t D, const float *a, int64_t lda, const float *b, int64_t ldb,
                   float *out);

/* The arrays of attn_dkv_rows (below) for key rows from j of one kv head: their k and v rows
 * (head-major, + r D) and the exponent ranges of those rows; the query rows of the group's rep
 * heads, from (first head, i = 0), the next head T D (or T) floats on: q, dout head-major (T, D),
 * qt, dout_t transposed (D, T), lse (loaded) and Di (T), and the exponent ranges of the q and dout
 * rows (T). An exponent range [lo, hi] holds the biased exponents of a row's nonzero elements
 * (lo = 255, hi = 0 for a row of zeros). */
typedef struct {
    int64_t T, D, rep;
    float scale;
    const float *k, *v;
    const int32_t *klo, *khi, *vlo, *vhi;
    const float *q, *dout, *qt, *dout_t, *lse, *Di;
    const int32_t *qlo, *qhi, *glo, *ghi;
} o1b_vattn_kv;
/* The arrays of attn_dq_rows for query rows from i of one head: their q and dout rows (+ r D), lse
 * (loaded) and Di ([r]) and the exponent ranges of the dout rows ([r]); the key rows of its kv
 * head: k head-major (T, D), kt, vt transposed (D, T), the exponent ranges of the k and v rows (T). */
typedef struct {
    int64_t T, D;
    float scale;
    const float *q, *dout, *lse, *Di;
    const int32_t *glo, *ghi;
    const float *k, *kt, *vt;
    const int32_t *klo, *khi, *vlo, *vhi;
} o1b_vattn_q;

/* The three kernels above for the SIMD level and switch in force, resolved once: for loops that
 * call them many times on short rows (attention), where choosing per call would cost more than
 * the work. */
typedef struct {
    void (*exp_sub)(int64_t n, const float *z, float m, float *e);
    void (*axpy)(int64_t n, float a, const float *x, float *y);
    void (*dots_t)(int64_t n, int64_t D, const float *x, const float *rows_t, int64_t ld, float *out);
    /* attention.c's rows, NULL where there is no hardware flush mode or with vmath off. Each
     * requires the caller to have set o1b_fpmode_ftz, reads its arrays up to O1B_VATTN_PAD floats
     * past the last one it uses (allocate them so), and leaves a row to be computed with
     * contract.h (returns 0, or its bit unset) on a product of exactly 2^-126 (see vmath.c).
     * attn_fwd_rows: the forward of nr <= O1B_VATTN_ROWS consecutive query rows of one head,
     * interleaved, with §6.6's block product (v) or §6.10's (qv, sv; and qv8, NULL unless
     * o1b_attn_vnni_now(): the levels packed per group of 4 keys, D rounded up to 16 values of 4
     * bytes, a byte a key, zeros past T and D); a bit mask of the rows done. */
    int (*attn_fwd_rows)(int nr, int64_t i, const int64_t *jlo, int64_t T, int64_t D, float scale,
                         const float *q, const float *kt, const float *v, const int32_t *vlo,
                         const int32_t *vhi, const float *qv, const float *sv, const int8_t *qv8,
                         float *acc, float *o, int64_t od, float *lse);
    /* attn_dq_rows: pass 1 (dq) of nr <= O1B_VATTN_ROWS consecutive query rows of one head,
     * interleaved; a bit mask of the rows done */
    int (*attn_dq_rows)(int nr, int64_t i, const int64_t *jlo, const o1b_vattn_q *a, float *acc,
                        float *dq, int64_t od);
    /* attn_dkv_rows: pass 2 (dk, dv) of nr <= O1B_VATTN_ROWS consecutive key rows of one kv head,
     * interleaved; a bit mask of the rows done. With qacc, dq's sums too: the rows' terms
     * ds_ij k_j added to query row i's accumulator (head h: qacc + (h T + i) qld, qld a multiple
     * of 32), each query's terms in ascending key order, and qrare[h T + i] set for a query row
     * whose sum may be off (it goes the contract.h way) */
    int (*attn_dkv_rows)(int nr, int64_t j, const int64_t *ilast, const o1b_vattn_kv *a, float *acc,
                         float *dk, float *dv, int64_t od, float *qacc, int64_t qld, int32_t *qrare);
} o1b_vkernels;
#define O1B_VATTN_BK 64     /* attention.c's key block (a contract constant) */
#define O1B_VATTN_PAD 64
#define O1B_VATTN_ROWS 4   /* query rows interleaved by attn_fwd_rows */
const o1b_vkernels *o1b_vkernels_now(void);
/* 1 when o1b_vkernels_now()'s attn_fwd_rows take §6.10's product from packed levels (qv8) on
 * AVX-512 VNNI (o1b_set_attn_vnni(0) turns that off, for tests of the fp32 lanes). */
int o1b_attn_vnni_now(void);

#endif
