// xent_forward_final — §6.8: lse = add(m, log(s)); ce = sub(lse, z_target);
// loss = add(ce, mul(zcoef, mul(lse, lse))). One thread per row. Grid (N).
uint n = thread_position_in_grid.x;
float l = o1b_add(m[n], o1b_log(s[n]));
float c = o1b_sub(l, zt[n]);
float zl = o1b_mul(o1b_load(zcoef[0]), o1b_mul(l, l));
lse[n] = o1b_store(l);
ce[n] = o1b_store(c);
loss[n] = o1b_store(o1b_add(c, zl));
