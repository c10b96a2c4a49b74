// qgrad_scale — the int8 layer's dx operand G (CONTRACT.md §6.9), transposed:
//   g[m, n] = mul(dy[n, m], s_w[m]), dy (N, M) bf16, s_w (M) fp32; g (M, N) fp32.
// prm (int64) = M, N. Grid (N, M).
long n = (long)thread_position_in_grid.x, m = (long)thread_position_in_grid.y;
long M = prm[0], N = prm[1];
g[m * N + n] = o1b_store(o1b_mul(o1b_bf16_to_f32(dy[n * M + m]), o1b_load(sw[m])));
