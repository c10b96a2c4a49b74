"""cpu_ref.weights_held: the int8 layer's weight operands (s_w, the forward's packed q_w and column
sums, dW's clip marks, dx's packed R = rot(q_w) and its scale) computed once per weight array and
reused by later calls. Held or not, every output has the same bits (they are the same functions of
the same bf16 weights); these tests hold that on the shapes that cross the packing's edges and on
the special rows, and check that the hold is really used (counts), keyed by the array (address and
shape); tests/train/test_int8_training.py checks that the training step holds its weights."""
from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest

from helpers import assert_bits_equal, rand_bf16
from mlx_open1b import cpu_ref
from mlx_open1b.cpu_ref import settings
from mlx_open1b.spec.arith import f32_to_bf16

VNNI = cpu_ref.simd_level() >= 2 and cpu_ref.gemm_i8_has_vnni()
needs_vnni = pytest.mark.skipif(not VNNI, reason="the held operands belong to the AVX-512 VNNI path")

# N, K, M: tails of the 16-row chunks, of K's groups of 4 and 32-column strips, of M's 32-row
# panels and 128-row rotation blocks; one QB block, several, and less than one
SHAPES = [(1, 1, 1), (3, 5, 7), (100, 70, 45), (257, 129, 300), (130, 256, 384), (64, 704, 33)]


