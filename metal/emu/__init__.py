"""The Metal emulator: runs the exact kernel source text given to `mx.fast.metal_kernel` on the CPU.

DESIGN.md §4. For a kernel (name, input names, output names, source, header) and a call
(inputs, output shapes and dtypes, grid, threadgroup, template arguments, init value) this module

1. writes the kernel signature exactly as MLX's `write_signature` does (template header, inputs as
   `const device T*` — `const constant T*` below 8 elements, `const constant T&` for 0-d arrays —
   `name_shape` / `name_strides` / `name_ndim` only when those words occur in the source, outputs
   as `device T*`, and the thread attributes whose names occur in the source, in MLX's order);
2. prepends `prelude.h` (MSL -> C++), appends a launcher that runs the grid group by group
   (threadgroup size min(threadgroup, grid) per dimension, partial groups at the edges, as MLX's
   `dispatch_threads` does) and, when the text contains `threadgroup_barrier`, runs the threads of a
   group as fibers with a faithful barrier;
3. checks the header and body for what Metal rejects and g++ would not (msl_check: `double`,
   pointers without an address space, recursion, C++ features MSL leaves out), then compiles the
   unit as C++14 (MSL's base) with `g++ -std=c++14 -pedantic-errors -Werror=vla -O2
   -ffp-contract=off -fno-fast-math`, `double` poisoned after the prelude, into a shared library cached at
   `$XDG_CACHE_HOME/mlx-open1b/emu/<sha256>.so` (default `~/.cache`), and calls it through ctypes on
   numpy arrays.

Flush-to-zero (`ftz=True`, or `O1B_EMU_FTZ=1`; x86 hosts): the kernel runs with the MXCSR FTZ
and DAZ bits set, as a GPU that flushes subnormals in hardware (tininess after rounding); the
contract header's results must not change.

Faulty and adversarial hardware (`with emu.hardware(fault=..., adversarial_flush=..., seed=...)`, or
`O1B_EMU_ADVERSARIAL=1`; hwmodel.py): the contract header's hardware operators O1B_HW_ADD/SUB/MUL/DIV
run on the modelled fp32 unit of hwfloat.h instead of the host's; the mode is compiled into the
library (part of its cache key) and chosen at each call.

Race check (`race_check=True`, or the environment variable `O1B_EMU_RACECHECK=1`): every call runs
twice, groups and the threads of each group once in forward and once in reverse round-robin order,
and the outputs must agree bit for bit; a missing barrier (or two threads writing one element)
shows up as a difference and raises `EmuRaceError`.

Fibers (kernels with threadgroup_barrier): on x86-64 Linux the threads of a group switch with
fiber_switch.h's stack switch; `O1B_EMU_UCONTEXT=1` uses ucontext's swapcontext instead (the same
schedule and results, much slower: a system call per switch).

Work counters (`with counters.counting() as log:`, counters.py): each call inside the block is
compiled with ThreadSanitizer hooks and counting operators and reports the global bytes it moved and
the fp32 operations it did (benchmarks/kernel_model.py); outside any block nothing changes.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import threading

import numpy as np

from . import counters, fibers, hwmodel, msl_check

_HERE = pathlib.Path(__file__).resolve().parent
PRELUDE_PATH = _HERE / "prelude.h"
# MSL is C++14 based; g++ warnings are not shown (the output is kept for errors), VLAs and GNU
# extensions that Metal lacks are errors.
CXX_FLAGS = ["-std=c++14", "-pedantic-errors", "-Werror=vla", "-O2", "-ffp-contract=off", "-fno-fast-math",
             "-fPIC", "-shared", "-Wno-attributes"]
#: compile / cache counters (tests read them to show that a second construction reuses the build)
stats = {"compiles": 0, "disk_hits": 0, "memory_hits": 0, "launches": 0}

MAX_CONSTANT_ARRAY_SIZE = 8     # MLX: inputs with fewer elements live in the constant address space

# MLX's list of thread attributes (name, type), in the order it writes them into the signature.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
# The C++ expression the launcher passes for each attribute (names of the launcher's locals).
_ATTR_VALUE = {
    "dispatch_quadgroups_per_threadgroup": "(tgd_.x * tgd_.y * tgd_.z + 3) / 4",
    "dispatch_simdgroups_per_threadgroup": "(tgd_.x * tgd_.y * tgd_.z + 31) / 32",
    "dispatch_threads_per_threadgroup": "tgd_",
    "grid_origin": "uint3(0, 0, 0)",
    "grid_size": "grid_",
    "quadgroup_index_in_threadgroup": "tiitg / 4",
    "quadgroups_per_threadgroup": "(tptg_.x * tptg_.y * tptg_.z + 3) / 4",
    "simdgroup_index_in_threadgroup": "tiitg / 32",
    "simdgroups_per_threadgroup": "(tptg_.x * tptg_.y * tptg_.z + 31) / 32",
    "thread_execution_width": "32u",
    "thread_index_in_quadgroup": "tiitg % 4",
    "thread_index_in_simdgroup": "tiitg % 32",
    "thread_index_in_threadgroup": "tiitg",
    "thread_position_in_grid": "tpig",
    "thread_position_in_threadgroup": "tpitg",
    "threadgroup_position_in_grid": "gpos_",
    "threadgroups_per_grid": "ngroups_",
    "threads_per_grid": "grid_",
    "threads_per_simdgroup": "32u",
    "threads_per_threadgroup": "tptg_",
}

_TYPE_STRING = {
    np.dtype(np.float32): "float", np.dtype(np.bool_): "bool", np.dtype(np.int8): "int8_t",
    np.dtype(np.int16): "int16_t", np.dtype(np.int32): "int32_t", np.dtype(np.int64): "int64_t",
    np.dtype(np.uint8): "uint8_t", np.dtype(np.uint16): "uint16_t", np.dtype(np.uint32): "uint32_t",
    np.dtype(np.uint64): "uint64_t",
}


_hardware = hwmodel.Setting()
#: `with emu.hardware(fault=None, adversarial_flush=False, seed=0):` launches inside run on an fp32
#: unit with a planted fault or adversarial flushing (hwmodel.py, hwfloat.h). On Metal the faults
#: reach the contract header's hardware operators (O1B_HW_ADD/SUB/MUL/DIV), not a bare operator of
#: a kernel body.
hardware = _hardware.context
FAULTS = hwmodel.FAULTS

# The text between the prelude's system headers and the kernel when a hardware mode is active: the
# fp32 unit of hwfloat.h (ftz: the launcher sets MXCSR DAZ for the inputs of every op, hwfloat.h
# flushes the results it computes, tininess after rounding) and the header's hooks pointing at it.
_HW_PREFIX = """#define O1B_HW_DAZ 0
#define O1B_HW_FTZ o1b_emu_hw_ftz
static int o1b_emu_hw_ftz = 0;
"""
_HW_HOOKS = """
#define O1B_HW_ADD(a, b) o1b_hw_add((a), (b))
#define O1B_HW_SUB(a, b) o1b_hw_sub((a), (b))
#define O1B_HW_MUL(a, b) o1b_hw_mul((a), (b))
#define O1B_HW_DIV(a, b) o1b_hw_div((a), (b))
"""


class EmuError(RuntimeError):
    """A kernel failed while running in the emulator (e.g. barrier divergence)."""


class EmuCompileError(EmuError):
    """g++ rejected a kernel's source; the message names the kernel and shows g++'s output."""


class EmuRaceError(EmuError):
    """Race check: forward and reverse thread orders gave different outputs."""


def type_string(dtype) -> str:
    """MLX's get_type_string for a numpy dtype (or an mlx Dtype, by name)."""
    dt = _to_np_dtype(dtype)
    try:
        return _TYPE_STRING[dt]
    except KeyError:
        raise EmuError(f"dtype {dtype} is not supported by the Metal emulator") from None


