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

#endif
