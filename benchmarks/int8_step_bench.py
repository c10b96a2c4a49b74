"""int8 vs bf16 side by side in one run: the model program's loss_and_grad (one microbatch,
forward + backward, C reference) with precision bf16 and int8, alternated so that both see the
same machine load; medians over repetitions, and where the time goes by op.

    python benchmarks/int8_step_bench.py --preset small --reps 7 --threads 2 [--no-ops] [--pool-ab]
    python benchmarks/int8_step_bench.py --preset small --threads 1 --clock thread   # loaded machine

--clock thread times by the calling thread's CPU time, which other processes' load does not
inflate; with one thread every op computes on the calling thread, so it counts all the work.

--pool-ab also runs both precisions with the C reference's thread pool off (threads started on
every parallel call, as before the pool), alternated with the pooled runs.

The op breakdown wraps every cpu_ref function the model calls with a timer (a second pass, so
that the ratios above are measured without the wrappers)."""
from __future__ import annotations

import argparse
import statistics
import time
import types

import numpy as np

from mlx_open1b import cpu_ref
from mlx_open1b.cpu_ref import _lib
from mlx_open1b.config import preset
from mlx_open1b.model import Model, init_params


CLOCK = time.perf_counter


class TimedOps:
    """cpu_ref with every function call timed by name (modules and constants pass through)."""

    def __init__(self, ops):
        self._ops, self.t = ops, {}

    def __getattr__(self, name):
        v = getattr(self._ops, name)
        if not callable(v) or isinstance(v, (type, types.ModuleType)):
            return v
        t = self.t

        def timed(*a, **k):
            t0 = CLOCK()
            r = v(*a, **k)
            t[name] = t.get(name, 0.0) + CLOCK() - t0
            return r
        return timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-ops", action="store_true")
    ap.add_argument("--pool-ab", action="store_true", help="also time both precisions with the thread pool off")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: the calling thread's CPU time (needs --threads 1)")
    a = ap.parse_args()
    if a.clock == "thread" and a.threads != 1:
        ap.error("--clock thread needs --threads 1 (other threads' CPU time is not counted)")
    global CLOCK
    CLOCK = time.thread_time if a.clock == "thread" else time.perf_counter
    cpu_ref.set_num_threads(a.threads)
    cfg = preset(a.preset)
    m, t = cfg.model, cfg.train
    params = init_params(m, t.seed)
    rng = np.random.default_rng(0)
    win = rng.integers(0, m.vocab_size, (t.microbatch_seqs, m.seq_len + 1)).astype(np.uint32)
    models = {p: Model(m, precision=p) for p in ("bf16", "int8")}
    set_pool = getattr(_lib.lib, "o1b_set_thread_pool", None)
    pools = (1, 0) if a.pool_ab and set_pool is not None else (1,)
    runs = [(p, pool) for pool in pools for p in models]
    times = {r: [] for r in runs}
    for mod in models.values():
        mod.loss_and_grad(params, win)                        # warm-up
    for _ in range(a.reps):
        for p, pool in runs:
            if set_pool is not None:
                set_pool(pool)
            t0 = CLOCK()
            models[p].loss_and_grad(params, win)
            times[(p, pool)].append(CLOCK() - t0)
    if set_pool is not None:
        set_pool(1)
    N = t.microbatch_seqs * m.seq_len
    print(f"preset {a.preset}: N {N}, d {m.d_model}, F {m.ffn_hidden}, layers {m.n_layers}, "
          f"threads {cpu_ref.get_num_threads()}, {a.reps} reps (microbatch forward+backward), "
          f"{a.clock} clock")
    for pool in pools:
        tag = "" if len(pools) == 1 else (" pool on " if pool else " pool off")
        for p in models:
            ts = times[(p, pool)]
            print(f"  {p:5s}{tag} median {1e3 * statistics.median(ts):8.1f} ms   min {1e3 * min(ts):8.1f} ms")
        ratios = [b / i for b, i in zip(times[("bf16", pool)], times[("int8", pool)])]
        print(f"  speed int8/bf16{tag}: median of per-rep ratios {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    if a.no_ops:
        return
    for p in models:
        ops = TimedOps(cpu_ref)
        mod = Model(m, ops=ops, precision=p)
        tot = []
        acc = {}
        for _ in range(a.reps):
            ops.t.clear()
            t0 = CLOCK()
            mod.loss_and_grad(params, win)
            tot.append(CLOCK() - t0)
            for k, v in ops.t.items():
                acc.setdefault(k, []).append(v)
        total = statistics.median(tot)
        print(f"  {p} by op (median ms per microbatch; total {1e3 * total:.1f} ms):")
        rows = sorted(((statistics.median(v), k) for k, v in acc.items()), reverse=True)
        for v, k in rows:
            if v >= 0.002 * total:
                print(f"    {k:22s} {1e3 * v:8.2f}  {100 * v / total:5.1f}%")
        rest = total - sum(v for v, _ in rows)
        print(f"    {'(python, numpy)':22s} {1e3 * rest:8.2f}  {100 * rest / total:5.1f}%")


if __name__ == "__main__":
    main()
