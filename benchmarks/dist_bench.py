"""Distributed data-parallel training: N workers (torchrun, gloo) vs 1 on the same preset and
machine, per-step time split into compute and communication, and the ledgers compared.

    python benchmarks/dist_bench.py --preset small --steps 3 --workers 1,2

Per step and per worker: `compute` (microbatch forward/backward and the worker's local folds),
`reduce` (the owner's fold of the routed partials), `optim` (clip + AdamW on owned tensors),
`hash`, and `comm` (time inside collectives: transfer plus waiting for the slowest worker); `wall`
is the step as a whole. `transfer` is the pure cost of the step's two big collectives (the gradient
all-to-all and the bf16 parameter all-gather) measured alone, back to back, before training.
Threads: the machine's CPUs divided by the workers, or --threads per worker (threads never change a bit). The first step is
a warm-up and is not counted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from common import corpus_arg


def _worker(a) -> None:
    import numpy as np

    from mlx_open1b.config import preset
    from mlx_open1b.distributed import DistributedTrainer, dyadic_blocks, microbatch_range, run_worker

    cfg = preset(a.preset)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=0, checkpoint_every=10 ** 9))
    rows = []
    keys = ("compute", "reduce", "optim", "hash", "comm", "wall")

    def snapshot(tr):
        return dict(tr.timing, comm=tr.comm.seconds, wall=time.perf_counter())

    orig = DistributedTrainer.step

    def step(self):                            # every rank times its own steps
        before = snapshot(self)
        rec = orig(self)
        after = snapshot(self)
        rows.append({k: after[k] - before[k] for k in keys})
        return rec

    DistributedTrainer.step = step
    h, tr = run_worker(a.out, cfg, a.data, steps=a.steps + 1, threads=a.threads, close=False)
    # the step's two big collectives alone: gradient all-to-all (f32 partials) and bf16 all-gather
    comm, P = tr.comm, tr.model_cfg.n_params()
    M, _ = tr.tcfg.tokens_per_step(tr.model_cfg, 0)
    nparts = len(dyadic_blocks(*microbatch_range(M, comm.world, comm.rank)))
    blocks = [len(dyadic_blocks(*microbatch_range(M, comm.world, w))) for w in range(comm.world)]
    send = np.zeros(nparts * P, np.float32)
    s0 = comm.seconds
    reps = 3
    for _ in range(reps):
        comm.all_to_all(send, [nparts * sh.size for sh in tr.shards], [b * tr.own.size for b in blocks])
    a2a = (comm.seconds - s0) / reps
    s0 = comm.seconds
    for _ in range(reps):
        comm.all_gather_into(tr.state.params, [sh.size for sh in tr.shards])
    ag = (comm.seconds - s0) / reps
    out = {"rank": comm.rank, "world": comm.world, "run_hash": h, "rows": rows[1:] if len(rows) > 1 else rows,
           "a2a_bytes": int(send.nbytes), "a2a_s": a2a, "allgather_s": ag, "params": P, "microbatches": M,
           "owned": tr.own.size, "threads": a.threads}
    pathlib.Path(a.report).with_suffix(f".rank{comm.rank}.json").write_text(json.dumps(out))
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--data", help="a prepared corpus (default: the embedded default corpus, prepared on first use "
                    "in runs/data-default)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0,
                    help="kernel threads per worker (default: the CPUs divided by the workers)")
    a = ap.parse_args()
    if a.worker:
        return _worker(a)
    a.data = corpus_arg(a.data)          # the default corpus prepared on first use

    from mlx_open1b.distributed.collectives import cpu_count
    cpus = cpu_count()
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for n in [int(x) for x in a.workers.split(",")]:
            threads = a.threads or max(1, cpus // n)
            run, report = pathlib.Path(d) / f"run{n}", pathlib.Path(d) / f"report{n}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   __file__, "--worker", "--preset", a.preset, "--steps", str(a.steps), "--data", a.data,
                   "--out", str(run), "--report", str(report), "--threads", str(threads)]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
            total = time.perf_counter() - t0
            reps = [json.loads(report.with_suffix(f".rank{r}.json").read_text()) for r in range(n)]
            results[n] = (reps, total, (run / "ledger.jsonl").read_bytes())
    base = None
    print(f"\npreset {a.preset}: {results[next(iter(results))][0][0]['params']:,} parameters, "
          f"{results[next(iter(results))][0][0]['microbatches']} microbatches per step, {cpus} CPUs; "
          f"means over {a.steps} steps after a warm-up step, seconds per step")
    print(f"{'workers':>7} {'rank':>4} {'threads':>7} {'wall':>7} {'compute':>8} {'reduce':>7} {'optim':>6} "
          f"{'hash':>6} {'comm':>6} {'a2a MB':>7} {'a2a s':>6} {'gather s':>8}")
    for n, (reps, total, led) in results.items():
        for r in reps:
            mean = {k: sum(row[k] for row in r["rows"]) / len(r["rows"]) for k in r["rows"][0]}
            print(f"{n:>7} {r['rank']:>4} {r['threads']:>7} {mean['wall']:>7.2f} {mean['compute']:>8.2f} "
                  f"{mean['reduce']:>7.3f} {mean['optim']:>6.3f} {mean['hash']:>6.3f} {mean['comm']:>6.3f} "
                  f"{r['a2a_bytes'] / 1e6:>7.1f} {r['a2a_s']:>6.3f} {r['allgather_s']:>8.3f}")
        wall = sum(row["wall"] for row in reps[0]["rows"]) / len(reps[0]["rows"])
        base = base or wall
        print(f"{'':>7} speed-up vs {next(iter(results))} worker(s): {base / wall:.2f}x")
    leds = {led for _, _, led in results.values()}
    print(f"ledgers identical across worker counts: {len(leds) == 1}  (run hash {next(iter(results.values()))[0][0]['run_hash'][:16]}…)")


if __name__ == "__main__":
    main()
