"""Opt-in work counters for both emulators: global-memory bytes and fp32 operations per launch.

    with counters.counting() as log:
        ...launch kernels on either emulator...
    log.launches    # one Launch per kernel launch, in order

Off (no `counting()` block active), nothing changes: the emulators compile and run exactly what they
always did. On, each kernel unit is compiled with two additions, so its library is a separate one
(its text, hence its cache key, differs):

- memory: the unit is compiled with g++'s ThreadSanitizer instrumentation (`-fsanitize=thread`, no
  runtime linked) and the hooks that instrumentation calls (`__tsan_read4(addr)`, ...) are defined
  here. A hook adds the access's size to the counter of the launch argument whose buffer holds the
  address and marks those bytes in a per-argument map; accesses outside every argument buffer
  (locals, `__shared__` / `threadgroup` arrays, the scheduler's state) are not counted. So a launch
  reports, per argument, the bytes its threads loaded and stored (`issued`: what the load/store
  units move, every re-read counted) and the distinct bytes touched (`unique`: the least that must
  cross DRAM).
- arithmetic: the fp32 operations the contract lets a kernel use are counted where the kernel text
  applies them: CUDA's __fadd_rn, __fsub_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn, __fmaf_rn and the
  emulated PTX fma.rn.ftz, mul.rn.ftz and add.rn.ftz (emu_fma_rn_ftz, emu_mul_rn_ftz, emu_add_rn_ftz) (macros defined between the prelude and the kernel source); Metal's contract-header hardware operators
  O1B_HW_ADD/SUB/MUL/DIV and `fma(` in a kernel's own text. Integer arithmetic, compares, selects and
  bit operations are not counted (the SASS reading in benchmarks/kernel_model.py sees those).

Counting needs the plain hardware (no planted fault or adversarial flush: both redefine the same
operators) and runs each launch once (no race-check rerun is counted).
"""
from __future__ import annotations

import contextlib
import dataclasses
import ctypes
import re
import subprocess
import threading

import numpy as np

OPS = ("add", "sub", "mul", "div", "sqrt", "fma")
MAX_BUFFERS = 64

_lock = threading.Lock()
_active: list["Log"] = []


@dataclasses.dataclass
class Launch:
    backend: str                    # "cuda" or "metal"
    kernel: str
    grid: tuple                     # CUDA: blocks; Metal: threads (as dispatched)
    block: tuple                    # CUDA: threads per block; Metal: threads per threadgroup
    groups: int                     # blocks / threadgroups launched
    read: list                      # per argument: bytes loaded (issued)
    written: list                   # per argument: bytes stored (issued)
    read_unique: list               # per argument: distinct bytes loaded
    written_unique: list            # per argument: distinct bytes stored
    ops: dict                       # fp32 operations by kind (OPS)
    loads: int = 0                  # global-memory load accesses (any width)
    stores: int = 0                 # global-memory store accesses

    @property
    def bytes_issued(self) -> int:
        return int(sum(self.read) + sum(self.written))

    @property
    def bytes_unique(self) -> int:
        return int(sum(self.read_unique) + sum(self.written_unique))

    @property
    def flops(self) -> int:
        """fp32 operations, a fused multiply-add counted as two."""
        return int(sum(self.ops.values()) + self.ops.get("fma", 0))


class Log:
    def __init__(self):
        self.launches: list[Launch] = []


def active() -> Log | None:
    """The innermost counting() block's log, or None (counting off)."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def counting():
    log = Log()
    with _lock:
        _active.append(log)
    try:
        yield log
    finally:
        with _lock:
            _active.remove(log)


# The hooks the instrumentation calls, and the counters. Pedantic C++14 (the Metal emulator's
# dialect) and no `double` (poisoned there after the prelude).
HOOKS = r"""
#line 1 "emu/counters (hooks)"
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#define O1B_CNT_NS extern "C" __attribute__((no_sanitize_thread, visibility("default")))
static uintptr_t o1b_cnt_lo[@MAX@], o1b_cnt_hi[@MAX@];
static unsigned char *o1b_cnt_rmark[@MAX@], *o1b_cnt_wmark[@MAX@];
static unsigned long long o1b_cnt_rbytes[@MAX@], o1b_cnt_wbytes[@MAX@], o1b_cnt_naccess[2];
static int o1b_cnt_nbuf = 0;
static unsigned long long o1b_cnt_ops[8];
__attribute__((no_sanitize_thread)) static inline void o1b_cnt_access(const void *p, size_t n, int w) {
    uintptr_t a = (uintptr_t)p;
    for (int i = 0; i < o1b_cnt_nbuf; i++) {
        if (a >= o1b_cnt_lo[i] && a < o1b_cnt_hi[i]) {
            size_t off = (size_t)(a - o1b_cnt_lo[i]), m = n;
            if (off + m > (size_t)(o1b_cnt_hi[i] - o1b_cnt_lo[i])) m = (size_t)(o1b_cnt_hi[i] - o1b_cnt_lo[i]) - off;
            o1b_cnt_naccess[w]++;
            if (w) { o1b_cnt_wbytes[i] += n; memset(o1b_cnt_wmark[i] + off, 1, m); }
            else { o1b_cnt_rbytes[i] += n; memset(o1b_cnt_rmark[i] + off, 1, m); }
            return;
        }
    }
}
#define O1B_CNT_RW(n) \
    O1B_CNT_NS void __tsan_read##n(void *p) { o1b_cnt_access(p, n, 0); } \
    O1B_CNT_NS void __tsan_write##n(void *p) { o1b_cnt_access(p, n, 1); } \
    O1B_CNT_NS void __tsan_unaligned_read##n(void *p) { o1b_cnt_access(p, n, 0); } \
    O1B_CNT_NS void __tsan_unaligned_write##n(void *p) { o1b_cnt_access(p, n, 1); } \
    O1B_CNT_NS void __tsan_volatile_read##n(void *p) { o1b_cnt_access(p, n, 0); } \
    O1B_CNT_NS void __tsan_volatile_write##n(void *p) { o1b_cnt_access(p, n, 1); } \
    O1B_CNT_NS void __tsan_unaligned_volatile_read##n(void *p) { o1b_cnt_access(p, n, 0); } \
    O1B_CNT_NS void __tsan_unaligned_volatile_write##n(void *p) { o1b_cnt_access(p, n, 1); }
