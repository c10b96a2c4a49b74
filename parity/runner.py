"""Run every case of the selected ops on every selected backend and compare the outputs bit for
bit (uint views). The first backend is the reference; each other backend is compared with it."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from . import backends as _bk
from .cases import OPS, SCALAR_OPS, Case, execute, make_case

NAN32 = np.uint32(0x7FC00000)


# ------------------------------------------------------------------------- normalizing outputs
def to_numpy(x) -> np.ndarray | None:
    """Any backend output as a numpy array: numpy, CuPy (.get()), MLX / DLPack / buffer
    protocol arrays, Python and numpy scalars; None stays None."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (float, np.floating)):
        return np.asarray(np.float32(x))
    if isinstance(x, (int, np.integer)):
        return np.asarray(x)
    get = getattr(x, "get", None)          # cupy.ndarray
    if callable(get) and type(x).__module__.startswith("cupy"):
        return np.asarray(get())
    return np.asarray(x)                    # mx.array and others implement __array__ / buffers


def _uint_view(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype.kind in "fiub" and a.dtype.itemsize in (1, 2, 4, 8):
        return a.view(f"u{a.dtype.itemsize}")
    return a


def _canon_nan(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float32:
        u = a.view(np.uint32).copy()
        u[np.isnan(a)] = NAN32
        return u.view(np.float32)
    return a


def show(a: np.ndarray, idx) -> tuple[float | int, str]:
    """(value, hex) of one element; uint16 arrays are bf16 by the API's convention."""
    v = a[idx]
    if a.dtype == np.uint16:
        return float(np.uint32(int(v) << 16).view(np.float32)), f"0x{int(v):04x}"
    if a.dtype == np.float32:
        return float(v), f"0x{int(np.float32(v).view(np.uint32)):08x}"
    if a.dtype.kind in "iu":
        return int(v), f"0x{int(v) & ((1 << (8 * a.dtype.itemsize)) - 1):0{2 * a.dtype.itemsize}x}"
    return float(v), "?"


def compare_outputs(ref: np.ndarray | None, got: np.ndarray | None) -> dict | None:
    """None when bit-identical, else what differs: kind, index, both values, count."""
    if ref is None and got is None:
        return None
    if ref is None or got is None:
        return {"kind": "none", "detail": f"reference {'None' if ref is None else 'array'}, "
                                          f"backend {'None' if got is None else 'array'}"}
    if ref.shape != got.shape:
        return {"kind": "shape", "detail": f"shape {got.shape} vs reference {ref.shape}"}
    if ref.dtype != got.dtype:
        return {"kind": "dtype", "detail": f"dtype {got.dtype} vs reference {ref.dtype}"}
    ua, ub = _uint_view(ref), _uint_view(got)
    diff = ua != ub
    n = int(np.count_nonzero(diff))
    if not n:
        return None
    flat = int(np.argmax(diff.reshape(-1)))
    idx = tuple(int(i) for i in np.unravel_index(flat, ref.shape)) if ref.ndim else ()
    rv, rh = show(ref, idx)
    gv, gh = show(got, idx)
    return {"kind": "value", "index": list(idx), "ref_value": rv, "ref_hex": rh, "value": gv, "hex": gh,
            "count": n, "size": int(ref.size)}


def normalize(op: str, raw: Sequence) -> list[np.ndarray | None]:
    out = []
    for x in raw:
        a = to_numpy(x)
        if a is not None and op in SCALAR_OPS:
            a = _canon_nan(np.asarray(a))
        out.append(a)
    return out


# ------------------------------------------------------------------------- report
@dataclasses.dataclass
class OpResult:
    op: str
    cases: int = 0
    mismatches: int = 0          # cases where some backend differs from the reference (or raised)
    errors: int = 0              # of those, cases where some backend raised
    missing: list = dataclasses.field(default_factory=list)   # backends without this op: not compared
    first: dict | None = None    # the first mismatch
    seconds: dict = dataclasses.field(default_factory=dict)   # backend -> seconds in the op

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Report:
    backends: list
    seed: int
    cases_per_op: int
    ops: dict                    # op -> OpResult
    seconds: float = 0.0

    @property
    def reference(self) -> str:
        return self.backends[0]

    @property
    def total_cases(self) -> int:
        return sum(r.cases for r in self.ops.values())

    @property
    def total_mismatches(self) -> int:
        return sum(r.mismatches for r in self.ops.values())

    @property
    def missing(self) -> dict:
        """op -> backends that have no function for it (reported, not compared, not a mismatch)."""
        return {op: list(r.missing) for op, r in self.ops.items() if r.missing}

    @property
    def ok(self) -> bool:
        """No mismatch among the ops every backend has (see `missing` and `complete`)."""
        return self.total_mismatches == 0

    @property
    def complete(self) -> bool:
        """ok, and every backend had every op."""
        return self.ok and not self.missing

    def to_json(self) -> dict:
        return {"backends": self.backends, "reference": self.reference, "seed": self.seed,
                "cases_per_op": self.cases_per_op, "seconds": self.seconds,
                "total_cases": self.total_cases, "total_mismatches": self.total_mismatches,
                "missing": self.missing,
                "ops": {k: v.to_json() for k, v in self.ops.items()}}


def _resolve_backends(backends) -> list[tuple[str, Any]]:
    if isinstance(backends, dict):
        return list(backends.items())
    out = []
    for b in backends:
        if isinstance(b, tuple):
            out.append(b)
        else:
            out.append((b, _bk.load(b)))
    return out


def run_case(case: Case, bks: list[tuple[str, Any]], res: OpResult) -> dict | None:
    """Run one case on every backend that has the op; update res; return the case's first mismatch
    (or None). When the reference or every other backend lacks the op, nothing runs."""
    outs: dict[str, Any] = {}
    present = []
    for name, b in bks:
        fn = _bk.resolve(b, case.op)
        if fn is None:          # not implemented there (yet): reported as missing, not compared
            if name not in res.missing:
                res.missing.append(name)
            continue
        present.append((name, b, fn))
    res.cases += 1
    if len(present) < 2 or present[0][0] != bks[0][0]:
        return None             # nothing to compare (the reference or every other backend lacks the op): not run
    for name, b, fn in present:
        t0 = time.perf_counter()
        try:
            outs[name] = normalize(case.op, execute(fn, case))
        except Exception as e:   # noqa: BLE001 - a failing backend is a reported mismatch
            outs[name] = e
        res.seconds[name] = res.seconds.get(name, 0.0) + time.perf_counter() - t0
    bks = [(name, b) for name, b, _ in present]
    ref_name = bks[0][0]
    ref = outs[ref_name]
    first = None
    errored = False
    base = {"op": case.op, "case": case.index, "seed": f"0x{case.seed:016x}", "desc": case.desc,
            "reference": ref_name}
    if isinstance(ref, Exception):
        errored = True
        first = dict(base, backend=ref_name, kind="error", output=None,
                     detail=f"{type(ref).__name__}: {ref}")
    else:
        for name, _ in bks[1:]:
            got = outs[name]
            if isinstance(got, Exception):
                errored = True
                first = first or dict(base, backend=name, kind="error", output=None,
                                      detail=f"{type(got).__name__}: {got}")
                continue
            for oname, r, g in zip(case.outputs, ref, got):
                d = compare_outputs(r, g)
                if d is not None:
                    first = first or dict(base, backend=name, output=oname, **d)
    if first is not None:
        res.mismatches += 1
        res.errors += errored
        if res.first is None:
            res.first = first
    return first


def run(backends: Iterable = ("cpu_ref", "spec"), ops: Sequence[str] | None = None, cases: int = 8,
        seed: int = 0, progress: Callable[[str, OpResult], None] | None = None) -> Report:
    """Every case of every op on every backend; the first backend is the reference.

    backends: names (resolved through the registry), (name, object) pairs, or {name: object}."""
    bks = _resolve_backends(backends)
    if len(bks) < 1:
        raise ValueError("backends: need at least one backend")
    ops = list(OPS if ops is None else ops)
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise KeyError(f"unknown op(s): {', '.join(unknown)}")
    t0 = time.perf_counter()
    report = Report(backends=[n for n, _ in bks], seed=int(seed), cases_per_op=int(cases), ops={})
    for op in ops:
        res = OpResult(op)
        for i in range(int(cases)):
            run_case(make_case(op, i, seed), bks, res)
        report.ops[op] = res
        if progress:
            progress(op, res)
    report.seconds = time.perf_counter() - t0
    return report


# ------------------------------------------------------------------------- table
def describe_mismatch(m: dict) -> str:
    where = f"case {m['case']} (seed {m['seed']}; {m['desc']})"
    if m["kind"] == "error":
        return f"{where}: {m['backend']} raised {m['detail']}"
    if m["kind"] == "value":
        idx = ", ".join(str(i) for i in m["index"])
        return (f"{where}: {m['output']}[{idx}] {m['backend']} {m['value']!r} ({m['hex']}) vs "
                f"{m['reference']} {m['ref_value']!r} ({m['ref_hex']}); {m['count']} of {m['size']} elements differ")
    return f"{where}: {m['output']}: {m['backend']} {m['detail']}"


def format_table(report: Report) -> str:
    others = ", ".join(report.backends[1:]) or "(nothing: one backend)"
    lines = [f"parity: {report.reference} (reference) vs {others}; {report.cases_per_op} cases per op, "
             f"seed {report.seed}"]
    w = max([len(o) for o in report.ops] + [2])
    bcols = report.backends
    head = f"{'op':<{w}}  {'cases':>5}  {'mismatch':>8}  " + "  ".join(f"{b[:10]:>10}" for b in bcols) + "  first mismatch"
    lines += [head, "-" * len(head)]
    for op, r in report.ops.items():
        secs = "  ".join(f"{r.seconds.get(b, 0.0):>9.2f}s" for b in bcols)
        first = describe_mismatch(r.first) if r.first else "-"
        if r.missing:
            first = f"MISSING on {', '.join(r.missing)} (not compared); " + first
        lines.append(f"{op:<{w}}  {r.cases:>5}  {r.mismatches:>8}  {secs}  {first}")
    lines.append("-" * len(head))
    bad = [op for op, r in report.ops.items() if r.mismatches]
    lines.append(f"total: {len(report.ops)} ops, {report.total_cases} cases, {report.total_mismatches} mismatching "
                 f"cases{' in ' + ', '.join(bad) if bad else ''} ({report.seconds:.1f} s)")
    miss = report.missing
    if miss:
        by_backend: dict = {}
        for op, names in miss.items():
            for n in names:
                by_backend.setdefault(n, []).append(op)
        for n, ops_ in by_backend.items():
            lines.append(f"missing: {n} has no {', '.join(ops_)} ({len(ops_)} op{'s' * (len(ops_) != 1)} "
                         "not compared)")
    if report.ok:
        lines.append("PASS: bit-identical" + (" on the ops every backend has (some ops MISSING, see above)"
                                              if miss else ""))
    else:
        lines.append("FAIL: outputs differ")
    return "\n".join(lines)
