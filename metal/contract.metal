// contract.metal — the scalar arithmetic of CONTRACT.md (version 1) in the Metal Shading Language.
//
// The header of every kernel of the Metal backend (given to mx.fast.metal_kernel as `header`).
// It is the MSL twin of cpu_ref/src/contract.h; each helper has the same name and the same
// sequence of operations. Rules (CONTRACT.md §1–§4):
//   - fp32 values entering an op are never subnormal: loads go through o1b_load (flush) or are
//     outputs of other helpers, which flush.
//   - a result whose exact value has magnitude below 2^-126 becomes a zero of the same sign
//     ("flush before rounding"). Metal has no double, so the one ambiguous case of mul (IEEE
//     result exactly ±2^-126) is decided with integer arithmetic on the significands and
//     exponents of the operands (o1b_mul_tiny); div is computed in integers altogether (o1b_div).
//   - no contraction into fused multiply-add: every fp32 + - * of the backend is one operator in
//     one statement of o1b_add or o1b_mul below (the other helpers and the kernels call them; a
//     source-text test, tests/backends/test_metal_source.py, holds the sources to this), so nothing can be
//     contracted even where the pragma below does not exist (it is Metal 3.2; MLX compiles Metal
//     3.1 on macOS 14); the kernels are built with math_mode "safe".
//   - no library math function at all: sqrt is the contract's integer definition (§3), exp, log,
//     sin, cos are the §4 software routines, NaN and ±inf are tested on the bits.
//   - NaN leaves an op as 0x7FC00000 (o1b_store at every store to an output array).
// Constants are written as their fp32 bit patterns (the hex float is in the comment), so their
// value does not depend on how a compiler reads floating literals.
#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 320
#pragma METAL fp contract(off)
#endif
#ifndef O1B_EMU
#include <metal_stdlib>
using namespace metal;
#endif

#define O1B_NAN_BITS 0x7FC00000u
#define O1B_F(bits) as_type<float>((uint)(bits))
// The hardware's fp32 operators: the helpers below are the only code that applies them, one per
// statement. The emulator redefines them to run the kernels on a modelled faulty or adversarially
// flushing fp32 unit (metal/emu/hwfloat.h); on a GPU they are the plain operators.
#ifndef O1B_HW_ADD
#define O1B_HW_ADD(a, b) ((a) + (b))
#define O1B_HW_SUB(a, b) ((a) - (b))
#define O1B_HW_MUL(a, b) ((a) * (b))
#define O1B_HW_DIV(a, b) ((a) / (b))
#endif
#define O1B_ATTN_BK 64       // contract constant ATTN_BLOCK (§6.6)
#define O1B_XENT_CHUNK 1024  // contract constant XENT_CHUNK (§6.8)
#define O1B_NORM_BLOCK 4096  // contract constant NORM_BLOCK (§7)
#define O1B_QMAX 127         // contract constant QMAX: int8 levels -127 ... 127 (§6.9)
#define O1B_QMAX4 7          // contract constant QMAX4: the simulated int4 path's levels -7 ... 7 (§6.9)
#define O1B_QMAX6 31         // contract constant QMAX6: the simulated int6 path's levels -31 ... 31 (§6.9)

