/* mathfn.cu — the contract's scalar functions mapped over arrays, the bf16 conversions, and the
 * small elementwise ops of the training step (CONTRACT.md §2–§4, §7). One thread per element;
 * each element's result is the C reference's (cpu_ref/src/mathfn.c) by construction. */
#include "contract.cuh"

/* op numbers: the order of cpu_ref.mathfn.FUNCTIONS */
enum { OP_EXP, OP_LOG, OP_SIN, OP_COS, OP_SQRT, OP_RSQRT, OP_SIGMOID, OP_SILU, OP_SQRT_INT };

/* y[i] = f(x[i]) for the function numbered `op`. */
extern "C" __global__ void o1b_map(int op, i64 n, const float *x, float *y) {
    i64 i = o1b_gid();
    if (i >= n) return;
    float v = o1b_load(x[i]), r;
    switch (op) {
    case OP_EXP: r = o1b_exp(v); break;
    case OP_LOG: r = o1b_log(v); break;
    case OP_SIN: r = o1b_sin(v); break;
    case OP_COS: r = o1b_cos(v); break;
    case OP_SQRT: r = o1b_sqrt(v); break;
    case OP_RSQRT: r = o1b_rsqrt(v); break;
    case OP_SIGMOID: r = o1b_sigmoid(v); break;
    case OP_SILU: r = o1b_silu(v); break;
    default: r = o1b_sqrt_int(v); break;
    }
    y[i] = o1b_store(r);
}

extern "C" __global__ void o1b_f32_to_bf16_array(i64 n, const float *x, bf16 *y) {
    i64 i = o1b_gid();
    if (i < n) y[i] = o1b_f32_to_bf16(x[i]);
}

extern "C" __global__ void o1b_bf16_to_f32_array(i64 n, const bf16 *x, float *y) {
    i64 i = o1b_gid();
    if (i < n) y[i] = o1b_store(o1b_bf16_to_f32(x[i]));
}

/* a[i] = a[i] + b[i]: one step of the microbatch gradient fold (a is the lower index, on the left). */
extern "C" __global__ void o1b_add_inplace(i64 n, float *a, const float *b) {
    i64 i = o1b_gid();
    if (i < n) a[i] = o1b_store(o1b_add(o1b_load(a[i]), o1b_load(b[i])));
}

/* a[i] = a[i] * s: averages (s = 1/M rounded once) and clipping. */
extern "C" __global__ void o1b_scale_inplace(i64 n, float *a, float s) {
    i64 i = o1b_gid();
    if (i < n) a[i] = o1b_store(o1b_mul(o1b_load(a[i]), o1b_load(s)));
}

/* Scalar (or elementwise) primitive ops for host-side contract arithmetic:
 * op 0 add, 1 sub, 2 mul, 3 div, 4 sqrt (of a; b unused), 5 div by its integer definition. */
extern "C" __global__ void o1b_binary(int op, i64 n, const float *a, const float *b, float *y) {
    i64 i = o1b_gid();
    if (i >= n) return;
    float x = o1b_load(a[i]), z = o1b_load(b[i]), r;
    switch (op) {
    case 0: r = o1b_add(x, z); break;
    case 1: r = o1b_sub(x, z); break;
    case 2: r = o1b_mul(x, z); break;
    case 3: r = o1b_div(x, z); break;
    case 5: r = o1b_div_int(x, z); break;
    default: r = o1b_sqrt(x); break;
    }
    y[i] = o1b_store(r);
}
