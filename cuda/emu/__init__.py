"""The CUDA emulator: runs the exact .cu source text of cuda/ on a CPU.

The source is compiled with g++ (-O2 -ffp-contract=off -fno-fast-math, no -march) after a prelude
(prelude.h) that maps the CUDA kernel environment onto C++: thread/block indices, __shared__
arrays, a faithful __syncthreads() (the threads of a block are cooperative fibers), warp-collective
steps (emu_warp_sync, on which imma.cuh models the tensor-core instruction), and the intrinsics the
contract allows. Kernels are launched like cupy.RawKernel: `fn(grid, block, args)`
with numpy arrays in place of cupy arrays and numpy scalars of the kernel's parameter types; blocks
run one after another.

Race check: `options(race_check=True)` runs every launch twice — threads scheduled in thread order
and in reverse order (at each barrier phase; the blocks too, last to first) on copies of the arrays
— and raises EmuRaceError if any array differs, which is how a missing __syncthreads shows up (and a
block that reads another's writes in an order the grid does not give).

Planted faults and adversarial flushing: `with emu.hardware(fault=..., adversarial_flush=...,
seed=...):` launches inside the block run on that fp32 unit (mlx_open1b.metal.emu.hwmodel, shared
with the Metal emulator; hwfloat.h implements the single-precision intrinsics). A module keeps one
library per hardware and picks the one of the hardware active at each launch, so no fault or mode
outlives its block whatever module cache a caller keeps.

Work counters (`with counters.counting() as log:`, mlx_open1b.metal.emu.counters, shared with the
Metal emulator): each launch inside the block runs on a separately built, instrumented library and
reports the global bytes it moved and the fp32 intrinsics it applied; outside any block nothing
changes.

Compiled libraries are cached in $XDG_CACHE_HOME/mlx-open1b/emu/<sha256>.so (default ~/.cache),
keyed by the prelude, the source text, the flags and the compiler.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import threading

import numpy as np

from mlx_open1b.metal.emu import counters, fibers, hwmodel

PRELUDE_PATH = pathlib.Path(__file__).resolve().parent / "prelude.h"
CXX = "g++"
CXXFLAGS = ("-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
            "-fno-strict-aliasing", "-fPIC", "-shared", "-w")

_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                        r'([A-Za-z_]\w*)\s*\(')
_SCALARS = {"f4": np.float32, "f8": np.float64, "i4": np.int32, "i8": np.int64, "u4": np.uint32,
            "u8": np.uint64, "i2": np.int16, "u2": np.uint16, "i1": np.int8, "u1": np.uint8}
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}
_settings = {"race_check": False, "ftz": 1, "ucontext": False}


_hardware = hwmodel.Setting()
#: `with emu.hardware(fault=None, adversarial_flush=False, seed=0):` (see hwmodel)
hardware = _hardware.context
FAULTS = hwmodel.FAULTS


class EmuCompileError(RuntimeError):
    """g++ rejected a kernel source; the message names the module and holds g++'s output."""


class EmuLaunchError(RuntimeError):
    """A launch failed: barrier divergence, bad arguments, or out of memory."""


class EmuRaceError(EmuLaunchError):
    """Two thread orders of the same launch gave different results (a missing barrier)."""


@contextlib.contextmanager
def options(race_check: bool | None = None, ftz: int | None = None, ucontext: bool | None = None):
    """Temporarily change the race check, the emulated single-precision flush mode (0 IEEE, 1 flush
    with tininess after rounding, 2 before rounding), or force ucontext fibers where the fast
    x86-64 stack switch would be used. Modules compiled while a setting is active keep it."""
    old = dict(_settings)
    try:
        if race_check is not None:
            _settings["race_check"] = bool(race_check)
        if ftz is not None:
            if ftz not in (0, 1, 2):
                raise ValueError(f"ftz: expected 0, 1 or 2, got {ftz!r}")
            _settings["ftz"] = int(ftz)
        if ucontext is not None:
            _settings["ucontext"] = bool(ucontext)
        yield
    finally:
        _settings.update(old)


def use_ucontext() -> bool:
    """Whether modules compiled now get ucontext fibers: options(ucontext=True), or
    O1B_EMU_UCONTEXT=1 in the environment (as for the Metal emulator)."""
    return _settings["ucontext"] or fibers.ucontext_from_env()


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "mlx-open1b" / "emu"


def compiler_available() -> tuple[bool, str]:
    path = shutil.which(CXX)
    return (True, path) if path else (False, f"{CXX} not found on PATH")


_version_cache: list[str] = []


def _compiler_version() -> str:
    if not _version_cache:
        out = subprocess.run([CXX, "--version"], capture_output=True, text=True)
        _version_cache.append(out.stdout.splitlines()[0] if out.stdout else "unknown")
    return _version_cache[0]


def kernel_names(source: str) -> list[str]:
    return _KERNEL_RE.findall(source)


