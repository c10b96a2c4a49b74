// hadamard_i8 — the Walsh–Hadamard rotation along the rows of an int8 matrix (CONTRACT.md §6.9):
// q (R, C) int8, padded with zero rows to Rp = grid.y * QB, rotated in int32 (|values| <= 127 QB,
// exact) by the butterflies of hadamard.metal, then converted by i2f (exact): y (Rp, C) fp32.
// prm (int64) = R, C. Grid (C, Rp / QB).
long c = (long)thread_position_in_grid.x, b = (long)thread_position_in_grid.y;
long R = prm[0], C = prm[1];
int v[128];
for (int i = 0; i < 128; i++) {
    long r = b * 128 + i;
    v[i] = r < R ? (int)q[r * C + c] : 0;
}
for (int h = 1; h < 128; h <<= 1)
    for (int i = 0; i < 128; i++) {
        if ((i & h) != 0) continue;
        int u = v[i], w = v[i + h];
        v[i] = u + w;
        v[i + h] = u - w;
    }
for (int i = 0; i < 128; i++) y[(b * 128 + i) * C + c] = o1b_store(o1b_i2f(v[i]));
