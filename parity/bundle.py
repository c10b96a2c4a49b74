"""Parity bundles: what one machine computes, in a file another machine can compare with.

A bundle (JSON) holds the contract and package versions, machine and library information, for
every op and case the case seed, the SHA-256 of the case's inputs and of every output, and the
ledger of a short training run (the tiny preset on the embedded default corpus). Two bundles
from different machines agree iff every output and every ledger record is bit-identical.
`bundle_sha256` (SHA-256 of the canonical JSON of the rest) shows edits made after export.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import pathlib
import platform
import tempfile
from typing import Callable, Sequence

import numpy as np

from mlx_open1b import __version__
from mlx_open1b.config import preset
from mlx_open1b.contract import CONTRACT_VERSION
from mlx_open1b.data.corpus import default_sources
from mlx_open1b.data.prepare import prepare
from mlx_open1b.data.tokenizer import Tokenizer
from mlx_open1b.fsutil import write_json_atomic
from mlx_open1b.train import Trainer
from . import backends as _bk
from .cases import OPS, make_case, execute
from .runner import normalize

FORMAT = "open1b-parity-bundle/1"
TRAIN_BACKENDS = ("cpu_ref", "metal", "cuda")


class BundleError(ValueError):
    """A file that is not a readable parity bundle."""


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def array_hash(a: np.ndarray | None) -> str | None:
    """SHA-256 of dtype, shape and the little-endian bytes (row-major) of one output."""
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    le = a.astype(a.dtype.newbyteorder("<"), copy=False)
    h = hashlib.sha256(f"{le.dtype.str}|{list(a.shape)}|".encode())
    h.update(le.tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------- machine info
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_info() -> dict:
    info = {}
    try:
        cp = importlib.import_module("cupy")
        n = cp.cuda.runtime.getDeviceCount()
        info["cuda"] = [cp.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(n)]
        info["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
        info["cuda_driver"] = cp.cuda.runtime.driverGetVersion()
    except Exception:   # noqa: BLE001 - no CuPy or no driver: nothing to report
        pass
    try:
        mx = importlib.import_module("mlx.core")
        if mx.metal.is_available():
            info["metal"] = dict(mx.metal.device_info())
    except Exception:   # noqa: BLE001
        pass
    return json.loads(json.dumps(info, default=str))


def machine_info(backend: str | None = None) -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "cpu": _cpu_model(),
            "python": platform.python_version(),
            "libraries": {d: _version(d) for d in ("numpy", "click", "mlx", "cupy-cuda12x", "cupy-cuda11x", "cupy",
                                                    "torch")},
            "gpu": _gpu_info()}
    try:                          # a machine without the built C reference still describes itself
        from mlx_open1b import cpu_ref
        info["cpu_ref"] = {"simd": cpu_ref.simd_name(), "threads": cpu_ref.get_num_threads()}
    except ImportError:
        pass
    if backend:
        info["backend_detail"] = next((d for n, ok, d in _bk.status() if n == backend), None)
    return info


# ------------------------------------------------------------------------- export
def op_hashes(backend_obj, ops: Sequence[str], cases: int, seed: int, progress=None) -> dict:
    out = {}
    for op in ops:
        fn = _bk.resolve(backend_obj, op)
        rows = []
        for i in range(cases):
            c = make_case(op, i, seed)
            row = {"case": i, "seed": f"0x{c.seed:016x}", "desc": c.desc, "inputs": c.input_hash()}
            try:
                if fn is None:
                    raise NotImplementedError(f"the backend has no function {op!r}")
                outs = normalize(op, execute(fn, c))
                row["outputs"] = {name: array_hash(a) for name, a in zip(c.outputs, outs)}
            except Exception as e:   # noqa: BLE001 - recorded; compare reports it
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
        out[op] = rows
        if progress:
            progress(op)
    return out


@contextlib.contextmanager
def temp_trainer(backend: str, data_dir=None, log: Callable[[str], None] | None = None, train_log=None,
                 preset_name: str = "tiny"):
    """A Trainer of a preset (tiny) on `backend` in a temporary run directory, on the embedded
    default corpus (prepared into a temporary directory unless data_dir is given); `train_log`
    gets the trainer's progress lines (default: `log`)."""
    log = log or (lambda m: None)
    with tempfile.TemporaryDirectory(prefix="open1b-tiny-") as tmp:
        tmp = pathlib.Path(tmp)
        if data_dir is None:
            log("preparing the embedded default corpus (~10 s)")
            data_dir = tmp / "data"
            prepare(default_sources(), data_dir, Tokenizer.load(None))
        yield Trainer(tmp / "run", preset(preset_name), data_dir, backend=backend, log=train_log or log)