def _to_np_dtype(dtype) -> np.dtype:
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        return np.dtype(dtype)
    name = str(dtype).rsplit(".", 1)[-1]          # e.g. mlx.core.float32 -> float32
    if name == "bfloat16":
        raise EmuError("bfloat16 arrays are passed as uint16 (CONTRACT.md §1)")
    return np.dtype(name)


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "mlx-open1b" / "emu"


_gxx_id: str | None = None


def compiler() -> str | None:
    return shutil.which(os.environ.get("O1B_EMU_CXX", "g++"))


def compiler_id() -> str:
    global _gxx_id
    if _gxx_id is None:
        cxx = compiler()
        if cxx is None:
            raise EmuError("the Metal emulator needs g++ (not found on PATH)")
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
        _gxx_id = cxx + "\n" + out.stdout.splitlines()[0] if out.stdout else cxx
    return _gxx_id


def available() -> tuple[bool, str]:
    cxx = compiler()
    if cxx is None:
        return False, "no g++ on PATH for the Metal emulator"
    return True, f"Metal emulator ({compiler_id().splitlines()[-1]})"


# ---------------------------------------------------------------------------------------------
# Signature (as MLX writes it) and launcher
# ---------------------------------------------------------------------------------------------
def template_def(template) -> str:
    parts = []
    for _name, arg in template:
        if isinstance(arg, (bool, np.bool_)):
            parts.append("1" if arg else "0")
        elif isinstance(arg, (int, np.integer)):
            parts.append(str(int(arg)))
        else:
            parts.append(type_string(arg))
    return "<" + ", ".join(parts) + ">"


