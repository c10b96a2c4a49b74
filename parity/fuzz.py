"""Parity fuzzing: the parity cases (cases.py: shapes that are multiples of no tile size, single
rows, special values at a rate set by the case index, bit patterns from Philox) drawn for as long
as asked, each op's next case going to the op that has had the least time so far (every op gets
the same time; a cheap op many more cases than an attention), each run on every backend and
compared bit for bit with the first (runner.run_case). A mismatch is kept with what
reproduces it: the op, the base seed and the case index (`open1b parity run --ops OP --seed S
--cases INDEX+1` runs it again, as case INDEX)."""
from __future__ import annotations

import dataclasses
import heapq
import time
from typing import Any, Callable, Sequence

from .cases import OPS, make_case
from .runner import OpResult, _resolve_backends, describe_mismatch, run_case


@dataclasses.dataclass
class FuzzReport:
    backends: list
    seed: int
    seconds: float
    ops: dict                               # op -> OpResult
    mismatches: list                        # every mismatch (up to the limit), each with "reproduce"

    @property
    def cases(self) -> int:
        return sum(r.cases for r in self.ops.values())

    @property
    def ok(self) -> bool:
        return not any(r.mismatches for r in self.ops.values())

    def to_json(self) -> dict:
        return {"backends": self.backends, "seed": self.seed, "seconds": self.seconds, "cases": self.cases,
                "ops": {k: v.to_json() for k, v in self.ops.items()}, "mismatches": self.mismatches}


def fuzz(backends, ops: Sequence[str] | None, seconds: float, seed: int = 0, keep: int = 100,
         progress: Callable[[FuzzReport], None] | None = None, every: float = 10.0) -> FuzzReport:
    """Run cases 0, 1, 2, ... of every op in turn until `seconds` have passed; the first backend
    is the reference. keep: mismatches kept in full (all are counted). progress(report) every
    `every` seconds."""
    bks: list[tuple[str, Any]] = _resolve_backends(backends)
    if len(bks) < 2:
        raise ValueError("backends: need at least two to compare")
    ops = list(OPS if ops is None else ops)
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise KeyError(f"unknown op(s): {', '.join(unknown)}")
    rep = FuzzReport([n for n, _ in bks], int(seed), 0.0, {op: OpResult(op) for op in ops}, [])
    t0 = last = time.perf_counter()
    spent = [(0.0, k) for k in range(len(ops))]          # (seconds on the op, its position): a heap
    while True:
        took, k = heapq.heappop(spent)
        op = ops[k]
        res = rep.ops[op]
        index = res.cases
        t = time.perf_counter()
        m = run_case(make_case(op, index, seed), bks, res)
        now = time.perf_counter()
        heapq.heappush(spent, (took + (now - t), k))
        if m is not None and len(rep.mismatches) < keep:
            rep.mismatches.append(dict(m, reproduce=f"open1b parity run --backends {','.join(rep.backends)} "
                                                    f"--ops {op} --seed {seed} --cases {index + 1}"))
        rep.seconds = now - t0
        if progress and now - last >= every:
            last = now
            progress(rep)
        if rep.seconds >= seconds:
            return rep


def format_fuzz(rep: FuzzReport) -> str:
    lines = [f"parity fuzz: {rep.backends[0]} (reference) vs {', '.join(rep.backends[1:])}; seed {rep.seed}; "
             f"{rep.cases} cases in {rep.seconds:.0f} s ({rep.cases / rep.seconds if rep.seconds else 0:.1f} cases/s)",
             f"  {'op':28s} {'cases':>8s} {'cases/s':>8s} {'mismatch':>8s}  not compared"]
    for op, r in rep.ops.items():
        lines.append(f"  {op:28s} {r.cases:8d} {r.cases / rep.seconds if rep.seconds else 0:8.1f} "
                     f"{r.mismatches:8d}  {', '.join(r.missing) or '-'}")
    for m in rep.mismatches:
        lines.append(f"MISMATCH {m['op']}: {describe_mismatch(m)}\n  reproduce: {m['reproduce']}")
    lines.append("no mismatch" if rep.ok else
                 f"{sum(r.mismatches for r in rep.ops.values())} mismatching cases")
    return "\n".join(lines)
