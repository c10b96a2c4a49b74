"""What the benchmarks share: side-by-side timing (each function timed once per round, the functions
taken in turn within a round, so that all of them see the same machine load; the median per
function), and the corpus a benchmark reads (by open1b train's rule)."""
from __future__ import annotations

import statistics
import sys
import time


def medians(fns, rounds: int, warm: bool = True, warm_s: float = 0.2) -> list[float]:
    """Median seconds of each of `fns` (no-argument callables) over `rounds` rounds, the calls
    alternated within each round; warm: untimed calls of each first, in turn, for at least warm_s
    seconds (one each at least). Not one call only: a BLAS call just before (numpy's OpenBLAS, whose
    worker threads keep spinning for tens of milliseconds after it returns) or a core that has idled
    slows the first calls, by up to 8x for a sub-millisecond layer on 2 cores (int8_bench's first
    row, right after its numpy figures, measured so before this warm-up)."""
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
