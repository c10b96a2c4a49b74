/* contract.cuh — the scalar arithmetic of CONTRACT.md (version 1) in CUDA C++.
 *
 * The CUDA twin of cpu_ref/src/contract.h: every kernel in cuda/*.cu is written with these helpers
 * only, so each line of a kernel reads as the contract's formula and equals the C reference bit for
 * bit. The rules (CONTRACT.md §1–§3):
 *   - fp32 values entering an op are never subnormal: loads go through o1b_load (flush) or are
 *     outputs of other helpers, which flush.
 *   - add/sub/mul/div are the round-to-nearest intrinsics __fadd_rn/__fsub_rn/__fmul_rn/__fdiv_rn:
 *     the compiler never contracts them into an FMA, whatever --fmad says.
 *   - a result whose exact value is below 2^-126 in magnitude becomes a zero of the same sign
 *     ("flush before rounding"). CuPy compiles with -ftz=true; these helpers give the same bits with
 *     the single-precision flush mode on or off, and whether the hardware detects tininess before or
 *     after rounding: add/sub flush their result explicitly (a tiny sum is exact, so every mode
 *     agrees), and mul/div re-decide the only ambiguous case, |result| == 2^-126, exactly in double
 *     (the double product of two floats is exact; -ftz=true does not touch double arithmetic). The
 *     sign of a flushed zero comes from the operands, never from the hardware's zero (the emulator's
 *     adversarial flush mode returns either zero, or the IEEE value, for every tiny result).
 *   - NaN leaves an op as 0x7FC00000 (o1b_store at every store to an output array).
 *   - no library math function is called: exp, log, sin, cos are the contract's §4 routines and
 *     sqrt is __fsqrt_rn (IEEE correctly rounded).
 * The emulator (cuda/emu) compiles this same text with g++ and a prelude defining the intrinsics.
 */
#ifndef O1B_CONTRACT_CUH
#define O1B_CONTRACT_CUH

#define O1B_CONTRACT_VERSION 1
#define O1B_NAN_BITS 0x7FC00000u
#define O1B_BF16_NAN ((unsigned short)0x7FC0u)
#define O1B_MIN_NORMAL 0x1p-126f
#define O1B_ROUND_MAGIC 0x1.8p23f   /* t + 1.5*2^23 - 1.5*2^23 rounds t to an integer (|t| < 2^22) */

typedef unsigned short bf16;        /* bf16 is stored as its 16 bits (CONTRACT.md §1) */
typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ u32 o1b_bits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float o1b_from_bits(u32 u) { return __uint_as_float(u); }
__device__ __forceinline__ float o1b_inf(void) { return __uint_as_float(0x7F800000u); }
__device__ __forceinline__ float o1b_nan(void) { return __uint_as_float(O1B_NAN_BITS); }
__device__ __forceinline__ bool o1b_isnan(float x) { return (__float_as_uint(x) & 0x7FFFFFFFu) > 0x7F800000u; }
__device__ __forceinline__ u32 o1b_abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

/* Subnormal -> zero of the same sign; everything else unchanged (decided on the bits, so it does
 * not matter whether the hardware would have flushed the comparison operands). */
__device__ __forceinline__ float o1b_flush(float x) {
    u32 u = __float_as_uint(x);
    return (u & 0x7F800000u) == 0u ? __uint_as_float(u & 0x80000000u) : x;
}
__device__ __forceinline__ float o1b_canon(float x) { return o1b_isnan(x) ? o1b_nan() : x; }
__device__ __forceinline__ float o1b_load(float x) { return o1b_flush(x); }
__device__ __forceinline__ float o1b_store(float x) { return o1b_canon(o1b_flush(x)); }

