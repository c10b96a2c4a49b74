/* attention.c — causal, optionally sliding-window, grouped-query attention, forward and
 * backward (CONTRACT.md, section "Attention").
 *
 *   B = batch, T = sequence length, H = query heads, G = key/value heads (H % G == 0; query
 *   head h reads kv head g = h / (H/G)), D = head dim, W = window (0: causal only).
 *   Key j is visible to query i iff j <= i and (W == 0 or i - j < W).
 *
 * Forward: an online softmax over key blocks of BK = 64 keys, aligned at absolute key indices
 * (block kb holds keys [kb*BK, kb*BK + BK)). BK enters the arithmetic (the running max and the
 * rescaling happen once per block), so it is a contract constant, never a tuning knob.
 * Backward: recomputes p and ds from the saved log-sum-exp; it has no block size. It is two
 * passes without atomics — one over queries (dq), one over keys (dk, dv) — and every output
 * element is summed by one thread in the written order, so the thread count changes no bit.
 * With vmath.c's rows and at least as many kv heads (B G) as threads, the two passes run as one
 * over each kv head's keys (fused_range), which computes each p and ds once: dq's terms reach each
 * query row in ascending key order, the order pass 1 adds them in, so the bits are the same.
 *
 * Inputs are first copied into head-major fp32 rows (b, head, t, d): widening bf16 and
 * flushing fp32 loads are exact, so this only moves data, and the inner loops then read
 * contiguous rows. The rows whose dot products with one vector a block needs (keys in the forward
 * and the dq pass, queries in the dk/dv pass) are also copied transposed (b, head, d, t), so that
 * the block's dot products run on SIMD lanes, one row per lane, each still summed d-ascending
 * (vmath.c's dots_t, contract.h's bits); the sums over d of the outputs (p v, ds k, ...) run
 * across d on lanes the same way (axpy), and the exps of a block on lanes (exp_sub).
 * Where the machine has a hardware flush mode, whole rows run in vmath.c's attention rows instead
 * (the same sums in the same order, bare adds under FTZ/DAZ); a row in which a product rounds to
 * exactly 2^-126 comes back and is computed here. The arrays they read are padded for them.
 * The forward (and the int8 forward, §6.10) and the dq pass run four query rows of a head at a
 * time there, the dk/dv pass four key rows of a kv head (their sums interleaved, each in its own
 * order); a row with a non-finite int8 block also comes back. The exponent ranges of the widened
 * rows (vmath.h) tell those rows which blocks cannot hold a product of 2^-126; there the products
 * go unmarked.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "contract.h"
#include "runtime.h"
#include "vmath.h"

#define O1B_ATTN_BK 64      /* contract constant: key block of the forward online softmax */
_Static_assert(O1B_ATTN_BK == O1B_VATTN_BK, "vmath.c's attention rows use the same key block");
O1B_API int o1b_attn_block(void) { return O1B_ATTN_BK; }

static int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

/* The first key visible to query i, and the last query that sees key j. */
static int64_t first_key(int64_t i, int64_t W) { return (W == 0 || i < W) ? 0 : i - W + 1; }
static int64_t last_query(int64_t j, int64_t T, int64_t W) { return W == 0 ? T - 1 : imin(T - 1, j + W - 1); }

/* The scores s[j] = mul(dot(q, k_j), scale) of n consecutive keys of a block, from the keys
 * transposed (kt[d * T + j]); returns their max (the written comparison, so a NaN score is passed
 * over). */
static float block_scores(const o1b_vkernels *vk, const float *q, const float *kt, int64_t T,
                          int64_t n, int64_t D, float scale, float *s) {
    vk->dots_t(n, D, q, kt, T, s);
    float mb = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        s[j] = o1b_mul(s[j], scale);
        mb = o1b_max(mb, s[j]);
    }
    return mb;
}

/* n floats (int32s) and O1B_VATTN_PAD zeros after them; the n are all written by the caller (a
 * scratch from the heap, not cleared: only the padding the SIMD rows may read past is) */
static void *alloc_padded(size_t n, size_t size) {
    char *p = malloc((n + O1B_VATTN_PAD) * size);
    if (p) memset(p + n * size, 0, O1B_VATTN_PAD * size);
    return p;
}

/* ---- layout: (B, T, N, D) token-major input -> (B, N, T, D) head-major fp32 rows ---- */
typedef struct { const bf16 *h; const float *f; float *out, *out_t; int64_t T, N, D; int32_t *elo, *ehi; } widen_args;

/* rows r in [lo, hi), r = (b*N + n)*T + t, by runs of one head's consecutive positions (their
 * source rows N D apart) */
