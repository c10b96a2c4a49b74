// rmsnorm_backward (dx) — §6.3, one thread per row n:
//   t_c = mul(dy_c, g_c) (or dy_c); sdot = sum from +0 over c ascending of mul(t_c, x_c)
//   b = mul(mul(sdot, mul(mul(r, r), r)), invC);  dx_c = sub(mul(t_c, r), mul(x_c, b)).
// prm = C. Grid (N).
long n = (long)thread_position_in_grid.x;
long C = prm[0];
float invC = o1b_div(1.0f, o1b_i2f((int)C));
float r = o1b_load(rstd[n]), sdot = 0.0f;
for (long c = 0; c < C; c++) {
    float t = o1b_load(dy[n * C + c]);
    if (HAS_G) t = o1b_mul(t, o1b_bf16_to_f32(g[c]));
    sdot = o1b_add(sdot, o1b_mul(t, o1b_load(x[n * C + c])));
}
float b = o1b_mul(o1b_mul(sdot, o1b_mul(o1b_mul(r, r), r)), invC);
for (long c = 0; c < C; c++) {
    float t = o1b_load(dy[n * C + c]);
    if (HAS_G) t = o1b_mul(t, o1b_bf16_to_f32(g[c]));
    dx[n * C + c] = o1b_store(o1b_sub(o1b_mul(t, r), o1b_mul(o1b_load(x[n * C + c]), b)));
}
