/* quant.cu — the int8 quantized linear layer (CONTRACT.md §6.9, .contract_parts/int8.md) and its
 * simulated int4 and int6 paths (qmax = QMAX4 = 7, coefficient QW_COEF4; qmax = QMAX6 = 31,
 * coefficient QW_COEF6; the kernels that depend on the level bound take it as their argument qmax,
 * 127, 31 or 7, checked by the host).
 *
 *   weights:    per output row j: S = sum from +0 over k ascending of |w[j,k]|,
 *               s_w[j] = mul(div(S, i2f(K)), coef) (NaN if S is not finite), coef = QW_COEF for
 *               qmax 127, QW_COEF6 for qmax 31, QW_COEF4 for qmax 7
 *   tensors:    s = div(absmax, qmax) (NaN if any element is inf/NaN; a max is exact in any order)
 *   quantize:   q = level(mul(v, div(1, s))) = clamp(rne(.), -qmax, qmax); q = 0 where s is +0 or NaN
 *   int8 GEMM:  acc[i,j] = sum_p A(i,p) B(j,p) in int32 (exact: P <= 2^17, so |acc| < 2^31)
 *   Hadamard:   in-place butterflies along rows, blocks of QB = 128 rows, stages h = 1, 2, ..., 64
 *               (fp32 add/sub, or exact int32)
 * One thread per output everywhere (one per row for the weight scales, one per (block, column)
 * for the rotation, one per block of Q_CHUNK elements for the absmax partials). Integer sums are
 * exact in any order; every fp32 value comes from the contract helpers in the written order, so
 * the results equal cpu_ref/src/quant.c bit for bit. No barriers, no shared memory.
 */
#include "contract.cuh"

#define QMAX 127
#define QMAX4 7                   /* the simulated int4 path: levels -7 ... 7 in int8 containers */
#define QMAX6 31                  /* the simulated int6 path: levels -31 ... 31 in int8 containers */
#define QB 128                    /* Hadamard block along the contraction dimension */
#define QW_COEF 0x1.6b7612p-3f    /* 2/sqrt(127) rounded to nearest fp32 */
#define QW_COEF4 0x1.83091ep-1f   /* 2/sqrt(7) rounded to nearest fp32 */
#define QW_COEF6 0x1.6fd4e8p-2f   /* 2/sqrt(31) rounded to nearest fp32 */
#define INV_QB 0x1p-7f            /* 1/QB, exact */
#define Q_CHUNK 4096              /* elements per absmax partial (no result depends on it) */
#define Q_BAD 0xFFFFFFFFu         /* absmax partial of a chunk holding an inf or NaN */

typedef signed char i8;

__device__ __forceinline__ bool o1b_q_finite(float x) { return (o1b_bits(x) & 0x7F800000u) != 0x7F800000u; }

/* The level bound qmax (QMAX, QMAX6 or QMAX4) as fp32, and the weight step coefficient it selects. */
__device__ __forceinline__ float o1b_q_maxf(int qmax) { return qmax == QMAX4 ? 7.0f : qmax == QMAX6 ? 31.0f : 127.0f; }
__device__ __forceinline__ float o1b_q_coef(int qmax) {
    return qmax == QMAX4 ? QW_COEF4 : qmax == QMAX6 ? QW_COEF6 : QW_COEF;
}

/* ------------------------------------------------------------------ weight step sizes */
/* s[j] (stored) per row; inv[j] = div(1, s_w[j]) where the row is finite (unused otherwise). */
extern "C" __global__ void o1b_q_weight_scales(i64 M, i64 K, const bf16 *w, float *s, float *inv, int qmax) {
    i64 j = o1b_gid();
    if (j >= M) return;
    const bf16 *row = w + j * K;
    float S = 0.0f;
    for (i64 k = 0; k < K; k++) S = o1b_add(S, o1b_from_bits(o1b_abs_bits(o1b_bf16_to_f32(row[k]))));
    float sj = o1b_q_finite(S) ? o1b_mul(o1b_div(S, o1b_i2f((int)K)), o1b_q_coef(qmax)) : o1b_nan();
    bool finite_nonzero = !o1b_isnan(sj) && sj != 0.0f;
    inv[j] = finite_nonzero ? o1b_div(1.0f, sj) : 0.0f;
    s[j] = o1b_store(sj);
}

