/* sha256_mb.c — the Merkle leaves of mlx_open1b/hashing.py: leaf = SHA-256(0x00 || chunk)
 * (FIPS 180-4), many leaves per call.
 *
 * On AVX-512 the leaves are hashed 16 at a time, one message per 32-bit lane, longest first; a
 * lane whose message ends takes the next one (its state lanes reset to the initial hash), so
 * leaves of any lengths keep the lanes busy. Each block's 16 message words come from 16 row loads
 * (one per lane), a byte swap and a 16 x 16 dword transpose. When fewer than MIN_LANES messages
 * are left in flight, each goes on alone from its lane's state (the state after a block is all
 * SHA-256 carries): with the SHA extensions where the CPU has them (level >= 1), else portable C.
 * Every path is the same function of the bytes, so the digests never depend on it; tests compare
 * them with hashlib at every padding edge and SIMD level.
 *
 * Runs on the calling thread only: the caller's background hashing thread must not queue behind
 * the training step's kernels in the thread pool. */
#include "runtime.h"
#include "sha256_mb.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define O1B_SHA_MB 1
#endif

static const uint32_t K256[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u,
};
static const uint32_t H256[8] = {
    0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au, 0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u,
};

/* ------------------------------------------------------------------ the padded message, by block
 * The message is 0x00 || data (len + 1 bytes), then 0x80, zeros, and the bit length as a 64-bit
 * big-endian number ending a block. Block b covers message bytes [64b, 64b + 64), i.e. data bytes
 * [64b - 1, 64b + 63). */
static int64_t n_blocks(int64_t len) { return (len + 1 + 8) / 64 + 1; }

/* Block b is data bytes only (no prefix, no padding): read it in place at data + 64b - 1. */
static int whole_block(int64_t len, int64_t b) { return b >= 1 && 64 * b + 63 <= len; }

/* Any other block, written into buf. */
static void edge_block(const uint8_t *data, int64_t len, int64_t b, uint8_t buf[64]) {
    int64_t m0 = 64 * b, mlen = len + 1;                    /* message bytes [m0, m0 + 64) */
    memset(buf, 0, 64);
    for (int j = 0; j < 64; j++) {
        int64_t m = m0 + j;
        if (m == 0) buf[j] = 0x00;
        else if (m < mlen) buf[j] = data[m - 1];
        else if (m == mlen) buf[j] = 0x80;
    }
    if (b == n_blocks(len) - 1) {
        uint64_t bits = (uint64_t)mlen * 8u;
        for (int j = 0; j < 8; j++) buf[56 + j] = (uint8_t)(bits >> (56 - 8 * j));
    }
}

/* ------------------------------------------------------------------ portable: one message */
static uint32_t ror32(uint32_t x, int r) { return (x >> r) | (x << (32 - r)); }

