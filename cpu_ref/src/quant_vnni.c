/* quant_vnni.c — the int8 quantized linear layer (CONTRACT.md §6.9) on AVX-512 VNNI: the same
 * values as the portable code in quant.c, computed in fewer passes.
 *
 * Why the bits are those of quant.c (and of the numpy spec the tests hold both to):
 *   - Integer work is exact in any order: the int8 GEMM (vpdpbusd, with A offset by +128 into u8
 *     and 128·colsum(B) subtracted per column, exact modulo 2^32), the integer Hadamard
 *     rotations (done in int16: every intermediate is at most 127·QB = 16256 in magnitude), the
 *     absmax reductions (a max is exact in any order) and the column sums.
 *   - Every fp32 value is the contract primitive of the same operands in the same order, one
 *     SIMD lane per element:
 *       * all vector arithmetic runs under hardware FTZ|DAZ, set by the task runner for its
 *         workers and restored after. DAZ reads a subnormal operand as a zero of its sign,
 *         which is the contract's flushed load. A butterfly's sum or difference of two
 *         flushed values is exact when it is subnormal, so FTZ flushes exactly what
 *         o1b_add/o1b_sub flush, to the same signed zero. Products are `vmul`: the product
 *         under FTZ, which can differ from o1b_mul only when it is exactly ±2^-126 (the exact
 *         product may lie just below, where the contract flushes); such lanes are recomputed
 *         by the scalar o1b_mul (vmul_n tests a batch of products at once and then redoes the
 *         batch with vmul). The rotation stages run in the contract's order
 *         h = 1, 2, ..., 64; within a stage the butterflies are independent, so grouping them
 *         (in-register for h < 16 along a row; across rows, stages 1-8 on sixteen consecutive
 *         rows and then 16-64 on rows sixteen apart, or three radix-8 passes in int16) changes
 *         nothing. add(u, v) is taken as u + v or v + u, which IEEE gives identically except
 *         for NaN payloads; a NaN anywhere makes the tensor's scale NaN and every q zero. The
 *         in-register butterflies take u + v and u - v as fma(u, +1, v) and fma(v, -1, u):
 *         the product by ±1 is exact, so the one rounding (and flush) is the sum's.
 *       * i2f of an accumulator is vcvtdq2ps (round to nearest even); level() is the clamp and
 *         the 1.5·2^23 rounding of quant.c's qrne; stores flush and canonicalize NaN.
 *   - Every reduction that fixes an order (the weight row sums, k ascending) runs in that
 *     order in one lane. Work is split into tasks handed out dynamically to the threads; a
 *     task writes only its own outputs, so neither the thread count nor the schedule matters.
 *
 * Structure (x (N, K), W (M, K), dy (N, M); packed operands as in the GEMM notes below):
 *   forward   F1: weight row sums -> s_w, q_w packed as the GEMM's B with column sums;
 *                 absmax of x.
 *             F2: per chunk of rows: x quantized straight into the packed A, then the GEMM over
 *                 all of B with the dequantization in its epilogue (no int32 matrix in memory).
 *   backward  B1: s_w, q_w, clip marks; absmax of x.
 *             B2: per block of 128 rows of dy: absmax of G = rot_m(dy · s_w) (rows rotated in
 *                 registers, not stored), then of D = rot_n(dy) (128 x 16 strips in L1, the
 *                 block's rows still in L2); R = rot_m(q_w) and X = rot_n(q_x) in int16,
 *                 stored by 32-column strips (B's panels), with their absmax.
 *             B3: R and X quantized and packed as B operands with their column sums; per
 *                 block of 128 rows of dy: G recomputed and quantized into the dx GEMM's A,
 *                 then D recomputed (the rows still in L2), quantized and transposed into the
 *                 dW GEMM's A.
 *             B4: the dx and dW GEMMs (epilogues with the dequantization, dW's with the clip
 *                 marks), side by side.
 *   held weights (o1b_qweights_new_vnni; cpu_ref.weights_held over a training step's
 *             microbatches): F1's weight part and B1-B3's (s_w, q_w packed, clip marks, R packed
 *             with its scale) computed once, by the same functions, and passed to later calls
 *             (pw), which then skip them.
 */
#define _GNU_SOURCE   /* MADV_HUGEPAGE (the scratch arena's hint), which -std=c11 hides otherwise */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "contract.h"
#include "quant.h"
#include "runtime.h"

#if defined(O1B_Q_X86)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define INL static inline __attribute__((always_inline)) TGT

#define MR 8            /* GEMM tile: MR rows x 32 columns (two zmm accumulators per row) */
#define NR 32
#define UNROLL _Pragma("GCC unroll 16")   /* small fixed loops over register arrays: unrolled, so that the arrays stay in registers */
#define RUN_GRAIN 40000 /* rough element-operations worth waking a thread for */

int o1b_q_vnni_available(void) {
    __builtin_cpu_init();
    return o1b_simd_level() >= 2 && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
}

/* ------------------------------------------------------------------ profile (measurement only) */
/* With o1b_q_profile(1), the layer's calls (not the held weights' set-up) add up, per phase, the
 * wall time of its parallel run and the time its tasks ran (summed over the threads), and per pass
 * the time its pieces ran: where a call's time goes on this machine (benchmarks/int8_bench.py
 * --phases). A pass's pieces run inside its phase's tasks, so their times are part of that
 * phase's task time. Off by default; no value computed depends on it. */
enum { QP_F1, QP_F2, QP_B1, QP_B2, QP_B3, QP_B4, QP_N };
enum { QT_F_WEIGHTS, QT_F_XMAX, QT_F_QUANT, QT_F_GEMM,
       QT_B_WEIGHTS, QT_B_XMAX, QT_B_GMAX, QT_B_DMAX, QT_B_ROT_W, QT_B_ROT_X,
       QT_B_DX_FILL, QT_B_DW_FILL, QT_B_PACK_W, QT_B_PACK_X, QT_B_DX_GEMM, QT_B_DW_GEMM, QT_N };
static atomic_int g_qprof;
static atomic_ullong g_qp_calls[2], g_qp_call_wall[2], g_qp_wall[QP_N], g_qp_twall[QP_N], g_qp_busy[QP_N],
                     g_qt_busy[QT_N];
O1B_API void o1b_q_profile(int on) { atomic_store(&g_qprof, on != 0); }
O1B_API void o1b_q_profile_reset(void) {
    for (int i = 0; i < 2; i++) { atomic_store(&g_qp_calls[i], 0); atomic_store(&g_qp_call_wall[i], 0); }
    for (int i = 0; i < QP_N; i++) {
        atomic_store(&g_qp_wall[i], 0); atomic_store(&g_qp_twall[i], 0); atomic_store(&g_qp_busy[i], 0);
    }
    for (int i = 0; i < QT_N; i++) atomic_store(&g_qt_busy[i], 0);
}
/* out: forward calls, backward calls, the forward's and the backward's wall time, QP_N phase walls,
 * QP_N phase walls times the threads each run used, QP_N phase task times, QT_N pass times
 * (nanoseconds), as far as n allows; returns how many values there are. */
O1B_API int o1b_q_profile_read(uint64_t *out, int n) {
    uint64_t v[4 + 3 * QP_N + QT_N];
    int k = 0;
    for (int i = 0; i < 2; i++) v[k++] = atomic_load(&g_qp_calls[i]);
    for (int i = 0; i < 2; i++) v[k++] = atomic_load(&g_qp_call_wall[i]);
    for (int i = 0; i < QP_N; i++) v[k++] = atomic_load(&g_qp_wall[i]);
    for (int i = 0; i < QP_N; i++) v[k++] = atomic_load(&g_qp_twall[i]);
    for (int i = 0; i < QP_N; i++) v[k++] = atomic_load(&g_qp_busy[i]);
    for (int i = 0; i < QT_N; i++) v[k++] = atomic_load(&g_qt_busy[i]);
    for (int i = 0; i < k && i < n; i++) out[i] = v[i];
    return k;
}
static int qp_on(void) { return atomic_load_explicit(&g_qprof, memory_order_relaxed); }
/* a piece's start (0: not timed) and its end, added to counter c */
static uint64_t qp_start(int timed) { return timed ? o1b_now_ns() : 0; }
static void qp_add(atomic_ullong *c, uint64_t t0) {
    if (t0) atomic_fetch_add_explicit(c, o1b_now_ns() - t0, memory_order_relaxed);
}

/* ------------------------------------------------------------------ tasks */
typedef void (*task_fn)(void *ctx, int64_t t);
typedef struct { atomic_llong next; int64_t n; task_fn fn; void *ctx; int phase; } runner;
static void run_worker(void *p, int64_t lo, int64_t hi) {
    runner *r = (runner *)p;
    (void)lo; (void)hi;
    o1b_fpmode m = o1b_fpmode_ftz();
    for (;;) {
        long long t = atomic_fetch_add_explicit(&r->next, 1, memory_order_relaxed);
        if (t >= r->n) break;
        uint64_t t0 = qp_start(r->phase >= 0);
        r->fn(r->ctx, (int64_t)t);
        if (t0) qp_add(&g_qp_busy[r->phase], t0);
    }
    o1b_fpmode_restore(m);
}
/* Tasks 0 .. n-1, each run once by some thread; `work` (element operations, roughly) decides
 * how many threads are worth it. phase: the profile's phase timed (-1: none). */
static void run_tasks(int64_t n, int64_t work, task_fn fn, void *ctx, int phase) {
    if (n <= 0) return;
    runner r;
    atomic_init(&r.next, 0);
    r.n = n; r.fn = fn; r.ctx = ctx; r.phase = phase;
    int64_t nt = o1b_get_num_threads(), byw = work / RUN_GRAIN;
    if (nt > n) nt = n;
    if (nt > byw) nt = byw;
    if (nt < 1) nt = 1;
    uint64_t t0 = qp_start(phase >= 0);
    o1b_parallel_for(nt, 1, run_worker, &r);
    if (t0) {
        uint64_t w = o1b_now_ns() - t0;
        atomic_fetch_add_explicit(&g_qp_wall[phase], w, memory_order_relaxed);
        atomic_fetch_add_explicit(&g_qp_twall[phase], w * (uint64_t)nt, memory_order_relaxed);
    }
}

/* ------------------------------------------------------------------ scratch memory */
/* One call's work buffers come from one block, kept between calls (freeing and mapping
 * megabytes on every call costs page faults that rival the arithmetic). A call that finds the
 * block in use (another thread's call) allocates its own. */
static pthread_mutex_t g_arena_lock = PTHREAD_MUTEX_INITIALIZER;
static char *g_arena;
static size_t g_arena_cap;
typedef struct { char *base; size_t need, used; int shared; } arena;
#define ARENA_ALIGN 64
static size_t arena_round(size_t n) { return (n + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN; }
static void arena_add(arena *a, size_t n) { a->need += arena_round(n > 0 ? n : 1); }
static char *arena_alloc(size_t n) {
    size_t align = n >= (4u << 20) ? (2u << 20) : ARENA_ALIGN;
    n = (n + align - 1) / align * align;
    char *p = (char *)aligned_alloc(align, n);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (p && align > ARENA_ALIGN) madvise(p, n, MADV_HUGEPAGE);
#endif
    return p;
}
static int arena_open(arena *a) {
    a->used = 0; a->shared = 0;
    if (pthread_mutex_trylock(&g_arena_lock) == 0) {
        if (g_arena_cap < a->need) {
            free(g_arena);
            g_arena = arena_alloc(a->need);
            g_arena_cap = g_arena ? a->need : 0;
        }
        if (g_arena) { a->base = g_arena; a->shared = 1; return 1; }
        pthread_mutex_unlock(&g_arena_lock);
    }
    a->base = arena_alloc(a->need);
    return a->base != NULL;
}
static void *arena_take(arena *a, size_t n) {
    void *p = a->base + a->used;
    a->used += arena_round(n > 0 ? n : 1);
    return p;
}
static void arena_close(arena *a) {
    if (a->shared) pthread_mutex_unlock(&g_arena_lock);
    else free(a->base);
}

/* ------------------------------------------------------------------ lane-wise contract ops */
static inline __mmask16 lanes16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
static inline __mmask32 lanes32(int64_t n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1); }

