"""The int8 quantized linear layer (CONTRACT.md §6.9): quantizers, the exact int8 GEMM, the
Walsh-Hadamard rotation, and the layer's forward and backward."""
from __future__ import annotations

import contextlib
import threading
import time
import weakref

import numpy as np

from mlx_open1b import opargs
from ._lib import c_i64, declare, empty_lines, p, ptr
import ctypes

_qw = declare("o1b_quant_weight_rows", c_i64, c_i64, ptr, ptr, ptr)
_qt = declare("o1b_quant_tensor", c_i64, ptr, ptr, ptr, restype=ctypes.c_int)
_qtf = declare("o1b_quant_tensor_f32", c_i64, ptr, ptr, ptr, restype=ctypes.c_int)
_gemm = declare("o1b_gemm_i8", c_i64, c_i64, c_i64, ptr, ptr, ptr)
_vnni = declare("o1b_gemm_i8_has_vnni", restype=ctypes.c_int)
_amx = declare("o1b_q_amx_present", restype=ctypes.c_int)
_amx_runs = declare("o1b_q_amx_runs", restype=ctypes.c_int64)
_had = declare("o1b_hadamard_rows", c_i64, c_i64, ptr)
_fwd = declare("o1b_qlinear_forward_q", c_i64, c_i64, c_i64, ptr, ptr, ptr, ctypes.c_int, ptr, restype=ctypes.c_int)
_bwd = declare("o1b_qlinear_backward_q", c_i64, c_i64, c_i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr,
               ctypes.c_int, restype=ctypes.c_int)
_qw_new = declare("o1b_qweights_new", c_i64, c_i64, ptr, ctypes.c_int, restype=ptr)
_qw_free = declare("o1b_qweights_free", ptr)
_qw_bytes = declare("o1b_qweights_bytes", ptr, restype=c_i64)

from mlx_open1b.contract import Q_MAX_P, QB, QMAX  # noqa: E402,F401  (QB, Q_MAX_P re-exported)


def _ok(rc: int) -> None:
    if rc == -2:    # a handle of other weights: weights_held keys them by address and shape, so a bug
        raise ValueError("qlinear: the held weight operands belong to another weight array")
    if rc != 0:
        raise MemoryError("the C reference could not allocate its int8 work buffers")


# ---------------------------------------------------------------------------- held weights
#: The most bytes of weight operands weights_held() keeps by default (beyond it, calls compute
#: their operands as outside; about 3 bytes per weight).
HELD_BYTES = 1 << 30

_held_runs = declare("o1b_q_held_runs", restype=c_i64)


def held_runs() -> int:
    """How many layer calls in this process ran on held operands (a test's proof that they did)."""
    return int(_held_runs())


_sx_reused = declare("o1b_q_sx_reused", restype=c_i64)


def sx_reused() -> int:
    """How many backward calls in this process took their forward's s_x (a test's proof)."""
    return int(_sx_reused())


class HeldWeights:
    """What weights_held() holds: each weight array's int8 operands, by (data address, shape,
    qmax), with the array itself (so that its memory, and with it the address, stays the same
    array's while held); `made` and `reused` count the operand sets computed and the calls that
    used one already computed. Per handle it also remembers (weakly) the x of the last forward on
    those weights: a backward given that same array, still alive, takes the forward's s_x."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = int(cap_bytes)
        self.bytes = 0
        self.made = 0
        self.reused = 0
        self._sets: dict = {}
        self._fwd_x: dict = {}        # handle -> weakref of the last forward's x

    def forward_x(self, h, x: np.ndarray) -> None:
        """The forward on handle h was given x (its s_x is noted on the C side)."""
        self._fwd_x[h] = weakref.ref(x)

    def same_x(self, h, x) -> bool:
        """Whether x is the very array of the last forward on h, alive since (so no other array can
        have taken its memory; its values are the caller's to leave unchanged, as the weights')."""
        ref = self._fwd_x.get(h)
        return ref is not None and ref() is x

    def handle(self, w: np.ndarray, qmax: int, M: int, K: int):
        """The C handle of w's operands (computed on first use), or None: computed in the call."""
        key = (p(w), M, K, qmax)
        got = self._sets.get(key)
        if got is not None:
            if got[1] is not None:
                self.reused += 1
            return got[1]
        if self.bytes >= self.cap_bytes:
            return None
        # None: the portable code runs (another qmax, no VNNI path) or no memory; not retried
        h = _qw_new(M, K, key[0], qmax) or None
        self._sets[key] = (w, h)
        if h is not None:
            self.bytes += int(_qw_bytes(h))
            self.made += 1
        return h

    def release(self) -> None:
        for _, h in self._sets.values():
            if h is not None:
                _qw_free(h)
        self._sets.clear()
        self._fwd_x.clear()
        self.bytes = 0


_local = threading.local()      # .held: this thread's HeldWeights, while inside weights_held()