def template_hash(tdef: str) -> str:
    out, i = [], 0
    while i < len(tdef):
        c = tdef[i]
        if c in "<>":
            out.append("_")
        elif c == "," and i + 1 < len(tdef) and tdef[i + 1] == " ":
            out.append("_")
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)[:-1]


def kernel_name(name: str, inputs, output_dtypes, template) -> str:
    kn = "custom_kernel_" + name
    if template:
        kn += "_" + template_hash(template_def(template))
    for a in inputs:
        kn += "_" + type_string(a.dtype)
        if a.ndim == 0:
            kn += "s"
        elif a.size < MAX_CONSTANT_ARRAY_SIZE:
            kn += "c"
    for dt in output_dtypes:
        kn += "_" + type_string(dt)
    return kn


def shape_infos(source: str, input_names):
    return [(n + "_shape" in source, n + "_strides" in source, n + "_ndim" in source) for n in input_names]


def attributes(source: str):
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def write_signature(func_name, header, source, input_names, inputs, output_names, output_dtypes,
                    template, attrs, infos) -> str:
    """The kernel text exactly as MLX's write_signature builds it (atomic_outputs=False)."""
    ks = header
    if template:
        kinds = []
        for name, arg in template:
            if isinstance(arg, (bool, np.bool_)):
                kinds.append("bool " + name)
            elif isinstance(arg, (int, np.integer)):
                kinds.append("int " + name)
            else:
                kinds.append("typename " + name)
        ks += "template <" + ", ".join(kinds) + ">\n"
    ks += "[[kernel]] void " + func_name + "(\n"
    index = 0
    for name, arr in zip(input_names, inputs):
        location = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        ks += f"  const {location} {type_string(arr.dtype)}{ref} {name} [[buffer({index})]],\n"
        index += 1
        if arr.ndim > 0:
            sh, st, nd = infos[input_names.index(name)]
            if sh:
                ks += f"  const constant int* {name}_shape [[buffer({index})]],\n"
                index += 1
            if st:
                ks += f"  const constant int64_t* {name}_strides [[buffer({index})]],\n"
                index += 1
            if nd:
                ks += f"  const constant int& {name}_ndim [[buffer({index})]],\n"
                index += 1
    for i, (name, dt) in enumerate(zip(output_names, output_dtypes)):
        ks += f"  device {type_string(dt)}* {name} [[buffer({index})]]"
        if index < len(inputs) + len(output_names) - 1 or attrs:
            ks += ",\n"
        else:
            ks += ") {\n"
        index += 1
    for i, (a, t) in enumerate(attrs):
        ks += f"  {t} {a} [[{a}]]"
        ks += ",\n" if i < len(attrs) - 1 else ") {\n"
    ks += source
    ks += "\n}\n"
    return ks