inline uint o1b_bits(float x) { return as_type<uint>(x); }
inline float o1b_from_bits(uint u) { return as_type<float>(u); }
inline bool o1b_isnan(float x) { return (o1b_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
inline float o1b_inf() { return O1B_F(0x7F800000u); }

// ---- §1 loads and stores ----
inline float o1b_flush(float x) {
    uint u = o1b_bits(x);
    return (u & 0x7F800000u) == 0u ? o1b_from_bits(u & 0x80000000u) : x;
}
inline float o1b_canon(float x) { return o1b_isnan(x) ? o1b_from_bits(O1B_NAN_BITS) : x; }
inline float o1b_load(float x) { return o1b_flush(x); }
inline float o1b_store(float x) { return o1b_canon(o1b_flush(x)); }
inline float o1b_nan() { return o1b_from_bits(O1B_NAN_BITS); }

// ---- §2 conversions ----
inline float o1b_bf16_to_f32(ushort h) { return o1b_flush(o1b_from_bits((uint)h << 16)); }
inline ushort o1b_f32_to_bf16(float x) {
    uint u = o1b_bits(o1b_flush(x));
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (ushort)0x7FC0u;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (ushort)(u >> 16);
}
inline float o1b_i2f(int i) { return o1b_flush((float)i); }   // exact for |i| <= 2^24

// ---- §3 primitive operations ----
inline float o1b_neg(float a) { return o1b_from_bits(o1b_bits(a) ^ 0x80000000u); }
// A subnormal sum of two normals is exact: flushing the IEEE result is the same as flushing the
// exact value. The sign of that zero must not depend on the GPU's own flushing (a flush-to-zero
// unit may return +0 for a tiny negative sum), so a zero result is re-signed from the operands:
// an exact zero (b = -a, or two zeros) keeps the IEEE sign the hardware gives; a tiny nonzero
// sum has the sign of the operand of larger magnitude.
inline float o1b_add(float a, float b) {
    float r = O1B_HW_ADD(a, b);
    uint ur = o1b_bits(r);
    if ((ur & 0x7F800000u) != 0u) return r;                             // normal, inf, NaN
    if ((ur & 0x7FFFFFFFu) != 0u) return o1b_from_bits(ur & 0x80000000u); // subnormal: flush
    uint ua = o1b_bits(a), ub = o1b_bits(b);
    if ((ua ^ ub) == 0x80000000u || ((ua | ub) & 0x7FFFFFFFu) == 0u) return r;
    return o1b_from_bits(((ua & 0x7FFFFFFFu) > (ub & 0x7FFFFFFFu) ? ua : ub) & 0x80000000u);
}
inline float o1b_sub(float a, float b) { return o1b_add(a, o1b_neg(b)); }

// |r| <= 2^-126 where r is the hardware product (rounded, possibly flushed). Below 2^-126 the
// result is the zero of the product's sign; at exactly 2^-126 the exact product decides: with
// normal operands a = ma 2^(Ea-150), b = mb 2^(Eb-150) (24-bit significands ma, mb with the
// hidden bit), |a b| < 2^-126  <=>  ma mb < 2^s, s = 300 - 126 - Ea - Eb; ma mb is in
// [2^46, 2^48). (r = ±2^-126 implies both operands are finite, normal and nonzero.)
inline float o1b_mul_tiny(float a, float b, float r) {
    uint sgn = (o1b_bits(a) ^ o1b_bits(b)) & 0x80000000u;
    if ((o1b_bits(r) & 0x7FFFFFFFu) < 0x00800000u) return o1b_from_bits(sgn);
    uint ua = o1b_bits(a) & 0x7FFFFFFFu, ub = o1b_bits(b) & 0x7FFFFFFFu;
    ulong m = (ulong)((ua & 0x7FFFFFu) | 0x800000u) * (ulong)((ub & 0x7FFFFFu) | 0x800000u);
    int s = 300 - 126 - (int)(ua >> 23) - (int)(ub >> 23);
    bool tiny = s >= 48 ? true : (s <= 46 ? false : m < ((ulong)1 << s));
    return tiny ? o1b_from_bits(sgn) : r;
}
inline float o1b_mul(float a, float b) {
    float r = O1B_HW_MUL(a, b);
    return (o1b_bits(r) & 0x7FFFFFFFu) <= 0x00800000u ? o1b_mul_tiny(a, b, r) : r;
}
// The contract's integer division (§3), equal to the IEEE correctly rounded quotient with the flush
// rule; no fp32 divide instruction is used, so no result depends on how the GPU rounds, flushes or
// overflows a quotient. With significands ma, mb in [2^23, 2^24): Q, R = divmod(ma 2^s, mb),
// s = 24 if ma < mb else 23, by restoring long division in 32 bits (the remainder stays below
// mb < 2^24, so r << 1 < 2^25); a/b = (Q + R/mb) 2^(E-150), E = Ea - Eb + 150 - s.
inline float o1b_div(float a, float b) {
    uint ua = o1b_bits(o1b_flush(a)), ub = o1b_bits(o1b_flush(b));
    uint sgn = (ua ^ ub) & 0x80000000u, xa = ua & 0x7FFFFFFFu, xb = ub & 0x7FFFFFFFu;
    if (xa > 0x7F800000u || xb > 0x7F800000u) return o1b_nan();            // NaN operand
    if (xa == 0x7F800000u) return xb == 0x7F800000u ? o1b_nan() : o1b_from_bits(sgn | 0x7F800000u);
    if (xb == 0x7F800000u) return o1b_from_bits(sgn);                      // x/inf = ±0
    if (xb == 0u) return xa == 0u ? o1b_nan() : o1b_from_bits(sgn | 0x7F800000u);   // 0/0, x/0
    if (xa == 0u) return o1b_from_bits(sgn);                                // 0/x = ±0
    uint ma = (xa & 0x7FFFFFu) | 0x800000u, mb = (xb & 0x7FFFFFu) | 0x800000u;
    int s = ma < mb ? 24 : 23;
    uint r = ma < mb ? ma << 1 : ma;                                        // r in [mb, 2 mb)
    uint q = 1u;
    r -= mb;
    for (int k = 0; k < 23; k++) {                                          // one quotient bit each
        r <<= 1;
        q <<= 1;
        if (r >= mb) { r -= mb; q |= 1u; }
    }
    int E = (int)(xa >> 23) - (int)(xb >> 23) + 150 - s;
    if (E <= 0) return o1b_from_bits(sgn);                                  // exact |a/b| < 2^-126
    if (E >= 255) return o1b_from_bits(sgn | 0x7F800000u);                  // >= 2^128
    if ((r << 1) > mb) q += 1u;                                             // nearest; no ties exist
    return o1b_from_bits(sgn | (((uint)E << 23) + q - 0x800000u));          // q < 2^24: no carry (§3)
}
// The contract's integer square root (§3): equals the IEEE correctly rounded sqrt.
inline float o1b_sqrt(float x) {
    uint u = o1b_bits(o1b_flush(x));
    if ((u & 0x7FFFFFFFu) == 0u) return o1b_from_bits(u);            // sqrt(±0) = ±0
    if ((u & 0x7FFFFFFFu) > 0x7F800000u || (u >> 31) != 0u) return o1b_nan();
    if (u == 0x7F800000u) return o1b_from_bits(u);
    int k = (int)(u >> 23) - 150;                                    // x = m 2^k, m in [2^23, 2^24)
    ulong m = (ulong)((u & 0x7FFFFFu) | 0x800000u);
    int t = ((k - 23) & 1) != 0 ? 24 : 23;                           // M = m 2^t in [2^46, 2^48), k - t even
    ulong M = m << t, rem = M, res = 0, one = (ulong)1 << 46;
    while (one != 0) {                                               // digit-by-digit integer root
        if (rem >= res + one) { rem -= res + one; res = (res >> 1) + one; }
        else res >>= 1;
        one >>= 2;
    }
    if (rem > res) res += 1;                                         // round up; no ties
    int j = (k - t) / 2;                                             // sqrt(x) = res 2^j
    return o1b_from_bits((uint)((j + 150) << 23) + (uint)res - 0x800000u);
}
// max as the written comparison b > a ? b : a (a NaN in b is passed over; a NaN in a stays).
inline float o1b_max(float a, float b) {
    if (o1b_isnan(a) || o1b_isnan(b)) return a;
    return b > a ? b : a;
}

// int32 -> fp32 of any int32 (§6.9 accumulators), round to nearest even by construction rather
// than by the GPU's conversion: acc = hi 2^16 + lo with hi = floor(acc / 2^16) in [-2^15, 2^15) and
// lo = acc mod 2^16 (bit fields of the two's complement word), both converted exactly (|i| <= 2^24),
// hi scaled exactly by mul; the one contract add rounds the exact sum acc once.
inline float o1b_i2f_acc(int acc) {
    uint u = as_type<uint>(acc);
    int hi = (int)(u >> 16) - (int)((u >> 31) << 16), lo = (int)(u & 0xFFFFu);
    return o1b_add(o1b_mul(o1b_i2f(hi), O1B_F(0x47800000u) /* 0x1p16 */), o1b_i2f(lo));
}

// ---- §4 software functions ----
#define O1B_MAGIC O1B_F(0x4B400000u)   /* 0x1.8p23 */

inline float o1b_exp(float x) {
    if (o1b_isnan(x)) return o1b_nan();
    if (x > O1B_F(0x42B17217u)) return o1b_inf();                   // > 0x1.62e42ep6
    if (x < O1B_F(0xC2CE0000u)) return 0.0f;                        // < -0x1.9cp6 (-103)
    float nf = o1b_sub(o1b_add(o1b_mul(x, O1B_F(0x3FB8AA3Bu) /* 0x1.715476p0 */), O1B_MAGIC), O1B_MAGIC);
    int n = (int)nf;
    if (n < -126) return 0.0f;
    float r = o1b_sub(o1b_sub(x, o1b_mul(nf, O1B_F(0x3F317200u) /* 0x1.62e4p-1 */)),
                      o1b_mul(nf, O1B_F(0x35BFBE8Eu) /* 0x1.7f7d1cp-20 */));
    float p = O1B_F(0x39500D01u);                                    // 0x1.a01a02p-13  1/7!
    p = o1b_add(o1b_mul(p, r), O1B_F(0x3AB60B61u));                  // 0x1.6c16c2p-10  1/6!
    p = o1b_add(o1b_mul(p, r), O1B_F(0x3C088889u));                  // 0x1.111112p-7   1/5!
    p = o1b_add(o1b_mul(p, r), O1B_F(0x3D2AAAABu));                  // 0x1.555556p-5   1/4!
    p = o1b_add(o1b_mul(p, r), O1B_F(0x3E2AAAABu));                  // 0x1.555556p-3   1/3!
    p = o1b_add(o1b_mul(p, r), O1B_F(0x3F000000u));                  // 0x1p-1
    p = o1b_add(o1b_mul(p, r), 1.0f);
    p = o1b_add(o1b_mul(p, r), 1.0f);
    if (n > 127) return o1b_mul(o1b_mul(p, 2.0f), O1B_F(0x7F000000u));  // 2^127
    return o1b_mul(p, o1b_from_bits((uint)(n + 127) << 23));
}

inline float o1b_log(float x) {
    uint u = o1b_bits(o1b_flush(x));
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return o1b_nan();
    if ((u & 0x7FFFFFFFu) == 0u) return o1b_neg(o1b_inf());          // log(±0) = -inf
    if ((u >> 31) != 0u) return o1b_nan();                            // log(x < 0) = NaN
    if (u == 0x7F800000u) return o1b_inf();
    int e = (int)(u >> 23) - 127;
    float m = o1b_from_bits((u & 0x7FFFFFu) | 0x3F800000u);          // x = m 2^e, m in [1, 2)
    if (m > O1B_F(0x3FB504F3u)) { m = o1b_mul(m, 0.5f); e += 1; }     // 0x1.6a09e6p0 (sqrt 2)
    float f = o1b_sub(m, 1.0f);
    float s = o1b_div(f, o1b_add(2.0f, f));
    float z = o1b_mul(s, s);
    float R = O1B_F(0x3E638E39u);                                    // 0x1.c71c72p-3  2/9
    R = o1b_add(o1b_mul(R, z), O1B_F(0x3E924925u));                  // 0x1.24924ap-2  2/7
    R = o1b_add(o1b_mul(R, z), O1B_F(0x3ECCCCCDu));                  // 0x1.99999ap-2  2/5
    R = o1b_add(o1b_mul(R, z), O1B_F(0x3F2AAAABu));                  // 0x1.555556p-1  2/3
    R = o1b_mul(R, z);
    float hfsq = o1b_mul(0.5f, o1b_mul(f, f));
    float ef = o1b_i2f(e);
    float r = o1b_add(o1b_mul(s, o1b_add(hfsq, R)), o1b_mul(ef, O1B_F(0x35BFBE8Eu) /* 0x1.7f7d1cp-20 */));
    r = o1b_add(o1b_sub(r, hfsq), f);
    return o1b_add(r, o1b_mul(ef, O1B_F(0x3F317200u) /* 0x1.62e4p-1 */));
}

// sin / cos reduction x = n pi/2 + r, pi/2 = P1 + P2 + P3. q = int(nf) & 3 in two's complement;
// for |nf| >= 2^31 (not representable as int) nf is a multiple of 4, so q = 0: computed without
// converting an out-of-range float to int (undefined in C, saturating on GPUs).
struct o1b_reduced { float r; int q; };
inline o1b_reduced o1b_sincos_reduce(float x) {
    float nf = o1b_sub(o1b_add(o1b_mul(x, O1B_F(0x3F22F983u) /* 0x1.45f306p-1 */), O1B_MAGIC), O1B_MAGIC);
    float y = o1b_sub(x, o1b_mul(nf, O1B_F(0x3FC90000u)));          // P1 = 0x1.92p0
    y = o1b_sub(y, o1b_mul(nf, O1B_F(0x39FDA000u)));                 // P2 = 0x1.fb4p-12
    o1b_reduced out;
    out.r = o1b_sub(y, o1b_mul(nf, O1B_F(0x33A22169u)));             // P3 = 0x1.4442d2p-24
    out.q = (o1b_bits(nf) & 0x7FFFFFFFu) < 0x4F000000u ? ((int)nf & 3) : 0;   // |nf| < 2^31
    return out;
}
inline float o1b_sin_poly(float r) {
    float z = o1b_mul(r, r);
    float p = O1B_F(0x3638EF1Du);                                    // 0x1.71de3ap-19   1/9!
    p = o1b_add(o1b_mul(p, z), O1B_F(0xB9500D01u));                  // -0x1.a01a02p-13 -1/7!
    p = o1b_add(o1b_mul(p, z), O1B_F(0x3C088889u));                  // 0x1.111112p-7    1/5!
    p = o1b_add(o1b_mul(p, z), O1B_F(0xBE2AAAABu));                  // -0x1.555556p-3  -1/3!
    return o1b_add(r, o1b_mul(o1b_mul(r, z), p));
}
inline float o1b_cos_poly(float r) {
    float z = o1b_mul(r, r);
    float p = O1B_F(0xB493F27Eu);                                    // -0x1.27e4fcp-22 -1/10!
    p = o1b_add(o1b_mul(p, z), O1B_F(0x37D00D01u));                  // 0x1.a01a02p-16   1/8!
    p = o1b_add(o1b_mul(p, z), O1B_F(0xBAB60B61u));                  // -0x1.6c16c2p-10 -1/6!
    p = o1b_add(o1b_mul(p, z), O1B_F(0x3D2AAAABu));                  // 0x1.555556p-5    1/4!
    p = o1b_add(o1b_mul(p, z), O1B_F(0xBF000000u));                  // -0x1p-1
    return o1b_add(1.0f, o1b_mul(z, p));
}
inline float o1b_sin(float x) {
    x = o1b_flush(x);
    if ((o1b_bits(x) & 0x7FFFFFFFu) >= 0x7F800000u) return o1b_nan();   // inf, NaN
    if ((o1b_bits(x) & 0x7FFFFFFFu) < 0x39800000u) return x;            // |x| < 2^-12
    o1b_reduced rq = o1b_sincos_reduce(x);
    float v = (rq.q & 1) != 0 ? o1b_cos_poly(rq.r) : o1b_sin_poly(rq.r);
    return (rq.q & 2) != 0 ? o1b_neg(v) : v;
}
inline float o1b_cos(float x) {
    x = o1b_flush(x);
    if ((o1b_bits(x) & 0x7FFFFFFFu) >= 0x7F800000u) return o1b_nan();
    o1b_reduced rq = o1b_sincos_reduce(x);
    float v = (rq.q & 1) != 0 ? o1b_sin_poly(rq.r) : o1b_cos_poly(rq.r);
    return (rq.q == 1 || rq.q == 2) ? o1b_neg(v) : v;
}
inline float o1b_rsqrt(float x) { return o1b_div(1.0f, o1b_sqrt(x)); }
inline float o1b_sigmoid(float x) { return o1b_div(1.0f, o1b_add(1.0f, o1b_exp(o1b_neg(x)))); }
inline float o1b_silu(float x) { return o1b_mul(x, o1b_sigmoid(x)); }

// ---- §6.9 the quantized linear layer's level bound and weight step coefficient ----
// qmax is O1B_QMAX (int8), O1B_QMAX6 or O1B_QMAX4 (the simulated int6 / int4 paths); the kernels take it as the
// template argument QMAX and reject any other value at compile time.
inline float o1b_qmax_f(int qmax) {                  // qmax as fp32 (exact)
    return qmax == O1B_QMAX4 ? O1B_F(0x40E00000u) /* 7 */
         : qmax == O1B_QMAX6 ? O1B_F(0x41F80000u) /* 31 */ : O1B_F(0x42FE0000u) /* 127 */;
}
inline float o1b_qw_coef(int qmax) {  // QW_COEF4 = 2/sqrt(7), QW_COEF6 = 2/sqrt(31), QW_COEF = 2/sqrt(127)
    return qmax == O1B_QMAX4 ? O1B_F(0x3F41848Fu) /* 0x1.83091ep-1 */
         : qmax == O1B_QMAX6 ? O1B_F(0x3EB7EA74u) /* 0x1.6fd4e8p-2 */ : O1B_F(0x3E35BB09u) /* 0x1.6b7612p-3 */;
}
// level(t) for a finite t: clamp to [-qmax, qmax], then round to nearest, ties to even (sub(add(t, MAGIC), MAGIC))
inline int o1b_level(float t, int qmax) {
    float qf = o1b_qmax_f(qmax);
    if (t >= qf) return qmax;
    if (t <= -qf) return -qmax;
    return (int)o1b_sub(o1b_add(t, O1B_MAGIC), O1B_MAGIC);
}

// ---- §5 Philox4x32-10 ----
struct o1b_block { uint w0, w1, w2, w3; };
inline o1b_block o1b_philox(uint k0, uint k1, o1b_block c) {
    for (int round = 0; round < 10; round++) {
        ulong p0 = (ulong)0xD2511F53u * (ulong)c.w0, p1 = (ulong)0xCD9E8D57u * (ulong)c.w2;
        uint hi0 = (uint)(p0 >> 32), lo0 = (uint)p0, hi1 = (uint)(p1 >> 32), lo1 = (uint)p1;
        o1b_block n;
        n.w0 = hi1 ^ c.w1 ^ k0; n.w1 = lo1; n.w2 = hi0 ^ c.w3 ^ k1; n.w3 = lo0;
        c = n;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    return c;
}
// The block at (seed, stream, index, sub): key = (seed lo, seed hi), counter = (index lo,
// index hi, stream, sub).
inline o1b_block o1b_philox_block(uint seed_lo, uint seed_hi, uint stream, ulong index, uint sub) {
    o1b_block c;
    c.w0 = (uint)index; c.w1 = (uint)(index >> 32); c.w2 = stream; c.w3 = sub;
    return o1b_philox(seed_lo, seed_hi, c);
}
