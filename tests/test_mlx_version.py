"""The metal backend's MLX requirement: mlx >= 0.32 (compile_options with math_mode 'safe', kernels
cached by their source), read from mx.__version__; installed with the package on Apple silicon."""
from __future__ import annotations

import pathlib

import pytest

from mlx_open1b.metal import runtime

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text,want", [
    ("0.32.4", (0, 32, 4)), ("0.32.0.dev20260115+g1a2b3c4", (0, 32, 0)), ("0.33.0rc1", (0, 33, 0)),
    ("v1.0", (1, 0, 0)), (" 0.31.9 ", (0, 31, 9)), ("0.9.12", (0, 9, 12)),
    ("", None), ("dev", None), ("1", None), (None, None),
])
def test_parse_version(text, want):
    assert runtime.parse_version(text) == want


@pytest.mark.parametrize("version,ok", [
    ("0.32.0", True), ("0.32.4", True), ("0.32.0.dev20260115", True), ("0.40.1", True), ("1.0.0", True),
    ("0.31.9", False), ("0.25.2", False), ("0.9.40", False), ("unknown", False),
])
def test_version_problem_names_the_installed_version(version, ok):
    why = runtime.mlx_version_problem(version)
    assert (why is None) == ok
    if not ok:
        assert repr(version) in why or f"mlx {version} " in why
        assert ">= 0.32" in why and "pip install" in why


@pytest.fixture
def fake_metal(monkeypatch):
    """mlx as found on a Mac: real_metal() true; mx.__version__ set by the test."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx-open1b[metal]')")
    monkeypatch.setattr(runtime, "real_metal", lambda: True)
    return lambda v: monkeypatch.setattr(mx, "__version__", v)


def test_too_old_mlx_is_refused_with_its_version(fake_metal):
    fake_metal("0.31.2")
    ok, why = runtime.available()
    assert not ok and "mlx 0.31.2 is installed" in why and ">= 0.32" in why
    with pytest.raises(RuntimeError, match=r"mlx 0\.31\.2 is installed.*>= 0\.32"):
        runtime.MetalKernel("k", ["x"], ["y"], "y[0] = x[0];", runtime.header())
    from mlx_open1b.train import TrainError, get_backend
    with pytest.raises(TrainError, match=r"backend 'metal' is not available here: mlx 0\.31\.2") as e:
        get_backend("metal")
    assert e.value.exit_code == 2


def test_new_enough_mlx_is_accepted(fake_metal):
    for v in ("0.32.0.dev20260115+g1a2b3c4", "0.32.4"):
        fake_metal(v)
        ok, why = runtime.available()
        assert ok and f"mlx {v}" in why


def _requirements(section):
    packaging = pytest.importorskip("packaging.requirements")
    return [packaging.Requirement(r) for r in section]


@pytest.mark.parametrize("where", ["dependencies", "metal extra"])
def test_pyproject_installs_mlx_on_apple_silicon(where):
    tomllib = pytest.importorskip("tomllib")           # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = _requirements(meta["dependencies"] if where == "dependencies" else meta["optional-dependencies"]["metal"])
    mac = {"sys_platform": "darwin", "platform_machine": "arm64"}
    intel_mac = {"sys_platform": "darwin", "platform_machine": "x86_64"}
    linux = {"sys_platform": "linux", "platform_machine": "x86_64"}
    on = lambda env: [r for r in reqs if r.name == "mlx" and (r.marker is None or r.marker.evaluate(env))]
    (r,) = on(mac)                                   # exactly one mlx requirement on Apple silicon
    assert r.specifier.contains("0.32.0") and not r.specifier.contains("0.31.9") and not r.extras
    assert on(intel_mac) == []                       # no mlx wheels for Intel Macs
    if where == "dependencies":
        assert on(linux) == []                       # the core install needs no mlx off the Mac
    else:
        (r,) = on(linux)                             # the CPU build: device-array mode and binding tests
        assert r.extras == {"cpu"} and r.specifier.contains("0.32.0") and not r.specifier.contains("0.31.9")