_LAUNCHER = r"""
// ---- launcher (mlx_open1b.metal.emu) ----
#define O1B_USE_FIBERS @FIBERS@
namespace o1b_emu {
static void *bufs[@NBUF@];
static uint3 grid_, tgd_, ngroups_, gpos_, tptg_;
static inline void run_thread(uint3 tpitg, uint tiitg) {
    uint3 tpig(gpos_.x * tgd_.x + tpitg.x, gpos_.y * tgd_.y + tpitg.y, gpos_.z * tgd_.z + tpitg.z);
    (void)tpig;
#ifdef O1B_HWFLOAT_H
    o1b_hw_start_thread(tpig.x + (unsigned long long)grid_.x * (tpig.y + (unsigned long long)grid_.y * tpig.z));
#endif
    @CALL@;
}
static void fiber_entry() {
    int i = cur;
    run_thread(fibers[i].tpitg, fibers[i].tiitg);
    fibers[i].state = DONE;
#ifdef EMU_FAST_SWITCH
    emu_switch(&fibers[i].sp, sched_sp);           // never resumed
    std::abort();
#endif
    // ucontext: returning resumes uc_link = the scheduler
}
static const size_t STACK = 256 * 1024;
static char *stacks = nullptr;
static size_t nstacks = 0;
#ifdef O1B_HWFLOAT_H
static o1b_hw_thread *hw_saved = nullptr;     // each fiber's fp32-unit state while it waits
#endif
}  // namespace o1b_emu

extern "C" int o1b_launch(void **b, const unsigned *g, const unsigned *t, int mode,
                          char *err, int errlen) {
    using namespace o1b_emu;
    const int reverse = mode & 1;
#if defined(__x86_64__) || defined(__i386__)
    const unsigned csr = _mm_getcsr();
#ifdef O1B_HWFLOAT_H
    o1b_emu_hw_ftz = (mode & 2) ? 1 : 0;           // hwfloat.h flushes the results it computes
    if (mode & 2) _mm_setcsr(csr | 0x0040u);       // DAZ: every op reads subnormal inputs as zeros
#else
    if (mode & 2) _mm_setcsr(csr | 0x8040u);       // FTZ | DAZ: a GPU that flushes in hardware
#endif
#else
    if (mode & 2) { std::snprintf(err, errlen, "flush-to-zero emulation needs an x86 host"); return 1; }
#endif
    failed = 0; errbuf[0] = 0;
    for (int i = 0; i < @NBUF@; i++) bufs[i] = b[i];
    grid_ = uint3(g[0], g[1], g[2]);
    tgd_ = uint3(t[0] < g[0] ? t[0] : g[0], t[1] < g[1] ? t[1] : g[1], t[2] < g[2] ? t[2] : g[2]);
    if (grid_.x == 0 || grid_.y == 0 || grid_.z == 0) return 0;
    ngroups_ = uint3((grid_.x + tgd_.x - 1) / tgd_.x, (grid_.y + tgd_.y - 1) / tgd_.y,
                     (grid_.z + tgd_.z - 1) / tgd_.z);
    const unsigned long total = (unsigned long)ngroups_.x * ngroups_.y * ngroups_.z;
    const unsigned long tgn = (unsigned long)tgd_.x * tgd_.y * tgd_.z;
#if O1B_USE_FIBERS
    fiber_mode = true;
    if (nstacks < tgn) {
        if (stacks) { munmap(stacks, nstacks * STACK); delete[] fibers; }
        void *m = mmap(nullptr, tgn * STACK, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) { std::snprintf(err, errlen, "cannot map fiber stacks"); return 1; }
        stacks = (char *)m; nstacks = tgn; fibers = new Fiber[tgn];
#ifdef O1B_HWFLOAT_H
        delete[] hw_saved;
        hw_saved = new o1b_hw_thread[tgn];
#endif
    }
#endif
    for (unsigned long gi = 0; gi < total && !failed; gi++) {
        unsigned long gl = reverse ? total - 1 - gi : gi;
        gpos_ = uint3(gl % ngroups_.x, (gl / ngroups_.x) % ngroups_.y, gl / ((unsigned long)ngroups_.x * ngroups_.y));
        tptg_ = uint3(grid_.x - gpos_.x * tgd_.x < tgd_.x ? grid_.x - gpos_.x * tgd_.x : tgd_.x,
                      grid_.y - gpos_.y * tgd_.y < tgd_.y ? grid_.y - gpos_.y * tgd_.y : tgd_.y,
                      grid_.z - gpos_.z * tgd_.z < tgd_.z ? grid_.z - gpos_.z * tgd_.z : tgd_.z);
        const uint n = tptg_.x * tptg_.y * tptg_.z;
#if !O1B_USE_FIBERS
        for (uint k = 0; k < n; k++) {
            uint i = reverse ? n - 1 - k : k;
            run_thread(uint3(i % tptg_.x, (i / tptg_.x) % tptg_.y, i / (tptg_.x * tptg_.y)), i);
        }
#else
        for (uint i = 0; i < n; i++) {
            Fiber &f = fibers[i];
            f.tpitg = uint3(i % tptg_.x, (i / tptg_.x) % tptg_.y, i / (tptg_.x * tptg_.y));
            f.tiitg = i;
            f.state = RUNNABLE;
#ifdef EMU_FAST_SWITCH
            f.sp = emu_prepare(stacks + (size_t)i * STACK, STACK, fiber_entry);
#else
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = stacks + (size_t)i * STACK;
            f.ctx.uc_stack.ss_size = STACK;
            f.ctx.uc_link = &sched;
            makecontext(&f.ctx, (void (*)())fiber_entry, 0);
#endif
        }
        for (unsigned long phase = 0;; phase++) {
            for (uint k = 0; k < n; k++) {          // round robin: each runs to a barrier or its end
                uint i = reverse ? n - 1 - k : k;
                if (fibers[i].state != RUNNABLE) continue;
                cur = (int)i;
#ifdef O1B_HWFLOAT_H
                if (phase > 0) o1b_hw_cur = hw_saved[i];
#endif
#ifdef EMU_FAST_SWITCH
                emu_switch(&sched_sp, fibers[i].sp);
#else
                swapcontext(&sched, &fibers[i].ctx);
#endif
#ifdef O1B_HWFLOAT_H
                hw_saved[i] = o1b_hw_cur;
#endif
                cur = -1;
            }
            uint waiting = 0, done = 0;
            for (uint i = 0; i < n; i++) {
                waiting += fibers[i].state == AT_BARRIER;
                done += fibers[i].state == DONE;
            }
            if (done == n) break;
            if (waiting == n) {                      // everyone arrived: release the barrier
                for (uint i = 0; i < n; i++) fibers[i].state = RUNNABLE;
                continue;
            }
            std::snprintf(errbuf, sizeof errbuf,
                          "barrier divergence in threadgroup (%u, %u, %u): %u of %u threads returned "
                          "while %u wait at barrier %lu", gpos_.x, gpos_.y, gpos_.z, done, n, waiting,
                          phase + 1);
            failed = 1;
            break;
        }
#endif
    }
    fiber_mode = false;
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(csr);
#endif
    if (failed) { std::snprintf(err, errlen, "%s", errbuf); return 1; }
    return 0;
}
"""