/* q[j,k] and (if has_clip) clip[j,k]: 1 where |t| > qmax, 2 on every element of a NaN-scale row. */
extern "C" __global__ void o1b_q_weight_levels(i64 M, i64 K, const bf16 *w, const float *s, const float *inv,
                                               i8 *q, unsigned char *clip, int has_clip, int qmax) {
    i64 i = o1b_gid();
    if (i >= M * K) return;
    i64 j = i / K;
    float sj = s[j];
    if (o1b_isnan(sj) || sj == 0.0f) {
        q[i] = 0;
        if (has_clip) clip[i] = o1b_isnan(sj) ? 2 : 0;
        return;
    }
    float t = o1b_mul(o1b_bf16_to_f32(w[i]), inv[j]);
    q[i] = o1b_level(t, qmax);
    if (has_clip) clip[i] = o1b_abs_bits(t) > o1b_bits(o1b_q_maxf(qmax)) ? 1 : 0;
}

/* ------------------------------------------------------------------ per-tensor quantization */
/* The value of element i of the tensor: a widened bf16 (is_f32 == 0) or a loaded fp32. */
__device__ __forceinline__ float o1b_q_value(const bf16 *xb, const float *xf, int is_f32, i64 i) {
    return is_f32 ? o1b_load(xf[i]) : o1b_bf16_to_f32(xb[i]);
}

/* part[c] = max over chunk c of the bits of |v| (ordered like the values), Q_BAD if any is inf/NaN. */
extern "C" __global__ void o1b_q_absmax_chunks(i64 n, const bf16 *xb, const float *xf, int is_f32, u32 *part) {
    i64 c = o1b_gid(), nc = (n + Q_CHUNK - 1) / Q_CHUNK;
    if (c >= nc) return;
    i64 end = (c + 1) * Q_CHUNK < n ? (c + 1) * Q_CHUNK : n;
    u32 m = 0u;
    for (i64 i = c * Q_CHUNK; i < end; i++) {
        u32 a = o1b_abs_bits(o1b_q_value(xb, xf, is_f32, i));
        if (a >= 0x7F800000u) { m = Q_BAD; break; }
        m = a > m ? a : m;
    }
    part[c] = m;
}

/* sc[0] = s = div(absmax, qmax) (stored), sc[1] = div(1, s) where s is finite and nonzero (else 0);
 * one thread. */
extern "C" __global__ void o1b_q_tensor_scale(i64 nparts, const u32 *part, float *sc, int qmax) {
    if (o1b_gid() != 0) return;
    u32 m = 0u;
    for (i64 c = 0; c < nparts; c++) m = part[c] > m ? part[c] : m;
    float s = m == Q_BAD ? o1b_nan() : o1b_div(o1b_from_bits(m), o1b_q_maxf(qmax));
    sc[1] = (!o1b_isnan(s) && s != 0.0f) ? o1b_div(1.0f, s) : 0.0f;
    sc[0] = o1b_store(s);
}

extern "C" __global__ void o1b_q_tensor_levels(i64 n, const bf16 *xb, const float *xf, int is_f32,
                                               const float *sc, i8 *q, int qmax) {
    i64 i = o1b_gid();
    if (i >= n) return;
    float s = sc[0];
    q[i] = (o1b_isnan(s) || s == 0.0f) ? (i8)0 : o1b_level(o1b_mul(o1b_q_value(xb, xf, is_f32, i), sc[1]), qmax);
}

/* ------------------------------------------------------------------ int8 GEMM */
/* C[i*J + j] = sum_p A[i*sa_i + p*sa_p] * B[j*sb_j + p*sb_p] in int32; one thread per (i, j). */
extern "C" __global__ void o1b_gemm_i8(i64 I, i64 J, i64 P, const i8 *A, i64 sa_i, i64 sa_p,
                                       const i8 *B, i64 sb_j, i64 sb_p, int *C) {
    i64 t = o1b_gid();
    if (t >= I * J) return;
    i64 i = t / J, j = t % J;
    const i8 *a = A + i * sa_i, *b = B + j * sb_j;
    u32 acc = 0u;   /* modulo 2^32; exact anyway, as |acc| < 2^31 at every step */
    for (i64 p = 0; p < P; p++) acc += (u32)((int)a[p * sa_p] * (int)b[p * sb_p]);
    C[t] = (int)acc;
}

/* ------------------------------------------------------------------ Walsh-Hadamard rotation */
/* f (R, C), R a multiple of QB, rotated in place along its rows: one thread per (block, column)
 * runs the 7 butterfly stages on its column's QB values (columns never interact). Values are loaded
 * with o1b_load and stored with o1b_store. */