/* ---- conversions (§2) ---- */
__device__ __forceinline__ float o1b_bf16_to_f32(bf16 h) { return o1b_flush(__uint_as_float((u32)h << 16)); }
__device__ __forceinline__ bf16 o1b_f32_to_bf16(float x) {
    u32 u = __float_as_uint(o1b_flush(x));
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return O1B_BF16_NAN;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}
/* int32 -> fp32: exact for |i| <= 2^24, the only uses in the contract. */
__device__ __forceinline__ float o1b_i2f(int i) { return o1b_flush(__int2float_rn(i)); }

/* ---- the primitive operations (§3) ---- */
/* r = the hardware sum of operands with bits ua, ub. A subnormal sum of two normals is exact:
 * flushing the IEEE result is flushing the exact value. The sign of that zero must not depend on the
 * hardware's own flushing (a flushing unit might return a zero of either sign for a tiny sum), so a
 * zero result is re-signed from the operands: an exact zero (b = -a, or two zeros) keeps the IEEE
 * sign the hardware gives; a tiny nonzero sum has the sign of the operand of larger magnitude. */
__device__ __forceinline__ float o1b_signed_sum(float r, u32 ua, u32 ub) {
    u32 ur = __float_as_uint(r);
    if ((ur & 0x7F800000u) != 0u) return r;                                   /* normal, inf, NaN */
    if ((ur & 0x7FFFFFFFu) != 0u) return __uint_as_float(ur & 0x80000000u);   /* subnormal: flush */
    if ((ua ^ ub) == 0x80000000u || ((ua | ub) & 0x7FFFFFFFu) == 0u) return r;
    return __uint_as_float(((ua & 0x7FFFFFFFu) > (ub & 0x7FFFFFFFu) ? ua : ub) & 0x80000000u);
}
__device__ __forceinline__ float o1b_add(float a, float b) {
    return o1b_signed_sum(__fadd_rn(a, b), __float_as_uint(a), __float_as_uint(b));
}
__device__ __forceinline__ float o1b_sub(float a, float b) {
    return o1b_signed_sum(__fsub_rn(a, b), __float_as_uint(a), __float_as_uint(b) ^ 0x80000000u);
}
__device__ __forceinline__ float o1b_neg(float a) { return __uint_as_float(__float_as_uint(a) ^ 0x80000000u); }

/* level(t) of §6.9 for a finite t: clamp to [-qmax, qmax] (127; 31 or 7 on the simulated int6 / int4
 * paths), then round to nearest, ties to even, by the magic constant (|t| < qmax <= 127 < 2^22). */
__device__ __forceinline__ signed char o1b_level(float t, int qmax) {
    float qf = __int2float_rn(qmax);                            /* exact */
    if (t >= qf) return (signed char)qmax;
    if (t <= -qf) return (signed char)-qmax;
    return (signed char)__float2int_rz(o1b_sub(o1b_add(t, O1B_ROUND_MAGIC), O1B_ROUND_MAGIC));
}

/* r = the hardware result of a*b (or a/b). If |r| < 2^-126 (zero, or a subnormal with FTZ off) the
 * exact value is below 2^-126 too: the zero of its sign, the operands' (a flushing unit might lose
 * the sign of a tiny result; r is never NaN here). If |r| == 2^-126 the exact value may lie
 * just below it (IEEE and FTZ-after-rounding round it up; FTZ-before-rounding gives 0, which the
 * first case handles): decided in double, where both sides are exact. Same decisions as the C
 * reference's o1b_mul_tiny / o1b_div_tiny. */
