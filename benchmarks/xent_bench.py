"""The C reference's fused cross-entropy at a preset's LM-head shape: xent_forward + xent_backward
per microbatch with the logits kept for the backward (keep=True) and computed again (keep=False),
the two alternated in one process so that a busy machine slows both alike.

    python benchmarks/xent_bench.py --preset small --threads 2 --reps 20
    python benchmarks/xent_bench.py --preset small --threads 1 --clock thread   # on a busy machine

Prints the median ms per microbatch of forward, backward and their sum for each way, and checks
that both give the same bits. Wall-clock figures are only meaningful on an otherwise idle machine;
--clock thread (with --threads 1, where the kernels run in the calling thread) counts the CPU time
of that thread alone, page faults included, which other processes disturb much less.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from mlx_open1b import cpu_ref
from mlx_open1b.config import PRESETS
from mlx_open1b.spec import arith as A


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    a = ap.parse_args(argv)
    if a.clock == "thread" and a.threads != 1:
        ap.error("--clock thread counts the calling thread only: use it with --threads 1")
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    run = PRESETS[a.preset]
    m, t = run.model, run.train
    N, C, V = t.microbatch_seqs * m.seq_len, m.d_model, m.vocab_size
    rng = np.random.default_rng(0)
    h = A.f32_to_bf16(rng.standard_normal((N, C)).astype(np.float32))
    w = A.f32_to_bf16((rng.standard_normal((V, C)) * 0.02).astype(np.float32))
    tg = rng.integers(0, V, N).astype(np.int32)
    dl = np.full(N, np.float32(1.0 / N), np.float32)
    zc = np.float32(m.z_loss)
    times = {k: ([], []) for k in ("recompute", "kept")}
    out = {}
    with cpu_ref.settings(threads=a.threads):
        for rep in range(a.reps + 1):
            for way in (("recompute", "kept") if rep % 2 else ("kept", "recompute")):
                keep = way == "kept"
                t0 = clock()
                f = cpu_ref.xent_forward(h, w, tg, zc, keep=True) if keep else cpu_ref.xent_forward(h, w, tg, zc)
                t1 = clock()
                b = cpu_ref.xent_backward(h, w, tg, zc, f[1], dl, saved=f[3] if keep else None)
                t2 = clock()
                if keep and f[3] is None:
                    print(f"the logits ({N} x {V}) are over cpu_ref.xent.XENT_KEEP_BYTES: not kept")
                if rep:                                   # the first round warms up
                    times[way][0].append(t1 - t0)
                    times[way][1].append(t2 - t1)
                out[way] = [x.view(np.uint32) for x in (*f[:3], *b)]
    same = all(np.array_equal(x, y) for x, y in zip(out["kept"], out["recompute"]))
    print(f"{a.preset}: N={N} C={C} V={V}, threads {a.threads}, {a.reps} reps, {a.clock} clock, same bits: {same}")
    for way, (tf, tb) in times.items():
        mf, mb = statistics.median(tf) * 1e3, statistics.median(tb) * 1e3
        print(f"  {way:9s} forward {mf:7.2f} ms  backward {mb:7.2f} ms  sum {mf + mb:7.2f} ms per microbatch")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
