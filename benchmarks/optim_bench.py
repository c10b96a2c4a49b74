"""The C reference's optimizer-step kernels at a preset's parameter tensors: the sum of squares
(the gradient norm's blocks) and the AdamW step, one call per tensor as in training, against a
numpy copy of the same bytes; optionally A/B against another build of the library.

    python benchmarks/optim_bench.py --preset tiny --threads 2
    python benchmarks/optim_bench.py --preset small --threads 1 --against /tmp/old_kernels.so

Times are the median over --rounds rounds of one pass over all tensors (the inputs stay in
cache between passes when they fit: this measures the kernels, not a cold step). With
--against, the two libraries alternate within each round, so both see the same machine load;
on a busy machine say so with the figures. Per tensor size class (blocks of NORM_BLOCK
elements) the sum of squares is shown too, where lanes of blocks and the threads' split differ.
"""
from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np


def load(path: str, threads: int):
    lib = ctypes.CDLL(path)
    lib.o1b_set_num_threads(threads)
    lib.o1b_sumsq_blocks.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.o1b_adamw_step.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_float] * 9
    return lib


def timed(fn, rounds: int) -> float:
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--against", default="", help="another build of the C library (a .so) to compare with")
    a = ap.parse_args()

    from mlx_open1b.config import preset
    from mlx_open1b.cpu_ref import _lib
    from mlx_open1b.model import ParamLayout
    libs = {"this build": load(_lib.lib._name, a.threads)}
    if a.against:
        libs["--against"] = load(a.against, a.threads)
    block = int(libs["this build"].o1b_norm_block())
    layout = ParamLayout(preset(a.preset).model)
    rng = np.random.default_rng(0)
    sizes = [t.size for t in layout]
    grads = [(rng.standard_normal(n) * 1e-3).astype(np.float32) for n in sizes]
    outs = [np.empty(-(-n // block), np.float32) for n in sizes]
    p = [(rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32).__rshift__(16).astype(np.uint16)
         for n in sizes]
    m = [np.zeros(n, np.float32) for n in sizes]
    v = [np.zeros(n, np.float32) for n in sizes]
    total = sum(sizes)

    def sumsq(lib, idx):
        def run():
            for i in idx:
                lib.o1b_sumsq_blocks(sizes[i], grads[i].ctypes.data, outs[i].ctypes.data)
        return run

    def adamw(lib):
        def run():
            for i, n in enumerate(sizes):
                lib.o1b_adamw_step(n, p[i].ctypes.data, grads[i].ctypes.data, m[i].ctypes.data,
                                   v[i].ctypes.data, 3e-3, 0.9, 0.95, 0.1, 0.05, 1e-8, 0.9997, 10.0, 20.0)
        return run

    classes = {}
    for i, n in enumerate(sizes):
        nb = -(-n // block)
        key = "1 block" if nb == 1 else f"{nb} blocks"
        classes.setdefault(key, []).append(i)
    rows = [(f"sumsq_blocks, all {len(sizes)} tensors", sumsq, list(range(len(sizes))), 4 * total)]
    rows += [(f"sumsq_blocks, {len(idx)} x {k}", sumsq, idx, 4 * sum(sizes[i] for i in idx))
             for k, idx in sorted(classes.items(), key=lambda kv: sizes[kv[1][0]])]
    src = np.ones(total * 11 // 2, np.float32)          # AdamW moves 44 bytes an element (half each way)
    dst = np.empty_like(src)
    print(f"{a.preset}: {len(sizes)} tensors, {total:,} params, {a.threads} threads "
          f"(median of {a.rounds} passes; us per pass)")
    names = list(libs)
    print(f"  {'':40s} " + " ".join(f"{k:>12s}" for k in names) + f" {'copy':>9s}")
    for label, make, idx, nbytes in rows + [("adamw_step, all tensors", None, None, 44 * total)]:
        t = {k: [] for k in names}
        tc = []
        for _ in range(3):                              # the libraries alternate
            for k in names:
                fn = make(libs[k], idx) if make else adamw(libs[k])
                t[k].append(timed(fn, a.rounds))
            tc.append(timed(lambda: np.copyto(dst[:nbytes // 8], src[:nbytes // 8]), a.rounds))
        print(f"  {label:40s} " + " ".join(f"{1e6 * min(t[k]):12.1f}" for k in names) +
              f" {1e6 * min(tc):9.1f}")
    if a.against:
        ref = [np.empty_like(o) for o in outs]
        for i, n in enumerate(sizes):
            libs["this build"].o1b_sumsq_blocks(n, grads[i].ctypes.data, outs[i].ctypes.data)
            libs["--against"].o1b_sumsq_blocks(n, grads[i].ctypes.data, ref[i].ctypes.data)
        same = all(np.array_equal(o.view(np.uint32), r.view(np.uint32)) for o, r in zip(outs, ref))
        print("  sums of squares of both builds bit-identical:", same)


if __name__ == "__main__":
    main()