def _build(source: str, name: str, ftz: int, ucontext: bool,
           hw: hwmodel.Hardware = hwmodel.Hardware(), count: bool = False) -> tuple[ctypes.CDLL, pathlib.Path]:
    kernels = kernel_names(source)
    if not kernels:
        raise EmuCompileError(f"{name}: no `extern \"C\" __global__ void` kernel in the source")
    text = (f"#define EMU_FTZ {ftz}\n"
            + "#define O1B_HW_DAZ (EMU_FTZ != 0)\n#define O1B_HW_FTZ EMU_FTZ\n" + hw.defines()
            + (counters.HOOKS if count else "")
            + hwmodel.hwfloat_text() + fibers.switch_text(ucontext)
            + "#line 1 \"emu/prelude.h\"\n" + PRELUDE_PATH.read_text()
            + (counters.CUDA_OPS if count else "")
            + f"\n#line 1 \"{name}\"\n" + source
            + "\n#line 1 \"<emulator trampolines>\"\n" + "".join(f"EMU_KERNEL({k})\n" for k in kernels))
    flags = CXXFLAGS
    key = hashlib.sha256("\0".join([text, " ".join(flags), _compiler_version()]).encode()).hexdigest()
    with _lock:
        if key in _loaded:
            return _loaded[key], cache_dir() / f"{key}.so"
        out = cache_dir() / f"{key}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="o1b-emu-") as tmp:
                src = pathlib.Path(tmp) / "module.cpp"
                src.write_text(text)
                tmp_so = out.parent / f".{key}.{os.getpid()}.tmp.so"
                proc = (counters.compile_unit(CXX, flags, str(src), str(tmp_so)) if count else
                        subprocess.run([CXX, *flags, "-o", str(tmp_so), str(src)], capture_output=True, text=True))
                if proc.returncode != 0:
                    tmp_so.unlink(missing_ok=True)
                    raise EmuCompileError(
                        f"CUDA emulator: g++ failed to compile {name} (kernels: {', '.join(kernels)}):\n"
                        f"{proc.stderr.strip()}")
                os.replace(tmp_so, out)    # atomic: concurrent builders write the same bytes
        lib = ctypes.CDLL(str(out))
        lib.emu_launch.restype = ctypes.c_int
        lib.emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_int]
        lib.o1b_hw_set_seed.argtypes = [ctypes.c_ulonglong]
        lib.o1b_hw_set_seed.restype = None
        _loaded[key] = lib
        return lib, out


#: bytes of static __shared__ memory a CUDA block may hold (more needs dynamic shared memory and an
#: opt-in); a launch of a kernel whose own __shared__ arrays pass it fails, as on a device
SHARED_LIMIT = 48 * 1024
_SHARED_SYMBOL = re.compile(r"\semu_shared\s+([0-9a-fA-F]+)\s+_ZZ(\d+)(\w+)$")


_shared_sizes: dict[str, dict[str, int] | None] = {}


def static_shared(path) -> dict[str, int] | None:
    """{function: bytes of the __shared__ arrays declared in its body} from a built library's
    symbols (objdump -t, once a library; None without objdump). Arrays declared in a __device__
    helper count for the helper, not for the kernels that call it."""
    key = str(path)
    if key not in _shared_sizes:
        tool = shutil.which("objdump")
        sizes: dict[str, int] | None = None
        if tool is not None:
            sizes = {}
            for line in subprocess.run([tool, "-t", key], capture_output=True, text=True).stdout.splitlines():
                m = _SHARED_SYMBOL.search(line)
                if m:
                    fn = m.group(3)[:int(m.group(2))]
                    sizes[fn] = sizes.get(fn, 0) + int(m.group(1), 16)
        _shared_sizes[key] = sizes
    return _shared_sizes[key]


class EmuModule:
    """cupy.RawModule's shape on the emulator: EmuModule(source, name).get_function(kernel)."""

    def __init__(self, source: str, name: str = "<source>"):
        self.name, self.source = name, source
        self.ftz, self.ucontext = _settings["ftz"], use_ucontext()
        self._libs: dict[hwmodel.Hardware, ctypes.CDLL] = {}
        # the library of the hardware active now (compile errors show up here, not at a launch);
        # every hardware's library has the same kernels and signatures
        self.lib, self.path = self.library(_hardware.current())
        self.uses_barrier = any(s in source for s in ("__syncthreads", "emu_warp_sync", "__shfl_sync"))
        self.kernels = kernel_names(source)
        self.shared = static_shared(self.path)

    def library(self, hw: hwmodel.Hardware) -> tuple[ctypes.CDLL, pathlib.Path]:
        """The library of this module on the hardware `hw` (its seed is set at each launch)."""
        key = dataclasses.replace(hw, seed=0)
        count = counters.active() is not None     # a counting library is a separate build
        got = self._libs.get((key, count))
        if got is None:
            if count and hw.active:
                raise EmuLaunchError(f"{self.name}: counting needs the plain hardware (no fault or adversarial flush)")
            got = self._libs[(key, count)] = _build(self.source, self.name, self.ftz, self.ucontext, key, count)
        return got

    def get_function(self, kernel: str) -> "EmuFunction":
        if kernel not in self.kernels:
            raise AttributeError(f"{self.name}: no kernel named {kernel!r} (has: {', '.join(self.kernels)})")
        return EmuFunction(self, kernel)


