// hwfloat.h — the fp32 unit of an emulated GPU: add, sub, mul, div, sqrt and fused multiply-add as
// the hardware does them, with the planted faults and the adversarial flush mode of
// `emu.hardware(...)`. Shared by both emulators: the CUDA prelude implements __fadd_rn, __fsub_rn,
// __fmul_rn, __fdiv_rn, __fsqrt_rn, __fmaf_rn and PTX fma.rn.ftz.f32 with it; the Metal prelude
// maps the contract header's hardware-operator hooks (O1B_HW_ADD, O1B_HW_SUB, O1B_HW_MUL,
// O1B_HW_DIV) onto it when a hardware mode is active.
//
// Configured before inclusion (every one is part of the compiled text, so of the cache key):
//   O1B_HW_FAULT        0 none; 1 div_rz: division rounds toward zero; 2 fma: a multiply feeding an
//                       add is contracted into one fused multiply-add; 3 flush_unsigned: every tiny
//                       result comes back as +0, whatever its sign
//   O1B_HW_ADVERSARIAL  1: every tiny result comes back as the IEEE value, +0 or -0, chosen
//                       pseudo-randomly per operation from (seed, thread, the thread's count of
//                       tiny results so far) — the same choices in any thread order
//   O1B_HW_DAZ          an expression; nonzero: subnormal inputs are read as zeros of their sign
//   O1B_HW_FTZ          an expression; what happens to a tiny result otherwise: 0 IEEE gradual
//                       underflow, 1 flushed to the zero of its sign when the rounded result is
//                       subnormal (tininess after rounding), 2 flushed whenever it is tiny (before)
// "Tiny" is a property of the EXACT result: nonzero and below 2^-126 in magnitude. add/sub: the
// IEEE result is subnormal (a tiny sum of two floats is exact); mul: the double product (exact for
// two floats); div: |a| < 2^-126 |b| in double (both sides exact); fused multiply-add: the exact
// product plus the addend as an unevaluated double pair. The precedence for a tiny result is
// flush_unsigned, then adversarial, then O1B_HW_FTZ.
//
// The fma fault is a dynamic model of contraction: every product a*b a thread computes is
// remembered (its two most recent products, newest first); an add/sub of which one operand has
// the bits of a remembered nonzero product r (or of -r) is computed as fmaf(±a, b, other operand) and the
// product is forgotten. So add(acc, mul(a, b)), add(mul(p, r), c) (Horner steps) and
// sub(x, mul(n, c)) fuse whatever the C++ code does with r in between (the contract header's mul
// inspects r's bits, so no compiler flag would fuse it here), and an add whose operands are not
// fresh products is left alone.
#ifndef O1B_HWFLOAT_H
#define O1B_HWFLOAT_H
#include <math.h>
#include <string.h>

#ifndef O1B_HW_FAULT
#define O1B_HW_FAULT 0
#endif
#ifndef O1B_HW_ADVERSARIAL
#define O1B_HW_ADVERSARIAL 0
#endif
#ifndef O1B_HW_DAZ
#define O1B_HW_DAZ 0
#endif
#ifndef O1B_HW_FTZ
#define O1B_HW_FTZ 0
#endif

// 2^-126 (written in decimal: the Metal emulator compiles C++14, which has no hex floats)
#define O1B_HW_MIN_NORMAL 1.1754943508222875e-38

// Whether the unit keeps per-thread state (the schedulers then start, save and restore it).
#define O1B_HW_STATEFUL (O1B_HW_ADVERSARIAL || O1B_HW_FAULT == 2)

// The state of the thread that is running; a scheduler that switches threads saves and restores it.
struct o1b_hw_thread {
    unsigned long long id;    // the thread's linear index in the launch
    unsigned int tiny_ops;    // tiny results so far (adversarial choices)
    unsigned int nprod;       // remembered products (fma fault), newest in slot 0
    float pa[2], pb[2], pr[2];
};
static o1b_hw_thread o1b_hw_cur;
static unsigned long long o1b_hw_seed = 0;

