// add — out[i] = add(a[i], b[i]) (a is the lower-index operand of a fold, CONTRACT.md §7).
uint i = thread_position_in_grid.x;
out[i] = o1b_store(o1b_add(o1b_load(a[i]), o1b_load(b[i])));
