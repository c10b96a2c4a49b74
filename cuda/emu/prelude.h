/* prelude.h — the CUDA kernel environment as plain C++, so that the exact .cu text of cuda/ runs
 * on a CPU (the CUDA emulator, cuda/emu/__init__.py). Compiled with g++ -O2 -ffp-contract=off
 * -fno-fast-math (no -march), so every float operation below is one IEEE binary32 operation.
 *
 * What it maps:
 *   - __global__/__device__/__host__/__forceinline__/__noinline__: plain (inline) C++ functions;
 *     __align__(n): the alignment attribute.
 *   - threadIdx/blockIdx/blockDim/gridDim: globals that the scheduler sets before it runs a thread.
 *   - __shared__: a function-local static, i.e. one array shared by all threads of the block that is
 *     running (blocks run one after another), poisoned at each block's start. Dynamic (extern)
 *     shared memory is not supported.
 *   - __syncthreads(): a faithful barrier. The threads of a block are cooperative fibers (one stack
 *     each; metal/emu/fiber_switch.h's stack switch, or ucontext's). The scheduler runs every runnable fiber, in thread order (or reversed, for
 *     the race check), until it reaches a barrier or returns; when all have reached the barrier they
 *     all pass it; a thread that returns while others wait at a barrier is "barrier divergence".
 *   - warps: emu_warp_sync() is a warp-collective step (threads 32w ... 32w + 31 of the block, in
 *     linear thread order, form warp w, as on the GPU): a lane waits there until all 32 lanes of
 *     its warp have arrived, then they all go on. A warp whose lanes do not all arrive (some wait
 *     at __syncthreads or returned, or the block has a partial warp) is "warp divergence", an error,
 *     as a .sync warp instruction requires every lane. The scheduler runs warp by warp, and a warp
 *     whose lanes all arrived goes on at once, so it runs ahead of the warps after it: a missing
 *     __syncthreads between warps shows up in the race check (first warp ahead vs last warp ahead).
 *     emu_warp_index() and emu_warp_lane() name the running thread's warp and lane. Instruction
 *     models built on it (imma.cuh; __shfl_sync with a full mask) keep their per-warp state in
 *     plain static arrays, as blocks run one after another.
 *   - the intrinsics the contract allows: __fadd_rn, __fsub_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn,
 *     __fmaf_rn, __dmul_rn, __float_as_uint, __uint_as_float, __int2float_rn, __float2int_rz,
 *     __umulhi; PTX fma.rn.ftz.f32 (emu_fma_rn_ftz, for contract.cuh's o1b_fma_ftz), mul.rn.ftz.f32 and
 *     add.rn.ftz.f32 (emu_mul_rn_ftz, emu_add_rn_ftz, for cuda/ftz.cuh); float4, uint4;
 *     atomicMin and atomicMax on int, atomicAdd on unsigned int, __threadfence; __launch_bounds__
 *     (ignored).
 *     The single-precision ones are the fp32 unit of hwfloat.h (included before this file, with
 *     O1B_HW_DAZ = EMU_FTZ != 0 and O1B_HW_FTZ = EMU_FTZ, and any planted fault or adversarial
 *     flushing of emu.hardware()). EMU_FTZ selects how they treat subnormals: 0 IEEE gradual
 *     underflow, 1 flush inputs and results with tininess detected after rounding (x86-like), 2
 *     flush with tininess detected before rounding. The contract helpers must give the same bits in
 *     all three (tests/backends/test_cuda_backend.py runs them), which is what makes CuPy's -ftz=true harmless.
 */
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700   /* macOS only offers the ucontext routines under this (untested there) */
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <ucontext.h>
#include <string>
#include <type_traits>
#include <utility>

#ifndef EMU_FTZ
#define EMU_FTZ 1
#endif

struct emu_uint3 { unsigned int x, y, z; };
typedef emu_uint3 uint3;
typedef emu_uint3 dim3;
static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
/* Every __shared__ array lives in the section "emu_shared", which the scheduler poisons at the
 * start of each block (0xFF bytes, NaN, in thread order; 0x7F bytes, 3.39e38, in reverse order), as
 * CUDA shared memory starts undefined: a read before the block's own write shows up as a wrong
 * value and, under the race check, as a difference between the two orders. */
