"""The metal backend's MLX requirement: mlx >= 0.32 (compile_options with math_mode 'safe', kernels
cached by their source), read from mx.__version__ by PEP 440's order (pip's 'mlx>=0.32' refuses
0.32.0's pre-releases and development builds, and so does the runtime) and confirmed on the feature
(mx.fast.metal_kernel takes compile_options); installed with the package on Apple silicon; a Mac
with a too-old mlx says why in `open1b info` and when --backend auto passes the GPU over."""
from __future__ import annotations

import pathlib

import pytest

from mlx_open1b.metal import runtime

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text,want", [
    ("0.32.4", (0, 32, 4, True)), ("0.32.0.dev20260115+g1a2b3c4", (0, 32, 0, False)),
    ("0.33.0rc1", (0, 33, 0, False)), ("0.32.0.post1", (0, 32, 0, True)), ("0.32.0.post1.dev2", (0, 32, 0, True)),
    ("v1.0", (1, 0, 0, True)), (" 0.31.9 ", (0, 31, 9, True)), ("0.9.12", (0, 9, 12, True)),
    ("0.32.0+local", (0, 32, 0, True)), ("0.32.0b2", (0, 32, 0, False)), ("0.32.0-alpha1", (0, 32, 0, False)),
    ("", None), ("dev", None), ("1", None), (None, None),
])
def test_parse_version(text, want):
    assert runtime.parse_version(text) == want


VERSIONS = [
    ("0.32.0", True), ("0.32.4", True), ("0.32.0.post1", True), ("0.32.1.dev3", True), ("0.33.0rc1", True),
    ("0.40.1", True), ("1.0.0", True), ("0.32", True),
    ("0.32.0.dev20260115", False), ("0.32.0.dev20260115+g1a2b3c4", False), ("0.32.0rc1", False),
    ("0.32.0a1", False), ("0.32.0b2", False), ("0.32.0.rc1", False),
    ("0.31.9", False), ("0.25.2", False), ("0.9.40", False), ("unknown", False),
]


@pytest.mark.parametrize("version,ok", VERSIONS)
def test_version_problem_names_the_installed_version(version, ok):
    why = runtime.mlx_version_problem(version)
    assert (why is None) == ok
    if not ok:
        assert repr(version) in why or f"mlx {version} " in why
        assert ">= 0.32" in why and "pip install" in why


def test_version_rule_is_pips():
    """The runtime accepts exactly the versions pip's 'mlx>=0.32' installs (PEP 440; pre-releases
    newer than 0.32.0, which pip installs when asked for them, accepted)."""
    specifiers = pytest.importorskip("packaging.specifiers")
    spec = specifiers.SpecifierSet(">=0.32")
    for version, _ in VERSIONS:
        if version != "unknown":
            pip = spec.contains(version, prereleases=True)
            assert (runtime.mlx_version_problem(version) is None) == pip, version


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
    for v in ("0.32.0", "0.32.1.dev3+g1a2b3c4", "0.32.4"):
        fake_metal(v)
        ok, why = runtime.available()
        assert ok and f"mlx {v}" in why


def test_pre_release_of_the_minimum_is_refused(fake_metal):
    for v in ("0.32.0.dev20260115+g1a2b3c4", "0.32.0rc1"):
        fake_metal(v)
        ok, why = runtime.available()
        assert not ok and f"mlx {v} is installed" in why


def _old_metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                      atomic_outputs=False):
    raise AssertionError("not reached: refused before construction")


class _Nanobind:
    """A nanobind function as mlx's: no Python signature, the signature on the docstring's first line."""
    __signature__ = property(lambda self: (_ for _ in ()).throw(ValueError("not supported")))

    def __init__(self, doc, error=None):
        self.__doc__, self.error = doc, error

    def __call__(self, **kw):
        raise self.error


def test_metal_kernel_without_compile_options_is_refused(fake_metal, monkeypatch):
    """A new-enough version number whose mx.fast.metal_kernel takes no compile_options (a development
    build from before the option) is refused by its signature, Python or nanobind, or at construction
    with a clear error where the signature says nothing."""
    import mlx.core as mx
    fake_metal("0.32.4")
    assert runtime.mlx_problem(mx) is None                        # the installed mlx has the option
    old_doc = ("metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str, "
               "header: str = '', ensure_row_contiguous: bool = True, atomic_outputs: bool = False) -> object\n\n"
               "A jit-compiled custom Metal kernel")
    for fn in (_old_metal_kernel, _Nanobind(old_doc)):
        monkeypatch.setattr(mx.fast, "metal_kernel", fn)
        ok, why = runtime.available()
        assert not ok and "mlx 0.32.4: mx.fast.metal_kernel takes no compile_options" in why and "pip install" in why
        with pytest.raises(RuntimeError, match="takes no compile_options"):
            runtime.MetalKernel("k", ["x"], ["y"], "y[0] = x[0];", runtime.header())
    silent = _Nanobind("", TypeError("metal_kernel(): incompatible function arguments. The following argument "
                                     "types are supported: ..."))
    monkeypatch.setattr(mx.fast, "metal_kernel", silent)
    assert runtime.available()[0]                                  # nothing to tell from the signature
    with pytest.raises(RuntimeError, match=r"mlx 0\.32\.4: mx.fast.metal_kernel takes no compile_options.*"
                                           r"incompatible function arguments"):
        runtime.MetalKernel("k", ["x"], ["y"], "y[0] = x[0];", runtime.header())


def test_info_and_auto_name_the_problem(fake_metal, monkeypatch, capsys):
    """On a Mac with a too-old mlx, `open1b info` shows metal unavailable with the reason, and
    --backend auto says in one line on stderr (once) why it passes the GPU over."""
    import mlx.core as mx
    from click.testing import CliRunner
    from mlx_open1b.cli.main import cli
    from mlx_open1b import backend
    fake_metal("0.31.2")
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(backend, "_WARNED", set())
    assert backend.resolve("auto") in ("cpu_ref", "cuda")
    assert backend.resolve("auto") in ("cpu_ref", "cuda")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: --backend auto does not use the Metal GPU: mlx 0.31.2 is installed")
    out = CliRunner().invoke(cli, ["info"]).output
    (row,) = [line for line in out.splitlines() if line.strip().startswith("metal ")]
    assert "unavailable" in row and "mlx 0.31.2 is installed" in row and ">= 0.32" in row, row


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
