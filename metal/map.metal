// map — y[i] = f(x[i]) for the contract function number OP (template int), CONTRACT.md §4:
// 0 exp, 1 log, 2 sin, 3 cos, 4 sqrt, 5 rsqrt, 6 sigmoid, 7 silu, 8 sqrt_int (= sqrt: Metal
// always uses the integer definition). One thread per element.
uint i = thread_position_in_grid.x;
float v = o1b_load(x[i]);
float r;
if (OP == 0) r = o1b_exp(v);
else if (OP == 1) r = o1b_log(v);
else if (OP == 2) r = o1b_sin(v);
else if (OP == 3) r = o1b_cos(v);
else if (OP == 5) r = o1b_rsqrt(v);
else if (OP == 6) r = o1b_sigmoid(v);
else if (OP == 7) r = o1b_silu(v);
else r = o1b_sqrt(v);
y[i] = o1b_store(r);
