"""`open1b selftest` and the first-contact check (mlx_open1b.selftest, cli/__init__.backend_option):
backends pass the shipped golden set; a planted fault is named by op, case, element and both
values in hex (located through cpu_ref, or the numpy spec when cpu_ref is the faulty one, or by
digest when no reference agrees); bundles compare with `open1b parity compare`; the training steps
are compared record by record; and before a command uses a real device the quick set runs once per
cache key, falls back to cpu_ref under --backend auto and refuses an explicit --backend before
anything is written. Real hardware is simulated with selftest.assume_hardware on the emulators,
with faults planted by monkeypatching a backend op or by the emulators' modelled fp32 unit
(emu.hardware(fault=...)): CUDA's division rounded toward zero and contracted multiply-adds change
results; Metal's division is done in integers, so a faulty divider changes nothing there."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import re

import numpy as np
import pytest
from click.testing import CliRunner

import mlx_open1b.cpu_ref as cpu_ref
import mlx_open1b.metal.ops as MO
from mlx_open1b import golden as G
from mlx_open1b import selftest as S
from mlx_open1b.cli.main import cli
from mlx_open1b.cuda import emu as cuda_emu
from mlx_open1b.golden import edge_cases as E
from mlx_open1b.metal import emu as metal_emu

GOLDEN = G.load()
EXP_ONLY = lambda gc: gc.op == "exp"   # noqa: E731


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    d = tmp_path / "selftest-cache"
    monkeypatch.setattr(S, "cache_dir", lambda: d)
    return d


def _flip_first(fn):
    """fn with the lowest bit of the first element of its (first) output flipped."""
    @functools.wraps(fn)
    def planted(*a, **k):
        y = np.array(fn(*a, **k), copy=True)
        y.reshape(-1).view(np.uint32)[0] ^= np.uint32(1)
        return y
    return planted


def _narrow(monkeypatch, select) -> None:
    """The first-contact check runs only the cases `select` picks (speed; the quick set's own
    power is shown by the tests of the modelled faults)."""
    real = S.run_backend
    monkeypatch.setattr(S, "run_backend", lambda *a, **k: real(*a, **dict(k, select=select)))


def _hexes(a) -> str:
    return f"0x{int(np.asarray(a, np.float32).reshape(-1).view(np.uint32)[0]):08x}"


# ------------------------------------------------------------------------- the selftest itself
def test_cpu_ref_and_cuda_pass_the_quick_set_and_their_bundles_compare_identical(tmp_path):
    r = CliRunner()
    for name in ("cpu_ref", "cuda"):
        res = r.invoke(cli, ["selftest", "--backend", name, "--bundle", str(tmp_path / f"{name}.json")])
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        head = next(x for x in lines if x.startswith(f"{name} ("))
        assert ("CPU" if name == "cpu_ref" else "emulated") in head and head.endswith(" s")
        for op in GOLDEN.data["ops"]:
            assert any(x.split()[:1] == [op] and x.endswith(" equal") for x in lines), op
        assert "result: EQUAL" in res.output and "not run: quick set" in res.output
    res = r.invoke(cli, ["parity", "compare", str(tmp_path / "cpu_ref.json"), str(tmp_path / "cuda.json")])
    assert res.exit_code == 0 and "result: IDENTICAL" in res.output, res.output
    b = json.loads((tmp_path / "cuda.json").read_text())
    assert b["selftest"]["equal"] and "edge:exp_fma_canary_tiny" in b["ops"] and b["training"] is None


def test_a_quick_selftest_bundle_compares_identical_with_an_export_of_the_same_backend(tmp_path, default_corpus):
    """The selftest bundle has edge cases the export did not run, the export a ledger the quick set
    did not train: those are 'not compared', not differences; the common cases are compared."""
    r = CliRunner()
    res = r.invoke(cli, ["selftest", "--backend", "cpu_ref", "--bundle", str(tmp_path / "st.json")])
    assert res.exit_code == 0, res.output
    res = r.invoke(cli, ["parity", "export", str(tmp_path / "ex.json"), "--cases", "3", "--steps", "2",
                         "--data", str(default_corpus)])
    assert res.exit_code == 0, res.output
    res = r.invoke(cli, ["parity", "compare", str(tmp_path / "st.json"), str(tmp_path / "ex.json")])
    assert res.exit_code == 0 and "result: IDENTICAL" in res.output, res.output
    n_edge = len(E.names())
    assert f"{3 * len(GOLDEN.data['ops'])} cases: {3 * len(GOLDEN.data['ops'])} identical" in res.output
    assert f"not compared (run by one bundle only): {n_edge} ops only in A (edge:" in res.output
    assert "the training ledger, only in B" in res.output


def _bundle(cases_per_op: int, ops: dict, steps: int | None = None, ledger: int | None = None) -> dict:
    """A parity bundle made by hand (sealed as an export seals it)."""
    from mlx_open1b.parity.bundle import FORMAT, canonical
    rows = {op: [{"case": i, "seed": f"0x{i:016x}", "desc": "", "inputs": f"{i:064x}",
                  "outputs": {"y": f"{i + 7:064x}"}} for i in idx] for op, idx in ops.items()}
    training = None if steps is None else {
        "preset": "tiny", "steps": steps, "backend": "cpu_ref", "genesis": "g", "run_hash": "h",
        "ledger": [{"step": k, "hash": f"{k:064x}"} for k in range(steps if ledger is None else ledger)]}
    b = {"format": FORMAT, "contract_version": 1, "backend": "cpu_ref", "seed": 0, "cases_per_op": cases_per_op,
         "ops": rows, "training": training}
    import hashlib
    b["bundle_sha256"] = hashlib.sha256(canonical(b)).hexdigest()
    return b


@pytest.mark.parametrize("a, b, differs, says", [
    # rows the other bundle did not run: not compared
    ((3, {"exp": [0, 1, 2], "edge:x": [0]}), (3, {"exp": [0, 1, 2]}), False, "1 op only in A (edge:x)"),
    ((8, {"exp": range(8)}), (3, {"exp": [0, 1, 2]}), False, "5 cases only in A (beyond the other"),
    ((3, {"exp": [0, 1, 2]}, 4), (3, {"exp": [0, 1, 2]}, 2), False, "ledger records 2-3, only in A (B trained 2"),
    ((3, {"exp": [0, 1, 2]}), (3, {"exp": [0, 1, 2]}, 2), False, "the training ledger, only in B"),
    # rows the other bundle ran and lost: differences
    ((3, {"exp": [0, 1, 2]}), (3, {"exp": [0, 2]}), True, "exp: case 1 is in A, missing from B"),
    ((3, {"exp": [0, 1, 2]}, 4), (3, {"exp": [0, 1, 2]}, 4, 2), True, "ledger lengths differ: 4 records (A), 2 (B)"),
    ((3, {"edge:x": [0]}), (3, {"exp": [0, 1, 2]}), True, "nothing was compared"),
])
def test_parity_compare_tells_rows_not_run_from_rows_lost(a, b, differs, says):
    from mlx_open1b.parity.bundle import compare, format_comparison
    ba, bb = _bundle(*a), _bundle(*b)
    r = compare(ba, bb)
    text = format_comparison(r, ba, bb)
    assert (r.exit_code == 1) == differs and says in text, text
    assert ("result: DIFFERENT" in text) == differs


def test_metal_passes_the_edge_cases():
    rep = S.run_backend("metal", GOLDEN, select=lambda gc: gc.kind == "edge")
    assert rep.ok and rep.cases == len(E.names()) and rep.where == "emulated"


def test_planted_bit_is_named_with_op_case_element_and_both_values(monkeypatch):
    monkeypatch.setattr(MO, "exp", _flip_first(MO.exp))
    rep = S.run_backend("metal", GOLDEN, select=EXP_ONLY)
    assert not rep.ok and rep.failed_ops == ["exp"]
    f = rep.ops["exp"].first
    gc = next(c for c in GOLDEN.cases if c.key == "exp/0")
    want = cpu_ref.exp(gc.make().args[0])
    assert f["case"] == "exp/0" and f["output"] == "y" and f["located_by"] == "cpu_ref"
    assert f["index"] == [0] * want.ndim and f["count"] == 1
    assert f["ref_hex"] == _hexes(want) and f["hex"] == f"0x{int(_hexes(want), 16) ^ 1:08x}"
    line = next(x for x in S.format_report([rep], GOLDEN, False).splitlines() if x.split()[:1] == ["exp"])
    assert "DIFFERS" in line and f["ref_hex"] in line and f["hex"] in line and "exp/0" in line
    assert rep.ops["log"].not_run == "no case selected"


def test_faulty_cpu_ref_is_located_through_the_spec_and_fails_the_cli(monkeypatch):
    monkeypatch.setattr(cpu_ref, "sigmoid", _flip_first(cpu_ref.sigmoid))
    res = CliRunner().invoke(cli, ["selftest", "--backend", "cpu_ref"])
    assert res.exit_code == 1, res.output
    line = next(x for x in res.output.splitlines() if x.split()[:1] == ["sigmoid"])
    assert "DIFFERS in 4 cases: sigmoid/0" in line and "golden" in line and "0x" in line
    assert "result: DIFFERENT" in res.output and "summary: cpu_ref DIFFERENT (CPU)" in res.output


def _flip_hex(h: str) -> str:
    return ("1" if h[0] == "0" else "0") + h[1:]


@pytest.mark.parametrize("key, field, says", [
    ("exp/1", "outputs", "op exp, case exp/1: the digest of output y"),
    ("edge/mul_tiny", "inputs", "op scalar_mul, case edge/mul_tiny: this install generates other inputs"),
])
def test_a_corrupted_golden_file_is_blamed_on_the_file_not_the_device(tmp_path, cache, monkeypatch, key, field,
                                                                      says, default_corpus):
    """One edited digest (no reference here computes it) or one input hash (this install makes
    other inputs): exit 2 naming the file, op and case; a first contact neither falls back nor
    refuses the device, and caches nothing."""
    d = json.loads(G.FILE.read_bytes())
    case = next(c for c in d["cases"] if c["key"] == key)
    if field == "outputs":
        case["outputs"] = {k: _flip_hex(v) for k, v in case["outputs"].items()}
    else:
        case["inputs"] = _flip_hex(case["inputs"])
    path = tmp_path / "golden.json"
    path.write_bytes(G.dumps(d))
    res = CliRunner().invoke(cli, ["selftest", "--backend", "cpu_ref", "--golden", str(path)])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert str(path) in res.output and says in res.output and "not a verdict on the device" in res.output
    assert "DIFFERENT" not in res.output and "Traceback" not in res.output
    _narrow(monkeypatch, lambda gc: gc.key == key)
    with S.assume_hardware("metal"):
        for requested in ("auto", "metal"):
            with pytest.raises(G.GoldenError, match=re.escape(says)):
                S.first_contact(requested, golden_path=path)
    assert not cache.exists() or not list(cache.iterdir())
    monkeypatch.setattr(G, "FILE", path)                  # the package's file corrupted: train stops, exit 2
    with S.assume_hardware("metal"):
        res = _train(CliRunner(), tmp_path / "run", default_corpus, "auto")
    assert res.exit_code == 2 and "cannot check the device before using it" in res.output and says in res.output
    assert not (tmp_path / "run").exists()


def test_usage_errors_exit_2(monkeypatch):
    r = CliRunner()
    for args, says in ((["--out", "x.json"], "--out is for --regenerate"), (["--data", "."], "--data is for --full"),
                       (["--regenerate", "--full"], "--regenerate takes only")):
        res = r.invoke(cli, ["selftest", *args])
        assert res.exit_code == 2 and says in res.output, res.output
    from mlx_open1b.parity import backends as PB

    real = PB.load

    def unavailable(name):
        if name in ("metal", "cuda"):
            raise PB.BackendUnavailable(f"{name}: no device and no emulator here")
        return real(name)
    monkeypatch.setattr(PB, "load", unavailable)
    res = r.invoke(cli, ["selftest", "--backend", "cuda"])
    assert res.exit_code == 2 and "cuda: no device and no emulator here" in res.output
    res = r.invoke(cli, ["selftest", "--backend", "all"])
    assert res.exit_code == 0 and "metal: not run: metal: no device" in res.output and "cpu_ref EQUAL" in res.output


def test_an_unwritable_bundle_or_out_path_is_refused_before_any_work(tmp_path):
    """--bundle and --regenerate's --out under a regular file (not a folder): exit 2 naming the
    path, before the checking or the computing starts, without a traceback."""
    blocker = tmp_path / "file.json"
    blocker.write_text("{}")
    r = CliRunner()
    for args, option in ((["--backend", "cpu_ref", "--bundle", str(blocker / "b.json")], "--bundle"),
                         (["--backend", "all", "--bundle", str(blocker / "sub" / "b.json")], "--bundle"),
                         (["--regenerate", "--out", str(blocker / "g.json")], "--out")):
        res = r.invoke(cli, ["selftest", *args])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
        assert f"error: {option} {blocker}" in res.output and f"{blocker} is not a directory" in res.output
        assert "result:" not in res.output and "golden:" not in res.output and "Traceback" not in res.output
    res = r.invoke(cli, ["selftest", "--backend", "cpu_ref", "--bundle", str(tmp_path)])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_data_that_is_not_the_golden_runs_corpus_is_a_usage_error(tmp_path, default_corpus, monkeypatch):
    """--data at an empty folder, or at a corpus other than the embedded default one: exit 2
    naming the folder, before any case runs (not 'cpu_ref DIFFERENT')."""
    def never(*a, **k):
        raise AssertionError("the check started")
    monkeypatch.setattr(S, "run_backend", never)
    monkeypatch.setattr(G, "compute", never)
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    m = json.loads((default_corpus / "manifest.json").read_text())
    m["sources"][0]["share"], m["sources"][1]["share"] = m["sources"][1]["share"], m["sources"][0]["share"]
    (other / "manifest.json").write_text(json.dumps(m))
    r = CliRunner()
    for data, says in ((empty, "no manifest"), (other, "is not the embedded default corpus the golden run")):
        res = r.invoke(cli, ["selftest", "--backend", "cpu_ref", "--full", "--data", str(data)])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
        assert f"error: --data {data}" in res.output and says in res.output
        assert "result:" not in res.output and "DIFFERENT" not in res.output and "Traceback" not in res.output
    for data, says in ((empty, "no manifest"), (other, "is not the embedded default corpus (its sources")):
        res = r.invoke(cli, ["selftest", "--regenerate", "--out", str(tmp_path / "g.json"), "--data", str(data)])
        assert res.exit_code == 2 and f"error: --data {data}" in res.output and says in res.output, res.output
        assert not (tmp_path / "g.json").exists()


def test_full_set_compares_training_records_and_names_the_first_difference(monkeypatch, default_corpus):
    rep = S.run_backend("cpu_ref", GOLDEN, full=True, steps=2, data_dir=default_corpus, select=EXP_ONLY)
    assert rep.ok and rep.ops["exp"].cases == G.CASES_PER_OP + 1 and rep.training["compared"] == 2
    assert rep.training["records"] == GOLDEN.training["records"][:2]
    real = cpu_ref.adamw_step

    def planted(p, g, m, v, **kw):          # one bf16 parameter one ulp off after every update
        real(p, g, m, v, **kw)
        p.reshape(-1)[:1] ^= np.uint16(1)
    monkeypatch.setattr(cpu_ref, "adamw_step", planted)
    rep = S.run_backend("cpu_ref", GOLDEN, full=True, steps=2, data_dir=default_corpus, select=lambda gc: False)
    assert not rep.ok and rep.training["compared"] == 1
    assert rep.training["first"]["detail"].startswith("step 0: hashes.params ")
    assert "training (tiny, 20 steps)      1" in S.format_report([rep], GOLDEN, True)


@pytest.mark.slow
def test_full_selftest_of_every_backend_passes(tmp_path, default_corpus):
    """`open1b selftest --backend all --full`: every case and 20 training steps (the emulated
    backends train for many minutes)."""
    res = CliRunner().invoke(cli, ["selftest", "--backend", "all", "--full", "--data", str(default_corpus),
                                   "--bundle", str(tmp_path / "b.json")])
    assert res.exit_code == 0, res.output
    assert res.output.count("result: EQUAL") == 3
    c = CliRunner().invoke(cli, ["parity", "compare", str(tmp_path / "b.cpu_ref.json"), str(tmp_path / "b.metal.json")])
    assert c.exit_code == 0 and "ledger: 20 records compared" in c.output, c.output


# ------------------------------------------------------------------------- first contact
def test_first_contact_runs_only_on_hardware_and_caches_a_pass(cache, monkeypatch):
    calls = []
    real = S.run_backend

    def counting(*a, **k):
        calls.append(a[0])
        return real(*a, **dict(k, select=EXP_ONLY))
    monkeypatch.setattr(S, "run_backend", counting)
    assert S.first_contact("metal") == "metal" and calls == []          # emulated: no check
    assert S.first_contact("auto") == "cpu_ref" and calls == []
    with S.assume_hardware("metal"):
        assert S.resolve("auto") == "metal"
        assert S.first_contact("metal", skip=True) == "metal" and calls == []
        log = []
        assert S.first_contact("auto", log=log.append) == "metal" and calls == ["metal"]
        assert "first contact with metal" in log[0] and "equal to the golden answers" in log[1]
        files = list(cache.iterdir())
        assert len(files) == 1 and json.loads(files[0].read_text())["key"] == S.cache_key("metal", GOLDEN)
        assert S.first_contact("metal") == "metal" and calls == ["metal"]        # cached
        entry = json.loads(files[0].read_text())
        files[0].write_text(json.dumps(dict(entry, key=dict(entry["key"], device="another"))))
        assert S.first_contact("metal") == "metal" and calls == ["metal", "metal"]   # not this key's pass
        calls.pop()
        key = S.cache_key("metal", GOLDEN)
        monkeypatch.setattr(S, "cache_key", lambda b, g, d=None: dict(key, mlx="9.9.9"))  # another library version
        assert S.first_contact("metal") == "metal" and calls == ["metal", "metal"]
    assert S.resolve("auto") == "cpu_ref"


class _FakeCudaRuntime:
    """cupy.cuda.runtime as a CUDA machine answers it (the values are placeholders)."""

    def __init__(self, **v):
        self.v = dict(current=0, driver=12040, runtime=12040, name=b"NVIDIA H200", major=9, minor=0,
                      bus="0000:{:02X}:00.0", uuid=b"\x01" * 16)
        self.v.update(v)

    def getDevice(self):
        return self.v["current"]

    def getDeviceProperties(self, i):
        return {"name": self.v["name"], "major": self.v["major"], "minor": self.v["minor"], "uuid": self.v["uuid"]}

    def deviceGetPCIBusId(self, i):
        return self.v["bus"].format(0x10 + i)

    def driverGetVersion(self):
        return self.v["driver"]

    def runtimeGetVersion(self):
        return self.v["runtime"]


def _fake_cupy(nvrtc=(12, 4), **v):
    from types import SimpleNamespace
    return SimpleNamespace(cuda=SimpleNamespace(runtime=_FakeCudaRuntime(**v),
                                                nvrtc=SimpleNamespace(getVersion=lambda: nvrtc)))


def test_cuda_identity_reads_device_driver_runtime_and_nvrtc():
    ident = S.cuda_identity(None, cupy=_fake_cupy(current=1))
    assert {k: ident[k] for k in ("device_index", "name", "compute_capability", "pci_bus_id", "uuid", "driver",
                                  "runtime", "nvrtc")} == {
        "device_index": 1, "name": "NVIDIA H200", "compute_capability": "9.0", "pci_bus_id": "0000:11:00.0",
        "uuid": "01" * 16, "driver": 12040, "runtime": 12040, "nvrtc": "12.4"}
    assert S.cuda_identity(3, cupy=_fake_cupy())["pci_bus_id"] == "0000:13:00.0"
    broken = _fake_cupy()
    del broken.cuda.nvrtc.getVersion
    assert S.cuda_identity(0, cupy=broken)["nvrtc"] == "unknown (AttributeError)"


def test_driver_build_from_nvml_or_proc(tmp_path, monkeypatch):
    import sys
    from types import SimpleNamespace
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    monkeypatch.setitem(sys.modules, "pynvml", None)                   # no NVML: the kernel module's line
    assert S._driver_build(str(proc)) == "550.54.15"
    assert S._driver_build(str(tmp_path / "absent")) is None
    nvml = SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                           nvmlSystemGetDriverVersion=lambda: b"560.35.03")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert S._driver_build(str(proc)) == "560.35.03"


@pytest.mark.parametrize("change", [
    dict(driver=12060), dict(runtime=12060), dict(nvrtc=(12, 6)), dict(name=b"NVIDIA H100"), dict(major=8),
    dict(bus="0001:{:02X}:00.0"), dict(uuid=b"\x02" * 16), dict(current=1),
])
def test_cuda_pass_is_cached_per_device_driver_runtime_and_nvrtc(cache, monkeypatch, change):
    """A pass cached for one CUDA stack is not reused when the driver, runtime, NVRTC, device
    (name, compute capability, PCI bus, UUID) or device index differ."""
    real = S.cuda_identity
    fake = [_fake_cupy()]
    monkeypatch.setattr(S, "cuda_identity", lambda device=None: real(device, cupy=fake[0]))
    calls = []
    run = S.run_backend
    monkeypatch.setattr(S, "run_backend", lambda *a, **k: calls.append(a[0]) or run(*a, **dict(k, select=EXP_ONLY)))
    with S.assume_hardware("cuda"):
        assert S.first_contact("cuda") == "cuda" and S.first_contact("cuda") == "cuda" and calls == ["cuda"]
        fake[0] = _fake_cupy(**change)
        assert S.first_contact("cuda") == "cuda" and calls == ["cuda", "cuda"]
    assert len(list(cache.iterdir())) == 2


def test_an_edited_kernel_source_invalidates_a_cached_pass(cache, monkeypatch, tmp_path):
    """An editable checkout: a pass cached before a kernel (or its launch code) changed is not
    reused after; the hash covers metal's .metal and cuda's .cu, .cuh and .py files."""
    import shutil
    for name in ("metal", "cuda"):
        shutil.copytree(S.backend_dir(name), tmp_path / name, ignore=shutil.ignore_patterns("emu", "__pycache__"))
    monkeypatch.setattr(S, "backend_dir", lambda b: tmp_path / b)
    calls = []
    run = S.run_backend
    monkeypatch.setattr(S, "run_backend", lambda *a, **k: calls.append(a[0]) or run(*a, **dict(k, select=EXP_ONLY)))
    for name, edited in (("metal", "gemm.metal"), ("cuda", "contract.cuh"), ("cuda", "linear.cu"), ("cuda", "ops.py")):
        with S.assume_hardware(name):
            S.first_contact(name)
            n = len(calls)
            assert S.first_contact(name) == name and len(calls) == n                    # cached
            with open(tmp_path / name / edited, "a") as f:
                f.write("\n")
            assert S.first_contact(name) == name and len(calls) == n + 1, edited          # checked again


def test_first_contact_falls_back_under_auto_and_refuses_an_explicit_backend(cache, monkeypatch):
    monkeypatch.setattr(MO, "exp", _flip_first(MO.exp))
    _narrow(monkeypatch, EXP_ONLY)
    with S.assume_hardware("metal"):
        log = []
        assert S.first_contact("auto", log=log.append) == "cpu_ref"
        assert "warning: metal" in log[-1] and "First difference: exp: exp/0" in log[-1]
        with pytest.raises(S.SelftestRefused, match=r"--backend metal: .* failed the self-test.*exp: exp/0") as e:
            S.first_contact("metal")
        assert e.value.exit_code == 3
        assert S.first_contact("metal", skip=True) == "metal"
    assert not cache.exists() or not list(cache.iterdir())                      # a failure is never cached


def test_golden_file_with_no_quick_case_or_an_unknown_op_is_refused_not_passed(tmp_path, cache):
    """Such a file would compare nothing on some op: the CLI exits 2 naming it, and a first contact
    neither passes nor caches a pass."""
    d = json.loads(G.FILE.read_bytes())
    for c in d["cases"]:
        c["quick"] = False
    (tmp_path / "noquick.json").write_bytes(G.dumps(d))
    res = CliRunner().invoke(cli, ["selftest", "--backend", "cpu_ref", "--golden", str(tmp_path / "noquick.json")])
    assert res.exit_code == 2 and str(tmp_path / "noquick.json") in res.output and "EQUAL" not in res.output
    d = json.loads(G.FILE.read_bytes())
    for c in d["cases"]:
        if c["op"] == "exp":
            c["op"] = "no_backend_has_this"
            c["key"] = c["key"].replace("exp", c["op"], 1) if c["kind"] == "parity" else c["key"]
    (tmp_path / "unknown.json").write_bytes(G.dumps(d))
    with S.assume_hardware("metal"), pytest.raises(G.GoldenError, match="not a contract op"):
        S.first_contact("metal", golden_path=tmp_path / "unknown.json")
    assert not cache.exists() or not list(cache.iterdir())


def test_a_run_that_compares_fewer_cases_than_selected_is_not_a_pass(monkeypatch, cache):
    """Zero cases compared is INCOMPLETE, not EQUAL; so is a backend that lacks an op: auto falls
    back, an explicit backend is refused, both naming the op."""
    none_quick = G.Golden(GOLDEN.path, GOLDEN.sha256, GOLDEN.data,
                          [dataclasses.replace(c, quick=False) for c in GOLDEN.cases])
    rep = S.run_backend("cpu_ref", none_quick)
    assert rep.cases == 0 and not rep.ok and rep.verdict == "INCOMPLETE"
    assert "result: INCOMPLETE (0 cases): no case was compared" in S.format_report([rep], none_quick, False)
    from mlx_open1b.parity import backends as PB
    real = PB.resolve
    monkeypatch.setattr(PB, "resolve", lambda b, op: None if op == "log" else real(b, op))
    _narrow(monkeypatch, lambda gc: gc.op in ("exp", "log"))
    with S.assume_hardware("metal"):
        log = []
        assert S.first_contact("auto", log=log.append) == "cpu_ref"
        n = {op: sum(1 for c in GOLDEN.select(False) if c.op == op) for op in ("exp", "log")}
        assert (f"Not a pass: compared {n['exp']} of {n['exp'] + n['log']} selected cases (log: metal has no "
                f"function for log)") in log[-1]
        with pytest.raises(S.SelftestRefused, match="log: metal has no function for log"):
            S.first_contact("metal")
    assert not cache.exists() or not list(cache.iterdir())


def test_broken_golden_file_stops_the_first_contact(tmp_path):
    with S.assume_hardware("metal"), pytest.raises(G.GoldenError, match="missing"):
        S.first_contact("metal", golden_path=tmp_path / "nope.json")


def _train(runner, out, data, backend, *extra):
    return runner.invoke(cli, ["train", "--backend", backend, "--out", str(out), "--data", str(data), "--steps", "1",
                               *extra])


def test_cli_refuses_a_failing_device_before_writing_and_falls_back_under_auto(tmp_path, monkeypatch,
                                                                                 default_corpus):
    """A planted one-bit fault in the metal backend, metal taken for real hardware: train, audit
    and eval with --backend metal stop with exit 3 and create nothing; --backend auto trains on
    cpu_ref with a warning; --skip-selftest uses the device."""
    monkeypatch.setattr(MO, "exp", _flip_first(MO.exp))
    _narrow(monkeypatch, EXP_ONLY)
    r = CliRunner()
    with S.assume_hardware("metal"):
        res = _train(r, tmp_path / "refused", default_corpus, "metal")
        assert res.exit_code == 3 and "failed the self-test" in res.output and "exp: exp/0" in res.output
        assert res.exception is None or isinstance(res.exception, SystemExit)
        assert not (tmp_path / "refused").exists()
        res = _train(r, tmp_path / "run", default_corpus, "auto")
        assert res.exit_code == 0, res.output
        assert "warning: metal" in res.output and "backend cpu_ref" in res.output and "run hash" in res.output
        att = tmp_path / "att.json"
        res = r.invoke(cli, ["audit", str(tmp_path / "run"), "--steps", "0", "--backend", "metal", "--out", str(att)])
        assert res.exit_code == 3 and "failed the self-test" in res.output and not att.exists()
        res = r.invoke(cli, ["eval", str(tmp_path / "run"), "--backend", "metal", "--json", str(att)])
        assert res.exit_code == 3 and not att.exists()
        res = r.invoke(cli, ["train", "--backend", "metal", "--skip-selftest", "--out", str(tmp_path / "skip"),
                             "--data", str(default_corpus), "--steps", "0"])
        assert res.exit_code == 0 and "backend metal" in res.output and "self-test" not in res.output, res.output


# ------------------------------------------------------------------------- distributed runs
def _faulty_device(monkeypatch, bad: int) -> None:
    """CUDA device `bad` fuses multiply-adds (the emulator's unit while that device is checked)."""
    real = S._on_device

    @contextlib.contextmanager
    def on_device(backend, device):
        with real(backend, device), (cuda_emu.hardware(fault="fma") if device == bad else contextlib.nullcontext()):
            yield
    monkeypatch.setattr(S, "_on_device", on_device)


def test_nproc_checks_every_local_device_before_launching_the_workers(tmp_path, monkeypatch, cache, default_corpus):
    """`open1b train --nproc 2`: the parent checks CUDA devices 0 and 1 (a cache entry each) and
    starts the workers with --skip-selftest; device 1 failing stops --backend cuda before any
    worker starts (exit 3), and under auto every worker gets cpu_ref."""
    import subprocess
    pytest.importorskip("torch")
    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **k: launched.append(cmd) or 0)
    _narrow(monkeypatch, lambda gc: gc.name == "exp_fma_canary_tiny")
    r = CliRunner()
    with S.assume_hardware("cuda"):
        res = _train(r, tmp_path / "ok", default_corpus, "cuda", "--nproc", "2")
        assert res.exit_code == 0, res.output
        assert sorted(json.loads(f.read_text())["key"]["cuda"]["device_index"] for f in cache.iterdir()) == [0, 1]
        cmd = launched.pop()
        assert "--skip-selftest" in cmd and cmd[cmd.index("--backend") + 1] == "cuda"
        for f in cache.iterdir():
            f.unlink()
        _faulty_device(monkeypatch, 1)
        res = _train(r, tmp_path / "refused", default_corpus, "cuda", "--nproc", "2")
        assert res.exit_code == 3 and "[device 1] failed the self-test" in res.output and not launched, res.output
        res = _train(r, tmp_path / "auto", default_corpus, "auto", "--nproc", "2")
        assert res.exit_code == 0 and "[device 1] failed the self-test" in res.output, res.output
        cmd = launched.pop()
        assert "--skip-selftest" in cmd and cmd[cmd.index("--backend") + 1] == "cpu_ref"