O1B_CNT_RW(1) O1B_CNT_RW(2) O1B_CNT_RW(4) O1B_CNT_RW(8) O1B_CNT_RW(16)
O1B_CNT_NS void __tsan_read_range(void *p, size_t n) { o1b_cnt_access(p, n, 0); }
O1B_CNT_NS void __tsan_write_range(void *p, size_t n) { o1b_cnt_access(p, n, 1); }
// atomics (a function-local static's guard; the kernels themselves use none): done, not counted
#define O1B_CNT_ATOMIC(n, T) \
    O1B_CNT_NS T __tsan_atomic##n##_load(const volatile T *a, int mo) { (void)mo; return __atomic_load_n(a, __ATOMIC_SEQ_CST); } \
    O1B_CNT_NS void __tsan_atomic##n##_store(volatile T *a, T v, int mo) { (void)mo; __atomic_store_n(a, v, __ATOMIC_SEQ_CST); } \
    O1B_CNT_NS T __tsan_atomic##n##_fetch_add(volatile T *a, T v, int mo) { (void)mo; return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); } \
    O1B_CNT_NS T __tsan_atomic##n##_exchange(volatile T *a, T v, int mo) { (void)mo; return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
O1B_CNT_ATOMIC(8, unsigned char) O1B_CNT_ATOMIC(16, unsigned short) O1B_CNT_ATOMIC(32, unsigned int)
O1B_CNT_ATOMIC(64, unsigned long long)
O1B_CNT_NS void __tsan_init(void) {}
O1B_CNT_NS void __tsan_func_entry(void *p) { (void)p; }
O1B_CNT_NS void __tsan_func_exit(void) {}
O1B_CNT_NS void __tsan_vptr_update(void *a, void *b) { (void)a; (void)b; }
O1B_CNT_NS void *__tsan_memcpy(void *d, const void *s, size_t n) {
    o1b_cnt_access(s, n, 0); o1b_cnt_access(d, n, 1); return memcpy(d, s, n); }
O1B_CNT_NS void *__tsan_memmove(void *d, const void *s, size_t n) {
    o1b_cnt_access(s, n, 0); o1b_cnt_access(d, n, 1); return memmove(d, s, n); }
