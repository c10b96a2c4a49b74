// scale — out[i] = mul(a[i], s): averages (s = 1/M rounded once) and clipping.
uint i = thread_position_in_grid.x;
out[i] = o1b_store(o1b_mul(o1b_load(a[i]), o1b_load(s[0])));
