"""The training step's host-side time outside the C reference's ops ("rest: Python, data, ledger" of
train_bench.py --profile), with and without the host paths that only move memory: the recycled
gradient buffers (Trainer.recycle_grads) and glibc's malloc thresholds (host_malloc.tune). Each
variant trains in its own process (the malloc thresholds are per process), the variants alternated
round by round so that they see the same machine load; every variant must end on the same ledger
hash (the paths change no bit).

    python benchmarks/host_overhead_bench.py --preset tiny --steps 10 --rounds 3
    python benchmarks/host_overhead_bench.py --preset small --steps 3 --rounds 2

Per variant: median over rounds of the step (ms, wall clock over the steps, no final checkpoint),
of the ops' time and of the rest; the process's CPU time (every thread) and page faults per step,
which machine load moves less. Measure on an idle machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from common import corpus_arg

VARIANTS = {"before": (False, False), "recycle": (True, False), "malloc": (False, True), "both": (True, True)}


def child(a) -> None:
    from mlx_open1b import cpu_ref, host_malloc
    from mlx_open1b.config import preset
    from mlx_open1b.train import Trainer
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from train_bench import timed_ops

    recycle, malloc = VARIANTS[a.child]
    if not malloc:
        host_malloc._tuned = False          # as if tuned already: the trainer leaves glibc's defaults
    cpu_ref.set_num_threads(a.threads)
    base = preset(a.preset)
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, eval_every=0, checkpoint_every=10 ** 9))
    totals: dict = {}
    with tempfile.TemporaryDirectory() as d, timed_ops(cpu_ref, totals):
        tr = Trainer(pathlib.Path(d) / "run", base, a.data)
        tr.recycle_grads = recycle
        tr.step()                                       # warm-up step (allocations, thread start)
        tr.timing = {"hash": 0.0, "steps": 0.0, "n": 0}
        totals.clear()
        f0, c0, t0 = _faults(), time.process_time(), time.perf_counter()
        for _ in tr.records(1 + a.steps):
            pass
        wall = (time.perf_counter() - t0) / a.steps
        cpu, faults = (time.process_time() - c0) / a.steps, (_faults() - f0) / a.steps
        ops = sum(s for s, _ in totals.values()) / a.steps
        hashing = tr.timing["hash"] / a.steps
        print(json.dumps({"step": wall, "ops": ops, "hash": hashing, "rest": wall - ops - hashing,
                          "cpu": cpu, "faults": faults, "ledger": tr.ledger.last_hash}))


def _faults() -> int:
    """Page faults of this process so far (minor: memory the kernel had to map and zero)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", help="a prepared corpus (default: the embedded default corpus, prepared on first use "
                    "in runs/data-default)")
    ap.add_argument("--variants", default="before,both", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    a.data = corpus_arg(a.data)          # the default corpus prepared on first use
    names = [v for v in a.variants.split(",") if v]
    got: dict = {v: [] for v in names}
    for _ in range(a.rounds):
        for v in names:
            out = subprocess.run([sys.executable, __file__, "--child", v, "--preset", a.preset, "--steps",
                                  str(a.steps), "--threads", str(a.threads), "--data", a.data],
                                 check=True, capture_output=True, text=True).stdout
            got[v].append(json.loads(out.strip().splitlines()[-1]))
    ledgers = {r["ledger"] for rs in got.values() for r in rs}
    print(f"preset {a.preset}, {a.threads} threads, {a.steps} steps x {a.rounds} rounds; "
          f"ledger hashes {'all equal' if len(ledgers) == 1 else 'DIFFER: ' + ', '.join(sorted(ledgers))}")
    print(f"  {'variant':8s} {'step ms':>9s} {'ops ms':>9s} {'hash ms':>8s} {'rest ms':>8s} {'cpu ms':>8s} "
          f"{'faults':>8s}   rest per round")
    for v in names:
        med = {k: sorted(r[k] for r in got[v])[len(got[v]) // 2] for k in ("step", "ops", "hash", "rest", "cpu", "faults")}
        print(f"  {v:8s} {1e3 * med['step']:9.1f} {1e3 * med['ops']:9.1f} {1e3 * med['hash']:8.1f} "
              f"{1e3 * med['rest']:8.1f} {1e3 * med['cpu']:8.1f} {med['faults']:8.0f}   "
              + ", ".join(f"{1e3 * r['rest']:.1f}" for r in got[v]))
    if len(ledgers) != 1:
        sys.exit(1)


if __name__ == "__main__":
    main()