#if defined(__ELF__)
#define __shared__ static __attribute__((section("emu_shared")))
extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));
static void emu_poison_shared(int reverse) {
    if (__start_emu_shared && __stop_emu_shared && __stop_emu_shared > __start_emu_shared)
        memset(__start_emu_shared, reverse ? 0x7F : 0xFF, (size_t)(__stop_emu_shared - __start_emu_shared));
}
#else   /* no linker-made section bounds: shared memory is not poisoned */
#define __shared__ static
static void emu_poison_shared(int) {}
#endif

/* ---- intrinsics ---- */
static inline unsigned int __float_as_uint(float x) { unsigned int u; memcpy(&u, &x, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float x; memcpy(&x, &u, 4); return x; }
static inline float __int2float_rn(int i) { return (float)i; }
static inline int __float2int_rz(float x) { return (int)x; }
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((uint64_t)a * (uint64_t)b) >> 32);
}
static inline double __dmul_rn(double a, double b) { return a * b; }

static inline float __fadd_rn(float a, float b) { return o1b_hw_add(a, b); }
static inline float __fsub_rn(float a, float b) { return o1b_hw_sub(a, b); }
static inline float __fmul_rn(float a, float b) { return o1b_hw_mul(a, b); }
static inline float __fdiv_rn(float a, float b) { return o1b_hw_div(a, b); }
static inline float __fsqrt_rn(float x) { return o1b_hw_sqrt(x); }
static inline float __fmaf_rn(float a, float b, float c) { return o1b_hw_fma(a, b, c); }
/* PTX fma.rn.ftz.f32, which contract.cuh's o1b_fma_ftz issues as inline assembly on a GPU */
static inline float emu_fma_rn_ftz(float a, float b, float c) { return o1b_hw_fma_ftz(a, b, c); }
/* PTX mul.rn.ftz.f32 and add.rn.ftz.f32 (cuda/ftz.cuh's o1b_mul_ftz, o1b_add_ftz) */
static inline float emu_mul_rn_ftz(float a, float b) { return o1b_hw_mul_ftz(a, b); }
static inline float emu_add_rn_ftz(float a, float b) { return o1b_hw_add_ftz(a, b); }

/* 128-bit vector of four floats (16-byte aligned, as CUDA's) for vectorized shared-memory access */
struct alignas(16) float4 { float x, y, z, w; };
static inline float4 make_float4(float x, float y, float z, float w) { float4 v = {x, y, z, w}; return v; }
struct alignas(16) uint4 { unsigned int x, y, z, w; };

/* Atomics: fibers switch only at barriers and returns, so a read-modify-write is atomic as written. */
static inline int atomicMin(int *p, int v) { int old = *p; if (v < old) *p = v; return old; }
static inline int atomicMax(int *p, int v) { int old = *p; if (v > old) *p = v; return old; }
static inline unsigned int atomicAdd(unsigned int *p, unsigned int v) {
    unsigned int old = *p; *p = old + v; return old;
}
/* Blocks run one after another (last to first in the race check's reverse pass), so every store of a
 * finished block is visible: a fence orders nothing more. */
static inline void __threadfence(void) {}

/* ---- the block scheduler ---- */
/* Fibers switch with emu_switch where fiber_switch.h (pasted before this file) defines
 * EMU_FAST_SWITCH, with ucontext's swapcontext otherwise: the same schedule either way. */

enum { EMU_RUNNABLE = 0, EMU_AT_BARRIER = 1, EMU_DONE = 2, EMU_AT_WARP = 3 };
struct emu_fiber {
    void *sp; int state; ucontext_t ctx;
    unsigned mma_calls;           /* this thread's o1b_mma_s8_16x8x32 calls in the block (cuda/imma.cuh) */
    uint3 idx;                    /* its threadIdx (set when the block starts: no division per switch) */
#if O1B_HW_STATEFUL
    o1b_hw_thread hw;             /* the fp32 unit's state of this thread while it waits */
#endif
};

static ucontext_t emu_sched_ctx;
static void *emu_sched_sp = 0;
static emu_fiber *emu_fibers = 0;
static char *emu_stacks = 0;
static int emu_capacity = 0;
static int emu_current = -1;
static int emu_direct = 0;
static void (*emu_body)(void **) = 0;
static void **emu_args = 0;
static const size_t EMU_STACK = 256 * 1024;

static void emu_set_thread(int t) {
    threadIdx.x = t % blockDim.x;
    threadIdx.y = (t / blockDim.x) % blockDim.y;
    threadIdx.z = t / (blockDim.x * blockDim.y);
}

