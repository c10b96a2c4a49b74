/* runtime.c — thread pool (pthreads, kept between calls; one static split per call), hardware
 * flush mode, CPU features. Nothing here touches arithmetic results. */
#define _GNU_SOURCE
#include "runtime.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define O1B_X86 1
#endif

static int g_threads = 0;   /* 0: not set, use the number of online CPUs */
static int g_simd_cap = 99;

O1B_API void o1b_set_num_threads(int n) { __atomic_store_n(&g_threads, n > 0 ? n : 0, __ATOMIC_RELAXED); }
static int g_online = 0;     /* online CPUs, read once (sysconf reads /sys on every call) */
O1B_API int o1b_get_num_threads(void) {
    int set = __atomic_load_n(&g_threads, __ATOMIC_RELAXED);
    if (set > 0) return set;
    int n = __atomic_load_n(&g_online, __ATOMIC_RELAXED);
    if (n <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 0 ? (int)c : 1;
        __atomic_store_n(&g_online, n, __ATOMIC_RELAXED);
    }
    return n;
}

typedef struct { o1b_range_fn fn; void *ctx; int64_t lo, hi; } o1b_task;
static void *o1b_run_task(void *p) {
    o1b_task *t = (o1b_task *)p;
    t->fn(t->ctx, t->lo, t->hi);
    return NULL;
}

/* The pool: worker threads started on first use and kept, each waiting for its range of the
 * next call. Creating and joining threads on every call costs 20-150 us here (more than many
 * kernels' work at training shapes); a waiting thread starts in about a microsecond while it
 * spins and in tens of microseconds once asleep (a virtual CPU must be woken), so each side
 * spins for a while (O1B_POOL_SPIN_US, measured on the clock) before it sleeps: long enough to
 * span the host's work between two calls of a training step (Python, often 50-150 us). A
 * count of pauses is no measure of time (a pause takes 10 ns on one Xeon, 40 on another): 4000
 * of them, 80 us where they were tuned, were 38 us on a later machine, where a (1024, 256)
 * RMSNorm after a 50 us gap then took 76-92 us instead of 38. Steps at the small preset were 3%
 * shorter with 80, 150 or 300 us than with 38 (in-process A/B, bf16 and int8 alike); at tiny, where
 * the background hashing thread wants a fifth of a CPU, the longer spins did not clearly win or
 * lose (+-3% between runs). Only the split of [0, n) into ranges enters the results, and it is the
 * same either way. One call uses the pool at a time: a call made while it is busy (from another
 * thread, or from inside a range) starts its own threads as before, and so does a call whose
 * workers cannot start. */
#define O1B_POOL_MAX 256
#ifndef O1B_POOL_SPIN_US
#define O1B_POOL_SPIN_US 150
#endif
static int g_pool_spin_us = O1B_POOL_SPIN_US > 0 ? O1B_POOL_SPIN_US : 0;
/* How long each side spins before it sleeps, in microseconds (for measurements; no result changes). */
O1B_API void o1b_set_pool_spin_us(int us) { __atomic_store_n(&g_pool_spin_us, us > 0 ? us : 0, __ATOMIC_RELAXED); }
O1B_API int o1b_pool_spin_us(void) { return __atomic_load_n(&g_pool_spin_us, __ATOMIC_RELAXED); }
uint64_t o1b_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}
/* The end of a spin that starts now (the clock is read once per 32 pauses while spinning). */
static uint64_t o1b_spin_deadline(void) {
    return o1b_now_ns() + 1000u * (uint64_t)__atomic_load_n(&g_pool_spin_us, __ATOMIC_RELAXED);
}
/* One step of a spin-wait. (Giving the CPU away with sched_yield every so often was tried: in
 * this virtual machine it slowed the common case, two threads on two CPUs, by a third.) */
static inline void o1b_cpu_relax(void) {
#if defined(O1B_X86)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}
static struct {
    pthread_mutex_t busy;          /* held by the call that uses the pool */
    pthread_mutex_t m;             /* with go/done: sleeping and waking */
    pthread_cond_t go, done;
    int nworkers;                  /* workers started (worker w runs tasks[w], w >= 1); caller only */
    unsigned long gen;             /* bumped (atomically) for each call */
    int nt, pending;               /* threads in the call (caller included); workers still running */
    int sleepers, caller_sleeps;   /* workers asleep on go; the caller asleep on done */
    o1b_task tasks[O1B_POOL_MAX];
    unsigned long born[O1B_POOL_MAX];
} g_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
            PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, {{0}}, {0}};
