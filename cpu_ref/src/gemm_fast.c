/* gemm_fast.c — packed, SIMD kernels for the contract GEMM, bit-identical to o1b_gemm_simple.
 *
 *   C[i,j] (+)= sum_{p=0..P-1} A(i,p) * B(p,j)    p ascending, acc = add(acc, mul(a, b))
 *
 * Why the bits cannot differ from the definition (CONTRACT.md, "The fast GEMM"):
 *   1. Every C element is computed by one SIMD lane of one thread, in the order p = 0, 1, ...,
 *      P-1, with the same operations in the same order: one rounded multiply, one rounded add
 *      (the file is compiled with -ffp-contract=off; the only FMA is the explicit one of 4). The
 *      depth is blocked by KC for the caches, but between blocks the fp32 accumulator is stored
 *      to C and loaded back unchanged, so the sequence of roundings is that of the plain loop.
 *      Threads split output tiles, never the sum, so neither the thread count nor any tile size
 *      enters the arithmetic.
 *   2. The operands are widened bf16 -> fp32 when packed (a 16-bit shift) and flushed there
 *      (o1b_bf16_to_f32). Every product of two such values has at most 8+8 significant bits, so
 *      it is exact in fp32 unless it overflows (inf in both) or its exact value is below 2^-126;
 *      then its rounding "with unbounded exponent" is the exact value too, so hardware
 *      flush-to-zero (x86 FTZ, which detects tininess after rounding, and ARM FZ, before) flushes
 *      exactly the products that o1b_mul flushes, to the same signed zero. A sum of two normals
 *      whose exact value is below 2^-126 is exact, so FTZ flushes exactly the sums that o1b_add
 *      flushes. Inputs are never subnormal (flushed when packed, and DAZ is set besides). So with
 *      FTZ|DAZ (FPCR.FZ) set, a bare `acc + a * b` in a SIMD lane is o1b_add(acc, o1b_mul(a, b)).
 *      The mode is per thread: each worker sets it at the start of its range and restores it.
 *   3. NaN: whether a result is NaN does not depend on the payload, and every NaN is replaced by
 *      0x7FC00000 when the final value is stored; an accumulated C input is flushed when loaded.
 * Padding lanes of edge tiles compute on zeros in a scratch tile and are never stored.
 *   4. The fused step (AVX-512 level, and AVX2 where the CPU has FMA3): a tile of packed A and B
 *      panels over one depth block whose nonzero operands pass CONTRACT.md §6.1's guard
 *      (min E(A) + min E(B) >= 128, max E(A) + max E(B) <= 380, no inf or NaN; E the exponent
 *      field) runs every step as one vfmadd. §6.1 proves that a fused multiply-add with a
 *      sign-preserving flush of a tiny result equals add(acc, mul(a, b)) there; x86 FTZ (set by
 *      the worker, see 2) is that flush: a tiny result becomes the zero of the true result's
 *      sign, and a result below 2^-126 is exact (§6.1), so detecting tininess after rounding
 *      changes nothing. Any other tile takes the separate multiply and add. The exponent ranges
 *      are taken once per packed panel (at the AVX-512 level on the lanes while it is packed).
 *
 * The kernel is written once with GCC/clang vector extensions (the O1B_GEMM_TEMPLATE section at
 * the end of this file, which the file includes again with different parameters) and
 * instantiated per SIMD level: AVX-512F (16 lanes, 12 x 32 tiles), AVX2 (8 lanes, 6 x 16) and the
 * portable one (4 lanes: SSE2 on x86-64, NEON on arm64, 6 x 8). o1b_simd_level() picks one at
 * run time; the AVX functions carry target attributes and the build has no -march flag. Other
 * architectures (no hardware flush mode assumed) return 0 here and use the plain loop.
 *
 * Structure (Goto's): for each block of NC columns, for each KC-deep slice of p, B is packed into
 * NR-wide panels (widened to fp32), then for each MC-row block A is packed into MR-high panels,
 * and the micro-kernel runs each MR x NR tile over the slice with its accumulators in registers.
 * Threads take contiguous ranges of row panels or of column panels (whichever leaves the
 * busiest thread less work, its packing included) and pack their own copies, so no thread waits
 * for another.
 */
#ifndef O1B_GEMM_TEMPLATE

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "contract.h"
#include "gemm.h"
#include "runtime.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define O1B_GEMM_X86 1
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif
#if (defined(__x86_64__) || defined(__aarch64__)) && (defined(__GNUC__) || defined(__clang__))
#define O1B_GEMM_HAVE_FAST 1
#endif

#ifdef O1B_GEMM_HAVE_FAST

