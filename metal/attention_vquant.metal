// attention_vquant — the value rows of the int8 attention forward (CONTRACT.md §6.10), one thread
// per key row r = (b*T + j)*G + g of v (B,T,G,D) bf16: the D values (widened) quantized as one
// tensor by §6.9's per-tensor rule. s = NaN and every q = 0 if any value is ±inf or NaN; otherwise
// a = max |v| (compared as bits: exact), s = div(a, 127); s = +0: every q = 0; else
// q = level(mul(v, div(1, s))) (clamp to [-127, 127], then sub(add(t, MAGIC), MAGIC): ties to even).
// Outputs q_v (B,T,G,D) int8 and s_v (B,T,G) fp32 (stored: NaN canonical). prm (int64) = D.
// Grid (B*T*G).
long r = (long)thread_position_in_grid.x;
long D = prm[0];
uint m = 0u;
bool bad = false;
for (long d = 0; d < D; d++) {
    uint a = o1b_bits(o1b_bf16_to_f32(v[r * D + d])) & 0x7FFFFFFFu;
    bad = bad || a >= 0x7F800000u;
    m = a > m ? a : m;
}
float s = bad ? o1b_nan() : o1b_div(o1b_from_bits(m), O1B_F(0x42FE0000u) /* 127 */);
bool ok = !bad && (o1b_bits(s) & 0x7FFFFFFFu) != 0u;
float inv = ok ? o1b_div(1.0f, s) : 0.0f;
for (long d = 0; d < D; d++) {
    // finite: |t| <= about 127
    qv[r * D + d] = ok ? o1b_level(o1b_mul(o1b_bf16_to_f32(v[r * D + d]), inv), O1B_QMAX) : 0;
}
sv[r] = o1b_store(s);
