/* ftz.cuh — the hardware flush-to-zero multiply and add (PTX mul.rn.ftz.f32, add.rn.ftz.f32) and the
 * exponent keys of the guards under which attention.cu uses them, and fma.rn.ftz, in place of the
 * contract's software-checked mul and add (CONTRACT.md §6.6 implementation notes, "Hardware
 * flush-to-zero steps"; §6.1's notes for the fused step).
 *
 *   o1b_add_ftz(a, b) = o1b_add(a, b) for every a, b that are not subnormal (no guard);
 *   o1b_mul_ftz(a, b) = o1b_mul(a, b') with b' = §2's flush of b, for a not subnormal, whenever
 *     the exact product of nonzero finite a, b' is not below 2^-126: guaranteed by
 *     o1b_key_lo(a) + o1b_key_lo(b) >= 128 (the "product guard").
 * Both are inline PTX, so neither -ftz nor --fmad changes them; the emulator models them
 * (cuda/emu/prelude.h emu_mul_rn_ftz, emu_add_rn_ftz: metal/emu/hwfloat.h). */
#ifndef O1B_FTZ_CUH
#define O1B_FTZ_CUH
#include "contract.cuh"

__device__ __forceinline__ float o1b_add_ftz(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return emu_add_rn_ftz(a, b);
#endif
}
__device__ __forceinline__ float o1b_mul_ftz(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return emu_mul_rn_ftz(a, b);
#endif
}

/* Exponent keys of a value from its fp32 bits (a bf16 widened by a shift is its fp32 bits): the
 * 8-bit exponent field E, with zeros and subnormals (E = 0, zeros after §2's flush) left out of
 * the ranges — lo 255, hi 0 — and inf/NaN (E = 255) failing every upper bound (hi 1000). A guard
 * takes min lo and max hi over a set of values: with none nonzero, it passes on that side. */
__device__ __forceinline__ int o1b_exp_field(u32 bits) { return (int)((bits >> 23) & 0xFFu); }
__device__ __forceinline__ int o1b_key_lo(u32 bits) { const int e = o1b_exp_field(bits); return e ? e : 255; }
__device__ __forceinline__ int o1b_key_hi(u32 bits) { const int e = o1b_exp_field(bits); return e == 255 ? 1000 : e; }
/* the §6.1 fused-step guard of a row's keys (alo, ahi) against a tile's (blo, bhi) */
__device__ __forceinline__ bool o1b_fma_guard(int alo, int ahi, int blo, int bhi) {
    return alo + blo >= 128 && ahi + bhi <= 380;
}


/* o1b_mul with its rare path (the exact decision at |result| <= 2^-126) inlined instead of called: the
 * same operations, so the same bits; a kernel holding many registers then makes no call in its loops. */
__device__ __forceinline__ float o1b_mul_inl(float a, float b) {
    const float r = __fmul_rn(a, b);
    if (o1b_abs_bits(r) > 0x00800000u) return r;
    const u32 sign = (__float_as_uint(a) ^ __float_as_uint(b)) & 0x80000000u;
    if (o1b_abs_bits(r) < 0x00800000u) return __uint_as_float(sign);
    const double e = __dmul_rn((double)a, (double)b);
    return (e < 0x1p-126 && e > -0x1p-126) ? __uint_as_float(sign) : r;
}

/* exp of §4 (o1b_exp) with the same bits for every input, on the hardware .ftz steps: no step of its
 * reduction and polynomial can be tiny once |x| >= 2^-100, and below that the result is 1 (CONTRACT.md
 * §6.6 implementation notes, "The exponential on hardware steps"); sub(a, b) is written add(a, -b),
 * the same IEEE operation. No call and no per-step check: the kernels' exp is a straight line. */
__device__ __forceinline__ float o1b_exp_ftz(float x) {
    const u32 ax = o1b_abs_bits(x);
    if (ax < 0x0D800000u) return 1.0f;                        /* |x| < 2^-100, zeros, subnormals */
    if (ax > 0x7F800000u) return o1b_nan();
    if (x > 0x1.62e42ep6f) return o1b_inf();
    if (x < -0x1.9cp6f) return 0.0f;
    const float nf = o1b_add_ftz(o1b_add_ftz(o1b_mul_ftz(x, 0x1.715476p0f), O1B_ROUND_MAGIC), -O1B_ROUND_MAGIC);
    const int n = __float2int_rz(nf);
    if (n < -126) return 0.0f;
    const float r = o1b_add_ftz(o1b_add_ftz(x, o1b_neg(o1b_mul_ftz(nf, 0x1.62e4p-1f))),
                                o1b_neg(o1b_mul_ftz(nf, 0x1.7f7d1cp-20f)));
    float p = 0x1.a01a02p-13f;
    p = o1b_add_ftz(o1b_mul_ftz(p, r), 0x1.6c16c2p-10f);
    p = o1b_add_ftz(o1b_mul_ftz(p, r), 0x1.111112p-7f);
    p = o1b_add_ftz(o1b_mul_ftz(p, r), 0x1.555556p-5f);
    p = o1b_add_ftz(o1b_mul_ftz(p, r), 0x1.555556p-3f);
    p = o1b_add_ftz(o1b_mul_ftz(p, r), 0x1p-1f);
    p = o1b_add_ftz(o1b_mul_ftz(p, r), 1.0f);
    p = o1b_add_ftz(o1b_mul_ftz(p, r), 1.0f);
    if (n > 127) return o1b_mul_ftz(o1b_mul_ftz(p, 2.0f), 0x1p127f);
    return o1b_mul_ftz(p, __uint_as_float((u32)(n + 127) << 23));
}

#endif
