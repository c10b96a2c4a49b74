// adamw — §6.7, one thread per element. sc = lr, b1, b2, omb1, omb2, eps, decay, bc1, bc2
// (host scalars of §8, rounded to fp32 once).
//   m' = add(mul(b1, m), mul(omb1, g));  v' = add(mul(b2, v), mul(omb2, mul(g, g)))
//   u = div(mul(m', bc1), add(sqrt(mul(v', bc2)), eps));  p' = bf16(sub(mul(p, decay), mul(lr, u)))
uint i = thread_position_in_grid.x;
float lr = o1b_load(sc[0]), b1 = o1b_load(sc[1]), b2 = o1b_load(sc[2]), omb1 = o1b_load(sc[3]);
float omb2 = o1b_load(sc[4]), eps = o1b_load(sc[5]), decay = o1b_load(sc[6]);
float bc1 = o1b_load(sc[7]), bc2 = o1b_load(sc[8]);
float gi = o1b_load(g[i]);
float mi = o1b_add(o1b_mul(b1, o1b_load(m[i])), o1b_mul(omb1, gi));
float vi = o1b_add(o1b_mul(b2, o1b_load(v[i])), o1b_mul(omb2, o1b_mul(gi, gi)));
float u = o1b_div(o1b_mul(mi, bc1), o1b_add(o1b_sqrt(o1b_mul(vi, bc2)), eps));
float pi = o1b_sub(o1b_mul(o1b_bf16_to_f32(p[i]), decay), o1b_mul(lr, u));
m_out[i] = o1b_store(mi);
v_out[i] = o1b_store(vi);
p_out[i] = o1b_f32_to_bf16(pi);
