/* vmath.c — contract.h's software functions on SIMD lanes, bit-identical to the scalar helpers.
 *
 * Why the bits cannot differ from contract.h:
 *   1. Each lane performs the scalar helper's operations in the same order on the same values:
 *      IEEE add, sub, mul, div and sqrt are correctly rounded in a SIMD lane as in a scalar
 *      register, and the file is compiled with -ffp-contract=off (no FMA).
 *   2. The flush rule, done per lane without a branch: a sum or difference below 2^-126 is exact,
 *      so flushing the IEEE result is o1b_add's flush. A product or quotient whose IEEE result
 *      has magnitude below 2^-126 has an exact value below 2^-126 too, and becomes a zero of its
 *      sign, as in o1b_mul. Only a result of magnitude exactly 2^-126 needs the exact value (it
 *      may come from a product just below 2^-126 rounded up); such a lane marks the vector, and
 *      the whole vector is recomputed with the scalar helpers. These tests look at result bits
 *      only, so they decide the same with the hardware flush modes (FTZ/DAZ, FZ) set or clear,
 *      as the scalar helpers do.
 *   3. The scalar helpers' special-case returns (NaN, overflow, underflow of exp; zero, negative,
 *      inf of log; ...) become per-lane selects; the lanes they cover compute the main path on a
 *      harmless stand-in value (so no lane converts an out-of-range float to int) and are
 *      overwritten with the scalar helper's constant.
 *
 * Written once with GCC/clang vector extensions (the O1B_VMATH_TEMPLATE section at the end, which
 * the file includes again per level) and instantiated for AVX-512F (16 lanes), AVX2 (8) and the
 * portable 4 lanes (SSE2 on x86-64, NEON on arm64, generic vectors elsewhere), chosen at run time
 * by o1b_simd_level() like the GEMM.
 */
#ifndef O1B_VMATH_TEMPLATE

#include <stdint.h>
#include <string.h>

#include "contract.h"
#include "runtime.h"
#include "vmath.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define O1B_VM_X86 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
/* 1: the memory-bound kernels (RMSNorm, add, RoPE, scale) run under the hardware flush mode (the
 * FN(*h) operations of the template section); 0: with the flushing operations. */
#if defined(O1B_VM_X86) || defined(__aarch64__)
#define O1B_VM_HWFTZ 1
#else
#define O1B_VM_HWFTZ 0
#endif

static int g_vmath = 1;           /* a test switch: written by settings(), read by the workers */
static inline int vmath_enabled(void) { return __atomic_load_n(&g_vmath, __ATOMIC_RELAXED); }
O1B_API void o1b_set_vmath(int on) { __atomic_store_n(&g_vmath, on, __ATOMIC_RELAXED); }
int o1b_vmath_on(void) { return vmath_enabled(); }

/* ---- the scalar definitions, for the exact path and the tails ---- */
static inline float fn_scalar(int fn, float x) {
    switch (fn) {
    case O1B_FN_EXP: return o1b_exp(x);
    case O1B_FN_LOG: return o1b_log(x);
    case O1B_FN_SIN: return o1b_sin(x);
    case O1B_FN_COS: return o1b_cos(x);
    case O1B_FN_SQRT: return o1b_sqrt(x);
    case O1B_FN_RSQRT: return o1b_rsqrt(x);
    case O1B_FN_SIGMOID: return o1b_sigmoid(x);
    default: return o1b_silu(x);
    }
}
static void map_scalar(int fn, int64_t lo, int64_t hi, const float *x, float *y) {
    for (int64_t i = lo; i < hi; i++) y[i] = o1b_store(fn_scalar(fn, o1b_load(x[i])));
}
static void exp_sub_scalar(int64_t lo, int64_t hi, const float *z, float m, float *e) {
    for (int64_t i = lo; i < hi; i++) e[i] = o1b_exp(o1b_sub(o1b_load(z[i]), m));
}
static void expsum_cols_scalar(int64_t lo, int64_t hi, int64_t L, const float *zt, int64_t ldz,
                               const float *m, float *mn, float *cs) {
    for (int64_t k = lo; k < hi; k++) {
        float cm = -INFINITY;                           /* a NaN logit is passed over here ... */
        for (int64_t v = 0; v < L; v++) cm = o1b_max(cm, o1b_load(zt[v * ldz + k]));
        float mk = o1b_max(m[k], cm), s = 0.0f;
        for (int64_t v = 0; v < L; v++)                 /* ... and turns the sum NaN here */
            s = o1b_add(s, o1b_exp(o1b_sub(o1b_load(zt[v * ldz + k]), mk)));
        mn[k] = mk;
        cs[k] = s;
    }
}
static void xent_grad_scalar(int64_t lo, int64_t hi, const float *z, float lse, float coef,
                             float dl, bf16 *dz) {
    for (int64_t i = lo; i < hi; i++)
        dz[i] = o1b_f32_to_bf16(o1b_mul(o1b_mul(o1b_exp(o1b_sub(o1b_load(z[i]), lse)), coef), dl));
}
static void xent_grad_cols_scalar(int64_t lo, int64_t hi, int64_t v0, int64_t v1, const float *zt,
                                  int64_t ldz, const float *lse, const float *coef, const float *dl,
                                  bf16 *dzt, int64_t ldd) {
    for (int64_t k = lo; k < hi; k++)
        for (int64_t v = v0; v < v1; v++)
            xent_grad_scalar(0, 1, zt + v * ldz + k, lse[k], coef[k], dl[k], dzt + v * ldd + k);
}
static void swiglu_fwd_scalar(int64_t lo, int64_t hi, const float *g, const float *u, float *out) {
    for (int64_t i = lo; i < hi; i++) out[i] = o1b_store(o1b_mul(o1b_silu(o1b_load(g[i])), o1b_load(u[i])));
}
static void swiglu_bwd_scalar(int64_t lo, int64_t hi, const float *dout, const float *gate,
                              const float *up, float *dgate, float *dup) {
    for (int64_t i = lo; i < hi; i++) {
        float g = o1b_load(gate[i]), u = o1b_load(up[i]), d = o1b_load(dout[i]);
        float s = o1b_sigmoid(g), silu = o1b_mul(g, s);
        float dsilu = o1b_mul(s, o1b_add(1.0f, o1b_mul(g, o1b_sub(1.0f, s))));
        dup[i] = o1b_store(o1b_mul(d, silu));
        dgate[i] = o1b_store(o1b_mul(o1b_mul(d, u), dsilu));
    }
}

static void axpy_scalar(int64_t lo, int64_t hi, float a, const float *x, float *y) {
    for (int64_t i = lo; i < hi; i++) y[i] = o1b_add(y[i], o1b_mul(a, x[i]));
}
static void dots_t_scalar(int64_t lo, int64_t hi, int64_t D, const float *x, const float *rows_t,
                          int64_t ld, float *out) {
    for (int64_t r = lo; r < hi; r++) out[r] = 0.0f;
    for (int64_t d = 0; d < D; d++)
        for (int64_t r = lo; r < hi; r++) out[r] = o1b_add(out[r], o1b_mul(x[d], rows_t[d * ld + r]));
}

static void adamw_scalar(int64_t lo, int64_t hi, bf16 *pp, const float *gg, float *mm, float *vv,
                         const float *k) {
    const float lr = k[0], b1 = k[1], b2 = k[2], omb1 = k[3], omb2 = k[4], eps = k[5], decay = k[6],
                bc1 = k[7], bc2 = k[8];
    for (int64_t i = lo; i < hi; i++) {
        float g = o1b_load(gg[i]);
        float m = o1b_add(o1b_mul(b1, o1b_load(mm[i])), o1b_mul(omb1, g));
        float v = o1b_add(o1b_mul(b2, o1b_load(vv[i])), o1b_mul(omb2, o1b_mul(g, g)));
        float u = o1b_div(o1b_mul(m, bc1), o1b_add(o1b_sqrt(o1b_mul(v, bc2)), eps));
        float p = o1b_sub(o1b_mul(o1b_bf16_to_f32(pp[i]), decay), o1b_mul(lr, u));
        mm[i] = o1b_store(m);
        vv[i] = o1b_store(v);
        pp[i] = o1b_f32_to_bf16(p);
    }
}
static void rms_scale_scalar(int64_t lo, int64_t hi, const float *x, float r, const bf16 *g, float *y) {
    for (int64_t c = lo; c < hi; c++) {
        float v = o1b_mul(o1b_load(x[c]), r);
        if (g) v = o1b_mul(v, o1b_bf16_to_f32(g[c]));
        y[c] = o1b_store(v);
    }
}
static void rms_dx_scalar(int64_t lo, int64_t hi, const float *dy, const float *x, const bf16 *g,
                          float r, float b, float *dx) {
    for (int64_t c = lo; c < hi; c++) {
        float t = o1b_load(dy[c]);
        if (g) t = o1b_mul(t, o1b_bf16_to_f32(g[c]));
        dx[c] = o1b_store(o1b_sub(o1b_mul(t, r), o1b_mul(o1b_load(x[c]), b)));
    }
}
static void rms_dg_scalar(int64_t lo, int64_t hi, int64_t N, int64_t C, const float *dy,
                          const float *x, const float *rstd, float *dg) {
    for (int64_t c = lo; c < hi; c++) {
        float acc = 0.0f;
        for (int64_t n = 0; n < N; n++)
            acc = o1b_add(acc, o1b_mul(o1b_load(dy[n * C + c]),
                                       o1b_mul(o1b_load(x[n * C + c]), o1b_load(rstd[n]))));
        dg[c] = o1b_store(acc);
    }
}

static void to_bf16_scalar(int64_t lo, int64_t hi, const float *x, bf16 *y) {
    for (int64_t i = lo; i < hi; i++) y[i] = o1b_f32_to_bf16(x[i]);
}
static void to_f32_scalar(int64_t lo, int64_t hi, const bf16 *x, float *y) {
    for (int64_t i = lo; i < hi; i++) y[i] = o1b_store(o1b_bf16_to_f32(x[i]));
}
/* The exponent range [*lo, *hi] of the flushed values x[0, n) joined to the one given (vmath.h:
 * a zero counts as 255 for lo, as 0 for hi). */
static void exp_range_scalar(int64_t n, const uint32_t *x, int32_t *lo, int32_t *hi) {
    for (int64_t d = 0; d < n; d++) {
        int32_t e = (int32_t)(x[d] >> 23 & 0xFF), el = e ? e : 255;
        *lo = el < *lo ? el : *lo;
        *hi = e > *hi ? e : *hi;
    }
}
static void widen_rows_scalar(int64_t n, int64_t D, const bf16 *h, const float *f, int64_t ld,
                              float *out, float *out_t, int64_t ldt, int32_t *elo, int32_t *ehi) {
    for (int64_t r = 0; r < n; r++) {
        uint32_t *dst = (uint32_t *)(void *)(out + r * D);
        for (int64_t d = 0; d < D; d++)
            dst[d] = o1b_flush_bits(h ? (uint32_t)h[r * ld + d] << 16 : o1b_bits(f[r * ld + d]));
        if (out_t)
            for (int64_t d = 0; d < D; d++) out_t[d * ldt + r] = out[r * D + d];
        if (!elo) continue;
        int32_t lo = 255, hi = 0;
        exp_range_scalar(D, dst, &lo, &hi);
        elo[r] = lo;
        ehi[r] = hi;
    }
}
static void add_scalar(int64_t lo, int64_t hi, const float *a, const float *b, float *out) {
    for (int64_t i = lo; i < hi; i++) out[i] = o1b_store(o1b_add(o1b_load(a[i]), o1b_load(b[i])));
}
static void scale_inplace_scalar(int64_t lo, int64_t hi, float *a, float s) {
    for (int64_t i = lo; i < hi; i++) a[i] = o1b_store(o1b_mul(o1b_load(a[i]), s));
}

/* sum_{c ascending} mul(t, load(b[c])) from +0 (unstored), t = load(a[c]) or mul(load(a[c]), g_c) */
static float row_dot_scalar(int64_t C, const float *a, const float *b, const bf16 *g) {
    float acc = 0.0f;
    for (int64_t c = 0; c < C; c++) {
        float t = o1b_load(a[c]);
        if (g) t = o1b_mul(t, o1b_bf16_to_f32(g[c]));
        acc = o1b_add(acc, o1b_mul(t, o1b_load(b[c])));
    }
    return acc;
}
static void dot_rows_scalar(int64_t n, int64_t D, const float *a, int64_t lda, const float *b,
                            int64_t ldb, float *out) {
    for (int64_t r = 0; r < n; r++) out[r] = row_dot_scalar(D, a + r * lda, b + r * ldb, NULL);
}
/* RMSNorm's row scalars: r from the sum of squares, b from the backward's dot */
static float rms_r_scalar(float ss, float invC, float eps) {
    return o1b_rsqrt(o1b_add(o1b_mul(ss, invC), eps));
}
static float rms_b_scalar(float dot, float r, float invC) {
    return o1b_mul(o1b_mul(dot, o1b_mul(o1b_mul(r, r), r)), invC);
}
static void rms_fwd_rows_scalar(int64_t lo, int64_t hi, int64_t C, const float *x, const bf16 *g,
                                float eps, float invC, float *y, float *rstd) {
    for (int64_t n = lo; n < hi; n++) {
        const float *xr = x + n * C;
        float r = rms_r_scalar(row_dot_scalar(C, xr, xr, NULL), invC, eps);
        rstd[n] = o1b_store(r);
        rms_scale_scalar(0, C, xr, r, g, y + n * C);
    }
}
static void rms_bwd_rows_scalar(int64_t lo, int64_t hi, int64_t C, const float *dy, const float *x,
                                const bf16 *g, const float *rstd, float invC, float *dx) {
    for (int64_t n = lo; n < hi; n++) {
        float r = o1b_load(rstd[n]);
        float b = rms_b_scalar(row_dot_scalar(C, dy + n * C, x + n * C, g), r, invC);
        rms_dx_scalar(0, C, dy + n * C, x + n * C, g, r, b, dx + n * C);
    }
}

static void rope_rows_scalar(int64_t lo, int64_t hi, int64_t T, int64_t R, int64_t D, const float *x,
                             const float *cs, const float *sn, float *y, int backward) {
    const int64_t Dh = D / 2;
    for (int64_t row = lo; row < hi; row++) {
        const int64_t t = (row / R) % T;
        const float *xr = x + row * D, *c = cs + t * Dh, *s = sn + t * Dh;
        float *yr = y + row * D;
        for (int64_t i = 0; i < Dh; i++) {
            float x1 = o1b_load(xr[i]), x2 = o1b_load(xr[i + Dh]);
            float ci = o1b_load(c[i]), si = o1b_load(s[i]);
            if (!backward) {          /* y1 = x1 c - x2 s,  y2 = x2 c + x1 s */
                yr[i] = o1b_store(o1b_sub(o1b_mul(x1, ci), o1b_mul(x2, si)));
                yr[i + Dh] = o1b_store(o1b_add(o1b_mul(x2, ci), o1b_mul(x1, si)));
            } else {                  /* the transpose: dx1 = dy1 c + dy2 s,  dx2 = dy2 c - dy1 s */
                yr[i] = o1b_store(o1b_add(o1b_mul(x1, ci), o1b_mul(x2, si)));
                yr[i + Dh] = o1b_store(o1b_sub(o1b_mul(x2, ci), o1b_mul(x1, si)));
            }
        }
    }
}
static void sum_rows_scalar(int64_t lo, int64_t hi, int64_t n, const int64_t *pos, const float *src,
                            int64_t C, float *dst) {
    for (int64_t c = lo; c < hi; c++) {
        float acc = 0.0f;
        for (int64_t t = 0; t < n; t++) acc = o1b_add(acc, o1b_load(src[pos[t] * C + c]));
        dst[c] = o1b_store(acc);
    }
}
static void sumsq_blocks_scalar(int64_t lo, int64_t hi, int64_t n, int64_t B, const float *x, float *out) {
    for (int64_t b = lo; b < hi; b++) {
        int64_t end = (b + 1) * B < n ? (b + 1) * B : n;
        float acc = 0.0f;
        for (int64_t i = b * B; i < end; i++) {
            float v = o1b_load(x[i]);
            acc = o1b_add(acc, o1b_mul(v, v));
        }
        out[b] = o1b_store(acc);
    }
}

