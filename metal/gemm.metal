// gemm — the contract GEMM (CONTRACT.md §6.1), one thread per output element C[i, j]:
//   C[i, j] = sum from c0 over p = 0, 1, ..., P-1 ascending of mul(A(i, p), B(p, j))
// A(i, p) = A[oa + i sa_i + p sa_p], B(p, j) = B[ob + p sb_p + j sb_j] (bf16 as uint16);
// c0 = +0, or the loaded C0[i, j] when ACC (template int) is 1. C is (I, J) row-major.
// prm (int64) = J, P, oa, sa_i, sa_p, ob, sb_p, sb_j. Grid (J, I).
long j = (long)thread_position_in_grid.x, i = (long)thread_position_in_grid.y;
long J = prm[0], P = prm[1], oa = prm[2], sai = prm[3], sap = prm[4];
long ob = prm[5], sbp = prm[6], sbj = prm[7];
long ci = i * J + j;
float acc = ACC ? o1b_load(C0[ci]) : 0.0f;
for (long p = 0; p < P; p++) {
    float a = o1b_bf16_to_f32(A[oa + i * sai + p * sap]);
    float b = o1b_bf16_to_f32(B[ob + p * sbp + j * sbj]);
    acc = o1b_add(acc, o1b_mul(a, b));
}
C[ci] = o1b_store(acc);
