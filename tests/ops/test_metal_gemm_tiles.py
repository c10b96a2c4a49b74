"""The tiled Metal GEMMs (metal/gemm.metal: 64 x 64 tiles of C, 4 x 4 outputs a thread, slices of 16
values of p in threadgroup memory; metal/gemm_i8.metal: the same with slices of 32) against the C
reference's definition, bit for bit, in the Metal emulator: shapes on each side of every tile and
slice boundary, every operand layout the model uses and general strides, the accumulating mode,
special values, the §6.1 table of sequences where a fused multiply-add would differ (placed across
slice and tile edges), the race check (forward and reverse thread order: a missing barrier) and the
adversarial fp32 unit (its flush of a tiny result picks either sign and either tininess rule where
the contract's operators do not depend on it)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from helpers import SPECIAL_BF16, assert_bits_equal, rand_bf16, sprinkle

import mlx_open1b.cpu_ref as ref
from mlx_open1b.cpu_ref import _lib, settings
from mlx_open1b.metal import emu, ops as M, slabs

OK, HOW = M.available()
pytestmark = pytest.mark.skipif(not OK, reason=HOW)

TILE, BK, BK8 = slabs.GEMM_TILE, 16, 32          # gemm.metal's tile and slices; gemm_i8.metal's slice

_gemm = _lib.lib.o1b_gemm
_gemm.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 + \
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
_gemm.restype = None


def logical(buf, off, s_row, s_p, nrow, P):
    """The (nrow, P) operand M(r, p) = buf[off + r s_row + p s_p]."""
    r, p = np.arange(nrow)[:, None], np.arange(P)[None, :]
    return buf[off + r * s_row + p * s_p]


def definition(A, B, C0=None):
    """The C reference's plain loop (settings(gemm_fast=False)) on row-major A (I, P), B (P, J)."""
    (I, P), J = A.shape, B.shape[1]
    C = np.ascontiguousarray(C0.copy()) if C0 is not None else np.zeros((I, J), np.float32)
    Ac, Bc = np.ascontiguousarray(A), np.ascontiguousarray(B)
    with settings(gemm_fast=False):
        _gemm(I, J, P, Ac.ctypes.data, P, 1, Bc.ctypes.data, J, 1, C.ctypes.data, J, int(C0 is not None))
    return C


# Layouts (A(i, p) strides, B(p, j) strides) as the ops call the kernel: the forward y = x W^T
# (both contiguous along p), dx = dy W (A along p, B along j), dW = dy^T x (A along i, B along j),
# and general strides (neither contiguous) with offsets.
def layout_strides(name, I, J, P):
    """(buffer sizes, oa, sa_i, sa_p, ob, sb_p, sb_j)."""
    if name == "forward":
        return (I * P, J * P), 0, P, 1, 0, 1, P
    if name == "dx":
        return (I * P, P * J), 0, P, 1, 0, J, 1
    if name == "dW":
        return (P * I, P * J), 0, 1, I, 0, J, 1
    if name == "strided":                   # A(i, p) = a[3 + 2 i + (2 I + 1) p], B(p, j) = b[5 + 3 p + 3 P j]
        return (3 + 2 * I + (2 * I + 1) * P, 5 + 3 * P + 3 * P * J), 3, 2, 2 * I + 1, 5, 3, 3 * P
    raise ValueError(name)


LAYOUTS = ("forward", "dx", "dW", "strided")
# I and J on each side of a tile edge (1, 63, 64, 65, 130 = two tiles and a partial one), P on
# each side of a slice edge (1, 15, 16, 17, 33, 48)
SHAPES = [(1, 1, 1), (63, 65, 16), (64, 64, 17), (65, 130, 15), (130, 63, 33), (2, 129, 48), (70, 3, 1)]


def run_case(rng, name, I, J, P, accumulate=False, frac=0.0):
    (na, nb), oa, sai, sap, ob, sbp, sbj = layout_strides(name, I, J, P)
    a, b = rand_bf16(rng, (na,), 2.0), rand_bf16(rng, (nb,), 2.0)
    if frac:
        a, b = sprinkle(rng, a, SPECIAL_BF16, frac), sprinkle(rng, b, SPECIAL_BF16, frac)
    C0 = rng.standard_normal((I, J)).astype(np.float32) if accumulate else None
    got = M._gemm(I, J, P, a, oa, sai, sap, b, ob, sbp, sbj, C0=C0)
    A = logical(a, oa, sai, sap, I, P)
    B = logical(b, ob, sbj, sbp, J, P).T
    assert_bits_equal(got, definition(A, B, C0), f"{name} {(I, J, P)} accumulate={accumulate}")