/* Stores under a mask only at the edges: full-width masked stores are slow on some cores. */
INL void st_ps(float *p, __mmask16 k, __m512 v) { if (k == 0xFFFF) _mm512_storeu_ps(p, v); else _mm512_mask_storeu_ps(p, k, v); }
INL void st_i32(int32_t *p, __mmask16 k, __m512i v) { if (k == 0xFFFF) _mm512_storeu_si512(p, v); else _mm512_mask_storeu_epi32(p, k, v); }
INL void st_b16(void *p, __mmask16 k, __m128i v) { if (k == 0xFFFF) _mm_storeu_si128((__m128i *)p, v); else _mm_mask_storeu_epi8(p, k, v); }

/* All vector arithmetic below runs inside run_worker, with FTZ|DAZ set: a subnormal operand
 * counts as a zero of its sign (as the contract's flushed load does) and a subnormal result is
 * flushed to a zero of its sign. */

/* bf16 -> fp32 bits (o1b_bf16_to_f32 up to the flush, which DAZ does for every arithmetic use);
 * lanes outside m are +0 and are not read. */
INL __m512 ld_bf16(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static __attribute__((noinline)) TGT __m512 vmul_slow(__m512 a, __m512 b, __m512 r, __mmask16 bad) {
    float fa[16], fb[16], fr[16];
    _mm512_storeu_ps(fa, a); _mm512_storeu_ps(fb, b); _mm512_storeu_ps(fr, r);
    for (int l = 0; l < 16; l++)
        if ((bad >> l) & 1) fr[l] = o1b_mul(o1b_flush(fa[l]), o1b_flush(fb[l]));
    return _mm512_loadu_ps(fr);
}
/* o1b_mul lane-wise. Under FTZ the IEEE product is flushed when it is tiny; it differs from
 * o1b_mul only where it is exactly ±2^-126 (the exact product may lie below and the contract
 * flushes it): those lanes are recomputed by the scalar o1b_mul. */
INL __m512 vmul(__m512 a, __m512 b) {
    __m512 r = _mm512_mul_ps(a, b);
    __mmask16 bad = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(r), _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32(0x00800000));
    if (__builtin_expect(bad != 0, 0)) r = vmul_slow(a, b, r, bad);
    return r;
}
/* Whether any lane of r[0..n) is exactly ±2^-126: (|r| bits) ^ 0x00800000 is zero just there. For
 * a batch of products that are then checked at once (vmul's test, in fewer instructions). */
INL int any_edge(const __m512 *r, int n) {
    const __m512i ab = _mm512_set1_epi32(0x7FFFFFFF), e = _mm512_set1_epi32(0x00800000);
    __m512i m = _mm512_ternarylogic_epi32(_mm512_castps_si512(r[0]), ab, e, 0x6A);   /* (r & ab) ^ e */
    UNROLL
    for (int i = 1; i < n; i++) m = _mm512_min_epu32(m, _mm512_ternarylogic_epi32(_mm512_castps_si512(r[i]), ab, e, 0x6A));
    return _mm512_testn_epi32_mask(m, m) != 0;
}
/* r[i] = vmul(a[i], b) for i < n (n a constant): the products, then one test for the batch. */
INL void vmul_n(__m512 *r, const __m512 *a, __m512 b, int n) {
    UNROLL
    for (int i = 0; i < n; i++) r[i] = _mm512_mul_ps(a[i], b);
    if (__builtin_expect(any_edge(r, n), 0)) {
        UNROLL
        for (int i = 0; i < n; i++) r[i] = vmul(a[i], b);
    }
}
INL __m512 vstore(__m512 r) {                 /* o1b_store of a flushed value: canonical NaN */
    __mmask16 nan = _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(r, nan, _mm512_castsi512_ps(_mm512_set1_epi32((int)O1B_NAN_BITS)));
}
/* level(t) + off as int32 lanes (t finite): the clamp, then t + 1.5*2^23, whose low bits are the
 * integer nearest to t, ties to even (as quant.c's qrne). */
INL __m512i vlevel_off(__m512 t, int off) {
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    return _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(t, _mm512_set1_ps(O1B_ROUND_MAGIC))),
                            _mm512_set1_epi32(0x4B400000 - off));
}
INL __m512i vlevel(__m512 t) { return vlevel_off(t, 0); }
/* vlevel_off where t = mul(v, 1/s) with s the tensor's own scale amax/127 and |v| <= amax (x, G,
 * D, R, X: never the weights): |t| <= 127·(1 + 2^-24)^3 < 127.5 after the three roundings
 * (s, 1/s, the product; a flush only shrinks), so the clamp changes nothing and is left out. */
INL __m512i vround_off(__m512 t, int off) {
    return _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(t, _mm512_set1_ps(O1B_ROUND_MAGIC))),
                            _mm512_set1_epi32(0x4B400000 - off));
}
INL __m512i vround(__m512 t) { return vround_off(t, 0); }
/* the per-tensor scale from the max of |v| bits (fp32 tensors: >= inf means not finite) */
static float scale_from_bits(uint32_t m) { return m >= 0x7F800000u ? o1b_nan() : tensor_scale(qfrom(m)); }
static float inv_of(float s) { return scale_kind(s) == 1 ? o1b_div(1.0f, s) : 0.0f; }
/* the per-tensor scale of an integer tensor (R, X) from its max |value| */
static float scale_from_intmax(uint32_t m) { return tensor_scale(o1b_i2f((int32_t)m)); }
/* the largest of the tasks' partial maxima */
static uint32_t max_of(const uint32_t *v, int64_t n) {
    uint32_t m = 0;
    for (int64_t c = 0; c < n; c++) m = v[c] > m ? v[c] : m;
    return m;
}

/* 16 x 16 dword transpose: out[j] lane i = in[i] lane j. */
INL void tr16(const __m512i in[16], __m512i out[16]) {
    __m512i r[16], t[16];
    UNROLL
    for (int k = 0; k < 16; k += 2) {
        t[k] = _mm512_unpacklo_epi32(in[k], in[k + 1]);
        t[k + 1] = _mm512_unpackhi_epi32(in[k], in[k + 1]);
    }
    UNROLL
    for (int k = 0; k < 16; k += 4) {
        r[k + 0] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
        r[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
        r[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
        r[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
    }
    UNROLL
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
        __m512i v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        out[c + 0] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        out[c + 4] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        out[c + 8] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        out[c + 12] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* ------------------------------------------------------------------ Walsh-Hadamard pieces */
/* Stages h = 1, 2, 4 on eight vectors x[0..7] (element i of the block is x[i]). FTZ is set. */
INL void bfly8_f(__m512 *x) {
    UNROLL
    for (int h = 1; h < 8; h <<= 1)
        UNROLL
        for (int i = 0; i < 8; i++) {
            if (i & h) continue;
            __m512 u = x[i], v = x[i + h];
            x[i] = _mm512_add_ps(u, v);
            x[i + h] = _mm512_sub_ps(u, v);
        }
}
INL void bfly8_i16(__m512i *x) {
    UNROLL
    for (int h = 1; h < 8; h <<= 1)
        UNROLL
        for (int i = 0; i < 8; i++) {
            if (i & h) continue;
            __m512i u = x[i], v = x[i + h];
            x[i] = _mm512_add_epi16(u, v);
            x[i + h] = _mm512_sub_epi16(u, v);
        }
}
/* The rotation of a block of QB = 128 rows held as v[0..127] (elementwise over the lanes):
 * stages 1, 2, 4 in groups of eight consecutive rows, 8, 16, 32 in groups of eight rows eight
 * apart, then 64. Every element sees the stages in the contract's order. */
INL void rot128_i16(__m512i *v) {
    UNROLL
    for (int g = 0; g < 128; g += 8) bfly8_i16(v + g);
    for (int base = 0; base < 128; base += 64)
        UNROLL
        for (int j0 = 0; j0 < 8; j0++) {
            __m512i y[8];
            UNROLL
            for (int j = 0; j < 8; j++) y[j] = v[base + j0 + 8 * j];
            bfly8_i16(y);
            UNROLL
            for (int j = 0; j < 8; j++) v[base + j0 + 8 * j] = y[j];
        }
    for (int i = 0; i < 64; i++) {
        __m512i u = v[i], w = v[i + 64];
        v[i] = _mm512_add_epi16(u, w);
        v[i + 64] = _mm512_sub_epi16(u, w);
    }
}
/* One in-register stage h < 16 along the 16 lanes: lanes i with (i & h) = 0 get u + v, lanes
 * i + h get u - v (u lane i, v lane i + h), as x·(±1) + partner in one fma (see the header). */
#define BFLY_IN(x, perm, mask) ((x) = _mm512_fmadd_ps((x), _mm512_mask_blend_ps((mask), _mm512_set1_ps(1.0f), \
                                                                          _mm512_set1_ps(-1.0f)), (perm)))
/* A row's QB-chunk held as x[0..7] (element 16r + l in x[r] lane l): all seven stages. */
INL void rot_row_chunk(__m512 *x) {
    UNROLL
    for (int r = 0; r < 8; r++) {
        BFLY_IN(x[r], _mm512_permute_ps(x[r], 0xB1), (__mmask16)0xAAAA);             /* h = 1 */
        BFLY_IN(x[r], _mm512_permute_ps(x[r], 0x4E), (__mmask16)0xCCCC);             /* h = 2 */
        BFLY_IN(x[r], _mm512_shuffle_f32x4(x[r], x[r], 0xB1), (__mmask16)0xF0F0);    /* h = 4 */
        BFLY_IN(x[r], _mm512_shuffle_f32x4(x[r], x[r], 0x4E), (__mmask16)0xFF00);    /* h = 8 */
    }
    bfly8_f(x);                                                                      /* h = 16, 32, 64 */
}

/* G's chunk c of row n: g = mul(dy[n, m], s_w[m]) for m = 128c + 16r + l (+0 for m >= M), rotated. */
INL void g_chunk(const bf16 *dyrow, const float *sw, int64_t M, int64_t c, __m512 *x) {
    int64_t m0 = c * QB;
    if (m0 + QB <= M) {
#define G_DY(r) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32( \
            _mm256_loadu_si256((const __m256i *)(dyrow + m0 + 16 * (r)))), 16))
        UNROLL
        for (int r = 0; r < 8; r++) x[r] = _mm512_mul_ps(G_DY(r), _mm512_loadu_ps(sw + m0 + 16 * r));
        if (__builtin_expect(any_edge(x, 8), 0)) {
            UNROLL
            for (int r = 0; r < 8; r++) x[r] = vmul(G_DY(r), _mm512_loadu_ps(sw + m0 + 16 * r));
        }
