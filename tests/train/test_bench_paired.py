"""benchmarks/train_bench.py --paired: one trainer per precision in one process, single steps taken in
turn. Timings are not asserted (they belong to benchmarks); this holds the mode's output to its own
numbers: every timed call computed one step (no record handed out without a step: a min of a
fraction of the others would show one), and the ratio printed is the one of the medians printed."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "train_bench.py"


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


def test_paired_needs_two_precisions_and_no_rounds(tmp_path, default_corpus):
    r = _run("--data", str(default_corpus), "--preset", "tiny", "--precision", "int8", "--paired",
             "--steps", "1", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--paired: give two or more precisions" in r.stderr
    r = _run("--data", str(default_corpus), "--preset", "tiny", "--precision", "bf16,int8", "--paired",
             "--rounds", "3", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--rounds does not apply" in r.stderr