@pytest.mark.parametrize("name", LAYOUTS)
def test_shapes_and_layouts(name):
    rng = np.random.default_rng([0x6E, LAYOUTS.index(name)])
    for k, (I, J, P) in enumerate(SHAPES):
        run_case(rng, name, I, J, P, accumulate=k % 2 == 1, frac=0.05 if k % 3 == 2 else 0.0)


def test_linear_and_xent_ops_match_cpu_ref():
    """The ops that launch the GEMM (forward, dx, dW; the fused cross-entropy's logits, dh
    accumulated across vocabulary chunks, dW of the head) at edge shapes, special values included."""
    rng = np.random.default_rng(0x6E1)
    N, K, Mo = 67, 33, 70
    x, w, dy = (sprinkle(rng, rand_bf16(rng, s), SPECIAL_BF16, 0.02) for s in ((N, K), (Mo, K), (N, Mo)))
    assert_bits_equal(M.linear_forward(x, w), ref.linear_forward(x, w), "forward")
    for got, want, what in zip(M.linear_backward(dy, x, w), ref.linear_backward(dy, x, w), ("dx", "dW")):
        assert_bits_equal(got, want, what)
    V, C, chunk = 150, 40, 64              # three vocabulary chunks, the last partial
    h, wh = rand_bf16(rng, (N, C)), rand_bf16(rng, (V, C))
    targets = rng.integers(0, V, N).astype(np.int32)
    fw = M._forward_chunked(h, wh, targets, 1e-4, chunk)
    for got, want, what in zip(fw, ref.xent._forward_chunked(h, wh, targets, 1e-4, chunk), ("loss", "lse", "ce")):
        assert_bits_equal(got, want, f"xent {what}")
    dloss = rng.standard_normal(N).astype(np.float32)
    for got, want, what in zip(M._backward_chunked(h, wh, targets, 1e-4, fw[1], dloss, chunk),
                               ref.xent._backward_chunked(h, wh, targets, 1e-4, fw[1], dloss, chunk), ("dh", "dW")):
        assert_bits_equal(got, want, f"xent {what}")


# The §6.1 table: element sequences (bf16 bits of a, b in p order) where a fused multiply-add gives
# other bits than add(acc, mul(a, b)); each is placed with its steps on both sides of a slice edge.
def bf(v: float) -> int:
    return int(np.array(v, np.float32).view(np.uint32)) >> 16


TABLE = [
    [(bf(2.0 ** -100), bf(2.0 ** -26)), (bf(2.0 ** -64), bf(-(2.0 ** -64)))],     # 2^-126 (fused: 0)
    [(bf(2.0 ** -64), bf(-(2.0 ** -64)))],                                         # +0 (fused: -0)
    [(0x7F7F, bf(-1.0)), (bf(2.0 ** 64), bf(2.0 ** 64))],                          # +inf (fused: finite)
]


def table_operands(I, J, P, p_at):
    """A (I, P), B (P, J) of ordinary values with TABLE[k] planted at element (i_k, j_k) from p_at[k]
    on; the element's other products are -0 (A's row -0, B's column positive), which leave its
    accumulator as it is (it starts at +0, and +0 + -0 = +0)."""
    rng = np.random.default_rng(0x7AB)
    A, B = rand_bf16(rng, (I, P)), rand_bf16(rng, (P, J))
    where = []
    for k, seq in enumerate(TABLE):
        i, j = (TILE - 1 + k) % I, (TILE + k) % J
        A[i, :] = 0x8000
        B[:, j] &= 0x7FFF
        for q, (a, b) in enumerate(seq):
            A[i, p_at[k] + q] = a
            B[p_at[k] + q, j] = b
        where.append((i, j))
    return A, B, where


@pytest.mark.parametrize("p_at", [(BK - 1, 2 * BK - 1, 0), (0, BK, BK - 1)])
def test_fma_counterexamples(p_at):
    """The table's sequences across a slice edge, in elements on both sides of a tile edge; the
    values the definition gives there are the table's (a kernel fusing its steps fails here)."""
    I, J, P = TILE + 3, TILE + 5, 2 * BK + 3
    A, B, where = table_operands(I, J, P, p_at)
    want = definition(A, B)
    got = M._gemm(I, J, P, A, 0, P, 1, B, 0, J, 1)
    assert_bits_equal(got, want, f"table at p {p_at}")
    table = [np.float32(2.0 ** -126), np.float32(0.0), np.float32(np.inf)]
    for (i, j), v in zip(where, table):
        assert want[i, j].view(np.uint32) == v.view(np.uint32)


