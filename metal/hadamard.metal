// hadamard — the Walsh–Hadamard rotation along the rows (CONTRACT.md §6.9), fp32, unnormalized.
// x (R, C) fp32 (loaded with flush), padded with +0 rows to Rp = grid.y * QB; y (Rp, C). For each
// block of QB = 128 rows and each column, stages h = 1, 2, ..., 64 in this order, each
// (v[i], v[i + h]) = (add(u, w), sub(u, w)), u = v[i], w = v[i + h], for every i < QB with
// (i & h) = 0. A threadgroup of H_NT = 256 threads rotates H_COLS = 16 columns of one block in
// threadgroup memory: the block's values in (rows read 16 consecutive columns at a time), then per
// stage thread t the butterflies t, t + H_NT, ... of its 64 x 16 (one column each, disjoint within
// the stage: how they are spread over threads changes no bit), a barrier between stages, and the
// values out. (One thread per column would keep 128 values in registers: more than an Apple GPU
// thread holds without spilling.) prm (int64) = R, C. Grid (ceil(C / H_COLS) * H_NT, Rp / QB),
// threadgroup H_NT.
constexpr int H_NT = 256, H_COLS = 16, H_QB = 128;
threadgroup float tv[H_QB * H_COLS];                // tv[i * H_COLS + cl]: row i, column c0 + cl
int t = (int)thread_index_in_threadgroup;
long c0 = (long)threadgroup_position_in_grid.x * H_COLS, b = (long)threadgroup_position_in_grid.y;
long R = prm[0], C = prm[1];
for (int e = t; e < H_QB * H_COLS; e += H_NT) {
    long r = b * H_QB + e / H_COLS, c = c0 + e % H_COLS;
    tv[e] = r < R && c < C ? o1b_load(x[r * C + c]) : 0.0f;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int h = 1; h < H_QB; h <<= 1) {
    for (int p = t; p < H_QB / 2 * H_COLS; p += H_NT) {
        int j = p / H_COLS, cl = p % H_COLS;           // the j-th row i with (i & h) = 0
        int i = (j / h) * 2 * h + j % h;
        float u = tv[i * H_COLS + cl], w = tv[(i + h) * H_COLS + cl];
        tv[i * H_COLS + cl] = o1b_add(u, w);
        tv[(i + h) * H_COLS + cl] = o1b_sub(u, w);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
for (int e = t; e < H_QB * H_COLS; e += H_NT) {
    long c = c0 + e % H_COLS;
    if (c < C) y[(b * H_QB + e / H_COLS) * C + c] = o1b_store(tv[e]);
}
