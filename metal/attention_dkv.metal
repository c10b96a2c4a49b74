// attention_dkv — §6.6 backward pass 2, one thread per key row r = (b*T + j)*G + g (dk's row
// order; a launch computes the slab R0 ... R0 + grid - 1 as rows r - R0 of its outputs): over the
// heads h of group g ascending, then the queries i = j, ..., ihi(j) ascending:
//   dk = mul(sum from +0 of mul(ds, q_id), scale),  dv = sum from +0 of mul(p, dout_id).
// D is a template int. prm = T, H, G, W, R0. Grid (rows).
long T = prm[0], H = prm[1], G = prm[2], W = prm[3], R0 = prm[4];
long ro = (long)thread_position_in_grid.x, r = R0 + ro;
long g = r % G, j = (r / G) % T, b = r / (T * G), rep = H / G;
float sc = o1b_load(scale[0]);
float kv[D], vv[D], dka[D], dva[D];
for (int d = 0; d < D; d++) {
    kv[d] = o1b_bf16_to_f32(k[((b * T + j) * G + g) * D + d]);
    vv[d] = o1b_bf16_to_f32(v[((b * T + j) * G + g) * D + d]);
    dka[d] = 0.0f; dva[d] = 0.0f;
}
long ilast = W == 0 ? T - 1 : (j + W - 1 < T - 1 ? j + W - 1 : T - 1);
for (long h = g * rep; h < (g + 1) * rep; h++) {
    for (long i = j; i <= ilast; i++) {
        long qi = ((b * T + i) * H + h) * D, row = (b * H + h) * T + i;
        float s = 0.0f, dp = 0.0f;
        for (int d = 0; d < D; d++) s = o1b_add(s, o1b_mul(kv[d], o1b_bf16_to_f32(q[qi + d])));
        for (int d = 0; d < D; d++) dp = o1b_add(dp, o1b_mul(vv[d], o1b_load(dout[qi + d])));
        float p = o1b_exp(o1b_sub(o1b_mul(s, sc), o1b_load(lse[row])));
        float ds = o1b_mul(p, o1b_sub(dp, Di[row]));
        for (int d = 0; d < D; d++) {
            dka[d] = o1b_add(dka[d], o1b_mul(ds, o1b_bf16_to_f32(q[qi + d])));
            dva[d] = o1b_add(dva[d], o1b_mul(p, o1b_load(dout[qi + d])));
        }
    }
}
for (int d = 0; d < D; d++) {
    dk[ro * D + d] = o1b_store(o1b_mul(dka[d], sc));
    dv[ro * D + d] = o1b_store(dva[d]);
}
