"""The golden known-answer set: what the C reference computes, shipped with the package.

`known_answers.json` (next to this file) holds, for every contract op of the backend API
(parity.cases.OPS: both precisions, forward and backward), CASES_PER_OP seeded parity cases and
the edge cases of edge_cases.py, each as digests: the case by (seed, op, index) or edge-case name
plus the SHA-256 of its inputs, every output by the SHA-256 of its canonical bytes
(parity.bundle.array_hash); and the ledger records of the first STEPS steps of the tiny preset on
the embedded default corpus, trained on cpu_ref. A machine proves a backend against it offline,
with no second machine (mlx_open1b.selftest, `open1b selftest`).

No per-element data is stored: the C reference is built with every install, so when an output's
digest differs the selftest recomputes the case on cpu_ref (or, if that disagrees with the digest
too, on the numpy spec) to name the first differing element; without a trustworthy reference the
report still names the op, the case and the output.

`compute()` rebuilds the set and `regenerate()` writes it atomically (`open1b selftest
--regenerate`); the bytes are a pure function of the package's code (no time stamps, no machine
data), so tests/backends/test_golden.py regenerates it and fails when the shipped file differs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time
from typing import Callable

from ..config import preset
from ..contract import CONTRACT_VERSION
from ..data.corpus import default_sources
from ..data.format import DataError, Manifest
from ..data.stream import manifest_fingerprint
from ..data.tokenizer import Tokenizer
from ..errors import Open1bError
from ..fsutil import write_bytes_atomic
from ..ledger import genesis_hash
from ..parity import backends as parity_backends
from ..parity.bundle import array_hash, temp_trainer
from ..parity.cases import OPS, execute, make_case
from ..parity.runner import normalize
from . import edge_cases

FORMAT = "open1b-golden/1"
FILE = pathlib.Path(__file__).resolve().with_name("known_answers.json")
REFERENCE = "cpu_ref"
SEED = 0
CASES_PER_OP = 8
#: the quick set's parity cases per op (index % 4 = 0, 1, 2: no specials, finite specials, a
#: NaN or infinity) — with every edge case
QUICK_INDICES = (0, 1, 2)
PRESET = "tiny"
STEPS = 20


class GoldenError(Open1bError, ValueError):
    """The golden file is missing, unreadable or malformed; the message names the file."""

    exit_code = 2


@dataclasses.dataclass(frozen=True)
class GoldenCase:
    key: str                     # "<op>/<index>" or "edge/<name>"
    op: str
    kind: str                    # "parity" or "edge"
    index: int                   # parity: the case index; edge: the position in edge_cases.names()
    name: str | None             # edge cases only
    seed: str                    # the case seed, hex
    desc: str
    inputs: str                  # SHA-256 of the inputs (Case.input_hash)
    outputs: dict                # output name -> SHA-256 of its canonical bytes (None for a None output)
    error: str | None            # the reference raised: "<Type>: <message>"
    quick: bool

    def make(self):
        """The case itself (fresh inputs), regenerated from its seed or its edge-case name."""
        if self.kind == "edge":
            return edge_cases.edge_case(self.name)
        return make_case(self.op, self.index, SEED)


@dataclasses.dataclass
class Golden:
    path: pathlib.Path
    sha256: str                  # of the file's bytes
    data: dict
    cases: list                  # GoldenCase, in file order

    @property
    def training(self) -> dict:
        return self.data["training"]

    def select(self, full: bool) -> list[GoldenCase]:
        return [c for c in self.cases if full or c.quick]


# ------------------------------------------------------------------------- computing the set
def _case_record(key: str, kind: str, case, quick: bool, ref, name: str | None = None) -> dict:
    rec = {"key": key, "op": case.op, "kind": kind, "index": case.index}
    if name is not None:
        rec["name"] = name
    rec.update(seed=f"0x{case.seed:016x}", desc=case.desc, inputs=case.input_hash(), quick=quick)
    try:
        outs = normalize(case.op, execute(parity_backends.resolve(ref, case.op), case))
        rec["outputs"] = {n: array_hash(a) for n, a in zip(case.outputs, outs)}
    except Exception as e:   # noqa: BLE001 - recorded: every backend must raise the same
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


def compute_cases(log: Callable[[str], None] | None = None) -> list[dict]:
    log = log or (lambda m: None)
    ref = parity_backends.load(REFERENCE)
    out = []
    for op in OPS:
        for i in range(CASES_PER_OP):
            out.append(_case_record(f"{op}/{i}", "parity", make_case(op, i, SEED), i in QUICK_INDICES, ref))
        log(f"golden: {op}")
    for name, case in edge_cases.edge_cases():
        out.append(_case_record(f"edge/{name}", "edge", case, True, ref, name))
    log(f"golden: {len(out)} cases")
    return out


def train_records(backend: str, steps: int, data_dir=None, on_step=None, log=None):
    """Train the tiny preset on the embedded default corpus for `steps` steps on `backend` in a
    temporary run directory (the corpus prepared into one unless data_dir is given); calls
    on_step(k, record) after each step, which may return False to stop. Returns (genesis, records)."""
    with temp_trainer(backend, data_dir, log, train_log=lambda m: None, preset_name=PRESET) as tr:
        records = []
        for k in range(steps):
            tr.step()
            records.append(tr.ledger.record_at(k))
            if on_step is not None and on_step(k, records[-1]) is False:
                break
        return tr.genesis, records


def check_corpus(data_dir, genesis: str | None = None) -> None:
    """DataError unless data_dir holds a prepared corpus that is the embedded default one: with
    genesis, the one the golden run trained on (the tiny preset on it has that genesis); without,
    its sources and tokenizer are the default corpus's (regenerating). Another corpus is a usage
    error, not a backend difference."""
    m = Manifest.load(data_dir)
    if genesis is None:
        want = [(s.name, float(s.share), list(s.inputs)) for s in default_sources()]
        have = [(s.name, float(s.share), list(s.inputs)) for s in m.sources]
        if have != want or m.tokenizer_sha256 != Tokenizer.load(None).sha256:
            raise DataError(f"{data_dir} is not the embedded default corpus (its sources or tokenizer differ); "
                            f"leave --data out to prepare that corpus")
        return
    mine = genesis_hash(preset(PRESET).to_json(), manifest_fingerprint(m), m.tokenizer_sha256, CONTRACT_VERSION)
    if mine != genesis:
        raise DataError(f"{data_dir} is not the embedded default corpus the golden run trained on (the {PRESET} "
                        f"preset on it has genesis {mine[:12]}…, the golden run {genesis[:12]}…); leave --data out "
                        f"to prepare that corpus")


def compute_training(steps: int = STEPS, data_dir=None, log=None) -> dict:
    genesis, records = train_records(REFERENCE, steps, data_dir, log=log)
    return {"preset": PRESET, "corpus": "the embedded default corpus", "backend": REFERENCE, "steps": steps,
            "genesis": genesis, "run_hash": records[-1]["hash"] if records else genesis, "records": records}


def header() -> dict:
    """The file's fields other than the cases and the training records."""
    return {"format": FORMAT,
            "about": "Known answers of the C reference (cpu_ref) for every contract op and the first steps of the "
                     "tiny preset: `open1b selftest` checks a backend against them; `open1b selftest --regenerate` "
                     "rewrites this file.",
            "contract_version": CONTRACT_VERSION, "reference": REFERENCE, "seed": SEED, "cases_per_op": CASES_PER_OP,
            "quick_indices": list(QUICK_INDICES), "ops": list(OPS)}


