"""benchmarks/common.py medians(): each function timed once per round, in turn, after a warm-up of
untimed calls in turn lasting at least warm_s (a BLAS call just before leaves spinning threads that
slow the first calls; one untimed call each was not enough)."""
from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from common import medians  # noqa: E402


def _recorder(log, name, seconds):
    def f():
        log.append((name, time.perf_counter()))
        time.sleep(seconds)
    return f


def test_warm_up_lasts_warm_s_then_rounds_alternate():
    log = []
    t0 = time.perf_counter()
    out = medians([_recorder(log, "a", 0.002), _recorder(log, "b", 0.001)], 5, warm_s=0.1)
    names = [n for n, _ in log]
    assert names == ["a", "b"] * (len(names) // 2) and len(names) % 2 == 0    # always in turn
    warm = len(names) // 2 - 5                                                  # untimed calls of each
    assert warm >= 2                                    # several, not one: 0.1 s of 3 ms pairs
    assert log[2 * warm][1] - t0 >= 0.1                 # the first timed call comes after warm_s
    assert warm <= 0.1 / 0.003 + 1                      # and the warm-up stops once warm_s has passed
    assert len(out) == 2 and out[0] >= 0.002 and out[1] >= 0.001


def test_a_slow_function_is_warmed_once_and_warm_false_not_at_all():
    log = []
    medians([_recorder(log, "a", 0.03)], 3, warm_s=0.01)
    assert len(log) == 1 + 3
    log.clear()
    medians([_recorder(log, "a", 0.0)], 3, warm=False)
    assert len(log) == 3
