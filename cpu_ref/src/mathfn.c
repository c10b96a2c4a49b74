/* mathfn.c — the contract's scalar functions and conversions mapped over arrays, and the small
 * elementwise ops of the training step (add, scale by a reciprocal, ...). */
#include <stdlib.h>

#include "contract.h"
#include "runtime.h"
#include "vmath.h"

typedef struct { int op; const float *x; float *y; } map_args;
enum { OP_EXP = O1B_FN_EXP, OP_LOG = O1B_FN_LOG, OP_SIN = O1B_FN_SIN, OP_COS = O1B_FN_COS,
       OP_SQRT = O1B_FN_SQRT, OP_RSQRT = O1B_FN_RSQRT, OP_SIGMOID = O1B_FN_SIGMOID,
       OP_SILU = O1B_FN_SILU, OP_SQRT_INT };

static void map_range(void *ctx, int64_t lo, int64_t hi) {
    const map_args *a = (const map_args *)ctx;
    for (int64_t i = lo; i < hi; i++) {
        float x = o1b_load(a->x[i]), y;
        switch (a->op) {
        case OP_EXP: y = o1b_exp(x); break;
        case OP_LOG: y = o1b_log(x); break;
        case OP_SIN: y = o1b_sin(x); break;
        case OP_COS: y = o1b_cos(x); break;
        case OP_SQRT: y = o1b_sqrt(x); break;
        case OP_RSQRT: y = o1b_rsqrt(x); break;
        case OP_SIGMOID: y = o1b_sigmoid(x); break;
        case OP_SILU: y = o1b_silu(x); break;
        default: y = o1b_sqrt_int(x); break;
        }
        a->y[i] = o1b_store(y);
    }
}
/* y[i] = f(x[i]) for the function numbered `op` (the enum above, vmath.h's numbering for all
 * but sqrt_int): the SIMD forms of vmath.c, which equal the scalar loop bit for bit. */
O1B_API void o1b_map(int op, int64_t n, const float *x, float *y) {
    if (op != OP_SQRT_INT) { o1b_vmap(op, n, x, y); return; }
    map_args a = {op, x, y};
    o1b_parallel_for(n, 4096, map_range, &a);
}

/* y[i] = div(a[i], b[i]): op 0 the contract's div as o1b_div computes it (C `/` and the exact tiny
 * check), op 1 its integer definition o1b_div_int (CONTRACT.md §3); the two are equal. */
O1B_API void o1b_div_array(int op, int64_t n, const float *a, const float *b, float *y) {
    for (int64_t i = 0; i < n; i++) {
        float x = o1b_load(a[i]), z = o1b_load(b[i]);
        y[i] = o1b_store(op == 0 ? o1b_div(x, z) : o1b_div_int(x, z));
    }
}

/* y[i] = i2f(v[i]) for any int32 (§6.9 accumulators): o1b_i2f_acc's exact halves and one add. */
O1B_API void o1b_i2f_acc_array(int64_t n, const int32_t *v, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = o1b_store(o1b_i2f_acc(v[i]));
}

/* The elementwise array ops below are memory-bound: threads over element ranges (no element
 * depends on another), SIMD lanes within a range (vmath.c). */
#define MAP_GRAIN (1 << 15)

typedef struct { const void *x; void *y; float s; const float *a; } ew_args;
static void to_bf16_range(void *ctx, int64_t lo, int64_t hi) {
    const ew_args *a = (const ew_args *)ctx;
    o1b_vto_bf16(lo, hi, (const float *)a->x, (bf16 *)a->y);
}
static void to_f32_range(void *ctx, int64_t lo, int64_t hi) {
    const ew_args *a = (const ew_args *)ctx;
    o1b_vto_f32(lo, hi, (const bf16 *)a->x, (float *)a->y);
}
static void add_range(void *ctx, int64_t lo, int64_t hi) {
    const ew_args *a = (const ew_args *)ctx;
    o1b_vadd(lo, hi, a->a, (const float *)a->x, (float *)a->y);
}
static void scale_range(void *ctx, int64_t lo, int64_t hi) {
    const ew_args *a = (const ew_args *)ctx;
    o1b_vscale_inplace(lo, hi, (float *)a->y, a->s);
}

#define ROWS_SCRATCH_FLOATS 8192
int o1b_rows_to_bf16(int64_t lo, int64_t hi, int64_t width, int64_t group,
                     void (*rows)(const void *ctx, int64_t r0, int64_t r1, float *buf), const void *ctx,
                     bf16 *out16) {
    if (width <= 0) {
        float none = 0.0f;
        rows(ctx, lo, hi, &none);
        return 0;
    }
    int64_t per = ROWS_SCRATCH_FLOATS / width;
    per = per >= group ? per / group * group : group;
    float *buf = malloc((size_t)(per * width) * sizeof(float));
    if (!buf) return -1;
    for (int64_t r0 = lo; r0 < hi; r0 += per) {
        int64_t r1 = r0 + per < hi ? r0 + per : hi;
        rows(ctx, r0, r1, buf);
        o1b_vto_bf16(0, (r1 - r0) * width, buf, out16 + r0 * width);
    }
    free(buf);
    return 0;
}

O1B_API void o1b_f32_to_bf16_array(int64_t n, const float *x, bf16 *y) {
    ew_args a = {x, y, 0.0f, NULL};
    o1b_parallel_for(n, MAP_GRAIN, to_bf16_range, &a);
}
O1B_API void o1b_bf16_to_f32_array(int64_t n, const bf16 *x, float *y) {
    ew_args a = {x, y, 0.0f, NULL};
    o1b_parallel_for(n, MAP_GRAIN, to_f32_range, &a);
}

/* a[i] = a[i] + b[i]: one step of the microbatch gradient fold (the left operand is the lower
 * microbatch index, CONTRACT.md §7). */
O1B_API void o1b_add_inplace(int64_t n, float *a, const float *b) {
    ew_args e = {b, a, 0.0f, a};
    o1b_parallel_for(n, MAP_GRAIN, add_range, &e);
}
/* out[i] = add(a[i], b[i]) (a on the left) into another array: the functional add in one pass. */
O1B_API void o1b_add_array(int64_t n, const float *a, const float *b, float *out) {
    ew_args e = {b, out, 0.0f, a};
    o1b_parallel_for(n, MAP_GRAIN, add_range, &e);
}
/* a[i] = a[i] * s: averages (s = 1/M rounded once) and clipping. */
O1B_API void o1b_scale_inplace(int64_t n, float *a, float s) {
    ew_args e = {NULL, a, o1b_load(s), NULL};
    o1b_parallel_for(n, MAP_GRAIN, scale_range, &e);
}
/* The scalar ops, for host-side contract arithmetic (schedules, clip coefficients). */
O1B_API float o1b_scalar_add(float a, float b) { return o1b_store(o1b_add(o1b_load(a), o1b_load(b))); }
O1B_API float o1b_scalar_sub(float a, float b) { return o1b_store(o1b_sub(o1b_load(a), o1b_load(b))); }
O1B_API float o1b_scalar_mul(float a, float b) { return o1b_store(o1b_mul(o1b_load(a), o1b_load(b))); }
O1B_API float o1b_scalar_div(float a, float b) { return o1b_store(o1b_div(o1b_load(a), o1b_load(b))); }
