// xent_backward_dz — §6.8 backward for one chunk [v0, v0 + L): tz = mul(2, zcoef);
// coef = add(1, mul(tz, lse_n)); pv = exp(sub(z, lse_n)); g = mul(pv, coef), minus 1 at the
// target; dz = bf16(mul(g, dloss_n)) (§2 rounding: the GEMM operand). prm = v0, L. Grid (L, N).
long v = (long)thread_position_in_grid.x, n = (long)thread_position_in_grid.y;
long v0 = prm[0], L = prm[1];
float tz = o1b_mul(2.0f, o1b_load(zcoef[0]));
float l = o1b_load(lse[n]);
float dl = o1b_load(dloss[n]);
float coef = o1b_add(1.0f, o1b_mul(tz, l));
float pv = o1b_exp(o1b_sub(o1b_load(z[n * L + v]), l));
float g = o1b_mul(pv, coef);
if (v == (long)targets[n] - v0) g = o1b_sub(g, 1.0f);
dz[n * L + v] = o1b_f32_to_bf16(o1b_mul(g, dl));
