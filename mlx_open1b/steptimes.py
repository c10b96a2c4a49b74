"""Wall-clock step times, kept beside the ledger (RUN/timing.jsonl), never in it.

The ledger holds only what the run computes, so that equal runs have byte-identical ledgers; how
long a step took depends on the machine and the moment, so it is written here instead, one line
per step by the run's writer:

    {"step": t, "seconds": s, "tokens": n}

s: wall-clock seconds of step t in the writer, from the start of its computation to its ledger
record (and its checkpoint and held-out evaluation, when due) being written; n: the tokens of the
step. Nothing hashes, audits or replays this file; the report reads it for the median step time,
the training time and tokens/s.

A resumed run appends the steps it computes again: a step's last line is its time. Each line is
one write without fsync (a line lost in a crash costs a point of a figure, never a bit of the run);
an incomplete last line (a crash mid-write) is cut off by the next writer and skipped by readers.
A failed write (full disk) stops the recording with one warning and never stops training.
"""
from __future__ import annotations

import json
import pathlib

from .fsutil import WriteError, append_unsynced

TIMING_FILE = "timing.jsonl"


class StepTimes:
    """The writer's side: append(step, seconds, tokens), one line each."""

    def __init__(self, path, log=None):
        self.path = pathlib.Path(path)
        self.log = log or (lambda msg: None)
        self.failed = False
        self._opened = False

    def append(self, step: int, seconds: float, tokens: int) -> None:
        if self.failed:
            return
        line = json.dumps({"step": int(step), "seconds": round(float(seconds), 6), "tokens": int(tokens)},
                          separators=(",", ":")) + "\n"
        try:
            append_unsynced(self.path, line.encode("ascii"), cut_incomplete=not self._opened)
            self._opened = True
        except WriteError as e:
            self.failed = True
            self.log(f"warning: {e}; step times are no longer recorded (training goes on: they are not part of "
                     f"the run)")


def read_step_times(path, error) -> dict[int, float]:
    """{step: seconds} from a timing file (TIMING_FILE, or a user's metrics.jsonl of the same form:
    {"step": t, "seconds": s} per line); a step's last line wins. An incomplete last line is skipped;
    any other line that is not such an object raises `error` naming the file and the line."""
    path = pathlib.Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot be read as text ({e}); delete it to report without step times") from None
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]               # cut short by a crash mid-write (or empty)
    out = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            m = json.loads(line)
            step, seconds = m["step"], m["seconds"]
            ok = (isinstance(step, int) and not isinstance(step, bool) and isinstance(seconds, (int, float))
                  and not isinstance(seconds, bool) and seconds >= 0)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise error(f"{path}: line {i}: expected {{\"step\": t, \"seconds\": s}} ({e})") from None
        if not ok:
            raise error(f"{path}: line {i}: expected {{\"step\": t, \"seconds\": s}} with an integer step and "
                        f"seconds >= 0, got {line[:80]!r}")
        out[step] = float(seconds)
    return out