def train_ledger(backend: str, steps: int, data_dir=None, log: Callable[[str], None] | None = None) -> dict:
    """The tiny preset trained for `steps` steps on `backend` (temp_trainer)."""
    with temp_trainer(backend, data_dir, log) as tr:
        run_hash = tr.train(int(steps))
        ledger = tr.rundir.records()
    return {"preset": "tiny", "steps": int(steps), "backend": backend, "genesis": tr.genesis,
            "run_hash": run_hash, "ledger": ledger}


def export(path, backend: str = "cpu_ref", cases: int = 8, steps: int = 3, seed: int = 0,
           ops: Sequence[str] | None = None, data_dir=None, log: Callable[[str], None] | None = None) -> dict:
    """Compute a bundle on `backend` and write it atomically to `path`; returns it."""
    ops = list(OPS if ops is None else ops)
    b = _bk.load(backend)
    if steps and backend not in TRAIN_BACKENDS:
        raise _bk.BackendUnavailable(f"backend {backend!r} cannot train (training runs on "
                                     f"{', '.join(TRAIN_BACKENDS)}); use --steps 0")
    bundle = {"format": FORMAT, "contract_version": CONTRACT_VERSION, "package_version": __version__,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "backend": backend, "seed": int(seed), "cases_per_op": int(cases),
              "machine": machine_info(backend),
              "ops": op_hashes(b, ops, int(cases), int(seed), progress=(lambda op: log and log(f"hashed {op}"))),
              "training": train_ledger(backend, steps, data_dir, log) if steps else None}
    bundle["bundle_sha256"] = hashlib.sha256(canonical(bundle)).hexdigest()
    write_json_atomic(path, bundle)
    return bundle


