/* quant_amx.c — the int8 GEMM's inner block on Intel AMX tiles, for quant_vnni.c.
 *
 * Why the bits are those of the VNNI kernel (and so of quant.c and the spec): the GEMM is an
 * integer sum. tdpbusd, like vpdpbusd, multiplies u8 by s8, adds each group of four products
 * and accumulates into int32 with wraparound; so both give the same sums modulo 2^32, whatever
 * the order, and the true sums (after quant_vnni.c subtracts 128·colsum) fit in int32
 * (Q_MAX_P). Nothing else changes: the operands are the VNNI kernel's packed A and B, read in
 * place, and the output block is the same int32 (rows, 32) array its epilogue reads.
 *
 * Operands (quant_vnni.c's layouts):
 *   A: u8 rows at a + i·lda, 64 bytes of p per tile row (a tile is 16 rows x 64 p).
 *   B: a 32-column panel; for each group of 4 p, 32 columns x 4 bytes (128 bytes). Sixteen
 *      groups (64 p) of columns 0-15 are one tile at stride 128, columns 16-31 the next 64 bytes:
 *      the VNNI layout tdpbusd's B operand asks for, with no repacking.
 * Tiles: 0-3 the (up to) 2 x 2 blocks of C (16 x 16 int32), 4-5 A, 6-7 B.
 *
 * Linux hands out the tile registers only after the process asks (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XTILEDATA), once, for every thread. Each caller loads the tile
 * configuration before a run of blocks and releases the tiles after, so an idle thread carries
 * no tile state across context switches. */
#define _GNU_SOURCE                  /* syscall() under -std=c11 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "contract.h"
#include "quant.h"
#include "runtime.h"

/* The tile intrinsics came with GCC 11 and clang 12; older compilers build the stub below. */
#if defined(O1B_Q_X86) && defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : (defined(__GNUC__) && __GNUC__ >= 11))
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ATGT __attribute__((target("amx-tile,amx-int8")))

static int g_amx_hw;                 /* CPU has AMX-TILE and AMX-INT8, and the kernel granted them */
static int g_amx_mode = -1;          /* -1 automatic (on where present), 0 off */
static pthread_once_t g_amx_once = PTHREAD_ONCE_INIT;
static atomic_llong g_amx_runs;     /* runs of blocks on tiles, for the tests to see that they ran */

static void amx_probe(void) {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return;         /* AMX-TILE, AMX-INT8 */
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return;
    g_amx_hw = 1;
}

O1B_API int o1b_q_amx_present(void) {
    pthread_once(&g_amx_once, amx_probe);
    return g_amx_hw;
}
O1B_API void o1b_set_q_amx(int on) { __atomic_store_n(&g_amx_mode, on ? -1 : 0, __ATOMIC_RELAXED); }   /* tests: 0 forces VNNI */
int o1b_q_amx_on(void) { return __atomic_load_n(&g_amx_mode, __ATOMIC_RELAXED) != 0 && o1b_q_amx_present(); }

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Palette 1, tiles 0-7 of 16 rows x 64 bytes. A global, since the intrinsic's asm does not tell
 * the compiler that it reads the memory (stores to a local copy may be dropped). */
static const tile_config g_tile_cfg = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

ATGT void o1b_q_amx_begin(void) {
    atomic_fetch_add_explicit(&g_amx_runs, 1, memory_order_relaxed);
    _tile_loadconfig(&g_tile_cfg);
}
O1B_API int64_t o1b_q_amx_runs(void) { return (int64_t)atomic_load(&g_amx_runs); }
ATGT void o1b_q_amx_end(void) { _tile_release(); }

/* out[r·32 + c] = sum over p < np of a[r·lda + p] · B[c, p] (int32 with wraparound) for
 * r < rows (16 or 32) and the panel's 32 columns; np a multiple of 64. */
ATGT void o1b_q_amx_block(const uint8_t *a, int64_t lda, int64_t np, const int8_t *bp, int rows, int32_t *out) {
    /* The tile intrinsics' asm names no memory operands: these barriers keep the caller's packing
     * stores before the tile loads, and its reads of out after the tile stores, even if this
     * function is ever inlined (LTO). */
    __asm__ volatile("" ::: "memory");
    _tile_zero(0);
    _tile_zero(1);
    if (rows == 32) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t p = 0; p < np; p += 64) {
            _tile_loadd(6, bp + p * 32, 128);
            _tile_loadd(7, bp + p * 32 + 64, 128);
            _tile_loadd(4, a + p, lda);
            _tile_loadd(5, a + 16 * lda + p, lda);
            _tile_dpbusd(0, 4, 6);
            _tile_dpbusd(1, 4, 7);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        }
        _tile_stored(2, out + 16 * 32, 128);
        _tile_stored(3, out + 16 * 32 + 16, 128);
    } else {
        for (int64_t p = 0; p < np; p += 64) {
            _tile_loadd(6, bp + p * 32, 128);
            _tile_loadd(7, bp + p * 32 + 64, 128);
            _tile_loadd(4, a + p, lda);
            _tile_dpbusd(0, 4, 6);
            _tile_dpbusd(1, 4, 7);
        }
    }
    _tile_stored(0, out, 128);
    _tile_stored(1, out + 16, 128);
    __asm__ volatile("" ::: "memory");
}

#else  /* no AMX here: quant_vnni.c keeps its VNNI kernel */
O1B_API int o1b_q_amx_present(void) { return 0; }
O1B_API void o1b_set_q_amx(int on) { (void)on; }
O1B_API int64_t o1b_q_amx_runs(void) { return 0; }
int o1b_q_amx_on(void) { return 0; }
void o1b_q_amx_begin(void) {}
void o1b_q_amx_end(void) {}
void o1b_q_amx_block(const uint8_t *a, int64_t lda, int64_t np, const int8_t *bp, int rows, int32_t *out) {
    (void)a; (void)lda; (void)np; (void)bp; (void)rows; (void)out;
}
#endif