#undef G_DY
    } else {
        UNROLL
        for (int r = 0; r < 8; r++) {
            int64_t m = m0 + 16 * r;
            __mmask16 k = m < M ? lanes16(M - m) : 0;
            x[r] = vmul(ld_bf16(dyrow + m, k), _mm512_maskz_loadu_ps(k, sw + m));
        }
    }
    rot_row_chunk(x);
}
/* Stages h = 1, 2, 4, 8 on sixteen vectors x[0..15]. */
INL void bfly16_f(__m512 *x) {
    UNROLL
    for (int h = 1; h < 16; h <<= 1)
        UNROLL
        for (int i = 0; i < 16; i++) {
            if (i & h) continue;
            __m512 u = x[i], v = x[i + h];
            x[i] = _mm512_add_ps(u, v);
            x[i + h] = _mm512_sub_ps(u, v);
        }
}
/* D's block b, columns m0 .. m0+15: v[i] = dy[128b + i, m0 + l] (+0 outside), rotated along i
 * in two passes: stages 1 .. 8 on sixteen consecutive rows as they are loaded, then 16, 32, 64
 * on the eight rows j0 + 16j. If mx is given, the max of |v| bits is returned there instead
 * of storing the second pass. */
INL void d_block(const bf16 *dy, int64_t N, int64_t M, int64_t b, int64_t m0, __m512 *v, uint32_t *mx) {
    __mmask16 k = lanes16(M - m0);
    for (int g = 0; g < QB; g += 16) {
        __m512 y[16];
        const bf16 *p = dy + (b * QB + g) * M + m0;
        int64_t nv = N - (b * QB + g);                     /* rows of this group inside dy */
        if (nv >= 16 && k == 0xFFFF) {
            UNROLL
            for (int j = 0; j < 16; j++)
                y[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                           _mm256_loadu_si256((const __m256i *)(p + j * M))), 16));
        } else {
            UNROLL
            for (int j = 0; j < 16; j++) y[j] = j < nv ? ld_bf16(p + j * M, k) : _mm512_setzero_ps();
        }
        bfly16_f(y);
        UNROLL
        for (int j = 0; j < 16; j++) v[g + j] = y[j];
    }
    __m512i m = _mm512_setzero_si512();
    UNROLL
    for (int j0 = 0; j0 < 16; j0++) {
        __m512 y[8];
        UNROLL
        for (int j = 0; j < 8; j++) y[j] = v[j0 + 16 * j];
        bfly8_f(y);
        if (mx)
            UNROLL
            for (int j = 0; j < 8; j++)
                m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(y[j]), _mm512_set1_epi32(0x7FFFFFFF)));
        else
            UNROLL
            for (int j = 0; j < 8; j++) v[j0 + 16 * j] = y[j];
    }
    if (mx) *mx = _mm512_reduce_max_epu32(m);
}

/* ------------------------------------------------------------------ the int8 GEMM */
/* C[i, j] = sum_p A[i, p] B[j, p] over p < P4 (P rounded up to 4; the padding is zeros).
 * Au: row i at Au + i * P4, u8 = a + 128 (padding and rows past I hold 128, i.e. a zero).
 * Bp: for each panel of 32 columns, for each group of 4 p, 32 columns x 4 bytes (padding 0).
 * colsum[j] = sum_p B[j, p]; sum (a + 128) b = sum a b + 128 colsum (exact modulo 2^32). */
enum { EP_RAW, EP_FWD, EP_DX, EP_DW };
typedef struct {
    int64_t I, J, P4;
    const uint8_t *Au; const int8_t *Bp; const int32_t *cs;
    int ep; float c0, c1, c2;                 /* the dequantization chain's scalars */
    const float *cw;                          /* EP_FWD: s_w per column */
    const uint8_t *clip;                      /* EP_DW: (I, J) marks: 1 -> +0, 2 -> NaN */
    float *Y; int32_t *C;                     /* the output (I, J) */
} gemm_job;

/* The MR x 32 tile at rows a (stride lda) and panel bp, over p < np: out[MR][32] (int32,
 * without the colsum correction). Kept out of line with named accumulators so that they stay in
 * registers whatever the caller does with the result. */
#define KACC(r) __m512i c##r##0 = _mm512_setzero_si512(), c##r##1 = _mm512_setzero_si512();
#define KSTEP(r) { int32_t a4_; memcpy(&a4_, a + r * lda + p, 4); __m512i av_ = _mm512_set1_epi32(a4_); \
    c##r##0 = _mm512_dpbusd_epi32(c##r##0, av_, b0); c##r##1 = _mm512_dpbusd_epi32(c##r##1, av_, b1); }
#define KOUT(r) _mm512_storeu_si512(out + r * 32, c##r##0); _mm512_storeu_si512(out + r * 32 + 16, c##r##1);
static __attribute__((noinline)) TGT void kernel(const uint8_t *a, int64_t lda, int64_t np, const int8_t *bp, int32_t *out) {
    KACC(0) KACC(1) KACC(2) KACC(3) KACC(4) KACC(5) KACC(6) KACC(7)
    for (int64_t p = 0; p < np; p += 4) {
        __m512i b0 = _mm512_loadu_si512(bp + p * 32), b1 = _mm512_loadu_si512(bp + p * 32 + 64);
        KSTEP(0) KSTEP(1) KSTEP(2) KSTEP(3) KSTEP(4) KSTEP(5) KSTEP(6) KSTEP(7)
    }
    KOUT(0) KOUT(1) KOUT(2) KOUT(3) KOUT(4) KOUT(5) KOUT(6) KOUT(7)
}
#undef KACC
#undef KSTEP
#undef KOUT
/* y and dx are written once and read much later by another op: past STREAM_BYTES (about a core's
 * L2) whole aligned vectors go around the cache, saving the read for ownership. dW is not streamed:
 * it is written into the model's gradient buffer (dw_out), which the step's fold over microbatches
 * reads soon after (streaming it measured 3% slower per small int8 step). */
#define STREAM_BYTES (2 << 20)
INL void epilogue16(const gemm_job *g, const int ep, int64_t i, int64_t j, __m512i acc, __mmask16 k, int stream) {
    if (ep == EP_RAW) { st_i32(g->C + i * g->J + j, k, acc); return; }
    /* i2f(acc) is 0 or at least 1 in magnitude and c0 is a per-tensor scale (+0, NaN, or at
     * least 2^-126), so the exact first product is never below 2^-126 unless it is 0: the
     * hardware product is o1b_mul's without the boundary check. */
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(g->c0));
    if (ep == EP_FWD) {
        v = vmul(v, k == 0xFFFF ? _mm512_loadu_ps(g->cw + j) : _mm512_maskz_loadu_ps(k, g->cw + j));
    } else {
        v = vmul(v, _mm512_set1_ps(g->c1));
        if (ep == EP_DW) v = vmul(v, _mm512_set1_ps(g->c2));
        v = vmul(v, _mm512_set1_ps(INV_QB));
    }
    v = vstore(v);
    if (ep == EP_DW) {
        __m512i cl = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, g->clip + i * g->J + j));
        __mmask16 z = _mm512_cmpeq_epi32_mask(cl, _mm512_set1_epi32(1));
        __mmask16 nn = _mm512_cmpeq_epi32_mask(cl, _mm512_set1_epi32(2));
        v = _mm512_mask_mov_ps(v, z, _mm512_setzero_ps());
        v = _mm512_mask_mov_ps(v, nn, _mm512_castsi512_ps(_mm512_set1_epi32((int)O1B_NAN_BITS)));
    }
    float *y = g->Y + i * g->J + j;
    if (stream && k == 0xFFFF && ((uintptr_t)y & 63) == 0) _mm512_stream_ps(y, v);
    else st_ps(y, k, v);
}
/* Rows [i0, i1) (i0 a multiple of MR; Au holds rows up to i1 rounded up to MR), all columns.
 * With AMX (rows in whole tiles of 16): blocks of 32 (or 16) rows on tiles over the first
 * P4 - P4 % 64 of p, the VNNI kernel adding the rest; both are exact integer sums. */
INL void gemm_rows_ep(const gemm_job *g, int64_t i0, int64_t i1, const int ep) {
    int64_t P4 = g->P4, np = (g->J + NR - 1) / NR, P64 = P4 / 64 * 64;
    int amx = P64 > 0 && i0 % 16 == 0 && i1 % 16 == 0 && o1b_q_amx_on();
    int stream = (ep == EP_FWD || ep == EP_DX) && g->I * g->J * (int64_t)sizeof(float) > STREAM_BYTES;
    if (amx) o1b_q_amx_begin();
    for (int64_t i = i0; i < i1;) {
        int rows = amx ? (i1 - i >= 32 ? 32 : 16) : MR;
        for (int64_t jp = 0; jp < np; jp++) {
            const int8_t *bp = g->Bp + jp * NR * P4;
            int64_t j0 = jp * NR;
            __m512i cs0 = _mm512_slli_epi32(_mm512_loadu_si512(g->cs + j0), 7);
            __m512i cs1 = _mm512_slli_epi32(_mm512_loadu_si512(g->cs + j0 + 16), 7);
            __mmask16 k0 = lanes16(g->J - j0), k1 = g->J - j0 > 16 ? lanes16(g->J - j0 - 16) : 0;
            int32_t c[32 * 32];
            if (amx) {
                o1b_q_amx_block(g->Au + i * P4, P4, P64, bp, rows, c);
                for (int r8 = 0; r8 < rows && P64 < P4; r8 += MR) {
                    int32_t t[MR * 32];
                    kernel(g->Au + (i + r8) * P4 + P64, P4, P4 - P64, bp + P64 * 32, t);
                    for (int e = 0; e < MR * 32; e += 16)
                        _mm512_storeu_si512(c + r8 * 32 + e, _mm512_add_epi32(_mm512_loadu_si512(c + r8 * 32 + e),
                                                                             _mm512_loadu_si512(t + e)));
                }
            } else {
                kernel(g->Au + i * P4, P4, P4, bp, c);
            }
            for (int r = 0; r < rows && i + r < i1 && i + r < g->I; r++) {
                epilogue16(g, ep, i + r, j0, _mm512_sub_epi32(_mm512_loadu_si512(c + r * 32), cs0), k0, stream);
                if (k1) epilogue16(g, ep, i + r, j0 + 16, _mm512_sub_epi32(_mm512_loadu_si512(c + r * 32 + 16), cs1), k1, stream);
            }
        }
        i += rows;
    }
    if (amx) o1b_q_amx_end();
    if (stream) _mm_sfence();       /* the streamed rows are visible before the task is done */
}
static TGT void gemm_rows_raw(const gemm_job *g, int64_t i0, int64_t i1) { gemm_rows_ep(g, i0, i1, EP_RAW); }
static TGT void gemm_rows_fwd(const gemm_job *g, int64_t i0, int64_t i1) { gemm_rows_ep(g, i0, i1, EP_FWD); }
static TGT void gemm_rows_dx(const gemm_job *g, int64_t i0, int64_t i1) { gemm_rows_ep(g, i0, i1, EP_DX); }
static TGT void gemm_rows_dw(const gemm_job *g, int64_t i0, int64_t i1) { gemm_rows_ep(g, i0, i1, EP_DW); }
static void gemm_rows(const gemm_job *g, int64_t i0, int64_t i1) {
    switch (g->ep) {
    case EP_RAW: gemm_rows_raw(g, i0, i1); break;
    case EP_FWD: gemm_rows_fwd(g, i0, i1); break;
    case EP_DX: gemm_rows_dx(g, i0, i1); break;
    default: gemm_rows_dw(g, i0, i1); break;
    }
}

/* ------------------------------------------------------------------ weights */
/* |w| of 16 bf16 as fp32 bits (flushed); lanes outside m are +0. */
INL __m512i absw16(const bf16 *p, __mmask16 m) {
    __m512i u = _mm512_and_si512(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), _mm512_set1_epi32(0x7FFF));
    return _mm512_maskz_slli_epi32(_mm512_cmpge_epu32_mask(u, _mm512_set1_epi32(0x80)), u, 16);
}
/* S[r] = sum from +0 over k ascending of |w[r, k]| for rows r < nr (nr <= 32), one lane per row.
 * Both operands of every add are >= +0 and flushed, so no sum is subnormal: add = o1b_add. */
