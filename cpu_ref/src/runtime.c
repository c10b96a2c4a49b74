/* runtime.c — thread pool (pthreads, one static split per call), hardware flush mode, CPU
 * features. Nothing here touches arithmetic results. */
#define _GNU_SOURCE
#include "runtime.h"

#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define O1B_X86 1
#endif

static int g_threads = 0;   /* 0: not set, use the number of online CPUs */
static int g_simd_cap = 99;

O1B_API void o1b_set_num_threads(int n) { g_threads = n > 0 ? n : 0; }
O1B_API int o1b_get_num_threads(void) {
    if (g_threads > 0) return g_threads;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

typedef struct { o1b_range_fn fn; void *ctx; int64_t lo, hi; } o1b_task;
static void *o1b_run_task(void *p) {
    o1b_task *t = (o1b_task *)p;
    t->fn(t->ctx, t->lo, t->hi);
    return NULL;
}

void o1b_parallel_for(int64_t n, int64_t grain, o1b_range_fn fn, void *ctx) {
    if (n <= 0) return;
    int64_t nt = o1b_get_num_threads();
    if (grain < 1) grain = 1;
    if (nt > n / grain) nt = n / grain;
    if (nt <= 1) { fn(ctx, 0, n); return; }
    o1b_task tasks[256];
    pthread_t tids[256];
    if (nt > 256) nt = 256;
    for (int64_t i = 0; i < nt; i++) {
        tasks[i].fn = fn; tasks[i].ctx = ctx;
        tasks[i].lo = n * i / nt; tasks[i].hi = n * (i + 1) / nt;
    }
    int started[256] = {0};
    for (int64_t i = 1; i < nt; i++)
        started[i] = pthread_create(&tids[i], NULL, o1b_run_task, &tasks[i]) == 0;
    o1b_run_task(&tasks[0]);
    for (int64_t i = 1; i < nt; i++) {
        if (started[i]) pthread_join(tids[i], NULL);
        else o1b_run_task(&tasks[i]);        /* could not start a thread: do its range here */
    }
}

o1b_fpmode o1b_fpmode_ftz(void) {
    o1b_fpmode m = {0, 0};
#if defined(O1B_X86)
    m.saved = _mm_getcsr(); m.active = 1;
    _mm_setcsr((unsigned)m.saved | 0x8040u);          /* FTZ (bit 15) | DAZ (bit 6) */
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    m.saved = fpcr; m.active = 1;
    fpcr |= (1ull << 24);                              /* FZ: flush, tininess before rounding */
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
#endif
    return m;
}
void o1b_fpmode_restore(o1b_fpmode m) {
    if (!m.active) return;
#if defined(O1B_X86)
    _mm_setcsr((unsigned)m.saved);
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(m.saved));
#endif
}
O1B_API int o1b_has_hw_ftz(void) {
#if defined(O1B_X86) || defined(__aarch64__)
    return 1;
#else
    return 0;
#endif
}

O1B_API void o1b_set_simd(int cap) { g_simd_cap = cap < 0 ? 99 : cap; }
O1B_API int o1b_simd_level(void) {
    int level = 0;
#if defined(O1B_X86) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) level = 1;
    if (__builtin_cpu_supports("avx512f")) level = 2;
#endif
    return level < g_simd_cap ? level : g_simd_cap;
}
/* Names of the features in use, for `open1b info`. */
O1B_API const char *o1b_simd_name(void) {
    switch (o1b_simd_level()) {
    case 2: return "avx512f";
    case 1: return "avx2";
    default:
#if defined(__aarch64__)
        return "neon";
#elif defined(O1B_X86)
        return "sse2";
#else
        return "scalar";
#endif
    }
}
O1B_API int o1b_contract_version(void) { return 1; }