__device__ __noinline__ float o1b_mul_tiny(float a, float b, float r) {
    u32 sign = (__float_as_uint(a) ^ __float_as_uint(b)) & 0x80000000u;
    if (o1b_abs_bits(r) < 0x00800000u) return __uint_as_float(sign);
    double e = __dmul_rn((double)a, (double)b);                 /* exact: 24 + 24 bits */
    return (e < 0x1p-126 && e > -0x1p-126) ? __uint_as_float(sign) : r;
}
__device__ __forceinline__ float o1b_mul(float a, float b) {
    float r = __fmul_rn(a, b);
    return o1b_abs_bits(r) <= 0x00800000u ? o1b_mul_tiny(a, b, r) : r;
}
__device__ __noinline__ float o1b_div_tiny(float a, float b, float r) {
    u32 sign = (__float_as_uint(a) ^ __float_as_uint(b)) & 0x80000000u;
    if (o1b_abs_bits(r) < 0x00800000u) return __uint_as_float(sign);
    /* |a/b| < 2^-126  <=>  |a| < 2^-126 |b|, both sides exact in double */
    double da = (double)__uint_as_float(o1b_abs_bits(a)), db = (double)__uint_as_float(o1b_abs_bits(b));
    return da < __dmul_rn(0x1p-126, db) ? __uint_as_float(sign) : r;
}
/* Correctly rounded IEEE division. */
__device__ __forceinline__ float o1b_div(float a, float b) {
    float r = __fdiv_rn(a, b);
    return o1b_abs_bits(r) <= 0x00800000u ? o1b_div_tiny(a, b, r) : r;
}
/* One step acc + a*b of the §6.1 GEMM sum as a single fused multiply-add with the instruction's own
 * flush: PTX fma.rn.ftz.f32, written out so that neither -ftz nor --fmad changes it (the emulator's
 * model: hwfloat.h, o1b_hw_fma_ftz). It equals o1b_add(acc, o1b_mul(a, b)) for bf16 operands only
 * under the FMA tile guard of CONTRACT.md §6.1's implementation notes; linear.cu uses it on tiles
 * that pass the guard and nowhere else. */
