/* xent.c — fused, vocabulary-chunked cross-entropy + z-loss (CONTRACT.md, "Cross-entropy with
 * z-loss"), forward and backward, chunk by chunk: the (N, V) logits are held whole only when the
 * forward keeps them for the backward (below).
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
 *
 * Kept logits: in training the forward may keep every chunk's transposed logits (V rows of
 * o1b_xent_ldz(N) floats, zk[v * ldz + n] = z[n, v]) and the backward read them instead of running
 * the logits GEMM again. A stored fp32 copy of the same GEMM's outputs is the same bits, and
 * everything after the logits runs the same code either way, so keeping changes no result.
 */
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <emmintrin.h>
#define XENT_STREAM 1
#endif

#include "contract.h"
#include "gemm.h"
#include "runtime.h"
#include "vmath.h"

#define XENT_CHUNK 1024

enum { XENT_OK = 0, XENT_NO_MEMORY = 1, XENT_BAD_TARGET = 2, XENT_BAD_SIZE = 3 };

O1B_API int o1b_xent_chunk(void) { return XENT_CHUNK; }

static int targets_in_range(int64_t N, int64_t V, const int32_t *targets) {
    for (int64_t n = 0; n < N; n++)
        if (targets[n] < 0 || targets[n] >= V) return 0;
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Forward
 * ------------------------------------------------------------------------------------------- */
/* Rows per unit of work: whole vectors of rows at every SIMD level. */
#define XENT_ROWS 16

typedef struct {
    int64_t N, v0, L, ldz;    /* this chunk is vocabulary entries [v0, v0 + L) */
    const float *zt;          /* (L, ldz) the chunk's logits transposed: zt[j * ldz + n] = z[n, v0 + j] */
    const int32_t *targets;   /* (N,) */
    float *m, *s, *zt_n;      /* (N,) running max, running sum of exp(z - m), target logit */
    float *mn, *cs;           /* (N,) scratch: the chunk's new max and its sum of exps */
    float *keep;              /* NULL, or where the chunk's logits are kept (L, ldz) */
} fwd_chunk_args;

/* Columns [lo, hi) of the chunk's L rows into the kept logits: a copy of the stored bits. On x86
 * with streaming stores, which write whole lines to memory without first reading them (the copy
 * is read again only by the backward, after every other op of the forward has run). */
static void keep_columns(const float *src, float *dst, int64_t ldz, int64_t L, int64_t lo, int64_t hi) {
#ifdef XENT_STREAM
    if (((uintptr_t)dst & 15) == 0 && lo % 4 == 0) {
        int64_t h4 = lo + (hi - lo) / 4 * 4;
        for (int64_t j = 0; j < L; j++) {
            const float *s = src + j * ldz;
            float *d = dst + j * ldz;
            for (int64_t n = lo; n < h4; n += 4) _mm_stream_ps(d + n, _mm_loadu_ps(s + n));
            if (h4 < hi) memcpy(d + h4, s + h4, sizeof(float) * (size_t)(hi - h4));
        }
        _mm_sfence();
        return;
    }
#endif
    for (int64_t j = 0; j < L; j++) memcpy(dst + j * ldz + lo, src + j * ldz + lo, sizeof(float) * (size_t)(hi - lo));
}

/* One chunk of the online logsumexp for the rows of units [b0, b1). With the logits transposed,
 * a SIMD vector holds one logit of each of W rows, so every row's max and sum run in ascending v
 * in their own lane (vmath.c). Then, per row, the running sum is rescaled to the new max. */
static void fwd_chunk_rows(void *ctx, int64_t b0, int64_t b1) {
    const fwd_chunk_args *a = (const fwd_chunk_args *)ctx;
    int64_t lo = b0 * XENT_ROWS, hi = b1 * XENT_ROWS < a->N ? b1 * XENT_ROWS : a->N;
    o1b_vexpsum_cols(hi - lo, a->L, a->zt + lo, a->ldz, a->m + lo, a->mn + lo, a->cs + lo);
    for (int64_t n = lo; n < hi; n++) {
        float corr = o1b_exp(o1b_sub(a->m[n], a->mn[n]));   /* exp(-inf) = +0 on the first chunk */
        a->s[n] = o1b_add(o1b_mul(a->s[n], corr), a->cs[n]);
        a->m[n] = a->mn[n];
        int64_t t = (int64_t)a->targets[n] - a->v0;
        if (t >= 0 && t < a->L) a->zt_n[n] = o1b_load(a->zt[t * a->ldz + n]);
    }
    if (a->keep) keep_columns(a->zt, a->keep, a->ldz, a->L, lo, hi);
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

/* The row stride of the transposed chunks: whole vectors of rows plus one cache line, so that a
 * column of zt does not fall into a few cache sets (a power-of-two stride would). */
O1B_API int64_t o1b_xent_ldz(int64_t N) { return (N + XENT_ROWS - 1) / XENT_ROWS * XENT_ROWS + 16; }

/* The forward with an explicit chunk size: the contract fixes it at XENT_CHUNK (o1b_xent_forward);
 * the tests call other sizes to show where it enters the arithmetic. zk: NULL, or (V, ldz) floats
 * that receive every chunk's logits for o1b_xent_backward_kept (copied from the chunk that stays
 * in cache, rather than computed into memory that a write would first have to read). */
O1B_API int o1b_xent_forward_kept(int64_t N, int64_t C, int64_t V, int64_t chunk,
                                  const bf16 *h,           /* (N, C) final hidden states */
                                  const bf16 *w,           /* (V, C) LM head */
                                  const int32_t *targets,  /* (N,) in [0, V) */
                                  float zcoef,
                                  float *loss,             /* (N,) ce + zcoef lse^2 */
                                  float *lse,              /* (N,) */
                                  float *ce,               /* (N,) lse - z[target] */
                                  float *zk) {             /* NULL or (V, ldz): the logits kept */
    if (N <= 0 || C <= 0 || V <= 0 || chunk <= 0) return XENT_BAD_SIZE;
    if (!targets_in_range(N, V, targets)) return XENT_BAD_TARGET;
    int64_t Lmax = chunk < V ? chunk : V;
    int64_t ldz = o1b_xent_ldz(N);
    float *zt = (float *)malloc(sizeof(float) * (size_t)(Lmax * ldz));
    float *state = (float *)malloc(sizeof(float) * (size_t)(5 * N));
    if (!zt || !state) { free(zt); free(state); return XENT_NO_MEMORY; }
    float *m = state, *s = state + N, *zt_n = state + 2 * N;
    for (int64_t n = 0; n < N; n++) { m[n] = -INFINITY; s[n] = 0.0f; zt_n[n] = 0.0f; }

    for (int64_t v0 = 0; v0 < V; v0 += chunk) {
        int64_t L = V - v0 < chunk ? V - v0 : chunk;
        /* zt[j, n] = sum_c w[v0 + j, c] h[n, c]: the columns v0.. of linear_forward(h, w),
         * transposed (each product's operands swapped, which does not change its bits) */
        o1b_gemm(L, N, C, w + v0 * C, C, 1, h, 1, C, zt, ldz, 0);
        fwd_chunk_args a = {N, v0, L, ldz, zt, targets, m, s, zt_n, state + 3 * N, state + 4 * N,
                            zk ? zk + v0 * ldz : NULL};
        o1b_parallel_for((N + XENT_ROWS - 1) / XENT_ROWS, 1, fwd_chunk_rows, &a);
    }
    fwd_final_args f = {m, s, zt_n, o1b_load(zcoef), loss, lse, ce};
    o1b_parallel_for(N, 4096, fwd_final_rows, &f);
    free(zt);
    free(state);
    return XENT_OK;
}

O1B_API int o1b_xent_forward_chunked(int64_t N, int64_t C, int64_t V, int64_t chunk, const bf16 *h,
                                     const bf16 *w, const int32_t *targets, float zcoef, float *loss,
                                     float *lse, float *ce) {
    return o1b_xent_forward_kept(N, C, V, chunk, h, w, targets, zcoef, loss, lse, ce, NULL);
}

O1B_API int o1b_xent_forward(int64_t N, int64_t C, int64_t V, const bf16 *h, const bf16 *w,
                             const int32_t *targets, float zcoef, float *loss, float *lse, float *ce) {
    return o1b_xent_forward_kept(N, C, V, XENT_CHUNK, h, w, targets, zcoef, loss, lse, ce, NULL);
}

/* ---------------------------------------------------------------------------------------------
 * Backward
 *   d loss[n] / d z[n,v] = softmax_v (1 + 2 zcoef lse[n]) - [v == target[n]]
 *   (the z-loss term: d(zcoef lse^2)/dz_v = 2 zcoef lse softmax_v)
 * ------------------------------------------------------------------------------------------- */
typedef struct {
    int64_t N, v0, L, ldz;    /* this chunk is vocabulary entries [v0, v0 + L) */
    const float *zt;          /* (L, ldz) the chunk's logits transposed: zt[j * ldz + n] = z[n, v0 + j] */
    const int32_t *targets;   /* (N,) */
    const float *lse, *coef, *dl;   /* (N,) per row: load(lse), add(1, mul(2 zcoef, lse)), load(dloss) */
    bf16 *dzt;                /* (L, ldz) dz transposed, rounded to bf16: the GEMMs' operand */
} bwd_chunk_args;

/* dz of one chunk for the rows of units [b0, b1), rows on SIMD lanes as in the forward. */
static void bwd_chunk_rows(void *ctx, int64_t b0, int64_t b1) {
    const bwd_chunk_args *a = (const bwd_chunk_args *)ctx;
    int64_t lo = b0 * XENT_ROWS, hi = b1 * XENT_ROWS < a->N ? b1 * XENT_ROWS : a->N;
    /* every v as if not the target ... */
    o1b_vxent_grad_cols(hi - lo, a->L, a->zt + lo, a->ldz, a->lse + lo, a->coef + lo, a->dl + lo,
                        a->dzt + lo, a->ldz);
    for (int64_t n = lo; n < hi; n++) {                    /* ... then the target's own */
        int64_t t = (int64_t)a->targets[n] - a->v0;
        if (t >= 0 && t < a->L) {
            float pv = o1b_exp(o1b_sub(o1b_load(a->zt[t * a->ldz + n]), a->lse[n]));
            float g = o1b_sub(o1b_mul(pv, a->coef[n]), 1.0f);
            a->dzt[t * a->ldz + n] = o1b_f32_to_bf16(o1b_mul(g, a->dl[n]));
        }
    }
}

/* zk: NULL (the logits computed again, chunk by chunk), or what o1b_xent_forward_kept kept for
 * the same h, w and chunk. */
O1B_API int o1b_xent_backward_kept(int64_t N, int64_t C, int64_t V, int64_t chunk,
                                   const bf16 *h,           /* (N, C) */
                                   const bf16 *w,           /* (V, C) */
                                   const int32_t *targets,  /* (N,) */
                                   float zcoef,
                                   const float *lse,        /* (N,) the forward's lse */
                                   const float *dloss,      /* (N,) */
                                   const float *zk,         /* NULL or (V, ldz) */
                                   float *dh,               /* (N, C) */
                                   float *dw) {             /* (V, C) */
    if (N <= 0 || C <= 0 || V <= 0 || chunk <= 0) return XENT_BAD_SIZE;
    if (!targets_in_range(N, V, targets)) return XENT_BAD_TARGET;
    int64_t Lmax = chunk < V ? chunk : V;
    int64_t ldz = o1b_xent_ldz(N);
    float *scratch = zk ? NULL : (float *)malloc(sizeof(float) * (size_t)(Lmax * ldz));
    bf16 *dzt = (bf16 *)malloc(sizeof(bf16) * (size_t)(Lmax * ldz));
    float *rows = (float *)malloc(sizeof(float) * (size_t)(3 * N));
    if ((!zk && !scratch) || !dzt || !rows) { free(scratch); free(dzt); free(rows); return XENT_NO_MEMORY; }
    float two_zcoef = o1b_mul(2.0f, o1b_load(zcoef));
    float *lse_l = rows, *coef = rows + N, *dl = rows + 2 * N;
    for (int64_t n = 0; n < N; n++) {
        lse_l[n] = o1b_load(lse[n]);
        coef[n] = o1b_add(1.0f, o1b_mul(two_zcoef, lse_l[n]));
        dl[n] = o1b_load(dloss[n]);
    }

    for (int64_t v0 = 0; v0 < V; v0 += chunk) {
        int64_t L = V - v0 < chunk ? V - v0 : chunk;
        const bf16 *wc = w + v0 * C;                       /* (L, C) rows of this chunk */
        const float *zt = zk ? zk + v0 * ldz : scratch;
        if (!zk) o1b_gemm(L, N, C, wc, C, 1, h, 1, C, scratch, ldz, 0);   /* the logits, as in the forward */
        bwd_chunk_args a = {N, v0, L, ldz, zt, targets, lse_l, coef, dl, dzt};
        o1b_parallel_for((N + XENT_ROWS - 1) / XENT_ROWS, 1, bwd_chunk_rows, &a);
        /* dh[n,c] (+)= sum_{j ascending} dz[n,j] w[v0+j, c]: one accumulator over all of v, so
         * the chunk boundaries do not enter dh (the GEMM stores and reloads it unchanged). */
        o1b_gemm(N, C, L, dzt, 1, ldz, wc, C, 1, dh, C, v0 > 0);
        /* dw[v0+j, c] = sum_{n ascending} dz[n,j] h[n,c]: rows of dw disjoint between chunks */
        o1b_gemm(L, C, N, dzt, ldz, 1, h, C, 1, dw + v0 * C, C, 0);
    }
    free(scratch);
    free(dzt);
    free(rows);
    return XENT_OK;
}

O1B_API int o1b_xent_backward_chunked(int64_t N, int64_t C, int64_t V, int64_t chunk, const bf16 *h,
                                      const bf16 *w, const int32_t *targets, float zcoef,
                                      const float *lse, const float *dloss, float *dh, float *dw) {
    return o1b_xent_backward_kept(N, C, V, chunk, h, w, targets, zcoef, lse, dloss, NULL, dh, dw);
}

O1B_API int o1b_xent_backward(int64_t N, int64_t C, int64_t V, const bf16 *h, const bf16 *w,
                              const int32_t *targets, float zcoef, const float *lse,
                              const float *dloss, float *dh, float *dw) {
    return o1b_xent_backward_kept(N, C, V, XENT_CHUNK, h, w, targets, zcoef, lse, dloss, NULL, dh, dw);
}
