/* contract.h — the scalar arithmetic of CONTRACT.md (version 1) as inline C.
 *
 * Every kernel of the C reference is written with these helpers only, so that each line of a
 * kernel reads as the contract's formula. The rules (CONTRACT.md §1–§3):
 *   - fp32 values entering an op are never subnormal: loads go through o1b_load (flush) or are
 *     outputs of other helpers, which flush.
 *   - a result whose exact value has magnitude below 2^-126 becomes a zero of the same sign
 *     ("flush before rounding"); otherwise it is the IEEE round-to-nearest-even result.
 *   - no fused multiply-add: the file is compiled with -ffp-contract=off (and the pragma below).
 *   - NaN leaves an op as 0x7FC00000 (o1b_canon at every store to an output array).
 * The process may run with x86 FTZ/DAZ or ARM FZ set or clear; these helpers give the same
 * bits either way (see o1b_mul).
 */
#ifndef O1B_CONTRACT_H
#define O1B_CONTRACT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#pragma STDC FP_CONTRACT OFF

#define O1B_CONTRACT_VERSION 1
#define O1B_NAN_BITS 0x7FC00000u
#define O1B_BF16_NAN 0x7FC0u
#define O1B_MIN_NORMAL 0x1p-126f

typedef uint16_t bf16;