#define O1B_KC 512                 /* depth block: the accumulators go through C between blocks */
#ifndef O1B_GEMM_GRAIN
#define O1B_GEMM_GRAIN (1 << 21)   /* mul-adds worth a thread (a build for tests may lower it) */
#endif

typedef struct {
    int64_t I, J, P;
    const bf16 *A; int64_t sa_i, sa_p;
    const bf16 *B; int64_t sb_p, sb_j;
    float *C; int64_t ldc; int accumulate;
    int split_rows;                /* 1: the parallel index runs over row panels, 0: column panels */
} fast_args;

/* The fused path on (1, default) or off (0: every tile multiplies and adds separately), and how
 * many tile steps (tile x depth block) took it, for the tests. */
static int g_gemm_fma = 1;
static _Atomic int64_t g_gemm_fma_tiles;
O1B_API void o1b_set_gemm_fma(int on) { __atomic_store_n(&g_gemm_fma, on, __ATOMIC_RELAXED); }
O1B_API int64_t o1b_gemm_fma_tiles(int reset) {
    return reset ? atomic_exchange(&g_gemm_fma_tiles, 0) : atomic_load(&g_gemm_fma_tiles);
}

/* §6.1's guard inputs for a packed panel of n fp32 values (flushed: a zero exponent field is a
 * zero): the min and max exponent fields of the nonzero values (1000 and 0 when there is none) and
 * whether one is inf or NaN. */
typedef struct { int emin, emax, special; } erange;
static erange panel_range(const uint32_t *v, int64_t n) {
    int emin = 1000, emax = 0, special = 0;
    for (int64_t i = 0; i < n; i++) {
        int e = (int)((v[i] >> 23) & 0xFFu);
        emin = e != 0 && e < emin ? e : emin;
        emax = e > emax ? e : emax;
        special |= e == 0xFF;
    }
    erange r = {emin, emax, special};
    return r;
}
static int fma_guard(erange a, erange b) {
    return !a.special && !b.special && a.emin + b.emin >= 128 && a.emax + b.emax <= 380;
}
static erange range_merge(erange a, erange b) {
    erange r = {a.emin < b.emin ? a.emin : b.emin, a.emax > b.emax ? a.emax : b.emax,
                a.special | b.special};
    return r;
}

/* bf16 bits -> fp32 bits, subnormal -> signed zero (o1b_bf16_to_f32 without the float trip). */
static inline uint32_t widen(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    return (u & 0x7F800000u) ? u : (u & 0x80000000u);
}

/* ---- transposed packing: the source rows run along p (x and W in y = x W^T, dy in dx = dy W).
 * Blocks of 16 x 16 (8 x 8) values are widened and transposed in registers; lanes
 * beyond the panel's m valid rows are zeros, as in the scalar loop. Returns how many p it did. */
#if defined(O1B_GEMM_X86)
#define O1B_AVX512 __attribute__((target("avx512f")))
static inline __attribute__((always_inline)) O1B_AVX512 __m512i widen16_avx512(const bf16 *s) {
    __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)s)), 16);
    __mmask16 normal = _mm512_test_epi32_mask(v, _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_mov_epi32(_mm512_and_si512(v, _mm512_set1_epi32((int)0x80000000u)), normal, v);
}
/* The exponent range of packed values, kept on the lanes while they are packed: vmax the max
 * of the exponent bits (v & 0x7F800000), vmin the min of those bits minus 1 as unsigned (a zero
 * field wraps to the top and drops out). Min and max are exact in any order. */
typedef struct { __m512i vmin, vmax; } vrange512;
static inline __attribute__((always_inline)) O1B_AVX512 vrange512 vrange_init_avx512(void) {
    vrange512 q = {_mm512_set1_epi32(-1), _mm512_setzero_si512()};
    return q;
}
static inline __attribute__((always_inline)) O1B_AVX512 void vrange_add_avx512(vrange512 *q, __m512i v) {
    __m512i e = _mm512_and_si512(v, _mm512_set1_epi32(0x7F800000));
    q->vmax = _mm512_max_epu32(q->vmax, e);
    q->vmin = _mm512_min_epu32(q->vmin, _mm512_sub_epi32(e, _mm512_set1_epi32(1)));
}
static inline __attribute__((always_inline)) O1B_AVX512 erange vrange_end_avx512(vrange512 q) {
    uint32_t lo = (uint32_t)_mm512_reduce_min_epu32(q.vmin) + 1u;
    uint32_t hi = (uint32_t)_mm512_reduce_max_epu32(q.vmax);
    erange r = {lo ? (int)(lo >> 23) : 1000, (int)(hi >> 23), (hi >> 23) == 0xFF};
    return r;
}

/* Returns how many p it did; with q, also the exponent range of what it packed (the padding
 * rows are zeros, which the range leaves out). */
