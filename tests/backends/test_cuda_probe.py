"""--backend auto picks cuda only where CuPy compiles and runs a kernel: a device count alone is not
enough (a bare-driver box lists the GPU, yet CuPy >= 14 cannot compile without NVRTC and the CUDA
headers). A fake cupy module stands in for both kinds of box."""
import sys
import types

import numpy as np
import pytest
from click.testing import CliRunner

from mlx_open1b.cuda import runtime
from mlx_open1b.train import resolve_backend


class CompileException(Exception):
    """cupy.cuda.compiler.CompileException's name (runtime matches no type, any failure counts)."""


def fake_cupy(compiles: bool, answer: float = 1.0):
    """A cupy with one CUDA device whose RawKernel launch fails to compile, or adds `answer`."""
    m = types.ModuleType("cupy")
    m.__version__ = "14.2.0 (fake)"
    m.float32 = np.float32
    m.zeros = lambda n, dtype: np.zeros(n, dtype)
    m.launches = []

    class RawKernel:
        def __init__(self, code, name, options=()):
            self.code, self.name, self.options = code, name, options

        def __call__(self, grid, block, args):          # CuPy compiles on the first launch
            m.launches.append((self.name, self.options))
            if not compiles:
                raise CompileException("nvrtc: error: failed to open libnvrtc-builtins.so.13.0")
            args[0][:] += np.float32(answer)

    m.RawKernel = RawKernel
    rt = types.SimpleNamespace(getDeviceCount=lambda: 1, getDeviceProperties=lambda i: {"name": b"Fake H200"})
    m.cuda = types.SimpleNamespace(runtime=rt)
    return m


@pytest.fixture
def probe(monkeypatch):
    """Install a fake cupy; the per-process probe cache is cleared before and after."""
    def install(**kw):
        m = fake_cupy(**kw)
        monkeypatch.setitem(sys.modules, "cupy", m)
        runtime._cuda_device.cache_clear()
        return m
    yield install
    runtime._cuda_device.cache_clear()


def test_device_that_cannot_compile_is_not_picked(probe):
    cp = probe(compiles=False)
    assert resolve_backend("auto") == "cpu_ref"
    ok, why = runtime.cuda_status()
    assert not ok and "lists 1 CUDA device(s) (Fake H200) but cannot compile and run a kernel" in why
    assert "CompileException: nvrtc: error: failed to open libnvrtc-builtins" in why and "[ctk]" in why
    assert not runtime.real_cuda()
    # the explicit backend says it runs emulated, and why
    ok, how = runtime.describe()
    assert "emulated on the CPU" in how and "cannot compile" in how
    assert resolve_backend("auto") == "cpu_ref" and len(cp.launches) == 1      # probed once per process
    assert cp.launches[0] == ("o1b_probe", runtime.OPTIONS)                    # with the backend's options


def test_device_that_compiles_is_picked(probe):
    cp = probe(compiles=True)
    assert resolve_backend("auto") == "cuda"
    assert runtime.real_cuda() and runtime.cuda_status() == (True, "CUDA device 0: Fake H200 (cupy 14.2.0 (fake))")
    with runtime.emulate():
        assert not runtime.real_cuda()
    assert resolve_backend("auto") == "cuda" and len(cp.launches) == 1


def test_wrong_answer_is_not_picked(probe):
    probe(compiles=True, answer=2.0)
    assert resolve_backend("auto") == "cpu_ref"
    assert "the probe kernel computed 64.0, not 32.0" in runtime.cuda_status()[1]


def test_info_says_why_cuda_was_not_picked(probe):
    from mlx_open1b.cli.main import cli
    probe(compiles=False)
    r = CliRunner().invoke(cli, ["info"])
    assert r.exit_code == 0, r.output
    assert "default (--backend auto): cpu_ref" in r.output
    assert "cuda not picked: cupy lists 1 CUDA device(s) (Fake H200) but cannot compile" in r.output
    probe(compiles=True)
    r = CliRunner().invoke(cli, ["info"])
    assert "default (--backend auto): cuda" in r.output and "not picked" not in r.output