extern "C" void o1b_hw_set_seed(unsigned long long seed) { o1b_hw_seed = seed; }
static inline void o1b_hw_start_thread(unsigned long long id) {
    memset(&o1b_hw_cur, 0, sizeof o1b_hw_cur);
    o1b_hw_cur.id = id;
}
static inline unsigned int o1b_hw_bits(float x) { unsigned int u; memcpy(&u, &x, 4); return u; }
static inline float o1b_hw_float(unsigned int u) { float x; memcpy(&x, &u, 4); return x; }
static inline float o1b_hw_in(float x) {
    unsigned int u = o1b_hw_bits(x);
    if ((O1B_HW_DAZ) && (u & 0x7F800000u) == 0u) return o1b_hw_float(u & 0x80000000u);
    return x;
}
// 0: the IEEE value, 1: +0, 2: -0 (splitmix64 of seed, thread, count)
static inline unsigned int o1b_hw_choice(void) {
    unsigned long long z = o1b_hw_seed + 0x9E3779B97F4A7C15ull * (o1b_hw_cur.id + 1)
                           + 0xD1B54A32D192ED03ull * (unsigned long long)(o1b_hw_cur.tiny_ops++);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (unsigned int)(z % 3u);
}
// The hardware's answer for a result r (IEEE, or rounded toward zero under div_rz) whose exact value
// is tiny or not.
static inline float o1b_hw_out(float r, bool tiny) {
    if (!tiny) return r;
#if O1B_HW_FAULT == 3
    return o1b_hw_float(0u);
#elif O1B_HW_ADVERSARIAL
    unsigned int c = o1b_hw_choice();
    return c == 0u ? r : o1b_hw_float(c == 1u ? 0u : 0x80000000u);
#else
    if ((O1B_HW_FTZ) == 2 || ((O1B_HW_FTZ) == 1 && (o1b_hw_bits(r) & 0x7F800000u) == 0u))
        return o1b_hw_float(o1b_hw_bits(r) & 0x80000000u);
    return r;
#endif
}
static inline bool o1b_hw_subnormal(float r) {
    unsigned int u = o1b_hw_bits(r);
    return (u & 0x7F800000u) == 0u && (u & 0x7FFFFFu) != 0u;
}

// Whether the exact a*b + c is tiny: p = a*b is exact in double, p + c = s + e exactly.
static inline bool o1b_hw_fused_tiny(float a, float b, float c) {
    double p = (double)a * (double)b, s = p + (double)c, bb = s - p;
    double e = (p - (s - bb)) + ((double)c - bb);
    if (fabs(s) < O1B_HW_MIN_NORMAL) return s != 0.0 || e != 0.0;
    return fabs(s) == O1B_HW_MIN_NORMAL && e != 0.0 && ((s > 0.0) != (e > 0.0));
}
// fmaf(a, b, c) with the unit's answer for a tiny result.
static inline float o1b_hw_fused(float a, float b, float c) {
    return o1b_hw_out(fmaf(a, b, c), o1b_hw_fused_tiny(a, b, c));
}

static inline float o1b_hw_mul(float a, float b) {
    a = o1b_hw_in(a); b = o1b_hw_in(b);
    float r = a * b;
    bool tiny = false;
    if ((o1b_hw_bits(r) & 0x7FFFFFFFu) <= 0x00800000u) {
        double e = (double)a * (double)b;
        tiny = e != 0.0 && fabs(e) < O1B_HW_MIN_NORMAL;
    }
#if O1B_HW_FAULT == 2
    o1b_hw_thread &t = o1b_hw_cur;
    t.pa[1] = t.pa[0]; t.pb[1] = t.pb[0]; t.pr[1] = t.pr[0];
    t.pa[0] = a; t.pb[0] = b;
    t.pr[0] = o1b_hw_out(r, tiny);
    t.nprod = t.nprod < 2u ? t.nprod + 1u : 2u;
    return t.pr[0];
#else
    return o1b_hw_out(r, tiny);
#endif
}

#if O1B_HW_FAULT == 2
// If x is (up to sign) a remembered nonzero product: forget it and return 1 with its operands
// (a negated for -r), else 0.
static inline int o1b_hw_take_product(float x, float *a, float *b) {
    o1b_hw_thread &t = o1b_hw_cur;
    unsigned int ux = o1b_hw_bits(x);
    for (unsigned int k = 0; k < t.nprod; k++) {
        unsigned int ur = o1b_hw_bits(t.pr[k]);
        if ((ur & 0x7FFFFFFFu) == 0u || (ux & 0x7FFFFFFFu) != (ur & 0x7FFFFFFFu)) continue;
        *a = ux == ur ? t.pa[k] : -t.pa[k];
        *b = t.pb[k];
        if (k == 0u) { t.pa[0] = t.pa[1]; t.pb[0] = t.pb[1]; t.pr[0] = t.pr[1]; }
        t.nprod--;
        return 1;
    }
    return 0;
}
#endif

static inline float o1b_hw_add(float a, float b) {
    a = o1b_hw_in(a); b = o1b_hw_in(b);
#if O1B_HW_FAULT == 2
    float pa, pb;
    if (o1b_hw_take_product(a, &pa, &pb)) return o1b_hw_fused(pa, pb, b);
    if (o1b_hw_take_product(b, &pa, &pb)) return o1b_hw_fused(pa, pb, a);
#endif
    float r = a + b;
    return o1b_hw_out(r, o1b_hw_subnormal(r));
}
static inline float o1b_hw_sub(float a, float b) {
    a = o1b_hw_in(a); b = o1b_hw_in(b);
#if O1B_HW_FAULT == 2
    float pa, pb;
    if (o1b_hw_take_product(a, &pa, &pb)) return o1b_hw_fused(pa, pb, -b);
    if (o1b_hw_take_product(b, &pa, &pb)) return o1b_hw_fused(-pa, pb, a);
#endif
    float r = a - b;
    return o1b_hw_out(r, o1b_hw_subnormal(r));
}

