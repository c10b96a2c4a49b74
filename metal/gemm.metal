// gemm — the contract GEMM (CONTRACT.md §6.1), tiled:
//   C[i, j] = sum from c0 over p = 0, 1, ..., P-1 ascending of mul(A(i, p), B(p, j))
// A(i, p) = A[oa + i sa_i + p sa_p], B(p, j) = B[ob + p sb_p + j sb_j] (bf16 as uint16);
// c0 = +0, or the loaded C0[i, j] when ACC (template int) is 1. C and C0 are (I, J) row-major.
// A threadgroup of GM_NT = 256 threads computes a GM_BM x GM_BN = 64 x 64 tile of C; thread
// (tx, ty) = (t % 16, t / 16) holds the 4 x 4 outputs rows ty*4 + r, columns tx*4 + c, each one fp32
// accumulator from its first product to its store. p goes through threadgroup memory in slices of
// GM_BK = 16 values, k-major (As[p][row], Bs[p][column]), widened and flushed by §2 as the operands
// are staged (exact, and what the plain loop reads), double buffered so that one barrier per slice
// separates a slice's stores from its reads and from the reuse of its buffer two slices later; the
// next slice's global loads are issued before this slice's products. Each output adds the slice's
// products for p ascending, o1b_add(acc, o1b_mul(a, b)), and keeps its accumulator across slices:
// the plain loop's sequence of roundings; a partial last slice adds only its own values of p. No
// fused multiply-add (CONTRACT.md §6.1's notes: Apple GPUs leave the sign of a flushed fused result
// unspecified, so fma() would need a software flush after every step) and no simdgroup_matrix
// (its order of accumulation is unspecified).
// Staging, per operand and slice, four values a thread, read along the operand's contiguous axis:
// when it is contiguous along p (stride 1: x and W in y = x W^T, dy in dx = dy W) thread t reads
// row t / 4, p = 4 (t % 4) ... + 3; otherwise (dW's dy^T and x, dx's W) rows 4 (t % 16) ... + 3 at
// p = t / 16, adjacent when the rows are. Any strides work either way. A thread's 64-bit offset
// into each operand is computed once and moved by one add per slice, its four values at q times a
// fixed stride from it (q a constant once the loop is unrolled): the loops hold no 64-bit multiply
// by a variable, so one variant serves buffers of any size.
// prm (int64) = I, J, P, oa, sa_i, sa_p, ob, sb_p, sb_j. Grid (tiles * 256), threadgroup 256;
// tile (row-major over ceil(I / 64) x ceil(J / 64)) = threadgroup_position_in_grid.x.
#define GM_BM 64
#define GM_BN 64
#define GM_BK 16
#define GM_NT 256
threadgroup float As[2 * GM_BK * GM_BM];                // As[s][p][r] = A(i0 + r, p0 + p), widened
threadgroup float Bs[2 * GM_BK * GM_BN];                // Bs[s][p][c] = B(p0 + p, j0 + c), widened
long I = prm[0], J = prm[1], P = prm[2], oa = prm[3], sai = prm[4], sap = prm[5];
long ob = prm[6], sbp = prm[7], sbj = prm[8];
int t = (int)thread_index_in_threadgroup, tx = t % 16, ty = t / 16;
long ntj = (J + GM_BN - 1) / GM_BN, tile = (long)threadgroup_position_in_grid.x;
long i0 = (tile / ntj) * GM_BM, j0 = (tile % ntj) * GM_BN;
int nI = (int)(I - i0 < GM_BM ? I - i0 : GM_BM), nJ = (int)(J - j0 < GM_BN ? J - j0 : GM_BN);
// this thread's staged values q = 0 ... 3 of each operand: A's at row ra + q dra of the tile and
// p = pa + q (1 - dra) of the slice, at abase + q qa in A (abase moves by one slice's step); B's likewise
bool apc = sap == 1, bpc = sbp == 1;
int ra = apc ? t / 4 : (t % 16) * 4, pa = apc ? (t % 4) * 4 : t / 16, dra = apc ? 0 : 1;
int rb = bpc ? t / 4 : (t % 16) * 4, pb = bpc ? (t % 4) * 4 : t / 16, drb = bpc ? 0 : 1;
long abase = oa + (i0 + ra) * sai + (long)pa * sap;    // value 0 of A's, at slice 0
long bbase = ob + (j0 + rb) * sbj + (long)pb * sbp;    // value 0 of B's, at slice 0
long qa = apc ? sap : sai, qb = bpc ? sbp : sbj;
long stepa = GM_BK * sap, stepb = GM_BK * sbp;
float acc[4][4];
for (int r = 0; r < 4; r++)
    for (int c = 0; c < 4; c++) {
        int ii = ty * 4 + r, jj = tx * 4 + c;
        acc[r][c] = (ACC && ii < nI && jj < nJ) ? o1b_load(C0[(i0 + ii) * J + j0 + jj]) : 0.0f;
    }
bool active = ty * 4 < nI && tx * 4 < nJ;               // threads with no output skip the products
ushort va[4], vb[4];
for (int q = 0; q < 4; q++) {
    va[q] = (ra + q * dra < nI && pa + q * (1 - dra) < P) ? A[abase + q * qa] : (ushort)0;
    vb[q] = (rb + q * drb < nJ && pb + q * (1 - drb) < P) ? B[bbase + q * qb] : (ushort)0;
}
int st = 0;                                             // the slice's buffer: 0 or GM_BK (its p offset)
for (long p0 = 0; p0 < P; p0 += GM_BK) {
    for (int q = 0; q < 4; q++) {
        As[(st + pa + q * (1 - dra)) * GM_BM + ra + q * dra] = o1b_bf16_to_f32(va[q]);
        Bs[(st + pb + q * (1 - drb)) * GM_BN + rb + q * drb] = o1b_bf16_to_f32(vb[q]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (p0 + GM_BK < P) {                               // the next slice's loads, before the products
        abase += stepa;
        bbase += stepb;
        for (int q = 0; q < 4; q++) {
            va[q] = (ra + q * dra < nI && p0 + GM_BK + pa + q * (1 - dra) < P) ? A[abase + q * qa] : (ushort)0;
            vb[q] = (rb + q * drb < nJ && p0 + GM_BK + pb + q * (1 - drb) < P) ? B[bbase + q * qb] : (ushort)0;
        }
    }
    int n = P - p0 < GM_BK ? (int)(P - p0) : GM_BK;     // padding p is never added
    if (active)
        for (int p = 0; p < n; p++) {
            float a[4], b[4];
            for (int k = 0; k < 4; k++) {
                a[k] = As[(st + p) * GM_BM + ty * 4 + k];
                b[k] = Bs[(st + p) * GM_BN + tx * 4 + k];
            }
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = o1b_add(acc[r][c], o1b_mul(a[r], b[c]));
        }
    st = GM_BK - st;
}
for (int r = 0; r < 4; r++)
    for (int c = 0; c < 4; c++) {
        int ii = ty * 4 + r, jj = tx * 4 + c;
        if (ii < nI && jj < nJ) C[(i0 + ii) * J + j0 + jj] = o1b_store(acc[r][c]);
    }
