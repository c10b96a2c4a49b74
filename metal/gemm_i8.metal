// gemm_i8 — the exact int8 GEMM (CONTRACT.md §6.9), tiled:
//   C[i, j] = sum over p < P of A(i, p) B(j, p) in int32 (|C| < 2^31 as P <= 2^17: exact in any
//   order), A(i, p) = A[oa + i sa_i + p sa_p], B(j, p) = B[ob + j sb_j + p sb_p] (int8 in
//   [-127, 127]); the offsets select a slab of rows and columns (metal/slabs.py). C is (I, J) row-major.
// The structure of gemm.metal: a threadgroup of QM_NT = 256 threads computes a 64 x 64 tile of C,
// thread (tx, ty) = (t % 16, t / 16) the 4 x 4 outputs rows ty*4 + r, columns tx*4 + c; p goes
// through threadgroup memory in slices of QM_BK = 32 values (as short, k-major, double buffered, one
// barrier per slice), eight values per operand and thread, read along the operand's contiguous axis:
// contiguous along p (the forward's qx and qw): row t / 4, p = 8 (t % 4) ... + 7; otherwise (the
// backward's rotated operands, contiguous along rows): rows 8 (t % 8) ... + 7 at p = t / 8. Zeros
// pad the edges (they add nothing to an exact sum). 64-bit offsets as in gemm.metal: one add per slice.
// prm (int64) = I, J, P, sa_i, sa_p, sb_j, sb_p, oa, ob. Grid (tiles * 256), threadgroup 256;
// tile (row-major over ceil(I / 64) x ceil(J / 64)) = threadgroup_position_in_grid.x.
#define QM_BM 64
#define QM_BN 64
#define QM_BK 32
#define QM_NT 256
threadgroup short Aq[2 * QM_BK * QM_BM];                // Aq[s][p][r] = A(i0 + r, p0 + p)
threadgroup short Bq[2 * QM_BK * QM_BN];                // Bq[s][p][c] = B(j0 + c, p0 + p)
long I = prm[0], J = prm[1], P = prm[2], sai = prm[3], sap = prm[4], sbj = prm[5], sbp = prm[6];
long oa = prm[7], ob = prm[8];
int t = (int)thread_index_in_threadgroup, tx = t % 16, ty = t / 16;
long ntj = (J + QM_BN - 1) / QM_BN, tile = (long)threadgroup_position_in_grid.x;
long i0 = (tile / ntj) * QM_BM, j0 = (tile % ntj) * QM_BN;
int nI = (int)(I - i0 < QM_BM ? I - i0 : QM_BM), nJ = (int)(J - j0 < QM_BN ? J - j0 : QM_BN);
// this thread's staged values q = 0 ... 7 of each operand: A's at row ra + q dra of the tile and
// p = pa + q (1 - dra) of the slice, at abase + q qa in A (abase moves by one slice's step); B's likewise
bool apc = sap == 1, bpc = sbp == 1;
int ra = apc ? t / 4 : (t % 8) * 8, pa = apc ? (t % 4) * 8 : t / 8, dra = apc ? 0 : 1;
int rb = bpc ? t / 4 : (t % 8) * 8, pb = bpc ? (t % 4) * 8 : t / 8, drb = bpc ? 0 : 1;
long abase = oa + (i0 + ra) * sai + (long)pa * sap;    // value 0 of A's, at slice 0
long bbase = ob + (j0 + rb) * sbj + (long)pb * sbp;    // value 0 of B's, at slice 0
long qa = apc ? sap : sai, qb = bpc ? sbp : sbj;
long stepa = QM_BK * sap, stepb = QM_BK * sbp;
int acc[4][4];
for (int r = 0; r < 4; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = 0;
bool active = ty * 4 < nI && tx * 4 < nJ;               // threads with no output skip the products
short va[8], vb[8];
for (int q = 0; q < 8; q++) {
    va[q] = (ra + q * dra < nI && pa + q * (1 - dra) < P) ? (short)A[abase + q * qa] : (short)0;
    vb[q] = (rb + q * drb < nJ && pb + q * (1 - drb) < P) ? (short)B[bbase + q * qb] : (short)0;
}
int st = 0;                                             // the slice's buffer: 0 or QM_BK (its p offset)
for (long p0 = 0; p0 < P; p0 += QM_BK) {
    for (int q = 0; q < 8; q++) {
        Aq[(st + pa + q * (1 - dra)) * QM_BM + ra + q * dra] = va[q];
        Bq[(st + pb + q * (1 - drb)) * QM_BN + rb + q * drb] = vb[q];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (p0 + QM_BK < P) {                               // the next slice's loads, before the products
        abase += stepa;
        bbase += stepb;
        for (int q = 0; q < 8; q++) {
            va[q] = (ra + q * dra < nI && p0 + QM_BK + pa + q * (1 - dra) < P) ? (short)A[abase + q * qa] : (short)0;
            vb[q] = (rb + q * drb < nJ && p0 + QM_BK + pb + q * (1 - drb) < P) ? (short)B[bbase + q * qb] : (short)0;
        }
    }
    if (active)
        for (int p = 0; p < QM_BK; p++) {
            int a[4], b[4];
            for (int k = 0; k < 4; k++) {
                a[k] = (int)Aq[(st + p) * QM_BM + ty * 4 + k];
                b[k] = (int)Bq[(st + p) * QM_BN + tx * 4 + k];
            }
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++) acc[r][c] += a[r] * b[c];
        }
    st = QM_BK - st;
}
for (int r = 0; r < 4; r++)
    for (int c = 0; c < 4; c++) {
        int ii = ty * 4 + r, jj = tx * 4 + c;
        if (ii < nI && jj < nJ) C[(i0 + ii) * J + j0 + jj] = acc[r][c];
    }
