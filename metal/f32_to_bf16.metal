// f32_to_bf16 — §2 round to nearest even by integer arithmetic; NaN -> 0x7FC0. One thread per element.
uint i = thread_position_in_grid.x;
y[i] = o1b_f32_to_bf16(x[i]);