static inline uint32_t o1b_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float o1b_from_bits(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* Subnormal -> zero of the same sign; everything else unchanged. */
static inline float o1b_flush(float x) {
    uint32_t u = o1b_bits(x);
    return (u & 0x7F800000u) == 0 ? o1b_from_bits(u & 0x80000000u) : x;
}
/* o1b_flush on the bits, without branches (loops of it vectorize) */
static inline uint32_t o1b_flush_bits(uint32_t u) {
    uint32_t normal = 0u - (uint32_t)((u & 0x7F800000u) != 0);     /* all ones unless zero/subnormal */
    return u & (normal | 0x80000000u);
}
/* Any NaN -> the canonical NaN. Applied when a value is stored to an op's output. */
static inline float o1b_canon(float x) { return x != x ? o1b_from_bits(O1B_NAN_BITS) : x; }
static inline float o1b_load(float x) { return o1b_flush(x); }
static inline float o1b_store(float x) { return o1b_canon(o1b_flush(x)); }
static inline float o1b_nan(void) { return o1b_from_bits(O1B_NAN_BITS); }

/* ---- conversions (§2) ---- */
static inline float o1b_bf16_to_f32(bf16 h) { return o1b_flush(o1b_from_bits((uint32_t)h << 16)); }
/* fp32 -> bf16, round to nearest even by integer arithmetic; NaN -> 0x7FC0; subnormal -> ±0. */
static inline bf16 o1b_f32_to_bf16(float x) {
    uint32_t u = o1b_bits(o1b_flush(x));
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return O1B_BF16_NAN;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

/* ---- the primitive operations (§3) ---- */
/* A subnormal sum or difference of two normals is exact, so flushing the IEEE result is the
 * same as flushing the exact value. */
static inline float o1b_add(float a, float b) { return o1b_flush(a + b); }
static inline float o1b_sub(float a, float b) { return o1b_flush(a - b); }
static inline float o1b_neg(float a) { return o1b_from_bits(o1b_bits(a) ^ 0x80000000u); }

/* |a*b| rounded to <= 2^-126: the exact product may lie below 2^-126 even when the IEEE
 * result (gradual underflow, or x86 FTZ which detects tininess after rounding) is 2^-126.
 * The double product of two floats is exact, so it decides. Rare path, kept out of line. */
static float o1b_mul_tiny(float a, float b, float r) {
    if (fabsf(r) < O1B_MIN_NORMAL) return o1b_from_bits(o1b_bits(r) & 0x80000000u);
    double e = (double)a * (double)b;
    return fabs(e) < 0x1p-126 ? o1b_from_bits(o1b_bits(r) & 0x80000000u) : r;
}
static inline float o1b_mul(float a, float b) {
    float r = a * b;
    return fabsf(r) <= O1B_MIN_NORMAL ? o1b_mul_tiny(a, b, r) : r;
}
static float o1b_div_tiny(float a, float b, float r) {
    if (fabsf(r) < O1B_MIN_NORMAL) return o1b_from_bits(o1b_bits(r) & 0x80000000u);
    /* |a/b| < 2^-126  <=>  |a| < 2^-126 |b|, both sides exact in double. */
    return fabs((double)a) < 0x1p-126 * fabs((double)b) ? o1b_from_bits(o1b_bits(r) & 0x80000000u) : r;
}
/* Correctly rounded IEEE division (every backend's `/` outside fast math, CUDA __fdiv_rn). */
static inline float o1b_div(float a, float b) {
    float r = a / b;
    return fabsf(r) <= O1B_MIN_NORMAL ? o1b_div_tiny(a, b, r) : r;
}
/* Correctly rounded IEEE square root; never tiny for a normal input. sqrtf is required by
 * IEEE 754 / C Annex F to be correctly rounded; o1b_sqrt_int below is the integer definition
 * that backends without a guaranteed sqrt use, and the tests hold the two equal. */
static inline float o1b_sqrt(float x) { return sqrtf(x); }
/* max/min as written comparisons: a NaN operand in `a` position is passed over. */
static inline float o1b_max(float a, float b) { return b > a ? b : a; }
static inline float o1b_i2f(int32_t i) { return o1b_flush((float)i); } /* exact for |i| <= 2^24 */

static inline float o1b_sqrt_int(float x) {
    uint32_t u = o1b_bits(o1b_flush(x));
    if ((u & 0x7FFFFFFFu) == 0) return o1b_from_bits(u);     /* sqrt(±0) = ±0 */
    if ((u & 0x7FFFFFFFu) > 0x7F800000u || (u >> 31)) return o1b_nan();
    if (u == 0x7F800000u) return o1b_from_bits(u);
    int k = (int)(u >> 23) - 150;                             /* x = m * 2^k, m in [2^23, 2^24) */
    uint64_t m = (u & 0x7FFFFFu) | 0x800000u;
    int t = ((k - 23) & 1) ? 24 : 23;                         /* M = m << t in [2^46, 2^48), k - t even */
    uint64_t M = m << t, rem = M, res = 0, one = 1ull << 46;
    while (one) {                                             /* digit-by-digit integer root */
        if (rem >= res + one) { rem -= res + one; res = (res >> 1) + one; }
        else res >>= 1;
        one >>= 2;
    }
    if (rem > res) res += 1;                                  /* (res+1/2)^2 < M: round up; no ties */
    int j = (k - t) / 2;                                      /* sqrt(x) = res * 2^j, res in [2^23, 2^24] */
    return o1b_from_bits((uint32_t)((j + 150) << 23) + (uint32_t)res - 0x800000u);
}

/* The contract's integer division (CONTRACT.md §3): the correctly rounded quotient with the flush
 * rule, from an integer quotient and remainder of the significands. It equals o1b_div (C `/` and
 * the exact tiny check) for every pair of operands; the Metal backend divides this way. */
static inline float o1b_div_int(float a, float b) {
    uint32_t ua = o1b_bits(o1b_flush(a)), ub = o1b_bits(o1b_flush(b));
    uint32_t sign = (ua ^ ub) & 0x80000000u, xa = ua & 0x7FFFFFFFu, xb = ub & 0x7FFFFFFFu;
    if (xa > 0x7F800000u || xb > 0x7F800000u) return o1b_nan();              /* NaN operand */
    if (xa == 0x7F800000u)                                                     /* inf/inf, inf/x */
        return xb == 0x7F800000u ? o1b_nan() : o1b_from_bits(sign | 0x7F800000u);
    if (xb == 0x7F800000u) return o1b_from_bits(sign);                        /* x/inf = ±0 */
    if (xb == 0) return xa == 0 ? o1b_nan() : o1b_from_bits(sign | 0x7F800000u); /* 0/0, x/0 */
    if (xa == 0) return o1b_from_bits(sign);                                   /* 0/x = ±0 */
    uint64_t ma = (xa & 0x7FFFFFu) | 0x800000u, mb = (xb & 0x7FFFFFu) | 0x800000u;
    int s = ma < mb ? 24 : 23;                                /* Q = (ma << s) / mb in [2^23, 2^24) */
    uint64_t Q = (ma << s) / mb, R = (ma << s) % mb;
    int E = (int)(xa >> 23) - (int)(xb >> 23) + 150 - s;      /* a/b = (Q + R/mb) 2^(E-150) */
    if (E <= 0) return o1b_from_bits(sign);                   /* exact |a/b| < 2^-126: flushed */
    if (E >= 255) return o1b_from_bits(sign | 0x7F800000u);   /* >= 2^128: overflow */
    /* Rounding up never reaches Q = 2^24 (no carry into the exponent): R > 0 needs Q <= 2^24 - 2
     * (s = 24: ma <= mb - 1; s = 23: mb = 2^23 leaves R = 0, a larger mb gives Q <= 2^24 - 3). */
    if (2 * R > mb) Q += 1;                                   /* round to nearest; 2R = mb is impossible */
    return o1b_from_bits(sign | (((uint32_t)E << 23) + (uint32_t)Q - 0x800000u));
}

/* int32 -> fp32 of any int32 (§2, §6.9: the int8 GEMM accumulators), round to nearest even by
 * construction: acc = hi 2^16 + lo with hi = floor(acc / 2^16) in [-2^15, 2^15) and lo = acc mod 2^16
 * in [0, 2^16) (two's complement bit fields, no implementation-defined shift), both converted
 * exactly, hi scaled exactly by mul; the one contract add rounds the exact sum acc once. Equals
 * C's (float)acc (CONTRACT.md §6.9 proves it). */
static inline float o1b_i2f_acc(int32_t acc) {
    uint32_t u = (uint32_t)acc;
    int32_t hi = (int32_t)(u >> 16) - (int32_t)((u >> 31) << 16), lo = (int32_t)(u & 0xFFFFu);
    return o1b_add(o1b_mul(o1b_i2f(hi), 65536.0f), o1b_i2f(lo));
}

/* ---- software transcendentals (§4). Taylor coefficients 1/k!, 2/(2k+1), rounded to fp32. ---- */
#define O1B_ROUND_MAGIC 0x1.8p23f   /* t + 1.5*2^23 - 1.5*2^23 rounds t to an integer (|t| < 2^22) */

/* level(t) of CONTRACT.md §6.9 for a finite t: nearest integer, ties to even, clamped to ±qmax
 * (127; 31 or 7 on the simulated int6 / int4 paths). */
static inline int8_t o1b_level_q(float t, int qmax) {
    float m = (float)qmax;
    if (t >= m) return (int8_t)qmax;
    if (t <= -m) return (int8_t)-qmax;
    return (int8_t)(int)((t + O1B_ROUND_MAGIC) - O1B_ROUND_MAGIC);
}
static inline int8_t o1b_level(float t) { return o1b_level_q(t, 127); }

static inline float o1b_exp(float x) {
    if (x != x) return o1b_nan();
    if (x > 0x1.62e42ep6f) return INFINITY;                   /* > ln(FLT_MAX) */
    if (x < -0x1.9cp6f) return 0.0f;                          /* < -103: far below 2^-126 */
    float nf = o1b_sub(o1b_add(o1b_mul(x, 0x1.715476p0f), O1B_ROUND_MAGIC), O1B_ROUND_MAGIC);
    int n = (int)nf;
    if (n < -126) return 0.0f;                                /* result < 2^-126: flushed */
    float r = o1b_sub(o1b_sub(x, o1b_mul(nf, 0x1.62e4p-1f)), o1b_mul(nf, 0x1.7f7d1cp-20f));
    float p = 0x1.a01a02p-13f;                                /* 1/7! */
    p = o1b_add(o1b_mul(p, r), 0x1.6c16c2p-10f);              /* 1/6! */
    p = o1b_add(o1b_mul(p, r), 0x1.111112p-7f);               /* 1/5! */
    p = o1b_add(o1b_mul(p, r), 0x1.555556p-5f);               /* 1/4! */
    p = o1b_add(o1b_mul(p, r), 0x1.555556p-3f);               /* 1/3! */
    p = o1b_add(o1b_mul(p, r), 0x1p-1f);                      /* 1/2! */
    p = o1b_add(o1b_mul(p, r), 1.0f);
    p = o1b_add(o1b_mul(p, r), 1.0f);
    if (n > 127) return o1b_mul(o1b_mul(p, 2.0f), 0x1p127f);
    return o1b_mul(p, o1b_from_bits((uint32_t)(n + 127) << 23));
}

static inline float o1b_log(float x) {
    uint32_t u = o1b_bits(o1b_flush(x));
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return o1b_nan();
    if ((u & 0x7FFFFFFFu) == 0) return -INFINITY;             /* log(±0) = -inf */
    if (u >> 31) return o1b_nan();                            /* log(x < 0) = NaN */
    if (u == 0x7F800000u) return INFINITY;
    int e = (int)(u >> 23) - 127;
    float m = o1b_from_bits((u & 0x7FFFFFu) | 0x3F800000u);  /* x = m * 2^e, m in [1, 2) */
    if (m > 0x1.6a09e6p0f) { m = o1b_mul(m, 0.5f); e += 1; } /* m in (sqrt(2)/2, sqrt(2)] */
    float f = o1b_sub(m, 1.0f);                               /* exact (Sterbenz) */
    float s = o1b_div(f, o1b_add(2.0f, f));                   /* log(1+f) = 2 atanh(s) */
    float z = o1b_mul(s, s);
    float R = 0x1.c71c72p-3f;                                 /* 2/9 */
    R = o1b_add(o1b_mul(R, z), 0x1.24924ap-2f);               /* 2/7 */
    R = o1b_add(o1b_mul(R, z), 0x1.99999ap-2f);               /* 2/5 */
    R = o1b_add(o1b_mul(R, z), 0x1.555556p-1f);               /* 2/3 */
    R = o1b_mul(R, z);
    float hfsq = o1b_mul(0.5f, o1b_mul(f, f));
    float ef = o1b_i2f(e);
    /* log(1+f) = f - hfsq + s*(hfsq + R), since f - 2s = s*f; ln2 split so ef*LN2_HI is exact */
    float r = o1b_add(o1b_mul(s, o1b_add(hfsq, R)), o1b_mul(ef, 0x1.7f7d1cp-20f));
    r = o1b_add(o1b_sub(r, hfsq), f);
    return o1b_add(r, o1b_mul(ef, 0x1.62e4p-1f));
}

/* sin and cos share the reduction x = n*pi/2 + r, |r| <= ~pi/4, pi/2 = P1 + P2 + P3 with
 * n*P1 and n*P2 exact for |n| < 2^14 (|x| < ~25700); beyond that the result is still fully
 * determined by these operations, with no accuracy claim. */
static inline void o1b_sincos_reduce(float x, float *r, int *q) {
    float nf = o1b_sub(o1b_add(o1b_mul(x, 0x1.45f306p-1f), O1B_ROUND_MAGIC), O1B_ROUND_MAGIC);
    float y = o1b_sub(x, o1b_mul(nf, 0x1.92p0f));
    y = o1b_sub(y, o1b_mul(nf, 0x1.fb4p-12f));
    *r = o1b_sub(y, o1b_mul(nf, 0x1.4442d2p-24f));
    *q = fabsf(nf) < 0x1p31f ? (int)nf & 3 : 0;   /* |nf| >= 2^25 is a multiple of 4 */
}
static inline float o1b_sin_poly(float r) {                   /* r - r^3/3! + ... + r^9/9! */
    float z = o1b_mul(r, r);
    float p = 0x1.71de3ap-19f;                                /* 1/9! */
    p = o1b_add(o1b_mul(p, z), -0x1.a01a02p-13f);             /* -1/7! */
    p = o1b_add(o1b_mul(p, z), 0x1.111112p-7f);               /* 1/5! */
    p = o1b_add(o1b_mul(p, z), -0x1.555556p-3f);              /* -1/3! */
    return o1b_add(r, o1b_mul(o1b_mul(r, z), p));
}
static inline float o1b_cos_poly(float r) {                   /* 1 - r^2/2! + ... - r^10/10! */
    float z = o1b_mul(r, r);
    float p = -0x1.27e4fcp-22f;                               /* -1/10! */
    p = o1b_add(o1b_mul(p, z), 0x1.a01a02p-16f);              /* 1/8! */
    p = o1b_add(o1b_mul(p, z), -0x1.6c16c2p-10f);             /* -1/6! */
    p = o1b_add(o1b_mul(p, z), 0x1.555556p-5f);               /* 1/4! */
    p = o1b_add(o1b_mul(p, z), -0x1p-1f);                     /* -1/2! */
    return o1b_add(1.0f, o1b_mul(z, p));
}
static inline float o1b_sin(float x) {
    x = o1b_flush(x);
    if (!(fabsf(x) <= 0x1.fffffep127f)) return o1b_nan();     /* inf, NaN */
    if (fabsf(x) < 0x1p-12f) return x;   /* the polynomial rounds to x here; keeps sin(-0) = -0 */
    float r; int q; o1b_sincos_reduce(x, &r, &q);
    float v = (q & 1) ? o1b_cos_poly(r) : o1b_sin_poly(r);
    return (q & 2) ? o1b_neg(v) : v;
}
static inline float o1b_cos(float x) {
    x = o1b_flush(x);
    if (!(fabsf(x) <= 0x1.fffffep127f)) return o1b_nan();
    float r; int q; o1b_sincos_reduce(x, &r, &q);
    float v = (q & 1) ? o1b_sin_poly(r) : o1b_cos_poly(r);
    return (q == 1 || q == 2) ? o1b_neg(v) : v;
}
static inline float o1b_rsqrt(float x) { return o1b_div(1.0f, o1b_sqrt(x)); }
static inline float o1b_sigmoid(float x) { return o1b_div(1.0f, o1b_add(1.0f, o1b_exp(o1b_neg(x)))); }
static inline float o1b_silu(float x) { return o1b_mul(x, o1b_sigmoid(x)); }

/* ---- Philox4x32-10 (§5) ---- */
static inline void o1b_philox(uint32_t k0, uint32_t k1, uint32_t c[4]) {
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0], p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c[0] = hi1 ^ c[1] ^ k0; c[1] = lo1; c[2] = hi0 ^ c[3] ^ k1; c[3] = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
}
/* The block at (seed, stream, index, sub): key = seed words, counter = (index lo, index hi,
 * stream, sub). */
static inline void o1b_philox_block(uint64_t seed, uint32_t stream, uint64_t index, uint32_t sub,
                                    uint32_t out[4]) {
    out[0] = (uint32_t)index; out[1] = (uint32_t)(index >> 32); out[2] = stream; out[3] = sub;
    o1b_philox((uint32_t)seed, (uint32_t)(seed >> 32), out);
}

#endif