@contextlib.contextmanager
def weights_held(cap_bytes: int = HELD_BYTES):
    """Inside, this thread's qlinear_forward and qlinear_backward calls compute each weight
    array's int8 operands (CONTRACT.md §6.9: s_w; q_w packed for the forward's GEMM with its column
    sums; dW's clip marks; R = rot(q_w) quantized and packed for dx's GEMM, with its scale) once, on
    the first call that uses it, and reuse them in every later call on the same array (the same
    memory and shape); leaving drops them. A backward whose x is the very array (the same object,
    alive since) of the last forward on the same weights takes that forward's s_x instead of x's
    absmax again. The bits are those of computing them in every call (the same functions of the
    same bf16 values). The caller must not write into a weight array it has passed while inside,
    nor into an x between its forward and the backward that follows: a training step holds its
    parameters over its microbatches, which only read them and their saved activations, and lets
    go before the optimizer writes them. Holds do not nest (a hold around
    several steps would outlive their parameters): entering one inside another is a RuntimeError.
    Other threads' calls do not see it. Up to cap_bytes are held; beyond, calls compute their
    operands as outside. Yields the HeldWeights (counts)."""
    if getattr(_local, "held", None) is not None:
        raise RuntimeError("weights_held: this thread already holds weights (a hold spans one unchanged "
                           "set of weights, e.g. one training step's microbatches; holds do not nest)")
    held = _local.held = HeldWeights(cap_bytes)
    try:
        yield held
    finally:
        _local.held = None
        held.release()


def _handle(w: np.ndarray, qmax: int, M: int, K: int):
    held = getattr(_local, "held", None)
    return None if held is None else held.handle(w, qmax, M, K)


def _same_x(h, x) -> int:
    """1 where the backward's x is the last forward's on held handle h (HeldWeights.same_x; a
    handle comes only from this thread's hold)."""
    return int(h is not None and _local.held.same_x(h, x))


# ---------------------------------------------------------------------------- phase profile
_prof_on = declare("o1b_q_profile", ctypes.c_int)
_prof_reset = declare("o1b_q_profile_reset")
_prof_read = declare("o1b_q_profile_read", ptr, ctypes.c_int, restype=ctypes.c_int)

#: The int8 layer's phases (quant_vnni.c): the forward's F1 (weights, absmax of x) and F2 (x
#: quantized into the GEMM's A, the GEMM and its dequantizing epilogue, by chunks of rows); the
#: backward's B1 (weights, absmax of x; empty with held weights and the forward's x, whose s_x is
#: taken), B2 (absmax of G and D; R = rot(q_w), X = rot(q_x)), B3 (dx's and dW's A filled; R and X
#: packed as B) and B4 (the dx and dW GEMMs with their epilogues).
PROFILE_PHASES = ("F1", "F2", "B1", "B2", "B3", "B4")
#: The pieces of work timed inside them, in the order of o1b_q_profile_read, each with its phase.
PROFILE_PASSES = (("F1", "weights"), ("F1", "absmax of x"), ("F2", "x quantized into A"),
                  ("F2", "GEMM + epilogue"),
                  ("B1", "weights"), ("B1", "absmax of x"), ("B2", "absmax of G"), ("B2", "absmax of D"),
                  ("B2", "R = rot(q_w)"), ("B2", "X = rot(q_x)"), ("B3", "dx's A (G quantized)"),
                  ("B3", "dW's A (D quantized)"), ("B3", "R packed"), ("B3", "X packed"),
                  ("B4", "dx GEMM + epilogue"), ("B4", "dW GEMM + epilogue"))
#: How many values o1b_q_profile_read gives: calls and call walls (2 each), per phase its wall, its
#: thread-wall and its tasks' time, per piece its time.
PROFILE_VALUES = 4 + 3 * len(PROFILE_PHASES) + len(PROFILE_PASSES)


_peak_loop = declare("o1b_q_vnni_peak_loop", c_i64, restype=c_i64)


def kernel_peak_macs(rounds: int = 1 << 20, reps: int = 5) -> float:
    """Multiply-adds per second of a 12-accumulator vpdpbusd loop on the calling thread (the best
    of reps runs): the issue rate that bounds the int8 GEMM kernel on one core; 0.0 without the
    AVX-512 VNNI path."""
    if not gemm_i8_has_vnni():
        return 0.0
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        _peak_loop(rounds)
        best = min(best, time.perf_counter() - t0)
    return rounds * 12 * 64 / best


