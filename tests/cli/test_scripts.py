"""scripts/device_check.sh and scripts/mac_check.sh: they parse, say how they are used, name
everything missing before any long work (with how to bring it to an offline machine), and, in
their emulated dry runs, go through every stage to a PASS with a timing table."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from data_helpers import make_corpus

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = {"device_check": ROOT / "scripts" / "device_check.sh", "mac_check": ROOT / "scripts" / "mac_check.sh"}
EMULATED = {"device_check": "O1B_DEVICE_CHECK_EMULATED", "mac_check": "O1B_MAC_CHECK_EMULATED"}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(script, *args, env=None, timeout=120):
    e = {k: v for k, v in os.environ.items() if not k.startswith("O1B_") and k != "OUT"}
    e.update({"PYTHON": sys.executable, **(env or {})})
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=e, timeout=timeout)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("scripts") / "corpus"
    make_corpus(d, {"web": (0.6, 8, 10), "code": (0.4, 6, 12)})
    return d


@pytest.fixture
def blocked_python(tmp_path):
    """A PYTHON that cannot import the named top-level modules (as on a machine without them)."""
    def make(*modules):
        site = tmp_path / "block"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(
            "import sys\n"
            f"_BLOCK = {set(modules)!r}\n"
            "class _Blocker:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in _BLOCK:\n"
            "            raise ImportError(f'No module named {name!r} (blocked)')\n"
            "sys.meta_path.insert(0, _Blocker())\n")
        py = tmp_path / "python-without"
        py.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
        py.chmod(0o755)
        return str(py)
    return make


# ------------------------------------------------------------------------------ cheap
@pytest.mark.parametrize("name", ["device_check", "mac_check"])
def test_parses_and_says_how_it_is_used(name):
    for f in (SCRIPTS[name], ROOT / "scripts" / "check_lib.sh"):
        r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    r = run(SCRIPTS[name], "--help")
    assert r.returncode == 0 and "Usage: scripts/" in r.stdout and "--preflight-only" in r.stdout
    assert EMULATED[name] in r.stdout and "O1B_DATA" in r.stdout and "O1B_WHEELS" in r.stdout
    assert not r.stdout.startswith("#") and "set -uo" not in r.stdout
    r = run(SCRIPTS[name], "--bogus")
    assert r.returncode == 2 and f"{name}: unknown argument --bogus" in r.stderr
    r = run(SCRIPTS[name], env={"O1B_SELFTEST": "always"})
    assert r.returncode == 2 and "O1B_SELFTEST=always (expected full, quick or skip)" in r.stderr


@pytest.mark.parametrize("name", ["device_check", "mac_check"])
def test_missing_python(tmp_path, name):
    r = run(SCRIPTS[name], env={"PYTHON": str(tmp_path / "no-python"), "O1B_RESULTS": str(tmp_path / "res")})
    assert r.returncode == 3
    assert f"{name}: FAILED: PYTHON={tmp_path / 'no-python'}: not found" in r.stderr
    assert (tmp_path / "res" / "FAILED").exists()


@pytest.mark.parametrize("name", ["device_check", "mac_check"])
def test_missing_corpus_is_named_before_any_work(tmp_path, name):
    res = tmp_path / "res"
    r = run(SCRIPTS[name], env={EMULATED[name]: "1", "O1B_SKIP_INSTALL": "1", "O1B_DATA": str(tmp_path / "nowhere"),
                                "O1B_RESULTS": str(res)})
    out = r.stdout + r.stderr
    assert r.returncode == 3, out
    assert f"corpus (O1B_DATA): {tmp_path / 'nowhere'}: no such file or directory" in out
    assert "open1b data prepare --default --out DIR && tar -cJf open1b-data.tar.xz -C DIR ." in out
    assert "set O1B_DATA=open1b-data.tar.xz" in out
    assert "cannot start" in r.stderr
    assert not (res / "rc").exists() and out.count("== [") == 1          # nothing after the preflight


def test_corpus_directory_or_archive(tmp_path, corpus):
    name = "device_check"
    env = {EMULATED[name]: "1", "O1B_SKIP_INSTALL": "1", "O1B_RESULTS": str(tmp_path / "res")}
    r = run(SCRIPTS[name], "--preflight-only", env={**env, "O1B_DATA": str(corpus)})
    assert r.returncode == 0 and "preflight passed" in r.stdout, r.stdout + r.stderr
    archive = tmp_path / "corpus.tar.xz"
    with tarfile.open(archive, "w:xz") as t:
        t.add(corpus, arcname=".")
    r = run(SCRIPTS[name], "--preflight-only", env={**env, "O1B_DATA": str(archive)})
    assert r.returncode == 0, r.stdout + r.stderr
    (tmp_path / "empty").mkdir()
    for bad, why in ((tmp_path / "empty", "not a prepared corpus (no manifest.json in it)"),
                     (tmp_path / "corpus.txt", "neither a corpus directory nor a readable tar archive")):
        if bad.suffix:
            bad.write_text("hello")
        r = run(SCRIPTS[name], "--preflight-only", env={**env, "O1B_DATA": str(bad)})
        assert r.returncode == 3 and f"{bad}: {why}" in r.stdout + r.stderr, r.stdout + r.stderr


def test_missing_packages_are_named_with_how_to_bring_them(tmp_path, corpus, blocked_python):
    """A machine without pyarrow and tokenizers: with a prepared corpus only pyarrow is needed (the
    run imports it), and an O1B_WHEELS folder without it fails the preflight naming it; without a
    corpus, tokenizers is needed too (to prepare one)."""
    py = blocked_python("pyarrow", "tokenizers")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env = {"PYTHON": py, EMULATED["device_check"]: "1", "O1B_SKIP_INSTALL": "1", "O1B_RESULTS": str(tmp_path / "r"),
           "O1B_WHEELS": str(wheels)}
    r = run(SCRIPTS["device_check"], "--preflight-only", env={**env, "O1B_DATA": str(corpus)})
    out = r.stdout + r.stderr
    assert r.returncode == 3, out
    assert "pyarrow: import pyarrow fails" in out and f"no pyarrow wheel in O1B_WHEELS={wheels}" in out
    assert "  - tokenizers" not in out
    assert "--python-version %d.%d 'pyarrow>=14'" % sys.version_info[:2] in out
    r = run(SCRIPTS["device_check"], "--preflight-only", env={**env, "O1B_DATA": ""})   # none, even if .device/ has one
    out = r.stdout + r.stderr
    assert r.returncode == 3 and "tokenizers: import tokenizers fails" in out
    assert "needed only to prepare the default corpus; or set O1B_DATA" in out
    # a wheel in O1B_WHEELS: the preflight passes, and the install stage is told what to install
    (wheels / "pyarrow-99.0-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"")
    r = run(SCRIPTS["device_check"], "--preflight-only", env={**env, "O1B_DATA": str(corpus)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-> pip install from O1B_WHEELS" in r.stdout
    assert (tmp_path / "r" / "missing.txt").read_text() == "pyarrow>=14\n"


def test_real_device_required_without_the_dry_run(tmp_path, corpus):
    env = {"O1B_SKIP_INSTALL": "1", "O1B_DATA": str(corpus), "O1B_RESULTS": str(tmp_path / "r")}
    try:
        import cupy  # noqa: F401
        has_cupy = True
    except Exception:  # noqa: BLE001
        has_cupy = False
    if not has_cupy:
        r = run(SCRIPTS["device_check"], "--preflight-only", env=env)
        assert r.returncode == 3 and "cupy: import cupy fails" in r.stdout + r.stderr
    import platform
    if not (platform.system() == "Darwin" and platform.machine() == "arm64"):
        r = run(SCRIPTS["mac_check"], "--preflight-only", env=env)
        out = r.stdout + r.stderr
        assert r.returncode == 3 and "  - Apple silicon: " in out and "O1B_MAC_CHECK_EMULATED=1" in out


def test_carried_folder_is_found(tmp_path, corpus):
    """A checkout with .device/data.tar.xz and .device/wheels uses them without being told."""
    co = tmp_path / "checkout"
    (co / "metal").mkdir(parents=True)
    shutil.copytree(ROOT / "scripts", co / "scripts")
    shutil.copy(ROOT / "pyproject.toml", co)
    shutil.copy(ROOT / "metal" / "runtime.py", co / "metal")
    (co / ".device" / "wheels").mkdir(parents=True)
    with tarfile.open(co / ".device" / "data.tar.xz", "w:xz") as t:
        t.add(corpus, arcname=".")
    r = run(co / "scripts" / "device_check.sh", "--preflight-only",
            env={EMULATED["device_check"]: "1", "O1B_SKIP_INSTALL": "1", "O1B_RESULTS": str(tmp_path / "r")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"O1B_DATA={co}/.device/data.tar.xz (found in .device/)" in r.stdout
    assert f"O1B_WHEELS={co}/.device/wheels (found in .device/)" in r.stdout


def _reports(res, backend, la, lb, **codes):
    (res / "rc").mkdir(parents=True)
    for k, v in {"parity": 0, "export": 0, "compare": 0, "microbatch": 0, **codes}.items():
        (res / "rc" / k).write_text(f"{v}\n")
    for name, ledger in (("cpu_ref", la), (backend, lb)):
        (res / f"bundle-{name}.json").write_text(json.dumps({"training": {"ledger": ledger, "run_hash": "ab" * 32}}))
    (res / "parity.json").write_text(json.dumps({"ops": {"add": {"mismatches": 0}}, "total_cases": 3,
                                                 "total_mismatches": 0}))
    (res / "microbatch.json").write_text(json.dumps({"kind": "mlx", "same": True, "model": "tiny", "windows": 4,
                                                     "ms": {"device": 2.0, "numpy_io": 3.0, "cpu_ref": 10.0}}))
    (res / "timings.tsv").write_text("parity: metal vs cpu_ref\t12\n")


def test_summary_fails_on_any_difference(tmp_path):
    """The table passes only when every stage passed: a ledger record that differs, or a stage's
    nonzero exit, fails it."""
    summary = [sys.executable, str(ROOT / "scripts" / "check_summary.py"), "--who", "mac_check", "--backend", "metal"]
    recs = [{"step": 0, "hash": "a"}, {"step": 1, "hash": "b"}]
    _reports(tmp_path / "same", "metal", recs, recs)
    r = subprocess.run(summary + [str(tmp_path / "same")], capture_output=True, text=True)
    assert r.returncode == 0 and "RESULT: PASS, metal is bit-identical to cpu_ref" in r.stdout, r.stdout + r.stderr
    assert "    12 s  parity: metal vs cpu_ref" in r.stdout and "(cpu_ref / metal: 5.00x)" in r.stdout
    assert "2/2 records identical" in r.stdout
    _reports(tmp_path / "differs", "metal", recs, [recs[0], {"step": 1, "hash": "c"}])
    r = subprocess.run(summary + [str(tmp_path / "differs")], capture_output=True, text=True)
    assert r.returncode == 1 and "1/2 records identical" in r.stdout and "RESULT: FAIL" in r.stdout
    _reports(tmp_path / "selftest", "metal", recs, recs, selftest=1)
    r = subprocess.run(summary + [str(tmp_path / "selftest")], capture_output=True, text=True)
    assert r.returncode == 1 and re.search(r"selftest --backend metal +FAIL", r.stdout), r.stdout


# ------------------------------------------------------------------------------ the dry runs
@pytest.mark.slow
@pytest.mark.parametrize("name,backend", [("device_check", "cuda"), ("mac_check", "metal")])
def test_emulated_dry_run_passes_every_stage(tmp_path, default_corpus, name, backend):
    """Every stage on the CPU emulator, with tiny sizes (two ops, one case, one step, the quick
    selftest): each stage passes and is in the table with its time. The selftest's verdict is the
    golden file's (mlx_open1b/golden): the script's exit status follows it."""
    res = tmp_path / "res"
    r = run(SCRIPTS[name], timeout=1200,
            env={EMULATED[name]: "1", "O1B_SKIP_INSTALL": "1", "O1B_DATA": str(default_corpus), "O1B_RESULTS": str(res),
                 "O1B_CASES": "1", "O1B_STEPS": "1", "O1B_EXPORT_CASES": "1", "O1B_OPS": "add,rmsnorm_forward"})
    s = (res / "summary.txt").read_text()
    rows = dict(re.findall(r"^  (\S.*?)  +(ok|PASS|FAIL|SKIP)  ", s, re.M))
    want = [f"parity {backend} vs cpu_ref (2 ops)", f"ledger, tiny preset, 1 steps, {backend} vs cpu_ref",
            "bundle compare (op hashes + ledger)", "model program on device arrays"]
    if name == "device_check":
        want.append("distributed, 1 worker (gloo), cuda backend")
    for row in want:
        assert rows.get(row) == "PASS", s + r.stderr[-3000:]
    selftest = rows.get(f"selftest --backend {backend}")
    assert selftest in ("PASS", "FAIL"), s
    assert (r.returncode == 0) == (selftest == "PASS") and r.returncode in (0, 1), s
    assert ("RESULT: PASS, %s is bit-identical to cpu_ref" % backend in s) == (selftest == "PASS")
    assert "one microbatch (micro model, int8, 1 windows)" in s and "tiny preset, 1 steps on cpu_ref" in s


def test_preflight_versions_follow_pep440_like_pip():
    """The preflight refuses what pip's '>=' refuses: pre-releases and dev builds of the minimum
    release are older than it (PEP 440); later ones, releases and local tags are fine."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("preflight", ROOT / "scripts" / "preflight.py")
    pf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pf)
    packaging = pytest.importorskip("packaging.specifiers")
    spec_ge = packaging.SpecifierSet(">=0.32", prereleases=False)
    for have in ("0.32.0", "0.32.0rc1", "0.32.0.dev2+g12ab", "0.31.9", "0.32.4", "0.33.0", "1.0", "0.32.0b1",
                 "0.32.1+local"):
        assert pf.satisfies(have, ">=", "0.32") == (have in spec_ge), have
    assert pf.satisfies("1.14.0", "==", "1.14.0") and not pf.satisfies("1.14.0rc1", "==", "1.14.0")
