// qw_scale — the quantized layer's weight step sizes (CONTRACT.md §6.9), one thread per output row j:
//   S = sum from +0 over k ascending of |w[j, k]| (add; |.| clears the sign bit);
//   s[j] = NaN if S is ±inf or NaN, else mul(div(S, i2f(K)), coef), coef = o1b_qw_coef(QMAX):
//   QW_COEF = 0x1.6b7612p-3 for int8 (QMAX = 127), QW_COEF6 = 0x1.6fd4e8p-2 for the simulated
//   int6 path (QMAX = 31), QW_COEF4 = 0x1.83091ep-1 for the simulated int4 path (QMAX = 7).
// w (M, K) bf16. prm (int64) = K. QMAX (template int) = 127, 31 or 7. Grid (M).
static_assert(QMAX == O1B_QMAX || QMAX == O1B_QMAX6 || QMAX == O1B_QMAX4,
              "QMAX must be 127 (int8), 31 (int6) or 7 (int4)");
long j = (long)thread_position_in_grid.x;
long K = prm[0];
float S = 0.0f;
for (long k = 0; k < K; k++)
    S = o1b_add(S, o1b_from_bits(o1b_bits(o1b_bf16_to_f32(w[j * K + k])) & 0x7FFFFFFFu));
bool finite = (o1b_bits(S) & 0x7F800000u) != 0x7F800000u;
s[j] = o1b_store(finite ? o1b_mul(o1b_div(S, o1b_i2f((int)K)), o1b_qw_coef(QMAX)) : o1b_nan());
