// embedding_forward — out[n, c] = wte[tokens[n], c] widened (§6.2). prm = C. Grid (C, N).
long c = (long)thread_position_in_grid.x, n = (long)thread_position_in_grid.y;
long C = prm[0];
out[n * C + c] = o1b_store(o1b_bf16_to_f32(wte[(long)tokens[n] * C + c]));