static inline __attribute__((always_inline)) O1B_AVX512 int64_t transpose_avx512(
        uint32_t *d, const bf16 *s, int64_t s_w, int64_t kc, int64_t m, int R, vrange512 *q) {
    int64_t p = 0;
    for (; p + 16 <= kc; p += 16)
        for (int g = 0; g < R; g += 16) {
            __m512i r[16], t[16];
            for (int k = 0; k < 16; k++)
                r[k] = g + k < m ? widen16_avx512(s + (g + k) * s_w + p) : _mm512_setzero_si512();
            if (q)
                for (int k = 0; k < 16; k++) vrange_add_avx512(q, r[k]);
            for (int k = 0; k < 16; k += 2) {
                t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
                t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
            }
            for (int k = 0; k < 16; k += 4) {      /* r[k + c], lane l: rows k..k+3 at p + 4l + c */
                r[k + 0] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
                r[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
                r[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
                r[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
            }
            for (int c = 0; c < 4; c++) {          /* 4 x 4 transpose of 128-bit lanes */
                __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
                __m512i v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
                __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
                __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
                t[c + 0] = _mm512_shuffle_i32x4(v0, v2, 0x88);    /* p + c */
                t[c + 4] = _mm512_shuffle_i32x4(v0, v2, 0xDD);    /* p + 4 + c */
                t[c + 8] = _mm512_shuffle_i32x4(v1, v3, 0x88);    /* p + 8 + c */
                t[c + 12] = _mm512_shuffle_i32x4(v1, v3, 0xDD);   /* p + 12 + c */
            }
            __mmask16 lanes = R - g >= 16 ? 0xFFFF : (__mmask16)((1u << (R - g)) - 1);
            for (int k = 0; k < 16; k++) _mm512_mask_storeu_epi32(d + (p + k) * R + g, lanes, t[k]);
        }
    return p;
}
/* One panel transposed (m valid rows of R): how many p it did, and in *r the exponent range of
 * what it packed when r is given. */
static O1B_AVX512 int64_t transpose_range_avx512(uint32_t *d, const bf16 *s, int64_t s_w, int64_t kc,
                                                 int64_t m, int R, erange *r) {
    if (!r) return transpose_avx512(d, s, s_w, kc, m, R, NULL);
    vrange512 q = vrange_init_avx512();
    int64_t p = transpose_avx512(d, s, s_w, kc, m, R, &q);
    *r = vrange_end_avx512(q);
    return p;
}

/* Twelve contiguous bf16 at s widened into lanes 0..11, zeros above (an A panel's row when the
 * source runs across the rows: dy in dW = dy^T x); reads exactly 24 bytes. */
static inline __attribute__((always_inline)) O1B_AVX512 __m512i widen12_avx512(const bf16 *s) {
    __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)s)),
                                        _mm_loadl_epi64((const __m128i *)(s + 8)), 1);
    __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    __mmask16 normal = _mm512_test_epi32_mask(v, _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_mov_epi32(_mm512_and_si512(v, _mm512_set1_epi32((int)0x80000000u)), normal, v);
}

/* Whole panels of R = 12 or 32 values across, from a source whose panel rows are contiguous
 * runs (s_w == 1): d[p * R + r] = widen(s[p * s_d + r]), one panel at a time, its exponent range
 * into rng[panel] when rng is given. Returns how many values across it packed (whole panels). */
static inline __attribute__((always_inline)) O1B_AVX512 int64_t contig_avx512(
        uint32_t *dst, const bf16 *src, int64_t s_d, int64_t nw, int64_t kc, int R, erange *rng) {
    int64_t w0 = 0;
    if (R != 12 && R != 32) return 0;
    for (; w0 + R <= nw; w0 += R) {
        uint32_t *d = dst + w0 * kc;
        const bf16 *s = src + w0;
        vrange512 q = vrange_init_avx512();
        for (int64_t p = 0; p < kc; p++, s += s_d) {
            if (R == 12) {
                __m512i v = widen12_avx512(s);
                _mm512_mask_storeu_epi32(d + p * 12, 0x0FFF, v);
                if (rng) vrange_add_avx512(&q, v);
            } else {
                __m512i v0 = widen16_avx512(s), v1 = widen16_avx512(s + 16);
                _mm512_storeu_si512(d + p * 32, v0);
                _mm512_storeu_si512(d + p * 32 + 16, v1);
                if (rng) { vrange_add_avx512(&q, v0); vrange_add_avx512(&q, v1); }
            }
        }
        if (rng) rng[w0 / R] = vrange_end_avx512(q);
    }
    return w0;
}
static O1B_AVX512 int64_t contig_pack_avx512(uint32_t *dst, const bf16 *src, int64_t s_d, int64_t nw,
                                             int64_t kc, int R, erange *rng) {
    return R == 12 ? contig_avx512(dst, src, s_d, nw, kc, 12, rng)
         : R == 32 ? contig_avx512(dst, src, s_d, nw, kc, 32, rng) : 0;
}

