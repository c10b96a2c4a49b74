// div — y[i] = div(a[i], b[i]) (CONTRACT.md §3), one thread per element. Metal's o1b_div is the
// contract's integer definition, so this is the backend's div_int (and its div).
uint i = thread_position_in_grid.x;
y[i] = o1b_store(o1b_div(o1b_load(a[i]), o1b_load(b[i])));
