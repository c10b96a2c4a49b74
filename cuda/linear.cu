/* linear.cu — the contract GEMM with bf16 operands and fp32 accumulation (CONTRACT.md §6.1).
 *
 *   C[i,j] (+)= sum_{p=0..P-1} mul(A(i,p), B(p,j))     p ascending, one add per term,
 *   the accumulator starting at +0 (or at the loaded old C[i,j] when accumulating).
 *
 * A(i,p) = A[i*sa_i + p*sa_p] and B(p,j) = B[p*sb_p + j*sb_j], so one kernel serves y = x W^T,
 * dx = dy W, dW = dy^T x and the fused cross-entropy's GEMMs. One thread owns one C[i,j] from its
 * first product to its store. The tiles in shared memory (TILE rows of A and TILE columns of B, TP
 * values of p at a time) only move data: each thread keeps its running accumulator across tiles and
 * adds the tile's products in ascending p, so the sequence of roundings is the plain loop's (no
 * split-K, no tensor cores, no FMA). Neither TILE nor TP enters the arithmetic.
 * Launch: block (TILE, TILE), a 1-D grid of ceil(I/TILE) * ceil(J/TILE) blocks (tile row-major:
 * block b covers rows (b / ceil(J/TILE)) * TILE.. and columns (b % ceil(J/TILE)) * TILE..).
 */
#include "contract.cuh"

#define TILE 16   /* rows of A / columns of B per block: the block is TILE x TILE threads */
#define TP 64     /* values of p per shared-memory tile */

extern "C" __global__ void o1b_gemm(i64 I, i64 J, i64 P,
                                    const bf16 *A, i64 sa_i, i64 sa_p,
                                    const bf16 *B, i64 sb_p, i64 sb_j,
                                    float *C, i64 ldc, int accumulate) {
    __shared__ float As[TILE][TP];     /* As[r][c] = A(i0 + r, p0 + c), widened */
    __shared__ float Bs[TP][TILE];     /* Bs[r][c] = B(p0 + r, j0 + c), widened */
    const int tx = threadIdx.x, ty = threadIdx.y;
    const i64 ntj = (J + TILE - 1) / TILE, i0 = ((i64)blockIdx.x / ntj) * TILE, j0 = ((i64)blockIdx.x % ntj) * TILE;
    const i64 i = i0 + ty, j = j0 + tx;
    const bool mine = i < I && j < J;
    float acc = (mine && accumulate) ? o1b_load(C[i * ldc + j]) : 0.0f;
    for (i64 p0 = 0; p0 < P; p0 += TP) {
        /* every thread of the block loads TP/TILE elements of each tile (zeros outside) ... */
        for (int s = 0; s < TP; s += TILE) {
            i64 pa = p0 + s + tx, pb = p0 + s + ty;
            As[ty][s + tx] = (i < I && pa < P) ? o1b_bf16_to_f32(A[i * sa_i + pa * sa_p]) : 0.0f;
            Bs[s + ty][tx] = (pb < P && j < J) ? o1b_bf16_to_f32(B[pb * sb_p + j * sb_j]) : 0.0f;
        }
        __syncthreads();
        /* ... then adds the tile's products to its own accumulator, p ascending, padding excluded */
        i64 n = P - p0 < TP ? P - p0 : TP;
        for (int c = 0; c < n; c++) acc = o1b_add(acc, o1b_mul(As[ty][c], Bs[c][tx]));
        __syncthreads();
    }
    if (mine) C[i * ldc + j] = o1b_store(acc);
}