#define O1B_AVX2 __attribute__((target("avx2")))
static inline __attribute__((always_inline)) O1B_AVX2 __m256i widen8_avx2(const bf16 *s) {
    __m256i v = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)s)), 16);
    __m256i zero = _mm256_cmpeq_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7F800000)),
                                      _mm256_setzero_si256());
    return _mm256_andnot_si256(_mm256_and_si256(zero, _mm256_set1_epi32(0x7FFFFFFF)), v);
}
static O1B_AVX2 int64_t transpose_avx2(uint32_t *d, const bf16 *s, int64_t s_w, int64_t kc,
                                       int64_t m, int R) {
    int64_t p = 0;
    for (; p + 8 <= kc; p += 8)
        for (int g = 0; g < R; g += 8) {
            __m256i r[8], t[8];
            for (int k = 0; k < 8; k++)
                r[k] = g + k < m ? widen8_avx2(s + (g + k) * s_w + p) : _mm256_setzero_si256();
            for (int k = 0; k < 8; k += 2) {
                t[k] = _mm256_unpacklo_epi32(r[k], r[k + 1]);
                t[k + 1] = _mm256_unpackhi_epi32(r[k], r[k + 1]);
            }
            for (int k = 0; k < 8; k += 4) {       /* r[k + c], lane l: rows k..k+3 at p + 4l + c */
                r[k + 0] = _mm256_unpacklo_epi64(t[k], t[k + 2]);
                r[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
                r[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]);
                r[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
            }
            for (int c = 0; c < 4; c++) {
                t[c] = _mm256_permute2x128_si256(r[c], r[4 + c], 0x20);       /* p + c */
                t[c + 4] = _mm256_permute2x128_si256(r[c], r[4 + c], 0x31);   /* p + 4 + c */
            }
            if (R - g >= 8) {
                for (int k = 0; k < 8; k++) _mm256_storeu_si256((__m256i *)(d + (p + k) * R + g), t[k]);
            } else {
                __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(R - g),
                                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                for (int k = 0; k < 8; k++) _mm256_maskstore_epi32((int *)(d + (p + k) * R + g), lanes, t[k]);
            }
        }
    return p;
}
#endif

/* The definition, for a worker that could not get its packing buffers. */
static void rows_cols_simple(const fast_args *g, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1; j++) {
            float acc = g->accumulate ? o1b_load(g->C[i * g->ldc + j]) : 0.0f;
            for (int64_t p = 0; p < g->P; p++) {
                float a = o1b_bf16_to_f32(g->A[i * g->sa_i + p * g->sa_p]);
                float b = o1b_bf16_to_f32(g->B[p * g->sb_p + j * g->sb_j]);
                acc = o1b_add(acc, o1b_mul(a, b));
            }
            g->C[i * g->ldc + j] = o1b_store(acc);
        }
}

/* ---- instantiations: this file again, from its template section ---- */
#define O1B_GEMM_TEMPLATE 1
#if defined(O1B_GEMM_X86)
#define O1B_TGT __attribute__((target("avx512f")))
#define O1B_SFX avx512
#define O1B_W 16
#define O1B_MR 12
#define O1B_NV 2
#define O1B_MC 96
#define O1B_NC 512
#define O1B_BCAST(s) ((vf)_mm512_set1_ps(s))
#define O1B_FMA(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#define O1B_TRANSPOSE_RANGE transpose_range_avx512
#define O1B_CONTIG_RANGE contig_pack_avx512
#include "gemm_fast.c"

/* FMA3 is its own CPUID flag: the AVX2 level's fused path runs only where the CPU reports it. */
static int cpu_has_fma(void) {
    __builtin_cpu_init();          /* idempotent; reads what libgcc's constructor found */
    return __builtin_cpu_supports("fma") != 0;
}

#define O1B_TGT __attribute__((target("avx2,fma")))
#define O1B_SFX avx2
#define O1B_W 8
#define O1B_MR 6
#define O1B_NV 2
#define O1B_MC 96
#define O1B_NC 512
#define O1B_BCAST(s) ((vf)_mm256_set1_ps(s))
#define O1B_FMA(a, b, c) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#define O1B_FMA_OK cpu_has_fma()
#define O1B_TRANSPOSE transpose_avx2
#include "gemm_fast.c"

#define O1B_BCAST(s) ((vf)_mm_set1_ps(s))
#else
#define O1B_BCAST(s) ((vf)vdupq_n_f32(s))
#endif
#define O1B_TGT
#define O1B_SFX portable
#define O1B_W 4
#define O1B_MR 6
#define O1B_NV 2
#define O1B_MC 96
#define O1B_NC 512
#include "gemm_fast.c"

