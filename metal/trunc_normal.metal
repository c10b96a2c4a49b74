// trunc_normal — §5, element i = index0 + i: for attempt a = 0..63 take the block
// (seed, stream, index, a); pairs (w0, w1), (w2, w3): u1 = mul(i2f((w >> 8) + 1), 2^-24),
// u2 = mul(i2f(w' >> 8), 2^-24), rad = sqrt(mul(-2, log(u1))), th = mul(2pi, u2);
// z = mul(rad, cos(th)), then mul(rad, sin(th)); the first |z| <= 2 gives mul(z, sigma); else +0.
// prm (uint32) = seed lo, seed hi, stream, unused, index0 lo, index0 hi. Grid (n).
uint i = thread_position_in_grid.x;
ulong index = ((ulong)prm[5] << 32 | (ulong)prm[4]) + (ulong)i;
float sg = o1b_load(sigma[0]);
float res = 0.0f;
bool found = false;
for (uint a = 0; a < 64 && !found; a++) {
    o1b_block w = o1b_philox_block(prm[0], prm[1], prm[2], index, a);
    for (int pair = 0; pair < 2 && !found; pair++) {
        uint wa = pair == 0 ? w.w0 : w.w2, wb = pair == 0 ? w.w1 : w.w3;
        float u1 = o1b_mul(o1b_i2f((int)((wa >> 8) + 1u)), O1B_F(0x33800000u) /* 2^-24 */);
        float u2 = o1b_mul(o1b_i2f((int)(wb >> 8)), O1B_F(0x33800000u));
        float rad = o1b_sqrt(o1b_mul(-2.0f, o1b_log(u1)));
        float th = o1b_mul(O1B_F(0x40C90FDBu) /* 0x1.921fb6p2 = 2pi */, u2);
        float z = o1b_mul(rad, o1b_cos(th));
        if ((o1b_bits(z) & 0x7FFFFFFFu) <= 0x40000000u) { res = o1b_mul(z, sg); found = true; }
        else {
            z = o1b_mul(rad, o1b_sin(th));
            if ((o1b_bits(z) & 0x7FFFFFFFu) <= 0x40000000u) { res = o1b_mul(z, sg); found = true; }
        }
    }
}
out[i] = o1b_store(res);