static void widen_range(void *ctx, int64_t lo, int64_t hi) {
    const widen_args *a = (const widen_args *)ctx;
    const int64_t T = a->T, N = a->N, D = a->D;
    for (int64_t r = lo; r < hi;) {
        int64_t t = r % T, n = (r / T) % N, b = r / (T * N), m = imin(hi - r, T - t);
        int64_t src = ((b * T + t) * N + n) * D;
        o1b_vwiden_rows(m, D, a->h ? a->h + src : NULL, a->h ? NULL : a->f + src, N * D, a->out + r * D,
                        a->out_t ? a->out_t + (r - t) * D + t : NULL, T,
                        a->elo ? a->elo + r : NULL, a->ehi ? a->ehi + r : NULL);
        r += m;
    }
}
/* (B, T, N, D) -> head-major rows out (B, N, T, D); out_t: NULL, or the same transposed,
 * (B, N, D, T); elo, ehi: NULL, or (B, N, T) for the rows' exponent ranges */
static void to_head_major(const bf16 *h, const float *f, int64_t B, int64_t T, int64_t N, int64_t D,
                          float *out, float *out_t, int32_t *elo, int32_t *ehi) {
    widen_args a = {h, f, out, out_t, T, N, D, elo, ehi};
    o1b_parallel_for(B * N * T, 1 + 4096 / (D > 0 ? D : 1), widen_range, &a);
}

/* ---- forward (§6.6; with qv set, the int8 block product of §6.10) ---- */
typedef struct {
    int64_t T, H, G, D, W; float scale;
    const float *q, *kt, *v;   /* (B,H,T,D), (B,G,D,T) transposed, (B,G,T,D) head-major, widened (v unused with qv) */
    const float *qv;           /* NULL, or (B,G,T,D) quantized value rows (§6.10), as floats (exact integers) */
    const float *sv;           /* with qv: (B,G,T) their step sizes */
    const int8_t *qv8;         /* NULL, or the same levels packed for vmath.c's VNNI rows: (B,G) blocks of
                                  T4 Dp bytes (vmath.h; T4, Dp: T, D rounded up to 4, 16) */
    const int32_t *vlo, *vhi;  /* without qv: (B,G,T) the value rows' exponent ranges (vmath.h) */
    float *o, *lse;            /* (B,T,H,D), (B,H,T) */
    atomic_int failed;
} fwd_args;

/* §6.10's block product: pv[d] from the weights t[jj] = mul(p_j, s_v[j]) of n keys (their max
 * tmax, or nonfinite when one is NaN) and the keys' quantized value rows qv (n, D). */
static void block_pv_i8(const float *t, int64_t n, float tmax, int nonfinite, const float *qv, int64_t D,
                        int8_t *qp, int32_t *iacc, float *pv) {
    float sp = o1b_div(tmax, 127.0f);
    if (nonfinite) {
        for (int64_t d = 0; d < D; d++) pv[d] = o1b_nan();
        return;
    }
    if (sp == 0.0f) {
        for (int64_t d = 0; d < D; d++) pv[d] = 0.0f;
        return;
    }
    float inv = o1b_div(1.0f, sp);
    for (int64_t jj = 0; jj < n; jj++) qp[jj] = o1b_level(o1b_mul(t[jj], inv));
    for (int64_t d = 0; d < D; d++) iacc[d] = 0;
    for (int64_t jj = 0; jj < n; jj++) {      /* exact integer sum: any order */
        const float *vj = qv + jj * D;
        int32_t w = qp[jj];
        for (int64_t d = 0; d < D; d++) iacc[d] += w * (int32_t)vj[d];
    }
    for (int64_t d = 0; d < D; d++) pv[d] = o1b_mul(o1b_i2f(iacc[d]), sp);
}

/* Query row r = (b*H + h)*T + i with contract.h (and vk's lane kernels). acc, pv, iacc: D each. */
static void fwd_row(fwd_args *a, int64_t r, const o1b_vkernels *vk, float *acc, float *pv, int32_t *iacc) {
    const int64_t T = a->T, H = a->H, D = a->D, W = a->W, rep = a->H / a->G;
    float s[O1B_ATTN_BK], t[O1B_ATTN_BK], pb[O1B_ATTN_BK];
    int8_t qp[O1B_ATTN_BK];
    int64_t i = r % T, h = (r / T) % H, b = r / (T * H), g = h / rep;
    const float *q = a->q + r * D;
    const float *kt = a->kt + (b * a->G + g) * T * D, *v = a->v + (b * a->G + g) * T * D;
    const float *qv = a->qv ? a->qv + (b * a->G + g) * T * D : NULL;
    const float *sv = a->qv ? a->sv + (b * a->G + g) * T : NULL;
    float m = -INFINITY, l = 0.0f;
    for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
    int64_t jlo = first_key(i, W);
    for (int64_t kb = jlo / O1B_ATTN_BK; kb <= i / O1B_ATTN_BK; kb++) {
        int64_t j0 = imax(kb * O1B_ATTN_BK, jlo), j1 = imin(kb * O1B_ATTN_BK + O1B_ATTN_BK - 1, i);
        int64_t n = j1 - j0 + 1;
        float mb = block_scores(vk, q, kt + j0, T, n, D, a->scale, s);
        float m_new = o1b_max(m, mb);
        float corr = o1b_exp(o1b_sub(m, m_new));     /* exp(-inf) = 0 on the first block */
        float ps = 0.0f, tmax = 0.0f;
        int nonfinite = 0;
        for (int64_t d = 0; d < D; d++) pv[d] = 0.0f;
        vk->exp_sub(n, s, m_new, pb);                 /* s is flushed: load(s) = s */
        for (int64_t jj = 0; jj < n; jj++) {
            float p = pb[jj];
            ps = o1b_add(ps, p);
            if (qv) {
                t[jj] = o1b_mul(p, sv[j0 + jj]);             /* >= +0 or NaN */
                if (t[jj] != t[jj]) nonfinite = 1;
                else tmax = o1b_max(tmax, t[jj]);
            } else {
                vk->axpy(D, p, v + (j0 + jj) * D, pv);
            }
        }
        if (qv) block_pv_i8(t, n, tmax, nonfinite, qv + j0 * D, D, qp, iacc, pv);
        l = o1b_add(o1b_mul(l, corr), ps);
        for (int64_t d = 0; d < D; d++) acc[d] = o1b_add(o1b_mul(acc[d], corr), pv[d]);
        m = m_new;
    }
    float inv = o1b_div(1.0f, l);
    float *o = a->o + ((b * T + i) * H + h) * D;
    for (int64_t d = 0; d < D; d++) o[d] = o1b_store(o1b_mul(acc[d], inv));
    a->lse[r] = o1b_store(o1b_add(m, o1b_log(l)));
}