int o1b_gemm_fast(int64_t I, int64_t J, int64_t P, const bf16 *A, int64_t sa_i, int64_t sa_p,
                  const bf16 *B, int64_t sb_p, int64_t sb_j, float *C, int64_t ldc, int accumulate) {
    if (I <= 0 || J <= 0 || P <= 0) return 0;          /* nothing to sum: the plain loop */
    fast_args g = {I, J, P, A, sa_i, sa_p, B, sb_p, sb_j, C, ldc, accumulate, 1};
    int level = o1b_simd_level();
#if defined(O1B_GEMM_X86)
    if (level >= 2) { run_avx512(&g); return 1; }
    if (level >= 1) { run_avx2(&g); return 1; }
#endif
    (void)level;
    run_portable(&g);
    return 1;
}

#else  /* no hardware flush mode to rely on: the plain loop */
int o1b_gemm_fast(int64_t I, int64_t J, int64_t P, const bf16 *A, int64_t sa_i, int64_t sa_p,
                  const bf16 *B, int64_t sb_p, int64_t sb_j, float *C, int64_t ldc, int accumulate) {
    (void)I; (void)J; (void)P; (void)A; (void)sa_i; (void)sa_p; (void)B; (void)sb_p; (void)sb_j;
    (void)C; (void)ldc; (void)accumulate;
    return 0;
}
#endif

#else /* O1B_GEMM_TEMPLATE: one SIMD level's micro-kernel and driver.
       * Parameters: O1B_SFX name suffix, O1B_TGT function attribute, O1B_W lanes, O1B_MR rows x
       * O1B_NV vectors per tile, O1B_MC rows per packed A block, O1B_NC columns per packed B
       * block, O1B_BCAST(s) a vector of W copies of s. */

#define O1B_CAT2(a, b) a##_##b
#define O1B_CAT(a, b) O1B_CAT2(a, b)
#define FN(name) O1B_CAT(name, O1B_SFX)
#define NR (O1B_W * O1B_NV)
#define MC (O1B_MC / O1B_MR * O1B_MR)   /* whole panels per block */
#define NC (O1B_NC / NR * NR)

typedef float FN(vf_t) __attribute__((vector_size(O1B_W * 4)));
typedef int32_t FN(vi_t) __attribute__((vector_size(O1B_W * 4)));
#define vf FN(vf_t)
#define vi FN(vi_t)

/* The first `rows` rows (MR, or fewer for the last row panel) of an MR x NR tile of C over kc
 * steps of p: a is the packed A panel (kc x MR), b the packed B panel (kc x NR). load_c: start
 * from C (the accumulated input, or the partial sum of the previous depth blocks); flush_c: flush
 * C as it is loaded (the accumulate input); final: store with the NaN canonicalized. */
static inline __attribute__((always_inline)) O1B_TGT void FN(tile)(
        int64_t kc, const float *restrict a, const float *restrict b, float *restrict c, int64_t ldc,
        int load_c, int flush_c, int final, int fused, const int rows) {
    vf acc[O1B_MR][O1B_NV];
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int v = 0; v < O1B_NV; v++) {
            if (load_c) {
                vf x;
                memcpy(&x, c + r * ldc + v * O1B_W, sizeof x);
                if (flush_c) {
                    vi u = (vi)x;
                    vi sub = (u & 0x7F800000) == 0;             /* -1 where subnormal or zero */
                    x = (vf)(u & (~sub | (int32_t)0x80000000));    /* keep the sign only */
                }
                acc[r][v] = x;
            } else {
                acc[r][v] = (vf){0};
            }
        }
#ifdef O1B_FMA
    if (fused) {                            /* the tile passed §6.1's guard: one vfmadd a step */
        for (int64_t p = 0; p < kc; p++) {
            vf bv[O1B_NV];
#pragma GCC unroll 4
            for (int v = 0; v < O1B_NV; v++) memcpy(&bv[v], b + p * NR + v * O1B_W, sizeof(vf));
#pragma GCC unroll 16
            for (int r = 0; r < rows; r++) {
                vf av = O1B_BCAST(a[p * O1B_MR + r]);
#pragma GCC unroll 4
                for (int v = 0; v < O1B_NV; v++) acc[r][v] = O1B_FMA(av, bv[v], acc[r][v]);
            }
        }
    } else