/* from the current fiber back to the scheduler */
static void emu_yield(void) {
#ifdef EMU_FAST_SWITCH
    emu_switch(&emu_fibers[emu_current].sp, emu_sched_sp);
#else
    swapcontext(&emu_fibers[emu_current].ctx, &emu_sched_ctx);
#endif
}

static void __syncthreads(void) {
    if (emu_direct) {   /* cannot happen: the driver uses fibers for any source naming __syncthreads */
        fprintf(stderr, "cuda emulator: __syncthreads() in a kernel launched without fibers\n");
        abort();
    }
    emu_fibers[emu_current].state = EMU_AT_BARRIER;
    emu_yield();
}

/* ---- warps ---- */
static int emu_warp_index(void) { return emu_current >> 5; }
static int emu_warp_lane(void) { return emu_current & 31; }
static void emu_warp_sync(void) {
    if (emu_direct) {   /* cannot happen: the driver uses fibers for any source naming emu_warp_sync */
        fprintf(stderr, "cuda emulator: a warp-collective step in a kernel launched without fibers\n");
        abort();
    }
    emu_fibers[emu_current].state = EMU_AT_WARP;
    emu_yield();
}

/* __shfl_sync(mask, v, src): the v of lane src (modulo 32) of the warp, for types of up to 8 bytes;
 * a warp-collective step, so every lane must take part (a partial mask is not modelled). */
static unsigned long long emu_shfl_slot[32][32];
template <class T> static T __shfl_sync(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= sizeof(unsigned long long), "__shfl_sync: at most 8 bytes");
    if (mask != 0xFFFFFFFFu) {
        fprintf(stderr, "cuda emulator: __shfl_sync with a partial mask is not modelled\n");
        abort();
    }
    int w = emu_warp_index();
    memcpy(&emu_shfl_slot[w][emu_warp_lane()], &v, sizeof(T));
    emu_warp_sync();                       /* every lane has placed its value */
    T r;
    memcpy(&r, &emu_shfl_slot[w][src & 31], sizeof(T));
    emu_warp_sync();                       /* every lane has read before any lane's next shuffle */
    return r;
}

static void emu_fiber_main(int t) {
    emu_body(emu_args);
    emu_fibers[t].state = EMU_DONE;
#ifdef EMU_FAST_SWITCH
    emu_yield();                      /* never resumed */
    abort();
#endif
    /* ucontext: returning resumes uc_link = the scheduler */
}

#ifdef EMU_FAST_SWITCH
static void emu_fiber_entry(void) { emu_fiber_main(emu_current); }
#endif

static int emu_reserve(int n) {
    if (n <= emu_capacity) return 0;
    free(emu_fibers); free(emu_stacks);
    emu_fibers = (emu_fiber *)calloc((size_t)n, sizeof(emu_fiber));
    emu_stacks = (char *)malloc((size_t)n * EMU_STACK);
    if (!emu_fibers || !emu_stacks) { emu_capacity = 0; return -1; }
    emu_capacity = n;
    return 0;
}

/* Runs one block; returns 0, or 1 on barrier divergence, 2 when out of memory, 3 on warp
 * divergence. */
static int emu_run_block(int nthreads, int reverse) {
    emu_poison_shared(reverse);
#if O1B_HW_STATEFUL
    unsigned long long first = (unsigned long long)nthreads
        * (blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z));
