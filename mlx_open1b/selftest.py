"""Prove a backend against the golden known answers (mlx_open1b/golden): `open1b selftest` and the
first-contact check that runs before a command trains or replays on a real Metal or CUDA device.

`run_backend(name, golden, full)` runs the golden cases on one backend and compares every output's
SHA-256 with the recorded one: the quick set (QUICK_INDICES of every op plus every edge case,
seconds on a GPU) or, with full, every case and the first golden.STEPS training steps (compared
record by record). A differing output is located to its first differing element by recomputing
the case on cpu_ref (or the numpy spec) when that reproduces the golden digest.

`first_contact(requested)` is the one place the CLI's --backend option goes through: for a real
device it runs the quick set unless a pass is cached for exactly this device, OS, driver, library,
package, contract and golden file ($XDG_CACHE_HOME/mlx-open1b/selftest/); on a mismatch it falls
back to cpu_ref under --backend auto and refuses (SelftestRefused) under an explicit --backend.
Whether a backend is real hardware is decided by `on_hardware`; tests treat an emulated backend
as hardware with `assume_hardware(...)`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import re
import time
from typing import Callable

from . import __version__, cpu_ref
from .backend import on_device, resolve as resolve_backend
from .contract import CONTRACT_VERSION
from .cuda import runtime as cuda_runtime
from .data.format import DataError
from .errors import Open1bError
from . import golden as _golden
from .fsutil import write_json_atomic
from .metal import runtime as metal_runtime
from .parity import backends as parity_backends
from .parity.bundle import FORMAT as BUNDLE_FORMAT, array_hash, canonical, flat_items, machine_info
from .parity.cases import execute
from .parity.runner import compare_outputs, normalize
from .train import TrainError

# mlx, cupy and pynvml are optional (a Mac's, an NVIDIA machine's): imported inside the functions that probe them

GPU_BACKENDS = ("metal", "cuda")
ALL = ("cpu_ref", "metal", "cuda")
#: exit code of a command refused because its device failed the self-test
REFUSED_EXIT = 3


class SelftestRefused(Open1bError, RuntimeError):
    """An explicitly requested device failed the self-test; nothing was run or written."""

    exit_code = REFUSED_EXIT


# ------------------------------------------------------------------------- real hardware or not
_assumed: set = set()


def on_hardware(backend: str) -> bool:
    """Whether the GPU backend `backend` runs on a real device here (not on its CPU emulator)."""
    return backend in _assumed or (backend in GPU_BACKENDS and on_device(backend))


@contextlib.contextmanager
def assume_hardware(*backends: str):
    """Inside the block, treat these backends as real devices (they still run on their emulators):
    --backend auto picks them and the first-contact check runs. For tests."""
    old = set(_assumed)
    _assumed.update(backends)
    try:
        yield
    finally:
        _assumed.clear()
        _assumed.update(old)


def resolve(requested: str) -> str:
    """--backend's value as a backend name: 'auto' as mlx_open1b.backend.resolve, or the first
    backend assume_hardware names."""
    if requested == "auto":
        for name in GPU_BACKENDS:
            if name in _assumed:
                return name
    return resolve_backend(requested)


def describe(backend: str) -> tuple[str, str]:
    """(where it runs: 'hardware' | 'emulated' | 'CPU', what runs it)."""
    if backend == "cpu_ref":
        return "CPU", f"C reference, SIMD {cpu_ref.simd_name()}, {cpu_ref.get_num_threads()} threads"
    try:
        if backend == "metal":
            detail = metal_runtime.available()[1]
        else:
            detail = cuda_runtime.describe()[1]
    except Exception as e:   # noqa: BLE001
        detail = f"{type(e).__name__}: {e}"
    if backend in _assumed:
        return "hardware", f"{detail} [treated as hardware by assume_hardware]"
    return ("hardware" if on_hardware(backend) else "emulated"), detail


# ------------------------------------------------------------------------- results
@dataclasses.dataclass
class OpLine:
    op: str
    cases: int = 0               # cases compared
    failed: int = 0
    first: dict | None = None    # the first failing case (see describe_failure)
    seconds: float = 0.0         # in the backend's functions
    not_run: str | None = None


@dataclasses.dataclass
class BackendReport:
    backend: str
    where: str = "-"
    device: str = ""
    not_run: str | None = None
    ops: dict = dataclasses.field(default_factory=dict)       # op -> OpLine, in the golden file's order
    rows: dict = dataclasses.field(default_factory=dict)      # parity-bundle rows: op or "edge:<name>" -> [row]
    training: dict | None = None  # {"steps", "compared", "first", "seconds", "not_run", "genesis", "records"}
    seconds: float = 0.0
    full: bool = False
    expected: int = 0             # cases selected: a report that compared fewer is not a pass

    @property
    def failed_ops(self) -> list[str]:
        return [op for op, line in self.ops.items() if line.failed]

    @property
    def training_failed(self) -> bool:
        return bool(self.training and self.training.get("first"))

    @property
    def incomplete(self) -> str | None:
        """Why this report compared fewer cases than were selected (an op the backend lacks), or
        compared nothing at all; None when every selected case was compared."""
        if self.not_run is not None:
            return None
        if self.cases < self.expected:
            why = [f"{op}: {line.not_run}" for op, line in self.ops.items()
                   if line.not_run and line.not_run != "no case selected"]
            return (f"compared {self.cases} of {self.expected} selected cases"
                    + (f" ({'; '.join(why[:3])})" if why else ""))
        if not self.cases and not (self.training and self.training.get("compared")):
            return "no case was compared"
        return None

    @property
    def verdict(self) -> str:
        if self.failed_ops or self.training_failed:
            return "DIFFERENT"
        return "INCOMPLETE" if self.incomplete else "EQUAL"

    @property
    def ok(self) -> bool:
        """Every selected case was compared and everything that ran was equal."""
        return self.not_run is None and self.verdict == "EQUAL"

    @property
    def cases(self) -> int:
        return sum(line.cases for line in self.ops.values())

    def first_failure(self) -> str | None:
        for op in self.failed_ops:
            return f"{op}: {describe_failure(self.ops[op].first)}"
        if self.training_failed:
            return f"training: {self.training['first']['detail']}"
        return self.incomplete


def _short(h) -> str:
    return "none" if h is None else str(h)[:12] + "…"


def describe_failure(f: dict) -> str:
    where = f["case"] + (f" ({f['desc']})" if f.get("desc") and not f["case"].startswith("edge/") else "")
    k = f["kind"]
    if k == "value":
        idx = ", ".join(str(i) for i in f["index"])
        return (f"{where}: {f['output']}[{idx}] = {f['value']!r} ({f['hex']}), golden {f['ref_value']!r} "
                f"({f['ref_hex']}); {f['count']} of {f['size']} elements differ")
    if k == "hash":
        return (f"{where}: output {f['output']} sha256 {_short(f['got'])}, golden {_short(f['want'])} "
                f"({f['detail']})")
    return f"{where}: {f['detail']}"


# ------------------------------------------------------------------------- running the cases
def _ref_outputs(case, reference: str, cache: dict):
    """cpu_ref's (or spec's) normalized outputs of a case, or None if it cannot run it."""
    if reference not in cache:
        try:
            fn = parity_backends.resolve(parity_backends.load(reference), case.op)
            cache[reference] = normalize(case.op, execute(fn, case))
        except Exception:   # noqa: BLE001 - no usable reference: the report stays at the digest
            cache[reference] = None
    return cache[reference]


def _locate(case, j: int, got, want: str, backend: str, cache: dict, gc=None, path=None) -> dict:
    """The first differing element of output j against a reference that reproduces the golden
    digest. When every reference that runs here computes another digest, the recorded one is not
    what this package computes: the golden file is at fault, not the device (GoldenError)."""
    ran = []
    for reference in ("cpu_ref", "spec"):
        if reference == backend:
            continue
        outs = _ref_outputs(case, reference, cache)
        if outs is None:
            continue
        ran.append(reference)
        if array_hash(outs[j]) != want:
            continue
        d = compare_outputs(outs[j], got)
        if d is None:
            break
        if d["kind"] == "value":
            return dict(d, located_by=reference)
        return {"kind": "other", "detail": f"output {case.outputs[j]}: {d['detail']}"}
    else:
        if ran and gc is not None:
            raise _golden.file_error(path, f"op {gc.op}, case {gc.key}: the digest of output {case.outputs[j]} "
                                           f"({_short(want)}) is not what {' or '.join(ran)} computes here, so the file "
                                           f"is corrupted or was made by another version of the package (not a "
                                           f"verdict on the device)")
    return {"kind": "hash", "detail": "no reference here reproduces the golden digest, so the element is not named",
            "got": None, "want": want}


def _run_case(gc, case, fn, backend: str, path=None) -> tuple[dict | None, dict, float]:
    """(failure or None, bundle row, seconds in fn); GoldenError when the golden file, not the
    backend, is at fault (its inputs or digest are not this package's)."""
    row = {"case": gc.index if gc.kind == "parity" else 0, "seed": gc.seed, "desc": gc.desc,
           "inputs": case.input_hash()}
    base = {"case": gc.key, "desc": gc.desc}
    if row["inputs"] != gc.inputs:
        raise _golden.file_error(path, f"op {gc.op}, case {gc.key}: this install generates other inputs for it "
                                       f"(sha256 {_short(row['inputs'])}, the file {_short(gc.inputs)}), so the file "
                                       f"is corrupted or was made by another version of the package (not a verdict "
                                       f"on the device)")
    t0 = time.perf_counter()
    try:
        outs = normalize(case.op, execute(fn, case))
        err = None
    except Exception as e:   # noqa: BLE001 - a raising backend is a reported failure
        outs, err = None, f"{type(e).__name__}: {e}"
    dt = time.perf_counter() - t0
    if err is not None:
        row["error"] = err
        if gc.error is not None:
            return None, row, dt
        return dict(base, kind="error", detail=f"raised {err}"), row, dt
    hashes = [array_hash(a) for a in outs]
    row["outputs"] = dict(zip(case.outputs, hashes))
    if gc.error is not None:
        return dict(base, kind="error", detail=f"returned, but the reference raised {gc.error}"), row, dt
    cache: dict = {}
    for j, (name, h) in enumerate(zip(case.outputs, hashes)):
        want = gc.outputs.get(name, "missing")
        if h != want:
            d = _locate(case, j, outs[j], want, backend, cache, gc, path)   # execute() ran on copies of the inputs
            d.setdefault("output", name)
            if d["kind"] == "hash":
                d["got"] = h
            return dict(base, **d), row, dt
    return None, row, dt


class _Cases:
    """The golden cases of one run, generated once and shared by the backends it checks."""

    def __init__(self, golden: _golden.Golden, full: bool):
        self.golden, self.selected = golden, golden.select(full)
        self._made: dict = {}

    def prepare(self, progress: Callable[[str], None] | None = None) -> None:
        """Generate every selected case now (so that no backend's time includes it)."""
        for n, gc in enumerate(self.selected, 1):
            if progress:
                progress(f"generating the cases: {n}/{len(self.selected)} ({gc.op})")
            try:
                self.case(gc)
            except Exception:   # noqa: BLE001 - run_backend reports it at the case
                pass

    def case(self, gc):
        if gc.key not in self._made:
            self._made[gc.key] = gc.make()
        return self._made[gc.key]


def run_backend(name: str, golden: _golden.Golden, full: bool = False, *, cases: _Cases | None = None,
                data_dir=None, steps: int | None = None, progress: Callable[[str], None] | None = None,
                select: Callable | None = None) -> BackendReport:
    """Check one backend against the golden set (quick, or full: every case and the training
    steps); select(golden_case) -> bool narrows the cases (tests)."""
    progress = progress or (lambda m: None)
    rep = BackendReport(name, full=full)
    t0 = time.perf_counter()
    try:
        b = parity_backends.load(name)
    except parity_backends.BackendUnavailable as e:
        rep.not_run = str(e)
        return rep
    rep.where, rep.device = describe(name)
    cases = cases or _Cases(golden, full)
    chosen = [gc for gc in cases.selected if select is None or select(gc)]
    rep.expected = len(chosen)
    for op in golden.data.get("ops", []):
        rep.ops[op] = OpLine(op)
    for n, gc in enumerate(chosen, 1):
        line = rep.ops.setdefault(gc.op, OpLine(gc.op))
        progress(f"{name}: {n}/{len(chosen)} cases ({gc.op})")
        fn = parity_backends.resolve(b, gc.op)
        if fn is None:
            line.not_run = f"{name} has no function for {gc.op}"
            continue
        try:
            case = cases.case(gc)
        except Exception as e:   # noqa: BLE001 - a golden case this install cannot build: the file's fault
            raise _golden.file_error(golden.path, f"op {gc.op}, case {gc.key}: this install cannot build it "
                                                  f"({type(e).__name__}: {e})") from None
        fail, row, dt = _run_case(gc, case, fn, name, golden.path)
        line.cases += 1
        line.seconds += dt
        rep.rows.setdefault(gc.op if gc.kind == "parity" else f"edge:{gc.name}", []).append(row)
        if fail is not None:
            line.failed += 1
            line.first = line.first or fail
    for line in rep.ops.values():
        if not line.cases and line.not_run is None:
            line.not_run = "no case selected"
    if full:
        rep.training = _run_training(name, golden, data_dir, steps, progress)
    rep.seconds = time.perf_counter() - t0
    return rep


def _record_difference(k: int, want: dict, got: dict) -> str:
    fw, fg = dict(flat_items(want)), dict(flat_items(got))
    fields = [f for f in list(fw) + [f for f in fg if f not in fw]
              if f not in ("hash", "prev") and fw.get(f, "missing") != fg.get(f, "missing")]
    f = fields[0] if fields else ("prev" if fw.get("prev") != fg.get("prev") else "hash")
    return (f"step {k}: {f} {fg.get(f, 'missing')!r}, golden {fw.get(f, 'missing')!r}"
            + (f"; also {', '.join(fields[1:4])}" if len(fields) > 1 else ""))


def _run_training(name: str, golden: _golden.Golden, data_dir, steps, progress) -> dict:
    want = golden.training["records"]
    steps = len(want) if steps is None else min(int(steps), len(want))
    tr = {"steps": steps, "compared": 0, "first": None, "seconds": 0.0, "not_run": None,
          "genesis": golden.training["genesis"], "records": []}
    if name not in ALL:
        tr["not_run"] = f"{name} cannot train"
        return tr
    t0 = time.perf_counter()

    def on_step(k: int, rec: dict):
        tr["records"].append(rec)
        tr["compared"] = k + 1
        progress(f"{name}: training step {k + 1}/{steps}")
        if k == 0 and rec.get("prev") != golden.training["genesis"]:
            tr["first"] = {"step": 0, "detail": "the run's genesis differs from the golden run's (the corpus, "
                                                "tokenizer or configuration differ here: not a backend difference)"}
            return False
        if rec != want[k]:
            tr["first"] = {"step": k, "detail": _record_difference(k, want[k], rec)}
            return False
        return True

    try:
        _golden.train_records(name, steps, data_dir, on_step=on_step, log=progress)
    except DataError:
        raise                        # the corpus, not the backend: the caller's usage error
    except (TrainError, OSError) as e:
        tr["first"] = {"step": tr["compared"], "detail": f"training stopped: {e}"}
    except Exception as e:   # noqa: BLE001 - a backend that fails while training is a failure
        tr["first"] = {"step": tr["compared"], "detail": f"training raised {type(e).__name__}: {e}"}
    tr["seconds"] = time.perf_counter() - t0
    return tr


# ------------------------------------------------------------------------- the table
def format_report(reports: list[BackendReport], golden: _golden.Golden, full: bool) -> str:
    sel = golden.select(full)
    n_edge = sum(1 for c in sel if c.kind == "edge")
    per_op = golden.data["cases_per_op"] if full else len(golden.data["quick_indices"])
    lines = [f"open1b selftest: {'full' if full else 'quick'} set ({len(sel) - n_edge} parity cases, {per_op} per op; "
             f"{n_edge} edge cases{'; ' + str(len(golden.training['records'])) + ' training steps' if full else ''}) "
             f"against {golden.path} ({golden.data['reference']}, contract v{golden.data['contract_version']})"]
    for rep in reports:
        lines.append("")
        if rep.not_run:
            lines.append(f"{rep.backend}: not run: {rep.not_run}")
            continue
        lines.append(f"{rep.backend} ({rep.where}): {rep.device}; {rep.seconds:.1f} s")
        label = f"training ({golden.training['preset']}, {len(golden.training['records'])} steps)"
        w = max([len(op) for op in rep.ops] + [len(label)])
        lines.append(f"  {'op':<{w}}  {'cases':>5}  {'seconds':>7}  result")
        for op, line in rep.ops.items():
            if line.failed:
                res = f"DIFFERS in {line.failed} case{'s' * (line.failed != 1)}: {describe_failure(line.first)}"
            elif line.cases:
                res = "equal"
            else:
                res = f"not run: {line.not_run}"
            lines.append(f"  {op:<{w}}  {line.cases:>5}  {line.seconds:>7.2f}  {res}")
        tr = rep.training
        if tr is None:
            lines.append(f"  {label:<{w}}  {'-':>5}  {'-':>7}  not run: quick set (--full trains "
                         f"{len(golden.training['records'])} steps and compares their ledger records)")
        elif tr["not_run"]:
            lines.append(f"  {label:<{w}}  {'-':>5}  {'-':>7}  not run: {tr['not_run']}")
        else:
            res = (f"DIFFERS: {tr['first']['detail']}" if tr["first"]
                   else f"equal (run hash {_short(tr['records'][-1]['hash'])})")
            lines.append(f"  {label:<{w}}  {tr['compared']:>5}  {tr['seconds']:>7.2f}  {res}")
        lines.append(f"  result: {rep.verdict} ({rep.cases} cases"
                     + (f", {tr['compared']} steps" if tr and not tr["not_run"] else "") + ")"
                     + (f": {rep.incomplete}" if rep.verdict == "INCOMPLETE" else ""))
    ran = [r for r in reports if not r.not_run]
    summary = ", ".join(f"{r.backend} {r.verdict} ({r.where})" for r in ran) or "nothing ran"
    lines += ["", f"summary: {summary}"]
    return "\n".join(lines)


# ------------------------------------------------------------------------- bundles
def write_bundle(path, rep: BackendReport, golden: _golden.Golden) -> dict:
    """A parity bundle (parity/bundle.py's format, for `open1b parity compare`) of what the backend
    computed: per op and case the seed, input and output hashes (edge cases as ops "edge:<name>"),
    and the ledger of the training steps when they ran."""
    tr = rep.training
    training = None
    if tr and tr["records"]:
        training = {"preset": golden.training["preset"], "steps": len(tr["records"]), "backend": rep.backend,
                    "genesis": tr["genesis"], "run_hash": tr["records"][-1]["hash"], "ledger": tr["records"]}
    bundle = {"format": BUNDLE_FORMAT, "contract_version": CONTRACT_VERSION, "package_version": __version__,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "backend": rep.backend, "seed": golden.data["seed"],
              "cases_per_op": golden.data["cases_per_op"] if rep.full else len(golden.data["quick_indices"]),
              "machine": machine_info(rep.backend),
              "selftest": {"set": "full" if rep.full else "quick", "golden_sha256": golden.sha256,
                           "where": rep.where, "device": rep.device, "equal": rep.ok},
              "ops": rep.rows, "training": training}
    bundle["bundle_sha256"] = hashlib.sha256(canonical(bundle)).hexdigest()
    write_json_atomic(path, bundle)
    return bundle


# ------------------------------------------------------------------------- first contact
def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "mlx-open1b" / "selftest"


def _dist_version(*names) -> str | None:
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _driver_build(proc: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA driver's build version (e.g. 550.54.15): NVML when pynvml imports, else the
    kernel module's line in /proc (Linux); None when neither says."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:   # noqa: BLE001 - no NVML here: the next source
        pass
    try:
        m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d[\w.\-]*)", pathlib.Path(proc).read_text())
        return m.group(1) if m else None
    except OSError:
        return None


def cuda_identity(device: int | None = None, cupy=None) -> dict:
    """The CUDA stack a pass is valid for: the device (index, name, compute capability, PCI bus
    id, UUID), the driver (its CUDA version and build), the CUDA runtime and NVRTC versions. Fields
    that cannot be read say so; device None: the current device. cupy: the module (tests pass a fake)."""
    def text(v):
        return v.decode(errors="replace") if isinstance(v, bytes) else v

    ident: dict = {"device_index": device}
    if cupy is None:
        try:
            import cupy
        except Exception as e:   # noqa: BLE001 - no CuPy: the key says so
            ident["cupy"] = f"not importable ({type(e).__name__})"
            ident["driver_build"] = _driver_build()
            return ident
    rt = cupy.cuda.runtime

    def q(field, fn):
        try:
            ident[field] = fn()
        except Exception as e:   # noqa: BLE001
            ident[field] = f"unknown ({type(e).__name__})"

    if device is None:
        q("device_index", rt.getDevice)
    i = ident["device_index"]
    props: dict = {}
    q("_props", lambda: props.update(rt.getDeviceProperties(i)))
    ident.pop("_props")
    q("name", lambda: text(props["name"]))
    q("compute_capability", lambda: f"{props['major']}.{props['minor']}")
    q("pci_bus_id", lambda: text(rt.deviceGetPCIBusId(i)))
    q("uuid", lambda: bytes(props["uuid"]).hex() if isinstance(props.get("uuid"), (bytes, bytearray))
      else text(props["uuid"]))
    q("driver", rt.driverGetVersion)
    q("runtime", rt.runtimeGetVersion)
    q("nvrtc", lambda: ".".join(str(x) for x in cupy.cuda.nvrtc.getVersion()))
    ident["driver_build"] = _driver_build()
    return ident


def metal_identity() -> dict:
    """The Metal device a pass is valid for (mx.metal.device_info(): name, architecture), when MLX
    runs on one."""
    try:
        import mlx.core as mx
        info = mx.metal.device_info()
        return {k: str(info[k]) for k in ("device_name", "architecture") if k in info}
    except Exception as e:   # noqa: BLE001
        return {"device_info": f"unknown ({type(e).__name__})"}


#: the files of a backend whose bytes a pass depends on: the kernels and the Python that builds and
#: launches them (an editable checkout's edit invalidates the cached pass)
KERNEL_FILES = {"metal": ("*.metal", "*.py"), "cuda": ("*.cu", "*.cuh", "*.py")}


def backend_dir(backend: str) -> pathlib.Path | None:
    """The folder of the mlx_open1b.<backend> package (not imported)."""
    try:
        spec = importlib.util.find_spec(f"mlx_open1b.{backend}")
    except (ImportError, ValueError):
        return None
    locs = list(spec.submodule_search_locations or []) if spec else []
    return pathlib.Path(locs[0]) if locs else None


def kernel_sources_sha256(backend: str, directory=None) -> str | None:
    """SHA-256 over the names and bytes of the backend's KERNEL_FILES (sorted by name)."""
    d = pathlib.Path(directory) if directory is not None else backend_dir(backend)
    if d is None or not d.is_dir():
        return None
    h = hashlib.sha256()
    files = sorted({f for pat in KERNEL_FILES.get(backend, ()) for f in d.glob(pat) if f.is_file()})
    for f in files:
        data = f.read_bytes()
        h.update(f"{f.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def cache_key(backend: str, golden: _golden.Golden, device: int | None = None) -> dict:
    """What a cached pass is valid for: the device (CUDA: the one with index `device`, default the
    current one), OS, driver, libraries (CUDA: runtime and NVRTC), the backend's kernel sources,
    package, contract and golden file."""
    where, described = describe(backend)
    key = {"backend": backend, "where": where, "device": described, "os": platform.platform(),
           "package": __version__, "contract": CONTRACT_VERSION, "golden_sha256": golden.sha256,
           "kernels_sha256": kernel_sources_sha256(backend)}
    if backend == "metal":
        key["mlx"] = _dist_version("mlx")
        key["metal"] = metal_identity() if on_hardware("metal") and "metal" not in _assumed else None
    else:
        key["cupy"] = _dist_version("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy")
        key["cuda"] = cuda_identity(device)
    return key


def _cache_file(key: dict) -> pathlib.Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / f"{key['backend']}-{digest}.json"


def passed_before(key: dict) -> bool:
    try:
        d = json.loads(_cache_file(key).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and d.get("key") == key and d.get("verdict") == "pass"


def remember_pass(key: dict, rep: BackendReport) -> pathlib.Path | None:
    path = _cache_file(key)
    try:
        write_json_atomic(path, {"key": key, "verdict": "pass", "cases": rep.cases, "seconds": round(rep.seconds, 3),
                                 "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    except OSError:
        return None                  # no writable cache: the check runs again next time
    return path


def local_devices(backend: str, *, nproc: int | None = None, local_rank: int | None = None) -> list[int] | None:
    """The CUDA devices a command will use on this machine, as the distributed workers pick them
    (LOCAL_RANK modulo the device count): one worker's (local_rank), those of nproc workers, or
    None (one process: the current device). Only CUDA has several; an emulated backend counts as
    having as many devices as asked for."""
    if backend != "cuda" or (nproc is None and local_rank is None):
        return None
    count = None
    try:
        if cuda_runtime.real_cuda() and "cuda" not in _assumed:
            import cupy
            count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:   # noqa: BLE001 - no count: as many as asked for
        count = None
    if local_rank is not None:
        return [local_rank % count if count else local_rank]
    return list(range(min(nproc, count) if count else nproc))


@contextlib.contextmanager
def _on_device(backend: str, device: int | None):
    """Run the check on CUDA device `device` (the current one when None, or when emulated)."""
    if backend != "cuda" or device is None or "cuda" in _assumed:
        yield
        return
    import cupy
    try:
        with cupy.cuda.Device(device):
            yield
    finally:
        try:                             # the workers need the memory this process checked with
            cupy.get_default_memory_pool().free_all_blocks()
        except Exception:   # noqa: BLE001
            pass


def _where(key: dict) -> str:
    """The device of a cache key in words (a CUDA device by its index and name)."""
    c = key.get("cuda") or {}
    if isinstance(c.get("device_index"), int):
        name = c.get("name")
        if isinstance(name, str) and not name.startswith("unknown") and key.get("where") == "hardware":
            return f"CUDA device {c['device_index']} ({name})"
        return f"{key['device']} [device {c['device_index']}]"
    return key["device"]


def check_device(backend: str, golden: _golden.Golden, device: int | None = None, *,
                 log: Callable[[str], None] | None = None, select: Callable | None = None) -> tuple[str, str | None]:
    """(the device in words, None when it passes — now or by a cached pass — else why not)."""
    log = log or (lambda m: None)
    key = cache_key(backend, golden, device)
    where = _where(key)
    if passed_before(key):
        return where, None
    log(f"first contact with {backend} on {where}: checking it against the golden known answers "
        f"(quick set; once per device, driver and version; --skip-selftest skips it)")
    with _on_device(backend, device):
        rep = run_backend(backend, golden, full=False, select=select)
    if rep.ok:
        remember_pass(key, rep)
        log(f"{backend}: {rep.cases} cases equal to the golden answers ({rep.seconds:.1f} s)")
        return where, None
    return where, (("First difference: " if rep.verdict == "DIFFERENT" else "Not a pass: ")
                   + (rep.first_failure() or rep.not_run or "unknown"))


def first_contact(requested: str, *, skip: bool = False, log: Callable[[str], None] | None = None,
                  golden_path=None, select: Callable | None = None, devices: list[int] | None = None) -> str:
    """The backend a command uses for --backend `requested`. On a real Metal or CUDA device the
    quick set runs first unless a pass is cached for this exact key; on a mismatch 'auto' falls back
    to cpu_ref (with a warning naming the op) and an explicit name raises SelftestRefused. A
    missing or broken golden file raises golden.GoldenError. skip: no check (--skip-selftest).
    devices: the CUDA devices to check (local_devices; default the current one): every one must
    pass, so that all the workers of a run use the backend or none does."""
    log = log or (lambda m: None)
    backend = resolve(requested)
    if skip or backend not in GPU_BACKENDS or not on_hardware(backend):
        return backend
    golden = _golden.load(golden_path)
    for device in (devices or [None]) if backend == "cuda" else [None]:
        where, what = check_device(backend, golden, device, log=log, select=select)
        if what is None:
            continue
        hint = f"`open1b selftest --backend {backend}` prints every op"
        if requested == "auto":
            log(f"warning: {backend} on {where} failed the self-test, so --backend auto uses cpu_ref (bit-"
                f"identical, slower). {what}. {hint}.")
            return "cpu_ref"
        raise SelftestRefused(f"--backend {backend}: {where} failed the self-test, so it is not used and "
                              f"nothing was written. {what}. {hint}; --backend cpu_ref runs the "
                              f"C reference; --skip-selftest runs on the device unchecked.")
    return backend
