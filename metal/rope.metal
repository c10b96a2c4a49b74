// rope — §6.4, rotate-half pairs (i, i + D/2) of x (B, T, R, D) at position t = (row / R) % T.
// BWD = 0: y1 = sub(mul(x1, c), mul(x2, s)), y2 = add(mul(x2, c), mul(x1, s));
// BWD = 1 (the transpose, dy -> dx): dx1 = add(mul(dy1, c), mul(dy2, s)), dx2 = sub(mul(dy2, c), mul(dy1, s)).
// prm = T, R, D. Grid (D/2, B*T*R).
long i = (long)thread_position_in_grid.x, row = (long)thread_position_in_grid.y;
long T = prm[0], R = prm[1], D = prm[2], Dh = D / 2;
long t = (row / R) % T;
float x1 = o1b_load(x[row * D + i]), x2 = o1b_load(x[row * D + i + Dh]);
float ci = o1b_load(cs[t * Dh + i]), si = o1b_load(sn[t * Dh + i]);
if (BWD == 0) {
    y[row * D + i] = o1b_store(o1b_sub(o1b_mul(x1, ci), o1b_mul(x2, si)));
    y[row * D + i + Dh] = o1b_store(o1b_add(o1b_mul(x2, ci), o1b_mul(x1, si)));
} else {
    y[row * D + i] = o1b_store(o1b_add(o1b_mul(x1, ci), o1b_mul(x2, si)));
    y[row * D + i + Dh] = o1b_store(o1b_sub(o1b_mul(x2, ci), o1b_mul(x1, si)));
}
