// swiglu_forward — §6.5: h = [gate | up] (N, 2F); out_f = mul(silu(gate_f), up_f). prm = F. Grid (F, N).
long f = (long)thread_position_in_grid.x, n = (long)thread_position_in_grid.y;
long F = prm[0];
float gate = o1b_load(h[n * 2 * F + f]), up = o1b_load(h[n * 2 * F + F + f]);
out[n * F + f] = o1b_store(o1b_mul(o1b_silu(gate), up));