# ------------------------------------------------------------------------- load and compare
def load(path) -> dict:
    try:
        d = json.loads(pathlib.Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise BundleError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise BundleError(f"{path}: not a parity bundle (format {d.get('format') if isinstance(d, dict) else None!r}, "
                          f"expected {FORMAT!r})")
    for key in ("contract_version", "ops"):
        if key not in d:
            raise BundleError(f"{path}: malformed bundle (no {key!r})")
    _check_shape(path, d)
    return d


def _check_shape(path, d: dict) -> None:
    """BundleError naming the field of a bundle whose structure compare() cannot read: ops is
    {op: [case, ...]} with each case an object with an integer "case" (outputs an object of
    strings, error a string); training is null or an object with a list of record objects."""
    def bad(where, what):
        raise BundleError(f"{path}: malformed bundle ({where}: {what})")
    if not isinstance(d["ops"], dict):
        bad("ops", "not an object")
    for op, cases in d["ops"].items():
        if not isinstance(cases, list):
            bad(f"ops.{op}", "not a list of cases")
        for i, c in enumerate(cases):
            if not isinstance(c, dict) or not isinstance(c.get("case"), int) or isinstance(c.get("case"), bool):
                bad(f"ops.{op}[{i}]", "not a case with an integer \"case\"")
            outs = c.get("outputs", {})
            if not isinstance(outs, dict) or not all(isinstance(v, (str, type(None))) for v in outs.values()):
                bad(f"ops.{op}[{i}].outputs", "not an object of hashes")
            for k in ("seed", "inputs", "desc", "error"):
                if isinstance(c.get(k), (dict, list)):
                    bad(f"ops.{op}[{i}].{k}", "not a scalar")
    t = d.get("training")
    if t is not None:
        if not isinstance(t, dict) or not isinstance(t.get("ledger", []), list) \
                or not all(isinstance(r, dict) for r in t.get("ledger", [])):
            bad("training", "not an object with a list of ledger records")
        if not isinstance(t.get("steps"), (int, type(None))) or isinstance(t.get("steps"), bool):
            bad("training.steps", "not an integer")


def intact(bundle: dict) -> bool:
    rest = {k: v for k, v in bundle.items() if k != "bundle_sha256"}
    return hashlib.sha256(canonical(rest)).hexdigest() == bundle.get("bundle_sha256")


def flat_items(d, prefix=""):
    """(dotted key, value) of every leaf of nested dicts, keys sorted."""
    if isinstance(d, dict):
        for k in sorted(d):
            yield from flat_items(d[k], f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, d


def _short(h) -> str:
    return "none" if h is None else str(h)[:16] + "…"


class Comparison:
    """Result of compare(a, b): .contract_mismatch (exit 2), .differences (exit 1), .lines;
    .not_compared: what one bundle has and the other did not run (not a difference)."""

    def __init__(self):
        self.contract_mismatch = None
        self.differences: list[dict] = []
        self.not_compared: list[str] = []
        self.notes: list[str] = []
        self.cases = self.identical_cases = 0
        self.per_op: dict[str, int] = {}
        self.ledger_records = 0

    @property
    def identical(self) -> bool:
        return not self.contract_mismatch and not self.differences

    @property
    def exit_code(self) -> int:
        return 2 if self.contract_mismatch else (1 if self.differences else 0)


def _describe(b: dict) -> str:
    def obj(d, key):                  # a bundle is read before it is trusted: any JSON value may stand here
        return d.get(key) if isinstance(d.get(key), dict) else {}
    m = obj(b, "machine")
    gpu = obj(m, "gpu")
    cuda = gpu.get("cuda") if isinstance(gpu.get("cuda"), list) else []
    dev = ", ".join(map(str, cuda)) or str(obj(gpu, "metal").get("device_name") or "")
    return (f"{b.get('backend')} on {m.get('platform', '?')} ({m.get('cpu', '?')}{'; ' + dev if dev else ''}), "
            f"open1b {b.get('package_version')}, contract v{b.get('contract_version')}, {b.get('created', '?')}")


def compare(a: dict, b: dict, names=("A", "B")) -> Comparison:
    r = Comparison()
    na, nb = names
    if a.get("contract_version") != b.get("contract_version"):
        r.contract_mismatch = (f"the bundles were made under different arithmetic contracts: {na} v{a.get('contract_version')}, "
                               f"{nb} v{b.get('contract_version')}; their results are not expected to agree and are not compared")
        return r
    for n, x in zip(names, (a, b)):
        if not intact(x):
            r.notes.append(f"warning: bundle {n} was edited after export (its bundle_sha256 does not match its content)")
            r.differences.append({"where": "bundle", "detail": f"bundle {n} was edited after export"})
    if a.get("seed") != b.get("seed"):
        r.notes.append(f"note: different case seeds ({na} {a.get('seed')}, {nb} {b.get('seed')}): the cases are not the same")
    oa, ob = a["ops"], b["ops"]
    # A row one bundle has and the other did not run (an op it was not asked for, such as a
    # selftest bundle's edge cases, or a case index at or beyond its cases_per_op) is not compared;
    # a row missing from a bundle that ran that op and that many cases is a difference.
    for n, ops in ((na, [o for o in oa if o not in ob]), (nb, [o for o in ob if o not in oa])):
        if ops:
            r.not_compared.append(f"{len(ops)} op{'s' * (len(ops) > 1)} only in {n} ({', '.join(ops[:3])}"
                                  f"{', …' if len(ops) > 3 else ''})")
    beyond = [0, 0]
    for op in [o for o in oa if o in ob]:
        ca, cb = {c["case"]: c for c in oa[op]}, {c["case"]: c for c in ob[op]}
        for side, (mine, other, n_mine, n_other, ran) in enumerate(((ca, cb, na, nb, b.get("cases_per_op")),
                                                                  (cb, ca, nb, na, a.get("cases_per_op")))):
            for i in sorted(set(mine) - set(other), key=str):
                if isinstance(ran, int) and isinstance(i, int) and i >= ran:
                    beyond[side] += 1
                else:
                    r.differences.append({"where": "op", "op": op, "detail": f"{op}: case {i} is in {n_mine}, "
                                                                             f"missing from {n_other}"})
        for i in sorted(set(ca) & set(cb)):
            x, y = ca[i], cb[i]
            r.cases += 1
            d = None
            base = {"where": "case", "op": op, "case": i, "seed": x.get("seed"), "desc": x.get("desc", "")}
            if x.get("seed") != y.get("seed"):
                d = dict(base, detail=f"different case seeds ({x.get('seed')} vs {y.get('seed')})")
            elif x.get("inputs") != y.get("inputs"):
                d = dict(base, detail=f"the inputs differ (sha256 {_short(x.get('inputs'))} vs {_short(y.get('inputs'))}): "
                                      "the case generators differ between the two installs")
            elif "error" in x or "error" in y:
                if x.get("error") != y.get("error"):
                    d = dict(base, detail=f"{na}: {x.get('error', 'ok')}; {nb}: {y.get('error', 'ok')}")
            else:
                xo, yo = x.get("outputs", {}), y.get("outputs", {})
                for name in list(xo) + [k for k in yo if k not in xo]:
                    if xo.get(name, "missing") != yo.get(name, "missing"):
                        d = dict(base, output=name, detail=f"output {name!r} sha256 {_short(xo.get(name))} ({na}) vs "
                                                           f"{_short(yo.get(name))} ({nb})")
                        break
            if d:
                r.differences.append(d)
                r.per_op[op] = r.per_op.get(op, 0) + 1
            else:
                r.identical_cases += 1
    for n, k in zip(names, beyond):
        if k:
            r.not_compared.append(f"{k} case{'s' * (k > 1)} only in {n} (beyond the other bundle's cases per op)")
    ta, tb = a.get("training"), b.get("training")
    if ta is None or tb is None:
        if ta is not None or tb is not None:
            r.not_compared.append(f"the training ledger, only in {na if ta else nb}")
    else:
        la, lb = ta.get("ledger", []), tb.get("ledger", [])
        if ta.get("genesis") != tb.get("genesis"):
            r.notes.append("note: the runs' genesis hashes differ (configuration, corpus or tokenizer differ)")
        for k, (x, y) in enumerate(zip(la, lb)):
            r.ledger_records += 1
            if x != y:
                fx, fy = dict(flat_items(x)), dict(flat_items(y))
                fields = [f for f in list(fx) + [f for f in fy if f not in fx]
                          if f not in ("hash", "prev") and fx.get(f, "missing") != fy.get(f, "missing")]
                field = fields[0] if fields else ("prev" if fx.get("prev") != fy.get("prev") else "hash")
                r.differences.append({"where": "ledger", "record": k, "step": x.get("step"), "field": field,
                                      "detail": f"ledger record {k} (step {x.get('step')}): {field} "
                                                f"{fx.get(field)!r} ({na}) vs {fy.get(field)!r} ({nb})"
                                                + (f"; also {', '.join(fields[1:4])}" if len(fields) > 1 else "")})
                break
        if len(la) != len(lb):
            short_n, short_t, short_l = (na, ta, la) if len(la) < len(lb) else (nb, tb, lb)
            if short_t.get("steps") == len(short_l):         # it trained fewer steps: the rest was not run
                r.not_compared.append(f"ledger records {len(short_l)}-{max(len(la), len(lb)) - 1}, only in "
                                      f"{nb if short_t is ta else na} ({short_n} trained {len(short_l)} steps)")
            else:
                r.differences.append({"where": "ledger", "detail": f"ledger lengths differ: {len(la)} records "
                                                                    f"({na}), {len(lb)} ({nb}); {short_n} says it "
                                                                    f"trained {short_t.get('steps')} steps"})
    if not r.cases and not r.ledger_records and not r.differences:
        r.differences.append({"where": "bundle", "detail": "the bundles have no case and no ledger record in common: "
                                                           "nothing was compared"})
    return r


def format_comparison(r: Comparison, a: dict, b: dict, names=("A", "B")) -> str:
    lines = [f"{names[0]}: {_describe(a)}", f"{names[1]}: {_describe(b)}"]
    if r.contract_mismatch:
        lines.append(f"error: {r.contract_mismatch}")
        return "\n".join(lines)
    lines += r.notes
    differing = sum(r.per_op.values())
    ops_line = f"ops: {len(set(a['ops']) & set(b['ops']))} compared, {r.cases} cases: {r.identical_cases} identical"
    if differing:
        ops_line += f", {differing} differ (" + ", ".join(f"{o}: {n}" for o, n in r.per_op.items()) + ")"
    lines.append(ops_line)
    if r.not_compared:
        lines.append("not compared (run by one bundle only): " + "; ".join(r.not_compared))
    ta, tb = a.get("training"), b.get("training")
    led = [d for d in r.differences if d["where"] == "ledger"]
    if ta and tb:
        lines.append(f"ledger: {r.ledger_records} records compared (tiny preset, {ta.get('steps')} steps on "
                     f"{ta.get('backend')} vs {tb.get('backend')}): "
                     + ("identical, run hash " + str(ta.get("run_hash")) if not led else "DIFFERENT: " + led[0]["detail"]))
    else:
        lines.append("ledger: " + ("-" if not led else led[0]["detail"]))
    if r.differences:
        first = next((d for d in r.differences if d["where"] == "case"), r.differences[0])
        where = (f"{first['op']} case {first['case']} (seed {first['seed']}; {first['desc']}): "
                 if first["where"] == "case" else "")
        lines.append(f"first difference: {where}{first['detail']}")
        lines.append(f"result: DIFFERENT ({len(r.differences)} difference(s))")
    else:
        lines.append("result: IDENTICAL")
    return "\n".join(lines)