static inline float o1b_hw_div(float a, float b) {
    a = o1b_hw_in(a); b = o1b_hw_in(b);
#if O1B_HW_FAULT == 1
    // The double quotient lies within 2^-53 (relative) of a/b, and a/b is either a float or at
    // least 2^-47 away from every float: truncating it truncates a/b (also to FLT_MAX for overflow).
    double d = (double)a / (double)b;
    float r = (float)d;
    if (fabs((double)r) > fabs(d)) r = nextafterf(r, 0.0f);
#else
    float r = a / b;
#endif
    bool tiny = false;
    if ((o1b_hw_bits(r) & 0x7FFFFFFFu) <= 0x00800000u && a != 0.0f && !isinf(b))
        tiny = fabs((double)a) < O1B_HW_MIN_NORMAL * fabs((double)b);
    return o1b_hw_out(r, tiny);
}
// The fused multiply-add instruction (CUDA's __fmaf_rn): one rounding of a*b + c, with the unit's
// flush mode and adversary like add, sub and mul.
static inline float o1b_hw_fma(float a, float b, float c) {
    return o1b_hw_fused(o1b_hw_in(a), o1b_hw_in(b), o1b_hw_in(c));
}

// The fused multiply-add with its own flush (PTX fma.rn.ftz.f32, whatever the unit's mode): subnormal
// inputs are read as zeros of their sign and a tiny result comes back as the zero of its sign (the
// sign of the exact value, which the rounded value keeps), as the PTX ISA specifies for .ftz. What
// the ISA leaves open is when a result is tiny: an exact value below 2^-126 that rounds to 2^-126 comes
// back as 2^-126 where tininess is detected after rounding (O1B_HW_FTZ 0 or 1) and as the zero where
// before (O1B_HW_FTZ 2); the adversary picks one of the two per operation. The flush_unsigned fault
// returns +0 for every tiny result, as for the other operations.
static inline float o1b_hw_ftz_in(float x) {
    unsigned int u = o1b_hw_bits(x);
    return (u & 0x7F800000u) == 0u ? o1b_hw_float(u & 0x80000000u) : x;
}
// A tiny result r of fma.rn.ftz or mul.rn.ftz: 2^-126 kept where it rounded up to it and tininess is
// detected after rounding, else the zero of its sign (the flush_unsigned fault: +0).
static inline float o1b_hw_ftz_tiny_result(float r) {
#if O1B_HW_FAULT == 3
    (void)r;
    return o1b_hw_float(0u);
#else
    unsigned int u = o1b_hw_bits(r);
    bool rounded_up = (u & 0x7FFFFFFFu) == 0x00800000u;
#if O1B_HW_ADVERSARIAL
    bool keep = rounded_up && o1b_hw_choice() == 0u;
#else
    bool keep = rounded_up && (O1B_HW_FTZ) != 2;
#endif
    return keep ? r : o1b_hw_float(u & 0x80000000u);
#endif
}
static inline float o1b_hw_fma_ftz(float a, float b, float c) {
    a = o1b_hw_ftz_in(a); b = o1b_hw_ftz_in(b); c = o1b_hw_ftz_in(c);
    float r = fmaf(a, b, c);
    return o1b_hw_fused_tiny(a, b, c) ? o1b_hw_ftz_tiny_result(r) : r;
}

// PTX mul.rn.ftz.f32 and add.rn.ftz.f32 (contract.cuh's neighbours in cuda/ftz.cuh issue them as inline
// assembly), whatever the unit's mode: subnormal inputs are read as zeros of their sign and a tiny
// result comes back as the zero of its sign, as the PTX ISA specifies for .ftz. For mul the ISA leaves
// open, as for fma.rn.ftz, whether an exact product just below 2^-126 that rounds to 2^-126 is tiny:
// kept where tininess is detected after rounding (O1B_HW_FTZ 0 or 1), the zero where before
// (O1B_HW_FTZ 2), either per operation under the adversary. "Rounds to 2^-126" is decided on the
// subnormal grid, so a few products IEEE's after-rounding rule (24 bits, exponent unbounded) would
// still call tiny are kept too: the harder case for a guard. A tiny sum is exact, so add has no such
// case. The flush_unsigned fault returns +0 for every tiny result.
static inline float o1b_hw_mul_ftz(float a, float b) {
    a = o1b_hw_ftz_in(a); b = o1b_hw_ftz_in(b);
    float r = a * b;
    double e = (double)a * (double)b;                       // exact
    return e != 0.0 && fabs(e) < O1B_HW_MIN_NORMAL ? o1b_hw_ftz_tiny_result(r) : r;
}
static inline float o1b_hw_add_ftz(float a, float b) {
    a = o1b_hw_ftz_in(a); b = o1b_hw_ftz_in(b);
    float r = a + b;
    if (!o1b_hw_subnormal(r)) return r;
#if O1B_HW_FAULT == 3
    return o1b_hw_float(0u);
#else
    return o1b_hw_float(o1b_hw_bits(r) & 0x80000000u);
#endif
}

// sqrt of a nonzero float is never tiny.
static inline float o1b_hw_sqrt(float x) { return sqrtf(o1b_hw_in(x)); }

#endif
