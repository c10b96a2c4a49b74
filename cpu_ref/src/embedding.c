/* embedding.c — token embedding lookup and its backward (CONTRACT.md §6.2).
 * N = tokens, V = vocabulary, C = channels. */
#include <stdlib.h>
#include <string.h>

#include "contract.h"
#include "runtime.h"
#include "vmath.h"

typedef struct { const int32_t *tok; const bf16 *wte; float *out; int64_t C; } fwd_args;

static void fwd_range(void *ctx, int64_t lo, int64_t hi) {
    const fwd_args *a = (const fwd_args *)ctx;
    for (int64_t n = lo; n < hi; n++) {
        /* the row widened exactly, stored by the store rule: vmath's f32 widen on lanes */
        o1b_vto_f32(0, a->C, a->wte + (int64_t)a->tok[n] * a->C, a->out + n * a->C);
    }
}
O1B_API void o1b_embedding_forward(int64_t N, int64_t C,
                                   const int32_t *tokens, /* (N,) in [0, V), checked by the caller */
                                   const bf16 *wte,       /* (V, C) */
                                   float *out) {          /* (N, C) the rows, widened exactly */
    fwd_args a = {tokens, wte, out, C};
    o1b_parallel_for(N, 64, fwd_range, &a);
}

/* Backward without atomics: positions are bucketed by token id with a stable counting sort, so
 * each vocabulary row is summed by one thread, its positions in ascending n — the order of a
 * sequential loop over n, whatever the thread count. */
typedef struct { const int64_t *start; const int64_t *pos; const float *dout; float *dwte; int64_t C; } bwd_args;

static void bwd_range(void *ctx, int64_t lo, int64_t hi) {
    const bwd_args *a = (const bwd_args *)ctx;
    for (int64_t v = lo; v < hi; v++) {       /* c of the row on SIMD lanes (vmath.c) */
        int64_t n = a->start[v + 1] - a->start[v];
        float *drow = a->dwte + v * a->C;
        if (n == 0) memset(drow, 0, (size_t)a->C * sizeof(float));
        else o1b_vsum_rows(n, a->pos + a->start[v], a->dout, a->C, drow);
    }
}
/* Returns 0, or -1 when out of memory. */
O1B_API int o1b_embedding_backward(int64_t N, int64_t V, int64_t C,
                                   const int32_t *tokens, /* (N,) */
                                   const float *dout,     /* (N, C) */
                                   float *dwte) {         /* (V, C) dwte[v] = sum_{n: tok[n]=v, n asc} dout[n] */
    int64_t *start = calloc((size_t)V + 1, sizeof(int64_t));
    int64_t *pos = malloc((size_t)(N > 0 ? N : 1) * sizeof(int64_t));
    if (!start || !pos) { free(start); free(pos); return -1; }
    for (int64_t n = 0; n < N; n++) start[tokens[n] + 1]++;
    for (int64_t v = 0; v < V; v++) start[v + 1] += start[v];
    int64_t *fill = malloc((size_t)(V > 0 ? V : 1) * sizeof(int64_t));
    if (!fill) { free(start); free(pos); return -1; }
    for (int64_t v = 0; v < V; v++) fill[v] = start[v];
    for (int64_t n = 0; n < N; n++) pos[fill[tokens[n]]++] = n;   /* stable: n ascending per row */
    bwd_args a = {start, pos, dout, dwte, C};
    o1b_parallel_for(V, 16, bwd_range, &a);
    free(fill); free(pos); free(start);
    return 0;
}
