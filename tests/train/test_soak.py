"""scripts/soak.sh, the short version: a run killed with SIGKILL six times (at random moments and
inside writes) and resumed each time ends with the uninterrupted run hash; after every kill its
checkpoints load and its ledger's complete lines verify. The soak itself runs >= 50 kills."""
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_short_soak():
    r = subprocess.run([str(ROOT / "scripts" / "soak.sh"), "--trials", "6", "--steps", "6", "--seed", "3"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "6 kills (" in r.stdout and "PROBLEM" not in r.stdout
    m = re.search(r"(\d+) runs finished after them, (\d+) with the uninterrupted run hash", r.stdout)
    assert m and int(m.group(1)) >= 1 and m.group(1) == m.group(2), r.stdout
