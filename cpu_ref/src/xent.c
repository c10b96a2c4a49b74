/* xent.c — fused, vocabulary-chunked cross-entropy + z-loss (CONTRACT.md, "Cross-entropy with
 * z-loss"), forward and backward, without ever holding the (N, V) logits.
 *
 *   N = rows (tokens), C = channels (hidden size), V = vocabulary, L = XENT_CHUNK
 *   z[n,v] = sum_{c ascending} h[n,c] w[v,c]        the contract GEMM, i.e. linear_forward's bits
 *   lse[n] = log sum_v exp(z[n,v])                  online over chunks of L vocabulary entries
 *   loss[n] = (lse[n] - z[n,target]) + zcoef lse[n]^2
 *
 * XENT_CHUNK is a contract constant, not a tuning knob: the online rescaling of the running sum
 * happens at chunk boundaries, so a different chunk size gives different lse bits. (The backward's
 * sums are chunk-free: dh continues one fp32 accumulator across chunks, and dw rows are disjoint.)
 *
 * Determinism: threads split rows n only; every sum over v or c stays inside one thread and runs
 * in ascending order, so no result depends on the thread count.
 */
#include <stdlib.h>

#include "contract.h"
#include "gemm.h"
#include "runtime.h"
#include "vmath.h"

#define XENT_CHUNK 1024

enum { XENT_OK = 0, XENT_NO_MEMORY = 1, XENT_BAD_TARGET = 2, XENT_BAD_SIZE = 3 };

O1B_API int o1b_xent_chunk(void) { return XENT_CHUNK; }

/* Elementwise work per row of a chunk is ~L exps; give a thread at least ~8k of them. */
static int64_t row_grain(int64_t L) { return 1 + 8192 / (L > 0 ? L : 1); }

static int targets_in_range(int64_t N, int64_t V, const int32_t *targets) {
    for (int64_t n = 0; n < N; n++)
        if (targets[n] < 0 || targets[n] >= V) return 0;
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Forward
 * ------------------------------------------------------------------------------------------- */
typedef struct {
    int64_t v0, L;            /* this chunk is vocabulary entries [v0, v0 + L) */
    const float *z;           /* (N, L) logits of the chunk */
    const int32_t *targets;   /* (N,) */
    float *m, *s, *zt;        /* (N,) running max, running sum of exp(z - m), target logit */
} fwd_chunk_args;

/* One chunk of the online logsumexp for rows [lo, hi). The exps of a group of rows are computed
 * across the vocabulary on SIMD lanes (vmath.c, contract.h's bits) into a buffer the size of the
 * chunk that stays in cache; then each row's sum runs over it in ascending v, the rows of a group
 * interleaved so that their independent chains of adds overlap in the pipeline. */
#define XENT_GROUP 4
static void fwd_chunk_rows_buffered(const fwd_chunk_args *a, int64_t lo, int64_t hi, float *e) {
    int64_t L = a->L;
    for (int64_t n0 = lo; n0 < hi; n0 += XENT_GROUP) {
        int G = hi - n0 < XENT_GROUP ? (int)(hi - n0) : XENT_GROUP;
        float m_new[XENT_GROUP], cs[XENT_GROUP];
        for (int g = 0; g < G; g++) {
            int64_t n = n0 + g;
            const float *zr = a->z + n * L;
            float cm = -INFINITY;                       /* a NaN logit is passed over here ... */
            for (int64_t v = 0; v < L; v++) cm = o1b_max(cm, o1b_load(zr[v]));
            m_new[g] = o1b_max(a->m[n], cm);
            o1b_vexp_sub(L, zr, m_new[g], e + g * L);
            cs[g] = 0.0f;
        }
        if (G == XENT_GROUP) {                          /* ... and turns the sum NaN here */
            for (int64_t v = 0; v < L; v++)
                for (int g = 0; g < XENT_GROUP; g++) cs[g] = o1b_add(cs[g], e[g * L + v]);
        } else {
            for (int g = 0; g < G; g++)
                for (int64_t v = 0; v < L; v++) cs[g] = o1b_add(cs[g], e[g * L + v]);
        }
        for (int g = 0; g < G; g++) {
            int64_t n = n0 + g;
            float corr = o1b_exp(o1b_sub(a->m[n], m_new[g]));   /* exp(-inf) = +0 on the first chunk */
            a->s[n] = o1b_add(o1b_mul(a->s[n], corr), cs[g]);
            a->m[n] = m_new[g];
            int64_t t = (int64_t)a->targets[n] - a->v0;
            if (t >= 0 && t < L) a->zt[n] = o1b_load(a->z[n * L + t]);
        }
    }
}
/* The same rows one exp at a time (no buffer to be had). */
static void fwd_chunk_rows_scalar(const fwd_chunk_args *a, int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; n++) {
        const float *zr = a->z + n * a->L;
        float cm = -INFINITY;
        for (int64_t v = 0; v < a->L; v++) cm = o1b_max(cm, o1b_load(zr[v]));
        float m_old = a->m[n];
        float m_new = o1b_max(m_old, cm);
        float corr = o1b_exp(o1b_sub(m_old, m_new));
        float cs = 0.0f;
        for (int64_t v = 0; v < a->L; v++)
            cs = o1b_add(cs, o1b_exp(o1b_sub(o1b_load(zr[v]), m_new)));
        a->s[n] = o1b_add(o1b_mul(a->s[n], corr), cs);
        a->m[n] = m_new;
        int64_t t = (int64_t)a->targets[n] - a->v0;
        if (t >= 0 && t < a->L) a->zt[n] = o1b_load(zr[t]);
    }
}
static void fwd_chunk_rows(void *ctx, int64_t lo, int64_t hi) {
    const fwd_chunk_args *a = (const fwd_chunk_args *)ctx;
    float *e = (float *)malloc(sizeof(float) * (size_t)(XENT_GROUP * a->L));
    if (e) fwd_chunk_rows_buffered(a, lo, hi, e);
    else fwd_chunk_rows_scalar(a, lo, hi);
    free(e);
}

