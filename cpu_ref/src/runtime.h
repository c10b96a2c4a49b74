/* runtime.h — what every kernel file shares besides the arithmetic: the thread pool, the
 * hardware flush mode used by GEMM-like kernels, and CPU feature detection. */
#ifndef O1B_RUNTIME_H
#define O1B_RUNTIME_H

#include <stdint.h>

#if defined(_WIN32)
#define O1B_API __declspec(dllexport)
#else
#define O1B_API __attribute__((visibility("default")))
#endif

/* Run fn(ctx, lo, hi) over [0, n) split into contiguous ranges, one per thread. Kernels give
 * each output element to exactly one call and never let a sum cross ranges, so the result does
 * not depend on the thread count. `grain` is the smallest range worth a thread. */
typedef void (*o1b_range_fn)(void *ctx, int64_t lo, int64_t hi);
void o1b_parallel_for(int64_t n, int64_t grain, o1b_range_fn fn, void *ctx);
int o1b_get_num_threads(void);

/* Hardware flush-to-zero for kernels whose every product is exact (bf16 x bf16) and whose every
 * sum is of normals: there x86 FTZ/DAZ and ARM FZ give exactly the contract's flush (a tiny
 * exact product or sum is flushed by both rules). Returns the previous state to restore. */
typedef struct { uint64_t saved; int active; } o1b_fpmode;
o1b_fpmode o1b_fpmode_ftz(void);
void o1b_fpmode_restore(o1b_fpmode m);
int o1b_has_hw_ftz(void);

/* SIMD level chosen at run time: 0 portable, 1 AVX2, 2 AVX-512 (x86-64); NEON is the
 * portable path on arm64. o1b_set_simd caps it (tests compare every level bit for bit). */
int o1b_simd_level(void);

/* The monotonic clock in nanoseconds (the pool's spin deadlines, quant_vnni.c's phase profile). */
uint64_t o1b_now_ns(void);
#endif