INL void wsums32(const bf16 *w, int64_t K, int64_t nr, float *S) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        __mmask16 km = lanes16(K - k0);
        int kn = K - k0 < 16 ? (int)(K - k0) : 16;
        __m512i r[16], t0[16], t1[16];
        for (int i = 0; i < 16; i++) r[i] = i < nr ? absw16(w + i * K + k0, km) : _mm512_setzero_si512();
        tr16(r, t0);
        for (int i = 0; i < 16; i++) r[i] = 16 + i < nr ? absw16(w + (16 + i) * K + k0, km) : _mm512_setzero_si512();
        tr16(r, t1);
        for (int k = 0; k < kn; k++) {
            s0 = _mm512_add_ps(s0, _mm512_castsi512_ps(t0[k]));
            s1 = _mm512_add_ps(s1, _mm512_castsi512_ps(t1[k]));
        }
    }
    _mm512_storeu_ps(S, s0);
    _mm512_storeu_ps(S + 16, s1);
}

/* ------------------------------------------------------------------ held weights */
struct o1b_qweights {
    int64_t M, K, bytes;
    const bf16 *w;              /* the weights they were computed from (a call on other weights is refused) */
    float *sw;                  /* s_w (Mp entries; rows past M: +0) */
    int8_t *Bf; int32_t *csf;   /* the forward's B: q_w by panels of NR rows, with column sums */
    uint8_t *clip;              /* (M, K) dW's clip marks: 1 -> +0, 2 -> NaN */
    int8_t *Bw; int32_t *csw;   /* the dx GEMM's B: R = rot_m(q_w) quantized, packed, with column sums */
    float srw;                  /* R's scale */
    char *mem;
    /* the last forward's x on these weights, its rows and its s_x: a backward on the same x (the
       caller says it is the same unchanged array, see o1b_qlinear_backward_q) takes this s_x */
    const bf16 *fx; int64_t fN; float fsx;
};

/* A loop of n rounds of 12 independent vpdpbusd (zmm: 64 multiply-adds each): the issue rate
 * that bounds the GEMM kernel on this core, for benchmarks (int8_bench.py --phases). The result
 * depends on every accumulator, so that none is left out. */
O1B_API TGT int64_t o1b_q_vnni_peak_loop(int64_t n) {
    if (!o1b_q_vnni_available()) return 0;
    __m512i c[12], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
    for (int i = 0; i < 12; i++) c[i] = _mm512_set1_epi32(i);
    for (int64_t r = 0; r < n; r++) {
        UNROLL
        for (int i = 0; i < 12; i++) c[i] = _mm512_dpbusd_epi32(c[i], a, b);
        __asm__ volatile("" : "+v"(a));
    }
    __m512i s = c[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_epi32(s, c[i]);
    return _mm512_reduce_add_epi32(s);
}

static atomic_llong g_held_runs;      /* layer calls that ran on held operands (for the tests) */
O1B_API int64_t o1b_q_held_runs(void) { return (int64_t)atomic_load(&g_held_runs); }
static atomic_llong g_sx_reused;      /* backward calls that took the forward's s_x (for the tests) */
O1B_API int64_t o1b_q_sx_reused(void) { return (int64_t)atomic_load(&g_sx_reused); }

/* ------------------------------------------------------------------ forward */
typedef struct {
    int64_t N, K, M, P4, Ip, npw, nxc, xper, rowchunk;
    const bf16 *x, *w;
    uint8_t *Au; int8_t *Bp; int32_t *cs; float *sw; uint32_t *xmax;
    float inv_x; int kind_x;
    gemm_job gj;
    int prof;                  /* the call is profiled: its pieces are timed */
} fwd_ctx;

/* bf16 absmax bits of x[i0, i1) (u16 of |x|; >= 0x7F80 means not finite). */
static TGT uint32_t absmax_bf16(const bf16 *x, int64_t i0, int64_t i1) {
    __m512i m = _mm512_setzero_si512();
    for (int64_t i = i0; i < i1; i += 32) {
        __m512i v = _mm512_maskz_loadu_epi16(lanes32(i1 - i), x + i);
        m = _mm512_max_epu16(m, _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF)));
    }
    __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(m));
    __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(m, 1));
    return _mm512_reduce_max_epu32(_mm512_max_epu32(lo, hi));
}
static float scale_from_bf16bits(uint32_t m) {
    if (m >= 0x7F80u) return o1b_nan();
    return tensor_scale(m < 0x80u ? 0.0f : qfrom(m << 16));
}

/* Weight panel jp (rows 32jp ..): s_w, and q_w packed as B with column sums. Sixteen rows x 16 k
 * at a time: the levels narrowed with saturating packs (exact on -127 .. 127) leave, in 16-byte
 * lane l, rows 4i .. 4i+3 x 4 bytes of k = k0 + 4l .. (the layout of B's group k0/4 + l), and
 * vpdpbusd by ones adds each row's 4 bytes into its column sum. Rows without a finite nonzero
 * scale (and rows past M) are zeros. */
static TGT void fwd_wpanel(fwd_ctx *a, int64_t jp) {
    int64_t K = a->K, P4 = a->P4, j0 = jp * NR, nr = a->M - j0 < NR ? a->M - j0 : NR, ng = P4 / 4;
    int8_t *dst = a->Bp + jp * NR * P4;
    float S[NR], inv[NR];
    wsums32(a->w + j0 * K, K, nr, S);
    for (int64_t jl = 0; jl < NR; jl++) {
        inv[jl] = 0.0f;
        if (jl >= nr) { a->sw[j0 + jl] = 0.0f; continue; }
        float s = weight_scale(S[jl], K);
        a->sw[j0 + jl] = o1b_store(s);
        if (scale_kind(s) == 1) inv[jl] = o1b_div(1.0f, s);
    }
    const __m512i ones = _mm512_set1_epi8(1);
    for (int h = 0; h < NR; h += 16) {
        __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int64_t k0 = 0; k0 < K; k0 += 16) {
            __mmask16 km = lanes16(K - k0);
            __m512 x[16], p[16];
            UNROLL
            for (int r = 0; r < 16; r++) {
                x[r] = inv[h + r] != 0.0f ? ld_bf16(a->w + (j0 + h + r) * K + k0, km) : _mm512_setzero_ps();
                p[r] = _mm512_mul_ps(x[r], _mm512_set1_ps(inv[h + r]));
            }
            if (__builtin_expect(any_edge(p, 16), 0)) {
                UNROLL
                for (int r = 0; r < 16; r++) p[r] = vmul(x[r], _mm512_set1_ps(inv[h + r]));
            }
            __m512i w2[8];
            UNROLL
            for (int k = 0; k < 8; k++) w2[k] = _mm512_packs_epi32(vlevel(p[2 * k]), vlevel(p[2 * k + 1]));
            UNROLL
            for (int i = 0; i < 4; i++) {
                __m512i b = _mm512_packs_epi16(w2[2 * i], w2[2 * i + 1]);
                acc[i] = _mm512_dpbusd_epi32(acc[i], ones, b);
                int8_t *d = dst + (k0 / 4) * 128 + (h + 4 * i) * 4;
                int64_t nl = ng - k0 / 4;                        /* groups of this k0 inside P4 */
                _mm_storeu_si128((__m128i *)d, _mm512_castsi512_si128(b));
                if (nl > 1) _mm_storeu_si128((__m128i *)(d + 128), _mm512_extracti32x4_epi32(b, 1));
                if (nl > 2) _mm_storeu_si128((__m128i *)(d + 256), _mm512_extracti32x4_epi32(b, 2));
                if (nl > 3) _mm_storeu_si128((__m128i *)(d + 384), _mm512_extracti32x4_epi32(b, 3));
            }
        }
        UNROLL
        for (int i = 0; i < 4; i++) {                /* dword 4l + r of acc[i]: row h + 4i + r */
            __m512i t = _mm512_add_epi32(acc[i], _mm512_shuffle_i32x4(acc[i], acc[i], 0x4E));
            t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0xB1));
            _mm_storeu_si128((__m128i *)(a->cs + j0 + h + 4 * i), _mm512_castsi512_si128(t));
        }
    }
}
/* Rows [r0, r1) of x quantized into Au (u8 = q + 128), 64 at a time: the levels narrowed with
 * saturating packs (exact on -127 .. 127), put back in order, offset by 128. */
static TGT void quant_rows_bf16(const bf16 *x, int64_t N, int64_t K, int64_t P4, float inv, int kind,
                                uint8_t *Au, int64_t r0, int64_t r1) {
    __m512 iv = _mm512_set1_ps(inv);
    const __m512i pd = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int64_t i = r0; i < r1; i++) {
        uint8_t *d = Au + i * P4;
        if (i >= N || kind != 1) { memset(d, 128, (size_t)P4); continue; }
        const bf16 *row = x + i * K;
        for (int64_t k0 = 0; k0 < P4; k0 += 64) {
            __m512 v[4];
            UNROLL
            for (int j = 0; j < 4; j++) {
                int64_t k = k0 + 16 * j;
                v[j] = ld_bf16(row + k, k < K ? lanes16(K - k) : 0);
            }
            vmul_n(v, v, iv, 4);
            __m512i b = _mm512_packs_epi16(_mm512_packs_epi32(vround(v[0]), vround(v[1])),
                                           _mm512_packs_epi32(vround(v[2]), vround(v[3])));
            b = _mm512_xor_si512(_mm512_permutexvar_epi32(pd, b), _mm512_set1_epi8((char)0x80));
            if (P4 - k0 >= 64) _mm512_storeu_si512(d + k0, b);
            else _mm512_mask_storeu_epi8(d + k0, (__mmask64)((1ull << (P4 - k0)) - 1), b);
        }
    }
}
static void fwd_f1(void *ctx, int64_t t) {
    fwd_ctx *a = (fwd_ctx *)ctx;
    uint64_t t0 = qp_start(a->prof);
    if (t < a->npw) { fwd_wpanel(a, t); qp_add(&g_qt_busy[QT_F_WEIGHTS], t0); return; }
    t -= a->npw;
    int64_t i0 = t * a->xper, i1 = i0 + a->xper < a->N * a->K ? i0 + a->xper : a->N * a->K;
    a->xmax[t] = absmax_bf16(a->x, i0, i1);
    qp_add(&g_qt_busy[QT_F_XMAX], t0);
}
static void fwd_f2(void *ctx, int64_t t) {
    fwd_ctx *a = (fwd_ctx *)ctx;
    int64_t r0 = t * a->rowchunk, r1 = r0 + a->rowchunk < a->Ip ? r0 + a->rowchunk : a->Ip;
    uint64_t t0 = qp_start(a->prof);
    quant_rows_bf16(a->x, a->N, a->K, a->P4, a->inv_x, a->kind_x, a->Au, r0, r1);
    qp_add(&g_qt_busy[QT_F_QUANT], t0);
    t0 = qp_start(a->prof);
    gemm_rows(&a->gj, r0, r1);
    qp_add(&g_qt_busy[QT_F_GEMM], t0);
}
static int64_t pick_rowchunk(int64_t rows) {   /* a multiple of 16; >= ~4 tasks per thread */
    int64_t per = rows / (4 * (int64_t)o1b_get_num_threads());
    int64_t rc = per >= 64 ? 64 : per >= 32 ? 32 : 16;
    return rc;
}

