// attention_di — §6.6 backward: Di[b, h, i] = sum from +0 over d ascending of mul(dout_id, o_id).
// Internal (fed to attention_dq / attention_dkv). prm = T, H, D. Grid (B*H*T).
long r = (long)thread_position_in_grid.x;
long T = prm[0], H = prm[1], D = prm[2];
long i = r % T, h = (r / T) % H, b = r / (T * H);
long base = ((b * T + i) * H + h) * D;
float acc = 0.0f;
for (long d = 0; d < D; d++) acc = o1b_add(acc, o1b_mul(o1b_load(dout[base + d]), o1b_load(o[base + d])));
Di[r] = acc;
