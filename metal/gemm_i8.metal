// gemm_i8 — the exact int8 GEMM (CONTRACT.md §6.9), one thread per output element C[i, j]:
//   C[i, j] = sum over p < P of A(i, p) B(j, p) in int32 (|C| < 2^31 as P <= 2^17: exact in any
//   order), A(i, p) = A[oa + i sa_i + p sa_p], B(j, p) = B[ob + j sb_j + p sb_p] (int8 in
//   [-127, 127]); the offsets select a slab of rows and columns (metal/slabs.py).
// prm (int64) = J, P, sa_i, sa_p, sb_j, sb_p, oa, ob. C is (I, J) row-major. Grid (J, I).
long j = (long)thread_position_in_grid.x, i = (long)thread_position_in_grid.y;
long J = prm[0], P = prm[1], sai = prm[2], sap = prm[3], sbj = prm[4], sbp = prm[5], oa = prm[6], ob = prm[7];
int acc = 0;
for (long p = 0; p < P; p++) acc += (int)A[oa + i * sai + p * sap] * (int)B[ob + j * sbj + p * sbp];
C[i * J + j] = acc;