def test_fma_counterexamples_catch_contraction():
    """Teeth: on the emulator's contracting unit (hardware(fault="fma"): an add of a fresh product's
    bits is one fused multiply-add) the table's overflow element comes out finite. (Its two tiny
    products are flushed by the contract's mul before the add sees them, so that unit does not fuse
    them; a kernel calling fma() would, and the definition's values there are checked above.)"""
    I, J, P = TILE + 3, TILE + 5, 2 * BK + 3
    A, B, where = table_operands(I, J, P, (BK - 1, 2 * BK - 1, 0))
    want = definition(A, B)
    with emu.hardware(fault="fma"):
        got = M._gemm(I, J, P, A, 0, P, 1, B, 0, J, 1)
    i, j = where[2]
    assert want[i, j] == np.inf and np.isfinite(got[i, j])


def test_padding_is_never_added():
    """An accumulating start of -0 with -0 products stays -0; adding the zero padding of a partial
    slice or tile (+0 * +0) would make it +0."""
    I, J, P = TILE + 1, TILE + 2, BK + 3
    A = np.full((I, P), 0x8000, np.uint16)
    B = np.full((P, J), bf(1.5), np.uint16)
    C0 = np.full((I, J), -0.0, np.float32)
    want = definition(A, B, C0)
    assert (want.view(np.uint32) == 0x80000000).all()
    assert_bits_equal(M._gemm(I, J, P, A, 0, P, 1, B, 0, J, 1, C0=C0), want, "-0 accumulate")
    assert_bits_equal(M._gemm(I, J, P, np.ascontiguousarray(A.T), 0, 1, I, B, 0, J, 1, C0=C0), want, "-0, A along i")


@pytest.mark.parametrize("mode", ["race", "adversarial", "ftz"])
def test_under_race_check_and_hardware_modes(mode, monkeypatch):
    rng = np.random.default_rng([0x6E2, len(mode)])
    if mode == "race":
        monkeypatch.setenv("O1B_EMU_RACECHECK", "1")
    if mode == "ftz":
        monkeypatch.setenv("O1B_EMU_FTZ", "1")
    ctx = emu.hardware(adversarial_flush=True, seed=321) if mode == "adversarial" else emu.hardware()
    with ctx:
        for name in LAYOUTS:
            run_case(rng, name, TILE + 1, TILE + 3, 2 * BK + 1, accumulate=name == "dx", frac=0.05)
        A, B, where = table_operands(TILE + 3, TILE + 5, 2 * BK + 3, (BK - 1, 2 * BK - 1, 0))
        assert_bits_equal(M._gemm(TILE + 3, TILE + 5, 2 * BK + 3, A, 0, 2 * BK + 3, 1, B, 0, TILE + 5, 1),
                          definition(A, B), f"table, {mode}")
        if mode == "race":
            check_i8(rng, TILE + 2, TILE + 1, 2 * BK8 + 5)


# ---------------------------------------------------------------------------------------------
# gemm_i8.metal
# ---------------------------------------------------------------------------------------------
def check_i8(rng, I, J, P):
    """Every layout the quantized layer uses: the forward (both operands contiguous along p) and the
    backward (both contiguous along rows), and general strides; against cpu_ref.gemm_i8."""
    a = rng.integers(-127, 128, (I, P), dtype=np.int8)
    b = rng.integers(-127, 128, (J, P), dtype=np.int8)
    if P >= 2:
        a[0, :], b[-1, :] = 127, -127                       # the extremes, a long same-sign run
    want = ref.gemm_i8(a, b)
    assert_bits_equal(M.gemm_i8(a, b), want, f"i8 forward {(I, J, P)}")
    at, bt = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
    assert_bits_equal(M._gemm_i8(I, J, P, at, 1, I, bt, 1, J), want, f"i8 rows {(I, J, P)}")
    big_a = np.zeros(7 + 3 * I * P + 3, np.int8)
    big_a[7 + 3 * (np.arange(I)[:, None] * P + np.arange(P)[None, :])] = a      # stride 3 P along i, 3 along p
    assert_bits_equal(M._gemm_i8(I, J, P, big_a[7:], 3 * P, 3, bt, 1, J), want, f"i8 strided {(I, J, P)}")


@pytest.mark.parametrize("I,J,P", [(1, 1, 1), (63, 65, 32), (64, 64, 33), (65, 130, 31), (130, 2, 97)])
def test_i8_shapes_and_layouts(I, J, P):
    check_i8(np.random.default_rng([0x18, I, J, P]), I, J, P)
