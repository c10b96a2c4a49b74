// bf16_to_f32 — §2 widening (h << 16, subnormals flushed), stored by the store rule.
uint i = thread_position_in_grid.x;
y[i] = o1b_store(o1b_bf16_to_f32(x[i]));