static void fwd_range(void *ctx, int64_t lo, int64_t hi) {
    fwd_args *a = (fwd_args *)ctx;
    const int64_t T = a->T, H = a->H, D = a->D, W = a->W, rep = a->H / a->G;
    const size_t Dn = (size_t)(D > 0 ? D : 1), R = O1B_VATTN_ROWS;
    float *acc = malloc(((R + 1) * (Dn + O1B_VATTN_PAD)) * sizeof(float) + Dn * sizeof(int32_t));
    if (!acc) { atomic_store(&a->failed, 1); return; }
    float *pv = acc + R * (Dn + O1B_VATTN_PAD);
    int32_t *iacc = (int32_t *)(pv + Dn + O1B_VATTN_PAD);
    const o1b_vkernels *vk = o1b_vkernels_now();
    int rows = vk->attn_fwd_rows != NULL;
    o1b_fpmode mode = rows ? o1b_fpmode_ftz() : (o1b_fpmode){0, 0};
    for (int64_t r = lo; r < hi;) {               /* r = (b*H + h)*T + i, one query row */
        if (!rows) { fwd_row(a, r, vk, acc, pv, iacc); r++; continue; }
        /* up to R rows of one head, interleaved; a row they leave goes the contract.h way */
        int64_t i = r % T, h = (r / T) % H, b = r / (T * H), g = h / rep;
        int nr = (int)imin((int64_t)R, imin(hi - r, T - i));
        int64_t jl[O1B_VATTN_ROWS];
        for (int k = 0; k < nr; k++) jl[k] = first_key(i + k, W);
        int done = vk->attn_fwd_rows(nr, i, jl, T, D, a->scale, a->q + r * D, a->kt + (b * a->G + g) * T * D,
                                     a->qv ? NULL : a->v + (b * a->G + g) * T * D,
                                     a->qv ? NULL : a->vlo + (b * a->G + g) * T,
                                     a->qv ? NULL : a->vhi + (b * a->G + g) * T,
                                     a->qv ? a->qv + (b * a->G + g) * T * D : NULL,
                                     a->qv ? a->sv + (b * a->G + g) * T : NULL,
                                     a->qv8 ? a->qv8 + (b * a->G + g) * ((T + 3) / 4 * 4) * ((D + 15) / 16 * 16) : NULL,
                                     acc, a->o + ((b * T + i) * H + h) * D, H * D, a->lse + r);
        for (int k = 0; k < nr; k++)
            if (!(done >> k & 1)) fwd_row(a, r + k, vk, acc, pv, iacc);
        r += nr;
    }
    o1b_fpmode_restore(mode);
    free(acc);
}

/* Returns 0, or -1 when out of memory. */
O1B_API int o1b_attention_forward(int64_t B, int64_t T, int64_t H, int64_t G, int64_t D,
                                  int64_t W,      /* window, >= 0 (0: causal only) */
                                  float scale,    /* e.g. 1/sqrt(D), rounded by the caller */
                                  const bf16 *q,  /* (B, T, H, D) */
                                  const bf16 *k,  /* (B, T, G, D) */
                                  const bf16 *v,  /* (B, T, G, D) */
                                  float *o,       /* (B, T, H, D) */
                                  float *lse) {   /* (B, H, T) m + log(l), for the backward */
    if (B * T == 0) return 0;
    size_t nq = (size_t)(B * H * T * D), nk = (size_t)(B * G * T * D);
    float *qh = alloc_padded(nq + 3 * nk, sizeof(float));             /* zero padding past kt */
    int32_t *vlo = alloc_padded(2 * (size_t)(B * G * T), sizeof(int32_t));
    if (!qh || !vlo) { free(qh); free(vlo); return -1; }
    int32_t *vhi = vlo + B * G * T;
    float *kh = qh + nq, *vh = kh + nk, *kt = vh + nk;
    to_head_major(q, NULL, B, T, H, D, qh, NULL, NULL, NULL);
    to_head_major(k, NULL, B, T, G, D, kh, kt, NULL, NULL);
    to_head_major(v, NULL, B, T, G, D, vh, NULL, vlo, vhi);
    fwd_args a = {T, H, G, D, W, o1b_load(scale), qh, kt, vh, NULL, NULL, NULL, vlo, vhi, o, lse, 0};
    o1b_parallel_for(B * H * T, 1 + (1 << 16) / (1 + T * D), fwd_range, &a);
    free(vlo);
    free(qh);
    return atomic_load(&a.failed) ? -1 : 0;
}

