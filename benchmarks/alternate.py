"""Side-by-side timing for the benchmarks: each function timed once per round, the functions taken in
turn within a round, so that all of them see the same machine load; the median per function."""
from __future__ import annotations

import statistics
import time


def medians(fns, rounds: int, warm: bool = True) -> list[float]:
    """Median seconds of each of `fns` (no-argument callables) over `rounds` rounds, the calls
    alternated within each round; warm: one untimed call of each first."""
    if warm:
        for f in fns:
            f()
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for k, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]