class LayerProfile:
    """What layer_profile() measured: `calls` (forward, backward), and in seconds `call_wall`
    (forward, backward: the C calls end to end), `wall[phase]`
    (the phase's parallel runs, end to end), `thread_wall[phase]` (each run's wall times the threads
    it used: a run with few tasks or little work uses fewer than the thread count), `tasks[phase]`
    (its tasks' run time, summed over the threads) and `passes[(phase, piece)]` (a piece's run time, summed over the threads; part of
    its phase's task time). Only calls that took the AVX-512 VNNI path are counted."""

    def __init__(self):
        self.calls = (0, 0)
        self.call_wall = (0.0, 0.0)
        self.wall = dict.fromkeys(PROFILE_PHASES, 0.0)
        self.thread_wall = dict.fromkeys(PROFILE_PHASES, 0.0)
        self.tasks = dict.fromkeys(PROFILE_PHASES, 0.0)
        self.passes = dict.fromkeys(PROFILE_PASSES, 0.0)

    def _read(self) -> None:
        n = PROFILE_VALUES
        v = np.zeros(n, np.uint64)
        got = _prof_read(p(v), n)
        if got not in (0, n):
            raise RuntimeError(f"layer_profile: the C library reports {got} counters, this module knows {n}")
        ns = v.astype(np.float64) * 1e-9
        k = len(PROFILE_PHASES)
        self.calls = (int(v[0]), int(v[1]))
        self.call_wall = (float(ns[2]), float(ns[3]))
        self.wall = dict(zip(PROFILE_PHASES, ns[4:4 + k].tolist()))
        self.thread_wall = dict(zip(PROFILE_PHASES, ns[4 + k:4 + 2 * k].tolist()))
        self.tasks = dict(zip(PROFILE_PHASES, ns[4 + 2 * k:4 + 3 * k].tolist()))
        self.passes = dict(zip(PROFILE_PASSES, ns[4 + 3 * k:].tolist()))


_prof_lock = threading.Lock()


@contextlib.contextmanager
def layer_profile():
    """Inside, the int8 layer's calls (every thread's: the counters are the process's) time their
    phases and pieces (PROFILE_PHASES, PROFILE_PASSES); the LayerProfile yielded is filled on
    leaving. For measurements (benchmarks/int8_bench.py --phases): no value computed depends on
    it. One profile at a time: entering a second is a RuntimeError."""
    if not _prof_lock.acquire(blocking=False):
        raise RuntimeError("layer_profile: a profile is already running (the counters are the process's)")
    out = LayerProfile()
    try:
        _prof_reset()
        _prof_on(1)
        try:
            yield out
        finally:
            _prof_on(0)
            out._read()
            _prof_reset()
    finally:
        _prof_lock.release()


def quant_weight_rows(w: np.ndarray):
    M, K = opargs.quant_weight_rows(w)
    q = np.empty((M, K), np.int8)
    s = np.empty(M, np.float32)
    _qw(M, K, p(w), p(q), p(s))
    return q, s


def quant_tensor(x: np.ndarray):
    f32 = x.dtype == np.float32
    n = opargs.quant_tensor(x, opargs.F32 if f32 else opargs.BF16)
    q = np.empty(x.shape, np.int8)
    s = np.empty(1, np.float32)
    _ok((_qtf if f32 else _qt)(n, p(x), p(q), p(s)))
    return q, s[0]


def gemm_i8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    I, J, P = opargs.gemm_i8(a, b)
    c = np.empty((I, J), np.int32)
    _gemm(I, J, P, p(a), p(b), p(c))
    return c


def gemm_i8_has_vnni() -> bool:
    """Whether the AVX-512 VNNI kernel is in use (at the current SIMD cap)."""
    return bool(_vnni())


def gemm_i8_has_amx() -> bool:
    """Whether this CPU and kernel give the VNNI path AMX int8 tiles for its GEMM blocks (used
    unless switched off with runtime.settings(amx=False); the same bits either way)."""
    return bool(_amx()) and gemm_i8_has_vnni()


def gemm_i8_amx_runs() -> int:
    """How many runs of GEMM blocks have gone to the AMX tiles in this process (a test's proof
    that the tile path ran)."""
    return int(_amx_runs())


def hadamard_rows(f: np.ndarray) -> np.ndarray:
    f = np.array(f, np.float32, copy=True, order="C")
    R, C = opargs.hadamard_rows(f)
    _had(R, C, p(f))
    return f


def qlinear_forward(x: np.ndarray, w: np.ndarray, qmax: int = QMAX) -> np.ndarray:
    N, K, M = opargs.qlinear_forward(x, w)
    qmax = opargs.qmax(qmax)
    y = empty_lines((N, M))
    h = _handle(w, qmax, M, K)
    _ok(_fwd(N, K, M, p(x), p(w), p(y), qmax, h))
    if h is not None:
        _local.held.forward_x(h, x)
    return y


def qlinear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, need_dx: bool = True,
                     need_dw: bool = True, qmax: int = QMAX, *, dw_out: np.ndarray | None = None):
    N, K, M = opargs.qlinear_backward(dy, x, w)
    qmax = opargs.qmax(qmax)
    dw_out = opargs.dw_out(dw_out, M, K, need_dw)
    dx = empty_lines((N, K)) if need_dx else None
    dw = (empty_lines((M, K)) if dw_out is None else dw_out) if need_dw else None
    h = _handle(w, qmax, M, K)
    _ok(_bwd(N, K, M, p(dy), p(x), p(w), p(dx), p(dw), qmax, h, _same_x(h, x)))
    return dx, dw