/* ---- forward with the int8 P·V product (CONTRACT.md §6.10) ---- */
typedef struct { const bf16 *v; float *qv; float *sv; int64_t T, G, D; } vquant_args;

/* Value row (b, g, j) -> q_v (B,G,T,D) head-major, its int8 levels held as floats (exact; the SIMD
 * rows without VNNI sum their products in fp32 lanes, see vmath.c), and s_v (B,G,T): §6.9's
 * per-tensor rule.
 * Branch-free, so the loops vectorize: the max of |x| is taken on the bits (for finite x, |x|'s bits
 * order as its value, and a max is exact in any order); the product x inv is bare, since where it
 * differs from mul (a result below 2^-126, or exactly 2^-126 from an exact product below it) the
 * level is 0 either way, and clamping before rounding gives the level (CONTRACT.md §6.9). */
static void vquant_range(void *ctx, int64_t lo, int64_t hi) {
    const vquant_args *a = (const vquant_args *)ctx;
    const int64_t D = a->D;
    int64_t j = lo % a->T, g = (lo / a->T) % a->G, b = lo / (a->T * a->G);
    for (int64_t r = lo; r < hi; r++) {            /* r = (b*G + g)*T + j */
        const bf16 *restrict src = a->v + ((b * a->T + j) * a->G + g) * D;
        float *restrict q = a->qv + r * D;
        uint32_t amax = 0;                          /* bits of max |x|; from 0x7F800000 on: inf, NaN */
        for (int64_t d = 0; d < D; d++) {
            uint32_t u = o1b_flush_bits((uint32_t)src[d] << 16) & 0x7FFFFFFFu;
            amax = u > amax ? u : amax;
        }
        int finite = amax < 0x7F800000u;
        float s = finite ? o1b_div(o1b_from_bits(amax), 127.0f) : o1b_nan();
        a->sv[r] = s;
        if (finite && s != 0.0f) {
            float inv = o1b_div(1.0f, s);
            for (int64_t d = 0; d < D; d++) {
                uint32_t t = o1b_bits(o1b_from_bits(o1b_flush_bits((uint32_t)src[d] << 16)) * inv);
                uint32_t big = 0u - (uint32_t)((t & 0x7FFFFFFFu) > 0x42FE0000u);     /* |t| > 127.0f */
                t = (t & ~big) | (big & ((t & 0x80000000u) | 0x42FE0000u));
                q[d] = (o1b_from_bits(t) + O1B_ROUND_MAGIC) - O1B_ROUND_MAGIC;  /* level 0: +0, as (float)level */
            }
        } else {
            for (int64_t d = 0; d < D; d++) q[d] = 0.0f;
        }
        if (++j == a->T) { j = 0; if (++g == a->G) { g = 0; b++; } }
    }
}

/* The levels q_v (B,G,T,D) as bytes in the packed layout of the VNNI rows (fwd_args' qv8), one
 * group of 4 keys of a kv head per item: Dp 32-bit words, word d holding key 4 jg + k's level at
 * d in byte k (little-endian; keys past T and d past D give 0). */
typedef struct { const float *qv; uint32_t *qv8; int64_t T, D; } vpack_args;
static void vpack_range(void *ctx, int64_t lo, int64_t hi) {
    const vpack_args *a = (const vpack_args *)ctx;
    const int64_t T = a->T, D = a->D, Dp = (D + 15) / 16 * 16, ng = (T + 3) / 4;
    for (int64_t it = lo; it < hi; it++) {         /* it = (b*G + g)*ng + jg */
        int64_t bg = it / ng, j = it % ng * 4;
        const float *q = a->qv + (bg * T + j) * D;
        uint32_t *restrict w = a->qv8 + it * Dp;
        int nk = (int)(T - j < 4 ? T - j : 4);
        for (int64_t d = 0; d < Dp; d++) w[d] = 0;
        for (int k = 0; k < nk; k++)
            for (int64_t d = 0; d < D; d++) w[d] |= (uint32_t)(uint8_t)(int32_t)q[k * D + d] << (8 * k);
    }
}

