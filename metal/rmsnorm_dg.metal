// rmsnorm_dg — §6.3: dg_c = sum from +0 over rows n ascending of mul(dy[n, c], mul(x[n, c], r_n)).
// One thread per column c. prm = N, C. Grid (C).
long c = (long)thread_position_in_grid.x;
long N = prm[0], C = prm[1];
float acc = 0.0f;
for (long n = 0; n < N; n++) {
    float xr = o1b_mul(o1b_load(x[n * C + c]), o1b_load(rstd[n]));
    acc = o1b_add(acc, o1b_mul(o1b_load(dy[n * C + c]), xr));
}
dg[c] = o1b_store(acc);