static void compress1(uint32_t h[8], const uint8_t *p) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 | (uint32_t)p[4 * t + 2] << 8 | p[4 * t + 3];
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = ror32(w[t - 15], 7) ^ ror32(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = ror32(w[t - 2], 17) ^ ror32(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int t = 0; t < 64; t++) {
        uint32_t t1 = hh + (ror32(e, 6) ^ ror32(e, 11) ^ ror32(e, 25)) + ((e & f) ^ (~e & g)) + K256[t] + w[t];
        uint32_t t2 = (ror32(a, 2) ^ ror32(a, 13) ^ ror32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
}

static void put_digest(uint8_t *out, const uint32_t h[8]) {
    for (int k = 0; k < 8; k++)
        for (int j = 0; j < 4; j++) out[4 * k + j] = (uint8_t)(h[k] >> (24 - 8 * j));
}

/* ------------------------------------------------------------------ SHA extensions: one message */
#if defined(O1B_SHA_MB)
#define O1B_SHANI_TGT __attribute__((target("sha,ssse3,sse4.1")))

/* nblocks consecutive blocks at p (the state order of FIPS 180-4 in h). */
static O1B_SHANI_TGT void compress_ni(uint32_t h[8], const uint8_t *p, int64_t nblocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)h), 0xb1);          /* CDAB */
    __m128i st1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)(h + 4)), 0x1b);    /* EFGH */
    __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);                                          /* ABEF */
    st1 = _mm_blend_epi16(st1, tmp, 0xf0);                                               /* CDGH */
    for (; nblocks > 0; nblocks--, p += 64) {
        __m128i abef = st0, cdgh = st1, m[4];
        for (int i = 0; i < 4; i++) m[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
        for (int i = 0; i < 16; i++) {                  /* rounds 4i .. 4i + 3; m[i & 3] = w[4i .. 4i + 3] */
            __m128i wk = _mm_add_epi32(m[i & 3], _mm_loadu_si128((const __m128i *)(K256 + 4 * i)));
            st1 = _mm_sha256rnds2_epu32(st1, st0, wk);
            st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(wk, 0x0e));
            if (i < 12)                                 /* w[4i + 16 ..] replaces w[4i ..] */
                m[i & 3] = _mm_sha256msg2_epu32(
                    _mm_add_epi32(_mm_sha256msg1_epu32(m[i & 3], m[(i + 1) & 3]),
                                  _mm_alignr_epi8(m[(i + 3) & 3], m[(i + 2) & 3], 4)),
                    m[(i + 3) & 3]);
        }
        st0 = _mm_add_epi32(st0, abef);
        st1 = _mm_add_epi32(st1, cdgh);
    }
    tmp = _mm_shuffle_epi32(st0, 0x1b);                                                  /* FEBA */
    st1 = _mm_shuffle_epi32(st1, 0xb1);                                                  /* DCHG */
    _mm_storeu_si128((__m128i *)h, _mm_blend_epi16(tmp, st1, 0xf0));                     /* DCBA */
    _mm_storeu_si128((__m128i *)(h + 4), _mm_alignr_epi8(st1, tmp, 8));                  /* HGFE */
}

static int probe_sha_ni(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 29 & 1) && __builtin_cpu_supports("sse4.1");
}
static int g_sha_ni_mode = -1;      /* -1: where the CPU has them; 0: off (tests run the other finish) */
/* cpuid once per process: it traps to the hypervisor on virtual machines. */
static int has_sha_ni(void) {
    static int cached = -1;          /* a race here only repeats the same probe */
    if (__atomic_load_n(&g_sha_ni_mode, __ATOMIC_RELAXED) == 0) return 0;
    int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v < 0) { v = probe_sha_ni(); __atomic_store_n(&cached, v, __ATOMIC_RELAXED); }
    return v;
}
#endif
/* Tests: 0 keeps the SHA extensions unused, so that a CPU that has them also runs what one
 * without them runs (the 16 lanes' last leaves finished in portable C); 1 restores them. */
O1B_API void o1b_set_sha_ni(int on) {
#if defined(O1B_SHA_MB)
    __atomic_store_n(&g_sha_ni_mode, on ? -1 : 0, __ATOMIC_RELAXED);
#else
    (void)on;
#endif
}

/* nblocks consecutive blocks at p, by the SHA extensions where `ni`, else portable. */
static void compress_n(uint32_t h[8], const uint8_t *p, int64_t nblocks, int ni) {
#if defined(O1B_SHA_MB)
    if (ni) { compress_ni(h, p, nblocks); return; }
#endif
    (void)ni;
    for (; nblocks > 0; nblocks--, p += 64) compress1(h, p);
}

/* Blocks b0 .. of one message from state h; its digest to out. */
static void finish1(uint32_t h[8], const uint8_t *data, int64_t len, int64_t b0, uint8_t *out, int ni) {
    uint8_t buf[64];
    int64_t nb = n_blocks(len), b = b0;
    while (b < nb) {
        if (whole_block(len, b)) {
            int64_t run = 1;
            while (b + run < nb && whole_block(len, b + run)) run++;
            compress_n(h, data + 64 * b - 1, run, ni);
            b += run;
        } else {
            edge_block(data, len, b, buf);
            compress_n(h, buf, 1, ni);
            b++;
        }
    }
    put_digest(out, h);
}

static void leaf1(const uint8_t *data, int64_t len, uint8_t *out, int ni) {
    uint32_t h[8];
    memcpy(h, H256, sizeof h);
    finish1(h, data, len, 0, out, ni);
}

/* ------------------------------------------------------------------ AVX-512: 16 messages of one length */
#if defined(O1B_SHA_MB)
#define O1B_SHA_TGT __attribute__((target("avx512f,avx512bw")))