def _call_expr(func_name, input_names, inputs, infos, output_dtypes, attrs, template) -> tuple[str, int]:
    args, k = [], 0
    for name, arr in zip(input_names, inputs):
        ts = type_string(arr.dtype)
        args.append(f"*(const {ts}*)bufs[{k}]" if arr.ndim == 0 else f"(const {ts}*)bufs[{k}]")
        k += 1
        if arr.ndim > 0:
            sh, st, nd = infos[input_names.index(name)]
            if sh:
                args.append(f"(const int*)bufs[{k}]"); k += 1
            if st:
                args.append(f"(const int64_t*)bufs[{k}]"); k += 1
            if nd:
                args.append(f"*(const int*)bufs[{k}]"); k += 1
    for dt in output_dtypes:
        args.append(f"({type_string(dt)}*)bufs[{k}]")
        k += 1
    for a, _t in attrs:
        args.append(_ATTR_VALUE[a])
    fn = func_name + (template_def(template) if template else "")
    return f"{fn}(" + ", ".join(args) + ")", k


def _with_line_markers(name: str, text: str, header: str, source: str) -> str:
    """The kernel text (header, signature, body) with #line markers, so that g++ names the kernel's
    own lines, and with `double` poisoned from there on (Metal has none)."""
    tail = "\n}\n"
    assert text.startswith(header) and text.endswith(source + tail)
    signature = text[len(header):len(text) - len(source) - len(tail)]
    return ("#pragma GCC poison double\n"
            f'#line 1 "{name} (header)"\n{header}\n#line 1 "{name} (signature)"\n{signature}\n'
            f'#line 1 "{name}"\n{source}{tail}#line 1 "<emulator launcher>"\n')


