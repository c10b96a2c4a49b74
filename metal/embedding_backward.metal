// embedding_backward — dwte[v, c] = sum from +0 over the positions of token v, n ascending, of
// dout[n, c] (§6.2). The host buckets positions by token with a stable counting sort (data
// movement only): positions of v are pos[start[v]], ..., pos[start[v+1] - 1], ascending.
// prm = C. Grid (C, V).
long c = (long)thread_position_in_grid.x, v = (long)thread_position_in_grid.y;
long C = prm[0];
float acc = 0.0f;
for (long t = start[v]; t < start[v + 1]; t++)
    acc = o1b_add(acc, o1b_load(dout[pos[t] * C + c]));
dwte[v * C + c] = o1b_store(acc);
