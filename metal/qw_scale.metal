// qw_scale — the int8 layer's weight step sizes (CONTRACT.md §6.9), one thread per output row j:
//   S = sum from +0 over k ascending of |w[j, k]| (add; |.| clears the sign bit);
//   s[j] = NaN if S is ±inf or NaN, else mul(div(S, i2f(K)), QW_COEF), QW_COEF = 0x1.6b7612p-3.
// w (M, K) bf16. prm (int64) = K. Grid (M).
long j = (long)thread_position_in_grid.x;
long K = prm[0];
float S = 0.0f;
for (long k = 0; k < K; k++)
    S = o1b_add(S, o1b_from_bits(o1b_bits(o1b_bf16_to_f32(w[j * K + k])) & 0x7FFFFFFFu));
bool finite = (o1b_bits(S) & 0x7F800000u) != 0x7F800000u;
s[j] = o1b_store(finite ? o1b_mul(o1b_div(S, o1b_i2f((int)K)), O1B_F(0x3E35BB09u) /* 0x1.6b7612p-3 */)
                        : o1b_nan());
