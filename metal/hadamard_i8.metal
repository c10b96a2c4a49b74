// hadamard_i8 — the Walsh–Hadamard rotation along the rows of an int8 matrix (CONTRACT.md §6.9):
// q (R, C) int8, padded with zero rows to Rp = grid.y * QB, rotated in int32 (|values| <= 127 QB,
// exact) by the butterflies of hadamard.metal, in threadgroup memory as there (H_COLS columns of one
// block per threadgroup of H_NT), then converted by i2f (exact): y (Rp, C) fp32.
// prm (int64) = R, C. Grid (ceil(C / H_COLS) * H_NT, Rp / QB), threadgroup H_NT.
constexpr int H_NT = 256, H_COLS = 16, H_QB = 128;
threadgroup int tv[H_QB * H_COLS];                  // tv[i * H_COLS + cl]: row i, column c0 + cl
int t = (int)thread_index_in_threadgroup;
long c0 = (long)threadgroup_position_in_grid.x * H_COLS, b = (long)threadgroup_position_in_grid.y;
long R = prm[0], C = prm[1];
for (int e = t; e < H_QB * H_COLS; e += H_NT) {
    long r = b * H_QB + e / H_COLS, c = c0 + e % H_COLS;
    tv[e] = r < R && c < C ? (int)q[r * C + c] : 0;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int h = 1; h < H_QB; h <<= 1) {
    for (int p = t; p < H_QB / 2 * H_COLS; p += H_NT) {
        int j = p / H_COLS, cl = p % H_COLS;           // the j-th row i with (i & h) = 0
        int i = (j / h) * 2 * h + j % h;
        int u = tv[i * H_COLS + cl], w = tv[(i + h) * H_COLS + cl];
        tv[i * H_COLS + cl] = u + w;
        tv[(i + h) * H_COLS + cl] = u - w;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
for (int e = t; e < H_QB * H_COLS; e += H_NT) {
    long c = c0 + e % H_COLS;
    if (c < C) y[(b * H_QB + e / H_COLS) * C + c] = o1b_store(o1b_i2f(tv[e]));
}