int o1b_qlinear_forward_vnni(int64_t N, int64_t K, int64_t M, const bf16 *x, const bf16 *w, float *y,
                             const o1b_qweights *pw) {
    if (!o1b_q_vnni_available()) return 0;
    fwd_ctx a;
    memset(&a, 0, sizeof a);
    a.prof = qp_on();
    uint64_t tcall = qp_start(a.prof);
    a.N = N; a.K = K; a.M = M; a.x = x; a.w = w;
    a.P4 = (K + 3) / 4 * 4;
    a.rowchunk = pick_rowchunk(N);
    a.Ip = (N + 15) / 16 * 16;
    a.xper = 1 << 15;
    a.nxc = (N * K + a.xper - 1) / a.xper;
    int64_t Jp = (M + NR - 1) / NR * NR;
    /* W's part (s_w, B, column sums): held (pw), or computed in F1 */
    a.npw = pw ? 0 : Jp / NR;
    arena ar = {0};
    size_t sz[5] = {(size_t)(a.Ip * a.P4), pw ? 0 : (size_t)(Jp * a.P4), pw ? 0 : (size_t)Jp * sizeof(int32_t),
                    pw ? 0 : (size_t)Jp * sizeof(float), (size_t)a.nxc * sizeof(uint32_t)};
    for (int i = 0; i < 5; i++) arena_add(&ar, sz[i]);
    int ok = arena_open(&ar);
    if (ok) {
        a.Au = (uint8_t *)arena_take(&ar, sz[0]);
        a.Bp = pw ? pw->Bf : (int8_t *)arena_take(&ar, sz[1]);
        a.cs = pw ? pw->csf : (int32_t *)arena_take(&ar, sz[2]);
        a.sw = pw ? pw->sw : (float *)arena_take(&ar, sz[3]);
        a.xmax = (uint32_t *)arena_take(&ar, sz[4]);
        if (pw) atomic_fetch_add_explicit(&g_held_runs, 1, memory_order_relaxed);
        run_tasks(a.npw + a.nxc, a.npw * NR * K * 3 + N * K / 4, fwd_f1, &a, a.prof ? QP_F1 : -1);
        float sx = scale_from_bf16bits(max_of(a.xmax, a.nxc));
        a.kind_x = scale_kind(sx);
        a.inv_x = inv_of(sx);
        if (pw) {                 /* the handle is the calling thread's (weights_held is per thread) */
            o1b_qweights *hw = (o1b_qweights *)pw;
            hw->fx = x; hw->fN = N; hw->fsx = sx;
        }
        gemm_job g = {N, M, a.P4, a.Au, a.Bp, a.cs, EP_FWD, sx, 0.0f, 0.0f, a.sw, NULL, y, NULL};
        a.gj = g;
        run_tasks((a.Ip + a.rowchunk - 1) / a.rowchunk, N * M * K / 64 + N * K, fwd_f2, &a, a.prof ? QP_F2 : -1);
        arena_close(&ar);
    }
    if (ok && tcall) {            /* counted where the call ran here (else the portable code runs) */
        atomic_fetch_add_explicit(&g_qp_calls[0], 1, memory_order_relaxed);
        qp_add(&g_qp_call_wall[0], tcall);
    }
    return ok;
}

/* ------------------------------------------------------------------ backward */
typedef struct {
    int64_t N, K, M, Mp, Np, Kp;             /* Kp: K rounded up to NR */
    const bf16 *dy, *x, *w;
    float *dx, *dw;
    /* B1 */
    int64_t nwp, nxc, xper;                    /* weight panels, x chunks */
    float *sw; int8_t *qw; uint8_t *clip; uint32_t *xmax, *dmax;
    /* B2 */
    int64_t ngt, nrw, nrx, nks;                /* G/D tasks (blocks of 128 rows of dy), R_w / X blocks, 32-column strips */
    uint32_t *gmax, *rwmax, *rxmax;
    int16_t *Rw, *Rx;
    float inv_x; int kind_x;
    /* B3 */
    int8_t *Bw, *Bx; int32_t *csw, *csx;
    float inv_rw, inv_rx; int kind_rw, kind_rx;
    /* B4 */
    int64_t ndx, dxrows, ndw, ndf, nbw;        /* dx tasks (dxrows rows each), dW tasks (DW_ROWS rows), A fills, B_w panels */
    uint8_t *Adx, *Adw;
    float inv_g, inv_d; int kind_g, kind_d;
    gemm_job gdx, gdw;
    int prof;                  /* the call is profiled: its pieces are timed */
} bwd_ctx;

/* Weight panel: s_w, q_w (row-major) and the clip marks. */
static TGT void bwd_wpanel(bwd_ctx *a, int64_t jp) {
    int64_t K = a->K, j0 = jp * NR, nr = a->M - j0 < NR ? a->M - j0 : NR;
    float S[NR];
    wsums32(a->w + j0 * K, K, nr, S);
    for (int64_t jl = 0; jl < nr; jl++) {
        int64_t j = j0 + jl;
        float s = weight_scale(S[jl], K);
        int kind = scale_kind(s);
        a->sw[j] = o1b_store(s);
        int8_t *q = a->qw + j * K;
        uint8_t *c = a->clip ? a->clip + j * K : NULL;
        if (kind != 1) {
            memset(q, 0, (size_t)K);
            if (c) memset(c, kind == 2 ? 2 : 0, (size_t)K);
            continue;
        }
        __m512 inv = _mm512_set1_ps(o1b_div(1.0f, s));
        const bf16 *row = a->w + j * K;
        for (int64_t k0 = 0; k0 < K; k0 += 16) {
            __mmask16 km = lanes16(K - k0);
            __m512 t = vmul(ld_bf16(row + k0, km), inv);
            st_b16(q + k0, km, _mm512_cvtepi32_epi8(vlevel(t)));
            if (c) {
                __mmask16 cl = _mm512_cmp_ps_mask(_mm512_abs_ps(t), _mm512_set1_ps(127.0f), _CMP_GT_OQ);
                st_b16(c + k0, km, _mm_maskz_mov_epi8(cl, _mm_set1_epi8(1)));
            }
        }
    }
}
/* The forward's B panel jp (Bp, with column sums cs; P4 = K rounded up to 4) packed from the
 * panel's q_w rows (row-major, as bwd_wpanel leaves them; rows past M zero): the same bytes as
 * fwd_wpanel's, whose levels are the same function of the same weights, so held operands need W
 * quantized once. Sixteen rows x 64 bytes at a time, transposed by dwords into the groups of 4 k. */
static TGT void pack_qw_panel(const int8_t *qw, int64_t M, int64_t K, int64_t P4, int8_t *Bp, int32_t *cs,
                              int64_t jp) {
    int64_t j0 = jp * NR, ng = P4 / 4;
    int8_t *dst = Bp + jp * NR * P4;
    const __m512i ones = _mm512_set1_epi8(1);
    for (int h = 0; h < NR; h += 16) {
        __m512i acc = _mm512_setzero_si512();
        for (int64_t g0 = 0; g0 < ng; g0 += 16) {
            int64_t k0 = 4 * g0;
            __mmask64 km = K - k0 >= 64 ? ~0ull : (1ull << (K - k0)) - 1;
            __m512i v[16], t[16];
            UNROLL
            for (int r = 0; r < 16; r++)
                v[r] = j0 + h + r < M ? _mm512_maskz_loadu_epi8(km, qw + (j0 + h + r) * K + k0) : _mm512_setzero_si512();
            tr16(v, t);
            int64_t ngl = ng - g0 < 16 ? ng - g0 : 16;
            for (int64_t g = 0; g < ngl; g++) {
                acc = _mm512_dpbusd_epi32(acc, ones, t[g]);
                _mm512_storeu_si512(dst + (g0 + g) * 128 + h * 4, t[g]);
            }
        }
        _mm512_storeu_si512(cs + j0 + h, acc);
    }
}
/* The held operands' weight panel jp: bwd_wpanel's s_w, q_w and clip marks, then the forward's
 * packed panel from that q_w. */
typedef struct { bwd_ctx *b; int64_t P4; int8_t *Bf; int32_t *csf; } held_ctx;
static void held_panel(void *ctx, int64_t jp) {
    held_ctx *h = (held_ctx *)ctx;
    bwd_wpanel(h->b, jp);
    pack_qw_panel(h->b->qw, h->b->M, h->b->K, h->P4, h->Bf, h->csf, jp);
}
/* absmax bits of D's block b (rows 128b ..), all columns: 64 columns at a time (a whole number of
 * cache lines per row), the next 64 columns' lines fetched meanwhile (a strided walk of 128
 * rows is latency-bound otherwise). */
static TGT uint32_t d_absmax(const bwd_ctx *a, int64_t b) {
    __m512 v[QB];
    uint32_t m = 0;
    int64_t n1 = b * QB + QB < a->N ? b * QB + QB : a->N;
    for (int64_t c0 = 0; c0 < a->M; c0 += 64) {
        if (c0 + 64 < a->M)
            for (int64_t n = b * QB; n < n1; n++) {
                const char *r = (const char *)(a->dy + n * a->M + c0 + 64);
                _mm_prefetch(r, _MM_HINT_T0);
                _mm_prefetch(r + 64, _MM_HINT_T0);
            }
        for (int64_t m0 = c0; m0 < c0 + 64 && m0 < a->M; m0 += 16) {
            uint32_t x;
            d_block(a->dy, a->N, a->M, b, m0, v, &x);
            m = x > m ? x : m;
        }
    }
    return m;
}
static void bwd_b1(void *ctx, int64_t t) {
    bwd_ctx *a = (bwd_ctx *)ctx;
    uint64_t t0 = qp_start(a->prof);
    if (t < a->nwp) { bwd_wpanel(a, t); qp_add(&g_qt_busy[QT_B_WEIGHTS], t0); return; }
    t -= a->nwp;
    if (t < a->nxc) {
        int64_t i0 = t * a->xper, i1 = i0 + a->xper < a->N * a->K ? i0 + a->xper : a->N * a->K;
        a->xmax[t] = absmax_bf16(a->x, i0, i1);
        qp_add(&g_qt_busy[QT_B_XMAX], t0);
    }
}

/* absmax bits of G's rows [r0, r1). */
static TGT uint32_t g_absmax(const bwd_ctx *a, int64_t r0, int64_t r1) {
    __m512i m = _mm512_setzero_si512();
    for (int64_t n = r0; n < r1 && n < a->N; n++)
        for (int64_t c = 0; c < a->Mp / QB; c++) {
            __m512 x[8];
            g_chunk(a->dy + n * a->M, a->sw, a->M, c, x);
            for (int r = 0; r < 8; r++)
                m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(x[r]), _mm512_set1_epi32(0x7FFFFFFF)));
        }
    return _mm512_reduce_max_epu32(m);
}
/* R's block b (rows 128b ..), columns 32s ..: the int8 rows (q_w, or x quantized with inv_x)
 * widened to int16, rotated (exact), stored; returns max |R| of the strip. The rows' next 32
 * columns are fetched meanwhile (pf). R is kept by strips of 32 columns (B's panels): row p of
 * strip s at R + (s * P + p) * 32, columns past K zero, so that this store and the packing
 * read whole lines in order. */
