// quant_absmax — the per-tensor scale of the quantized layer (CONTRACT.md §6.9), in two passes of
// this kernel. Thread b takes the elements [b B, min(n, (b + 1) B)) of x (fp32, loaded with flush)
// and writes NaN if any of them is ±inf or NaN, else their largest |x| (a max is exact in any
// order; |x| of a finite value compared as its bits). With SCALE (template int) = 1 it writes
// s = div(a, QMAX) instead (NaN stays NaN; +0 when a = 0 or the quotient flushes). QMAX (template
// int) = 127 (int8), 31 or 7 (the simulated int6 / int4 paths); the first pass does not use it.
// prm (int64) = n, B. Grid (blocks).
static_assert(QMAX == O1B_QMAX || QMAX == O1B_QMAX6 || QMAX == O1B_QMAX4,
              "QMAX must be 127 (int8), 31 (int6) or 7 (int4)");
long b = (long)thread_position_in_grid.x;
long n = prm[0], B = prm[1];
long end = (b + 1) * B < n ? (b + 1) * B : n;
uint m = 0u;
bool bad = false;
for (long i = b * B; i < end; i++) {
    uint a = o1b_bits(o1b_load(x[i])) & 0x7FFFFFFFu;
    bad = bad || a >= 0x7F800000u;
    m = a > m ? a : m;
}
float r = bad ? o1b_nan() : o1b_from_bits(m);
if (SCALE && !bad) r = o1b_div(r, o1b_qmax_f(QMAX));
out[b] = o1b_store(r);