#endif
    for (int64_t p = 0; p < kc; p++) {
        vf bv[O1B_NV];
#pragma GCC unroll 4
        for (int v = 0; v < O1B_NV; v++) memcpy(&bv[v], b + p * NR + v * O1B_W, sizeof(vf));
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            vf av = O1B_BCAST(a[p * O1B_MR + r]);
#pragma GCC unroll 4
            for (int v = 0; v < O1B_NV; v++) acc[r][v] = acc[r][v] + av * bv[v];  /* mul, then add */
        }
    }
    (void)fused;
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int v = 0; v < O1B_NV; v++) {
            vf x = acc[r][v];
            if (final) {
                vi nan_lanes = x != x;
                x = (vf)(((vi)x & ~nan_lanes) | (nan_lanes & (int32_t)O1B_NAN_BITS));
            }
            memcpy(c + r * ldc + v * O1B_W, &x, sizeof x);
        }
}

static O1B_TGT void FN(kernel)(int64_t kc, const float *restrict a, const float *restrict b,
                               float *restrict c, int64_t ldc, int load_c, int flush_c, int final,
                               int fused) {
    FN(tile)(kc, a, b, c, ldc, load_c, flush_c, final, fused, O1B_MR);
}
/* A last row panel with at most 4 (8) valid rows computes 4 (8) rows, not MR; each row's lanes do
 * what they do in the full kernel. */
static O1B_TGT void FN(kernel4)(int64_t kc, const float *restrict a, const float *restrict b,
                                float *restrict c, int64_t ldc, int load_c, int flush_c, int final,
                                int fused) {
    FN(tile)(kc, a, b, c, ldc, load_c, flush_c, final, fused, 4);
}
static O1B_TGT void FN(kernel8)(int64_t kc, const float *restrict a, const float *restrict b,
                                float *restrict c, int64_t ldc, int load_c, int flush_c, int final,
                                int fused) {
    FN(tile)(kc, a, b, c, ldc, load_c, flush_c, final, fused, O1B_MR < 8 ? O1B_MR : 8);
}

/* panel_range at this level's width: the min of the nonzero exponent fields (a zero field
 * counts as 1000) and the max, lane by lane and then across the lanes; a max of 255 is an inf
 * or NaN. Min and max are exact in any order, so the result is panel_range's. */
static O1B_TGT erange FN(range)(const uint32_t *v, int64_t n) {
    vi vmin = (vi){0} + 1000, vmax = (vi){0};
    int64_t i = 0;
    for (; i + O1B_W <= n; i += O1B_W) {
        vi u;
        memcpy(&u, v + i, sizeof u);
        vi e = (u >> 23) & 0xFF;
        vi lo = e | ((e == 0) & 1000);
        vi lt = lo < vmin, gt = e > vmax;
        vmin = (lo & lt) | (vmin & ~lt);
        vmax = (e & gt) | (vmax & ~gt);
    }
    int emin = 1000, emax = 0;
    for (int l = 0; l < O1B_W; l++) {
        emin = vmin[l] < emin ? vmin[l] : emin;
        emax = vmax[l] > emax ? vmax[l] : emax;
    }
    erange r = panel_range(v + i, n - i);
    r.emin = r.emin < emin ? r.emin : emin;
    r.emax = r.emax > emax ? r.emax : emax;
    r.special |= emax == 0xFF;
    return r;
}

/* Pack an (nw x kc) block of an operand into panels R values across and kc deep:
 *   dst[(w / R) * kc * R + p * R + w % R] = widen(src[w * s_w + p * s_d]),  zeros for w >= nw,
 * and, when rng is given, each panel's exponent range (panel_range) into rng[w / R].
 * src points at element (w, p) = (0, 0) of the block. Called with a constant R, so the inner
 * loops are unrolled and vectorized for this level's target. */
