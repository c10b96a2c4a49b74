/* embedding.cu — token embedding lookup and its backward (CONTRACT.md §6.2).
 * N = tokens, V = vocabulary, C = channels. */
#include "contract.cuh"

/* out[n, c] = wte[tokens[n], c] widened exactly; one thread per (n, c). tokens checked by the host. */
extern "C" __global__ void o1b_embedding_forward(i64 N, i64 C, const int *tokens, const bf16 *wte, float *out) {
    i64 e = o1b_gid();
    if (e >= N * C) return;
    i64 n = e / C, c = e % C;
    out[e] = o1b_store(o1b_bf16_to_f32(wte[(i64)tokens[n] * C + c]));
}

/* dwte[v, c] = sum from +0 over the positions of token v in ascending n of dout[n, c].
 * Without atomics: the host buckets positions by token with a stable counting sort (pure data
 * movement: start (V+1,), pos (N,) with pos[start[v] .. start[v+1]) ascending), and one thread owns
 * each (v, c) and walks its bucket in order. */
extern "C" __global__ void o1b_embedding_backward(i64 V, i64 C, const i64 *start, const i64 *pos,
                                                  const float *dout, float *dwte) {
    i64 e = o1b_gid();
    if (e >= V * C) return;
    i64 v = e / C, c = e % C;
    float acc = 0.0f;
    for (i64 t = start[v]; t < start[v + 1]; t++) acc = o1b_add(acc, o1b_load(dout[pos[t] * C + c]));
    dwte[e] = o1b_store(acc);
}
