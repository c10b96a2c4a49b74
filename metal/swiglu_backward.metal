// swiglu_backward — §6.5 with s = sigmoid(gate), silu = mul(gate, s):
//   dup = mul(dout, silu);  dgate = mul(mul(dout, up), mul(s, add(1, mul(gate, sub(1, s))))).
// dh (N, 2F) = [dgate | dup]. prm = F. Grid (F, N).
long f = (long)thread_position_in_grid.x, n = (long)thread_position_in_grid.y;
long F = prm[0];
float g = o1b_load(h[n * 2 * F + f]), u = o1b_load(h[n * 2 * F + F + f]), d = o1b_load(dout[n * F + f]);
float s = o1b_sigmoid(g), silu = o1b_mul(g, s);
float dsilu = o1b_mul(s, o1b_add(1.0f, o1b_mul(g, o1b_sub(1.0f, s))));
dh[n * 2 * F + F + f] = o1b_store(o1b_mul(d, silu));
dh[n * 2 * F + f] = o1b_store(o1b_mul(o1b_mul(d, u), dsilu));