INL uint32_t r_strip(const bwd_ctx *a, int from_x, int64_t b, int64_t s, int pf) {
    int64_t R = from_x ? a->N : a->M, C = a->K, c0 = s * 32, P = from_x ? a->Np : a->Mp;
    int16_t *dst = (from_x ? a->Rx : a->Rw) + s * P * 32;
    __mmask32 km = lanes32(C - c0);
    __m512i v[QB];
    __m512 iv = _mm512_set1_ps(a->inv_x);
    /* packs leave columns 4l..4l+3 and 16+4l.. in 64-bit word 2l and 2l+1; this puts them back */
    const __m512i unpk = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    int zero = from_x && a->kind_x != 1;
    for (int i = 0; i < QB; i += 8) {
        int64_t r = b * QB + i;
        if (r >= R || zero) {
            for (int k = 0; k < 8; k++) v[i + k] = _mm512_setzero_si512();
            continue;
        }
        if (from_x) {
            __m512 t[16];
            UNROLL
            for (int k = 0; k < 8; k++) {
                const bf16 *row = a->x + (r + k < R ? r + k : r) * C + c0;
                if (pf) _mm_prefetch((const char *)(row + 32), _MM_HINT_T0);
                t[2 * k] = ld_bf16(row, (__mmask16)km);
                t[2 * k + 1] = ld_bf16(row + 16, (__mmask16)(km >> 16));
            }
            vmul_n(t, t, iv, 16);
            UNROLL
            for (int k = 0; k < 8; k++)
                v[i + k] = r + k < R ? _mm512_permutexvar_epi64(unpk, _mm512_packs_epi32(vround(t[2 * k]), vround(t[2 * k + 1])))
                                     : _mm512_setzero_si512();
        } else {
            UNROLL
            for (int k = 0; k < 8; k++) {
                const int8_t *row = a->qw + (r + k < R ? r + k : r) * C + c0;
                if (pf) _mm_prefetch((const char *)(row + 32), _MM_HINT_T0);
                v[i + k] = r + k < R ? _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(km, row)) : _mm512_setzero_si512();
            }
        }
    }
    rot128_i16(v);
    __m512i m = _mm512_setzero_si512();
    UNROLL
    for (int i = 0; i < QB; i++) {
        m = _mm512_max_epu16(m, _mm512_abs_epi16(v[i]));
        _mm512_storeu_si512(dst + (b * QB + i) * 32, v[i]);
    }
    __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(m));
    __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(m, 1));
    return _mm512_reduce_max_epu32(_mm512_max_epu32(lo, hi));
}
/* R's block b, all columns: max |R| of the block. */
static TGT uint32_t r_block(const bwd_ctx *a, int from_x, int64_t b) {
    uint32_t m = 0;
    for (int64_t s = 0; s < a->nks; s++) {
        uint32_t x = r_strip(a, from_x, b, s, s + 1 < a->nks);
        m = x > m ? x : m;
    }
    return m;
}
static void bwd_b2(void *ctx, int64_t t) {
    bwd_ctx *a = (bwd_ctx *)ctx;
    if (t < a->ngt) {              /* one block of 128 rows: G's rows, then D's columns from cache */
        if (a->dx) {
            uint64_t t0 = qp_start(a->prof);
            a->gmax[t] = g_absmax(a, t * QB, t * QB + QB);
            qp_add(&g_qt_busy[QT_B_GMAX], t0);
        }
        if (a->dw) {
            uint64_t t0 = qp_start(a->prof);
            a->dmax[t] = d_absmax(a, t);
            qp_add(&g_qt_busy[QT_B_DMAX], t0);
        }
        return;
    }
    t -= a->ngt;
    uint64_t t0 = qp_start(a->prof);
    if (t < a->nrw) { a->rwmax[t] = r_block(a, 0, t); qp_add(&g_qt_busy[QT_B_ROT_W], t0); return; }
    t -= a->nrw;
    a->rxmax[t] = r_block(a, 1, t);
    qp_add(&g_qt_busy[QT_B_ROT_X], t0);
}

/* Panel jp of the B operand from R (P rows; strip jp at R + jp * P * 32, see r_strip):
 * q = level(mul(i2f(R), inv)).
 * Per four rows: the levels narrowed with saturating packs (exact on -127 .. 127), which leave
 * lane l with rows 0-3 x 4 bytes of columns 4l .. 4l+3; a byte shuffle turns that into columns
 * x rows, B's layout; vpdpbusd by ones adds each column's 4 bytes into its sum. */
static TGT void pack_r_panel(const int16_t *R, int64_t P, float inv, int kind,
                             int8_t *Bp, int32_t *cs, int64_t jp) {
    int64_t j0 = jp * NR;
    int8_t *dst = Bp + jp * NR * P;
    if (kind != 1) { memset(dst, 0, (size_t)(NR * P)); memset(cs + j0, 0, NR * sizeof(int32_t)); return; }
    const int16_t *Rs = R + jp * P * 32;
    __m512 iv = _mm512_set1_ps(inv);
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i sh = _mm512_set4_epi32(0x0F0B0703, 0x0E0A0602, 0x0D090501, 0x0C080400);   /* (r, i) -> (i, r) */
    __m512i c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
    for (int64_t p = 0; p < P; p += 4) {
        __m512 x[8];                          /* x[2r]: row p + r, columns 0-15; x[2r + 1]: 16-31 */
        UNROLL
        for (int r = 0; r < 4; r++) {
            __m512i v = _mm512_loadu_si512(Rs + (p + r) * 32);
            x[2 * r] = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
            x[2 * r + 1] = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
        }
        vmul_n(x, x, iv, 8);
        __m512i lo = _mm512_shuffle_epi8(_mm512_packs_epi16(_mm512_packs_epi32(vround(x[0]), vround(x[2])),
                                                            _mm512_packs_epi32(vround(x[4]), vround(x[6]))), sh);
        __m512i hi = _mm512_shuffle_epi8(_mm512_packs_epi16(_mm512_packs_epi32(vround(x[1]), vround(x[3])),
                                                            _mm512_packs_epi32(vround(x[5]), vround(x[7]))), sh);
        c0 = _mm512_dpbusd_epi32(c0, ones, lo);
        c1 = _mm512_dpbusd_epi32(c1, ones, hi);
        _mm512_storeu_si512(dst + p * 32, lo);
        _mm512_storeu_si512(dst + p * 32 + 64, hi);
    }
    _mm512_storeu_si512(cs + j0, c0);
    _mm512_storeu_si512(cs + j0 + 16, c1);
}
/* Sixteen rows n of D (v[0..15], lane = column m) quantized (u8 = level + 128, 1 .. 255) and
 * stored transposed: row m at A + m * lda, 16 bytes. The levels are narrowed with saturating
 * packs (exact on 1 .. 255), which leave b[j] byte 16t + 4r + i = (n = 4j + r, m = 4t + i);
 * then bytes and dwords are moved into place. */
INL void q_tr16(const __m512 *v, __m512 iv, uint8_t *A, int64_t lda) {
    __m512i w[8], b[4];
    __m512 t[16];
    vmul_n(t, v, iv, 16);
    UNROLL
    for (int k = 0; k < 8; k++) w[k] = _mm512_packs_epi32(vround_off(t[2 * k], 128), vround_off(t[2 * k + 1], 128));
    /* within each 16-byte lane t: (r, i) -> (i, r) */
    const __m512i sh = _mm512_set4_epi32(0x0F0B0703, 0x0E0A0602, 0x0D090501, 0x0C080400);
    UNROLL
    for (int j = 0; j < 4; j++) b[j] = _mm512_shuffle_epi8(_mm512_packus_epi16(w[2 * j], w[2 * j + 1]), sh);
    /* c[t] lane j = b[j] lane t */
    __m512i t0 = _mm512_shuffle_i32x4(b[0], b[1], 0x44), t1 = _mm512_shuffle_i32x4(b[0], b[1], 0xEE);
    __m512i t2 = _mm512_shuffle_i32x4(b[2], b[3], 0x44), t3 = _mm512_shuffle_i32x4(b[2], b[3], 0xEE);
    __m512i c[4] = {_mm512_shuffle_i32x4(t0, t2, 0x88), _mm512_shuffle_i32x4(t0, t2, 0xDD),
                    _mm512_shuffle_i32x4(t1, t3, 0x88), _mm512_shuffle_i32x4(t1, t3, 0xDD)};
    /* c[t] dword 4j + i holds rows n = 4j .. 4j+3 of column m = 4t + i; row m wants dwords j = 0..3 */
    const __m512i pd = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    UNROLL
    for (int t = 0; t < 4; t++) {
        __m512i o = _mm512_permutexvar_epi32(pd, c[t]);
        _mm_storeu_si128((__m128i *)(A + (4 * t + 0) * lda), _mm512_castsi512_si128(o));
        _mm_storeu_si128((__m128i *)(A + (4 * t + 1) * lda), _mm512_extracti32x4_epi32(o, 1));
        _mm_storeu_si128((__m128i *)(A + (4 * t + 2) * lda), _mm512_extracti32x4_epi32(o, 2));
        _mm_storeu_si128((__m128i *)(A + (4 * t + 3) * lda), _mm512_extracti32x4_epi32(o, 3));
    }
}
#define DW_ROWS 32
/* A of the dW GEMM, columns 128b .. 128b+127 (D's block b, rows n) of rows m < Mr: D recomputed
 * 16 columns at a time from dy's rows of the block, quantized and transposed; the next 64
 * columns' lines are fetched meanwhile. */
static TGT void dw_fill(bwd_ctx *a, int64_t b) {
    int64_t Np = a->Np, M = a->M, Mr = a->ndw * DW_ROWS;
    uint8_t *A = a->Adw + b * QB;
    if (a->kind_d != 1) {
        for (int64_t m = 0; m < Mr; m++) memset(A + m * Np, 128, QB);
        return;
    }
    __m512 iv = _mm512_set1_ps(a->inv_d);
    int64_t n1 = b * QB + QB < a->N ? b * QB + QB : a->N;
    for (int64_t c0 = 0; c0 < M; c0 += 64) {
        if (c0 + 64 < M)
            for (int64_t n = b * QB; n < n1; n++) {
                const char *r = (const char *)(a->dy + n * M + c0 + 64);
                _mm_prefetch(r, _MM_HINT_T0);
                _mm_prefetch(r + 64, _MM_HINT_T0);
            }
        for (int64_t m0 = c0; m0 < c0 + 64 && m0 < M; m0 += 16) {
            __m512 v[QB];
            d_block(a->dy, a->N, M, b, m0, v, NULL);
            for (int g = 0; g < QB; g += 16) q_tr16(v + g, iv, A + m0 * Np + g, Np);
        }
    }
    for (int64_t m = (M + 15) / 16 * 16; m < Mr; m++) memset(A + m * Np, 128, QB);   /* rows past M */
}
/* Rows [r0, r1) of dx's A: G recomputed and quantized (levels narrowed with saturating
 * packs, exact on -127 .. 127, put back in order, offset by 128), then the GEMM. */
