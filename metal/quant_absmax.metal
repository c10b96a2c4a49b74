// quant_absmax — the per-tensor scale of the quantized layer (CONTRACT.md §6.9), in two passes of
// this kernel. Threadgroup b (QA_NT = 256 threads) takes the elements [b B, min(n, (b + 1) B)) of x
// (fp32, loaded with flush), thread t those at b B + t, b B + t + QA_NT, ... (consecutive threads read
// consecutive elements), and writes NaN if any of them is ±inf or NaN, else their largest |x|: each
// thread's maximum, then a tree of maxes over the threadgroup in threadgroup memory (a max is exact in
// any order; |x| of a finite value compared as its bits, a non-finite one as 0xFFFFFFFF, above them
// all). The second pass is one threadgroup over the first pass's block maxima, with SCALE (template
// int) = 1: it writes s = div(a, QMAX) instead (NaN stays NaN; +0 when a = 0 or the quotient
// flushes). QMAX (template int) = 127 (int8), 31 or 7 (the simulated int6 / int4 paths); the first
// pass does not use it. prm (int64) = n, B. Grid (blocks * QA_NT), threadgroup QA_NT.
static_assert(QMAX == O1B_QMAX || QMAX == O1B_QMAX6 || QMAX == O1B_QMAX4,
              "QMAX must be 127 (int8), 31 (int6) or 7 (int4)");
constexpr uint QA_NT = 256;
threadgroup uint red[QA_NT];
uint t = thread_index_in_threadgroup;
long b = (long)threadgroup_position_in_grid.x;
long n = prm[0], B = prm[1];
long end = (b + 1) * B < n ? (b + 1) * B : n;
uint m = 0u;
for (long i = b * B + (long)t; i < end; i += (long)QA_NT) {
    uint a = o1b_bits(o1b_load(x[i])) & 0x7FFFFFFFu;
    a = a >= 0x7F800000u ? 0xFFFFFFFFu : a;
    m = a > m ? a : m;
}
red[t] = m;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint h = QA_NT / 2; h > 0; h >>= 1) {
    if (t < h) red[t] = red[t + h] > red[t] ? red[t + h] : red[t];
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (t == 0) {
    bool bad = red[0] == 0xFFFFFFFFu;
    float r = bad ? o1b_nan() : o1b_from_bits(red[0]);
    if (SCALE && !bad) r = o1b_div(r, o1b_qmax_f(QMAX));
    out[b] = o1b_store(r);
}