_lock = threading.Lock()
_libs: dict[str, tuple[ctypes.CDLL, object]] = {}


def _build(text: str, name: str, count: bool = False):
    """Compile (or load from the disk cache) the full translation unit; returns (launch fn, library)."""
    key = hashlib.sha256((compiler_id() + "\0" + " ".join(CXX_FLAGS) + "\0" + text).encode()).hexdigest()
    with _lock:
        if key in _libs:
            stats["memory_hits"] += 1
            return _libs[key][1], _libs[key][0]
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        so = d / f"{key}.so"
        if so.exists():
            stats["disk_hits"] += 1
        else:
            src = d / f"{key}.cpp"
            src.write_text(text)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
            os.close(fd)
            res = (counters.compile_unit(compiler(), CXX_FLAGS, str(src), tmp) if count else
                   subprocess.run([compiler(), *CXX_FLAGS, "-x", "c++", str(src), "-o", tmp],
                                  capture_output=True, text=True))
            if res.returncode != 0:
                os.unlink(tmp)
                raise EmuCompileError(f"Metal kernel '{name}' does not compile (emulator, g++; "
                                      f"generated source {src}):\n{res.stderr.strip()}")
            os.replace(tmp, so)
            stats["compiles"] += 1
        lib = ctypes.CDLL(str(so))
        fn = lib.o1b_launch
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint),
                       ctypes.POINTER(ctypes.c_uint), ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        fn.restype = ctypes.c_int
        _libs[key] = (lib, fn)
        return fn, lib


#: bytes of threadgroup memory a Metal threadgroup may hold (Apple GPUs: 32 KiB); a launch of a
#: kernel whose threadgroup arrays pass it fails, as on a device
THREADGROUP_LIMIT = 32 * 1024
_tg_bytes: dict[tuple[str, str], int | None] = {}


def threadgroup_bytes(path, fname: str) -> int | None:
    """Bytes of the static locals of kernel function `fname` (its threadgroup arrays: the prelude
    makes `threadgroup` static) in a built library, from its symbols (objdump -t; None without
    objdump)."""
    key = (str(path), fname)
    if key not in _tg_bytes:
        tool = shutil.which("objdump")
        out = subprocess.run([tool, "-t", key[0]], capture_output=True, text=True).stdout if tool else None
        pat = re.compile(r"\s([0-9a-fA-F]+)\s+_ZZ" + str(len(fname)) + re.escape(fname) + r"\w*$", re.M)
        _tg_bytes[key] = None if out is None else sum(int(m.group(1), 16) for m in pat.finditer(out))
    return _tg_bytes[key]