static TGT void dx_fill(bwd_ctx *a, int64_t r0, int64_t r1) {
    int64_t Mp = a->Mp;
    __m512 iv = _mm512_set1_ps(a->inv_g);
    const __m512i pd = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int64_t n = r0; n < r1; n++) {
        uint8_t *d = a->Adx + n * Mp;
        if (n >= a->N || a->kind_g != 1) { memset(d, 128, (size_t)Mp); continue; }
        for (int64_t c = 0; c < Mp / QB; c++) {
            __m512 x[8];
            g_chunk(a->dy + n * a->M, a->sw, a->M, c, x);
            vmul_n(x, x, iv, 8);
            UNROLL
            for (int h = 0; h < 2; h++) {    /* packs leave x[4h + a] elements 4l .. 4l+3 in dword 4l + a */
                __m512i b = _mm512_packs_epi16(_mm512_packs_epi32(vround(x[4 * h]), vround(x[4 * h + 1])),
                                               _mm512_packs_epi32(vround(x[4 * h + 2]), vround(x[4 * h + 3])));
                b = _mm512_xor_si512(_mm512_permutexvar_epi32(pd, b), _mm512_set1_epi8((char)0x80));   /* q + 128 */
                _mm512_storeu_si512(d + c * QB + 64 * h, b);
            }
        }
    }
}
static void bwd_b3(void *ctx, int64_t t) {
    bwd_ctx *a = (bwd_ctx *)ctx;
    if (t < a->ndf) {     /* the larger tasks first: a block of 128 rows of dy, read in order for
                             dx's A rows, then from cache by columns for dW's A */
        int64_t r0 = t * QB, r1 = r0 + QB < a->ndx * a->dxrows ? r0 + QB : a->ndx * a->dxrows;
        if (a->dx && r0 < r1) {
            uint64_t t0 = qp_start(a->prof);
            dx_fill(a, r0, r1);
            qp_add(&g_qt_busy[QT_B_DX_FILL], t0);
        }
        if (a->dw) {
            uint64_t t0 = qp_start(a->prof);
            dw_fill(a, t);
            qp_add(&g_qt_busy[QT_B_DW_FILL], t0);
        }
        return;
    }
    t -= a->ndf;
    uint64_t t0 = qp_start(a->prof);
    if (t < a->nbw) {
        pack_r_panel(a->Rw, a->Mp, a->inv_rw, a->kind_rw, a->Bw, a->csw, t);
        qp_add(&g_qt_busy[QT_B_PACK_W], t0);
        return;
    }
    t -= a->nbw;
    pack_r_panel(a->Rx, a->Np, a->inv_rx, a->kind_rx, a->Bx, a->csx, t);
    qp_add(&g_qt_busy[QT_B_PACK_X], t0);
}

/* dx and dW tasks: rows of the GEMMs (A filled in B3). */
static void dx_task(bwd_ctx *a, int64_t t) { gemm_rows(&a->gdx, t * a->dxrows, t * a->dxrows + a->dxrows); }
static void dw_task(bwd_ctx *a, int64_t t) { gemm_rows(&a->gdw, t * DW_ROWS, t * DW_ROWS + DW_ROWS); }
static void bwd_b4(void *ctx, int64_t t) {
    bwd_ctx *a = (bwd_ctx *)ctx;
    uint64_t t0 = qp_start(a->prof);
    if (t < a->ndw) { dw_task(a, t); qp_add(&g_qt_busy[QT_B_DW_GEMM], t0); return; }   /* the dW tasks first: fewer, larger */
    dx_task(a, t - a->ndw);
    qp_add(&g_qt_busy[QT_B_DX_GEMM], t0);
}

int o1b_qlinear_backward_vnni(int64_t N, int64_t K, int64_t M, const bf16 *dy, const bf16 *x,
                              const bf16 *w, float *dx, float *dw, const o1b_qweights *pw, int same_x) {
    if (!o1b_q_vnni_available()) return 0;
    bwd_ctx a;
    memset(&a, 0, sizeof a);
    a.prof = qp_on();
    uint64_t tcall = qp_start(a.prof);
    a.N = N; a.K = K; a.M = M; a.dy = dy; a.x = x; a.w = w; a.dx = dx; a.dw = dw;
    a.Mp = pad_qb(M); a.Np = pad_qb(N); a.Kp = (K + NR - 1) / NR * NR;
    int64_t Mp = a.Mp, Np = a.Np, Kp = a.Kp;
    /* W's part (s_w, clip marks, B_w with its sums and scale): held (pw), or computed in B1-B3 */
    a.nwp = pw ? 0 : (M + NR - 1) / NR;
    a.xper = 1 << 15;
    /* s_x: the forward's on these held weights where x is that forward's (same_x: the same array,
       unchanged, by the caller; the same pointer and rows here), else B1's absmax of x */
    int fwd_sx = dw && pw && same_x && pw->fx == x && pw->fN == N;
    a.nxc = dw && !fwd_sx ? (N * K + a.xper - 1) / a.xper : 0;
    a.ngt = dx || dw ? Np / QB : 0;
    a.nks = (K + 31) / 32;
    a.nrw = dx && !pw ? Mp / QB : 0;
    a.nbw = dx && !pw ? Kp / NR : 0;
    a.nrx = dw ? Np / QB : 0;
    a.dxrows = pick_rowchunk(N);
    a.ndx = dx ? (N + a.dxrows - 1) / a.dxrows : 0;
    a.ndw = dw ? (M + DW_ROWS - 1) / DW_ROWS : 0;
    a.ndf = dx || dw ? Np / QB : 0;
    int64_t Nr = a.ndx * a.dxrows, Mr = a.ndw * DW_ROWS;
    /* the work buffers, in one block: pass 0 sizes it, pass 1 hands out the pieces */
    arena ar = {0};
    int ok = 1;
    for (int pass = 0; pass < 2 && ok; pass++) {
#define QALLOC(ptr, type, n) do { size_t b_ = (size_t)((n) > 0 ? (n) : 1) * sizeof(type); \
        if (pass == 0) arena_add(&ar, b_); else ptr = (type *)arena_take(&ar, b_); } while (0)
        if (!pw) {
            QALLOC(a.sw, float, Mp);
            QALLOC(a.qw, int8_t, M * K);
        }
        if (dw) {
            if (!pw) QALLOC(a.clip, uint8_t, M * K);
            QALLOC(a.xmax, uint32_t, a.nxc);
            QALLOC(a.dmax, uint32_t, a.ngt);
            QALLOC(a.rxmax, uint32_t, a.nrx);
            QALLOC(a.Rx, int16_t, Np * Kp);
            QALLOC(a.Bx, int8_t, Kp * Np);
            QALLOC(a.csx, int32_t, Kp);
            QALLOC(a.Adw, uint8_t, Mr * Np);
        }
        if (dx) {
            QALLOC(a.gmax, uint32_t, a.ngt);
            if (!pw) {
                QALLOC(a.rwmax, uint32_t, a.nrw);
                QALLOC(a.Rw, int16_t, Mp * Kp);
                QALLOC(a.Bw, int8_t, Kp * Mp);
                QALLOC(a.csw, int32_t, Kp);
            }
            QALLOC(a.Adx, uint8_t, Nr * Mp);
        }
        if (pass == 0) ok = arena_open(&ar);
    }
#undef QALLOC
    if (ok && pw) {
        a.sw = pw->sw; a.clip = pw->clip; a.Bw = pw->Bw; a.csw = pw->csw;
        atomic_fetch_add_explicit(&g_held_runs, 1, memory_order_relaxed);
    }
    if (ok) {
        /* B1: weights, absmax of x */
        run_tasks(a.nwp + a.nxc, a.nwp * NR * K * 4 + (dw ? N * K / 4 : 0), bwd_b1, &a, a.prof ? QP_B1 : -1);
        float sx = 0.0f, sd = 0.0f;
        if (dw) {
            sx = fwd_sx ? pw->fsx : scale_from_bf16bits(max_of(a.xmax, a.nxc));
            a.kind_x = scale_kind(sx); a.inv_x = inv_of(sx);
            if (fwd_sx) atomic_fetch_add_explicit(&g_sx_reused, 1, memory_order_relaxed);
        }
        /* B2: absmax of G and of D; R = rot(q_w), X = rot(q_x) */
        run_tasks(a.ngt + a.nrw + a.nrx, (dx ? N * Mp * 3 + a.nrw * QB * K : 0) + (dw ? Np * M * 2 + Np * K * 2 : 0), bwd_b2, &a, a.prof ? QP_B2 : -1);
        float sg = 0.0f, srw = 0.0f, srx = 0.0f;
        if (dx) {
            sg = scale_from_bits(max_of(a.gmax, a.ngt));
            a.kind_g = scale_kind(sg); a.inv_g = inv_of(sg);
            srw = pw ? pw->srw : scale_from_intmax(max_of(a.rwmax, a.nrw));
            a.kind_rw = scale_kind(srw); a.inv_rw = inv_of(srw);
        }
        if (dw) {
            sd = scale_from_bits(max_of(a.dmax, a.ngt));
            a.kind_d = scale_kind(sd); a.inv_d = inv_of(sd);
            srx = scale_from_intmax(max_of(a.rxmax, a.nrx));
            a.kind_rx = scale_kind(srx); a.inv_rx = inv_of(srx);
        }
        /* B3: R and X packed as B */
        run_tasks(a.ndf + a.nbw + (dw ? Kp / NR : 0), (dx ? a.nbw * NR * Mp * 2 + N * Mp * 3 : 0) + (dw ? Np * K * 2 + Np * M * 3 : 0), bwd_b3, &a, a.prof ? QP_B3 : -1);
        /* B4: the two GEMMs */
        gemm_job gdx = {N, K, Mp, a.Adx, a.Bw, a.csw, EP_DX, sg, srw, 0.0f, NULL, NULL, dx, NULL};
        gemm_job gdw = {M, K, Np, a.Adw, a.Bx, a.csx, EP_DW, sd, srx, sx, NULL, a.clip, dw, NULL};
        a.gdx = gdx; a.gdw = gdw;
        run_tasks(a.ndw + a.ndx, (dx ? N * K * Mp / 64 : 0) + (dw ? M * K * Np / 64 : 0), bwd_b4, &a, a.prof ? QP_B4 : -1);
        arena_close(&ar);
    }
    if (ok && tcall) {
        atomic_fetch_add_explicit(&g_qp_calls[1], 1, memory_order_relaxed);
        qp_add(&g_qp_call_wall[1], tcall);
    }
    return ok;
}

/* ------------------------------------------------------------------ held weights */
/* W's operands for later calls on the same unchanged W: the forward's F1 part and the backward's
 * B1-B3 parts, by the same functions (so the same bytes), into one block of memory. */
o1b_qweights *o1b_qweights_new_vnni(int64_t M, int64_t K, const bf16 *w) {
    if (!o1b_q_vnni_available()) return NULL;
    int64_t P4 = (K + 3) / 4 * 4, Jp = (M + NR - 1) / NR * NR, Mp = pad_qb(M), Kp = (K + NR - 1) / NR * NR;
    o1b_qweights *q = (o1b_qweights *)calloc(1, sizeof *q);
    if (!q) return NULL;
    size_t sz[6] = {(size_t)Mp * sizeof(float), (size_t)(Jp * P4), (size_t)Jp * sizeof(int32_t),
                    (size_t)(M * K), (size_t)(Kp * Mp), (size_t)Kp * sizeof(int32_t)};
    size_t total = 0;
    for (int i = 0; i < 6; i++) total += arena_round(sz[i] > 0 ? sz[i] : 1);
    q->mem = arena_alloc(total);
    arena sc = {0};
    arena_add(&sc, (size_t)(M * K));
    arena_add(&sc, (size_t)(Mp * Kp) * sizeof(int16_t));
    arena_add(&sc, (size_t)(Mp / QB) * sizeof(uint32_t));
    if (!q->mem || !arena_open(&sc)) { free(q->mem); free(q); return NULL; }
    char *c = q->mem;
    void *part[6];
    for (int i = 0; i < 6; i++) { part[i] = c; c += arena_round(sz[i] > 0 ? sz[i] : 1); }
    q->M = M; q->K = K; q->w = w; q->bytes = (int64_t)total;
    q->sw = (float *)part[0]; q->Bf = (int8_t *)part[1]; q->csf = (int32_t *)part[2];
    q->clip = (uint8_t *)part[3]; q->Bw = (int8_t *)part[4]; q->csw = (int32_t *)part[5];
    memset(q->sw, 0, sz[0]);
    /* per weight panel, B1's part (s_w, q_w, clip marks) and the forward's packed q_w from it;
       then B2 (R) and B3 (R packed) */
    bwd_ctx b;
    memset(&b, 0, sizeof b);
    b.M = M; b.K = K; b.Mp = Mp; b.Kp = Kp; b.w = w; b.sw = q->sw; b.clip = q->clip;
    b.nwp = (M + NR - 1) / NR; b.nks = (K + 31) / 32; b.nrw = Mp / QB; b.nbw = Kp / NR;
    b.qw = (int8_t *)arena_take(&sc, (size_t)(M * K));
    b.Rw = (int16_t *)arena_take(&sc, (size_t)(Mp * Kp) * sizeof(int16_t));
    b.rwmax = (uint32_t *)arena_take(&sc, (size_t)(Mp / QB) * sizeof(uint32_t));
    b.Bw = q->Bw; b.csw = q->csw;
    held_ctx hc = {&b, P4, q->Bf, q->csf};
    run_tasks(b.nwp, M * K * 5, held_panel, &hc, -1);       /* nwp = Jp / NR panels */
    run_tasks(b.nrw, Mp * K, bwd_b2, &b, -1);
    q->srw = scale_from_intmax(max_of(b.rwmax, b.nrw));
    b.kind_rw = scale_kind(q->srw); b.inv_rw = inv_of(q->srw);
    run_tasks(b.nbw, Mp * K * 2, bwd_b3, &b, -1);
    arena_close(&sc);
    return q;
}
void o1b_qweights_free_vnni(o1b_qweights *pw) {
    if (pw) { free(pw->mem); free(pw); }
}
int64_t o1b_qweights_bytes_vnni(const o1b_qweights *pw) { return pw ? pw->bytes : 0; }
int o1b_qweights_fits_vnni(const o1b_qweights *pw, const bf16 *w, int64_t M, int64_t K) {
    return pw && pw->w == w && pw->M == M && pw->K == K;
}
void o1b_qweights_forget_x(const o1b_qweights *pw) {
    if (pw) ((o1b_qweights *)pw)->fx = NULL;     /* the calling thread's handle (weights_held) */
}