/* As o1b_attention_forward, with each block's P·V product in int8 (§6.10). 0, or -1 when out of memory. */
O1B_API int o1b_attention_forward_i8(int64_t B, int64_t T, int64_t H, int64_t G, int64_t D, int64_t W,
                                     float scale, const bf16 *q, const bf16 *k, const bf16 *v,
                                     float *o, float *lse) {
    if (B * T == 0) return 0;
    size_t nq = (size_t)(B * H * T * D), nk = (size_t)(B * G * T * D);
    /* the SIMD rows read up to O1B_VATTN_PAD floats past kt, qv and sv: each is followed by
     * another or by zero padding */
    float *qh = alloc_padded(nq + 3 * nk + (size_t)(B * G * T), sizeof(float));
    size_t n8 = o1b_attn_vnni_now() ? (size_t)(B * G * ((T + 3) / 4 * 4) * ((D + 15) / 16 * 16)) : 0;
    int8_t *qv8 = n8 ? malloc(n8) : NULL;           /* the packed levels (vpack_range) */
    if (!qh || (n8 && !qv8)) { free(qh); free(qv8); return -1; }
    float *kh = qh + nq, *kt = kh + nk, *qv = kt + nk, *sv = qv + nk;
    to_head_major(q, NULL, B, T, H, D, qh, NULL, NULL, NULL);
    to_head_major(k, NULL, B, T, G, D, kh, kt, NULL, NULL);
    vquant_args va = {v, qv, sv, T, G, D};
    o1b_parallel_for(B * G * T, 1 + 4096 / (D > 0 ? D : 1), vquant_range, &va);
    if (qv8) {
        vpack_args vp = {qv, (uint32_t *)(void *)qv8, T, D};
        o1b_parallel_for(B * G * ((T + 3) / 4), 1 + 1024 / (D > 0 ? D : 1), vpack_range, &vp);
    }
    fwd_args a = {T, H, G, D, W, o1b_load(scale), qh, kt, NULL, qv, sv, qv8, NULL, NULL, o, lse, 0};
    o1b_parallel_for(B * H * T, 1 + (1 << 16) / (1 + T * D), fwd_range, &a);
    free(qv8);
    free(qh);
    return atomic_load(&a.failed) ? -1 : 0;
}

/* ---- backward ---- */
typedef struct {
    int64_t T, H, G, D, W; float scale;
    const float *q, *k, *v, *dout;   /* head-major: (B,H,T,D), (B,G,T,D), (B,G,T,D), (B,H,T,D) */
    const float *qt, *kt, *vt, *dout_t;  /* the same transposed: (B,H,D,T), (B,G,D,T), ... */
    const float *o;                  /* (B,T,H,D) as given */
    const float *lse;                /* (B,H,T) as given (loaded with o1b_load) */
    const float *lse_p;              /* (B,H,T) the same loaded, with O1B_VATTN_PAD floats after */
    float *Di;                       /* (B,H,T) sum_d dout*o, with O1B_VATTN_PAD floats after */
    const int32_t *qlo, *qhi, *glo, *ghi;  /* (B,H,T) exponent ranges of the q and dout rows (vmath.h) */
    const int32_t *klo, *khi, *vlo, *vhi;  /* (B,G,T) those of the k and v rows */
    float *dq, *dk, *dv;             /* (B,T,H,D), (B,T,G,D), (B,T,G,D) */
    atomic_int failed;
} bwd_args;

/* Di = sum_{d ascending} mul(dout_id, load(o_id)) from +0; r = (b*H + h)*T + i, by runs of one
 * head's consecutive queries (their o rows H D apart) */
static void di_range(void *ctx, int64_t lo, int64_t hi) {
    bwd_args *a = (bwd_args *)ctx;
    const int64_t T = a->T, H = a->H, D = a->D;
    for (int64_t r = lo; r < hi;) {
        int64_t i = r % T, h = (r / T) % H, b = r / (T * H), m = imin(hi - r, T - i);
        o1b_vdot_rows(m, D, a->dout + r * D, D, a->o + ((b * T + i) * H + h) * D, H * D, a->Di + r);
        r += m;
    }
}

/* The backward visits pairs in chunks of up to CHUNK keys (pass 1) or queries (pass 2), only
 * so that dots_t can run their dot products on lanes; the chunk enters no sum. */
#define CHUNK 64

/* p and ds of a visible pair, from its dot(q_i, k_j) = s and dot(dout_i, v_j) = dp and the query
 * row's lse and Di:  p = exp(sub(mul(s, scale), lse)),  ds = mul(p, sub(dp, Di)). */

/* Pass 1, one query row per item r = (b*H + h)*T + i:
 *   dq_i = scale * sum_{visible j ascending} ds_ij k_j */