static pthread_once_t g_pool_once = PTHREAD_ONCE_INIT;
static int g_pool_on = 1;
/* 0: start threads on every call, as before the pool (for measurements; no result changes). */
O1B_API void o1b_set_thread_pool(int on) { __atomic_store_n(&g_pool_on, on != 0, __ATOMIC_RELAXED); }

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_SEQ_CST)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_SEQ_CST)
static void *o1b_pool_worker(void *p) {
    int w = (int)(intptr_t)p;
    unsigned long seen = g_pool.born[w];        /* the generation before its first call */
    for (;;) {
        for (uint64_t end = o1b_spin_deadline(), i = 1; LOAD(g_pool.gen) == seen; i++) {
            o1b_cpu_relax();
            if (i % 32 == 0 && o1b_now_ns() >= end) break;
        }
        if (LOAD(g_pool.gen) == seen) {
            pthread_mutex_lock(&g_pool.m);
            __atomic_add_fetch(&g_pool.sleepers, 1, __ATOMIC_SEQ_CST);
            while (LOAD(g_pool.gen) == seen) pthread_cond_wait(&g_pool.go, &g_pool.m);
            __atomic_sub_fetch(&g_pool.sleepers, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&g_pool.m);
        }
        seen = LOAD(g_pool.gen);
        if (w >= LOAD(g_pool.nt)) continue;
        o1b_run_task(&g_pool.tasks[w]);
        if (__atomic_sub_fetch(&g_pool.pending, 1, __ATOMIC_SEQ_CST) == 0 && LOAD(g_pool.caller_sleeps)) {
            pthread_mutex_lock(&g_pool.m);
            pthread_cond_signal(&g_pool.done);
            pthread_mutex_unlock(&g_pool.m);
        }
    }
    return NULL;
}
/* After fork() only the forking thread exists in the child: forget the workers. */
static void o1b_pool_after_fork_child(void) {
    pthread_mutex_t m0 = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c0 = PTHREAD_COND_INITIALIZER;
    g_pool.busy = m0; g_pool.m = m0; g_pool.go = c0; g_pool.done = c0;
    g_pool.nworkers = 0; g_pool.nt = 0; g_pool.pending = 0; g_pool.sleepers = 0; g_pool.caller_sleeps = 0;
}
static void o1b_pool_init(void) { pthread_atfork(NULL, NULL, o1b_pool_after_fork_child); }

/* Runs tasks[0 .. nt) with the pool; returns 0 (nothing run) if it is busy or cannot start. */
static int o1b_pool_run(o1b_task *tasks, int64_t nt) {
    if (!__atomic_load_n(&g_pool_on, __ATOMIC_RELAXED)) return 0;
    pthread_once(&g_pool_once, o1b_pool_init);
    if (pthread_mutex_trylock(&g_pool.busy) != 0) return 0;
    while (g_pool.nworkers < nt - 1) {
        pthread_t tid;
        pthread_attr_t at;
        g_pool.born[g_pool.nworkers + 1] = LOAD(g_pool.gen);
        int ok = pthread_attr_init(&at) == 0;
        if (ok) {
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            ok = pthread_create(&tid, &at, o1b_pool_worker, (void *)(intptr_t)(g_pool.nworkers + 1)) == 0;
            pthread_attr_destroy(&at);
        }
        if (!ok) { pthread_mutex_unlock(&g_pool.busy); return 0; }
        g_pool.nworkers++;
    }
    /* workers read tasks/nt only after they see the new generation (sequentially consistent) */
    for (int64_t i = 1; i < nt; i++) g_pool.tasks[i] = tasks[i];
    STORE(g_pool.nt, (int)nt);
    STORE(g_pool.pending, (int)nt - 1);
    __atomic_add_fetch(&g_pool.gen, 1, __ATOMIC_SEQ_CST);
    if (LOAD(g_pool.sleepers) > 0) {             /* a worker that has not yet counted itself
                                                    asleep will see the new generation */
        pthread_mutex_lock(&g_pool.m);
        pthread_cond_broadcast(&g_pool.go);
        pthread_mutex_unlock(&g_pool.m);
    }
    o1b_run_task(&tasks[0]);
    for (uint64_t end = o1b_spin_deadline(), i = 1; LOAD(g_pool.pending) > 0; i++) {
        o1b_cpu_relax();
        if (i % 32 == 0 && o1b_now_ns() >= end) break;
    }
    if (LOAD(g_pool.pending) > 0) {
        pthread_mutex_lock(&g_pool.m);
        STORE(g_pool.caller_sleeps, 1);
        while (LOAD(g_pool.pending) > 0) pthread_cond_wait(&g_pool.done, &g_pool.m);
        STORE(g_pool.caller_sleeps, 0);
        pthread_mutex_unlock(&g_pool.m);
    }
    pthread_mutex_unlock(&g_pool.busy);
    return 1;
}
#undef LOAD
#undef STORE

void o1b_parallel_for(int64_t n, int64_t grain, o1b_range_fn fn, void *ctx) {
    if (n <= 0) return;
    int64_t nt = o1b_get_num_threads();
    if (grain < 1) grain = 1;
    if (nt > n / grain) nt = n / grain;
    if (nt <= 1) { fn(ctx, 0, n); return; }
    o1b_task tasks[O1B_POOL_MAX];
    pthread_t tids[O1B_POOL_MAX];
    if (nt > O1B_POOL_MAX) nt = O1B_POOL_MAX;
    for (int64_t i = 0; i < nt; i++) {
        tasks[i].fn = fn; tasks[i].ctx = ctx;
        tasks[i].lo = n * i / nt; tasks[i].hi = n * (i + 1) / nt;
    }
    if (o1b_pool_run(tasks, nt)) return;
    int started[O1B_POOL_MAX] = {0};
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
    fpcr &= ~(1ull << 1);     /* AH = 0: with FEAT_AFP and AH = 1, FZ would not flush inputs (FIZ
                                 would); RES0 without the feature, so clearing it is harmless */
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

O1B_API void o1b_set_simd(int cap) { __atomic_store_n(&g_simd_cap, cap < 0 ? 99 : cap, __ATOMIC_RELAXED); }
O1B_API int o1b_simd_level(void) {
    int level = 0;
#if defined(O1B_X86) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) level = 1;
    if (__builtin_cpu_supports("avx512f")) level = 2;
#endif
    int cap = __atomic_load_n(&g_simd_cap, __ATOMIC_RELAXED);
    return level < cap ? level : cap;
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
