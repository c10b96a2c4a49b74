// quant_apply — levels from a scale (CONTRACT.md §6.9), one thread per element i of v (fp32):
// s = s[i / C] with PER_ROW (template int) = 1, else s[0]. NaN s: q = 0, clip = 2 (non-finite
// row); s = +0: q = 0, clip = 0 (zero row / tensor); else inv = div(1, s), t = mul(v, inv),
// q = level(t) (round to nearest, ties to even, clamped to [-QMAX, QMAX]: sub(add(t, MAGIC), MAGIC)
// after clamping), clip = 1 where |t| > QMAX. QMAX (template int) = 127 (int8), 31 or 7 (the
// simulated int6 / int4 paths: levels -QMAX ... QMAX in the int8 output). prm (int64) = C. Grid (n).
static_assert(QMAX == O1B_QMAX || QMAX == O1B_QMAX6 || QMAX == O1B_QMAX4,
              "QMAX must be 127 (int8), 31 (int6) or 7 (int4)");
long i = (long)thread_position_in_grid.x;
long C = prm[0];
float sc = o1b_load(s[PER_ROW ? i / C : 0]);
float qf = o1b_qmax_f(QMAX);
int lv = 0;
uchar cl = 0;
if (o1b_isnan(sc)) {
    cl = 2;
} else if ((o1b_bits(sc) & 0x7FFFFFFFu) != 0u) {
    float t = o1b_mul(o1b_load(v[i]), o1b_div(1.0f, sc));
    lv = o1b_level(t, QMAX);
    cl = (o1b_bits(t) & 0x7FFFFFFFu) > o1b_bits(qf) ? 1 : 0;   // |t| > QMAX (t is never NaN here)
}
q[i] = lv;
clip[i] = cl;
