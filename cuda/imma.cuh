/* imma.cuh — the int8 tensor-core multiply-accumulate of one warp, as one device function, and the
 * 16-byte moves that feed it.
 *
 * o1b_mma_s8_16x8x32(d, a, b): D (16x8, int32) = A (16x32, int8) B (32x8, int8) + D, the PTX
 * instruction mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (sm_80 and later; no .satfinite, so
 * the sums wrap modulo 2^32 like the contract's int32 sums — which never overflow in §6.9's bounds).
 * Every lane of the warp must call it together, each with its fragment registers (PTX ISA, "Matrix
 * fragments for mma.m16n8k32", .s8; g = lane >> 2, t = lane & 3; element i of a fragment is byte
 * i & 3 of register i >> 2, low byte first):
 *   A (row-major, 4 registers, a0 … a15): row g for i < 4 or 8 <= i < 12, g + 8 otherwise;
 *                                           column 4t + (i & 3), plus 16 for i >= 8
 *   B (column-major, 2 registers, b0 … b7): row 4t + (i & 3), plus 16 for i >= 4; column g
 *   C, D (4 int32, c0 … c3):                row g for i < 2, g + 8 otherwise; column 2t + (i & 1)
 * Integer products and sums are exact (in any order, modulo 2^32), so the instruction's internal
 * order does not matter: its result is a function of the operands alone, which the emulator's model
 * computes directly.
 *
 * On the GPU: the inline PTX for sm_80+, and below sm_80 the same result from warp shuffles (each
 * lane gathers the A and B elements of its four outputs from the lanes that hold them); the
 * emulator runs that fallback instead of its model where O1B_IMMA_SHUFFLE is defined (its test).
 * In the CUDA emulator (g++, no __CUDA_ARCH__): an exact model of the instruction written from the
 * layout above. The 32 lanes meet at a warp-collective step (emu_warp_sync, cuda/emu/prelude.h):
 * each lane places its fragments in its warp's 16x32 A and 32x8 B, all lanes wait, each computes its
 * four outputs; consecutive calls use two buffers in turn, so no lane's next call overwrites A or B
 * while another still reads them. A lane that does not arrive is warp divergence, an error, as on
 * the GPU where mma.sync requires every lane.
 */
#ifndef O1B_IMMA_CUH
#define O1B_IMMA_CUH

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void o1b_mma_s8_16x8x32(int d[4], const u32 a[4], const u32 b[2]) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#elif defined(__CUDA_ARCH__) || defined(O1B_IMMA_SHUFFLE)
/* Signed byte e (0 … 3) of a register. */
__device__ __forceinline__ int o1b_imma_byte(u32 r, int e) { return (int)(signed char)(r >> (8 * e)); }

__device__ __forceinline__ void o1b_mma_s8_16x8x32(int d[4], const u32 a[4], const u32 b[2]) {
    int lane = (int)(threadIdx.x & 31u), g = lane >> 2, t = lane & 3;
    u32 s[4] = {(u32)d[0], (u32)d[1], (u32)d[2], (u32)d[3]};
    for (int h = 0; h < 2; h++)            /* columns 16h ... 16h + 15 of A = rows of B */
        for (int q = 0; q < 4; q++) {      /* the lane (g', q) holding A's and B's bytes 16h + 4q ... + 3 */
            u32 alo = __shfl_sync(0xFFFFFFFFu, a[2 * h], 4 * g + q);       /* A row g */
            u32 ahi = __shfl_sync(0xFFFFFFFFu, a[2 * h + 1], 4 * g + q);   /* A row g + 8 */
            u32 b0 = __shfl_sync(0xFFFFFFFFu, b[h], 4 * (2 * t) + q);      /* B column 2t */
            u32 b1 = __shfl_sync(0xFFFFFFFFu, b[h], 4 * (2 * t + 1) + q);  /* B column 2t + 1 */
            for (int e = 0; e < 4; e++) {
                int x0 = o1b_imma_byte(alo, e), x1 = o1b_imma_byte(ahi, e);
                int y0 = o1b_imma_byte(b0, e), y1 = o1b_imma_byte(b1, e);
                s[0] += (u32)(x0 * y0); s[1] += (u32)(x0 * y1);
                s[2] += (u32)(x1 * y0); s[3] += (u32)(x1 * y1);
            }
        }
    for (int i = 0; i < 4; i++) d[i] = (int)s[i];
}
#else   /* the CUDA emulator's model of the instruction */
/* Per warp of the block, two buffers used in turn (the parity of the lane's call count, equal in
 * every lane of a warp since all lanes make every call): A[row][k] and B[column][k]. */
static signed char o1b_emu_mma_a[2][32][16][32];
static signed char o1b_emu_mma_b[2][32][8][32];

static void o1b_mma_s8_16x8x32(int d[4], const u32 a[4], const u32 b[2]) {
    int w = emu_warp_index(), lane = emu_warp_lane();
    int p = (int)(emu_fibers[emu_current].mma_calls++ & 1u);
    int groupID = lane >> 2, threadID_in_group = lane % 4;
    for (int i = 0; i < 16; i++) {
        int row = (i < 4 || (8 <= i && i < 12)) ? groupID : groupID + 8;
        int col = i < 8 ? threadID_in_group * 4 + (i & 0x3) : threadID_in_group * 4 + (i & 0x3) + 16;
        o1b_emu_mma_a[p][w][row][col] = (signed char)(a[i >> 2] >> (8 * (i & 3)));
    }
    for (int i = 0; i < 8; i++) {
        int row = i < 4 ? threadID_in_group * 4 + (i & 0x3) : threadID_in_group * 4 + (i & 0x3) + 16;
        int col = groupID;
        o1b_emu_mma_b[p][w][col][row] = (signed char)(b[i >> 2] >> (8 * (i & 3)));
    }
    emu_warp_sync();                 /* all 32 lanes have placed their fragments */
    for (int i = 0; i < 4; i++) {
        int row = i < 2 ? groupID : groupID + 8;
        int col = threadID_in_group * 2 + (i & 0x1);
        u32 s = (u32)d[i];
        for (int k = 0; k < 32; k++) s += (u32)((int)o1b_emu_mma_a[p][w][row][k] * (int)o1b_emu_mma_b[p][w][col][k]);
        d[i] = (int)s;
    }
    /* No second wait: a lane that runs on writes its next call's fragments into the other buffer,
     * and cannot reach the call after that (this buffer again) before every lane has arrived at
     * the next call's wait, i.e. has finished reading this one. */
}
#endif

#ifdef __CUDA_ARCH__
/* 16 (8) bytes from global or shared memory, 16- (8-) byte aligned, as 4 (2) little-endian words;
 * 16 bytes to memory. */
__device__ __forceinline__ void o1b_load16(u32 r[4], const void *p) {
    uint4 v = *reinterpret_cast<const uint4 *>(p);
    r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
}
__device__ __forceinline__ void o1b_load8(u32 r[2], const void *p) {
    uint2 v = *reinterpret_cast<const uint2 *>(p);
    r[0] = v.x; r[1] = v.y;
}
__device__ __forceinline__ void o1b_store16(void *p, const u32 r[4]) {
    *reinterpret_cast<uint4 *>(p) = make_uint4(r[0], r[1], r[2], r[3]);
}

#else   /* the CUDA emulator */
static inline void o1b_load16(u32 r[4], const void *p) { memcpy(r, p, 16); }
static inline void o1b_load8(u32 r[2], const void *p) { memcpy(r, p, 8); }
static inline void o1b_store16(void *p, const u32 r[4]) { memcpy(p, r, 16); }
#endif

#endif
