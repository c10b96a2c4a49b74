"""Loading the CUDA kernel sources: cupy.RawModule on a CUDA machine, the emulator elsewhere.

`CudaModule(source_text, options, name)` has cupy.RawModule's shape: `.get_function(kernel)` returns
a callable `(grid, block, args, shared_mem=0)`. With CuPy and a GPU it *is* a cupy.RawModule; on any
other machine (or inside `emulate()`) it runs the same text on the CPU emulator (cuda/emu).

Options passed to NVRTC (OPTIONS): `-std=c++17` (hex float literals) and `--fmad=false`. The
kernels already never contract — every float operation is an explicit __fadd_rn/__fmul_rn/...
intrinsic, which NVCC/NVRTC never fuse — so --fmad=false is a second guard against any plain float
expression slipping in. CuPy adds -ftz=true itself; the contract helpers give the same bits
either way (contract.cuh).

Sources are self-contained strings: `read_source(file)` inlines the local `#include "x.cuh"` lines
with #line markers, so compiler messages (nvrtc or g++) name the original file and line.
"""
from __future__ import annotations

import contextlib
import functools
import pathlib
import re

from . import emu

SOURCE_DIR = pathlib.Path(__file__).resolve().parent
OPTIONS = ("-std=c++17", "--fmad=false")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_force_emulation = [False]


class KernelCompileError(RuntimeError):
    """A kernel source did not compile; the message names the file and holds the compiler output."""


def read_source(filename: str, directory: pathlib.Path | str | None = None) -> str:
    """The text of a .cu file with its local includes inlined (each once), with #line markers."""
    directory = pathlib.Path(directory) if directory is not None else SOURCE_DIR
    return read_source_text((directory / filename).read_text(), filename, directory)


def read_source_text(text: str, name: str, directory: pathlib.Path | str | None = None) -> str:
    """`text` (the source of file `name`) with the local includes of `directory` inlined."""
    directory = pathlib.Path(directory) if directory is not None else SOURCE_DIR
    seen: set[str] = set()

    def expand(body: str, fname: str) -> str:
        out = [f'#line 1 "{fname}"']
        for lineno, line in enumerate(body.splitlines(), 1):
            m = _INCLUDE.match(line)
            if m and (directory / m.group(1)).exists():
                if m.group(1) not in seen:
                    seen.add(m.group(1))
                    out.append(expand((directory / m.group(1)).read_text(), m.group(1)))
                out.append(f'#line {lineno + 1} "{fname}"')
            else:
                out.append(line)
        return "\n".join(out)

    return expand(text, name) + "\n"


# The probe every real-CUDA answer rests on: a one-line kernel compiled by NVRTC with this
# backend's options and run. A driver alone lists the device, but CuPy >= 14 compiles nothing
# without the CUDA headers and NVRTC, so a device count is not enough.
_PROBE = (r'extern "C" __global__ void o1b_probe(float* x) '
          r'{ x[threadIdx.x] = __fadd_rn(x[threadIdx.x], 1.0f); }')


def _probe_kernel(cupy) -> str | None:
    """None when a kernel compiles and runs on device 0 with the right answer, else why not."""
    try:
        x = cupy.zeros(32, cupy.float32)
        cupy.RawKernel(_PROBE, "o1b_probe", options=OPTIONS)((1,), (32,), (x,))
        got = float(x.sum())
    except Exception as e:  # noqa: BLE001 - CompileException, a missing libnvrtc, a driver error
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first}"
    return None if got == 32.0 else f"the probe kernel computed {got}, not 32.0"


@functools.lru_cache(maxsize=1)
def _cuda_device() -> tuple[bool, str]:
    """(usable, why): CuPy lists a CUDA device and compiles and runs a kernel on it. Probed once
    per process."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install
        return False, f"cupy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"cupy found no CUDA device ({type(e).__name__}: {e})"
    if n < 1:
        return False, "cupy found no CUDA device"
    try:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    except Exception as e:  # noqa: BLE001
        return False, f"cupy lists {n} CUDA device(s) but cannot query device 0 ({type(e).__name__}: {e})"
    why = _probe_kernel(cupy)
    if why is not None:
        return False, (f"cupy lists {n} CUDA device(s) ({name}) but cannot compile and run a kernel ({why}); "
                       "CuPy >= 14 needs NVRTC and the CUDA headers: a CUDA toolkit, or pip install "
                       "'cupy-cuda13x[ctk]' (cupy-cuda12x[ctk] for CUDA 12)")
    return True, f"CUDA device 0: {name} (cupy {cupy.__version__})"


def cuda_status() -> tuple[bool, str]:
    """(a GPU runs the kernels, why or which): the device probe, ignoring emulate()."""
    return _cuda_device()


def real_cuda() -> bool:
    """True when kernels run on a GPU through CuPy (a device that compiled and ran the probe
    kernel) and emulation is not forced."""
    return not _force_emulation[0] and _cuda_device()[0]


def describe() -> tuple[bool, str]:
    """(usable, how): a real GPU, the emulator, or why neither."""
    if real_cuda():
        return True, _cuda_device()[1]
    ok, where = emu.compiler_available()
    if not ok:
        return False, f"no CUDA device ({_cuda_device()[1]}) and no emulator ({where})"
    return True, f"emulated on the CPU with {where} ({_cuda_device()[1]})"


@contextlib.contextmanager
def emulate():
    """Run kernels on the emulator inside this block even where a GPU exists (race checks,
    mutated sources)."""
    old = _force_emulation[0]
    _force_emulation[0] = True
    try:
        yield
    finally:
        _force_emulation[0] = old


class CudaModule:
    def __init__(self, source_text: str, options: tuple = OPTIONS, name: str = "<source>"):
        self.name, self.source = name, source_text
        self.emulated = not real_cuda()
        if self.emulated:
            try:
                self._mod = emu.EmuModule(source_text, name=name)
            except emu.EmuCompileError as e:
                raise KernelCompileError(str(e)) from None
        else:
            import cupy
            self._mod = cupy.RawModule(code=source_text, options=tuple(options))
        self._functions: dict = {}

    def get_function(self, kernel: str):
        fn = self._functions.get(kernel)
        if fn is None:
            if self.emulated:
                fn = self._mod.get_function(kernel)
            else:
                try:                     # RawModule compiles lazily, on the first get_function
                    fn = self._mod.get_function(kernel)
                except Exception as e:
                    if type(e).__name__ == "CompileException":
                        raise KernelCompileError(f"nvrtc failed to compile {self.name} "
                                                 f"(kernel {kernel}):\n{e}") from None
                    raise
            self._functions[kernel] = fn
        return fn


_modules: dict = {}


def load(filename: str, directory: pathlib.Path | str | None = None, defines: tuple = ()) -> CudaModule:
    """The module of one .cu file, built once per (file, directory, defines, runtime) and reused.
    `defines`: (name, value) pairs written as #define lines before the source (compile-time
    constants such as attention.cu's head dim)."""
    defines = tuple((str(n), int(v)) for n, v in defines)
    key = (filename, str(directory), defines, real_cuda(), emu._settings["ftz"], emu.use_ucontext())
    mod = _modules.get(key)
    if mod is None:
        text = "".join(f"#define {n} {v}\n" for n, v in defines) + read_source(filename, directory)
        name = filename + "".join(f" [{n}={v}]" for n, v in defines)
        mod = CudaModule(text, OPTIONS, name=name)
        _modules[key] = mod
    return mod