def _layer(rng, N, K, M, nonfinite=False):
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.05), rand_bf16(rng, (N, M), 1e-3)
    if M >= 4 and K >= 2:
        w[0] = 0                                             # a zero row
        w[1] = f32_to_bf16(np.full(K, 2e-38, np.float32))   # a row whose step size flushes: zeros
        w[2, 0] = f32_to_bf16(np.float32(4.0))               # a clipped weight
        if nonfinite:
            w[3, K // 2] = 0x7FC1                            # a non-finite row (NaN through all of dx)
    return x, w, dy


def _calls(x, w, dy):
    """Every output of the layer for these operands: y; dx, dw; dw alone; dx alone."""
    return (cpu_ref.qlinear_forward(x, w), *cpu_ref.qlinear_backward(dy, x, w),
            cpu_ref.qlinear_backward(dy, x, w, need_dx=False)[1],
            cpu_ref.qlinear_backward(dy, x, w, need_dw=False)[0])


def _same(got, want, what):
    for i, (g, e) in enumerate(zip(got, want)):
        assert_bits_equal(g, e, f"{what} output {i}")


@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("N,K,M", SHAPES)
def test_held_operands_give_the_same_bits(N, K, M, nonfinite):
    rng = np.random.default_rng(N * 31 + K * 7 + M)
    x, w, dy = _layer(rng, N, K, M, nonfinite)
    assert nonfinite or M < 4 or not np.isnan(cpu_ref.qlinear_backward(dy, x, w)[0]).any()
    for threads in (1, 2, 3):
        with settings(threads=threads):
            want = _calls(x, w, dy)
            runs, reused = cpu_ref.quant.held_runs(), cpu_ref.quant.sx_reused()
            with cpu_ref.weights_held() as held:
                first = _calls(x, w, dy)       # the first call computes the operands, the rest reuse them
                again = _calls(x, w, dy)
            _same(first, want, f"{(N, K, M)} threads {threads} first use")
            _same(again, want, f"{(N, K, M)} threads {threads} reused")
            if VNNI:    # every call ran on the held operands (counted by the C code)
                assert (held.made, held.reused) == (1, 7), "the hold was not used"
                assert cpu_ref.quant.held_runs() - runs == 8, "the C code did not run on the held operands"
                # the backwards with dW (two per _calls) took the forward's s_x
                assert cpu_ref.quant.sx_reused() - reused == 4, "the forward's s_x was not taken"


@needs_vnni
@pytest.mark.parametrize("N,K,M", [(257, 129, 300), (64, 704, 33)])
def test_backward_takes_the_forward_s_x_only_for_that_very_x(N, K, M):
    """Inside a hold, a backward takes s_x from the last forward on the same weights only when
    its x is that forward's array, still alive: not for another array (other values, or a copy), not
    after a later forward on another x, not once the forward's x is gone (another array may have
    its memory). Every dx and dW equals its unheld value either way."""
    rng = np.random.default_rng(N + K + M)
    x1, w, dy = _layer(rng, N, K, M)
    x2 = rand_bf16(rng, x1.shape, 4.0)                      # another absmax, so another s_x
    want1, want2 = cpu_ref.qlinear_backward(dy, x1, w), cpu_ref.qlinear_backward(dy, x2, w)
    count = cpu_ref.quant.sx_reused

    def check(x, want, what, taken):
        before = count()
        _same(cpu_ref.qlinear_backward(dy, x, w), want, what)
        assert count() - before == taken, f"{what}: the forward's s_x {'not ' if taken else ''}taken"

    with cpu_ref.weights_held():
        cpu_ref.qlinear_forward(x1, w)
        check(x1, want1, "the forward's x", 1)
        check(x2, want2, "another x", 0)
        check(x1.copy(), want1, "a copy of the forward's x", 0)
        cpu_ref.qlinear_forward(x1, w)
        cpu_ref.qlinear_forward(x2, w)
        check(x1, want1, "an earlier forward's x", 0)
        check(x2, want2, "the last forward's x", 1)
        xa = x2.copy()
        cpu_ref.qlinear_forward(xa, w)
        gone = weakref.ref(xa)
        del xa                                               # gone: its memory may be another array's
        assert gone() is None, "the hold keeps the forward's x alive"
        xb = x1.copy()
        check(xb, want1, "an array made after the forward's x was freed", 0)


@needs_vnni
def test_a_forward_on_the_portable_path_leaves_no_earlier_s_x():
    """A held forward that runs the portable code (the SIMD cap below AVX-512) notes no s_x, and
    drops what an earlier forward on the same weights noted: here that earlier x is freed and the
    next one takes its memory, so a record left behind would match the pointer and rows (and Python
    sees the very array the last forward was given), and dW would be scaled by the freed x's s_x."""
    rng = np.random.default_rng(3)
    N, K, M = 257, 129, 300
    _, w, dy = _layer(rng, N, K, M)
    s1, s2 = rand_bf16(rng, (N, K)), rand_bf16(rng, (N, K), 4.0)
    want = cpu_ref.qlinear_backward(dy, s2, w)
    with cpu_ref.weights_held():
        kept = []                                            # tries whose next array got other memory
        for _ in range(50):
            xa = s1.copy()
            cpu_ref.qlinear_forward(xa, w)                   # VNNI: notes xa's s_x
            address = xa.ctypes.data
            del xa
            xb = s2.copy()
            if xb.ctypes.data == address:
                break
            kept.append(xb)
        else:
            pytest.skip("the allocator never gave the next array the freed one's memory")
        with settings(simd=1):
            cpu_ref.qlinear_forward(xb, w)                   # the portable path
        before = cpu_ref.quant.sx_reused()
        got = cpu_ref.qlinear_backward(dy, xb, w)
        assert cpu_ref.quant.sx_reused() == before, "an earlier forward's s_x was taken"
    _same(got, want, "after a portable forward")


@needs_vnni
def test_held_operands_are_keyed_by_the_array():
    """Two weights of one shape each get their own operands; a new view of the same memory
    reuses them; another qmax (the simulated int6 / int4 paths: portable code) holds nothing;
    holds do not nest; another thread's calls do not use this thread's hold; no room (cap 0) holds
    nothing; leaving drops them all. Every output equals its unheld value."""
    rng = np.random.default_rng(5)
    x, w1, dy = _layer(rng, 96, 130, 70)
    w2 = rand_bf16(rng, w1.shape, 0.05)
    want1, want2 = _calls(x, w1, dy), _calls(x, w2, dy)
    with cpu_ref.weights_held() as held:
        _same(_calls(x, w1, dy), want1, "w1")
        _same(_calls(x, w2, dy), want2, "w2 (same shape, other memory)")
        _same(_calls(x, w1[:], dy), want1, "a view of w1")
        assert held.made == 2 and held.reused == 10 and held.bytes > w1.nbytes
        for qmax in (31, 7):
            want = cpu_ref.qlinear_forward(x, w1, qmax=qmax)
            assert_bits_equal(cpu_ref.qlinear_forward(x, w1, qmax=qmax), want, f"qmax {qmax}")
        assert held.made == 2
        with pytest.raises(RuntimeError, match="holds do not nest"):
            with cpu_ref.weights_held():
                pass
        seen = []                                  # another thread's calls do not see this hold
        t = threading.Thread(target=lambda: seen.append((cpu_ref.quant.held_runs(), _calls(x, w2, dy),
                                                         cpu_ref.quant.held_runs())))
        t.start()
        t.join()
        before, got, after = seen[0]
        _same(got, want2, "w2 from another thread")
        assert after == before and held.made == 2 and held.reused == 10
    assert held.bytes == 0 and held._sets == {}
    with cpu_ref.weights_held() as again:          # released: a new hold can start
        assert again is not held
    with cpu_ref.weights_held(cap_bytes=0) as none:
        _same(_calls(x, w1, dy), want1, "cap 0")
        assert none.made == 0