static void dq_row(bwd_args *a, int64_t r, const o1b_vkernels *vk, float *acc) {
    const int64_t T = a->T, H = a->H, D = a->D, rep = a->H / a->G;
    float s[CHUNK], dp[CHUNK], pb[CHUNK];
    int64_t i = r % T, h = (r / T) % H, b = r / (T * H), g = h / rep;
    const float *q = a->q + r * D, *dout = a->dout + r * D;
    const float *k = a->k + (b * a->G + g) * T * D;
    const float *kt = a->kt + (b * a->G + g) * T * D, *vt = a->vt + (b * a->G + g) * T * D;
    float lse = o1b_load(a->lse[r]), Di = a->Di[r];
    for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
    for (int64_t j0 = first_key(i, a->W); j0 <= i; j0 += CHUNK) {
        int64_t n = imin(CHUNK, i + 1 - j0);
        vk->dots_t(n, D, q, kt + j0, T, s);
        vk->dots_t(n, D, dout, vt + j0, T, dp);
        for (int64_t c = 0; c < n; c++) s[c] = o1b_mul(s[c], a->scale);
        vk->exp_sub(n, s, lse, pb);                   /* p = exp(s*scale - lse) */
        for (int64_t c = 0; c < n; c++) {             /* j = j0 + c ascending */
            float ds = o1b_mul(pb[c], o1b_sub(dp[c], Di));
            vk->axpy(D, ds, k + (j0 + c) * D, acc);
        }
    }
    float *dq = a->dq + ((b * T + i) * H + h) * D;
    for (int64_t d = 0; d < D; d++) dq[d] = o1b_store(o1b_mul(acc[d], a->scale));
}

static void dq_range(void *ctx, int64_t lo, int64_t hi) {
    bwd_args *a = (bwd_args *)ctx;
    const int64_t T = a->T, H = a->H, D = a->D, rep = a->H / a->G;
    const size_t R = O1B_VATTN_ROWS;
    float *acc = malloc(R * (size_t)((D > 0 ? D : 1) + O1B_VATTN_PAD) * sizeof(float));
    if (!acc) { atomic_store(&a->failed, 1); return; }
    const o1b_vkernels *vk = o1b_vkernels_now();
    o1b_fpmode mode = vk->attn_dq_rows ? o1b_fpmode_ftz() : (o1b_fpmode){0, 0};
    for (int64_t r = lo; r < hi;) {               /* r = (b*H + h)*T + i, one query row */
        if (!vk->attn_dq_rows) { dq_row(a, r, vk, acc); r++; continue; }
        /* up to R rows of one head, interleaved; a row they leave goes the contract.h way */
        int64_t i = r % T, h = (r / T) % H, b = r / (T * H), g = h / rep;
        int nr = (int)imin((int64_t)R, imin(hi - r, T - i));
        int64_t jl[O1B_VATTN_ROWS];
        for (int k = 0; k < nr; k++) jl[k] = first_key(i + k, a->W);
        int64_t kr = (b * a->G + g) * T, kv = kr * D;
        o1b_vattn_q qa = {T, D, a->scale, a->q + r * D, a->dout + r * D, a->lse_p + r, a->Di + r,
                          a->glo + r, a->ghi + r, a->k + kv, a->kt + kv, a->vt + kv,
                          a->klo + kr, a->khi + kr, a->vlo + kr, a->vhi + kr};
        int done = vk->attn_dq_rows(nr, i, jl, &qa, acc, a->dq + ((b * T + i) * H + h) * D, H * D);
        for (int k = 0; k < nr; k++)
            if (!(done >> k & 1)) dq_row(a, r + k, vk, acc);
        r += nr;
    }
    o1b_fpmode_restore(mode);
    free(acc);
}

/* Pass 2, one key row r = (b*G + g)*T + j:
 *   dk_j = scale * sum_{h in group ascending, then visible i ascending} ds_hij q_hi
 *   dv_j =         sum_{the same order}                                p_hij dout_hi */
static void dkv_row(bwd_args *a, int64_t r, const o1b_vkernels *vk, float *dk_acc, float *dv_acc) {
    const int64_t T = a->T, G = a->G, D = a->D, rep = a->H / a->G;
    float s[CHUNK], dp[CHUNK], pb[CHUNK];
    int64_t j = r % T, g = (r / T) % G, b = r / (T * G);
    const float *kj = a->k + r * D, *vj = a->v + r * D;
    for (int64_t d = 0; d < D; d++) { dk_acc[d] = 0.0f; dv_acc[d] = 0.0f; }
    int64_t ilast = last_query(j, T, a->W);
    for (int64_t h = g * rep; h < (g + 1) * rep; h++) {
        int64_t row0 = (b * a->H + h) * T;            /* query row of (b, h, i = 0) */
        for (int64_t i0 = j; i0 <= ilast; i0 += CHUNK) {
            int64_t n = imin(CHUNK, ilast + 1 - i0);
            /* mul(k, q) = mul(q, k): the same scores as pass 1 */
            vk->dots_t(n, D, kj, a->qt + row0 * D + i0, T, s);
            vk->dots_t(n, D, vj, a->dout_t + row0 * D + i0, T, dp);
            /* p = exp(s*scale - lse_i): the exponents, then their exps on lanes (sub(u, +0) = u
             * for every u, so exp_sub with m = +0 is exp itself) */
            for (int64_t c = 0; c < n; c++)
                s[c] = o1b_sub(o1b_mul(s[c], a->scale), o1b_load(a->lse[row0 + i0 + c]));
            vk->exp_sub(n, s, 0.0f, pb);
            for (int64_t c = 0; c < n; c++) {         /* i = i0 + c ascending */
                int64_t qi = row0 + i0 + c;
                float ds = o1b_mul(pb[c], o1b_sub(dp[c], a->Di[qi]));
                vk->axpy(D, ds, a->q + qi * D, dk_acc);
                vk->axpy(D, pb[c], a->dout + qi * D, dv_acc);
            }
        }
    }
    float *dk = a->dk + ((b * T + j) * G + g) * D, *dv = a->dv + ((b * T + j) * G + g) * D;
    for (int64_t d = 0; d < D; d++) {
        dk[d] = o1b_store(o1b_mul(dk_acc[d], a->scale));
        dv[d] = o1b_store(dv_acc[d]);
    }
}

