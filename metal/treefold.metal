// treefold — §7, the binary-carry tree fold of values[0 .. n-1], one thread: push each value;
// while the top of the stack has the same level, pop it and add it on the LEFT; then combine what
// remains from the bottom of the stack upwards. n = 0 gives +0. prm = n. Grid (1).
long n = prm[0];
float val[64];
int lvl[64];
int top = 0;
for (long i = 0; i < n; i++) {
    float part = o1b_load(values[i]);
    int level = 0;
    while (top > 0 && lvl[top - 1] == level) { top--; part = o1b_add(val[top], part); level++; }
    val[top] = part; lvl[top] = level; top++;
}
float acc = 0.0f;
if (top > 0) {
    acc = val[0];
    for (int s = 1; s < top; s++) acc = o1b_add(acc, val[s]);
}
out[0] = o1b_store(acc);