def _dims(v, what: str) -> tuple[int, int, int]:
    t = (int(v),) if np.isscalar(v) else tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3 or any(x < 1 for x in t):
        raise EmuLaunchError(f"{what}: expected 1 to 3 positive sizes, got {v!r}")
    return t + (1,) * (3 - len(t))


class EmuFunction:
    def __init__(self, module: EmuModule, kernel: str):
        self.module, self.kernel = module, kernel
        sig = getattr(module.lib, f"emu_sig_{kernel}")
        sig.restype = ctypes.c_char_p
        self.signature = [s for s in sig().decode().split(",") if s]

    def _pack(self, args):
        if len(args) != len(self.signature):
            raise EmuLaunchError(f"{self.kernel}: expected {len(self.signature)} arguments, got {len(args)}")
        holders, arrays = [], []
        for i, (code, a) in enumerate(zip(self.signature, args)):
            if code == "p":
                if not isinstance(a, np.ndarray):
                    raise EmuLaunchError(f"{self.kernel}: argument {i} is a pointer; expected a numpy array, "
                                         f"got {type(a).__name__}")
                if not a.flags.c_contiguous:
                    raise EmuLaunchError(f"{self.kernel}: argument {i} must be C-contiguous")
                arrays.append(a)
                holders.append(ctypes.c_void_p(a.ctypes.data))
            else:
                want = _SCALARS[code]
                if not isinstance(a, np.generic) or a.dtype != np.dtype(want):
                    raise EmuLaunchError(f"{self.kernel}: argument {i} must be a numpy {np.dtype(want).name} "
                                         f"scalar (the kernel's parameter type), got {type(a).__name__}")
                holders.append(np.array(a, dtype=want))   # owns the bytes
        ptrs = (ctypes.c_void_p * max(1, len(holders)))()
        for i, h in enumerate(holders):
            ptrs[i] = ctypes.addressof(h) if isinstance(h, ctypes.c_void_p) else h.ctypes.data
        return ptrs, holders, arrays

    def _run(self, lib, tramp, grid, block, ptrs, reverse: bool) -> None:
        mode = (1 if reverse else 0) | (0 if self.module.uses_barrier else 2)
        rc = lib.emu_launch(tramp, ctypes.addressof(ptrs), *grid, *block, mode)
        if rc == 1:
            raise EmuLaunchError(f"{self.kernel}: barrier divergence (some threads of a block returned while "
                                 "others wait at __syncthreads)")
        if rc == 3:
            raise EmuLaunchError(f"{self.kernel}: warp divergence (a warp-collective step reached by only some "
                                 "lanes of a warp, or by a partial warp)")
        if rc:
            raise EmuLaunchError(f"{self.kernel}: launch failed (code {rc})")

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        if shared_mem:
            raise EmuLaunchError(f"{self.kernel}: dynamic shared memory is not supported by the emulator")
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        if block[0] * block[1] * block[2] > 1024:
            raise EmuLaunchError(f"{self.kernel}: a block has at most 1024 threads, got {block}")
        used = (self.module.shared or {}).get(self.kernel, 0)
        if used > SHARED_LIMIT:
            raise EmuLaunchError(f"{self.kernel} ({self.module.name}): {used} bytes of static shared memory, over "
                                 f"the {SHARED_LIMIT} a block may hold")
        ptrs, holders, arrays = self._pack(tuple(args))
        hw = _hardware.current()
        lib = self.module.library(hw)[0]
        tramp = ctypes.cast(getattr(lib, f"emu_tramp_{self.kernel}"), ctypes.c_void_p).value
        with _lock:    # the scheduler state in the library is global
            lib.o1b_hw_set_seed(hw.seed)
            if counters.active() is not None:     # counted once, never race-checked
                with counters.launch(lib, "cuda", self.kernel, grid, block, grid[0] * grid[1] * grid[2], arrays):
                    self._run(lib, tramp, grid, block, ptrs, False)
                return
            if not _settings["race_check"]:
                self._run(lib, tramp, grid, block, ptrs, False)
                return
            before = [a.copy() for a in arrays]
            self._run(lib, tramp, grid, block, ptrs, False)
            forward = [a.copy() for a in arrays]
            for a, b in zip(arrays, before):
                np.copyto(a, b)
            self._run(lib, tramp, grid, block, ptrs, True)
            for i, (a, f) in enumerate(zip(arrays, forward)):
                if a.tobytes() != f.tobytes():
                    raise EmuRaceError(f"{self.kernel}: race detected — array argument {i} differs between "
                                       "forward and reverse thread order (a missing __syncthreads?)")