def compute(data_dir=None, steps: int = STEPS, log=None) -> dict:
    """The golden set as a dict (the file's content)."""
    t0 = time.perf_counter()
    d = dict(header(), cases=compute_cases(log), training=compute_training(steps, data_dir, log))
    if log:
        log(f"golden: computed in {time.perf_counter() - t0:.1f} s")
    return d


def dumps(d: dict) -> bytes:
    """The file's bytes: one case and one ledger record per line, keys in a fixed order."""
    one = lambda v: json.dumps(v, separators=(", ", ": "), ensure_ascii=True)      # noqa: E731
    head = [f" {one(k)}: {one(v)}," for k, v in d.items() if k not in ("cases", "training")]
    tr = d["training"]
    lines = ["{"] + head + [' "cases": [']
    lines += [f"  {one(c)}," for c in d["cases"][:-1]] + [f"  {one(d['cases'][-1])}", " ],"]
    lines += [' "training": {'] + [f"  {one(k)}: {one(v)}," for k, v in tr.items() if k != "records"]
    recs = tr["records"]
    lines += ['  "records": ['] + [f"   {one(r)}," for r in recs[:-1]] + ([f"   {one(recs[-1])}"] if recs else [])
    lines += ["  ]", " }", "}"]
    text = "\n".join(lines) + "\n"
    if json.loads(text) != d:
        raise AssertionError("golden: the serialization does not round-trip")
    return text.encode("ascii")


def regenerate(out=None, data_dir=None, steps: int = STEPS, log=None) -> pathlib.Path:
    """Compute the set and write it atomically to `out` (default: the package's file)."""
    path = pathlib.Path(out) if out is not None else FILE
    write_bytes_atomic(path, dumps(compute(data_dir, steps, log)))
    return path


# ------------------------------------------------------------------------- loading
_CASE_FIELDS = {"key": str, "op": str, "kind": str, "index": int, "seed": str, "desc": str, "inputs": str,
                "quick": bool}


def file_error(path, what: str) -> GoldenError:
    return GoldenError(f"golden file {path}: {what}; reinstall the package or rewrite it with "
                       f"`open1b selftest --regenerate`")


