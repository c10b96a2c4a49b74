// rope_tables — §6.4: invD = div(1, i2f(D)); lt = log(theta);
//   f_i = exp(neg(mul(mul(i2f(2i), invD), lt))); a = mul(i2f(t), f_i); cos(a), sin(a).
// prm = T, D. Grid (D/2, T); each thread recomputes f_i (the same operations, the same bits).
long i = (long)thread_position_in_grid.x, t = (long)thread_position_in_grid.y;
long D = prm[1], Dh = D / 2;
float invD = o1b_div(1.0f, o1b_i2f((int)D));
float lt = o1b_log(o1b_load(theta[0]));
float f = o1b_exp(o1b_neg(o1b_mul(o1b_mul(o1b_i2f((int)(2 * i)), invD), lt)));
float ang = o1b_mul(o1b_i2f((int)t), f);
cos_t[t * Dh + i] = o1b_store(o1b_cos(ang));
sin_t[t * Dh + i] = o1b_store(o1b_sin(ang));