/* ------------------------------------------------------------------ the plain int8 GEMM */
typedef struct { int64_t I, J, P, P4, Ip, rowchunk, na; const int8_t *A, *B; uint8_t *Au; int8_t *Bp; int32_t *cs; gemm_job gj; } gi8_ctx;
static void gi8_pack(void *ctx, int64_t t) {
    gi8_ctx *g = (gi8_ctx *)ctx;
    int64_t P = g->P, P4 = g->P4;
    if (t < g->na) {                               /* A rows: u8 = a + 128, padding 128 */
        for (int64_t i = t * 16; i < t * 16 + 16; i++) {
            uint8_t *d = g->Au + i * P4;
            if (i < g->I) {
                const int8_t *s = g->A + i * P;
                for (int64_t p = 0; p < P; p++) d[p] = (uint8_t)((uint8_t)s[p] ^ 0x80u);
                for (int64_t p = P; p < P4; p++) d[p] = 128;
            } else memset(d, 128, (size_t)P4);
        }
        return;
    }
    int64_t jp = t - g->na;                       /* one 32-column panel of B with its sums */
    int8_t *dst = g->Bp + jp * NR * P4;
    memset(dst, 0, (size_t)(NR * P4));
    for (int64_t jl = 0; jl < NR; jl++) {
        int64_t j = jp * NR + jl;
        if (j >= g->J) { g->cs[j] = 0; continue; }
        const int8_t *b = g->B + j * P;
        int32_t s = 0;
        for (int64_t p = 0; p < P; p++) { dst[(p / 4) * 128 + jl * 4 + (p % 4)] = b[p]; s += b[p]; }
        g->cs[j] = s;
    }
}
static void gi8_run(void *ctx, int64_t t) {
    gi8_ctx *g = (gi8_ctx *)ctx;
    int64_t r0 = t * g->rowchunk, r1 = r0 + g->rowchunk < g->Ip ? r0 + g->rowchunk : g->Ip;
    gemm_rows(&g->gj, r0, r1);
}
int o1b_gemm_i8_vnni(int64_t I, int64_t J, int64_t P, const int8_t *A, const int8_t *B, int32_t *C) {
    if (!o1b_q_vnni_available()) return 0;
    gi8_ctx g;
    memset(&g, 0, sizeof g);
    g.I = I; g.J = J; g.P = P; g.A = A; g.B = B;
    g.P4 = (P + 3) / 4 * 4;
    g.rowchunk = pick_rowchunk(I);
    g.Ip = (I + g.rowchunk - 1) / g.rowchunk * g.rowchunk;
    g.na = g.Ip / 16;
    int64_t np = (J + NR - 1) / NR;
    arena ar = {0};
    size_t sz[3] = {(size_t)(g.Ip * g.P4), (size_t)(np * NR * g.P4), (size_t)(np * NR) * sizeof(int32_t)};
    for (int i = 0; i < 3; i++) arena_add(&ar, sz[i]);
    int ok = arena_open(&ar);
    if (ok) {
        g.Au = (uint8_t *)arena_take(&ar, sz[0]);
        g.Bp = (int8_t *)arena_take(&ar, sz[1]);
        g.cs = (int32_t *)arena_take(&ar, sz[2]);
        run_tasks(g.na + np, (I + J) * P, gi8_pack, &g, -1);
        gemm_job j = {I, J, g.P4, g.Au, g.Bp, g.cs, EP_RAW, 0.0f, 0.0f, 0.0f, NULL, NULL, NULL, C};
        g.gj = j;
        run_tasks(g.Ip / g.rowchunk, I * J * P / 64, gi8_run, &g, -1);
        arena_close(&ar);
    }
    return ok;
}

/* ------------------------------------------------------------------ test hook */
/* The lane-wise helpers against the scalar contract, under the runner's FTZ|DAZ, on random and
 * crafted operands: products whose exact value lies within a few ulps of 2^-126 on either side
 * (where the hardware's product and o1b_mul can differ and vmul must take its scalar path),
 * subnormal operands, and level() on ties and out-of-range values; vmul_n on the same products
 * in a batch. Returns the number of mismatches; *boundary counts the products that came out at
 * exactly ±2^-126 in hardware. */
typedef struct { uint64_t seed; int64_t n, bad, boundary; } st_ctx;
static uint64_t st_next(uint64_t *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }
static TGT void selftest_task(void *ctx, int64_t t) {
    st_ctx *c = (st_ctx *)ctx;
    uint64_t s = c->seed * 2654435761u + 1;
    (void)t;
    for (int64_t it = 0; it < c->n; it++) {
        float fa[16], fb[16], fr[16], tt[16];
        for (int l = 0; l < 16; l++) {
            uint64_t r = st_next(&s);
            uint32_t ua = (uint32_t)(0x1F000000u + (r % 0x0F000000u));   /* 2^-65 .. 2^-35 */
            fa[l] = qfrom(ua | ((r >> 40) & 1 ? 0x80000000u : 0));
            int kind = (int)((r >> 41) % 4);
            if (kind == 0) fb[l] = qfrom((uint32_t)(st_next(&s) & 0xFFFFFFFFu));       /* any bits */
            else {                                       /* a·b within a few ulps of 2^-126 */
                double target = 0x1p-126 * (1.0 + (double)((int)((r >> 43) % 9) - 5) * 0x1p-25);
                fb[l] = (float)(target / (double)fa[l]);
                if (kind == 3) fa[l] = qfrom((uint32_t)((r >> 20) & 0x007FFFFFu));   /* subnormal */
            }
            if (fb[l] != fb[l]) fb[l] = 1.0f;
            tt[l] = (float)((int64_t)(r % 601) - 300) * 0.5f;            /* level: ties, clamps */
        }
        __m512 a = _mm512_loadu_ps(fa), b = _mm512_loadu_ps(fb);
        __m512 raw = _mm512_mul_ps(a, b);
        c->boundary += __builtin_popcount(_mm512_cmpeq_epi32_mask(
            _mm512_and_si512(_mm512_castps_si512(raw), _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x00800000)));
        _mm512_storeu_ps(fr, vstore(vmul(a, b)));
        float fn[16];                            /* the batched test: a among seven ordinary products */
        __m512 in8[8], out8[8];
        for (int i = 0; i < 8; i++) in8[i] = i == (int)(it & 7) ? a : _mm512_set1_ps(1.0f);
        vmul_n(out8, in8, b, 8);
        _mm512_storeu_ps(fn, vstore(out8[it & 7]));
        int32_t q[16];
        _mm512_storeu_si512(q, vlevel_off(_mm512_loadu_ps(tt), 128));
        for (int l = 0; l < 16; l++) {
            float want = o1b_store(o1b_mul(o1b_flush(fa[l]), o1b_flush(fb[l])));
            c->bad += qbits(fr[l]) != qbits(want);
            c->bad += qbits(fn[l]) != qbits(want);
            c->bad += q[l] != (int32_t)o1b_level(tt[l]) + 128;
        }
    }
}
O1B_API int64_t o1b_q_vnni_selftest(uint64_t seed, int64_t n, int64_t *boundary) {
    if (!o1b_q_vnni_available()) { *boundary = 0; return 0; }
    st_ctx c = {seed, n, 0, 0};
    run_tasks(1, 0, (task_fn)selftest_task, &c, -1);
    *boundary = c.boundary;
    return c.bad;
}

#else  /* not x86-64 with GCC/clang: the portable code in quant.c does everything */
int o1b_q_vnni_available(void) { return 0; }
o1b_qweights *o1b_qweights_new_vnni(int64_t M, int64_t K, const bf16 *w) { (void)M; (void)K; (void)w; return NULL; }
void o1b_qweights_free_vnni(o1b_qweights *pw) { (void)pw; }
int64_t o1b_qweights_bytes_vnni(const o1b_qweights *pw) { (void)pw; return 0; }
int o1b_qweights_fits_vnni(const o1b_qweights *pw, const bf16 *w, int64_t M, int64_t K) { (void)pw; (void)w; (void)M; (void)K; return 0; }
void o1b_qweights_forget_x(const o1b_qweights *pw) { (void)pw; }
O1B_API int64_t o1b_q_held_runs(void) { return 0; }
O1B_API int64_t o1b_q_sx_reused(void) { return 0; }
O1B_API void o1b_q_profile(int on) { (void)on; }
O1B_API void o1b_q_profile_reset(void) {}
O1B_API int64_t o1b_q_vnni_peak_loop(int64_t n) { (void)n; return 0; }
O1B_API int o1b_q_profile_read(uint64_t *out, int n) { (void)out; (void)n; return 0; }
int o1b_qlinear_forward_vnni(int64_t N, int64_t K, int64_t M, const bf16 *x, const bf16 *w, float *y,
                             const o1b_qweights *pw) {
    (void)N; (void)K; (void)M; (void)x; (void)w; (void)y; (void)pw;
    return 0;
}
int o1b_qlinear_backward_vnni(int64_t N, int64_t K, int64_t M, const bf16 *dy, const bf16 *x,
                              const bf16 *w, float *dx, float *dw, const o1b_qweights *pw, int same_x) {
    (void)N; (void)K; (void)M; (void)dy; (void)x; (void)w; (void)dx; (void)dw; (void)pw; (void)same_x;
    return 0;
}
int o1b_gemm_i8_vnni(int64_t I, int64_t J, int64_t P, const int8_t *A, const int8_t *B, int32_t *C) {
    (void)I; (void)J; (void)P; (void)A; (void)B; (void)C;
    return 0;
}
O1B_API int64_t o1b_q_vnni_selftest(uint64_t seed, int64_t n, int64_t *boundary) {
    (void)seed; (void)n;
    *boundary = 0;
    return 0;
}
#endif