static inline __attribute__((always_inline)) O1B_TGT void FN(pack)(
        uint32_t *restrict dst, const bf16 *restrict src, int64_t s_w, int64_t s_d, int64_t nw,
        int64_t kc, const int R, erange *rng) {
    int64_t full = nw / R * R, rn = nw - full, ranged = 0;
    if (s_w == 1) {                     /* each p is a contiguous run across the block */
        int64_t w1 = 0;                 /* whole panels packed (and ranged) already */
#ifdef O1B_CONTIG_RANGE
        w1 = O1B_CONTIG_RANGE(dst, src, s_d, full, kc, R, rng);
        ranged = w1;
#endif
        for (int64_t p = 0; p < kc; p++) {
            const bf16 *sp = src + p * s_d;
            for (int64_t w0 = w1; w0 < full; w0 += R) {
                uint32_t *dp = dst + w0 * kc + p * R;
                for (int r = 0; r < R; r++) dp[r] = widen(sp[w0 + r]);
            }
            if (rn) {
                uint32_t *dp = dst + full * kc + p * R;
                for (int r = 0; r < R; r++) dp[r] = r < rn ? widen(sp[full + r]) : 0;
            }
        }
    } else {
        for (int64_t w0 = 0; w0 < nw; w0 += R) {   /* one panel at a time, source rows along p */
            int64_t m = nw - w0 < R ? nw - w0 : R;
            uint32_t *d = dst + w0 * kc;
            const bf16 *s = src + w0 * s_w;
            int64_t p0 = 0;
#if defined(O1B_TRANSPOSE_RANGE)
            if (s_d == 1) {
                erange head;
                p0 = O1B_TRANSPOSE_RANGE(d, s, s_w, kc, m, R, rng ? &head : NULL);
                for (int64_t p = p0; p < kc; p++)
                    for (int r = 0; r < R; r++) d[p * R + r] = r < m ? widen(s[r * s_w + p * s_d]) : 0;
                if (rng) rng[w0 / R] = range_merge(head, FN(range)(d + p0 * R, (kc - p0) * R));
                continue;
            }
#elif defined(O1B_TRANSPOSE)
            if (s_d == 1) p0 = O1B_TRANSPOSE(d, s, s_w, kc, m, R);
#endif
            for (int64_t p = p0; p < kc; p++)
                for (int r = 0; r < R; r++) d[p * R + r] = r < m ? widen(s[r * s_w + p * s_d]) : 0;
            if (rng) rng[w0 / R] = FN(range)(d, kc * R);
        }
        return;
    }
    if (rng)                            /* the panels not ranged while packed */
        for (int64_t w0 = ranged; w0 < nw; w0 += R) rng[w0 / R] = FN(range)(dst + w0 * kc, kc * R);
}
static O1B_TGT void FN(pack_a)(uint32_t *dst, const bf16 *src, int64_t s_w, int64_t s_d,
                               int64_t nw, int64_t kc, erange *rng) {
    FN(pack)(dst, src, s_w, s_d, nw, kc, O1B_MR, rng);
}
static O1B_TGT void FN(pack_b)(uint32_t *dst, const bf16 *src, int64_t s_w, int64_t s_d,
                               int64_t nw, int64_t kc, erange *rng) {
    FN(pack)(dst, src, s_w, s_d, nw, kc, NR, rng);
}

/* Rows [i0, i1) x columns [j0, j1) of C, every p. */
static void FN(block)(const fast_args *g, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    int64_t mc_max = MC < i1 - i0 ? MC : (i1 - i0 + O1B_MR - 1) / O1B_MR * O1B_MR;
    int64_t nc_max = NC < j1 - j0 ? NC : (j1 - j0 + NR - 1) / NR * NR;
    int64_t kc_max = O1B_KC < g->P ? O1B_KC : g->P;
    uint32_t *pa = aligned_alloc(64, (size_t)(mc_max * kc_max * 4 + 64) / 64 * 64);
    uint32_t *pb = aligned_alloc(64, (size_t)(nc_max * kc_max * 4 + 64) / 64 * 64);
    if (!pa || !pb) {
        free(pa); free(pb);
        rows_cols_simple(g, i0, i1, j0, j1);
        return;
    }
    float tile[O1B_MR * NR] __attribute__((aligned(64))) = {0};
    erange ra[MC / O1B_MR], rb[NC / NR];
#if defined(O1B_FMA) && defined(O1B_FMA_OK)
    const int use_fma = __atomic_load_n(&g_gemm_fma, __ATOMIC_RELAXED) && O1B_FMA_OK;
#elif defined(O1B_FMA)
    const int use_fma = __atomic_load_n(&g_gemm_fma, __ATOMIC_RELAXED);
#else
    const int use_fma = 0;
#endif
    int64_t fused_tiles = 0;
    for (int64_t jc = j0; jc < j1; jc += NC) {
        int64_t nc = j1 - jc < NC ? j1 - jc : NC;
        for (int64_t pc = 0; pc < g->P; pc += O1B_KC) {
            int64_t kc = g->P - pc < O1B_KC ? g->P - pc : O1B_KC;
            int load_c = g->accumulate || pc > 0, flush_c = g->accumulate && pc == 0;
            int final = pc + kc == g->P;
            FN(pack_b)(pb, g->B + pc * g->sb_p + jc * g->sb_j, g->sb_j, g->sb_p, nc, kc,
                       use_fma ? rb : NULL);
            for (int64_t ic = i0; ic < i1; ic += MC) {
                int64_t mc = i1 - ic < MC ? i1 - ic : MC;
                FN(pack_a)(pa, g->A + ic * g->sa_i + pc * g->sa_p, g->sa_i, g->sa_p, mc, kc,
                           use_fma ? ra : NULL);
                for (int64_t jr = 0; jr < nc; jr += NR) {
                    int64_t nr = nc - jr < NR ? nc - jr : NR;
                    const float *bp = (const float *)(pb + jr * kc);
                    for (int64_t ir = 0; ir < mc; ir += O1B_MR) {
                        int64_t mr = mc - ir < O1B_MR ? mc - ir : O1B_MR;
                        const float *ap = (const float *)(pa + ir * kc);
                        float *c = g->C + (ic + ir) * g->ldc + (jc + jr);
                        int fused = use_fma && fma_guard(ra[ir / O1B_MR], rb[jr / NR]);
                        fused_tiles += fused;
                        if (mr == O1B_MR && nr == NR) {
                            FN(kernel)(kc, ap, bp, c, g->ldc, load_c, flush_c, final, fused);
                        } else {                      /* edge tile: through the scratch tile */
                            if (load_c)
                                for (int64_t r = 0; r < mr; r++)
                                    memcpy(tile + r * NR, c + r * g->ldc, (size_t)nr * 4);
                            if (mr <= 4 && O1B_MR > 4)
                                FN(kernel4)(kc, ap, bp, tile, NR, load_c, flush_c, final, fused);
                            else if (mr <= 8 && O1B_MR > 8)
                                FN(kernel8)(kc, ap, bp, tile, NR, load_c, flush_c, final, fused);
                            else
                                FN(kernel)(kc, ap, bp, tile, NR, load_c, flush_c, final, fused);
                            for (int64_t r = 0; r < mr; r++)
                                memcpy(c + r * g->ldc, tile + r * NR, (size_t)nr * 4);
                        }
                    }
                }
            }
        }
    }
    if (fused_tiles) atomic_fetch_add(&g_gemm_fma_tiles, fused_tiles);
    free(pa); free(pb);
}