typedef struct {
    const float *m, *s, *zt;
    float zcoef;
    float *loss, *lse, *ce;
} fwd_final_args;

static void fwd_final_rows(void *ctx, int64_t lo, int64_t hi) {
    const fwd_final_args *a = (const fwd_final_args *)ctx;
    for (int64_t n = lo; n < hi; n++) {
        float lse = o1b_add(a->m[n], o1b_log(a->s[n]));
        float ce = o1b_sub(lse, a->zt[n]);
        float zl = o1b_mul(a->zcoef, o1b_mul(lse, lse));
        a->lse[n] = o1b_store(lse);
        a->ce[n] = o1b_store(ce);
        a->loss[n] = o1b_store(o1b_add(ce, zl));
    }
}

/* The forward with an explicit chunk size: the contract fixes it at XENT_CHUNK (o1b_xent_forward);
 * the tests call other sizes to show where it enters the arithmetic. */
O1B_API int o1b_xent_forward_chunked(int64_t N, int64_t C, int64_t V, int64_t chunk,
                                     const bf16 *h,           /* (N, C) final hidden states */
                                     const bf16 *w,           /* (V, C) LM head */
                                     const int32_t *targets,  /* (N,) in [0, V) */
                                     float zcoef,
                                     float *loss,             /* (N,) ce + zcoef lse^2 */
                                     float *lse,              /* (N,) */
                                     float *ce) {             /* (N,) lse - z[target] */
    if (N <= 0 || C <= 0 || V <= 0 || chunk <= 0) return XENT_BAD_SIZE;
    if (!targets_in_range(N, V, targets)) return XENT_BAD_TARGET;
    int64_t Lmax = chunk < V ? chunk : V;
    float *z = (float *)malloc(sizeof(float) * (size_t)(N * Lmax));
    float *state = (float *)malloc(sizeof(float) * (size_t)(3 * N));
    if (!z || !state) { free(z); free(state); return XENT_NO_MEMORY; }
    float *m = state, *s = state + N, *zt = state + 2 * N;
    for (int64_t n = 0; n < N; n++) { m[n] = -INFINITY; s[n] = 0.0f; zt[n] = 0.0f; }

    for (int64_t v0 = 0; v0 < V; v0 += chunk) {
        int64_t L = V - v0 < chunk ? V - v0 : chunk;
        /* z[n, j] = sum_c h[n, c] w[v0 + j, c]: the columns v0.. of linear_forward(h, w) */
        o1b_gemm(N, L, C, h, C, 1, w + v0 * C, 1, C, z, L, 0);
        fwd_chunk_args a = {v0, L, z, targets, m, s, zt};
        o1b_parallel_for(N, row_grain(L), fwd_chunk_rows, &a);
    }
    fwd_final_args f = {m, s, zt, o1b_load(zcoef), loss, lse, ce};
    o1b_parallel_for(N, 4096, fwd_final_rows, &f);
    free(z);
    free(state);
    return XENT_OK;
}

O1B_API int o1b_xent_forward(int64_t N, int64_t C, int64_t V, const bf16 *h, const bf16 *w,
                             const int32_t *targets, float zcoef, float *loss, float *lse, float *ce) {
    return o1b_xent_forward_chunked(N, C, V, XENT_CHUNK, h, w, targets, zcoef, loss, lse, ce);
}

