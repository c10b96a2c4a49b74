"""What the benchmarks share: side-by-side timing (each function timed once per round, the functions
taken in turn within a round, so that all of them see the same machine load; the median per
function), and the corpus a benchmark reads (by open1b train's rule)."""
from __future__ import annotations

import math
import statistics
import sys
import time


def medians(fns, rounds: int, warm: bool = True, warm_s: float = 0.2) -> list[float]:
    """Median seconds of each of `fns` (no-argument callables) over `rounds` rounds, the calls
    alternated within each round; warm: untimed calls of each first, in turn, for at least warm_s
    seconds (one each at least). Not one call only: a BLAS call just before (numpy's OpenBLAS, whose
    worker threads keep spinning for tens of milliseconds after it returns) or a core that has idled
    slows the first calls, by up to 8x for a sub-millisecond layer on 2 cores."""
    if warm:
        t_end = time.perf_counter() + warm_s
        while True:
            for f in fns:
                f()
            if time.perf_counter() >= t_end:
                break
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for k, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


def median_interval(values, level: float = 0.95) -> tuple[float, float, float]:
    """(lower, upper, coverage): the distribution-free interval for the median of the population the
    values are independent draws of, between two order statistics: [x_(k), x_(n+1-k)] (1-based,
    sorted) with the largest k for which P(Binomial(n, 1/2) < k) <= (1 - level) / 2, so that it holds
    the median with probability `coverage` >= level whatever the distribution. With too few values
    for the level (n < 6 at 95%) the interval is the whole range and its coverage 1 - 2^(1-n)."""
    x = sorted(values)
    n = len(x)
    if n == 0:
        raise ValueError("median_interval: no values")
    tail = (1.0 - level) / 2.0
    k, below = 0, 0.0                      # below = P(B < k) for the current k
    while k < n // 2:
        p_next = below + math.comb(n, k) / 2 ** n     # exact integer power: no overflow for large n
        if p_next > tail:
            break
        below, k = p_next, k + 1
    if k == 0:                             # too few values: the whole range
        return x[0], x[-1], 1.0 - 2.0 ** (1 - n)
    return x[k - 1], x[n - k], 1.0 - 2.0 * below


def corpus_arg(data: str | None) -> str:
    """The corpus of --data by open1b train's rule (none: the embedded default corpus, prepared on
    first use; one given must be prepared); a corpus that cannot be had stops the benchmark with one
    line naming it, exit code 1."""
    from mlx_open1b.data.format import DataError
    from mlx_open1b.data.prepare import corpus_dir
    try:
        return str(corpus_dir(data, log=lambda msg: print(msg, file=sys.stderr)))
    except (DataError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