def test_a_torchrun_worker_checks_its_own_device_and_hands_a_refusal_to_the_agreement(tmp_path, monkeypatch, cache,
                                                                                       default_corpus):
    """A hand-launched torchrun worker checks the device it will use (LOCAL_RANK) and does not stop
    alone when it fails: run_worker gets the refusal as its start-up error (exit code 3), with the
    device backend (so its process group is the others'), under auto too."""
    import mlx_open1b.distributed as D
    from types import SimpleNamespace
    got = []

    def fake_run_worker(out, cfg, data_dir, **kw):
        got.append(kw)
        return "0" * 64, SimpleNamespace(comm=SimpleNamespace(rank=1))
    monkeypatch.setattr(D, "run_worker", fake_run_worker)
    _narrow(monkeypatch, lambda gc: gc.name == "exp_fma_canary_tiny")
    _faulty_device(monkeypatch, 1)
    r = CliRunner()
    for local_rank, backend, extra, refused in (("0", "cuda", (), False), ("1", "cuda", (), True),
                                                ("1", "auto", (), True), ("1", "cuda", ("--skip-selftest",), False)):
        monkeypatch.setenv("RANK", local_rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with S.assume_hardware("cuda"):
            res = _train(r, tmp_path / "run", default_corpus, backend, *extra)
        assert res.exit_code == 0, res.output
        kw = got.pop()
        assert kw["backend"] == "cuda", (local_rank, backend)
        if not refused:
            assert kw["startup_error"] is None, (local_rank, backend, extra)
            continue
        msg, code = kw["startup_error"]
        assert code == 3 and "[device 1] failed the self-test" in msg and "exp_fma_canary_tiny" in msg
        assert ("cannot fall back to cpu_ref alone" in msg) == (backend == "auto")
    keys = [json.loads(f.read_text())["key"] for f in cache.iterdir()]
    assert [k["cuda"]["device_index"] for k in keys] == [0]                       # only device 0 passed


_WORKER_SITE = """
import os
if os.environ.get("RANK") == "1":          # rank 1 takes the metal emulator for its device
    import numpy as np
    import mlx_open1b.metal.ops as MO
    from mlx_open1b import selftest as S
    S._assumed.add("metal")
    if os.environ.get("O1B_TEST_FAULTY") == "1":
        real_exp = MO.exp
        def exp(*a, **k):
            y = np.array(real_exp(*a, **k), copy=True)
            y.reshape(-1).view(np.uint32)[0] ^= np.uint32(1)
            return y
        MO.exp = exp
    real_run = S.run_backend
    S.run_backend = lambda *a, **k: real_run(*a, **dict(k, select=lambda gc: gc.op == "exp"))
"""


def test_hand_launched_workers_stop_together_on_a_refused_or_mixed_backend(tmp_path, default_corpus):
    """Two workers with torchrun's environment (no agent): rank 1's device fails the self-test ->
    both stop at the start-up agreement with exit 3 naming rank 1; rank 1 on a passing device under
    auto while rank 0 has none (cpu_ref) -> both stop with exit 2: the backends differ."""
    import os
    import socket
    import subprocess
    import sys
    pytest.importorskip("torch.distributed")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_WORKER_SITE)

    def launch(backend, out, **env):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = []
        for rank in range(2):
            e = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                     LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     XDG_CACHE_HOME=str(tmp_path / "cache"),
                     PYTHONPATH=os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p]), **env)
            procs.append(subprocess.Popen([sys.executable, "-m", "mlx_open1b.cli.main", "train", "--backend", backend,
                                           "--out", str(tmp_path / out), "--data", str(default_corpus), "--steps", "1",
                                           "--dist-timeout", "60"], env=e, cwd=tmp_path, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        return [(p.returncode, err) for p, (_, err) in ((p, p.communicate(timeout=300)) for p in procs)]

    for code, err in launch("metal", "refused", O1B_TEST_FAULTY="1"):
        assert code == 3 and "workers cannot start: rank 1: --backend metal:" in err, err[-3000:]
        assert "failed the self-test" in err and "exp: exp/0" in err, err[-3000:]
    for code, err in launch("auto", "mixed"):
        assert code == 2 and "workers disagree" in err and "rank 1: backend 'metal' (rank 0: 'cpu_ref')" in err, \
            err[-3000:]
    assert not (tmp_path / "refused").exists() and not (tmp_path / "mixed").exists()


# ------------------------------------------------------------------------- faults of the modelled fp32 unit
def test_emulated_cuda_division_toward_zero_fails_the_quick_set():
    with cuda_emu.hardware(fault="div_rz"), S.assume_hardware("cuda"):
        with pytest.raises(S.SelftestRefused, match="--backend cuda: .*failed the self-test") as e:
            S.first_contact("cuda")
        rep = S.run_backend("cuda", GOLDEN, select=lambda gc: gc.kind == "edge")
    assert "edge/div_tiny_overflow" in S.describe_failure(rep.ops["scalar_div"].first)
    assert {"scalar_div", "sigmoid", "rsqrt"} <= set(rep.failed_ops)


def test_emulated_contraction_fails_the_canaries_on_both_gpu_backends():
    canaries = lambda gc: gc.name in ("exp_fma_canary_tiny", "linear_fma_canary")     # noqa: E731
    for emu, name in ((cuda_emu, "cuda"), (metal_emu, "metal")):
        with emu.hardware(fault="fma"):
            rep = S.run_backend(name, GOLDEN, select=canaries)
        assert rep.failed_ops == ["exp", "linear_forward"], name
        assert "linear_fma_canary: y[2, 2] = " in S.describe_failure(rep.ops["linear_forward"].first)


def test_contraction_fault_through_the_first_contact(monkeypatch, cache):
    """A unit that fuses multiply-adds, met at first contact: --backend auto falls back to
    cpu_ref, an explicit backend is refused; both name the op and the canary case."""
    canaries = lambda gc: gc.name in ("exp_fma_canary_tiny", "linear_fma_canary")     # noqa: E731
    _narrow(monkeypatch, canaries)
    for emu, name in ((cuda_emu, "cuda"), (metal_emu, "metal")):
        with emu.hardware(fault="fma"), S.assume_hardware(name):
            log = []
            assert S.first_contact("auto", log=log.append) == "cpu_ref"
            assert f"warning: {name}" in log[-1] and "First difference: exp: edge/exp_fma_canary_tiny" in log[-1]
            with pytest.raises(S.SelftestRefused, match=f"--backend {name}: .*First difference: exp: "
                                                        "edge/exp_fma_canary_tiny"):
                S.first_contact(name)
    assert not cache.exists() or not list(cache.iterdir())


def test_a_unit_that_flushes_to_plus_zero_leaves_both_emulators_passing():
    """Immunity, stated: a unit that returns +0 for every tiny result whatever its sign changes no
    bit, because the contract flushes tiny results itself and re-signs every flushed zero from the
    operands (cuda/contract.cuh, metal/contract.metal), so the edge cases built on negative tiny
    results (mul_tiny, div_tiny_overflow, add/sub_tiny, exp and sigmoid near 2^-126, ...) pass."""
    for emu, name in ((cuda_emu, "cuda"), (metal_emu, "metal")):
        with emu.hardware(fault="flush_unsigned"):
            rep = S.run_backend(name, GOLDEN, select=lambda gc: gc.kind == "edge")
        assert rep.ok and rep.cases == len(E.names()), (name, rep.first_failure())


def test_metal_division_is_immune_to_a_faulty_divider():
    """Metal divides in integers (CONTRACT.md §3), so the modelled divider's rounding never shows."""
    divides = lambda gc: gc.name in ("div_tiny_overflow", "sigmoid_divisor_above_2^126", "rsqrt_subnormal")  # noqa
    with metal_emu.hardware(fault="div_rz"):
        assert S.run_backend("metal", GOLDEN, select=divides).ok


def test_cli_with_an_emulated_faulty_cuda_unit(tmp_path, default_corpus):
    """The whole quick set on CUDA's modelled unit with division rounded toward zero: --backend
    auto trains on cpu_ref, --backend cuda is refused before the run directory exists."""
    r = CliRunner()
    with cuda_emu.hardware(fault="div_rz"), S.assume_hardware("cuda"):
        res = _train(r, tmp_path / "refused", default_corpus, "cuda")
        assert res.exit_code == 3 and "--backend cuda" in res.output and not (tmp_path / "refused").exists()
        res = _train(r, tmp_path / "auto", default_corpus, "auto")
        assert res.exit_code == 0 and "warning: cuda" in res.output and "backend cpu_ref" in res.output
