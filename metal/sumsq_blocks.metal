// sumsq_blocks — §7: block b (NORM_BLOCK = 4096 consecutive elements, the last may be shorter)
// partial = sum from +0 over its elements ascending of mul(x, x). One thread per block.
// prm = n. Grid (number of blocks).
long blk = (long)thread_position_in_grid.x;
long n = prm[0];
long end = (blk + 1) * O1B_NORM_BLOCK < n ? (blk + 1) * O1B_NORM_BLOCK : n;
float acc = 0.0f;
for (long i = blk * O1B_NORM_BLOCK; i < end; i++) { float v = o1b_load(x[i]); acc = o1b_add(acc, o1b_mul(v, v)); }
out[blk] = o1b_store(acc);
