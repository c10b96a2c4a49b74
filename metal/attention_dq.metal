// attention_dq — §6.6 backward pass 1, one thread per query row r = (b*T + i)*H + h (dq's row
// order; a launch computes the slab R0 ... R0 + grid - 1 as rows r - R0 of its output):
//   for visible j ascending: s = score, p = exp(sub(s, lse_i)), dp = sum_d mul(dout_id, v_jd),
//   ds = mul(p, sub(dp, Di)); S_d = sum from +0 of mul(ds, k_jd); dq = mul(S_d, scale).
// lse and Di are (B,H,T). D is a template int. prm = T, H, G, W, R0. Grid (rows).
long T = prm[0], H = prm[1], G = prm[2], W = prm[3], R0 = prm[4];
long ro = (long)thread_position_in_grid.x, r = R0 + ro;
long h = r % H, i = (r / H) % T, b = r / (T * H), g = h / (H / G), row = (b * H + h) * T + i;
float sc = o1b_load(scale[0]);
float qv[D], gv[D], acc[D];
for (int d = 0; d < D; d++) {
    qv[d] = o1b_bf16_to_f32(q[((b * T + i) * H + h) * D + d]);
    gv[d] = o1b_load(dout[((b * T + i) * H + h) * D + d]);
    acc[d] = 0.0f;
}
float lse_i = o1b_load(lse[row]), di = Di[row];
long jlo = (W == 0 || i < W) ? 0 : i - W + 1;
for (long j = jlo; j <= i; j++) {
    long kj = ((b * T + j) * G + g) * D;
    float s = 0.0f, dp = 0.0f;
    for (int d = 0; d < D; d++) s = o1b_add(s, o1b_mul(qv[d], o1b_bf16_to_f32(k[kj + d])));
    for (int d = 0; d < D; d++) dp = o1b_add(dp, o1b_mul(gv[d], o1b_bf16_to_f32(v[kj + d])));
    float p = o1b_exp(o1b_sub(o1b_mul(s, sc), lse_i));
    float ds = o1b_mul(p, o1b_sub(dp, di));
    for (int d = 0; d < D; d++) acc[d] = o1b_add(acc[d], o1b_mul(ds, o1b_bf16_to_f32(k[kj + d])));
}
for (int d = 0; d < D; d++) dq[ro * D + d] = o1b_store(o1b_mul(acc[d], sc));
