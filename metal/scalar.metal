// scalar — one contract operation on scalars (host-side contract arithmetic, one thread):
// OP (template int) 0 add(a, b), 1 sub(a, b), 2 mul(a, b), 3 div(a, b), 4 sqrt(a),
// 5 clip coefficient div(b, add(a, 0x1.0c6f7ap-20)) with a = norm, b = max_norm (§7).
float a = o1b_load(ab[0]), b = o1b_load(ab[1]);
float r;
if (OP == 0) r = o1b_add(a, b);
else if (OP == 1) r = o1b_sub(a, b);
else if (OP == 2) r = o1b_mul(a, b);
else if (OP == 3) r = o1b_div(a, b);
else if (OP == 4) r = o1b_sqrt(a);
else r = o1b_div(b, o1b_add(a, O1B_F(0x358637BDu) /* 0x1.0c6f7ap-20 = 1e-6 */));
out[0] = o1b_store(r);