#endif
    if (emu_direct) {
        for (int k = 0; k < nthreads; k++) {
            int t = reverse ? nthreads - 1 - k : k;
            emu_set_thread(t);
#if O1B_HW_STATEFUL
            o1b_hw_start_thread(first + (unsigned)t);
#endif
            emu_body(emu_args);
        }
        return 0;
    }
    if (emu_reserve(nthreads)) return 2;
    for (int t = 0; t < nthreads; t++) {
        emu_fiber *f = &emu_fibers[t];
        f->state = EMU_RUNNABLE;
        f->mma_calls = 0;
        emu_set_thread(t);
        f->idx = threadIdx;
#if O1B_HW_STATEFUL
        o1b_hw_start_thread(first + (unsigned)t);
        f->hw = o1b_hw_cur;
#endif
#ifdef EMU_FAST_SWITCH
        f->sp = emu_prepare(emu_stacks + (size_t)t * EMU_STACK, EMU_STACK, emu_fiber_entry);
#else
        getcontext(&f->ctx);
        f->ctx.uc_stack.ss_sp = emu_stacks + (size_t)t * EMU_STACK;
        f->ctx.uc_stack.ss_size = EMU_STACK;
        f->ctx.uc_link = &emu_sched_ctx;
        makecontext(&f->ctx, (void (*)(void))emu_fiber_main, 1, t);
#endif
    }
    int nwarps = (nthreads + 31) / 32;
    for (;;) {
        /* one phase: warp by warp (in thread order or reversed), every thread up to a barrier or its
         * end; a warp whose 32 lanes all reach a warp-collective step goes on at once, so each warp
         * runs as far ahead of the next ones as it can (the race check compares the first warp
         * running ahead with the last) */
        for (int kw = 0; kw < nwarps; kw++) {
            int w = reverse ? nwarps - 1 - kw : kw;
            int lo = 32 * w, hi = lo + 32 < nthreads ? lo + 32 : nthreads;
            for (;;) {
                for (int k = lo; k < hi; k++) {
                    int t = reverse ? lo + hi - 1 - k : k;
                    if (emu_fibers[t].state != EMU_RUNNABLE) continue;
                    emu_current = t;
                    threadIdx = emu_fibers[t].idx;
#if O1B_HW_STATEFUL
                    o1b_hw_cur = emu_fibers[t].hw;
#endif
#ifdef EMU_FAST_SWITCH
                    emu_switch(&emu_sched_sp, emu_fibers[t].sp);
#else
                    swapcontext(&emu_sched_ctx, &emu_fibers[t].ctx);
#endif
#if O1B_HW_STATEFUL
                    emu_fibers[t].hw = o1b_hw_cur;
#endif
                }
                int n = 0;
                for (int t = lo; t < hi; t++) n += emu_fibers[t].state == EMU_AT_WARP;
                if (n == 0) break;
                if (n != 32) return 3;                /* a lane that can never arrive */
                for (int t = lo; t < hi; t++) emu_fibers[t].state = EMU_RUNNABLE;
            }
        }
        int waiting = 0, done = 0;
        for (int t = 0; t < nthreads; t++) {
            if (emu_fibers[t].state == EMU_AT_BARRIER) waiting++;
            else done++;
        }
        if (waiting == 0) return 0;
        if (done > 0) return 1;                     /* some threads exited, others wait: divergence */
        for (int t = 0; t < nthreads; t++) emu_fibers[t].state = EMU_RUNNABLE;   /* all pass */
    }
}

/* mode bit 0: reverse thread order; bit 1: direct (no fibers; the kernel has no barrier). */
extern "C" int emu_launch(void (*body)(void **), void **args, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, int mode) {
    emu_body = body; emu_args = args;
    emu_direct = (mode >> 1) & 1;
    gridDim.x = gx; gridDim.y = gy; gridDim.z = gz;
    blockDim.x = bx; blockDim.y = by; blockDim.z = bz;
    int nthreads = (int)(bx * by * bz);
    /* the reverse pass also runs the blocks last to first: a block that reads another block's writes
     * without an order the grid gives (e.g. a last block found by its index, not by a count) differs */
    int rb = mode & 1;
    for (unsigned z = 0; z < gz; z++)
        for (unsigned y = 0; y < gy; y++)
            for (unsigned x = 0; x < gx; x++) {
                blockIdx.x = rb ? gx - 1 - x : x; blockIdx.y = rb ? gy - 1 - y : y; blockIdx.z = rb ? gz - 1 - z : z;
                int rc = emu_run_block(nthreads, mode & 1);
                if (rc) return rc;
            }
    return 0;
}

/* ---- calling a kernel with CUDA-style arguments: an array of pointers to the values ---- */
template <class... A, size_t... I>
static void emu_call_impl(void (*f)(A...), void **a, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_cv<A>::type *>(a[I])...);
}
template <class... A>
static void emu_call(void (*f)(A...), void **a) { emu_call_impl(f, a, std::index_sequence_for<A...>{}); }

/* The parameter types as a string ("p,i8,f4,..."), so the driver can refuse arguments that the
 * real runtime would pass with the wrong width or type. */
template <class T> static std::string emu_code() {
    if (std::is_pointer<T>::value) return "p";
    std::string s = std::is_floating_point<T>::value ? "f" : (std::is_signed<T>::value ? "i" : "u");
    return s + std::to_string(sizeof(T));
}
template <class... A> static std::string emu_signature(void (*)(A...)) {
    std::string s;
    ((s += emu_code<A>(), s += ","), ...);
    return s;
}
#define EMU_KERNEL(name) \
    extern "C" void emu_tramp_##name(void **a) { emu_call(name, a); } \
    extern "C" const char *emu_sig_##name(void) { static std::string s = emu_signature(name); return s.c_str(); }
