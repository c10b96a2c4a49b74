// rmsnorm_forward — §6.3, one thread per row n. HAS_G (template int): with a gain g (bf16).
//   ss = sum from +0 over c ascending of mul(x_c, x_c);  r = rsqrt(add(mul(ss, invC), eps))
//   y_c = mul(mul(x_c, r), g_c)  (without gain: mul(x_c, r));  rstd = r.   prm = C. Grid (N).
long n = (long)thread_position_in_grid.x;
long C = prm[0];
float invC = o1b_div(1.0f, o1b_i2f((int)C));
float ss = 0.0f;
for (long c = 0; c < C; c++) { float v = o1b_load(x[n * C + c]); ss = o1b_add(ss, o1b_mul(v, v)); }
float r = o1b_rsqrt(o1b_add(o1b_mul(ss, invC), o1b_load(eps[0])));
rstd[n] = o1b_store(r);
for (long c = 0; c < C; c++) {
    float v = o1b_mul(o1b_load(x[n * C + c]), r);
    if (HAS_G) v = o1b_mul(v, o1b_bf16_to_f32(g[c]));
    y[n * C + c] = o1b_store(v);
}