/* ---- §6.10's int8 block product on AVX-512 VNNI (attn_fwd_rows with packed value levels) ---- */
#if defined(O1B_VM_X86)
static int g_attn_vnni = -1;        /* -1: as the CPU allows; 0: off (tests run the fp32 lanes) */
O1B_API void o1b_set_attn_vnni(int on) { __atomic_store_n(&g_attn_vnni, on ? -1 : 0, __ATOMIC_RELAXED); }
O1B_API int o1b_attn_vnni_now(void) {
    if (!vmath_enabled() || o1b_simd_level() < 2 || __atomic_load_n(&g_attn_vnni, __ATOMIC_RELAXED) == 0) return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
}
/* out[r * 32 + d - d0] = sum over the ng groups of 4 keys of qp[r * qld + k] q_v[k][d] for the
 * O1B_VATTN_ROWS rows r and d in [d0, d0 + 32) (d0 + 16 when Dp - d0 = 16). qp: the rows' q_p
 * bytes (0 .. 127) from the first group's first key; v8: the packed levels from that group (per
 * group Dp values of 4 bytes, one a key). vpdpbusd adds 4 products of an unsigned and a signed byte
 * into each int32 lane: every partial sum is exact (|sum| <= 64 127^2), the int32 sum of any order. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void pv_i8_vnni(int64_t ng, int64_t Dp, int64_t d0, const int8_t *v8, const uint8_t *qp, int64_t qld,
                       int32_t *out) {
    enum { R = O1B_VATTN_ROWS };
    const int two = Dp - d0 > 16;
    __m512i a[R][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
    for (int64_t g = 0; g < ng; g++) {
        const int8_t *vg = v8 + (g * Dp + d0) * 4;
        __m512i v0 = _mm512_loadu_si512(vg), v1 = two ? _mm512_loadu_si512(vg + 64) : _mm512_setzero_si512();
        for (int r = 0; r < R; r++) {
            int32_t w;
            memcpy(&w, qp + r * qld + 4 * g, 4);
            __m512i wv = _mm512_set1_epi32(w);
            a[r][0] = _mm512_dpbusd_epi32(a[r][0], wv, v0);
            if (two) a[r][1] = _mm512_dpbusd_epi32(a[r][1], wv, v1);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_si512(out + r * 32, a[r][0]);
        _mm512_storeu_si512(out + r * 32 + 16, a[r][1]);
    }
}
#else
O1B_API void o1b_set_attn_vnni(int on) { (void)on; }
O1B_API int o1b_attn_vnni_now(void) { return 0; }
#endif

/* ---- instantiations: this file again, from its template section ---- */
#define O1B_VMATH_TEMPLATE 1
#if defined(O1B_VM_X86)
#define O1B_TGT __attribute__((target("avx512f")))
#define O1B_SFX avx512
#define O1B_W 16
#define O1B_ANY(m) (_mm512_test_epi32_mask((__m512i)(m), (__m512i)(m)) != 0)
#define O1B_VSQRT(x) ((vf)_mm512_sqrt_ps((__m512)(x)))
#define O1B_FLUSH(u) ((vi)_mm512_mask_and_epi32((__m512i)(u), _mm512_testn_epi32_mask((__m512i)(u), \
    _mm512_set1_epi32(0x7F800000)), (__m512i)(u), _mm512_set1_epi32((int)0x80000000)))
#include "vmath.c"

#define O1B_TGT __attribute__((target("avx2")))
#define O1B_SFX avx2
#define O1B_W 8
#define O1B_ANY(m) (!_mm256_testz_si256((__m256i)(m), (__m256i)(m)))
#define O1B_VSQRT(x) ((vf)_mm256_sqrt_ps((__m256)(x)))
#include "vmath.c"

#define O1B_ANY(m) (_mm_movemask_ps((__m128)(m)) != 0)
#define O1B_VSQRT(x) ((vf)_mm_sqrt_ps((__m128)(x)))
#elif defined(__aarch64__)
#define O1B_ANY(m) (vmaxvq_u32((uint32x4_t)(m)) != 0)
#define O1B_VSQRT(x) ((vf)vsqrtq_f32((float32x4_t)(x)))
#endif
#define O1B_TGT
#define O1B_SFX portable
#define O1B_W 4
#include "vmath.c"

#if defined(O1B_VM_X86)
#define O1B_VM_DISPATCH(call)                                                  \
    do {                                                                       \
        int level_ = o1b_simd_level();                                         \
        if (level_ >= 2) { call(avx512); return; }                             \
        if (level_ >= 1) { call(avx2); return; }                               \
        call(portable);                                                        \
    } while (0)
#else
#define O1B_VM_DISPATCH(call) do { call(portable); } while (0)
#endif
/* O1B_VM_DISPATCH for the kernels written with the FN(*h) operations: under the hardware flush
 * mode where they assume it, the caller's mode restored after. */
static inline o1b_fpmode vm_ftz(void) {
#if O1B_VM_HWFTZ
    return o1b_fpmode_ftz();
#else
    return (o1b_fpmode){0, 0};
#endif
}
#if defined(O1B_VM_X86)
#define O1B_VM_DISPATCH_FTZ(call)                                                                \
    do {                                                                                         \
        int level_ = o1b_simd_level();                                                           \
        o1b_fpmode mode_ = vm_ftz();                                                             \
        if (level_ >= 2) call(avx512);                                                           \
        else if (level_ >= 1) call(avx2);                                                        \
        else call(portable);                                                                     \
        o1b_fpmode_restore(mode_);                                                               \
    } while (0)
#else
#define O1B_VM_DISPATCH_FTZ(call)                                                                \
    do {                                                                                         \
        o1b_fpmode mode_ = vm_ftz();                                                             \
        call(portable);                                                                          \
        o1b_fpmode_restore(mode_);                                                               \
    } while (0)
#endif

typedef struct { int fn; const float *x; float *y; } vmap_args;
static void vmap_range(void *ctx, int64_t lo, int64_t hi) {
    const vmap_args *a = (const vmap_args *)ctx;
    if (!vmath_enabled()) { map_scalar(a->fn, lo, hi, a->x, a->y); return; }
#define CALL(s) map_##s(a->fn, lo, hi, a->x, a->y)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vmap(int fn, int64_t n, const float *x, float *y) {
    vmap_args a = {fn, x, y};
    o1b_parallel_for(n, 4096, vmap_range, &a);
}

void o1b_vexp_sub(int64_t n, const float *z, float m, float *e) {
    if (!vmath_enabled()) { exp_sub_scalar(0, n, z, m, e); return; }
#define CALL(s) exp_sub_##s(n, z, m, e)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vexpsum_cols(int64_t n, int64_t L, const float *zt, int64_t ldz, const float *m, float *mn,
                      float *cs) {
    if (!vmath_enabled()) { expsum_cols_scalar(0, n, L, zt, ldz, m, mn, cs); return; }
#define CALL(s) expsum_cols_##s(n, L, zt, ldz, m, mn, cs)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vxent_grad_cols(int64_t n, int64_t L, const float *zt, int64_t ldz, const float *lse,
                         const float *coef, const float *dl, bf16 *dzt, int64_t ldd) {
    if (!vmath_enabled()) { xent_grad_cols_scalar(0, n, 0, L, zt, ldz, lse, coef, dl, dzt, ldd); return; }
#define CALL(s) xent_grad_cols_##s(n, L, zt, ldz, lse, coef, dl, dzt, ldd)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vswiglu_fwd_rows(int64_t lo, int64_t hi, int64_t F, const float *h, float *out) {
    if (!vmath_enabled()) {
        for (int64_t r = lo; r < hi; r++) swiglu_fwd_scalar(0, F, h + r * 2 * F, h + r * 2 * F + F, out + r * F);
        return;
    }
#define CALL(s) swiglu_fwd_rows_##s(lo, hi, F, h, out)
    O1B_VM_DISPATCH_FTZ(CALL);
#undef CALL
}
void o1b_vswiglu_bwd_rows(int64_t lo, int64_t hi, int64_t F, const float *dout, const float *h,
                          float *dh) {
    if (!vmath_enabled()) {
        for (int64_t r = lo; r < hi; r++)
            swiglu_bwd_scalar(0, F, dout + r * F, h + r * 2 * F, h + r * 2 * F + F, dh + r * 2 * F,
                              dh + r * 2 * F + F);
        return;
    }
#define CALL(s) swiglu_bwd_rows_##s(lo, hi, F, dout, h, dh)
    O1B_VM_DISPATCH_FTZ(CALL);
#undef CALL
}

void o1b_vaxpy(int64_t n, float a, const float *x, float *y) {
    if (!vmath_enabled()) { axpy_scalar(0, n, a, x, y); return; }
#define CALL(s) axpy_##s(n, a, x, y)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vdots_t(int64_t n, int64_t D, const float *x, const float *rows_t, int64_t ld, float *out) {
    if (!vmath_enabled()) { dots_t_scalar(0, n, D, x, rows_t, ld, out); return; }
#define CALL(s) dots_t_##s(n, D, x, rows_t, ld, out)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vadamw(int64_t n, bf16 *p, const float *g, float *m, float *v, const float *k) {
    if (!vmath_enabled()) { adamw_scalar(0, n, p, g, m, v, k); return; }
#define CALL(s) adamw_##s(n, p, g, m, v, k)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vrms_forward(int64_t lo, int64_t hi, int64_t C, const float *x, const bf16 *g, float eps,
                      float invC, float *y, float *rstd) {
    if (!vmath_enabled()) { rms_fwd_rows_scalar(lo, hi, C, x, g, eps, invC, y, rstd); return; }
#define CALL(s) rms_fwd_rows_##s(lo, hi, C, x, g, eps, invC, y, rstd)
    O1B_VM_DISPATCH_FTZ(CALL);
#undef CALL
}
void o1b_vrms_backward(int64_t lo, int64_t hi, int64_t C, const float *dy, const float *x,
                       const bf16 *g, const float *rstd, float invC, float *dx) {
    if (!vmath_enabled()) { rms_bwd_rows_scalar(lo, hi, C, dy, x, g, rstd, invC, dx); return; }
#define CALL(s) rms_bwd_rows_##s(lo, hi, C, dy, x, g, rstd, invC, dx)
    O1B_VM_DISPATCH_FTZ(CALL);
#undef CALL
}
void o1b_vrms_dg(int64_t lo, int64_t hi, int64_t N, int64_t C, const float *dy, const float *x,
                 const float *rstd, float *dg) {
    if (!vmath_enabled()) { rms_dg_scalar(lo, hi, N, C, dy, x, rstd, dg); return; }
#define CALL(s) rms_dg_##s(lo, hi, N, C, dy, x, rstd, dg)
    O1B_VM_DISPATCH_FTZ(CALL);
#undef CALL
}

void o1b_vrope_rows(int64_t lo, int64_t hi, int64_t T, int64_t R, int64_t D, const float *x,
                    const float *cs, const float *sn, float *y, int backward) {
    if (!vmath_enabled()) { rope_rows_scalar(lo, hi, T, R, D, x, cs, sn, y, backward); return; }
#define CALL(s) rope_rows_##s(lo, hi, T, R, D, x, cs, sn, y, backward)
    O1B_VM_DISPATCH_FTZ(CALL);
#undef CALL
}
void o1b_vsum_rows(int64_t n, const int64_t *pos, const float *src, int64_t C, float *dst) {
    if (!vmath_enabled()) { sum_rows_scalar(0, C, n, pos, src, C, dst); return; }
#define CALL(s) sum_rows_##s(n, pos, src, C, dst)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vsumsq_blocks(int64_t lo, int64_t hi, int64_t n, int64_t B, const float *x, float *out) {
    if (!vmath_enabled() || hi - lo < 2) { sumsq_blocks_scalar(lo, hi, n, B, x, out); return; }
#define CALL(s) sumsq_blocks_##s(lo, hi, n, B, x, out)
    O1B_VM_DISPATCH_FTZ(CALL);
#undef CALL
}
void o1b_vto_bf16(int64_t lo, int64_t hi, const float *x, bf16 *y) {
    if (!vmath_enabled()) { to_bf16_scalar(lo, hi, x, y); return; }
#define CALL(s) to_bf16_arr_##s(lo, hi, x, y)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vto_f32(int64_t lo, int64_t hi, const bf16 *x, float *y) {
    if (!vmath_enabled()) { to_f32_scalar(lo, hi, x, y); return; }
#define CALL(s) to_f32_arr_##s(lo, hi, x, y)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vwiden_rows(int64_t n, int64_t D, const bf16 *h, const float *f, int64_t ld, float *out,
                     float *out_t, int64_t ldt, int32_t *elo, int32_t *ehi) {
    if (!vmath_enabled()) { widen_rows_scalar(n, D, h, f, ld, out, out_t, ldt, elo, ehi); return; }
#define CALL(s) widen_rows_##s(n, D, h, f, ld, out, out_t, ldt, elo, ehi)
    O1B_VM_DISPATCH(CALL);
#undef CALL
}
void o1b_vdot_rows(int64_t n, int64_t D, const float *a, int64_t lda, const float *b, int64_t ldb,
                   float *out) {
    if (!vmath_enabled()) { dot_rows_scalar(n, D, a, lda, b, ldb, out); return; }
#define CALL(s) dot_rows_##s(n, D, a, lda, b, ldb, out)
    O1B_VM_DISPATCH_FTZ(CALL);
#undef CALL
}
void o1b_vadd(int64_t lo, int64_t hi, const float *a, const float *b, float *out) {
    if (!vmath_enabled()) { add_scalar(lo, hi, a, b, out); return; }
#define CALL(s) add_arr_##s(lo, hi, a, b, out)
    O1B_VM_DISPATCH_FTZ(CALL);
#undef CALL
}
void o1b_vscale_inplace(int64_t lo, int64_t hi, float *a, float s) {
    if (!vmath_enabled()) { scale_inplace_scalar(lo, hi, a, s); return; }
#define CALL(sfx) scale_inplace_arr_##sfx(lo, hi, a, s)
    O1B_VM_DISPATCH_FTZ(CALL);
#undef CALL
}


static void exp_sub_s(int64_t n, const float *z, float m, float *e) { exp_sub_scalar(0, n, z, m, e); }
static void axpy_s(int64_t n, float a, const float *x, float *y) { axpy_scalar(0, n, a, x, y); }
static void dots_t_s(int64_t n, int64_t D, const float *x, const float *rows_t, int64_t ld, float *out) {
    dots_t_scalar(0, n, D, x, rows_t, ld, out);
}
/* The attention rows need the hardware flush mode (x86 and arm64 have it). */
#if defined(O1B_VM_X86) || defined(__aarch64__)
#define O1B_ATTN_ROWS(s) attn_fwd_rows_##s, attn_dq_rows_##s, attn_dkv_rows_##s
#else
#define O1B_ATTN_ROWS(s) NULL, NULL, NULL
#endif
const o1b_vkernels *o1b_vkernels_now(void) {
    static const o1b_vkernels scalar = {exp_sub_s, axpy_s, dots_t_s, NULL, NULL, NULL};
    static const o1b_vkernels portable = {exp_sub_portable, axpy_portable, dots_t_portable,
                                          O1B_ATTN_ROWS(portable)};
#if defined(O1B_VM_X86)
    static const o1b_vkernels avx2 = {exp_sub_avx2, axpy_avx2, dots_t_avx2, O1B_ATTN_ROWS(avx2)};
    static const o1b_vkernels avx512 = {exp_sub_avx512, axpy_avx512, dots_t_avx512, O1B_ATTN_ROWS(avx512)};
    if (!vmath_enabled()) return &scalar;
    int level = o1b_simd_level();
    return level >= 2 ? &avx512 : level >= 1 ? &avx2 : &portable;
#else
    return vmath_enabled() ? &portable : &scalar;
#endif
}

#else /* O1B_VMATH_TEMPLATE: one SIMD level's functions.
       * Parameters: O1B_SFX name suffix, O1B_TGT function attribute, O1B_W lanes, O1B_ANY(m)
       * whether any lane of an int mask is set, O1B_VSQRT(x) the lanes' IEEE square roots (both
       * optional: lane loops otherwise), O1B_FLUSH(u) o1b_flush of the lanes' bits (optional). */

#define O1B_CAT2(a, b) a##_##b
#define O1B_CAT(a, b) O1B_CAT2(a, b)
#define FN(name) O1B_CAT(name, O1B_SFX)
#define AI static inline __attribute__((always_inline)) O1B_TGT

typedef float FN(vf_t) __attribute__((vector_size(O1B_W * 4)));
typedef int32_t FN(vi_t) __attribute__((vector_size(O1B_W * 4)));
typedef uint32_t FN(vu_t) __attribute__((vector_size(O1B_W * 4)));
typedef uint16_t FN(vh_t) __attribute__((vector_size(O1B_W * 2)));
#define vf FN(vf_t)
#define vi FN(vi_t)
#define vu FN(vu_t)
#define vh FN(vh_t)
#define SIGN ((int32_t)0x80000000)
#define BITS(x) ((vi)(x))
#define VF(u) ((vf)(u))