def load(path=None) -> Golden:
    """The golden set in `path` (default: the package's file), checked for shape and contract."""
    path = pathlib.Path(path) if path is not None else FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise file_error(path, "missing") from None
    except OSError as e:
        raise file_error(path, f"unreadable ({e.strerror or e})") from None
    try:
        d = json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise file_error(path, f"not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        fmt = d.get("format") if isinstance(d, dict) else None
        raise file_error(path, f"not a golden known-answer file (format {fmt!r}, expected {FORMAT!r})")
    if d.get("contract_version") != CONTRACT_VERSION:
        raise file_error(path, f"made under contract v{d.get('contract_version')}, this package implements "
                         f"v{CONTRACT_VERSION}")
    cases = d.get("cases")
    if not isinstance(cases, list) or not cases:
        raise file_error(path, "no cases")
    out = []
    for n, c in enumerate(cases):
        bad = [f for f, t in _CASE_FIELDS.items() if not isinstance(c, dict) or not isinstance(c.get(f), t)]
        outputs = c.get("outputs") if isinstance(c, dict) else None
        if not bad and "error" not in c and not (isinstance(outputs, dict) and all(
                v is None or (isinstance(v, str) and len(v) == 64) for v in outputs.values())):
            bad = ["outputs"]
        if not bad and c["kind"] == "edge" and not isinstance(c.get("name"), str):
            bad = ["name"]
        if bad:
            key = c.get("key") if isinstance(c, dict) else repr(c)[:40]
            raise file_error(path, f"case {n} ({key}): field {bad[0]!r} missing or malformed")
        out.append(GoldenCase(key=c["key"], op=c["op"], kind=c["kind"], index=c["index"], name=c.get("name"),
                              seed=c["seed"], desc=c["desc"], inputs=c["inputs"], outputs=dict(outputs or {}),
                              error=c.get("error"), quick=c["quick"]))
    _check_coverage(path, d, out)
    tr = d.get("training")
    if not (isinstance(tr, dict) and isinstance(tr.get("records"), list) and isinstance(tr.get("genesis"), str)
            and all(isinstance(r, dict) and isinstance(r.get("hash"), str) for r in tr["records"])):
        raise file_error(path, "the training section is missing or malformed")
    if not tr["records"]:
        raise file_error(path, "the training section has no ledger records (--full compares them)")
    return Golden(path=path, sha256=hashlib.sha256(raw).hexdigest(), data=d, cases=out)


def _check_coverage(path, d: dict, cases: list) -> None:
    """The file covers what this package checks, no more and no less: every contract op
    (parity.cases.OPS) with cases 0..cases_per_op-1, the quick ones being quick_indices (never
    none), and every edge case of edge_cases.py once, quick, with its op. A file that covers less
    would let a device pass on fewer cases than a first contact is meant to run."""
    per_op, quick = d.get("cases_per_op"), d.get("quick_indices")
    if not (type(per_op) is int and per_op >= 1):
        raise file_error(path, f"cases_per_op {per_op!r} is not a positive integer")
    if not (isinstance(quick, list) and quick and all(type(i) is int and 0 <= i < per_op for i in quick)
            and len(set(quick)) == len(quick)):
        raise file_error(path, f"quick_indices {quick!r} is not a non-empty list of distinct case indices below "
                         f"cases_per_op ({per_op})")
    if d.get("ops") != list(OPS):
        raise file_error(path, "its op list is not this package's contract ops (parity.cases.OPS)")
    parity: dict = {op: [] for op in OPS}
    edge_want = edge_cases.edge_ops()
    edge_seen: set = set()
    for n, c in enumerate(cases):
        where = f"case {n} ({c.key})"
        if c.kind == "parity":
            if c.op not in parity:
                raise file_error(path, f"{where}: op {c.op!r} is not a contract op of this package")
            if c.key != f"{c.op}/{c.index}":
                raise file_error(path, f"{where}: its key is not '<op>/<index>' ({c.op}/{c.index})")
            parity[c.op].append(c)
        elif c.kind == "edge":
            if c.name not in edge_want:
                raise file_error(path, f"{where}: edge case {c.name!r} is not one this package knows")
            if c.name in edge_seen:
                raise file_error(path, f"{where}: edge case {c.name!r} appears twice")
            if c.op != edge_want[c.name] or c.key != f"edge/{c.name}" or not c.quick:
                raise file_error(path, f"{where}: edge case {c.name!r} must be key edge/{c.name}, op "
                                 f"{edge_want[c.name]}, quick")
            edge_seen.add(c.name)
        else:
            raise file_error(path, f"{where}: kind {c.kind!r} is neither 'parity' nor 'edge'")
    for op, mine in parity.items():
        idx = sorted(c.index for c in mine)
        if idx != list(range(per_op)):
            raise file_error(path, f"op {op}: cases {idx}, expected 0..{per_op - 1} (cases_per_op)")
        q = sorted(c.index for c in mine if c.quick)
        if q != sorted(quick):
            raise file_error(path, f"op {op}: quick cases {q}, expected quick_indices {sorted(quick)}")
    missing = [n for n in edge_want if n not in edge_seen]
    if missing:
        raise file_error(path, f"edge case{'s' * (len(missing) > 1)} {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''} missing")