__device__ __forceinline__ float o1b_fma_ftz(float a, float b, float acc) {
#ifdef __CUDA_ARCH__
    float r;
    asm("fma.rn.ftz.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(acc));
    return r;
#else
    return emu_fma_rn_ftz(a, b, acc);
#endif
}
/* Correctly rounded IEEE square root; never tiny for a normal input, sqrt(-0) = -0. */
__device__ __forceinline__ float o1b_sqrt(float x) { return o1b_flush(__fsqrt_rn(x)); }
/* max as the written comparison: a NaN in `b` is passed over, a NaN in `a` stays. */
__device__ __forceinline__ float o1b_max(float a, float b) { return b > a ? b : a; }

/* ---- software functions (§4). Taylor coefficients 1/k!, 2/(2k+1), rounded to fp32. ---- */
__device__ __forceinline__ float o1b_exp(float x) {
    if (o1b_isnan(x)) return o1b_nan();
    if (x > 0x1.62e42ep6f) return o1b_inf();                  /* > ln(FLT_MAX) */
    if (x < -0x1.9cp6f) return 0.0f;                          /* < -103: far below 2^-126 */
    float nf = o1b_sub(o1b_add(o1b_mul(x, 0x1.715476p0f), O1B_ROUND_MAGIC), O1B_ROUND_MAGIC);
    int n = __float2int_rz(nf);                               /* nf is an integer: exact */
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
    return o1b_mul(p, __uint_as_float((u32)(n + 127) << 23));
}

__device__ __forceinline__ float o1b_log(float x) {
    u32 u = __float_as_uint(o1b_flush(x));
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return o1b_nan();
    if ((u & 0x7FFFFFFFu) == 0u) return o1b_neg(o1b_inf());   /* log(±0) = -inf */
    if (u >> 31) return o1b_nan();                            /* log(x < 0) = NaN */
    if (u == 0x7F800000u) return o1b_inf();
    int e = (int)(u >> 23) - 127;
    float m = __uint_as_float((u & 0x7FFFFFu) | 0x3F800000u); /* x = m * 2^e, m in [1, 2) */
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
    float t = o1b_add(o1b_mul(s, o1b_add(hfsq, R)), o1b_mul(ef, 0x1.7f7d1cp-20f));
    t = o1b_add(o1b_sub(t, hfsq), f);
    return o1b_add(t, o1b_mul(ef, 0x1.62e4p-1f));
}

/* sin and cos share the reduction x = n*pi/2 + r, pi/2 = P1 + P2 + P3. */
__device__ __forceinline__ float o1b_sincos_reduce(float x, int *q) {
    float nf = o1b_sub(o1b_add(o1b_mul(x, 0x1.45f306p-1f), O1B_ROUND_MAGIC), O1B_ROUND_MAGIC);
    float y = o1b_sub(x, o1b_mul(nf, 0x1.92p0f));
    y = o1b_sub(y, o1b_mul(nf, 0x1.fb4p-12f));
    *q = (__float_as_uint(nf) & 0x7FFFFFFFu) < 0x4F000000u ? (__float2int_rz(nf) & 3) : 0;   /* |nf| >= 2^25 is a multiple of 4 */
    return o1b_sub(y, o1b_mul(nf, 0x1.4442d2p-24f));
}
__device__ __forceinline__ float o1b_sin_poly(float r) {     /* r - r^3/3! + ... + r^9/9! */
    float z = o1b_mul(r, r);
    float p = 0x1.71de3ap-19f;
    p = o1b_add(o1b_mul(p, z), -0x1.a01a02p-13f);
    p = o1b_add(o1b_mul(p, z), 0x1.111112p-7f);
    p = o1b_add(o1b_mul(p, z), -0x1.555556p-3f);
    return o1b_add(r, o1b_mul(o1b_mul(r, z), p));
}
__device__ __forceinline__ float o1b_cos_poly(float r) {     /* 1 - r^2/2! + ... - r^10/10! */
    float z = o1b_mul(r, r);
    float p = -0x1.27e4fcp-22f;
    p = o1b_add(o1b_mul(p, z), 0x1.a01a02p-16f);
    p = o1b_add(o1b_mul(p, z), -0x1.6c16c2p-10f);
    p = o1b_add(o1b_mul(p, z), 0x1.555556p-5f);
    p = o1b_add(o1b_mul(p, z), -0x1p-1f);
    return o1b_add(1.0f, o1b_mul(z, p));
}
__device__ __forceinline__ float o1b_sin(float x) {
    x = o1b_flush(x);
    if (o1b_abs_bits(x) >= 0x7F800000u) return o1b_nan();     /* inf, NaN */
    if (o1b_abs_bits(x) < 0x39800000u) return x;              /* |x| < 2^-12: keeps sin(-0) = -0 */
    int q; float r = o1b_sincos_reduce(x, &q);
    float v = (q & 1) ? o1b_cos_poly(r) : o1b_sin_poly(r);
    return (q & 2) ? o1b_neg(v) : v;
}
__device__ __forceinline__ float o1b_cos(float x) {
    x = o1b_flush(x);
    if (o1b_abs_bits(x) >= 0x7F800000u) return o1b_nan();
    int q; float r = o1b_sincos_reduce(x, &q);
    float v = (q & 1) ? o1b_sin_poly(r) : o1b_cos_poly(r);
    return (q == 1 || q == 2) ? o1b_neg(v) : v;
}
__device__ __forceinline__ float o1b_rsqrt(float x) { return o1b_div(1.0f, o1b_sqrt(x)); }
__device__ __forceinline__ float o1b_sigmoid(float x) { return o1b_div(1.0f, o1b_add(1.0f, o1b_exp(o1b_neg(x)))); }
__device__ __forceinline__ float o1b_silu(float x) { return o1b_mul(x, o1b_sigmoid(x)); }

/* The integer square root of CONTRACT.md §3 (equal to the IEEE sqrt; the C reference exposes it
 * as sqrt_int, so it is here too). */
__device__ __forceinline__ float o1b_sqrt_int(float x) {
    u32 u = __float_as_uint(o1b_flush(x));
    if ((u & 0x7FFFFFFFu) == 0u) return __uint_as_float(u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u || (u >> 31)) return o1b_nan();
    if (u == 0x7F800000u) return __uint_as_float(u);
    int k = (int)(u >> 23) - 150;
    u64 m = (u & 0x7FFFFFu) | 0x800000u;
    int t = ((k - 23) & 1) ? 24 : 23;
    u64 M = m << t, rem = M, res = 0, one = 1ull << 46;
    while (one) {
        if (rem >= res + one) { rem -= res + one; res = (res >> 1) + one; }
        else res >>= 1;
        one >>= 2;
    }
    if (rem > res) res += 1;
    int j = (k - t) / 2;
    return __uint_as_float((u32)((j + 150) << 23) + (u32)res - 0x800000u);
}

/* The integer division of CONTRACT.md §3 (equal to o1b_div; the C reference exposes it as div_int,
 * so it is here too): Q, R = divmod(ma 2^s, mb) of the 24-bit significands. */
__device__ __forceinline__ float o1b_div_int(float a, float b) {
    u32 ua = __float_as_uint(o1b_flush(a)), ub = __float_as_uint(o1b_flush(b));
    u32 sign = (ua ^ ub) & 0x80000000u, xa = ua & 0x7FFFFFFFu, xb = ub & 0x7FFFFFFFu;
    if (xa > 0x7F800000u || xb > 0x7F800000u) return o1b_nan();
    if (xa == 0x7F800000u) return xb == 0x7F800000u ? o1b_nan() : __uint_as_float(sign | 0x7F800000u);
    if (xb == 0x7F800000u) return __uint_as_float(sign);
    if (xb == 0u) return xa == 0u ? o1b_nan() : __uint_as_float(sign | 0x7F800000u);
    if (xa == 0u) return __uint_as_float(sign);
    u64 ma = (xa & 0x7FFFFFu) | 0x800000u, mb = (xb & 0x7FFFFFu) | 0x800000u;
    int s = ma < mb ? 24 : 23;
    u64 Q = (ma << s) / mb, R = (ma << s) % mb;
    int E = (int)(xa >> 23) - (int)(xb >> 23) + 150 - s;
    if (E <= 0) return __uint_as_float(sign);                 /* exact |a/b| < 2^-126: flushed */
    if (E >= 255) return __uint_as_float(sign | 0x7F800000u); /* >= 2^128 */
    if (2 * R > mb) Q += 1;                                   /* nearest; 2R = mb is impossible */
    return __uint_as_float(sign | (((u32)E << 23) + (u32)Q - 0x800000u));
}

/* int32 -> fp32 of any int32 (§6.9 accumulators), round to nearest even by construction: the exact
 * halves hi = floor(acc / 2^16) and lo = acc mod 2^16, one contract add of mul(i2f(hi), 2^16) and
 * i2f(lo) (the C reference's o1b_i2f_acc; equal to __int2float_rn). */
__device__ __forceinline__ float o1b_i2f_acc(int acc) {
    u32 u = (u32)acc;
    int hi = (int)(u >> 16) - (int)((u >> 31) << 16), lo = (int)(u & 0xFFFFu);
    return o1b_add(o1b_mul(o1b_i2f(hi), 65536.0f), o1b_i2f(lo));
}

/* ---- Philox4x32-10 (§5) ---- */
__device__ __forceinline__ void o1b_philox(u32 k0, u32 k1, u32 c[4]) {
    for (int round = 0; round < 10; round++) {
        u32 hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        u32 hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        c[0] = hi1 ^ c[1] ^ k0; c[1] = lo1; c[2] = hi0 ^ c[3] ^ k1; c[3] = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
}
/* The block at (seed, stream, index, sub): key = seed words, counter = (index lo, index hi, stream, sub). */
__device__ __forceinline__ void o1b_philox_block(u64 seed, u32 stream, u64 index, u32 sub, u32 out[4]) {
    out[0] = (u32)index; out[1] = (u32)(index >> 32); out[2] = stream; out[3] = sub;
    o1b_philox((u32)seed, (u32)(seed >> 32), out);
}

/* The global index of this thread in a 1-D launch. */
__device__ __forceinline__ i64 o1b_gid(void) { return (i64)blockIdx.x * (i64)blockDim.x + (i64)threadIdx.x; }

#endif
