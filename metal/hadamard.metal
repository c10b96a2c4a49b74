// hadamard — the Walsh–Hadamard rotation along the rows (CONTRACT.md §6.9), fp32, unnormalized.
// x (R, C) fp32 (loaded with flush), padded with +0 rows to Rp = grid.y * QB; y (Rp, C). One
// thread per (column c, block b): the column's QB values of the block, then for h = 1, 2, ..., 64
// in this order, for every i < QB with (i & h) = 0: (v[i], v[i + h]) = (add(u, w), sub(u, w)).
// prm (int64) = R, C. Grid (C, Rp / QB).
long c = (long)thread_position_in_grid.x, b = (long)thread_position_in_grid.y;
long R = prm[0], C = prm[1];
float v[128];
for (int i = 0; i < 128; i++) {
    long r = b * 128 + i;
    v[i] = r < R ? o1b_load(x[r * C + c]) : 0.0f;
}
for (int h = 1; h < 128; h <<= 1)
    for (int i = 0; i < 128; i++) {
        if ((i & h) != 0) continue;
        float u = v[i], w = v[i + h];
        v[i] = o1b_add(u, w);
        v[i + h] = o1b_sub(u, w);
    }
for (int i = 0; i < 128; i++) y[(b * 128 + i) * C + c] = o1b_store(v[i]);
