"""Held-out evaluation split over the workers (distributed/trainer.py eval_work, eval_means): every
probe window evaluated once, near-equal shares; each source's CE the mean of its windows' values in
window order, whatever order the workers' pieces come in — the one process's number."""
import numpy as np
import pytest

from mlx_open1b.distributed.trainer import eval_means, eval_work

SOURCES = [("web", 7), ("code", 3), ("math", 0), ("wiki", 5)]


@pytest.mark.parametrize("N", [1, 2, 3, 4, 6, 15, 16])
def test_bf16_windows_cut_near_equal_each_once(N):
    work = eval_work([s for s in SOURCES if s[1]], N, True)
    for name, n in SOURCES:
        got = sorted((a, b) for _, s, a, b in work if s == name)
        covered = [i for a, b in got for i in range(a, b)]
        assert covered == list(range(n)), (name, got)
    load = [sum(b - a for r, _, a, b in work if r == w) for w in range(N)]
    assert max(load) - min(load) <= 1 and sum(load) == 15
    ranks = [r for r, *_ in work]
    assert ranks == sorted(ranks)                    # each rank's run is contiguous, in window order


def test_quantized_sources_stay_whole():
    work = eval_work([("web", 7), ("code", 3), ("wiki", 5)], 2, False)
    assert work == [(0, "web", 0, 7), (1, "code", 0, 3), (0, "wiki", 0, 5)]


def test_means_in_window_order_whatever_the_arrival():
    """float64 sums of these float32 values depend on their order (1e16 + 1 - 1e16): the mean must
    be np.mean of the windows in order, from pieces gathered in any rank order."""
    vals = np.array([1e16, 1.0, -1e16, 3.0, 2.5], np.float32)
    want = float(np.mean(vals, dtype=np.float64))
    shuffled = float(np.mean(vals[[0, 2, 1, 3, 4]], dtype=np.float64))
    assert shuffled != want                          # the order shows in the result
    pieces = [[("web", 3, vals[3:5])], [("web", 0, vals[0:1]), ("code", 0, vals[:2])], [("web", 1, vals[1:3])]]
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        got = eval_means([pieces[i] for i in order])
        assert got["web"] == want and got["code"] == float(np.mean(vals[:2], dtype=np.float64))
