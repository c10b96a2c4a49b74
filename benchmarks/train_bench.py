"""Side by side in one run: the reproducible trainer (C reference) vs the PyTorch baseline on the
same preset, windows and threads; hashing as a share of step time; audit replay vs training.

    python benchmarks/train_bench.py --preset tiny --steps 20 --threads 2
    python benchmarks/train_bench.py --preset small --precision bf16,int8 --only-ours --rounds 3

--precision bf16,int8 trains the same preset, windows and threads once per precision (in rounds,
alternated, so that both see the same machine load) and prints their step times side by side.
With --paired the two precisions' trainers live in one process and take single steps in turn
(bf16, int8, bf16, ...): both see the same load at the grain of a step, which on a shared machine
(load moving by 10-20% within a minute) gives a steadier ratio than whole rounds.

    python benchmarks/train_bench.py --preset small --precision bf16,int8 --paired --steps 20

--profile: where one step's time goes, ours per C reference op (each call of the backend module
timed at the outermost level; the rest is Python, hashing and the optimizer's host work) next to
torch's profiler for the same architecture (self CPU time per aten op), both per step, and the
ratio line. Measure on an idle machine: both sides share the CPUs with whatever else runs.

    python benchmarks/train_bench.py --preset tiny --steps 5 --profile
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import pathlib
import tempfile
import time

from common import corpus_arg, median_interval


@contextlib.contextmanager
def timed_ops(module, totals: dict):
    """Wrap every public function of `module` (the backend the model calls by attribute) so that
    totals[name] = [seconds, calls] accumulate; a call made inside another timed call counts only
    in the outer one."""
    depth = [0]
    saved = {}

    def wrap(name, fn):
        @functools.wraps(fn)
        def timed(*args, **kw):
            if depth[0]:
                return fn(*args, **kw)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                depth[0] -= 1
                rec = totals.setdefault(name, [0.0, 0])
                rec[0] += time.perf_counter() - t0
                rec[1] += 1
        return timed

    skip = {"settings", "set_num_threads", "get_num_threads", "available", "contract_version",
            "simd_level", "simd_name"}
    for name in dir(module):
        fn = getattr(module, name)
        if name.startswith("_") or name in skip or not callable(fn) or isinstance(fn, type):
            continue
        if getattr(fn, "__module__", "") and not fn.__module__.startswith("mlx_open1b"):
            continue
        saved[name] = fn
        setattr(module, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def print_table(title: str, rows, step_s: float, top: int = 24) -> None:
    """rows: (name, seconds per step, calls per step), largest first."""
    print(f"  {title}: {1e3 * step_s:.1f} ms/step")
    print(f"    {'op':34s} {'ms/step':>9s} {'share':>7s} {'calls':>7s}")
    rows = sorted(rows, key=lambda r: -r[1])
    for name, sec, calls in rows[:top]:
        print(f"    {name:34s} {1e3 * sec:9.2f} {100 * sec / step_s:6.1f}% {calls:7.1f}")
    rest = sum(r[1] for r in rows[top:])
    if rest:
        print(f"    {'(the other ' + str(len(rows) - top) + ')':34s} {1e3 * rest:9.2f} {100 * rest / step_s:6.1f}%")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", help="a prepared corpus (default: the embedded default corpus, prepared on first use "
                    "in runs/data-default)")
    ap.add_argument("--precision", default="", help="bf16, int8, or both comma-separated (default: the preset's)")
    ap.add_argument("--only-ours", action="store_true", help="skip the PyTorch baselines and the audit replay")
    ap.add_argument("--rounds", type=int, default=1, help="repetitions of each precision's run (alternated)")
    ap.add_argument("--paired", action="store_true",
                    help="with two precisions: one trainer each in this process, single steps alternated "
                         "(--steps pairs); the ratio of the median steps and the median of the pairs' ratios")
    ap.add_argument("--profile", action="store_true", help="per-op time table of a step, ours and torch's")
    ap.add_argument("--hashes-inline", action="store_true",
                    help="wait for each step's state hashes at its end instead of overlapping them with "
                         "the next step (the same ledger; shows what the overlap saves)")
    a = ap.parse_args()
    a.data = corpus_arg(a.data)          # the default corpus prepared on first use

    from mlx_open1b import cpu_ref
    from mlx_open1b.audit import audit
    from mlx_open1b.config import preset
    from mlx_open1b.data.stream import Stream
    from mlx_open1b.model import init_params
    from mlx_open1b.torch_model import TorchTrainer

    cpu_ref.set_num_threads(a.threads)
    base = preset(a.preset)
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, eval_every=0, checkpoint_every=10 ** 9))
    precisions = [p for p in a.precision.split(",") if p] or [base.precision]
    t, m = base.train, base.model
    M, tokens = t.tokens_per_step(m, 0)

    def train_once(precision, with_audit):
        with tempfile.TemporaryDirectory() as d:
            run = pathlib.Path(d) / "run"
            tr = warm_trainer(a, base, precision, run)
            tr.timing = {"hash": 0.0, "steps": 0.0, "n": 0}
            t0 = time.perf_counter()
            for _ in tr.records(1 + a.steps):      # the steps alone, not train()'s final checkpoint
                pass
            ours = a.steps * tokens / (time.perf_counter() - t0)
            tr.train(1 + a.steps)                   # that checkpoint (the audit below replays the run)
            hash_share = tr.timing["hash"] / tr.timing["steps"]
            print(f"  hashing: {1e3 * tr.timing['hash'] / a.steps:.1f} ms/step on the step's path, "
                  f"{1e3 * tr.timing.get('hash_background', 0.0) / a.steps:.1f} ms/step on the background "
                  f"thread ({'inline' if a.hashes_inline else 'overlapping the next step'})")
            step_s = tr.timing["steps"] / tr.timing["n"]
            replay = None
            if with_audit:
                # both audits replay from checkpoint 0 (loading and checking it, building the model,
                # a first step's allocations); their difference is a.steps - 1 replayed steps alone,
                # as the training figure counts steps alone
                took = []
                for last in (1, a.steps):
                    t0 = time.perf_counter()
                    att = audit(run, 1, last)
                    took.append(time.perf_counter() - t0)
                    assert att["verdict"] == "certified", att
                replay = (a.steps - 1) * tokens / (took[1] - took[0]) if a.steps > 1 else float("nan")
        return ours, step_s, hash_share, replay

    if a.profile:
        profile(a, base, precisions[0], tokens, M)
        return

    if a.paired:
        paired(a, base, precisions, tokens, M)
        return

    if len(precisions) > 1 or a.only_ours:
        steps = {p: [] for p in precisions}
        for _ in range(a.rounds):
            for p in precisions:
                steps[p].append(train_once(p, False)[1])
        print(f"preset {a.preset}, {m.n_params():,} params, {tokens} tokens/step ({M} microbatches), "
              f"{a.threads} threads, {a.steps} steps x {a.rounds} rounds")
        for p in precisions:
            med = sorted(steps[p])[len(steps[p]) // 2]
            print(f"  {p:5s} step {1e3 * med:8.1f} ms (median of rounds; each round's mean: "
                  + ", ".join(f"{1e3 * s:.1f}" for s in steps[p]) + ")")
        if "bf16" in steps and "int8" in steps:
            r = sorted(b / i for b, i in zip(steps["bf16"], steps["int8"]))
            lo, hi, cov = median_interval(r)
            print(f"  speed int8/bf16: {r[len(r) // 2]:.3f} (per round: " + ", ".join(f"{x:.3f}" for x in r)
                  + ")" + interval_words(lo, hi, cov, len(r), "rounds"))
        return

    import torch
    torch.set_num_threads(a.threads)
    cfg = dataclasses.replace(base, precision=precisions[0])
    ours, step_s, hash_share, replay = train_once(precisions[0], True)

    results = {}
    for name, kw in (("torch float32", {}), ("torch bf16 autocast", {"autocast_bf16": True})):
        stream = Stream(a.data, t.seed, m.seq_len)
        tt = TorchTrainer(m, init_params(m, t.seed), betas=(t.beta1, t.beta2), eps=t.eps,
                          weight_decay=t.weight_decay, clip_norm=t.clip_norm, **kw)
        batches = (stream.next_windows(t.microbatch_seqs) for _ in iter(int, 1))
        tt.train_steps(batches, 1, t.peak_lr, microbatches=M)
        res = tt.train_steps(batches, a.steps, t.peak_lr, microbatches=M)
        results[name] = res.tokens_per_s

    print(f"preset {a.preset} ({cfg.precision}), {m.n_params():,} params, {tokens} tokens/step, {a.threads} threads, {a.steps} steps")
    print(f"  reproducible (cpu_ref)   {ours:10,.0f} tok/s   step {step_s * 1e3:7.1f} ms   hashing {100 * hash_share:.2f}% of step")
    for name, v in results.items():
        print(f"  {name:24s} {v:10,.0f} tok/s   ratio torch/ours {v / ours:5.2f}")
    print(f"  audit replay             {replay:10,.0f} tok/s   replay/train {replay / ours:5.2f}")


def interval_words(lo: float, hi: float, coverage: float, n: int, what: str) -> str:
    """The interval of the median of the n ratios (of the pairs or rounds: not of the ratio of the
    medians) as printed after them, with its coverage and what it assumes (common.median_interval);
    nothing for a single ratio."""
    if n < 2:
        return ""
    return (f"; the {what}' median's interval {lo:.3f} .. {hi:.3f} ({100 * coverage:.1f}% coverage, "
            f"distribution-free, taking the {n} {what} as independent)")


def warm_trainer(a, base, precision, run: pathlib.Path):
    """A trainer of the preset at `precision` writing to `run`, after one warm-up step (allocations,
    thread start)."""
    from mlx_open1b.train import Trainer
    tr = Trainer(run, dataclasses.replace(base, precision=precision), a.data)
    tr.overlap_hashes = not a.hashes_inline
    tr.step()
    return tr


def paired(a, base, precisions, tokens, M) -> None:
    """Single steps of one trainer per precision, alternated; per precision the median step (and its
    spread), then the speed ratios of the first precision's step to each other's."""
    import statistics
    if len(precisions) < 2:
        raise SystemExit("--paired: give two or more precisions (--precision bf16,int8)")
    if a.rounds != 1:
        raise SystemExit("--paired: --rounds does not apply (the steps alternate one by one; give more --steps)")
    times = {p: [] for p in precisions}
    with tempfile.TemporaryDirectory() as d:
        trainers, records = {}, {}

        def one_step(p) -> float:
            """The time to compute one more step (a record may come out of the generator without one)."""
            tr, t0 = trainers[p], time.perf_counter()
            s0 = tr.state.step
            while tr.state.step == s0:
                next(records[p])
            return time.perf_counter() - t0

        for p in precisions:
            tr = trainers[p] = warm_trainer(a, base, p, pathlib.Path(d) / p)
            # records() yields a step's record when the next one is computed: the first next()
            # computes two steps (warm buffers), each later one a step; one step more than timed,
            # since the run's last step waits for its own hashes (the drain below takes it)
            records[p] = iter(tr.records(4 + a.steps))
            one_step(p)
        for _ in range(a.steps):
            for p in precisions:
                times[p].append(one_step(p))
        for it in records.values():                     # the last records (not timed)
            for _ in it:
                pass
    m = base.model
    print(f"preset {a.preset}, {m.n_params():,} params, {tokens} tokens/step ({M} microbatches), "
          f"{a.threads} threads, {a.steps} steps each, alternated step by step")
    med = {p: statistics.median(times[p]) for p in precisions}
    for p in precisions:
        print(f"  {p:5s} step {1e3 * med[p]:8.1f} ms (median; min {1e3 * min(times[p]):.1f}, "
              f"max {1e3 * max(times[p]):.1f})")
    first = precisions[0]
    for p in precisions[1:]:
        pairs = sorted(f / o for f, o in zip(times[first], times[p]))
        lo, hi, cov = median_interval(pairs)
        print(f"  speed {p}/{first}: {med[first] / med[p]:.3f} (ratio of the medians); pairs' ratios: median "
              f"{statistics.median(pairs):.3f}, quartiles {pairs[len(pairs) // 4]:.3f} .. {pairs[(3 * len(pairs)) // 4]:.3f}"
              + interval_words(lo, hi, cov, len(pairs), "pairs"))


def profile(a, base, precision, tokens, M) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from mlx_open1b import cpu_ref
    from mlx_open1b.data.stream import Stream
    from mlx_open1b.model import init_params
    from mlx_open1b.torch_model import TorchTrainer

    cfg = dataclasses.replace(base, precision=precision)
    t, m = cfg.train, cfg.model
    totals: dict = {}
    # wrapped before the model is built: it keeps references to some ops (the linear layers)
    with tempfile.TemporaryDirectory() as d, timed_ops(cpu_ref, totals):
        tr = warm_trainer(a, base, precision, pathlib.Path(d) / "run")
        tr.timing = {"hash": 0.0, "steps": 0.0, "n": 0}
        totals.clear()
        t0 = time.perf_counter()
        for _ in tr.records(1 + a.steps):          # the steps alone, not train()'s final checkpoint
            pass
        wall = time.perf_counter() - t0
        hash_s, hash_bg = tr.timing["hash"], tr.timing.get("hash_background", 0.0)
    n = a.steps
    ours_step = wall / n
    rows = [(name, sec / n, calls / n) for name, (sec, calls) in totals.items()]
    rows.append(("hashing (on the step's path)", hash_s / n, 1.0))
    rows.append(("rest: Python, data, ledger", max(0.0, ours_step - sum(r[1] for r in rows)), 0.0))

    torch.set_num_threads(a.threads)
    stream = Stream(a.data, t.seed, m.seq_len)
    tt = TorchTrainer(m, init_params(m, t.seed), betas=(t.beta1, t.beta2), eps=t.eps,
                      weight_decay=t.weight_decay, clip_norm=t.clip_norm)
    batches = (stream.next_windows(t.microbatch_seqs) for _ in iter(int, 1))
    tt.train_steps(batches, 1, t.peak_lr, microbatches=M)
    t0 = time.perf_counter()
    tt.train_steps(batches, n, t.peak_lr, microbatches=M)      # unprofiled: the ratio line
    torch_step = (time.perf_counter() - t0) / n
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        tt.train_steps(batches, n, t.peak_lr, microbatches=M)
        profiled_step = (time.perf_counter() - t0) / n
    trows = [(e.key, e.self_cpu_time_total * 1e-6 / n, e.count / n) for e in prof.key_averages()]
    covered = sum(r[1] for r in trows)
    trows.append(("rest: Python, profiler overhead", max(0.0, profiled_step - covered), 0.0))

    print(f"preset {a.preset} ({precision}), {m.n_params():,} params, {tokens} tokens/step, "
          f"{a.threads} threads, {n} steps each (SIMD {cpu_ref.simd_name()})")
    print_table("reproducible (cpu_ref), per C reference op (timed calls)", rows, ours_step)
    print(f"  hashing on the background thread: {1e3 * hash_bg / n:.1f} ms/step "
          f"({'inline: --hashes-inline' if a.hashes_inline else 'overlapping the next step'})")
    print_table("torch float32 eager under torch.profiler (self CPU time)", trows, profiled_step)
    print(f"  torch float32 eager unprofiled: {1e3 * torch_step:.1f} ms/step")
    print(f"  ratio torch/ours (speed; step time ours / torch unprofiled): {ours_step / torch_step:5.2f}")
    print("  figures from a shared machine are indicative only; re-run on an idle one")


if __name__ == "__main__":
    main()