def clear_memory_cache() -> None:
    """Forget loaded libraries (the disk cache stays): the next call loads from disk."""
    with _lock:
        _libs.clear()


def _as_numpy(a):
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a)                  # ensure_row_contiguous=True
    if isinstance(a, (bool, int, float, np.generic)):
        raise EmuError("scalar kernel inputs are not supported; pass a 1-element array")
    return np.ascontiguousarray(np.array(a))           # e.g. an mx.array


class EmuKernel:
    """Same constructor and call signature as the object `mx.fast.metal_kernel` returns."""

    def __init__(self, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False, race_check: bool | None = None,
                 ftz: bool | None = None):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        if atomic_outputs:
            raise EmuError("atomic_outputs is not supported by the Metal emulator")
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.infos = shape_infos(source, self.input_names)
        self.attrs = attributes(source)
        self.fibers = "threadgroup_barrier" in source or "threadgroup_barrier" in header
        self.race_check = race_check
        self.ftz = ftz
        self.library = None         # set by each call

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None):
        def check_size(actual, expected, what):
            if actual != expected:
                raise ValueError(f"[metal_kernel] Expected `{what}` to have size {expected} but got size {actual}.")
        check_size(len(inputs), len(self.input_names), "inputs")
        check_size(len(output_shapes), len(self.output_names), "output_shapes")
        check_size(len(output_dtypes), len(self.output_names), "output_dtypes")
        template = list(template or [])
        ins = [_as_numpy(a) for a in inputs]
        odt = [_to_np_dtype(d) for d in output_dtypes]
        fname = kernel_name(self.name, ins, odt, template)
        text = write_signature(fname, self.header, self.source, self.input_names, ins,
                               self.output_names, odt, template, self.attrs, self.infos)
        call, nbuf = _call_expr(fname, self.input_names, ins, self.infos, odt, self.attrs, template)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{text}\n```")
        hw = _hardware.current()
        types = tuple(n for n, v in template if not isinstance(v, (bool, int, np.bool_, np.integer)))
        bad = msl_check.check(self.header, self.source, types)
        if bad:
            raise EmuCompileError(f"Metal kernel '{self.name}' is not valid Metal (emulator source check):\n"
                                  + "\n".join(f"  {v}" for v in bad))
        hw_text = (_HW_PREFIX + hw.defines() + hwmodel.hwfloat_text() + _HW_HOOKS) if hw.active else ""
        count = counters.active() is not None     # opt-in work counters (counters.py): a separate build
        if count and hw.active:
            raise EmuError(f"Metal kernel '{self.name}': counting needs the plain hardware (no fault or adversarial flush)")
        if count:
            hw_text = counters.HOOKS + counters.METAL_HW_OPS
        unit = (hw_text + fibers.switch_text(fibers.ucontext_from_env()) + '#line 1 "emu/prelude.h"\n' + PRELUDE_PATH.read_text() + "\n"
                + (counters.metal_fma_macro(text) if count else "") + _with_line_markers(self.name, text, self.header, self.source)
                + _LAUNCHER.replace("@FIBERS@", "1" if self.fibers else "0")
                .replace("@NBUF@", str(max(nbuf, 1))).replace("@CALL@", call))
        launch, lib = _build(unit, self.name, count)
        used = threadgroup_bytes(lib._name, fname)
        if used is not None and used > THREADGROUP_LIMIT:
            raise EmuError(f"Metal kernel '{self.name}': {used} bytes of threadgroup memory, over the "
                           f"{THREADGROUP_LIMIT} a threadgroup may hold")
        self._count_lib = lib if count else None
        self.library = lib          # the library of the last call (tests read its switch)
        if hw.active:
            lib.o1b_hw_set_seed(ctypes.c_ulonglong(hw.seed))

        grid3 = tuple(int(v) for v in grid)
        tg3 = tuple(int(v) for v in threadgroup)
        if len(grid3) != 3 or len(tg3) != 3 or min(grid3) < 0 or min(tg3) < 1:
            raise ValueError(f"{self.name}: grid and threadgroup must be 3 sizes (threadgroup >= 1), "
                             f"got {grid} and {threadgroup}")
        if tg3[0] * tg3[1] * tg3[2] > 1024:
            raise ValueError(f"Thread group size ({tg3[0] * tg3[1] * tg3[2]}) is greater than the "
                             f"maximum allowed threads per threadgroup (1024).")
        race = self.race_check if self.race_check is not None else os.environ.get("O1B_EMU_RACECHECK") == "1"
        outs = self._run(launch, ins, output_shapes, odt, grid3, tg3, init_value, reverse=False)
        if race and not count:
            outs2 = self._run(launch, ins, output_shapes, odt, grid3, tg3, init_value, reverse=True)
            for name, a, b in zip(self.output_names, outs, outs2):
                if a.tobytes() != b.tobytes():
                    n = int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8)))
                    raise EmuRaceError(f"Metal kernel '{self.name}': output '{name}' depends on the order "
                                       f"in which threads run ({n} bytes differ between forward and "
                                       f"reverse order): a missing threadgroup_barrier or a data race")
        return outs

    def _run(self, launch, ins, output_shapes, odt, grid3, tg3, init_value, reverse):
        outs = []
        for shape, dt in zip(output_shapes, odt):
            o = np.empty(tuple(int(s) for s in shape), dt)
            if init_value is not None:
                o[...] = np.array(init_value, np.float64).astype(dt)
            else:
                o.view(np.uint8)[...] = 0xFF            # "uninitialized": a visible poison pattern
            outs.append(o)
        keep, ptrs = [], []
        for name, a in zip(self.input_names, ins):
            ptrs.append(a.ctypes.data if a.size else _empty_ptr(keep))
            if a.ndim > 0:
                sh, st, nd = self.infos[self.input_names.index(name)]
                if sh:
                    b = np.array(a.shape, np.int32); keep.append(b); ptrs.append(b.ctypes.data)
                if st:
                    b = np.array([s // a.itemsize for s in a.strides], np.int64); keep.append(b); ptrs.append(b.ctypes.data)
                if nd:
                    b = np.array([a.ndim], np.int32); keep.append(b); ptrs.append(b.ctypes.data)
        for o in outs:
            ptrs.append(o.ctypes.data if o.size else _empty_ptr(keep))
        arr = (ctypes.c_void_p * max(len(ptrs), 1))(*ptrs)
        g = (ctypes.c_uint * 3)(*grid3)
        t = (ctypes.c_uint * 3)(*tg3)
        err = ctypes.create_string_buffer(600)
        stats["launches"] += 1
        ftz = self.ftz if self.ftz is not None else os.environ.get("O1B_EMU_FTZ") == "1"
        if getattr(self, "_count_lib", None) is None:
            rc = launch(arr, g, t, int(reverse) | (2 if ftz else 0), err, 600)
        else:
            tgd = [min(a, b) for a, b in zip(tg3, grid3)]
            groups = int(np.prod([-(-a // max(b, 1)) for a, b in zip(grid3, tgd)]))
            with counters.launch(self._count_lib, "metal", self.name, grid3, tg3, groups, ins + outs):
                rc = launch(arr, g, t, int(reverse) | (2 if ftz else 0), err, 600)
        if rc != 0:
            raise EmuError(f"Metal kernel '{self.name}': {err.value.decode(errors='replace')}")
        return outs


def _empty_ptr(keep):
    b = np.zeros(16, np.uint8)
    keep.append(b)
    return b.ctypes.data
