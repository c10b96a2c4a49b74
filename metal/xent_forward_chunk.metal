// xent_forward_chunk — §6.8 forward, one vocabulary chunk [v0, v0 + L) for one row n per thread.
// z (N, L) are the chunk's logits (the contract GEMM, stored). Running state in/out: m, s, zt.
//   cm = max over v ascending of z (from -inf); m_new = max(m, cm); corr = exp(sub(m, m_new));
//   cs = sum from +0 over v ascending of exp(sub(z_v, m_new)); s = add(mul(s, corr), cs); m = m_new;
//   zt = z[target] when the target lies in this chunk.   prm = v0, L. Grid (N).
long n = (long)thread_position_in_grid.x;
long v0 = prm[0], L = prm[1];
float cm = o1b_neg(o1b_inf());
for (long v = 0; v < L; v++) cm = o1b_max(cm, o1b_load(z[n * L + v]));
float m_old = m_in[n];
float m_new = o1b_max(m_old, cm);
float corr = o1b_exp(o1b_sub(m_old, m_new));
float cs = 0.0f;
for (long v = 0; v < L; v++) cs = o1b_add(cs, o1b_exp(o1b_sub(o1b_load(z[n * L + v]), m_new)));
s_out[n] = o1b_add(o1b_mul(s_in[n], corr), cs);
m_out[n] = m_new;
long t = (long)targets[n] - v0;
zt_out[n] = (t >= 0 && t < L) ? o1b_load(z[n * L + t]) : zt_in[n];
