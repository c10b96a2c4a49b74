"""Linear layer GEMMs of the C reference vs numpy float32 matmul (OpenBLAS), side by side.

For each shape N x K x M (tokens x in features x out features) it times the three GEMMs of a
linear layer on bf16 operands with fp32 accumulation in contract order:

    forward  y  = x W^T     (N, M), depth K
    dx       dx = dy W      (N, K), depth M
    dW       dW = dy^T x    (M, K), depth N

and numpy's float32 matmul of the same shapes and transposes (x @ w.T, dy @ w, dy.T @ x on
float32 copies; OpenBLAS takes the transposed views without copying), with the same thread
count, 2 N K M flops each. Runs alternate in blocks (ours x b, numpy x b, ours x b, ...) so both
see the same machine load, and each block starts with --warmup seconds of untimed calls of the
same op: OpenBLAS's worker threads keep spinning for tens of milliseconds after a call (timed
right after numpy, ours would share its cores with them), and a core that has idled (a virtual
CPU in particular) runs the first calls slowly. Best and median of --repeat runs each are printed, and the ratios
ours/numpy. On a shared machine take the best of several invocations, or time one thread by
its own CPU time (`--threads 1 --clock thread`), which other processes' load does not inflate.

    python benchmarks/linear_bench.py                       # all CPUs, default shapes
    python benchmarks/linear_bench.py --threads 1 --repeat 11
    python benchmarks/linear_bench.py --shapes 4096x512x512 --simd 1     # cap ours at AVX2

The numpy peer: numpy's OpenBLAS reads OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE at import. If
the environment pins OPENBLAS_CORETYPE=Haswell (as some CI images do), OpenBLAS runs its AVX2
kernels even on an AVX-512 CPU and is about half as fast; for a fair peer run

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/linear_bench.py

(the script prints both variables so the table says which peer it measured). numpy's thread
count is set with threadpoolctl when it is installed; otherwise, when --threads is given, the
script sets OPENBLAS_NUM_THREADS before importing numpy (and says so).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4096x512x512,4096x512x1408,4096x1408x512",
                    help="comma-separated NxKxM (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads for both (default 0: one per online CPU, both sides)")
    ap.add_argument("--repeat", type=int, default=9, help="timed runs of each (default 9)")
    ap.add_argument("--block", type=int, default=3, help="runs per block (default 3)")
    ap.add_argument("--warmup", type=float, default=0.2,
                    help="seconds of untimed calls before each block (default 0.2)")
    ap.add_argument("--ops", default="fwd,dx,dw", help="any of fwd,dx,dw (default all)")
    ap.add_argument("--simd", type=int, default=None,
                    help="cap our SIMD level: 0 portable, 1 AVX2, 2 AVX-512 (default: best)")
    ap.add_argument("--no-numpy", action="store_true", help="time ours only")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="wall: perf_counter; thread: CPU time of the calling thread, which "
                         "time slicing on a loaded machine does not inflate (needs --threads 1, "
                         "where both sides compute on the calling thread)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = args.threads if args.threads > 0 else (os.cpu_count() or 1)
    if args.clock == "thread" and threads != 1:
        print("linear_bench: --clock thread needs --threads 1 (other threads' CPU time is not "
              "counted)", file=sys.stderr)
        return 2
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    blas_note = ""
    try:
        import threadpoolctl  # noqa: F401
        have_tpc = True
    except ImportError:
        have_tpc = False
        if args.threads > 0:
            if os.environ.get("OPENBLAS_NUM_THREADS", str(threads)) != str(threads):
                blas_note = "(OPENBLAS_NUM_THREADS was %s; overridden) " % os.environ["OPENBLAS_NUM_THREADS"]
            os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
            blas_note += "numpy threads: OPENBLAS_NUM_THREADS=%d set before importing numpy" % threads
        else:
            blas_note = ("numpy threads: OpenBLAS default (OPENBLAS_NUM_THREADS=%s); "
                         "install threadpoolctl to set and report them" %
                         os.environ.get("OPENBLAS_NUM_THREADS", "unset"))

    import numpy as np
    from mlx_open1b import cpu_ref
    from mlx_open1b.cpu_ref import settings

    cpu_ref.set_num_threads(threads)
    limiter = None
    if have_tpc:
        from threadpoolctl import threadpool_info, threadpool_limits
        limiter = threadpool_limits(limits=threads, user_api="blas")
        infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        blas_note = "numpy BLAS (threadpoolctl): " + "; ".join(
            "%s %s %s, %s threads" % (i.get("internal_api"), i.get("version"),
                                      i.get("architecture"), i.get("num_threads")) for i in infos)

    print("ours: mlx_open1b cpu_ref GEMM, %d threads, SIMD %s%s" %
          (threads, cpu_ref.simd_name(), "" if args.simd is None else " (capped at level %d)" % args.simd))
    print("numpy %s: %s" % (np.__version__, blas_note))
    print("env: OPENBLAS_CORETYPE=%s OPENBLAS_L2_SIZE=%s" %
          (os.environ.get("OPENBLAS_CORETYPE", "unset"), os.environ.get("OPENBLAS_L2_SIZE", "unset")))
    print("GFLOP/s = 2 N K M / time (%s clock); best and median of %d runs each, alternating in "
          "blocks of %d\n" % (args.clock, args.repeat, args.block))

    rng = np.random.default_rng(0)

    def bf16(shape, scale):
        f = (rng.standard_normal(shape) * scale).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)

    def f32(h):
        return (h.astype(np.uint32) << 16).view(np.float32)

    def timed(fn):
        t = clock()
        fn()
        return clock() - t

    def warm(fn):
        t = time.perf_counter()
        while time.perf_counter() - t < args.warmup:
            fn()

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    hdr = "%-16s %-4s %9s %9s %9s %9s %7s %7s" % ("N x K x M", "op", "ours", "(median)", "numpy",
                                                  "(median)", "ratio", "(med)")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    with settings(threads=threads, simd=args.simd):
        for spec in args.shapes.split(","):
            N, K, M = (int(v) for v in spec.lower().split("x"))
            x, w, dy = bf16((N, K), 1.0), bf16((M, K), 0.02), bf16((N, M), 1.0)
            xf, wf, dyf = f32(x), f32(w), f32(dy)
            flops = 2.0 * N * K * M
            cases = {
                "fwd": (lambda: cpu_ref.linear_forward(x, w), lambda: np.matmul(xf, wf.T)),
                "dx": (lambda: cpu_ref.linear_backward(dy, x, w, need_dx=True, need_dw=False),
                       lambda: np.matmul(dyf, wf)),
                "dw": (lambda: cpu_ref.linear_backward(dy, x, w, need_dx=False, need_dw=True),
                       lambda: np.matmul(dyf.T, xf)),
            }
            for op in ops:
                ours_fn, np_fn = cases[op]
                t_ours, t_np = [], []
                while len(t_ours) < args.repeat:
                    b = min(args.block, args.repeat - len(t_ours))
                    warm(ours_fn)
                    t_ours += [timed(ours_fn) for _ in range(b)]
                    if not args.no_numpy:
                        warm(np_fn)
                        t_np += [timed(np_fn) for _ in range(b)]
                g_best, g_med = flops / min(t_ours) / 1e9, flops / statistics.median(t_ours) / 1e9
                if t_np:
                    n_best, n_med = flops / min(t_np) / 1e9, flops / statistics.median(t_np) / 1e9
                    line = "%-16s %-4s %9.1f %9.1f %9.1f %9.1f %7.2f %7.2f" % (
                        spec, op, g_best, g_med, n_best, n_med, g_best / n_best, g_med / n_med)
                else:
                    line = "%-16s %-4s %9.1f %9.1f" % (spec, op, g_best, g_med)
                print(line, flush=True)
                rows.append(line)
    if limiter is not None:
        limiter.restore_original_limits()
    return 0


if __name__ == "__main__":
    sys.exit(main())