/* rows[i] holds lane i's 16 message words (big-endian bytes); w[t] gets word t of every lane. */
static O1B_SHA_TGT void transpose16(const __m512i rows[16], __m512i w[16]) {
    const __m512i bswap = _mm512_set4_epi32(0x0c0d0e0f, 0x08090a0b, 0x04050607, 0x00010203);
    __m512i r[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_shuffle_epi8(rows[i], bswap);
    for (int i = 0; i < 16; i += 2) {                   /* pairs of rows, 32-bit interleave */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {                   /* 128-bit lane k of u[i + j]: word 4k + j of rows i..i+3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {                       /* gather 128-bit lane k of u[j], u[4+j], u[8+j], u[12+j] */
        __m512i s0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
        __m512i s1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
        __m512i s2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        __m512i s3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
        w[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        w[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xdd);
        w[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        w[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xdd);
    }
}

#define XOR3(x, y, z) _mm512_ternarylogic_epi32((x), (y), (z), 0x96)
#define CH(e, f, g) _mm512_ternarylogic_epi32((e), (f), (g), 0xca)     /* e ? f : g */
#define MAJ(a, b, c) _mm512_ternarylogic_epi32((a), (b), (c), 0xe8)
#define ROR(x, r) _mm512_ror_epi32((x), (r))

static O1B_SHA_TGT void compress16(__m512i h[8], __m512i w[16]) {
    __m512i a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
#pragma GCC unroll 64                                  /* constant indices: w and the state in registers */
    for (int t = 0; t < 64; t++) {
        __m512i wt;
        if (t < 16) {
            wt = w[t];
        } else {                                        /* w[t & 15] holds w[t - 16] until replaced */
            __m512i w15 = w[(t - 15) & 15], w2 = w[(t - 2) & 15];
            __m512i s0 = XOR3(ROR(w15, 7), ROR(w15, 18), _mm512_srli_epi32(w15, 3));
            __m512i s1 = XOR3(ROR(w2, 17), ROR(w2, 19), _mm512_srli_epi32(w2, 10));
            wt = _mm512_add_epi32(_mm512_add_epi32(w[t & 15], s0), _mm512_add_epi32(w[(t - 7) & 15], s1));
            w[t & 15] = wt;
        }
        __m512i t1 = _mm512_add_epi32(_mm512_add_epi32(hh, XOR3(ROR(e, 6), ROR(e, 11), ROR(e, 25))),
                                      _mm512_add_epi32(CH(e, f, g),
                                                       _mm512_add_epi32(_mm512_set1_epi32((int)K256[t]), wt)));
        __m512i t2 = _mm512_add_epi32(XOR3(ROR(a, 2), ROR(a, 13), ROR(a, 22)), MAJ(a, b, c));
        hh = g; g = f; f = e; e = _mm512_add_epi32(d, t1); d = c; c = b; b = a; a = _mm512_add_epi32(t1, t2);
    }
    h[0] = _mm512_add_epi32(h[0], a); h[1] = _mm512_add_epi32(h[1], b);
    h[2] = _mm512_add_epi32(h[2], c); h[3] = _mm512_add_epi32(h[3], d);
    h[4] = _mm512_add_epi32(h[4], e); h[5] = _mm512_add_epi32(h[5], f);
    h[6] = _mm512_add_epi32(h[6], g); h[7] = _mm512_add_epi32(h[7], hh);
}

/* Fewer messages than this in flight: each goes on alone (with the SHA extensions one message
 * runs at about a third of 16 full lanes' bytes per second here; portable C at a tenth). */
#define MIN_LANES_NI 6
#define MIN_LANES_PORTABLE 2

/* The leaves of the messages order[0 .. n) (longest first); returns how many ended in the lanes. */
static O1B_SHA_TGT int64_t leaves16(const uint8_t *const *ptrs, const int64_t *lens, const int64_t *order,
                                    int64_t n, uint8_t *out, int ni) {
    const int min_lanes = ni ? MIN_LANES_NI : MIN_LANES_PORTABLE;
    __m512i h[8], rows[16], w[16];
    uint8_t edge[16][64];
    uint32_t hv[8][16];
    int64_t msg[16], b[16], nb[16], next = 0, done = 0;
    for (int k = 0; k < 8; k++) h[k] = _mm512_set1_epi32((int)H256[k]);
    for (int i = 0; i < 16; i++) msg[i] = -1;
    memset(edge, 0, sizeof edge);
    for (;;) {
        __mmask16 fresh = 0;
        int active = 0;
        int64_t steps = INT64_MAX;
        for (int i = 0; i < 16; i++) {
            if (msg[i] < 0 && next < n) {
                msg[i] = order[next++];
                b[i] = 0;
                nb[i] = n_blocks(lens[msg[i]]);
                fresh |= (__mmask16)(1u << i);
            }
            if (msg[i] >= 0) {
                active++;
                if (nb[i] - b[i] < steps) steps = nb[i] - b[i];
            }
        }
        for (int k = 0; k < 8; k++) h[k] = _mm512_mask_mov_epi32(h[k], fresh, _mm512_set1_epi32((int)H256[k]));
        if (active < min_lanes) break;
        for (int64_t s = 0; s < steps; s++) {         /* no lane ends before the last of these */
            for (int i = 0; i < 16; i++) {
                int64_t m = msg[i], bb = b[i] + s;
                if (m >= 0 && whole_block(lens[m], bb)) {
                    rows[i] = _mm512_loadu_si512((const void *)(ptrs[m] + 64 * bb - 1));
                } else {                                /* an edge block, or an idle lane's zeros */
                    if (m >= 0) edge_block(ptrs[m], lens[m], bb, edge[i]);
                    rows[i] = _mm512_loadu_si512((const void *)edge[i]);
                }
            }
            transpose16(rows, w);
            compress16(h, w);
        }
        for (int k = 0; k < 8; k++) _mm512_storeu_si512((void *)hv[k], h[k]);
        for (int i = 0; i < 16; i++) {
            if (msg[i] < 0) continue;
            b[i] += steps;
            if (b[i] == nb[i]) {
                uint32_t d[8];
                for (int k = 0; k < 8; k++) d[k] = hv[k][i];
                put_digest(out + 32 * msg[i], d);
                msg[i] = -1;
                done++;
            }
        }
    }
    for (int k = 0; k < 8; k++) _mm512_storeu_si512((void *)hv[k], h[k]);
    for (int i = 0; i < 16; i++) {                      /* the few left go on alone from their state */
        if (msg[i] < 0) continue;
        uint32_t st[8];
        for (int k = 0; k < 8; k++) st[k] = hv[k][i];
        finish1(st, ptrs[msg[i]], lens[msg[i]], b[i], out + 32 * msg[i], ni);
    }
    return done;
}
#endif

/* ------------------------------------------------------------------ entry points */
typedef struct { int64_t len, i; } o1b_leaf_key;
static int longest_first(const void *x, const void *y) {
    const o1b_leaf_key *a = (const o1b_leaf_key *)x, *b = (const o1b_leaf_key *)y;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return (a->i > b->i) - (a->i < b->i);
}

O1B_API int o1b_sha256_lanes(void) {
#if defined(O1B_SHA_MB)
    if (o1b_simd_level() >= 2 && __builtin_cpu_supports("avx512bw")) return 16;
#endif
    return 1;
}

O1B_API int64_t o1b_sha256_leaves(int64_t n, const uint8_t *const *ptrs, const int64_t *lens, uint8_t *out) {
    if (n <= 0) return 0;
    for (int64_t i = 0; i < n; i++)
        if (lens[i] < 0) return -1;
    int ni = 0;
#if defined(O1B_SHA_MB)
    ni = o1b_simd_level() >= 1 && has_sha_ni();
    if (n >= 2 && o1b_sha256_lanes() == 16) {
        o1b_leaf_key *key = (o1b_leaf_key *)malloc((size_t)n * sizeof *key);
        int64_t *order = (int64_t *)malloc((size_t)n * sizeof *order);
        if (!key || !order) { free(key); free(order); return -1; }
        for (int64_t i = 0; i < n; i++) key[i] = (o1b_leaf_key){lens[i], i};
        qsort(key, (size_t)n, sizeof *key, longest_first);
        for (int64_t i = 0; i < n; i++) order[i] = key[i].i;
        free(key);
        int64_t done = leaves16(ptrs, lens, order, n, out, ni);
        free(order);
        return done;
    }
#endif
    for (int64_t i = 0; i < n; i++) leaf1(ptrs[i], lens[i], out + 32 * i, ni);
    return 0;
}