/* ---------------------------------------------------------------------------------------------
 * Backward
 *   d loss[n] / d z[n,v] = softmax_v (1 + 2 zcoef lse[n]) - [v == target[n]]
 *   (the z-loss term: d(zcoef lse^2)/dz_v = 2 zcoef lse softmax_v)
 * ------------------------------------------------------------------------------------------- */
typedef struct {
    int64_t v0, L;
    const float *z;           /* (N, L) logits of the chunk */
    const int32_t *targets;   /* (N,) */
    const float *lse;         /* (N,) from the forward */
    const float *dloss;       /* (N,) */
    float two_zcoef;          /* mul(2, zcoef) */
    bf16 *dz;                 /* (N, L) the GEMM operand: dz rounded to bf16 */
} bwd_chunk_args;

static void bwd_chunk_rows(void *ctx, int64_t lo, int64_t hi) {
    const bwd_chunk_args *a = (const bwd_chunk_args *)ctx;
    for (int64_t n = lo; n < hi; n++) {
        const float *zr = a->z + n * a->L;
        bf16 *dzr = a->dz + n * a->L;
        float lse = o1b_load(a->lse[n]);
        float dl = o1b_load(a->dloss[n]);
        float coef = o1b_add(1.0f, o1b_mul(a->two_zcoef, lse));
        int64_t t = (int64_t)a->targets[n] - a->v0;
        o1b_vxent_grad(a->L, zr, lse, coef, dl, dzr);    /* every v as if not the target ... */
        if (t >= 0 && t < a->L) {                           /* ... then the target's own */
            float pv = o1b_exp(o1b_sub(o1b_load(zr[t]), lse));
            float g = o1b_sub(o1b_mul(pv, coef), 1.0f);
            dzr[t] = o1b_f32_to_bf16(o1b_mul(g, dl));
        }
    }
}

O1B_API int o1b_xent_backward_chunked(int64_t N, int64_t C, int64_t V, int64_t chunk,
                                      const bf16 *h,           /* (N, C) */
                                      const bf16 *w,           /* (V, C) */
                                      const int32_t *targets,  /* (N,) */
                                      float zcoef,
                                      const float *lse,        /* (N,) the forward's lse */
                                      const float *dloss,      /* (N,) */
                                      float *dh,               /* (N, C) */
                                      float *dw) {             /* (V, C) */
    if (N <= 0 || C <= 0 || V <= 0 || chunk <= 0) return XENT_BAD_SIZE;
    if (!targets_in_range(N, V, targets)) return XENT_BAD_TARGET;
    int64_t Lmax = chunk < V ? chunk : V;
    float *z = (float *)malloc(sizeof(float) * (size_t)(N * Lmax));
    bf16 *dz = (bf16 *)malloc(sizeof(bf16) * (size_t)(N * Lmax));
    if (!z || !dz) { free(z); free(dz); return XENT_NO_MEMORY; }
    float two_zcoef = o1b_mul(2.0f, o1b_load(zcoef));

    for (int64_t v0 = 0; v0 < V; v0 += chunk) {
        int64_t L = V - v0 < chunk ? V - v0 : chunk;
        const bf16 *wc = w + v0 * C;                       /* (L, C) rows of this chunk */
        o1b_gemm(N, L, C, h, C, 1, wc, 1, C, z, L, 0);     /* logits, as in the forward */
        bwd_chunk_args a = {v0, L, z, targets, lse, dloss, two_zcoef, dz};
        o1b_parallel_for(N, row_grain(L), bwd_chunk_rows, &a);
        /* dh[n,c] (+)= sum_{j ascending} dz[n,j] w[v0+j, c]: one accumulator over all of v, so
         * the chunk boundaries do not enter dh (the GEMM stores and reloads it unchanged). */
        o1b_gemm(N, C, L, dz, L, 1, wc, C, 1, dh, C, v0 > 0);
        /* dw[v0+j, c] = sum_{n ascending} dz[n,j] h[n,c]: rows of dw disjoint between chunks */
        o1b_gemm(L, C, N, dz, 1, L, h, C, 1, dw + v0 * C, C, 0);
    }
    free(z);
    free(dz);
    return XENT_OK;
}

O1B_API int o1b_xent_backward(int64_t N, int64_t C, int64_t V, const bf16 *h, const bf16 *w,
                              const int32_t *targets, float zcoef, const float *lse,
                              const float *dloss, float *dh, float *dw) {
    return o1b_xent_backward_chunked(N, C, V, XENT_CHUNK, h, w, targets, zcoef, lse, dloss, dh, dw);
}
