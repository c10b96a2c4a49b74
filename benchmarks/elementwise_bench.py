"""The C reference's memory-bound ops at a preset's training shapes, against the machine's copy
bandwidth: RMSNorm (with gain and the QK-norm rows), f32 -> bf16, SwiGLU, add, add_inplace, RoPE.

    python benchmarks/elementwise_bench.py --preset small --threads 2
    python benchmarks/elementwise_bench.py --preset small --threads 1,2 --rounds 5

For each op at one microbatch's shape: the time per call (median of --reps calls, the median of
--rounds rounds), the bytes it must move (its inputs read once, its outputs written once) per
second, and next to it a numpy copy of the same number of bytes in the same process (np.copyto into
a buffer allocated once: the bandwidth the op could reach), the per-call overhead (the op on
16 elements) and the threads' hand-off (a two-thread-sized add_inplace at the given thread count
next to one thread). Process memory is set up as in training (host_malloc.tune). Ops and copies
alternate within each round, so both see the same machine load; on a busy machine say so
with the figures.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def cases(C, cfg, rng):
    """(name, fn, bytes moved) per op at one microbatch of the model config."""
    m, t = cfg.model, cfg.train
    N, d, F = t.microbatch_seqs * m.seq_len, m.d_model, m.ffn_hidden
    B, T, H, G, D = t.microbatch_seqs, m.seq_len, m.n_heads, m.n_kv_heads, m.head_dim
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    x, dy, g = f32(N, d), f32(N, d), C.f32_to_bf16(f32(d))
    q, dq, k = f32(N * H, D), f32(N * H, D), f32(N * G, D)
    gu, ds, hid = f32(N, 2 * F), f32(N, F), f32(N, d)
    _, r = C.rmsnorm_forward(x, g, 1e-5)
    _, rq = C.rmsnorm_forward(q, None, 1e-5)
    cos, sin = C.rope_tables(T, D, 10000.0)
    xq, xk = q.reshape(B, T, H, D), k.reshape(B, T, G, D)
    acc = f32(N, d)
    return [
        (f"rmsnorm_forward ({N},{d}) gain", lambda: C.rmsnorm_forward(x, g, 1e-5), 8 * N * d),
        (f"rmsnorm_forward ({N * H},{D})", lambda: C.rmsnorm_forward(q, None, 1e-5), 8 * N * H * D),
        (f"rmsnorm_forward ({N * G},{D})", lambda: C.rmsnorm_forward(k, None, 1e-5), 8 * N * G * D),
        (f"rmsnorm_backward ({N},{d}) gain", lambda: C.rmsnorm_backward(dy, x, g, r), 12 * N * d),
        (f"rmsnorm_backward ({N * H},{D})", lambda: C.rmsnorm_backward(dq, q, None, rq), 12 * N * H * D),
        (f"f32_to_bf16 ({N},{d})", lambda: C.f32_to_bf16(x), 6 * N * d),
        (f"f32_to_bf16 ({N},{2 * F})", lambda: C.f32_to_bf16(gu), 12 * N * F),
        (f"swiglu_forward ({N},{2 * F})", lambda: C.swiglu_forward(gu), 12 * N * F),
        (f"swiglu_backward ({N},{2 * F})", lambda: C.swiglu_backward(ds, gu), 20 * N * F),
        (f"add ({N},{d})", lambda: C.add(hid, x), 12 * N * d),
        (f"add_inplace ({N},{d})", lambda: C.add_inplace(acc, x), 12 * N * d),
        (f"rope_forward ({B},{T},{H},{D})", lambda: C.rope_forward(xq, cos, sin), 8 * N * H * D),
        (f"rope_backward ({B},{T},{G},{D})", lambda: C.rope_backward(xk, cos, sin), 8 * N * G * D),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", default="2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()

    from mlx_open1b import cpu_ref as C, host_malloc
    from mlx_open1b.config import preset
    host_malloc.tune()
    rng = np.random.default_rng(0)
    ops = cases(C, preset(a.preset), rng)
    tiny = np.ones(16, np.float32)
    for threads in [int(t) for t in a.threads.split(",")]:
        C.set_num_threads(threads)
        print(f"{a.preset}, {threads} threads, SIMD {C.simd_name()}  (median of {a.rounds} rounds x {a.reps} calls)")
        print(f"  {'op':36s} {'us/call':>9s} {'GB/s':>7s} {'copy GB/s':>10s} {'of copy':>8s}")
        for name, fn, nbytes in ops:
            src = np.ones(nbytes // 8, np.float32)
            dst = np.empty_like(src)
            t_op, t_copy = [], []
            for _ in range(a.rounds):
                t_op.append(median_time(fn, a.reps))
                t_copy.append(median_time(lambda: np.copyto(dst, src), a.reps))
            op, cp = float(np.median(t_op)), float(np.median(t_copy))
            print(f"  {name:36s} {1e6 * op:9.1f} {nbytes / op / 1e9:7.2f} {nbytes / cp / 1e9:10.2f} "
                  f"{cp / op:7.0%}")
        over = {"f32_to_bf16": lambda: C.f32_to_bf16(tiny), "add": lambda: C.add(tiny, tiny),
                "add_inplace": lambda: C.add_inplace(tiny, tiny)}
        print("  per-call overhead (16 elements): " + ", ".join(
            f"{k} {1e6 * median_time(f, 201):.1f} us" for k, f in over.items()))
        # the threads' hand-off: add_inplace of 2 x 32768 elements (two threads' worth of the
        # elementwise ops' grain, a few us of work) at this thread count and at one
        h1, h2 = np.ones(1 << 16, np.float32), np.ones(1 << 16, np.float32)
        t_n = median_time(lambda: C.add_inplace(h1, h2), 201)
        with C.settings(threads=1):
            t_1 = median_time(lambda: C.add_inplace(h1, h2), 201)
        print(f"  add_inplace of 65536 elements: {1e6 * t_n:.1f} us at {threads} threads, {1e6 * t_1:.1f} us at 1")


if __name__ == "__main__":
    main()
