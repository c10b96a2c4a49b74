// qdequant — the int8 layer's dequantization of an int32 accumulator (CONTRACT.md §6.9), one
// thread per element (i, j) of out (I, J); f = i2f(acc) (int32 -> fp32, round to nearest even, by
// o1b_i2f_acc's exact halves):
//   MODE 0 (forward y):  mul(mul(f, sc[0]), cs[j])
//   MODE 1 (dx):         mul(mul(mul(f, sc[0]), sc[1]), INV_QB)
//   MODE 2 (dW):         mul(mul(mul(mul(f, sc[0]), sc[1]), sc[2]), INV_QB), then +0 where
//                        clip = 1 and NaN where clip = 2 (a non-finite weight row).
// prm (int64) = J. Grid (J, I).
long j = (long)thread_position_in_grid.x, i = (long)thread_position_in_grid.y;
long J = prm[0];
long e = i * J + j;
float f = o1b_i2f_acc(acc[e]);
float r;
if (MODE == 0) {
    r = o1b_mul(o1b_mul(f, o1b_load(sc[0])), o1b_load(cs[j]));
} else if (MODE == 1) {
    r = o1b_mul(o1b_mul(o1b_mul(f, o1b_load(sc[0])), o1b_load(sc[1])), O1B_F(0x3C000000u) /* 0x1p-7 */);
} else {
    r = o1b_mul(o1b_mul(o1b_mul(o1b_mul(f, o1b_load(sc[0])), o1b_load(sc[1])), o1b_load(sc[2])),
                O1B_F(0x3C000000u) /* 0x1p-7 */);
    if (clip[e] == 2) r = o1b_nan();
    else if (clip[e] == 1) r = 0.0f;
}
out[e] = o1b_store(r);