AI vi FN(isplat)(int32_t s) { return (vi){0} + s; }
/* W copies of s, bit for bit (a float add of +0 would turn -0 into +0) */
AI vf FN(splat)(float s) { return VF(FN(isplat)((int32_t)o1b_bits(s))); }
AI vf FN(load)(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
AI void FN(put)(float *p, vf x) { memcpy(p, &x, sizeof x); }
AI int FN(any)(vi m) {
#ifdef O1B_ANY
    return O1B_ANY(m);
#else
    int32_t r = 0;
    for (int k = 0; k < O1B_W; k++) r |= m[k];
    return r != 0;
#endif
}
AI vf FN(sqrt)(vf x) {
#ifdef O1B_VSQRT
    return O1B_VSQRT(x);
#else
    vf y;
    for (int k = 0; k < O1B_W; k++) y[k] = sqrtf(x[k]);
    return y;
#endif
}
/* m ? a : b per lane (m all ones or zero) */
AI vf FN(sel)(vi m, vf a, vf b) { return VF((m & BITS(a)) | (~m & BITS(b))); }
/* o1b_flush (O1B_FLUSH: the same on a level's mask registers, two instructions instead of four) */
AI vf FN(flush)(vf x) {
#ifdef O1B_FLUSH
    return VF(O1B_FLUSH(BITS(x)));
#else
    vi u = BITS(x), sub = (u & 0x7F800000) == 0;
    return VF(u & (~sub | SIGN));
#endif
}
/* o1b_canon(o1b_flush(x)) */
AI vf FN(store)(vf x) {
    vi nan = x != x;
    return VF((BITS(FN(flush)(x)) & ~nan) | (nan & (int32_t)O1B_NAN_BITS));
}
/* o1b_store of a value already flushed (a result of flush, add, sub, mul, div or widen): the
 * canonical NaN alone */
AI vf FN(canon)(vf x) {
    vi nan = x != x;
    return VF((BITS(x) & ~nan) | (nan & (int32_t)O1B_NAN_BITS));
}
AI vf FN(add)(vf a, vf b) { return FN(flush)(a + b); }
AI vf FN(sub)(vf a, vf b) { return FN(flush)(a - b); }
AI vf FN(neg)(vf a) { return VF(BITS(a) ^ SIGN); }
/* IEEE result below 2^-126 -> zero of its sign; exactly 2^-126 -> mark the lane (rare path) */
AI vf FN(tiny)(vf r, vi *rare) {
    vi u = BITS(r), mag = u & 0x7FFFFFFF;
    *rare |= mag == 0x00800000;
    return VF(u & (~(mag < 0x00800000) | SIGN));
}
AI vf FN(mul)(vf a, vf b, vi *rare) { return FN(tiny)(a * b, rare); }
AI vf FN(div)(vf a, vf b, vi *rare) { return FN(tiny)(a / b, rare); }
AI vf FN(i2f)(vi i) { return FN(flush)(__builtin_convertvector(i, vf)); }
/* The operations of the kernels dispatched with O1B_VM_DISPATCH_FTZ. Under the hardware flush
 * mode (FTZ/DAZ on x86, FZ on arm64) an operand's subnormal is read as the zero of its sign, a
 * bare IEEE add or subtract is o1b_add / o1b_sub (a subnormal sum is exact, and the hardware
 * flushes it to the zero of its sign), and a bare product is o1b_mul unless its magnitude is
 * exactly 2^-126 (x86 detects tininess after rounding; the exact product may lie below): such a
 * lane is marked for the exact path. So ldh needs no flush of its own, provided every value it
 * loads enters an operation before it is stored. Results come out flushed: canon stores them.
 * Without a hardware flush mode they are the flushing operations above. */
#if O1B_VM_HWFTZ
AI vf FN(ldh)(const float *p) { return FN(load)(p); }
AI vf FN(addh)(vf a, vf b) { return a + b; }
AI vf FN(subh)(vf a, vf b) { return a - b; }
AI vf FN(mulh)(vf a, vf b, vi *rare) {
    vf r = a * b;
    *rare |= (BITS(r) & 0x7FFFFFFF) == 0x00800000;
    return r;
}
#else
AI vf FN(ldh)(const float *p) { return FN(flush)(FN(load)(p)); }
AI vf FN(addh)(vf a, vf b) { return FN(add)(a, b); }
AI vf FN(subh)(vf a, vf b) { return FN(sub)(a, b); }
AI vf FN(mulh)(vf a, vf b, vi *rare) { return FN(mul)(a, b, rare); }
#endif

/* o1b_exp. Only the last multiply needs the flush rule; every other operation of the main path
 * gets o1b_exp's bits with the bare IEEE operation (xs flushed, |xs| <= 103), because its result
 * is never below 2^-126 unless it is zero:
 *   - mul(xs, log2e): log2e > 1, so |xs log2e| >= |xs| >= 2^-126 (or 0). mul(nf, ln2_hi|lo): nf is
 *     an integer, the constants exceed 2^-20.
 *   - add/sub of a and b with |b| >= 2^-100 (the rounding constant; ln2_hi nf and ln2_lo nf for
 *     nf != 0; the Horner constants, >= 1/6!): either |a| < 2^-101 and |a + b| > 2^-101, or both
 *     are multiples of 2^-124 and so is the sum. With nf = 0 the two subtractions take away +0
 *     from xs, which is flushed.
 *   - mul(p, r) in the Horner steps may be tiny, and then o1b_mul's zero and the IEEE result
 *     (subnormal or 2^-126) differ; but each is added to a Horner constant c >= 2^-10 next, and
 *     c + t rounds to c for any |t| <= 2^-126 (far below half an ulp of c): the same p either way.
 *   - mul(p, 2) for p in [0.7, 1.5].
 * A vector whose flushed arguments all lie in [-87, 88] takes the main path alone. There no lane
 * is NaN, above ln(FLT_MAX) or below -103; t = mul(xs, log2e) lies in [-125.52, 126.96], so n is
 * in [-126, 127] and no lane is clamped; and the last multiply is neither tiny nor infinite, so
 * the bare IEEE product is o1b_mul's: n >= -125 gives p 2^n >= 0.7 * 2^-125 > 2^-126, n = -126
 * happens only for t <= -125.5, where r = xs + 126 ln2 >= 0.33 and so p > 1.39, and p <= 1.42
 * (|r| <= ln2 / 2 + an ulp) with n <= 127 stays below 2^128.
 * K vectors at a time, their operations interleaved: each lane's chain of dependent operations is
 * long (the Horner steps), and chains side by side keep the SIMD units busy. */
#define O1B_EXP_K 4
AI void FN(exp_main)(const int K, const vf *xs, vf *y) {
    vf nf[O1B_EXP_K], r[O1B_EXP_K], p[O1B_EXP_K];
    vi n[O1B_EXP_K];
#define EACH _Pragma("GCC unroll 4") for (int k = 0; k < K; k++)
    EACH nf[k] = ((xs[k] * FN(splat)(0x1.715476p0f)) + FN(splat)(O1B_ROUND_MAGIC)) - FN(splat)(O1B_ROUND_MAGIC);
    EACH n[k] = __builtin_convertvector(nf[k], vi);
    EACH r[k] = (xs[k] - nf[k] * FN(splat)(0x1.62e4p-1f)) - nf[k] * FN(splat)(0x1.7f7d1cp-20f);
    EACH p[k] = FN(splat)(0x1.a01a02p-13f) * r[k] + FN(splat)(0x1.6c16c2p-10f);
    EACH p[k] = p[k] * r[k] + FN(splat)(0x1.111112p-7f);
    EACH p[k] = p[k] * r[k] + FN(splat)(0x1.555556p-5f);
    EACH p[k] = p[k] * r[k] + FN(splat)(0x1.555556p-3f);
    EACH p[k] = p[k] * r[k] + FN(splat)(0x1p-1f);
    EACH p[k] = p[k] * r[k] + FN(splat)(1.0f);
    EACH p[k] = p[k] * r[k] + FN(splat)(1.0f);
    EACH y[k] = p[k] * VF((n[k] + 127) << 23);
#undef EACH
}
AI vi FN(exp_main_range)(vf xf) { return (xf >= -87.0f) & (xf <= 88.0f); }
AI vf FN(exp)(vf x, vi *rare) {
    vf xf = FN(flush)(x);
    if (__builtin_expect(!FN(any)(~FN(exp_main_range)(xf)), 1)) {
        vf y;
        FN(exp_main)(1, &xf, &y);
        return y;
    }
    vi nan = x != x, big = x > 0x1.62e42ep6f, small = x < -0x1.9cp6f;
    vf xs = FN(sel)(nan | big | small, FN(splat)(0.0f), xf);
    vf nf = ((xs * FN(splat)(0x1.715476p0f)) + FN(splat)(O1B_ROUND_MAGIC)) - FN(splat)(O1B_ROUND_MAGIC);
    vi n = __builtin_convertvector(nf, vi);          /* |nf| <= 150 on every lane */
    vi under = n < -126, over = n > 127;
    vf r = (xs - nf * FN(splat)(0x1.62e4p-1f)) - nf * FN(splat)(0x1.7f7d1cp-20f);
    vf p = FN(splat)(0x1.a01a02p-13f);
    p = p * r + FN(splat)(0x1.6c16c2p-10f);
    p = p * r + FN(splat)(0x1.111112p-7f);
    p = p * r + FN(splat)(0x1.555556p-5f);
    p = p * r + FN(splat)(0x1.555556p-3f);
    p = p * r + FN(splat)(0x1p-1f);
    p = p * r + FN(splat)(1.0f);
    p = p * r + FN(splat)(1.0f);
    /* n > 127: mul(mul(p, 2), 2^127); else mul(p, 2^n) (n clamped where the lane is replaced) */
    vi nc = BITS(FN(sel)(under, VF(FN(isplat)(-126)), VF(n)));
    nc = BITS(FN(sel)(over, VF(FN(isplat)(127)), VF(nc)));
    vf scale = FN(sel)(over, FN(splat)(0x1p127f), VF((nc + 127) << 23));
    vi rare_y = {0};
    vf y = FN(mul)(FN(sel)(over, p * FN(splat)(2.0f), p), scale, &rare_y);
    *rare |= rare_y & ~under;                        /* lanes replaced below cannot mark */
    y = FN(sel)(small | under, FN(splat)(0.0f), y);
    y = FN(sel)(big, FN(splat)(INFINITY), y);
    return FN(sel)(nan, VF(FN(isplat)((int32_t)O1B_NAN_BITS)), y);
}

/* FN(exp) of O1B_EXP_K vectors: interleaved when all of them take the main path. */
AI void FN(exp_k)(const vf *x, vf *y, vi *rare) {
    vf xf[O1B_EXP_K];
    vi out = {0};
    for (int k = 0; k < O1B_EXP_K; k++) {
        xf[k] = FN(flush)(x[k]);
        out |= ~FN(exp_main_range)(xf[k]);
    }
    if (__builtin_expect(!FN(any)(out), 1)) { FN(exp_main)(O1B_EXP_K, xf, y); return; }
    for (int k = 0; k < O1B_EXP_K; k++) y[k] = FN(exp)(x[k], rare);
}

/* o1b_log */
AI vf FN(log)(vf x, vi *rare) {
    vi u = BITS(FN(flush)(x)), ax = u & 0x7FFFFFFF;
    vi nan = ax > 0x7F800000, zero = ax == 0, neg = (u < 0) & ~nan & ~zero, pinf = u == 0x7F800000;
    vi special = nan | zero | neg | pinf;
    vi us = BITS(FN(sel)(special, FN(splat)(1.0f), VF(u)));
    vi e = (us >> 23) - 127;
    vf m = VF((us & 0x7FFFFF) | 0x3F800000);
    vi big = m > 0x1.6a09e6p0f;
    m = FN(sel)(big, FN(mul)(m, FN(splat)(0.5f), rare), m);
    e = e - big;                                      /* big is -1 where set */
    vf f = FN(sub)(m, FN(splat)(1.0f));
    vf s = FN(div)(f, FN(add)(FN(splat)(2.0f), f), rare);
    vf z = FN(mul)(s, s, rare);
    vf R = FN(splat)(0x1.c71c72p-3f);
    R = FN(add)(FN(mul)(R, z, rare), FN(splat)(0x1.24924ap-2f));
    R = FN(add)(FN(mul)(R, z, rare), FN(splat)(0x1.99999ap-2f));
    R = FN(add)(FN(mul)(R, z, rare), FN(splat)(0x1.555556p-1f));
    R = FN(mul)(R, z, rare);
    vf hfsq = FN(mul)(FN(splat)(0.5f), FN(mul)(f, f, rare), rare);
    vf ef = FN(i2f)(e);
    vf r = FN(add)(FN(mul)(s, FN(add)(hfsq, R), rare), FN(mul)(ef, FN(splat)(0x1.7f7d1cp-20f), rare));
    r = FN(add)(FN(sub)(r, hfsq), f);
    vf y = FN(add)(r, FN(mul)(ef, FN(splat)(0x1.62e4p-1f), rare));
    y = FN(sel)(pinf, FN(splat)(INFINITY), y);
    y = FN(sel)(zero, FN(splat)(-INFINITY), y);
    return FN(sel)(nan | neg, VF(FN(isplat)((int32_t)O1B_NAN_BITS)), y);
}

/* o1b_sincos_reduce, o1b_sin_poly, o1b_cos_poly */
AI vf FN(sin_poly)(vf r, vi *rare) {
    vf z = FN(mul)(r, r, rare);
    vf p = FN(splat)(0x1.71de3ap-19f);
    p = FN(add)(FN(mul)(p, z, rare), FN(splat)(-0x1.a01a02p-13f));
    p = FN(add)(FN(mul)(p, z, rare), FN(splat)(0x1.111112p-7f));
    p = FN(add)(FN(mul)(p, z, rare), FN(splat)(-0x1.555556p-3f));
    return FN(add)(r, FN(mul)(FN(mul)(r, z, rare), p, rare));
}
AI vf FN(cos_poly)(vf r, vi *rare) {
    vf z = FN(mul)(r, r, rare);
    vf p = FN(splat)(-0x1.27e4fcp-22f);
    p = FN(add)(FN(mul)(p, z, rare), FN(splat)(0x1.a01a02p-16f));
    p = FN(add)(FN(mul)(p, z, rare), FN(splat)(-0x1.6c16c2p-10f));
    p = FN(add)(FN(mul)(p, z, rare), FN(splat)(0x1.555556p-5f));
    p = FN(add)(FN(mul)(p, z, rare), FN(splat)(-0x1p-1f));
    return FN(add)(FN(splat)(1.0f), FN(mul)(z, p, rare));
}
/* the sin and cos polynomials of the reduced argument, and the quadrant; x finite */
AI void FN(sincos)(vf x, vf *sp, vf *cp, vi *q, vi *rare) {
    vf nf = FN(sub)(FN(add)(FN(mul)(x, FN(splat)(0x1.45f306p-1f), rare), FN(splat)(O1B_ROUND_MAGIC)),
                    FN(splat)(O1B_ROUND_MAGIC));
    vf y = FN(sub)(x, FN(mul)(nf, FN(splat)(0x1.92p0f), rare));
    y = FN(sub)(y, FN(mul)(nf, FN(splat)(0x1.fb4p-12f), rare));
    vf r = FN(sub)(y, FN(mul)(nf, FN(splat)(0x1.4442d2p-24f), rare));
    vi inrange = VF(BITS(nf) & 0x7FFFFFFF) < 0x1p31f;
    *q = __builtin_convertvector(FN(sel)(inrange, nf, FN(splat)(0.0f)), vi) & 3;
    *sp = FN(sin_poly)(r, rare);
    *cp = FN(cos_poly)(r, rare);
}
AI vf FN(sin)(vf x, vi *rare) {
    x = FN(flush)(x);
    vf ax = VF(BITS(x) & 0x7FFFFFFF);
    vi finite = ax <= 0x1.fffffep127f, small = ax < 0x1p-12f;
    vf sp, cp; vi q;
    FN(sincos)(FN(sel)(finite & ~small, x, FN(splat)(1.0f)), &sp, &cp, &q, rare);
    vf v = FN(sel)((q & 1) != 0, cp, sp);
    v = FN(sel)((q & 2) != 0, FN(neg)(v), v);
    v = FN(sel)(small, x, v);
    return FN(sel)(finite, v, VF(FN(isplat)((int32_t)O1B_NAN_BITS)));
}
AI vf FN(cos)(vf x, vi *rare) {
    x = FN(flush)(x);
    vf ax = VF(BITS(x) & 0x7FFFFFFF);
    vi finite = ax <= 0x1.fffffep127f;
    vf sp, cp; vi q;
    FN(sincos)(FN(sel)(finite, x, FN(splat)(1.0f)), &sp, &cp, &q, rare);
    vf v = FN(sel)((q & 1) != 0, sp, cp);
    v = FN(sel)((q == 1) | (q == 2), FN(neg)(v), v);
    return FN(sel)(finite, v, VF(FN(isplat)((int32_t)O1B_NAN_BITS)));
}
AI vf FN(sigmoid)(vf x, vi *rare) {
    return FN(div)(FN(splat)(1.0f), FN(add)(FN(splat)(1.0f), FN(exp)(FN(neg)(x), rare)), rare);
}
AI vf FN(silu)(vf x, vi *rare) { return FN(mul)(x, FN(sigmoid)(x, rare), rare); }

/* One function over [lo, hi); the switch is hoisted out of the loop by the per-function copies. */
#define O1B_VM_MAP_LOOP(F)                                                                   \
    for (; i + O1B_W <= hi; i += O1B_W) {                                                    \
        vi rare = {0};                                                                       \
        vf y = F(FN(flush)(FN(load)(x + i)), &rare);                                         \
        if (__builtin_expect(FN(any)(rare), 0)) map_scalar(fn, i, i + O1B_W, x, y_out);     \
        else FN(put)(y_out + i, FN(store)(y));                                               \
    }
AI vf FN(sqrt_r)(vf x, vi *rare) { (void)rare; return FN(sqrt)(x); }
AI vf FN(rsqrt)(vf x, vi *rare) { return FN(div)(FN(splat)(1.0f), FN(sqrt)(x), rare); }
static O1B_TGT void FN(map)(int fn, int64_t lo, int64_t hi, const float *x, float *y_out) {
    int64_t i = lo;
    switch (fn) {
    case O1B_FN_EXP:
        for (; i + O1B_EXP_K * O1B_W <= hi; i += O1B_EXP_K * O1B_W) {
            vi rare = {0};
            vf xv[O1B_EXP_K], y[O1B_EXP_K];
            for (int k = 0; k < O1B_EXP_K; k++) xv[k] = FN(flush)(FN(load)(x + i + k * O1B_W));
            FN(exp_k)(xv, y, &rare);
            if (__builtin_expect(FN(any)(rare), 0)) map_scalar(fn, i, i + O1B_EXP_K * O1B_W, x, y_out);
            else for (int k = 0; k < O1B_EXP_K; k++) FN(put)(y_out + i + k * O1B_W, FN(store)(y[k]));
        }
        O1B_VM_MAP_LOOP(FN(exp));
        break;
    case O1B_FN_LOG: O1B_VM_MAP_LOOP(FN(log)); break;
    case O1B_FN_SIN: O1B_VM_MAP_LOOP(FN(sin)); break;
    case O1B_FN_COS: O1B_VM_MAP_LOOP(FN(cos)); break;
    case O1B_FN_SQRT: O1B_VM_MAP_LOOP(FN(sqrt_r)); break;
    case O1B_FN_RSQRT: O1B_VM_MAP_LOOP(FN(rsqrt)); break;
    case O1B_FN_SIGMOID: O1B_VM_MAP_LOOP(FN(sigmoid)); break;
    default: O1B_VM_MAP_LOOP(FN(silu)); break;
    }
    map_scalar(fn, i, hi, x, y_out);
}

static O1B_TGT void FN(exp_sub)(int64_t n, const float *z, float m, float *e) {
    vf mv = FN(splat)(m);
    int64_t i = 0;
    for (; i + O1B_W <= n; i += O1B_W) {
        vi rare = {0};
        vf y = FN(exp)(FN(sub)(FN(flush)(FN(load)(z + i)), mv), &rare);
        if (__builtin_expect(FN(any)(rare), 0)) exp_sub_scalar(i, i + O1B_W, z, m, e);
        else FN(put)(e + i, y);
    }
    if (i < n) exp_sub_scalar(i, n, z, m, e);
}

/* Lanes are rows (expsum_cols_scalar's k), so each lane's max and sum run over v in order while
 * the exps of O1B_EXP_K consecutive v are computed side by side. */
static O1B_TGT void FN(expsum_cols)(int64_t n, int64_t L, const float *zt, int64_t ldz,
                                    const float *m, float *mn, float *cs) {
    int64_t k = 0;
    for (; k + O1B_W <= n; k += O1B_W) {
        vf cm = FN(splat)(-INFINITY);
        for (int64_t v = 0; v < L; v++) {
            vf z = FN(flush)(FN(load)(zt + v * ldz + k));
            cm = FN(sel)(z > cm, z, cm);
        }
        vf mo = FN(load)(m + k);
        vf mv = FN(sel)(cm > mo, cm, mo), s = {0};
        int64_t v = 0;
        for (; v + O1B_EXP_K <= L; v += O1B_EXP_K) {
            vi rare = {0};
            vf x[O1B_EXP_K], e[O1B_EXP_K];
            for (int j = 0; j < O1B_EXP_K; j++) x[j] = FN(sub)(FN(flush)(FN(load)(zt + (v + j) * ldz + k)), mv);
            FN(exp_k)(x, e, &rare);
            if (__builtin_expect(FN(any)(rare), 0))
                for (int j = 0; j < O1B_EXP_K; j++)
                    for (int l = 0; l < O1B_W; l++) e[j][l] = o1b_exp(x[j][l]);
            for (int j = 0; j < O1B_EXP_K; j++) s = FN(add)(s, e[j]);
        }
        for (; v < L; v++) {
            vi rare = {0};
            vf x = FN(sub)(FN(flush)(FN(load)(zt + v * ldz + k)), mv);
            vf e = FN(exp)(x, &rare);
            if (__builtin_expect(FN(any)(rare), 0))
                for (int l = 0; l < O1B_W; l++) e[l] = o1b_exp(x[l]);
            s = FN(add)(s, e);
        }
        FN(put)(mn + k, mv);
        FN(put)(cs + k, s);
    }
    if (k < n) expsum_cols_scalar(k, n, L, zt, ldz, m, mn, cs);
}

/* o1b_f32_to_bf16 */
AI vh FN(to_bf16)(vf x) {
    vu u = (vu)FN(flush)(x);
    vi nan = (vi)(u & 0x7FFFFFFFu) > 0x7F800000;
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    u = (vu)FN(sel)(nan, VF(FN(isplat)(O1B_BF16_NAN)), VF(u));
    return __builtin_convertvector(u, vh);
}

/* Lanes are rows (xent_grad_cols_scalar's k), each with its row's lse, coef and dl; the chunk is
 * walked v by v, so zt and dzt are read and written along their rows (a walk down the columns
 * would take a cache line from memory per v and row block), O1B_EXP_K vectors of rows at a time. */
static O1B_TGT void FN(xent_grad_cols)(int64_t n, int64_t L, const float *zt, int64_t ldz,
                                       const float *lse, const float *coef, const float *dl,
                                       bf16 *dzt, int64_t ldd) {
    for (int64_t v = 0; v < L; v++) {
        const float *zr = zt + v * ldz;
        bf16 *dr = dzt + v * ldd;
        int64_t k = 0;
        for (; k + O1B_EXP_K * O1B_W <= n; k += O1B_EXP_K * O1B_W) {
            vi rare = {0};
            vf x[O1B_EXP_K], pv[O1B_EXP_K], g[O1B_EXP_K];
            for (int j = 0; j < O1B_EXP_K; j++)
                x[j] = FN(sub)(FN(flush)(FN(load)(zr + k + j * O1B_W)), FN(load)(lse + k + j * O1B_W));
            FN(exp_k)(x, pv, &rare);
            for (int j = 0; j < O1B_EXP_K; j++)
                g[j] = FN(mul)(FN(mul)(pv[j], FN(load)(coef + k + j * O1B_W), &rare),
                               FN(load)(dl + k + j * O1B_W), &rare);
            if (__builtin_expect(FN(any)(rare), 0)) {
                xent_grad_cols_scalar(k, k + O1B_EXP_K * O1B_W, v, v + 1, zt, ldz, lse, coef, dl, dzt, ldd);
            } else {
                for (int j = 0; j < O1B_EXP_K; j++) {
                    vh h = FN(to_bf16)(g[j]);
                    memcpy(dr + k + j * O1B_W, &h, sizeof h);
                }
            }
        }
        for (; k + O1B_W <= n; k += O1B_W) {
            vi rare = {0};
            vf pv = FN(exp)(FN(sub)(FN(flush)(FN(load)(zr + k)), FN(load)(lse + k)), &rare);
            vf g = FN(mul)(FN(mul)(pv, FN(load)(coef + k), &rare), FN(load)(dl + k), &rare);
            if (__builtin_expect(FN(any)(rare), 0)) {
                xent_grad_cols_scalar(k, k + O1B_W, v, v + 1, zt, ldz, lse, coef, dl, dzt, ldd);
            } else {
                vh h = FN(to_bf16)(g);
                memcpy(dr + k, &h, sizeof h);
            }
        }
        if (k < n) xent_grad_cols_scalar(k, n, v, v + 1, zt, ldz, lse, coef, dl, dzt, ldd);
    }
}

/* sigmoid(g[j]) = div(1, add(1, exp(neg(g[j])))) of O1B_EXP_K vectors, the exps side by side */
AI void FN(sigmoid_k)(const vf *g, vf *s, vi *rare) {
    vf ng[O1B_EXP_K], e[O1B_EXP_K];
    for (int j = 0; j < O1B_EXP_K; j++) ng[j] = FN(neg)(g[j]);
    FN(exp_k)(ng, e, rare);
    for (int j = 0; j < O1B_EXP_K; j++)
        s[j] = FN(div)(FN(splat)(1.0f), FN(add)(FN(splat)(1.0f), e[j]), rare);
}

static O1B_TGT void FN(swiglu_fwd)(int64_t n, const float *g, const float *u, float *out) {
    enum { K = O1B_EXP_K };
    int64_t i = 0;
    for (; i + K * O1B_W <= n; i += K * O1B_W) {
        vi rare = {0};
        vf gv[K], s[K], y[K];
        for (int j = 0; j < K; j++) gv[j] = FN(flush)(FN(load)(g + i + j * O1B_W));
        FN(sigmoid_k)(gv, s, &rare);
        for (int j = 0; j < K; j++)
            y[j] = FN(mulh)(FN(mulh)(gv[j], s[j], &rare), FN(ldh)(u + i + j * O1B_W), &rare);
        if (__builtin_expect(FN(any)(rare), 0)) swiglu_fwd_scalar(i, i + K * O1B_W, g, u, out);
        else for (int j = 0; j < K; j++) FN(put)(out + i + j * O1B_W, FN(canon)(y[j]));
    }
    for (; i + O1B_W <= n; i += O1B_W) {
        vi rare = {0};
        vf y = FN(mulh)(FN(silu)(FN(flush)(FN(load)(g + i)), &rare), FN(ldh)(u + i), &rare);
        if (__builtin_expect(FN(any)(rare), 0)) swiglu_fwd_scalar(i, i + O1B_W, g, u, out);
        else FN(put)(out + i, FN(canon)(y));
    }
    if (i < n) swiglu_fwd_scalar(i, n, g, u, out);
}

static O1B_TGT void FN(swiglu_bwd)(int64_t n, const float *dout, const float *gate,
                                   const float *up, float *dgate, float *dup) {
    enum { K = O1B_EXP_K };
    int64_t i = 0;
    vf one = FN(splat)(1.0f);
    for (; i + K * O1B_W <= n; i += K * O1B_W) {
        vi rare = {0};
        vf g[K], s[K], a[K], b[K];
        for (int j = 0; j < K; j++) g[j] = FN(flush)(FN(load)(gate + i + j * O1B_W));
        FN(sigmoid_k)(g, s, &rare);
        for (int j = 0; j < K; j++) {
            vf u = FN(ldh)(up + i + j * O1B_W), d = FN(ldh)(dout + i + j * O1B_W);
            vf silu = FN(mulh)(g[j], s[j], &rare);
            vf dsilu = FN(mulh)(s[j], FN(addh)(one, FN(mulh)(g[j], FN(subh)(one, s[j]), &rare)), &rare);
            a[j] = FN(mulh)(d, silu, &rare);
            b[j] = FN(mulh)(FN(mulh)(d, u, &rare), dsilu, &rare);
        }
        if (__builtin_expect(FN(any)(rare), 0)) {
            swiglu_bwd_scalar(i, i + K * O1B_W, dout, gate, up, dgate, dup);
        } else {
            for (int j = 0; j < K; j++) {
                FN(put)(dup + i + j * O1B_W, FN(canon)(a[j]));
                FN(put)(dgate + i + j * O1B_W, FN(canon)(b[j]));
            }
        }
    }
    for (; i + O1B_W <= n; i += O1B_W) {
        vi rare = {0};
        vf g = FN(flush)(FN(load)(gate + i)), u = FN(ldh)(up + i);
        vf d = FN(ldh)(dout + i);
        vf s = FN(sigmoid)(g, &rare), silu = FN(mulh)(g, s, &rare);
        vf dsilu = FN(mulh)(s, FN(addh)(one, FN(mulh)(g, FN(subh)(one, s), &rare)), &rare);
        vf a = FN(mulh)(d, silu, &rare);
        vf b = FN(mulh)(FN(mulh)(d, u, &rare), dsilu, &rare);
        if (__builtin_expect(FN(any)(rare), 0)) {
            swiglu_bwd_scalar(i, i + O1B_W, dout, gate, up, dgate, dup);
        } else {
            FN(put)(dup + i, FN(canon)(a));
            FN(put)(dgate + i, FN(canon)(b));
        }
    }
    if (i < n) swiglu_bwd_scalar(i, n, dout, gate, up, dgate, dup);
}
/* rows [lo, hi) of h = [gate | up] (2F per row) */
static O1B_TGT void FN(swiglu_fwd_rows)(int64_t lo, int64_t hi, int64_t F, const float *h, float *out) {
    for (int64_t r = lo; r < hi; r++) FN(swiglu_fwd)(F, h + r * 2 * F, h + r * 2 * F + F, out + r * F);
}
static O1B_TGT void FN(swiglu_bwd_rows)(int64_t lo, int64_t hi, int64_t F, const float *dout,
                                        const float *h, float *dh) {
    for (int64_t r = lo; r < hi; r++)
        FN(swiglu_bwd)(F, dout + r * F, h + r * 2 * F, h + r * 2 * F + F, dh + r * 2 * F, dh + r * 2 * F + F);
}

static O1B_TGT void FN(axpy)(int64_t n, float a, const float *x, float *y) {
    vf av = FN(splat)(a);
    int64_t i = 0;
    for (; i + O1B_W <= n; i += O1B_W) {
        vi rare = {0};
        vf r = FN(add)(FN(load)(y + i), FN(mul)(av, FN(load)(x + i), &rare));
        if (__builtin_expect(FN(any)(rare), 0)) axpy_scalar(i, i + O1B_W, a, x, y);
        else FN(put)(y + i, r);
    }
    if (i < n) axpy_scalar(i, n, a, x, y);
}

/* Lanes are rows r; two vectors of rows at a time so that their chains of adds overlap. */
static O1B_TGT void FN(dots_t)(int64_t n, int64_t D, const float *x, const float *rows_t,
                               int64_t ld, float *out) {
    int64_t r = 0;
    for (; r + 2 * O1B_W <= n; r += 2 * O1B_W) {
        vi rare = {0};
        vf acc0 = {0}, acc1 = {0};
        for (int64_t d = 0; d < D; d++) {
            vf xv = FN(splat)(x[d]);
            const float *row = rows_t + d * ld + r;
            acc0 = FN(add)(acc0, FN(mul)(xv, FN(load)(row), &rare));
            acc1 = FN(add)(acc1, FN(mul)(xv, FN(load)(row + O1B_W), &rare));
        }
        if (__builtin_expect(FN(any)(rare), 0)) {
            dots_t_scalar(r, r + 2 * O1B_W, D, x, rows_t, ld, out);
        } else {
            FN(put)(out + r, acc0);
            FN(put)(out + r + O1B_W, acc1);
        }
    }
    for (; r + O1B_W <= n; r += O1B_W) {
        vi rare = {0};
        vf acc = {0};
        for (int64_t d = 0; d < D; d++)
            acc = FN(add)(acc, FN(mul)(FN(splat)(x[d]), FN(load)(rows_t + d * ld + r), &rare));
        if (__builtin_expect(FN(any)(rare), 0)) dots_t_scalar(r, r + O1B_W, D, x, rows_t, ld, out);
        else FN(put)(out + r, acc);
    }
    if (r < n) dots_t_scalar(r, n, D, x, rows_t, ld, out);
}

/* o1b_bf16_to_f32 of W values */
AI vf FN(widen)(const bf16 *h) {
    vh x;
    memcpy(&x, h, sizeof x);
    return FN(flush)(VF(__builtin_convertvector(x, vu) << 16));
}

/* The W x W block v[0..W) transposed in place (afterwards lane l of v[j] is lane j of the old
 * v[l]): log2(W) rounds, each interleaving the vectors of pairs (i, i + s). Moves bits only. */
#if O1B_W == 16
#define O1B_ZLO 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23
#define O1B_ZHI 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31
#elif O1B_W == 8
#define O1B_ZLO 0, 8, 1, 9, 2, 10, 3, 11
#define O1B_ZHI 4, 12, 5, 13, 6, 14, 7, 15
#else
#define O1B_ZLO 0, 4, 1, 5
#define O1B_ZHI 2, 6, 3, 7
#endif
/* the lane swaps of FN(hmax): lane l takes lane l XOR h */
#if O1B_W == 16
#define O1B_X8 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7
#define O1B_X4 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11
#define O1B_X2 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13
#define O1B_X1 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14
#elif O1B_W == 8
#define O1B_X4 4, 5, 6, 7, 0, 1, 2, 3
#define O1B_X2 2, 3, 0, 1, 6, 7, 4, 5
#define O1B_X1 1, 0, 3, 2, 5, 4, 7, 6
#else
#define O1B_X2 2, 3, 0, 1
#define O1B_X1 1, 0, 3, 2
#endif
#if defined(__clang__)
#define O1B_ZIP(a, b, idx) __builtin_shufflevector(a, b, idx)
#define O1B_SWAP(a, idx) __builtin_shufflevector(a, a, idx)
#else
#define O1B_ZIP(a, b, idx) __builtin_shuffle(a, b, (vi){idx})
#define O1B_SWAP(a, idx) __builtin_shuffle(a, (vi){idx})
#endif
AI void FN(zip_round)(vf *v, const int s) {
#pragma GCC unroll 16
    for (int i = 0; i < O1B_W; i++) {
        if (i & s) continue;
        vf a = v[i], b = v[i + s];
        v[i] = O1B_ZIP(a, b, O1B_ZLO);
        v[i + s] = O1B_ZIP(a, b, O1B_ZHI);
    }
}
AI void FN(transpose)(vf *v) {      /* the rounds written out: v stays in registers */
#if O1B_W >= 16
    FN(zip_round)(v, 8);
#endif
#if O1B_W >= 8
    FN(zip_round)(v, 4);
#endif
    FN(zip_round)(v, 2);
    FN(zip_round)(v, 1);
}

/* Lanes are rows: for the m <= W rows at a and b (C floats each, rows lda and ldb apart), each lane's
 *   sum_{c ascending} mul(t_c, load(b[c])) from +0 (unstored),  t_c = load(a[c]) or mul(load(a[c]), g_c)
 * (row_dot_scalar's). Lanes from m on repeat row m - 1 (their sums unused). Whole blocks of W
 * columns are loaded as rows (t's products with g on column lanes, the same operations) and
 * transposed on registers; the last C % W columns are gathered lane by lane. `same`: b is a
 * (the sum of squares; a constant at each call). */
AI vf FN(rows_dot)(int m, int64_t C, const float *a, int64_t lda, const float *b, int64_t ldb,
                   const bf16 *g, const int same, vi *rare) {
    const float *pa[O1B_W], *pb[O1B_W];
    for (int l = 0; l < O1B_W; l++) {
        int64_t r = l < m ? l : m - 1;
        pa[l] = a + r * lda;
        pb[l] = b + r * ldb;
    }
    vf acc = {0};
    int64_t c = 0;
    for (; c + O1B_W <= C; c += O1B_W) {
        vf t[O1B_W], x[O1B_W];
        vf gv = g ? FN(widen)(g + c) : FN(splat)(1.0f);
        for (int l = 0; l < O1B_W; l++) {
            t[l] = FN(ldh)(pa[l] + c);
            if (g) t[l] = FN(mulh)(t[l], gv, rare);
        }
        FN(transpose)(t);
        if (!same) {
            for (int l = 0; l < O1B_W; l++) x[l] = FN(ldh)(pb[l] + c);
            FN(transpose)(x);
        }
        for (int j = 0; j < O1B_W; j++) acc = FN(addh)(acc, FN(mulh)(t[j], same ? t[j] : x[j], rare));
    }
    for (; c < C; c++) {
        vf t, x;
        for (int l = 0; l < O1B_W; l++) { t[l] = pa[l][c]; x[l] = pb[l][c]; }
        t = FN(flush)(t);
        if (g) t = FN(mul)(t, FN(splat)(o1b_bf16_to_f32(g[c])), rare);
        acc = FN(add)(acc, FN(mul)(t, FN(flush)(x), rare));
    }
    return acc;
}

/* rope_rows_scalar with i on lanes; a row with a product at 2^-126 goes the scalar way. */
static O1B_TGT void FN(rope_rows)(int64_t lo, int64_t hi, int64_t T, int64_t R, int64_t D,
                                  const float *x, const float *cs, const float *sn, float *y,
                                  int backward) {
    const int64_t Dh = D / 2;
    int64_t t = (lo / R) % T, h = lo % R;   /* the row's position and head, counted on (no divisions) */
    for (int64_t row = lo; row < hi; row++) {
        const float *xr = x + row * D, *c = cs + t * Dh, *s = sn + t * Dh;
        float *yr = y + row * D;
        vi rare = {0};
        int64_t i = 0;
        for (; i + O1B_W <= Dh; i += O1B_W) {
            vf x1 = FN(ldh)(xr + i), x2 = FN(ldh)(xr + i + Dh);
            vf ci = FN(ldh)(c + i), si = FN(ldh)(s + i);
            vf a = FN(mulh)(x1, ci, &rare), b = FN(mulh)(x2, si, &rare);
            vf e = FN(mulh)(x2, ci, &rare), f = FN(mulh)(x1, si, &rare);
            FN(put)(yr + i, FN(canon)(backward ? FN(addh)(a, b) : FN(subh)(a, b)));
            FN(put)(yr + i + Dh, FN(canon)(backward ? FN(subh)(e, f) : FN(addh)(e, f)));
        }
        if (i < Dh || __builtin_expect(FN(any)(rare), 0))
            rope_rows_scalar(row, row + 1, T, R, D, x, cs, sn, y, backward);
        if (++h == R) {
            h = 0;
            if (++t == T) t = 0;
        }
    }
}
/* dst[c] = store(sum_{t < n ascending} load(src[pos[t] C + c])) from +0, c on lanes */
static O1B_TGT void FN(sum_rows)(int64_t n, const int64_t *pos, const float *src, int64_t C, float *dst) {
    int64_t c = 0;
    for (; c + O1B_W <= C; c += O1B_W) {
        vf acc = {0};
        for (int64_t t = 0; t < n; t++) acc = FN(add)(acc, FN(flush)(FN(load)(src + pos[t] * C + c)));
        FN(put)(dst + c, FN(store)(acc));
    }
    if (c < C) sum_rows_scalar(c, C, n, pos, src, C, dst);
}
/* p[0..k) on the first lanes, +0 on the others (k may be <= 0 or >= W). */
AI vf FN(load_part)(const float *p, int64_t k) {
    if (k >= O1B_W) return FN(load)(p);
    vf x = {0};
    if (k > 0) memcpy(&x, p, (size_t)k * sizeof(float));
    return x;
}
/* o1b_mul(v, v) of a loaded v, under the hardware flush mode where the kernel has it: a square
 * needs no exact path, because no fp32 square rounds up to 2^-126 from below (the exact square of
 * the largest fp32 below 2^-63 is 2^-126 - 2^-149 + 2^-174, below both rounding points; tested by
 * test_no_square_rounds_up_to_2_126), so an IEEE square of 2^-126 is exact and o1b_mul's. */
AI vf FN(squareh)(vf v) {
    vi exact = {0};                   /* the marks mulh sets are never read (and not computed) */
    return FN(mulh)(v, v, &exact);
}
/* Blocks [lo, hi) of B elements (the array's last block may be short), W blocks on lanes:
 * W consecutive elements of each block are loaded and transposed on registers, so each lane adds
 * its block's squares in ascending element order from +0, as sumsq_blocks_scalar does. Lanes past
 * the group's m blocks repeat its last block over the columns all m blocks have and are +0 over
 * the rest (their sums are never stored); past a short block's end its lane is +0, and adding the
 * square +0 leaves a sum of squares from +0 unchanged (it is never -0). A lone block gains nothing
 * from lanes (its sum is one chain of adds) and goes the scalar way. */
static O1B_TGT void FN(sumsq_blocks)(int64_t lo, int64_t hi, int64_t n, int64_t B, const float *x,
                                     float *out) {
    for (int64_t b = lo; b < hi; b += O1B_W) {
        const int m = hi - b < O1B_W ? (int)(hi - b) : O1B_W;
        if (m == 1) { sumsq_blocks_scalar(b, b + 1, n, B, x, out); break; }
        int64_t last = n - (b + m - 1) * B;          /* the group's last block's length */
        if (last > B) last = B;
        const float *pl[O1B_W];
        for (int l = 0; l < O1B_W; l++) pl[l] = x + (b + (l < m ? l : m - 1)) * B;
        vf acc = {0};
        int64_t c = 0;
        for (; c + O1B_W <= last; c += O1B_W) {
            vf v[O1B_W];
            for (int l = 0; l < O1B_W; l++) v[l] = FN(ldh)(pl[l] + c);
            FN(transpose)(v);
            for (int j = 0; j < O1B_W; j++) acc = FN(addh)(acc, FN(squareh)(v[j]));
        }
        for (; c < B; c += O1B_W) {                   /* m > 1: the first block is whole */
            vf v[O1B_W];
            for (int l = 0; l < O1B_W; l++)
                v[l] = FN(flush)(FN(load_part)(pl[l] + c, (l < m - 1 ? B : l == m - 1 ? last : 0) - c));
            FN(transpose)(v);
            for (int j = 0; j < O1B_W; j++) acc = FN(addh)(acc, FN(squareh)(v[j]));
        }
        vf s = FN(canon)(acc);
        memcpy(out + b, &s, (size_t)m * sizeof(float));
    }
}

static O1B_TGT void FN(to_bf16_arr)(int64_t lo, int64_t hi, const float *x, bf16 *y) {
    int64_t i = lo;
    for (; i + O1B_W <= hi; i += O1B_W) {
        vh h = FN(to_bf16)(FN(load)(x + i));
        memcpy(y + i, &h, sizeof h);
    }
    if (i < hi) to_bf16_scalar(i, hi, x, y);
}
static O1B_TGT void FN(to_f32_arr)(int64_t lo, int64_t hi, const bf16 *x, float *y) {
    int64_t i = lo;
    for (; i + O1B_W <= hi; i += O1B_W) FN(put)(y + i, FN(canon)(FN(widen)(x + i)));
    if (i < hi) to_f32_scalar(i, hi, x, y);
}
static O1B_TGT void FN(add_arr)(int64_t lo, int64_t hi, const float *a, const float *b, float *out) {
    int64_t i = lo;
    for (; i + O1B_W <= hi; i += O1B_W)
        FN(put)(out + i, FN(canon)(FN(addh)(FN(ldh)(a + i), FN(ldh)(b + i))));
    if (i < hi) add_scalar(i, hi, a, b, out);
}
static O1B_TGT void FN(scale_inplace_arr)(int64_t lo, int64_t hi, float *a, float s) {
    vf sv = FN(splat)(s);
    int64_t i = lo;
    for (; i + O1B_W <= hi; i += O1B_W) {
        vi rare = {0};
        vf y = FN(mulh)(FN(ldh)(a + i), sv, &rare);
        if (__builtin_expect(FN(any)(rare), 0)) scale_inplace_scalar(i, i + O1B_W, a, s);
        else FN(put)(a + i, FN(canon)(y));
    }
    if (i < hi) scale_inplace_scalar(i, hi, a, s);
}

static O1B_TGT void FN(adamw)(int64_t n, bf16 *pp, const float *gg, float *mm, float *vv,
                              const float *k) {
    vf lr = FN(splat)(k[0]), b1 = FN(splat)(k[1]), b2 = FN(splat)(k[2]), omb1 = FN(splat)(k[3]);
    vf omb2 = FN(splat)(k[4]), eps = FN(splat)(k[5]), decay = FN(splat)(k[6]);
    vf bc1 = FN(splat)(k[7]), bc2 = FN(splat)(k[8]);
    int64_t i = 0;
    /* two vectors side by side: each one's chain (m, v, sqrt, div, p) is long */
    for (; i + 2 * O1B_W <= n; i += 2 * O1B_W) {
        vi rare = {0};
        vf g[2], m[2], v[2], u[2], p[2];
        for (int j = 0; j < 2; j++) g[j] = FN(flush)(FN(load)(gg + i + j * O1B_W));
        for (int j = 0; j < 2; j++)
            m[j] = FN(add)(FN(mul)(b1, FN(flush)(FN(load)(mm + i + j * O1B_W)), &rare),
                           FN(mul)(omb1, g[j], &rare));
        for (int j = 0; j < 2; j++)
            v[j] = FN(add)(FN(mul)(b2, FN(flush)(FN(load)(vv + i + j * O1B_W)), &rare),
                           FN(mul)(omb2, FN(mul)(g[j], g[j], &rare), &rare));
        for (int j = 0; j < 2; j++)
            u[j] = FN(div)(FN(mul)(m[j], bc1, &rare),
                           FN(add)(FN(sqrt)(FN(mul)(v[j], bc2, &rare)), eps), &rare);
        for (int j = 0; j < 2; j++)
            p[j] = FN(sub)(FN(mul)(FN(widen)(pp + i + j * O1B_W), decay, &rare), FN(mul)(lr, u[j], &rare));
        if (__builtin_expect(FN(any)(rare), 0)) {
            adamw_scalar(i, i + 2 * O1B_W, pp, gg, mm, vv, k);
        } else {
            for (int j = 0; j < 2; j++) {
                FN(put)(mm + i + j * O1B_W, FN(store)(m[j]));
                FN(put)(vv + i + j * O1B_W, FN(store)(v[j]));
                vh h = FN(to_bf16)(p[j]);
                memcpy(pp + i + j * O1B_W, &h, sizeof h);
            }
        }
    }
    for (; i + O1B_W <= n; i += O1B_W) {
        vi rare = {0};
        vf g = FN(flush)(FN(load)(gg + i));
        vf m = FN(add)(FN(mul)(b1, FN(flush)(FN(load)(mm + i)), &rare), FN(mul)(omb1, g, &rare));
        vf v = FN(add)(FN(mul)(b2, FN(flush)(FN(load)(vv + i)), &rare),
                       FN(mul)(omb2, FN(mul)(g, g, &rare), &rare));
        vf u = FN(div)(FN(mul)(m, bc1, &rare), FN(add)(FN(sqrt)(FN(mul)(v, bc2, &rare)), eps), &rare);
        vf p = FN(sub)(FN(mul)(FN(widen)(pp + i), decay, &rare), FN(mul)(lr, u, &rare));
        if (__builtin_expect(FN(any)(rare), 0)) {
            adamw_scalar(i, i + O1B_W, pp, gg, mm, vv, k);
        } else {
            FN(put)(mm + i, FN(store)(m));
            FN(put)(vv + i, FN(store)(v));
            vh h = FN(to_bf16)(p);
            memcpy(pp + i, &h, sizeof h);
        }
    }
    if (i < n) adamw_scalar(i, n, pp, gg, mm, vv, k);
}

/* The outputs of rows l < m of a block (row l at + l C), columns on lanes: a vector of columns
 * at a time for every row (its gain widened once for the block); a vector with a product at
 * 2^-126 is done by the scalar loop. */
AI void FN(rms_scale_rows)(int m, int64_t C, const float *x, const float *rs, const bf16 *g,
                           float *y) {
    int64_t c = 0;
    for (; c + O1B_W <= C; c += O1B_W) {
        vf gv = g ? FN(widen)(g + c) : FN(splat)(1.0f);
        for (int l = 0; l < m; l++) {
            vi rare = {0};
            vf v = FN(mulh)(FN(ldh)(x + l * C + c), FN(splat)(rs[l]), &rare);
            if (g) v = FN(mulh)(v, gv, &rare);
            if (__builtin_expect(FN(any)(rare), 0)) rms_scale_scalar(c, c + O1B_W, x + l * C, rs[l], g, y + l * C);
            else FN(put)(y + l * C + c, FN(canon)(v));
        }
    }
    if (c < C)
        for (int l = 0; l < m; l++) rms_scale_scalar(c, C, x + l * C, rs[l], g, y + l * C);
}
AI void FN(rms_dx_rows)(int m, int64_t C, const float *dy, const float *x, const bf16 *g,
                        const float *rs, const float *bs, float *dx) {
    int64_t c = 0;
    for (; c + O1B_W <= C; c += O1B_W) {
        vf gv = g ? FN(widen)(g + c) : FN(splat)(1.0f);
        for (int l = 0; l < m; l++) {
            vi rare = {0};
            vf t = FN(ldh)(dy + l * C + c);
            if (g) t = FN(mulh)(t, gv, &rare);
            vf d = FN(subh)(FN(mulh)(t, FN(splat)(rs[l]), &rare),
                            FN(mulh)(FN(ldh)(x + l * C + c), FN(splat)(bs[l]), &rare));
            if (__builtin_expect(FN(any)(rare), 0))
                rms_dx_scalar(c, c + O1B_W, dy + l * C, x + l * C, g, rs[l], bs[l], dx + l * C);
            else FN(put)(dx + l * C + c, FN(canon)(d));
        }
    }
    if (c < C)
        for (int l = 0; l < m; l++) rms_dx_scalar(c, C, dy + l * C, x + l * C, g, rs[l], bs[l], dx + l * C);
}

/* The gain's column sums of K vectors of columns from c, the accumulators in registers over
 * every row; a block with a product at 2^-126 is summed again by the scalar loop. */
AI void FN(rms_dg_cols)(const int K, int64_t c, int64_t N, int64_t C, const float *dy,
                        const float *x, const float *rstd, float *dg) {
    vf acc[8] = {{0}};
    vi rare = {0};
    for (int64_t n = 0; n < N; n++) {
        vf rv = FN(splat)(o1b_load(rstd[n]));
        const float *dyr = dy + n * C + c, *xr = x + n * C + c;
        for (int j = 0; j < K; j++)
            acc[j] = FN(addh)(acc[j], FN(mulh)(FN(ldh)(dyr + j * O1B_W),
                                               FN(mulh)(FN(ldh)(xr + j * O1B_W), rv, &rare), &rare));
    }
    if (__builtin_expect(FN(any)(rare), 0)) rms_dg_scalar(c, c + K * O1B_W, N, C, dy, x, rstd, dg);
    else for (int j = 0; j < K; j++) FN(put)(dg + c + j * O1B_W, FN(store)(acc[j]));
}
static O1B_TGT void FN(rms_dg)(int64_t lo, int64_t hi, int64_t N, int64_t C, const float *dy,
                               const float *x, const float *rstd, float *dg) {
    int64_t c = lo;
    for (; c + 8 * O1B_W <= hi; c += 8 * O1B_W) FN(rms_dg_cols)(8, c, N, C, dy, x, rstd, dg);
    for (; c + O1B_W <= hi; c += O1B_W) FN(rms_dg_cols)(1, c, N, C, dy, x, rstd, dg);
    if (c < hi) rms_dg_scalar(c, hi, N, C, dy, x, rstd, dg);
}

/* RMSNorm rows [lo, hi) (rmsnorm.c, rms_fwd_rows_scalar's operations): W rows at a time, their
 * sums and row scalars on lanes (rows_dot; r, b), then their outputs with columns on lanes
 * (rms_scale_rows, rms_dx_rows). A vector of rows with a product or quotient at 2^-126 gets its row scalars from the
 * scalar helpers. */
static O1B_TGT void FN(rms_fwd_rows)(int64_t lo, int64_t hi, int64_t C, const float *x, const bf16 *g,
                                     float eps, float invC, float *y, float *rstd) {
    vf ev = FN(splat)(eps), iv = FN(splat)(invC);
    for (int64_t n = lo; n < hi; n += O1B_W) {
        int m = hi - n < O1B_W ? (int)(hi - n) : O1B_W;
        const float *xb = x + n * C;
        vi rare = {0};
        vf ss = FN(rows_dot)(m, C, xb, C, xb, C, NULL, 1, &rare);
        float rs[O1B_W];
        FN(put)(rs, FN(rsqrt)(FN(add)(FN(mul)(ss, iv, &rare), ev), &rare));
        if (__builtin_expect(FN(any)(rare), 0))
            for (int l = 0; l < m; l++)
                rs[l] = rms_r_scalar(row_dot_scalar(C, xb + l * C, xb + l * C, NULL), invC, eps);
        for (int l = 0; l < m; l++) rstd[n + l] = o1b_store(rs[l]);
        FN(rms_scale_rows)(m, C, xb, rs, g, y + n * C);
    }
}
static O1B_TGT void FN(rms_bwd_rows)(int64_t lo, int64_t hi, int64_t C, const float *dy,
                                     const float *x, const bf16 *g, const float *rstd, float invC,
                                     float *dx) {
    vf iv = FN(splat)(invC);
    for (int64_t n = lo; n < hi; n += O1B_W) {
        int m = hi - n < O1B_W ? (int)(hi - n) : O1B_W;
        const float *dyb = dy + n * C, *xb = x + n * C;
        vi rare = {0};
        vf dot = FN(rows_dot)(m, C, dyb, C, xb, C, g, 0, &rare);
        float rs[O1B_W], bs[O1B_W];
        for (int l = 0; l < O1B_W; l++) rs[l] = o1b_load(rstd[n + (l < m ? l : m - 1)]);
        vf r = FN(load)(rs);
        FN(put)(bs, FN(mul)(FN(mul)(dot, FN(mul)(FN(mul)(r, r, &rare), r, &rare), &rare), iv, &rare));
        if (__builtin_expect(FN(any)(rare), 0))
            for (int l = 0; l < m; l++)
                bs[l] = rms_b_scalar(row_dot_scalar(C, dyb + l * C, xb + l * C, g), rs[l], invC);
        FN(rms_dx_rows)(m, C, dyb, xb, g, rs, bs, dx + n * C);
    }
}

/* o1b_vdot_rows: W rows on lanes (rows_dot); a block with a product at 2^-126 goes the scalar way */
static O1B_TGT void FN(dot_rows)(int64_t n, int64_t D, const float *a, int64_t lda, const float *b,
                                 int64_t ldb, float *out) {
    for (int64_t r = 0; r < n; r += O1B_W) {
        int m = n - r < O1B_W ? (int)(n - r) : O1B_W;
        vi rare = {0};
        float s[O1B_W];
        FN(put)(s, FN(rows_dot)(m, D, a + r * lda, lda, b + r * ldb, ldb, NULL, 0, &rare));
        if (__builtin_expect(FN(any)(rare), 0)) dot_rows_scalar(m, D, a + r * lda, lda, b + r * ldb, ldb, s);
        memcpy(out + r, s, (size_t)m * sizeof(float));
    }
}

AI vi FN(imin)(vi a, vi b) { vi m = a < b; return (a & m) | (b & ~m); }
AI vi FN(imax)(vi a, vi b) { vi m = a > b; return (a & m) | (b & ~m); }
/* widen_rows' source values i .. i + W - 1: bf16 widened, or fp32 (f) flushed */
AI vf FN(widen_at)(const bf16 *h, const float *f, int64_t i) {
    return h ? FN(widen)(h + i) : FN(flush)(FN(load)(f + i));
}
/* the lanes' exponent ranges joined with the exponent fields of x (vmath.h: a zero counts as 255
 * for lo, as 0 for hi) */
AI void FN(exp_range)(vf x, vi *lo, vi *hi) {
    vi e = (BITS(x) >> 23) & 0xFF;
    *lo = FN(imin)(*lo, e | ((e == 0) & 255));
    *hi = FN(imax)(*hi, e);
}

/* o1b_vwiden_rows. Whole blocks of W rows (D a multiple of W): W x W blocks widened, stored as rows,
 * transposed on registers (each vector then a column, lanes the rows), stored as columns; the
 * rows' exponent ranges are the lanes' min and max over the columns (exact in any order). The
 * other rows (fewer than W left, or D not a multiple of W: not attention's head dims) go the
 * scalar way, which moves the same bits. */
static O1B_TGT void FN(widen_rows)(int64_t n, int64_t D, const bf16 *h, const float *f, int64_t ld,
                                   float *out, float *out_t, int64_t ldt, int32_t *elo, int32_t *ehi) {
    int64_t r = 0;
    for (; D % O1B_W == 0 && r + O1B_W <= n; r += O1B_W) {
        vi lo = FN(isplat)(255), hi = {0};
        for (int64_t d0 = 0; d0 < D; d0 += O1B_W) {
            vf v[O1B_W];
            for (int l = 0; l < O1B_W; l++) {
                v[l] = FN(widen_at)(h, f, (r + l) * ld + d0);
                FN(put)(out + (r + l) * D + d0, v[l]);
            }
            if (!out_t && !elo) continue;
            FN(transpose)(v);
            for (int l = 0; l < O1B_W; l++) {
                if (out_t) FN(put)(out_t + (d0 + l) * ldt + r, v[l]);
                FN(exp_range)(v[l], &lo, &hi);
            }
        }
        if (elo) {
            memcpy(elo + r, &lo, sizeof lo);
            memcpy(ehi + r, &hi, sizeof hi);
        }
    }
    if (r < n)
        widen_rows_scalar(n - r, D, h ? h + r * ld : NULL, h ? NULL : f + r * ld, ld, out + r * D,
                          out_t ? out_t + r : NULL, ldt, elo ? elo + r : NULL, ehi ? ehi + r : NULL);
}

/* ---- attention rows (attention.c) under the hardware flush mode ----
 * The caller has set FTZ/DAZ (FZ on arm64) with o1b_fpmode_ftz. There a bare IEEE add or subtract
 * of flushed operands is o1b_add / o1b_sub (a subnormal sum is exact, and the hardware flushes it
 * to the zero of its sign), a bare product of two bf16 values is o1b_mul (exact, gemm_fast.c's
 * argument), and any other bare product is o1b_mul unless its magnitude is exactly 2^-126 (x86
 * detects tininess after rounding): such a lane (a valid one) marks the row, and the caller
 * computes the whole row again with contract.h. So each accumulator is one bare add per step,
 * the chain the hardware can run at full speed. Keys (or queries) of a block are lanes for the
 * dot products and the exps; the output's d is the lanes for the sums over keys (queries), each
 * lane adding in the written order. Lanes past the valid ones read neighbouring data or the
 * callers' padding (O1B_VATTN_PAD) and are never stored. */
#define NBV (O1B_VATTN_BK / O1B_W)

AI vf FN(mulz)(vf a, vf b, vi *rare) {
    vf r = a * b;
    *rare |= (BITS(r) & 0x7FFFFFFF) == 0x00800000;
    return r;
}
/* lanes l < n */
AI vi FN(below)(int64_t n) {
    vi idx;
    for (int l = 0; l < O1B_W; l++) idx[l] = l;
    return idx < (int32_t)(n < O1B_W ? n : O1B_W);
}
AI void FN(exp_n)(int n, const vf *x, vf *y, vi *rare) {
    int k = 0;
    for (; k + O1B_EXP_K <= n; k += O1B_EXP_K) FN(exp_k)(x + k, y + k, rare);
    for (; k < n; k++) y[k] = FN(exp)(x[k], rare);
}
/* out[d] = store(mul(acc[d], s)) for d < D */
AI void FN(store_scaled)(int64_t D, const float *acc, float s, float *out, vi *rare) {
    vf sv = FN(splat)(s);
    int64_t d = 0;
    for (; d + O1B_W <= D; d += O1B_W) FN(put)(out + d, FN(store)(FN(mulz)(FN(load)(acc + d), sv, rare)));
    if (d < D) {
        vi r = {0};
        vf y = FN(store)(FN(mulz)(FN(load)(acc + d), sv, &r));
        *rare |= r & FN(below)(D - d);
        for (int64_t l = 0; l < D - d; l++) out[d + l] = y[l];
    }
}

/* Exponent guards. A product of nonzero flushed x and y rounds to exactly 2^-126 only if their
 * biased exponents sum to 127 (the exact product lies in [2^(ex+ey-254), 2^(ex+ey-252)); with a
 * smaller sum it stays below 2^-126 and flushes on the hardware as in the contract, with a larger
 * one it is at least 2^-126 exactly). So a block whose products all miss that sum needs no per-product
 * mark, and its loops run bare; the others run with mulz as before. A row's exponent range
 * [lo, hi] covers its nonzero elements (lo > hi for a row of zeros). */
AI vi FN(expo)(vf x) { return (BITS(x) >> 23) & 0xFF; }
AI vi FN(iload)(const int32_t *p) { vi x; memcpy(&x, p, sizeof x); return x; }
/* lanes where x (exponent ex, 0 for zero) times some element of a row in [lo, hi] may hit 127 */
AI vi FN(may_tiny)(vi ex, vi lo, vi hi) { return (ex != 0) & (ex + lo <= 127) & (ex + hi >= 127); }

/* The lanes [*mlo, *mhi) of [0, nu) that every row with lanes (r < nr, lo[r] < hi[r]) holds: the
 * middle of a group's union, where the rows' loops need no test per row and lane (empty when no
 * row has lanes). With pr (rows of pb) and act: per row, the row to read there (itself when it has
 * lanes, else one that has) and all ones for a row with lanes. Returns how many rows have lanes. */
AI int FN(rows_middle)(int nr, int64_t nu, const int64_t *lo, const int64_t *hi, float (*pb)[O1B_VATTN_BK],
                       const float **pr, vi *act, int64_t *mlo, int64_t *mhi) {
    enum { R = O1B_VATTN_ROWS };
    int n = 0, with = 0;
    *mlo = 0;
    *mhi = nu;
    for (int r = 0; r < nr; r++) {
        if (hi[r] == lo[r]) continue;
        *mlo = lo[r] > *mlo ? lo[r] : *mlo;
        *mhi = hi[r] < *mhi ? hi[r] : *mhi;
        with = r;
        n++;
    }
    if (n == 0 || *mhi < *mlo) *mhi = *mlo = n == 0 ? nu : *mlo;
    for (int r = 0; pr && r < R; r++) {
        int has = r < nr && hi[r] > lo[r];
        pr[r] = pb[has ? r : with];
        act[r] = FN(isplat)(has ? -1 : 0);
    }
    return n;
}

/* fwd_pv's sums over the block's keys j in [j0, j1), ascending, into the registers a (nd vectors a
 * row; pr[r]: row r's p, by key): with `pred`, row r takes key j only inside its lanes [lo[r], hi[r]);
 * without, every row takes every key, which the caller allows only where every row with keys has
 * them all. There the other rows (no keys in the block, or past nr) read a row that has (pr) and sum
 * what is never stored; with `checked`, act (all ones for a row with keys) drops their marks. */
AI void FN(pv_keys)(int64_t j0, int64_t j1, const int pred, const int checked, const int nd, int nr,
                    const int64_t *lo, const int64_t *hi, const float *v, int64_t D,
                    const float *const *pr, vf (*a)[2], vi *rare, const vi *act) {
    enum { R = O1B_VATTN_ROWS };
    for (int64_t j = j0; j < j1; j++) {
        const float *vr = v + j * D;
        vf v0 = FN(load)(vr), v1 = nd > 1 ? FN(load)(vr + O1B_W) : (vf){0};
        for (int r = 0; r < R; r++) {
            if (pred && !(r < nr && j >= lo[r] && j < hi[r])) continue;
            vf cj = FN(splat)(pr[r][j]);
            vi m = {0};
            a[r][0] = a[r][0] + (checked ? FN(mulz)(cj, v0, &m) : cj * v0);
            if (nd > 1) a[r][1] = a[r][1] + (checked ? FN(mulz)(cj, v1, &m) : cj * v1);
            if (checked) rare[r] |= pred ? m : m & act[r];
        }
    }
}

/* The forward's sums of p over the block's keys j in [j0, j1), ascending, into ps (pr, pred as in
 * pv_keys: a row with keys reads itself, so pred's rows read pb). */
AI void FN(ps_keys)(int64_t j0, int64_t j1, const int pred, int nr, const int64_t *lo, const int64_t *hi,
                    const float *const *pr, float *ps) {
    enum { R = O1B_VATTN_ROWS };
    for (int64_t j = j0; j < j1; j++)
        for (int r = 0; r < R; r++)
            if (!pred || (r < nr && j >= lo[r] && j < hi[r])) ps[r] = ps[r] + pr[r][j];
}

/* The forward's block product and rescale for the columns [d0, d0 + nd W): each row r's
 *   t = sum_{j in [lo[r], hi[r]) ascending} pb[r][j] v_j  (v at key j = 0 of the block, D floats a row),
 * times spr[r] with i8, then acc = add(mul(acc, corr[r]), t); `checked`: t's products marked. The
 * keys that every row with keys has (the middle of the union, most of it) run without a test per
 * row and key, the few before and after with it; each row's terms keep their order either way. */
AI void FN(fwd_pv_d)(const int nd, const int checked, int nr, int64_t nu, const int64_t *lo,
                     const int64_t *hi, int64_t mlo, int64_t mhi, const float *const *pr, const vi *act,
                     int64_t D, int64_t d0, const float *v, const float *corr, const float *spr, int i8,
                     float *acc, vi *rare) {
    enum { R = O1B_VATTN_ROWS };
    const int64_t ld = D + O1B_VATTN_PAD;
    vf a[R][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = (vf){0};
    FN(pv_keys)(0, mlo, 1, checked, nd, nr, lo, hi, v + d0, D, pr, a, rare, act);
    FN(pv_keys)(mlo, mhi, 0, checked, nd, nr, lo, hi, v + d0, D, pr, a, rare, act);
    FN(pv_keys)(mhi, nu, 1, checked, nd, nr, lo, hi, v + d0, D, pr, a, rare, act);
    for (int r = 0; r < R; r++) {
        if (r >= nr || hi[r] == lo[r]) continue;
        vf cv = FN(splat)(corr[r]);
        for (int t = 0; t < nd; t++) {
            float *ap = acc + r * ld + d0 + t * O1B_W;
            vf pvv = i8 ? FN(mulz)(a[r][t], FN(splat)(spr[r]), &rare[r]) : a[r][t];
            FN(put)(ap, FN(mulz)(FN(load)(ap), cv, &rare[r]) + pvv);
        }
    }
}

/* fwd_pv_d over d < D, two vectors at a time (one for a last odd vector); the middle [mlo, mhi), pr
 * and act from rows_middle. */
AI void FN(fwd_pv)(int nr, int64_t nu, const int64_t *lo, const int64_t *hi, int64_t mlo, int64_t mhi,
                   const float *const *pr, const vi *act, int64_t D, const float *v, const float *corr,
                   const float *spr, int i8, float *acc, vi *rare, const int checked) {
    for (int64_t d0 = 0; d0 < D; d0 += 2 * O1B_W) {
        if (D - d0 > O1B_W)                             /* nd a constant in each inlined copy */
            FN(fwd_pv_d)(2, checked, nr, nu, lo, hi, mlo, mhi, pr, act, D, d0, v, corr, spr, i8, acc, rare);
        else
            FN(fwd_pv_d)(1, checked, nr, nu, lo, hi, mlo, mhi, pr, act, D, d0, v, corr, spr, i8, acc, rare);
    }
}

/* The forward's dots with the key vectors u0 .. u0 + nc - 1 (nc <= 4, a constant at each call) of
 * a block (kt: its first key in the transposed keys, rows of T floats): sv[r][u] = sum over d
 * ascending of q[r D + d] k_d, from the caller's +0, each lane one (row, key) sum in the written
 * order. All O1B_VATTN_ROWS rows run, those from nr on as a copy of row nr - 1 (unused sums), so
 * that the 4 nc accumulators stay in registers with no test in the loop. */
AI void FN(fwd_dots)(const int nc, int u0, int nr, int64_t D, int64_t T, const float *q, const float *kt,
                     vf (*sv)[NBV]) {
    enum { R = O1B_VATTN_ROWS };
    vf s[R][4];
    const float *qr[R];
    for (int r = 0; r < R; r++) {
        qr[r] = q + (r < nr ? r : nr - 1) * D;
        for (int c = 0; c < nc; c++) s[r][c] = sv[r][u0 + c];
    }
    for (int64_t d = 0; d < D; d++) {
        const float *row = kt + d * T + u0 * O1B_W;
        vf kv[4];
        for (int c = 0; c < nc; c++) kv[c] = FN(load)(row + c * O1B_W);
        for (int r = 0; r < R; r++) {
            vf xd = FN(splat)(qr[r][d]);
            for (int c = 0; c < nc; c++) s[r][c] = s[r][c] + xd * kv[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++) sv[r][u0 + c] = s[r][c];
}

/* The largest lane of x, whose lanes are not NaN: a tree of lane swaps. Any order gives the same
 * bits unless the largest is a zero (+0 and -0 compare equal; lanes >= +0 have no -0). */
AI float FN(hmax)(vf x) {
#if O1B_W == 16
    x = FN(sel)(O1B_SWAP(x, O1B_X8) > x, O1B_SWAP(x, O1B_X8), x);
#endif
#if O1B_W >= 8
    x = FN(sel)(O1B_SWAP(x, O1B_X4) > x, O1B_SWAP(x, O1B_X4), x);
#endif
    x = FN(sel)(O1B_SWAP(x, O1B_X2) > x, O1B_SWAP(x, O1B_X2), x);
    x = FN(sel)(O1B_SWAP(x, O1B_X1) > x, O1B_SWAP(x, O1B_X1), x);
    return x[0];
}

/* §6.10's steps 1-3 for the rows' blocks: pb[r] (p on the lanes [lo, hi) of the key union, nv
 * vectors) becomes q_p (levels as floats, +0 on the other lanes), spr[r] s_p. A row without keys
 * keeps pb and has s_p = +0; a zero block has s_p = +0 and q_p all +0; a non-finite block marks its
 * row (the caller's way) and is taken as zero here. t = mul(p, s_v) is marked where it may be exactly
 * 2^-126 (its value decides q_p there); t inv is bare, since a product near 2^-126 has level 0 with
 * or without the flush. The rows' two divisions run on the lanes of one short vector; a quotient at
 * or below 2^-126 is taken again with o1b_div (inv = 1 / s_p is never that small: s_p <= FLT_MAX /
 * 127). */
AI void FN(fwd_qp)(int nr, int nv, const int64_t *lo, const int64_t *hi, const float *svr,
                   float (*pb)[O1B_VATTN_BK], float *spr, vi *rare) {
    enum { R = O1B_VATTN_ROWS };
    typedef float rows_v __attribute__((vector_size(R * sizeof(float))));
    typedef int32_t rows_i __attribute__((vector_size(R * sizeof(int32_t))));
    rows_v tm = {0};
    for (int r = 0; r < nr; r++) {
        if (hi[r] == lo[r]) continue;
        vf tmv = (vf){0};
        vi nan = {0};
        for (int u = 0; u < nv; u++) {
            vi valid = FN(below)(hi[r] - u * O1B_W) & ~FN(below)(lo[r] - u * O1B_W), rr = {0};
            vf x = FN(mulz)(FN(load)(pb[r] + u * O1B_W), FN(load)(svr + u * O1B_W), &rr);
            rare[r] |= rr & valid;
            nan |= valid & (x != x);
            vf t = FN(sel)(valid, x, (vf){0});
            tmv = FN(sel)(t > tmv, t, tmv);
            FN(put)(pb[r] + u * O1B_W, t);
        }
        if (FN(any)(nan)) {                            /* non-finite block: the caller's way */
            rare[r] = FN(isplat)(-1);
            tmv = (vf){0};
        }
        tm[r] = FN(hmax)(tmv);
    }
    rows_v sp = tm / 127.0f, one = (rows_v){0} + 1.0f;
    rows_i zero = sp == 0.0f;
    rows_v iv = one / (rows_v)(((rows_i)sp & ~zero) | ((rows_i)one & zero));   /* no division by 0 */
    for (int r = 0; r < R; r++) {
        spr[r] = 0.0f;
        if (r >= nr || hi[r] == lo[r]) continue;
        float s = sp[r], inv = iv[r];
        if (s <= O1B_MIN_NORMAL) {
            s = o1b_div(tm[r], 127.0f);
            inv = s == 0.0f ? 0.0f : o1b_div(1.0f, s);
        }
        spr[r] = s;
        vf invv = FN(splat)(inv), magic = FN(splat)(O1B_ROUND_MAGIC), qmax = FN(splat)(127.0f);
        for (int u = 0; u < nv; u++) {                  /* s_p = +0: every q_p +0 */
            vf t = FN(load)(pb[r] + u * O1B_W) * invv;
            t = FN(sel)(t >= qmax, qmax, t);
            FN(put)(pb[r] + u * O1B_W, (t + magic) - magic);
        }
    }
}

#if defined(O1B_VM_X86) && O1B_W == 16
/* The block product and rescale of fwd_pv with i8 from the packed levels qv8 (per group of 4 keys
 * from key 0, D rounded up to 16 values of 4 bytes, a byte a key; zeros past T and D) on VNNI:
 * q_p (pb, +0 outside each row's lanes) to bytes, then each 32 values of d the int32 sums
 * (pv_i8_vnni), exact as floats (|sum| < 2^24), times spr, and acc = add(mul(acc, corr), pv). */
AI void FN(fwd_pv_vnni)(int nr, int64_t nu, int nv, const int64_t *lo, const int64_t *hi, int64_t j0,
                        int64_t D, const int8_t *qv8, float (*pb)[O1B_VATTN_BK], const float *corr,
                        const float *spr, float *acc, vi *rare) {
    enum { R = O1B_VATTN_ROWS, QB = O1B_VATTN_BK + 16 };
    const int64_t Dp = (D + 15) / 16 * 16, off = j0 & 3, ld = D + O1B_VATTN_PAD;
    const int64_t ng = (off + nu + 3) / 4;
    uint8_t qp[R][QB] __attribute__((aligned(64)));
    int32_t ia[R * 32] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++) {
        memset(qp[r], 0, QB);
        if (r >= nr || hi[r] == lo[r]) continue;
        for (int u = 0; u < nv; u++)
            _mm_storeu_si128((__m128i *)(void *)(qp[r] + off + u * O1B_W),
                             _mm512_cvtepi32_epi8(_mm512_cvttps_epi32((__m512)FN(load)(pb[r] + u * O1B_W))));
    }
    const int8_t *v8 = qv8 + (j0 - off) * Dp;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        pv_i8_vnni(ng, Dp, d0, v8, &qp[0][0], QB, ia);
        int nd = D - d0 > 16 ? 2 : 1;
        for (int r = 0; r < nr; r++) {
            if (hi[r] == lo[r]) continue;
            vf cv = FN(splat)(corr[r]), sv = FN(splat)(spr[r]);
            for (int t = 0; t < nd; t++) {
                float *ap = acc + r * ld + d0 + t * O1B_W;
                vi n;
                memcpy(&n, ia + r * 32 + t * 16, sizeof n);
                vf pvv = FN(mulz)(__builtin_convertvector(n, vf), sv, &rare[r]);
                FN(put)(ap, FN(mulz)(FN(load)(ap), cv, &rare[r]) + pvv);
            }
        }
    }
}
#endif

/* attention.c's forward of the nr <= O1B_VATTN_ROWS consecutive query rows i .. i + nr - 1 of one
 * head (row r: keys [jlo[r], i + r] in blocks of O1B_VATTN_BK at absolute key indices; q at q + r D,
 * o at o + r od, lse at lse + r). The rows are interleaved so that their independent sums (the dots
 * over shared key vectors, ps, the d-sums over keys) overlap; each row's sums are its own, in the
 * written order. With qv set (§6.10; v unused): qv the keys' quantized value rows (T, D) held as
 * floats (integers in [-127, 127]) and svr their step sizes (T); the block's int32 sum of q_p q_v
 * runs in fp32 lanes: every product and partial sum is an integer below 64 * 127^2 < 2^24, so each
 * is exact and the sum is the int32 one, and i2f of it is the float itself. With qv8 also set
 * (only where o1b_attn_vnni_now(); the AVX-512 rows use it, the others ignore it): the same levels
 * packed for VNNI (fwd_pv_vnni), whose int32 sums are the same integers. acc: nr (D +
 * O1B_VATTN_PAD) floats. vlo, vhi: the exponent ranges of the value rows (T; unused with qv, whose
 * integer products are exact). Returns a bit mask of the rows done (a row with a product of exactly
 * 2^-126, or with a non-finite int8 block, is left to the caller's contract.h path). */
static O1B_TGT int FN(attn_fwd_rows)(int nr, int64_t i, const int64_t *jlo, int64_t T, int64_t D,
                                     float scale, const float *q, const float *kt, const float *v,
                                     const int32_t *vlo, const int32_t *vhi, const float *qv,
                                     const float *svr, const int8_t *qv8, float *acc, float *o, int64_t od,
                                     float *lse) {
    enum { R = O1B_VATTN_ROWS };
    float pb[R][O1B_VATTN_BK] __attribute__((aligned(64)));
    float spr[R];
    vi rare[R];
    vf scv = FN(splat)(scale);
    float m[R], l[R];
    const int64_t ld = D + O1B_VATTN_PAD;
    for (int r = 0; r < R; r++) {
        rare[r] = (vi){0};
        m[r] = -INFINITY;
        l[r] = 0.0f;
        if (r < nr) for (int64_t d = 0; d < D; d += O1B_W) FN(put)(acc + r * ld + d, (vf){0});
    }
    int64_t ilast = i + nr - 1;
    for (int64_t kb = jlo[0] / O1B_VATTN_BK; kb <= ilast / O1B_VATTN_BK; kb++) {
        int64_t j0 = kb * O1B_VATTN_BK > jlo[0] ? kb * O1B_VATTN_BK : jlo[0];
        int64_t j1 = kb * O1B_VATTN_BK + O1B_VATTN_BK - 1 < ilast ? kb * O1B_VATTN_BK + O1B_VATTN_BK - 1 : ilast;
        int64_t nu = j1 - j0 + 1;                       /* the union of the rows' keys in the block */
        int nv = (int)((nu + O1B_W - 1) / O1B_W);
        int64_t lo[R], hi[R];                           /* row r's keys: lanes [lo, hi) of the union */
        vf sv[R][NBV];
        for (int r = 0; r < R; r++) {
            int64_t a = kb * O1B_VATTN_BK > jlo[r] ? kb * O1B_VATTN_BK : jlo[r];
            int64_t b = kb * O1B_VATTN_BK + O1B_VATTN_BK - 1 < i + r ? kb * O1B_VATTN_BK + O1B_VATTN_BK - 1 : i + r;
            lo[r] = r < nr ? a - j0 : 0;
            hi[r] = r < nr && b >= a ? b + 1 - j0 : lo[r];
            for (int u = 0; u < NBV; u++) sv[r][u] = (vf){0};
        }
        for (int u0 = 0; u0 < nv; u0 += 4) {           /* dots: rows x key vectors, d ascending */
            switch (nv - u0) {
            case 1: FN(fwd_dots)(1, u0, nr, D, T, q, kt + j0, sv); break;
            case 2: FN(fwd_dots)(2, u0, nr, D, T, q, kt + j0, sv); break;
            case 3: FN(fwd_dots)(3, u0, nr, D, T, q, kt + j0, sv); break;
            default: FN(fwd_dots)(4, u0, nr, D, T, q, kt + j0, sv); break;
            }
        }
        float corr[R], cx[R];                           /* corr = exp(cx), the rows on lanes below */
        for (int r = 0; r < R; r++) {
            cx[r] = 0.0f;
            if (r >= nr || hi[r] == lo[r]) continue;
            vf x[NBV], p[NBV];
            vf mv = FN(splat)(-INFINITY);
            for (int u = 0; u < nv; u++) {
                vi valid = FN(below)(hi[r] - u * O1B_W) & ~FN(below)(lo[r] - u * O1B_W), rr = {0};
                sv[r][u] = FN(mulz)(sv[r][u], scv, &rr);
                rare[r] |= rr & valid;
                vf y = FN(sel)(valid, sv[r][u], FN(splat)(-INFINITY));
                mv = FN(sel)(y > mv, y, mv);
                FN(put)(pb[r] + u * O1B_W, sv[r][u]);
            }
            float mb = FN(hmax)(mv);                    /* no NaN lane (passed over above) */
            if (mb == 0.0f) {                           /* a zero maximum: taken again in order */
                mb = -INFINITY;
                for (int64_t j = lo[r]; j < hi[r]; j++) mb = o1b_max(mb, pb[r][j]);
            }
            float m_new = o1b_max(m[r], mb);
            cx[r] = o1b_sub(m[r], m_new);
            vf mnv = FN(splat)(m_new);
            for (int u = 0; u < nv; u++) {
                vi valid = FN(below)(hi[r] - u * O1B_W) & ~FN(below)(lo[r] - u * O1B_W);
                x[u] = FN(sel)(valid, FN(sub)(sv[r][u], mnv), (vf){0});
            }
            FN(exp_n)(nv, x, p, &rare[r]);
            for (int u = 0; u < nv; u++) FN(put)(pb[r] + u * O1B_W, p[u]);
            m[r] = m_new;
        }
        {
            vf x = (vf){0};
            vi cr = {0};
            for (int r = 0; r < R; r++) x[r] = cx[r];
            vf y = FN(exp)(x, &cr);
            for (int r = 0; r < R; r++)
                corr[r] = r >= nr || hi[r] == lo[r] ? 1.0f : cr[r] ? o1b_exp(cx[r]) : y[r];
        }
        float ps[R] = {0};                              /* each row's sum of p, keys ascending */
        const float *pr[R];                             /* in the middle, a row without keys reads one with */
        vi act[R];
        int64_t mlo, mhi;                               /* the keys of every row with keys */
        FN(rows_middle)(nr, nu, lo, hi, pb, pr, act, &mlo, &mhi);
        FN(ps_keys)(0, mlo, 1, nr, lo, hi, pr, ps);
        FN(ps_keys)(mlo, mhi, 0, nr, lo, hi, pr, ps);   /* the other rows' sums are not used */
        FN(ps_keys)(mhi, nu, 1, nr, lo, hi, pr, ps);
        for (int r = 0; r < R; r++)
            if (r < nr && hi[r] > lo[r]) l[r] = o1b_add(o1b_mul(l[r], corr[r]), ps[r]);
        if (qv) FN(fwd_qp)(nr, nv, lo, hi, svr + j0, pb, spr, rare);   /* §6.10: pb becomes q_p */
        vi chk = {0};                                   /* the guard of p_j x v_j (with v) */
        for (int r = 0; !qv && r < nr; r++) {
            if (hi[r] == lo[r]) continue;
            for (int u = 0; u < nv; u++) {
                vi valid = FN(below)(hi[r] - u * O1B_W) & ~FN(below)(lo[r] - u * O1B_W);
                chk |= valid & FN(may_tiny)(FN(expo)(FN(load)(pb[r] + u * O1B_W)),
                                            FN(iload)(vlo + j0 + u * O1B_W), FN(iload)(vhi + j0 + u * O1B_W));
            }
        }
#if defined(O1B_VM_X86) && O1B_W == 16
        if (qv8) FN(fwd_pv_vnni)(nr, nu, nv, lo, hi, j0, D, qv8, pb, corr, spr, acc, rare);
        else
#endif
        if (FN(any)(chk)) FN(fwd_pv)(nr, nu, lo, hi, mlo, mhi, pr, act, D, v + j0 * D, corr, spr, 0, acc, rare, 1);
        else FN(fwd_pv)(nr, nu, lo, hi, mlo, mhi, pr, act, D, (qv ? qv : v) + j0 * D, corr, spr, qv != NULL,
                        acc, rare, 0);
    }
    vf lv = FN(splat)(1.0f), lg;                       /* log(l) of the rows on lanes */
    vi lr = {0};
    for (int r = 0; r < nr; r++) lv[r] = l[r];
    lg = FN(log)(lv, &lr);
    int done = 0;
    for (int r = 0; r < nr; r++) {
        if (FN(any)(rare[r])) continue;
        vi rr = {0};
        FN(store_scaled)(D, acc + r * ld, o1b_div(1.0f, l[r]), o + r * od, &rr);
        if (FN(any)(rr)) continue;
        lse[r] = o1b_store(o1b_add(m[r], lr[r] ? o1b_log(l[r]) : lg[r]));
        done |= 1 << r;
    }
    return done;
}

/* kv_dots for the nw (1 or 2, a constant) vectors of lanes from u: each splat of a row's element
 * serves all nw; each lane's sums are the same either way. */
AI void FN(kv_dots_at)(const int nw, const int checked, int u, int64_t D, int64_t T, const float *const *kr,
                       const float *const *vr, const float *qt, const float *gt, vf (*sv)[NBV], vf (*dp)[NBV],
                       vi (*rr)[NBV]) {
    enum { R = O1B_VATTN_ROWS };
    vf s[R][2], p[R][2];
    vi m[R][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < nw; t++) { s[r][t] = p[r][t] = (vf){0}; m[r][t] = (vi){0}; }
    const float *qc = qt + u * O1B_W, *gc = gt + u * O1B_W;
    for (int64_t d = 0; d < D; d++) {
        vf x[2], y[2];
        for (int t = 0; t < nw; t++) { x[t] = FN(load)(qc + d * T + t * O1B_W); y[t] = FN(load)(gc + d * T + t * O1B_W); }
        for (int r = 0; r < R; r++) {
            vf kd = FN(splat)(kr[r][d]), vd = FN(splat)(vr[r][d]);
            for (int t = 0; t < nw; t++) {
                s[r][t] = s[r][t] + kd * x[t];
                p[r][t] = p[r][t] + (checked ? FN(mulz)(vd, y[t], &m[r][t]) : vd * y[t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < nw; t++) { sv[r][u + t] = s[r][t]; dp[r][u + t] = p[r][t]; rr[r][u + t] = m[r][t]; }
}
/* The dots of a chunk of attn_dkv_rows (attn_dq_rows): for the R key (query) rows kr, vr (their k and v
 * rows; q and dout) and the query (key) lanes u < nv of the transposed qt, gt (kt, vt), from d
 * ascending and +0:  sv = sum_d kr_d qt[d],  dp = sum_d vr_d gt[d];  `checked`: dp's products
 * marked into rr. A vector of lanes at a time, its 2R sums interleaved; unchecked on AVX-512, two
 * vectors at a time, each splat serving both (the loop then bound by its arithmetic, not its loads;
 * 4R accumulators, so only where there are 32 vector registers), each lane's sum unchanged. */
AI void FN(kv_dots)(int nv, int64_t D, int64_t T, const float *const *kr, const float *const *vr,
                    const float *qt, const float *gt, vf (*sv)[NBV], vf (*dp)[NBV], vi (*rr)[NBV],
                    const int checked) {
    int u = 0;
    if (O1B_W == 16 && !checked)
        for (; u + 2 <= nv; u += 2) FN(kv_dots_at)(2, 0, u, D, T, kr, vr, qt, gt, sv, dp, rr);
    for (; u < nv; u++) FN(kv_dots_at)(1, checked, u, D, T, kr, vr, qt, gt, sv, dp, rr);
}
/* The sums of a chunk, for d < D two vectors at a time: each row r's
 *   acc_a += ca[r][c] x_c  (and with `two`, acc_b += cb[r][c] y_c)
 * over its lanes c in [lo[r], hi[r]) ascending (x, y at row c = 0 of the chunk, D floats a row;
 * acc_a at acc + r ld, or with `two` acc + 2r ld and acc_b at acc + (2r + 1) ld); `checked`:
 * every product marked into rare[r]. */
AI void FN(kv_sums)(int nr, int64_t nu, const int64_t *lo, const int64_t *hi, int64_t D, const float *x,
                    const float *y, float (*ca)[O1B_VATTN_BK], float (*cb)[O1B_VATTN_BK],
                    float *acc, vi *rare, const int checked, const int two) {
    enum { R = O1B_VATTN_ROWS };
    const int64_t ld = D + O1B_VATTN_PAD;
    for (int64_t d0 = 0; d0 < D; d0 += 2 * O1B_W) {
        vf aa[R][2], ab[R][2];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < 2; t++) {
                aa[r][t] = r < nr ? FN(load)(acc + (two ? 2 * r : r) * ld + d0 + t * O1B_W) : (vf){0};
                ab[r][t] = two && r < nr ? FN(load)(acc + (2 * r + 1) * ld + d0 + t * O1B_W) : (vf){0};
            }
        for (int64_t c = 0; c < nu; c++) {
            const float *xc = x + c * D + d0, *yc = two ? y + c * D + d0 : xc;
            vf x0 = FN(load)(xc), x1 = FN(load)(xc + O1B_W);
            vf y0 = two ? FN(load)(yc) : x0, y1 = two ? FN(load)(yc + O1B_W) : x1;
            for (int r = 0; r < R; r++) {
                if (r >= nr || c < lo[r] || c >= hi[r]) continue;
                vf sa = FN(splat)(ca[r][c]);
                if (checked) {
                    aa[r][0] = aa[r][0] + FN(mulz)(sa, x0, &rare[r]);
                    aa[r][1] = aa[r][1] + FN(mulz)(sa, x1, &rare[r]);
                } else {
                    aa[r][0] = aa[r][0] + sa * x0;
                    aa[r][1] = aa[r][1] + sa * x1;
                }
                if (!two) continue;
                vf sb = FN(splat)(cb[r][c]);
                if (checked) {
                    ab[r][0] = ab[r][0] + FN(mulz)(sb, y0, &rare[r]);
                    ab[r][1] = ab[r][1] + FN(mulz)(sb, y1, &rare[r]);
                } else {
                    ab[r][0] = ab[r][0] + sb * y0;
                    ab[r][1] = ab[r][1] + sb * y1;
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < 2; t++)
                if (r < nr) {
                    FN(put)(acc + (two ? 2 * r : r) * ld + d0 + t * O1B_W, aa[r][t]);
                    if (two) FN(put)(acc + (2 * r + 1) * ld + d0 + t * O1B_W, ab[r][t]);
                }
    }
}

/* attention.c's pass 1 (dq) for the nr <= O1B_VATTN_ROWS consecutive query rows i .. i + nr - 1 of
 * one head (row r: keys [jlo[r], i + r] in chunks of O1B_VATTN_BK from jlo[0]; dq at + r od),
 * interleaved like attn_dkv_rows, the roles of keys and queries swapped; each row's sum over keys
 * is its own, in ascending order (the chunks enter no sum). acc: nr (D + O1B_VATTN_PAD) floats.
 * Returns the bit mask of the rows done. */
static O1B_TGT int FN(attn_dq_rows)(int nr, int64_t i, const int64_t *jlo, const o1b_vattn_q *a,
                                    float *acc, float *dq, int64_t od) {
    enum { R = O1B_VATTN_ROWS };
    float dsb[R][O1B_VATTN_BK] __attribute__((aligned(64)));
    const int64_t T = a->T, D = a->D, ld = D + O1B_VATTN_PAD, ilast = i + nr - 1;
    const float *qr[R], *gr[R];
    vi rare[R];
    vf scv = FN(splat)(a->scale);
    for (int r = 0; r < R; r++) {
        int rc = r < nr ? r : nr - 1;
        qr[r] = a->q + rc * D;
        gr[r] = a->dout + rc * D;
        rare[r] = (vi){0};
        if (r < nr)                                   /* kv_sums' whole pairs of vectors */
            for (int64_t d = 0; d < D + O1B_W; d += O1B_W) FN(put)(acc + r * ld + d, (vf){0});
    }
    for (int64_t j0 = jlo[0]; j0 <= ilast; j0 += O1B_VATTN_BK) {
        int64_t nu = ilast + 1 - j0 < O1B_VATTN_BK ? ilast + 1 - j0 : O1B_VATTN_BK;
        int nv = (int)((nu + O1B_W - 1) / O1B_W);
        int64_t lo[R], hi[R];                           /* row r's keys: lanes [lo, hi) of the chunk */
        vi chk = {0};
        for (int r = 0; r < R; r++) {
            int64_t x = jlo[r] > j0 ? jlo[r] - j0 : 0, y = i + r + 1 - j0 < nu ? i + r + 1 - j0 : nu;
            lo[r] = r < nr ? x : 0;
            hi[r] = r < nr && y > x ? y : lo[r];
        }
        for (int u = 0; u < nv; u++) {                  /* dp's guard: dout_i x v_j */
            vi vl = FN(iload)(a->vlo + j0 + u * O1B_W), vh = FN(iload)(a->vhi + j0 + u * O1B_W);
            for (int r = 0; r < nr; r++) {
                vi valid = FN(below)(hi[r] - u * O1B_W) & ~FN(below)(lo[r] - u * O1B_W);
                chk |= valid & (vl + a->glo[r] <= 127) & (vh + a->ghi[r] >= 127);
            }
        }
        vf sv[R][NBV], dp[R][NBV];
        vi rr[R][NBV];
        if (FN(any)(chk)) FN(kv_dots)(nv, D, T, qr, gr, a->kt + j0, a->vt + j0, sv, dp, rr, 1);
        else FN(kv_dots)(nv, D, T, qr, gr, a->kt + j0, a->vt + j0, sv, dp, rr, 0);
        chk = (vi){0};
        for (int r = 0; r < nr; r++) {                   /* p and ds on lanes */
            if (hi[r] == lo[r]) continue;
            vf x[NBV], p[NBV], lsev = FN(splat)(a->lse[r]), Div = FN(splat)(a->Di[r]);
            for (int u = 0; u < nv; u++) {
                vi valid = FN(below)(hi[r] - u * O1B_W) & ~FN(below)(lo[r] - u * O1B_W), m = rr[r][u];
                x[u] = FN(sel)(valid, FN(sub)(FN(mulz)(sv[r][u], scv, &m), lsev), (vf){0});
                rare[r] |= m & valid;
            }
            FN(exp_n)(nv, x, p, &rare[r]);
            for (int u = 0; u < nv; u++) {
                vi valid = FN(below)(hi[r] - u * O1B_W) & ~FN(below)(lo[r] - u * O1B_W), m = {0};
                int64_t c = j0 + u * O1B_W;
                vf ds = FN(mulz)(p[u], FN(sub)(dp[r][u], Div), &m);
                rare[r] |= m & valid;
                FN(put)(dsb[r] + u * O1B_W, ds);
                /* the sum's guard: ds_j x k_j */
                chk |= valid & FN(may_tiny)(FN(expo)(ds), FN(iload)(a->klo + c), FN(iload)(a->khi + c));
            }
        }
        if (FN(any)(chk)) FN(kv_sums)(nr, nu, lo, hi, D, a->k + j0 * D, NULL, dsb, dsb, acc, rare, 1, 0);
        else FN(kv_sums)(nr, nu, lo, hi, D, a->k + j0 * D, NULL, dsb, dsb, acc, rare, 0, 0);
    }
    int done = 0;
    for (int r = 0; r < nr; r++) {
        if (FN(any)(rare[r])) continue;
        vi m = {0};
        FN(store_scaled)(D, acc + r * ld, a->scale, dq + r * od, &m);
        if (!FN(any)(m)) done |= 1 << r;
    }
    return done;
}

/* dq's sums of a chunk of attn_dkv_rows, for each query lane c < nu: qacc_c += ds[r][c] k_r over the
 * key rows r (ascending) whose lanes [lo[r], hi[r]) hold c; qacc row c at qacc + c qld (qld a
 * multiple of 2W); `checked`: every product marked, a marked query's qrare[c] set. */
AI void FN(q_sums_lanes)(int64_t c0, int64_t c1, int nr, const int64_t *lo, const int64_t *hi, int64_t D,
                         const float *const *kr, float (*dsb)[O1B_VATTN_BK], float *qacc, int64_t qld,
                         int32_t *qrare, const int checked) {
    for (int64_t c = c0; c < c1; c++) {
        int r0 = 0, r1 = 0;                             /* the rows holding c: [r0, r1) */
        while (r0 < nr && c >= hi[r0]) r0++;
        r1 = r0;
        while (r1 < nr && c >= lo[r1]) r1++;
        if (r0 == r1) continue;
        vi m = {0};
        for (int64_t d0 = 0; d0 < D; d0 += 2 * O1B_W) {
            float *ac = qacc + c * qld + d0;
            vf a0 = FN(load)(ac), a1 = FN(load)(ac + O1B_W);
            for (int r = r0; r < r1; r++) {
                vf sr = FN(splat)(dsb[r][c]), k0 = FN(load)(kr[r] + d0), k1 = FN(load)(kr[r] + d0 + O1B_W);
                if (checked) {
                    a0 = a0 + FN(mulz)(sr, k0, &m);
                    a1 = a1 + FN(mulz)(sr, k1, &m);
                } else {
                    a0 = a0 + sr * k0;
                    a1 = a1 + sr * k1;
                }
            }
            FN(put)(ac, a0);
            FN(put)(ac + O1B_W, a1);
        }
        if (checked && FN(any)(m)) qrare[c] = 1;
    }
}
/* The same for the lanes [c0, c1) that all O1B_VATTN_ROWS rows hold: the rows' k vectors loaded
 * once (in registers; the stores into qacc could alias them for the compiler) and no search. */
AI void FN(q_sums_all)(int64_t c0, int64_t c1, int64_t D, const float *const *kr,
                       float (*dsb)[O1B_VATTN_BK], float *qacc, int64_t qld, int32_t *qrare,
                       const int checked) {
    enum { R = O1B_VATTN_ROWS };
    for (int64_t d0 = 0; d0 < D; d0 += 2 * O1B_W) {
        vf k0[R], k1[R];
        for (int r = 0; r < R; r++) { k0[r] = FN(load)(kr[r] + d0); k1[r] = FN(load)(kr[r] + d0 + O1B_W); }
        for (int64_t c = c0; c < c1; c++) {
            float *ac = qacc + c * qld + d0;
            vf a0 = FN(load)(ac), a1 = FN(load)(ac + O1B_W);
            vi m = {0};
            for (int r = 0; r < R; r++) {
                vf sr = FN(splat)(dsb[r][c]);
                if (checked) {
                    a0 = a0 + FN(mulz)(sr, k0[r], &m);
                    a1 = a1 + FN(mulz)(sr, k1[r], &m);
                } else {
                    a0 = a0 + sr * k0[r];
                    a1 = a1 + sr * k1[r];
                }
            }
            FN(put)(ac, a0);
            FN(put)(ac + O1B_W, a1);
            if (checked && FN(any)(m)) qrare[c] = 1;
        }
    }
}
AI void FN(q_sums)(int nr, int64_t nu, const int64_t *lo, const int64_t *hi, int64_t D,
                   const float *const *kr, float (*dsb)[O1B_VATTN_BK], float *qacc, int64_t qld,
                   int32_t *qrare, const int checked) {
    enum { R = O1B_VATTN_ROWS };
    int64_t mlo, mhi;                                   /* the lanes every row holds, when all R have some */
    if (FN(rows_middle)(nr, nu, lo, hi, dsb, NULL, NULL, &mlo, &mhi) < R) mlo = mhi = nu;
    FN(q_sums_lanes)(0, mlo, nr, lo, hi, D, kr, dsb, qacc, qld, qrare, checked);
    FN(q_sums_all)(mlo, mhi, D, kr, dsb, qacc, qld, qrare, checked);
    FN(q_sums_lanes)(mhi, nu, nr, lo, hi, D, kr, dsb, qacc, qld, qrare, checked);
}

/* attention.c's pass 2 for the nr <= O1B_VATTN_ROWS consecutive key rows j .. j + nr - 1 of one kv
 * head (row r: queries [j + r, ilast[r]] of each of the group's heads in order, in chunks of
 * O1B_VATTN_BK queries from j; dk, dv at + r od), interleaved: the chunk's query vectors are loaded
 * once for all rows, and each row's sums over (head, query) are its own, in the written order
 * (the chunks enter no sum). The products of dout v (dp) and of the sums run bare where the
 * exponent guards allow. acc: 2 nr (D + O1B_VATTN_PAD) floats. Returns the bit mask of the rows done. */
static O1B_TGT int FN(attn_dkv_rows)(int nr, int64_t j, const int64_t *ilast, const o1b_vattn_kv *a,
                                     float *acc, float *dk, float *dv, int64_t od, float *qacc,
                                     int64_t qld, int32_t *qrare) {
    enum { R = O1B_VATTN_ROWS };
    float pb[R][O1B_VATTN_BK] __attribute__((aligned(64))), dsb[R][O1B_VATTN_BK] __attribute__((aligned(64)));
    const int64_t T = a->T, D = a->D, ld = D + O1B_VATTN_PAD, imax = ilast[nr - 1];
    const float *kr[R], *vr[R];
    vi rare[R];
    vf scv = FN(splat)(a->scale);
    for (int r = 0; r < R; r++) {
        int rc = r < nr ? r : nr - 1;
        kr[r] = a->k + rc * D;
        vr[r] = a->v + rc * D;
        rare[r] = (vi){0};
        if (r < nr)                                   /* kv_sums' whole pairs of vectors */
            for (int64_t d = 0; d < D + O1B_W; d += O1B_W) {
                FN(put)(acc + 2 * r * ld + d, (vf){0});
                FN(put)(acc + (2 * r + 1) * ld + d, (vf){0});
            }
    }
    for (int64_t h = 0; h < a->rep; h++) {
        const float *qt = a->qt + h * T * D, *gt = a->dout_t + h * T * D;
        const float *q = a->q + h * T * D, *g = a->dout + h * T * D;
        const float *lse = a->lse + h * T, *Di = a->Di + h * T;
        const int32_t *qlo = a->qlo + h * T, *qhi = a->qhi + h * T, *glo = a->glo + h * T, *ghi = a->ghi + h * T;
        float *qa = qacc ? qacc + h * T * qld : NULL;
        int32_t *qr = qacc ? qrare + h * T : NULL;
        for (int64_t i0 = j; i0 <= imax; i0 += O1B_VATTN_BK) {
            int64_t nu = imax + 1 - i0 < O1B_VATTN_BK ? imax + 1 - i0 : O1B_VATTN_BK;
            int nv = (int)((nu + O1B_W - 1) / O1B_W);
            int64_t lo[R], hi[R];                       /* row r's queries: lanes [lo, hi) of the chunk */
            vi chk = {0};
            for (int r = 0; r < R; r++) {
                int64_t x = j + r > i0 ? j + r - i0 : 0, y = ilast[r] + 1 - i0 < nu ? ilast[r] + 1 - i0 : nu;
                lo[r] = r < nr ? x : 0;
                hi[r] = r < nr && y > x ? y : lo[r];
            }
            for (int u = 0; u < nv; u++) {              /* dp's guard: dout_i x v_j */
                vi gl = FN(iload)(glo + i0 + u * O1B_W), gh = FN(iload)(ghi + i0 + u * O1B_W);
                for (int r = 0; r < nr; r++) {
                    vi valid = FN(below)(hi[r] - u * O1B_W) & ~FN(below)(lo[r] - u * O1B_W);
                    chk |= valid & (gl + a->vlo[r] <= 127) & (gh + a->vhi[r] >= 127);
                }
            }
            vf sv[R][NBV], dp[R][NBV];
            vi rr[R][NBV];
            /* mul(k, q) = mul(q, k): the same scores as pass 1 */
            if (FN(any)(chk)) FN(kv_dots)(nv, D, T, kr, vr, qt + i0, gt + i0, sv, dp, rr, 1);
            else FN(kv_dots)(nv, D, T, kr, vr, qt + i0, gt + i0, sv, dp, rr, 0);
            chk = (vi){0};
            vi chq = {0};
            for (int r = 0; r < nr; r++) {               /* p and ds on lanes */
                if (hi[r] == lo[r]) continue;
                vf x[NBV], p[NBV];
                vi pr = {0};                            /* marks of this row's p and ds */
                for (int u = 0; u < nv; u++) {
                    vi valid = FN(below)(hi[r] - u * O1B_W) & ~FN(below)(lo[r] - u * O1B_W), m = rr[r][u];
                    vf lsev = FN(flush)(FN(load)(lse + i0 + u * O1B_W));
                    x[u] = FN(sel)(valid, FN(sub)(FN(mulz)(sv[r][u], scv, &m), lsev), (vf){0});
                    pr |= m & valid;
                }
                FN(exp_n)(nv, x, p, &pr);
                for (int u = 0; u < nv; u++) {
                    vi valid = FN(below)(hi[r] - u * O1B_W) & ~FN(below)(lo[r] - u * O1B_W), m = {0};
                    int64_t c = i0 + u * O1B_W;
                    vf ds = FN(mulz)(p[u], FN(sub)(dp[r][u], FN(load)(Di + c)), &m);
                    pr |= m & valid;
                    FN(put)(pb[r] + u * O1B_W, p[u]);
                    FN(put)(dsb[r] + u * O1B_W, ds);
                    /* the sums' guards: ds_i x q_i and p_i x dout_i (and dq's ds_i x k_j) */
                    chk |= valid & (FN(may_tiny)(FN(expo)(ds), FN(iload)(qlo + c), FN(iload)(qhi + c)) |
                                    FN(may_tiny)(FN(expo)(p[u]), FN(iload)(glo + c), FN(iload)(ghi + c)));
                    if (qa) chq |= valid & FN(may_tiny)(FN(expo)(ds), FN(isplat)(a->klo[r]), FN(isplat)(a->khi[r]));
                }
                rare[r] |= pr;
                if (qa && FN(any)(pr))                  /* the queries whose ds may be off: dq the exact way */
                    for (int64_t c = lo[r]; c < hi[r]; c++) qr[i0 + c] = 1;
            }
            if (FN(any)(chk)) FN(kv_sums)(nr, nu, lo, hi, D, q + i0 * D, g + i0 * D, dsb, pb, acc, rare, 1, 1);
            else FN(kv_sums)(nr, nu, lo, hi, D, q + i0 * D, g + i0 * D, dsb, pb, acc, rare, 0, 1);
            if (!qa) continue;
            if (FN(any)(chq)) FN(q_sums)(nr, nu, lo, hi, D, kr, dsb, qa + i0 * qld, qld, qr + i0, 1);
            else FN(q_sums)(nr, nu, lo, hi, D, kr, dsb, qa + i0 * qld, qld, qr + i0, 0);
        }
    }
    int done = 0;
    for (int r = 0; r < nr; r++) {
        if (FN(any)(rare[r])) continue;
        vi m = {0};
        FN(store_scaled)(D, acc + 2 * r * ld, a->scale, dk + r * od, &m);
        FN(store_scaled)(D, acc + (2 * r + 1) * ld, 1.0f, dv + r * od, &m);
        if (!FN(any)(m)) done |= 1 << r;
    }
    return done;
}

#undef O1B_VM_MAP_LOOP
#undef SIGN
#undef BITS
#undef VF
#undef AI
#undef vf
#undef vi
#undef vu
#undef vh
#undef FN
#undef O1B_TGT
#undef O1B_SFX
#undef O1B_W
#undef O1B_ANY
#undef O1B_VSQRT
#undef O1B_FLUSH
#undef O1B_ZLO
#undef O1B_ZHI
#undef O1B_ZIP
#undef O1B_SWAP
#undef O1B_X8
#undef O1B_X4
#undef O1B_X2
#undef O1B_X1
#endif