static void FN(worker)(void *ctx, int64_t lo, int64_t hi) {
    const fast_args *g = (const fast_args *)ctx;
    o1b_fpmode mode = o1b_fpmode_ftz();                /* per thread; restored below */
    if (g->split_rows) {
        int64_t i1 = hi * O1B_MR < g->I ? hi * O1B_MR : g->I;
        FN(block)(g, lo * O1B_MR, i1, 0, g->J);
    } else {
        int64_t j1 = hi * NR < g->J ? hi * NR : g->J;
        FN(block)(g, 0, g->I, lo * NR, j1);
    }
    o1b_fpmode_restore(mode);
}

/* The work of the busiest thread when the parallel index runs over row panels (split_rows) or
 * column panels, in multiply-adds per p: its tiles, plus its packing (each thread packs the B
 * columns and the A rows of its own range, A once per NC columns), a packed value counted as
 * O1B_W multiply-adds (about the ratio of their costs). *grain: the parallel_for grain. */
static int64_t FN(split_cost)(const fast_args *g, int split_rows, int64_t nt, int64_t *grain) {
    int64_t n = split_rows ? (g->I + O1B_MR - 1) / O1B_MR : (g->J + NR - 1) / NR;
    int64_t per_unit = (split_rows ? O1B_MR * g->J : NR * g->I) * g->P;
    *grain = 1 + (int64_t)O1B_GEMM_GRAIN / (per_unit > 0 ? per_unit : 1);
    int64_t threads = n / *grain < nt ? n / *grain : nt;
    if (threads < 1) threads = 1;
    int64_t units = (n + threads - 1) / threads;
    int64_t rows = split_rows ? units * O1B_MR : g->I, cols = split_rows ? g->J : units * NR;
    if (rows > g->I) rows = g->I;
    if (cols > g->J) cols = g->J;
    return rows * cols + O1B_W * (cols + rows * ((cols + NC - 1) / NC));
}

static void FN(run)(fast_args *g) {
    int64_t nt = o1b_get_num_threads(), grain_rows, grain_cols;
    /* Split the way that leaves the busiest thread the least work; rows on a tie. */
    int64_t by_rows = FN(split_cost)(g, 1, nt, &grain_rows);
    int64_t by_cols = FN(split_cost)(g, 0, nt, &grain_cols);
    g->split_rows = by_rows <= by_cols;
    int64_t n = g->split_rows ? (g->I + O1B_MR - 1) / O1B_MR : (g->J + NR - 1) / NR;
    o1b_parallel_for(n, g->split_rows ? grain_rows : grain_cols, FN(worker), g);
}

#undef vf
#undef vi
#undef NR
#undef MC
#undef NC
#undef FN
#undef O1B_TGT
#undef O1B_SFX
#undef O1B_W
#undef O1B_MR
#undef O1B_NV
#undef O1B_MC
#undef O1B_NC
#undef O1B_BCAST
#undef O1B_FMA
#undef O1B_FMA_OK
#undef O1B_TRANSPOSE
#undef O1B_TRANSPOSE_RANGE
#undef O1B_CONTIG_RANGE
#endif