extern "C" __global__ void o1b_hadamard_f32(i64 R, i64 C, float *f) {
    i64 t = o1b_gid();
    if (t >= (R / QB) * C) return;
    i64 blk = t / C, c = t % C;
    float *base = f + blk * QB * C + c;
    float v[QB];
    for (int i = 0; i < QB; i++) v[i] = o1b_load(base[i * C]);
    for (int h = 1; h < QB; h <<= 1)
        for (int i = 0; i < QB; i++) {
            if (i & h) continue;
            float a = v[i], b = v[i + h];
            v[i] = o1b_add(a, b);
            v[i + h] = o1b_sub(a, b);
        }
    for (int i = 0; i < QB; i++) base[i * C] = o1b_store(v[i]);
}

/* The same in int32 (|values| <= qmax * QB <= 127 * QB: exact). */
extern "C" __global__ void o1b_hadamard_i32(i64 R, i64 C, int *n) {
    i64 t = o1b_gid();
    if (t >= (R / QB) * C) return;
    i64 blk = t / C, c = t % C;
    int *base = n + blk * QB * C + c;
    int v[QB];
    for (int i = 0; i < QB; i++) v[i] = base[i * C];
    for (int h = 1; h < QB; h <<= 1)
        for (int i = 0; i < QB; i++) {
            if (i & h) continue;
            int a = v[i], b = v[i + h];
            v[i] = a + b;
            v[i + h] = a - b;
        }
    for (int i = 0; i < QB; i++) base[i * C] = v[i];
}

/* out (Rp, C) int32: rows < R are q (R, C), the rest +0 (padding). */
extern "C" __global__ void o1b_q_pad_i32(i64 R, i64 Rp, i64 C, const i8 *q, int *out) {
    i64 i = o1b_gid();
    if (i >= Rp * C) return;
    out[i] = i < R * C ? (int)q[i] : 0;
}

/* f[i] = i2f(n[i]) (exact: |n| < 2^24). */
extern "C" __global__ void o1b_q_i2f(i64 n, const int *v, float *f) {
    i64 i = o1b_gid();
    if (i >= n) return;
    f[i] = o1b_i2f(v[i]);
}

/* ------------------------------------------------------------------ the layer's operands and epilogues */
/* y[i,j] = mul(mul(i2f(acc[i,j]), s_x), s_w[j]). */
extern "C" __global__ void o1b_qlinear_y(i64 N, i64 M, const int *acc, const float *scx, const float *sw, float *y) {
    i64 t = o1b_gid();
    if (t >= N * M) return;
    y[t] = o1b_store(o1b_mul(o1b_mul(o1b_i2f_acc(acc[t]), scx[0]), sw[t % M]));
}

/* g (Mp, N) = transposed G: g[m, n] = mul(dy[n, m], s_w[m]) for m < M, +0 below. */
extern "C" __global__ void o1b_qlinear_g(i64 N, i64 M, i64 Mp, const bf16 *dy, const float *sw, float *g) {
    i64 t = o1b_gid();
    if (t >= Mp * N) return;
    i64 m = t / N, n = t % N;
    g[t] = m < M ? o1b_mul(o1b_bf16_to_f32(dy[n * M + m]), sw[m]) : 0.0f;
}

/* d (Np, M): rows < N are dy widened, the rest +0. */
extern "C" __global__ void o1b_qlinear_d(i64 N, i64 Np, i64 M, const bf16 *dy, float *d) {
    i64 t = o1b_gid();
    if (t >= Np * M) return;
    d[t] = t < N * M ? o1b_bf16_to_f32(dy[t]) : 0.0f;
}

/* dx = mul(mul(mul(i2f(acc), s_G), s_R), INV_QB). */
extern "C" __global__ void o1b_qlinear_dx(i64 n, const int *acc, const float *scg, const float *scr, float *dx) {
    i64 t = o1b_gid();
    if (t >= n) return;
    dx[t] = o1b_store(o1b_mul(o1b_mul(o1b_mul(o1b_i2f_acc(acc[t]), scg[0]), scr[0]), INV_QB));
}

/* dW = mul(mul(mul(mul(i2f(acc), s_D), s_X), s_x), INV_QB); +0 where clipped, NaN on a NaN row. */
extern "C" __global__ void o1b_qlinear_dw(i64 n, const int *acc, const float *scd, const float *scr,
                                          const float *scx, const unsigned char *clip, float *dw) {
    i64 t = o1b_gid();
    if (t >= n) return;
    float v = o1b_mul(o1b_mul(o1b_mul(o1b_mul(o1b_i2f_acc(acc[t]), scd[0]), scr[0]), scx[0]), INV_QB);
    dw[t] = clip[t] == 2 ? o1b_nan() : clip[t] ? 0.0f : o1b_store(v);
}