/* Key rows j .. j+nr-1 of kv head (b, g) interleaved by vmath.c's rows (with dq's accumulators
 * where qacc is given: the fused pass); a row they leave goes the contract.h way. */
static void dkv_group(bwd_args *a, const o1b_vkernels *vk, int64_t b, int64_t g, int64_t j, int nr,
                      float *acc, float *qacc, int64_t qld, int32_t *qrare) {
    const int64_t T = a->T, G = a->G, D = a->D, rep = a->H / a->G;
    int64_t r = (b * G + g) * T + j;              /* the first key row */
    int64_t row0 = (b * a->H + g * rep) * T;      /* query row (b, first head of the group, 0) */
    int64_t il[O1B_VATTN_ROWS];
    for (int k = 0; k < nr; k++) il[k] = last_query(j + k, T, a->W);
    o1b_vattn_kv kv = {T, D, rep, a->scale, a->k + r * D, a->v + r * D,
                       a->klo + r, a->khi + r, a->vlo + r, a->vhi + r,
                       a->q + row0 * D, a->dout + row0 * D, a->qt + row0 * D, a->dout_t + row0 * D,
                       a->lse_p + row0, a->Di + row0,
                       a->qlo + row0, a->qhi + row0, a->glo + row0, a->ghi + row0};
    int64_t out = ((b * T + j) * G + g) * D;
    int done = vk->attn_dkv_rows(nr, j, il, &kv, acc, a->dk + out, a->dv + out, G * D, qacc, qld, qrare);
    for (int k = 0; k < nr; k++)
        if (!(done >> k & 1)) dkv_row(a, r + k, vk, acc, acc + D);
}

static void dkv_range(void *ctx, int64_t lo, int64_t hi) {
    bwd_args *a = (bwd_args *)ctx;
    const int64_t T = a->T, G = a->G, D = a->D;
    const size_t R = O1B_VATTN_ROWS;
    float *acc = malloc(2 * R * (size_t)((D > 0 ? D : 1) + O1B_VATTN_PAD) * sizeof(float));
    if (!acc) { atomic_store(&a->failed, 1); return; }
    const o1b_vkernels *vk = o1b_vkernels_now();
    o1b_fpmode mode = vk->attn_dkv_rows ? o1b_fpmode_ftz() : (o1b_fpmode){0, 0};
    for (int64_t r = lo; r < hi;) {               /* r = (b*G + g)*T + j, one key row */
        if (!vk->attn_dkv_rows) { dkv_row(a, r, vk, acc, acc + D); r++; continue; }
        /* up to R key rows of one kv head, interleaved; a row they leave goes the contract.h way */
        int64_t j = r % T, g = (r / T) % G, b = r / (T * G);
        int nr = (int)imin((int64_t)R, imin(hi - r, T - j));
        dkv_group(a, vk, b, g, j, nr, acc, NULL, 0, NULL);
        r += nr;
    }
    o1b_fpmode_restore(mode);
    free(acc);
}

/* Both passes at once, one kv head per item (b*G + g), with vmath.c's rows: its key rows in groups
 * of R, ascending (pass 2), and with them dq's sums, each group's terms ds_ij k_j added to the
 * accumulators of the query rows of the kv head's rep heads, so that every query's terms arrive in
 * ascending key order, as pass 1 sums them: each p and ds is computed once. A query row the rows
 * mark goes the contract.h way (dq_row). */
