/* quant.h — what quant.c (the portable int8 layer and the public entry points) and quant_vnni.c
 * (its AVX-512 VNNI fast path) share: the §6.9 constants and the scalar helpers that define
 * every value both compute. */
#ifndef O1B_QUANT_H
#define O1B_QUANT_H

#include <stdint.h>
#include <string.h>

#include "contract.h"

#define QMAX 127
#define QB 128                          /* Hadamard block along the contraction dimension */
#define QB_LOG2 7
#define QW_COEF 0x1.6b7612p-3f          /* 2/sqrt(127) rounded to nearest fp32 */
#define INV_QB 0x1p-7f                  /* 1/QB */
#define Q_MAX_P (1 << 17)               /* contraction length bound: 2^17 * 127^2 < 2^31 */
#define QMAX4 7                         /* the simulated int4 path (levels -7 ... 7) */
#define QW_COEF4 0x1.83091ep-1f         /* 2/sqrt(7) rounded to nearest fp32 */
#define QMAX6 31                        /* the simulated int6 path (levels -31 ... 31) */
#define QW_COEF6 0x1.6fd4e8p-2f         /* 2/sqrt(31) rounded to nearest fp32 */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define O1B_Q_X86 1
#endif

static inline int is_finite(float x) { return (o1b_bits(x) & 0x7F800000u) != 0x7F800000u; }

static inline float qw_coef(int qmax) {
    return qmax == QMAX4 ? QW_COEF4 : qmax == QMAX6 ? QW_COEF6 : QW_COEF;
}

static inline uint32_t qbits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float qfrom(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* s from a row/tensor's statistics: 0 (zero scale), 1 (finite, nonzero), 2 (NaN) */
static inline int scale_kind(float s) {
    if (s != s) return 2;
    return s == 0.0f ? 0 : 1;
}
/* The per-tensor scale from an absmax (NaN when the tensor is not finite). */
static inline float tensor_scale_q(float amax, int qmax) {
    if (amax != amax) return o1b_nan();
    return o1b_div(amax, (float)qmax);   /* +0 if amax is 0 or the quotient flushes */
}
static inline float tensor_scale(float amax) { return tensor_scale_q(amax, QMAX); }
/* The weight row scale from the row's sum of |w| (k ascending). */
static inline float weight_scale_q(float S, int64_t K, int qmax) {
    return is_finite(S) ? o1b_mul(o1b_div(S, o1b_i2f((int32_t)K)), qw_coef(qmax)) : o1b_nan();
}
static inline float weight_scale(float S, int64_t K) { return weight_scale_q(S, K, QMAX); }
static inline int64_t pad_qb(int64_t n) { return (n + QB - 1) / QB * QB; }

/* The AVX-512 VNNI path (quant_vnni.c). Each returns 1 when it computed the result and 0 when
 * it did not (no such CPU or SIMD level capped below 2, not built for x86-64, or out of memory):
 * then the caller runs the portable code, which gives the same bits. */
int o1b_q_vnni_available(void);
/* A weight's operands, computed once by o1b_qweights_new_vnni and reused by later calls on the same
 * unchanged W (pw; NULL: computed in the call): s_w, the forward's packed q_w with its column sums,
 * dW's clip marks, and the dx GEMM's packed R = rot(q_w) with its sums and scale. A forward on
 * them also notes its x and s_x there, which a backward on the same x may take (same_x). */
typedef struct o1b_qweights o1b_qweights;
o1b_qweights *o1b_qweights_new_vnni(int64_t M, int64_t K, const bf16 *w);   /* NULL: no VNNI path, or no memory */
void o1b_qweights_free_vnni(o1b_qweights *pw);
int64_t o1b_qweights_bytes_vnni(const o1b_qweights *pw);
int o1b_qweights_fits_vnni(const o1b_qweights *pw, const bf16 *w, int64_t M, int64_t K);
/* Drops the x and s_x a forward noted on pw: every forward on pw starts with it, so that a forward
 * that does not note its own (the portable path) leaves no earlier forward's behind. */
void o1b_qweights_forget_x(const o1b_qweights *pw);
int o1b_qlinear_forward_vnni(int64_t N, int64_t K, int64_t M, const bf16 *x, const bf16 *w, float *y,
                             const o1b_qweights *pw);
int o1b_qlinear_backward_vnni(int64_t N, int64_t K, int64_t M, const bf16 *dy, const bf16 *x,
                              const bf16 *w, float *dx, float *dw, const o1b_qweights *pw, int same_x);
int o1b_gemm_i8_vnni(int64_t I, int64_t J, int64_t P, const int8_t *A, const int8_t *B, int32_t *C);

/* The VNNI path's GEMM block on AMX tiles (quant_amx.c): the same integer sums. on() says
 * whether to use it (CPU, kernel permission, not switched off); begin/end load and release the
 * tile configuration around a run of blocks in one thread. */
int o1b_q_amx_on(void);
void o1b_q_amx_begin(void);
void o1b_q_amx_end(void);
void o1b_q_amx_block(const uint8_t *a, int64_t lda, int64_t np, const int8_t *bp, int rows, int32_t *out);

#endif
