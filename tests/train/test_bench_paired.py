"""benchmarks/train_bench.py --paired: one trainer per precision in one process, single steps taken in
turn. Timings are not asserted (they belong to benchmarks); this holds the mode's output to its own
numbers: every timed call computed one step (no record handed out without a step: a min of a
fraction of the others would show one), the ratio printed is the one of the medians printed, and the
median's interval (benchmarks/common.py median_interval) is the order-statistic one it claims."""
from __future__ import annotations

import fractions
import math
import pathlib
import random
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "train_bench.py"
sys.path.insert(0, str(SCRIPT.parent))
from common import median_interval  # noqa: E402


def _run(*args, cwd):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd)


def test_paired_steps_and_their_ratio(tmp_path, default_corpus):
    r = _run("--data", str(default_corpus), "--preset", "tiny", "--precision", "bf16,int8", "--paired",
             "--steps", "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    step = {}
    for p in ("bf16", "int8"):
        m = re.search(rf"^  {p}\s+step\s+([\d.]+) ms \(median; min ([\d.]+), max ([\d.]+)\)$", out, re.M)
        assert m, out
        med, lo, hi = map(float, m.groups())
        assert 0 < lo <= med <= hi, out
        assert lo > 0.25 * med, f"a timed call without a step ({p}): {out}"
        step[p] = med
    m = re.search(r"speed int8/bf16: ([\d.]+) \(ratio of the medians\)", out)
    assert m and abs(float(m.group(1)) - step["bf16"] / step["int8"]) < 2e-3 * float(m.group(1)) + 1e-3, out
    assert "3 steps each, alternated step by step" in out
    m = re.search(r"pairs' ratios: median ([\d.]+), quartiles [\d.]+ \.\. [\d.]+; the pairs' median's interval ([\d.]+) \.\. "
                  r"([\d.]+) \(75\.0% coverage, distribution-free, taking the 3 pairs as independent\)", out)
    assert m, out                                 # 3 pairs: too few for 95%, the whole range
    med, lo, hi = map(float, m.groups())
    assert lo <= med <= hi, out


def test_paired_needs_two_precisions_and_no_rounds(tmp_path, default_corpus):
    r = _run("--data", str(default_corpus), "--preset", "tiny", "--precision", "int8", "--paired",
             "--steps", "1", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--paired: give two or more precisions" in r.stderr
    r = _run("--data", str(default_corpus), "--preset", "tiny", "--precision", "bf16,int8", "--paired",
             "--rounds", "3", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--rounds does not apply" in r.stderr


def _coverages(n: int) -> list[float]:
    """[P(x_(k) <= median <= x_(n+1-k)) for k = 0 .. n // 2] for n independent draws of a continuous
    distribution (k = 0: no bound), from exact binomial sums."""
    out, below = [], 0
    for k in range(n // 2 + 1):
        out.append(float(1 - fractions.Fraction(2 * below, 2 ** n)))
        below += math.comb(n, k)
    return out


@pytest.mark.parametrize("level", [0.8, 0.95, 0.99])
@pytest.mark.parametrize("n", [1, 2, 5, 6, 7, 9, 20, 21, 50, 1500])
def test_median_interval_order_statistics(n, level):
    """The bounds are the k-th smallest and largest of n distinct values for the largest k whose
    coverage is still >= level (k = 0: too few values, the whole range), computed here from exact
    binomial sums; n = 1500 is past where 2.0 ** n overflows."""
    rng = random.Random(n)
    vals = [rng.gauss(0.0, 1.0) for _ in range(n)]
    x = sorted(vals)
    assert len(set(x)) == n                      # distinct: every index error shows
    lo, hi, cov = median_interval(vals, level)
    c = _coverages(n)
    k = max([j for j in range(1, n // 2 + 1) if c[j] >= level], default=0)
    if k == 0:
        assert (lo, hi) == (x[0], x[-1]) and abs(cov - (1.0 - 2.0 ** (1 - n))) < 1e-12
    else:
        assert (lo, hi) == (x[k - 1], x[n - k]) and abs(cov - c[k]) < 1e-12 and cov >= level
    assert lo <= x[(n - 1) // 2] <= x[n // 2] <= hi


def test_median_interval_holds_the_median_as_often_as_it_claims():
    """Simulated: 20 draws from a skewed distribution whose median is known (exponential: ln 2); the
    interval holds it in about the claimed share of 4000 trials (the binomial sd is 0.3%)."""
    rng = random.Random(7)
    hits = 0
    for _ in range(4000):
        lo, hi, cov = median_interval([rng.expovariate(1.0) for _ in range(20)])
        hits += lo <= math.log(2.0) <= hi
    assert abs(hits / 4000 - cov) < 0.015, (hits / 4000, cov)


def test_median_interval_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        median_interval([])


def test_rounds_ratio_and_its_interval(tmp_path, default_corpus):
    """--rounds: the speed line's ratio is one of the per-round ratios it lists (the upper median) and
    the median's interval printed after them is the order-statistic one of those ratios."""
    r = _run("--data", str(default_corpus), "--preset", "tiny", "--precision", "bf16,int8", "--only-ours",
             "--rounds", "2", "--steps", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    m = re.search(r"speed int8/bf16: ([\d.]+) \(per round: ([\d., ]+)\); the rounds' median's interval ([\d.]+) \.\. ([\d.]+) "
                  r"\(([\d.]+)% coverage, distribution-free, taking the 2 rounds as independent\)", r.stdout)
    assert m, r.stdout
    ratio, rounds = float(m.group(1)), [float(x) for x in m.group(2).split(", ")]
    lo, hi, cov = median_interval(rounds)
    assert ratio == sorted(rounds)[1] and (float(m.group(3)), float(m.group(4))) == (round(lo, 3), round(hi, 3))
    assert float(m.group(5)) == round(100 * cov, 1) == 50.0