static void fused_range(void *ctx, int64_t lo, int64_t hi) {
    bwd_args *a = (bwd_args *)ctx;
    const int64_t T = a->T, G = a->G, D = a->D, rep = a->H / a->G, R = O1B_VATTN_ROWS;
    const int64_t qld = (D + 31) / 32 * 32;       /* whole pairs of vectors of any level */
    float *acc = malloc((2 * (size_t)R * (size_t)((D > 0 ? D : 1) + O1B_VATTN_PAD) + (size_t)(rep * T * qld))
                        * sizeof(float));
    int32_t *qrare = malloc((size_t)(rep * T) * sizeof(int32_t));
    if (!acc || !qrare) { free(acc); free(qrare); atomic_store(&a->failed, 1); return; }
    float *qacc = acc + 2 * R * ((D > 0 ? D : 1) + O1B_VATTN_PAD);
    const o1b_vkernels *vk = o1b_vkernels_now();
    o1b_fpmode mode = o1b_fpmode_ftz();
    for (int64_t item = lo; item < hi; item++) {
        int64_t g = item % G, b = item / G;
        memset(qacc, 0, (size_t)(rep * T * qld) * sizeof(float));
        memset(qrare, 0, (size_t)(rep * T) * sizeof(int32_t));
        for (int64_t j = 0; j < T;) {
            int nr = (int)imin(R, T - j);
            dkv_group(a, vk, b, g, j, nr, acc, qacc, qld, qrare);
            j += nr;
        }
        o1b_vscale_inplace(0, rep * T * qld, qacc, a->scale);   /* dq = store(mul(sum, scale)) */
        for (int64_t hh = 0; hh < rep; hh++)
            for (int64_t i = 0; i < T; i++) {
                int64_t h = g * rep + hh;
                if (qrare[hh * T + i]) { dq_row(a, (b * a->H + h) * T + i, vk, acc); continue; }
                memcpy(a->dq + ((b * T + i) * a->H + h) * D, qacc + (hh * T + i) * qld, (size_t)D * sizeof(float));
            }
    }
    o1b_fpmode_restore(mode);
    free(qrare);
    free(acc);
}

/* Returns 0, or -1 when out of memory. */
O1B_API int o1b_attention_backward(int64_t B, int64_t T, int64_t H, int64_t G, int64_t D,
                                   int64_t W, float scale,
                                   const float *dout, /* (B, T, H, D) */
                                   const bf16 *q,     /* (B, T, H, D) */
                                   const bf16 *k,     /* (B, T, G, D) */
                                   const bf16 *v,     /* (B, T, G, D) */
                                   const float *o,    /* (B, T, H, D) the forward's output */
                                   const float *lse,  /* (B, H, T)    the forward's lse */
                                   float *dq,         /* (B, T, H, D) */
                                   float *dk,         /* (B, T, G, D) */
                                   float *dv) {       /* (B, T, G, D) */
    if (B * T == 0) return 0;
    size_t nq = (size_t)(B * H * T * D), nk = (size_t)(B * G * T * D), nr = (size_t)(B * H * T);
    /* the SIMD rows read up to O1B_VATTN_PAD floats past an array: each one here is followed by
     * another or by zero padding */
    float *qh = alloc_padded(4 * nq + 4 * nk + 2 * nr + 2 * O1B_VATTN_PAD, sizeof(float));
    if (!qh) return -1;
    float *gh = qh + nq, *kh = gh + nq, *vh = kh + nk, *Di = vh + nk;
    float *lse_p = Di + nr + O1B_VATTN_PAD;
    float *qt = lse_p + nr + O1B_VATTN_PAD, *gt = qt + nq, *kt = gt + nq, *vt = kt + nk;
    memset(Di + nr, 0, O1B_VATTN_PAD * sizeof(float));
    memset(lse_p + nr, 0, O1B_VATTN_PAD * sizeof(float));
    /* exponent ranges: 4 of the query rows, 4 of the key rows, padded */
    size_t nkr = (size_t)(B * G * T);
    int32_t *qlo = alloc_padded(4 * nr + 4 * nkr, sizeof(int32_t));
    if (!qlo) { free(qh); return -1; }
    int32_t *qhi = qlo + nr, *glo = qhi + nr, *ghi = glo + nr;
    int32_t *klo = ghi + nr, *khi = klo + nkr, *vlo = khi + nkr, *vhi = vlo + nkr;
    for (size_t r = 0; r < nr; r++) lse_p[r] = o1b_load(lse[r]);
    to_head_major(q, NULL, B, T, H, D, qh, qt, qlo, qhi);
    to_head_major(NULL, dout, B, T, H, D, gh, gt, glo, ghi);
    to_head_major(k, NULL, B, T, G, D, kh, kt, klo, khi);
    to_head_major(v, NULL, B, T, G, D, vh, vt, vlo, vhi);
    bwd_args a = {T, H, G, D, W, o1b_load(scale), qh, kh, vh, gh, qt, kt, vt, gt, o, lse, lse_p, Di,
                  qlo, qhi, glo, ghi, klo, khi, vlo, vhi, dq, dk, dv, 0};
    o1b_parallel_for(B * H * T, 1 + 4096 / (1 + D), di_range, &a);
    int64_t grain = 1 + (1 << 16) / (1 + T * D);
    if (o1b_vkernels_now()->attn_dkv_rows && B * G >= o1b_get_num_threads()) {
        o1b_parallel_for(B * G, 1, fused_range, &a);      /* enough kv heads for the threads */
    } else {
        o1b_parallel_for(B * H * T, grain, dq_range, &a);
        o1b_parallel_for(B * G * T, grain, dkv_range, &a);
    }
    free(qlo);
    free(qh);
    return atomic_load(&a.failed) ? -1 : 0;
}