O1B_CNT_NS void *__tsan_memset(void *d, int c, size_t n) { o1b_cnt_access(d, n, 1); return memset(d, c, n); }
O1B_CNT_NS void o1b_cnt_begin(int n, const uintptr_t *lo, const uintptr_t *hi, unsigned char **rm,
                              unsigned char **wm) {
    o1b_cnt_nbuf = n;
    for (int i = 0; i < n; i++) {
        o1b_cnt_lo[i] = lo[i]; o1b_cnt_hi[i] = hi[i]; o1b_cnt_rmark[i] = rm[i]; o1b_cnt_wmark[i] = wm[i];
        o1b_cnt_rbytes[i] = 0; o1b_cnt_wbytes[i] = 0;
    }
    for (int k = 0; k < 8; k++) o1b_cnt_ops[k] = 0;
    o1b_cnt_naccess[0] = o1b_cnt_naccess[1] = 0;
}
O1B_CNT_NS void o1b_cnt_end(unsigned long long *r, unsigned long long *w, unsigned long long *ops) {
    for (int i = 0; i < o1b_cnt_nbuf; i++) { r[i] = o1b_cnt_rbytes[i]; w[i] = o1b_cnt_wbytes[i]; }
    for (int k = 0; k < 6; k++) ops[k] = o1b_cnt_ops[k];
    ops[6] = o1b_cnt_naccess[0]; ops[7] = o1b_cnt_naccess[1];
    o1b_cnt_nbuf = 0;
}
#define O1B_CNT_OP(k, e) (o1b_cnt_ops[k]++, (e))
""".replace("@MAX@", str(MAX_BUFFERS))

# CUDA: placed between the prelude and the kernel source, so only the kernel's own uses count.
CUDA_OPS = """
#line 1 "emu/counters (CUDA operations)"
#define __fadd_rn(a, b) O1B_CNT_OP(0, __fadd_rn(a, b))
#define __fsub_rn(a, b) O1B_CNT_OP(1, __fsub_rn(a, b))
#define __fmul_rn(a, b) O1B_CNT_OP(2, __fmul_rn(a, b))
#define __fdiv_rn(a, b) O1B_CNT_OP(3, __fdiv_rn(a, b))
#define __fsqrt_rn(a) O1B_CNT_OP(4, __fsqrt_rn(a))
#define __fmaf_rn(a, b, c) O1B_CNT_OP(5, __fmaf_rn(a, b, c))
#define emu_fma_rn_ftz(a, b, c) O1B_CNT_OP(5, emu_fma_rn_ftz(a, b, c))
#define emu_mul_rn_ftz(a, b) O1B_CNT_OP(2, emu_mul_rn_ftz(a, b))
#define emu_add_rn_ftz(a, b) O1B_CNT_OP(0, emu_add_rn_ftz(a, b))
"""

# Metal: before the prelude (the contract header defines its operators only where undefined).
METAL_HW_OPS = """
#define O1B_HW_ADD(a, b) O1B_CNT_OP(0, (a) + (b))
#define O1B_HW_SUB(a, b) O1B_CNT_OP(1, (a) - (b))
#define O1B_HW_MUL(a, b) O1B_CNT_OP(2, (a) * (b))
#define O1B_HW_DIV(a, b) O1B_CNT_OP(3, (a) / (b))
"""
# ... and after it, a kernel's own fma( (not a qualified metal::fma, which a macro cannot wrap)
METAL_FMA = "\n#define fma(a, b, c) O1B_CNT_OP(5, fma(a, b, c))\n"
_QUALIFIED_FMA = re.compile(r"::\s*fma\s*\(")


def metal_fma_macro(kernel_text: str) -> str:
    return "" if _QUALIFIED_FMA.search(kernel_text) else METAL_FMA


def compile_unit(cxx: str, flags, src: str, out: str) -> subprocess.CompletedProcess:
    """Compile a counting unit: instrumented object (no sanitizer runtime), then the shared library.
    `flags` are the emulator's own (the -shared among them is applied at the link step)."""
    cflags = [f for f in flags if f != "-shared"]
    obj = out + ".o"
    proc = subprocess.run([cxx, *cflags, "-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0",
                           "-c", "-x", "c++", src, "-o", obj], capture_output=True, text=True)
    if proc.returncode == 0:
        proc = subprocess.run([cxx, "-shared", "-o", out, obj], capture_output=True, text=True)
    subprocess.run(["rm", "-f", obj])
    return proc


def _setup(lib) -> None:
    if getattr(lib, "_o1b_cnt_ready", False):
        return
    lib.o1b_cnt_begin.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.o1b_cnt_begin.restype = None
    lib.o1b_cnt_end.argtypes = [ctypes.c_void_p] * 3
    lib.o1b_cnt_end.restype = None
    lib._o1b_cnt_ready = True


@contextlib.contextmanager
def launch(lib, backend: str, kernel: str, grid, block, groups: int, buffers):
    """Around one launch on a counting library: `buffers` are the argument arrays (numpy), in
    order. Appends the launch's Launch to the active log."""
    log = active()
    if log is None:
        yield
        return
    if len(buffers) > MAX_BUFFERS:
        raise RuntimeError(f"{kernel}: more than {MAX_BUFFERS} array arguments cannot be counted")
    _setup(lib)
    n = len(buffers)
    lo = np.array([b.ctypes.data for b in buffers] + [0], np.uintp)
    hi = np.array([b.ctypes.data + b.nbytes for b in buffers] + [0], np.uintp)
    rmarks = [np.zeros(max(b.nbytes, 1), np.uint8) for b in buffers]
    wmarks = [np.zeros(max(b.nbytes, 1), np.uint8) for b in buffers]
    rm = np.array([m.ctypes.data for m in rmarks] + [0], np.uintp)
    wm = np.array([m.ctypes.data for m in wmarks] + [0], np.uintp)
    lib.o1b_cnt_begin(n, lo.ctypes.data, hi.ctypes.data, rm.ctypes.data, wm.ctypes.data)
    r = np.zeros(n + 1, np.uint64)
    w = np.zeros(n + 1, np.uint64)
    ops = np.zeros(8, np.uint64)
    try:
        yield
    finally:
        lib.o1b_cnt_end(r.ctypes.data, w.ctypes.data, ops.ctypes.data)
    log.launches.append(Launch(
        backend, kernel, tuple(grid), tuple(block), int(groups),
        [int(x) for x in r[:n]], [int(x) for x in w[:n]],
        [int(np.count_nonzero(m)) if b.nbytes else 0 for m, b in zip(rmarks, buffers)],
        [int(np.count_nonzero(m)) if b.nbytes else 0 for m, b in zip(wmarks, buffers)],
        {k: int(ops[i]) for i, k in enumerate(OPS)}, int(ops[6]), int(ops[7])))
