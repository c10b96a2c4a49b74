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


@functools.lru_cache(maxsize=1)
def _cuda_device() -> tuple[bool, str]:
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
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return True, f"CUDA device 0: {name} (cupy {cupy.__version__})"


def real_cuda() -> bool:
    """True when kernels run on a GPU through CuPy (and emulation is not forced)."""
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


def load(filename: str, directory: pathlib.Path | str | None = None) -> CudaModule:
    """The module of one .cu file, built once per (file, directory, runtime) and reused."""
    key = (filename, str(directory), real_cuda(), emu._settings["ftz"], emu._settings["ucontext"])
    mod = _modules.get(key)
    if mod is None:
        mod = CudaModule(read_source(filename, directory), OPTIONS, name=filename)
        _modules[key] = mod
    return mod
