"""The int8 layer's weight-operand cache (cpu_ref/src/quant_wcache.c, used by the VNNI path at
qmax 127): a hit gives the bits of a recomputation (forward and backward, tails, special
weights), the key is the weight's bits and not its address (one element changed in place
misses), the cap bounds it with least-recently-used eviction, and calls from several threads
with evictions under them keep their bits."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from helpers import SPECIAL_BF16, assert_bits_equal, rand_bf16, sprinkle
from mlx_open1b import cpu_ref
from mlx_open1b.contract import QMAX
from mlx_open1b.cpu_ref import settings
from mlx_open1b.cpu_ref.quant import wcache, wcache_clear, wcache_stats

pytestmark = pytest.mark.skipif(not cpu_ref.gemm_i8_has_vnni(), reason="the cache serves the VNNI path only")


@pytest.fixture(autouse=True)
def fresh_cache():
    wcache_clear()
    with wcache(on=True, cap=-1):
        yield
    wcache_clear()


def layer(rng, N, K, M, special=False):
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    if special:
        w = sprinkle(rng, w, SPECIAL_BF16, 0.01)
        w[0] = 0                                      # zero row: s = +0
        w[min(2, M - 1), -1] = 0x7F7F                 # huge: a clipped outlier
    return x, w, dy


def uncached(fn, *args, **kw):
    with wcache(on=False):
        return fn(*args, **kw)


def check_bwd(got, want, what):
    for g, c, name in zip(got, want, ("dx", "dw")):
        if c is None:
            assert g is None
        else:
            assert_bits_equal(g, c, f"{what} {name}")


SHAPES = [(1, 1, 1), (7, 9, 5), (37, 19, 53), (130, 200, 129), (260, 96, 200), (64, 300, 33), (129, 257, 130)]


@pytest.mark.parametrize("N,K,M", SHAPES)
@pytest.mark.parametrize("special", [False, True])
def test_hits_give_the_bits_of_a_recomputation(N, K, M, special):
    """Two microbatches on one weight, forward and backward in both orders and with one gradient
    left out: every call equals the same call with the cache off, and the later calls hit."""
    rng = np.random.default_rng(N * 1000 + K * 10 + M + special)
    x1, w, dy1 = layer(rng, N, K, M, special)
    x2, _, dy2 = layer(rng, N, K, M)
    calls = [("bwd", x1, dy1, True, False), ("fwd", x1, None, None, None), ("bwd", x1, dy1, True, True),
             ("fwd", x2, None, None, None), ("bwd", x2, dy2, True, True), ("bwd", x2, dy2, False, True),
             ("bwd", x1, dy1, True, False), ("fwd", x1, None, None, None)]
    for i, (kind, x, dy, need_dx, need_dw) in enumerate(calls):
        if kind == "fwd":
            assert_bits_equal(cpu_ref.qlinear_forward(x, w), uncached(cpu_ref.qlinear_forward, x, w), f"call {i} y")
        else:
            check_bwd(cpu_ref.qlinear_backward(dy, x, w, need_dx, need_dw),
                      uncached(cpu_ref.qlinear_backward, dy, x, w, need_dx, need_dw), f"call {i}")
    st = wcache_stats()
    # misses: the first backward (dx only), the first forward, the first backward needing dW's clip marks
    assert (st["hits"], st["misses"], st["entries"]) == (5, 3, 1), st


@pytest.mark.parametrize("qmax", [7, 31, QMAX])
def test_only_the_vnni_path_looks_up(qmax):
    """The int4 / int6 paths run quant.c's portable code, which has no cache: no lookups, and the
    same bits with the cache on or off; qmax 127 looks up and hits the second time."""
    rng = np.random.default_rng(qmax)
    x, w, dy = layer(rng, 70, 130, 40)
    for _ in range(2):
        assert_bits_equal(cpu_ref.qlinear_forward(x, w, qmax=qmax), uncached(cpu_ref.qlinear_forward, x, w, qmax=qmax))
        check_bwd(cpu_ref.qlinear_backward(dy, x, w, qmax=qmax),
                  uncached(cpu_ref.qlinear_backward, dy, x, w, qmax=qmax), f"qmax {qmax}")
    st = wcache_stats()
    assert (st["hits"], st["misses"]) == ((2, 2) if qmax == QMAX else (0, 0)), st


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_element_changed_in_place_misses(where):
    """The optimizer rewrites a weight's buffer in place: after one element changes (at the same
    address), the next call must give the new weight's bits, not the cached ones."""
    rng = np.random.default_rng(5)
    x, w, dy = layer(rng, 96, 160, 70)
    y_old = cpu_ref.qlinear_forward(x, w)
    dx_old, dw_old = cpu_ref.qlinear_backward(dy, x, w)
    addr = w.ctypes.data
    i, j = {"first": (0, 0), "middle": (35, 80), "last": (69, 159)}[where]
    w[i, j] = 0x4100                                  # 8.0: changes row i's scale, so y's column i
    assert w.ctypes.data == addr
    y = cpu_ref.qlinear_forward(x, w)
    dx, dw = cpu_ref.qlinear_backward(dy, x, w)
    assert_bits_equal(y, uncached(cpu_ref.qlinear_forward, x, w), "y")
    check_bwd((dx, dw), uncached(cpu_ref.qlinear_backward, dy, x, w), "changed")
    assert not np.array_equal(y.view(np.uint32), y_old.view(np.uint32))
    assert not np.array_equal(dx.view(np.uint32), dx_old.view(np.uint32))
    assert not np.array_equal(dw.view(np.uint32), dw_old.view(np.uint32))
    st = wcache_stats()
    assert (st["hits"], st["misses"]) == (0, 4), st
    assert st["entries"] == 1, st           # the entry for the old bits at this address is gone


def test_the_key_is_the_bits_not_the_address():
    """A copy of the weight at another address hits; the same shape with other bits misses."""
    rng = np.random.default_rng(6)
    x, w, dy = layer(rng, 50, 64, 48)
    cpu_ref.qlinear_forward(x, w)
    assert_bits_equal(cpu_ref.qlinear_forward(x, w.copy()), uncached(cpu_ref.qlinear_forward, x, w))
    assert wcache_stats()["hits"] == 1
    w2 = w.copy()
    w2[-1, -1] ^= 1
    assert_bits_equal(cpu_ref.qlinear_forward(x, w2), uncached(cpu_ref.qlinear_forward, x, w2))
    assert (wcache_stats()["hits"], wcache_stats()["misses"]) == (1, 2)


def entry_bytes(x, w):
    wcache_clear()
    cpu_ref.qlinear_forward(x, w)
    n = wcache_stats()["bytes"]
    wcache_clear()
    return n


def test_eviction_least_recently_used_under_a_small_cap():
    rng = np.random.default_rng(7)
    x, _, _ = layer(rng, 40, 120, 60)
    ws = [layer(rng, 40, 120, 60)[1] for _ in range(3)]
    want = [uncached(cpu_ref.qlinear_forward, x, w) for w in ws]
    e = entry_bytes(x, ws[0])
    with wcache(cap=2 * e + e // 2):                   # room for two entries
        def fwd(k, hit):
            before = wcache_stats()["hits"]
            assert_bits_equal(cpu_ref.qlinear_forward(x, ws[k]), want[k], f"w{k}")
            st = wcache_stats()
            assert st["hits"] - before == hit, (k, st)
            assert st["bytes"] <= st["cap"] and st["entries"] <= 2, st
        fwd(0, 0); fwd(1, 0); fwd(0, 1)                # w1 is now the least recently used
        fwd(2, 0)                                      # evicts w1
        fwd(0, 1); fwd(2, 1); fwd(1, 0)                # w1 again evicts w0
        fwd(2, 1); fwd(0, 0)
    with wcache(cap=e - 1):                            # an entry larger than the cap is never made
        wcache_clear()
        for k in range(3):
            assert_bits_equal(cpu_ref.qlinear_forward(x, ws[k]), want[k], f"w{k} uncacheable")
        assert wcache_stats()["entries"] == 0 and wcache_stats()["bytes"] == 0


def test_threads_with_evictions_under_them():
    """Several threads on a few weights of sizes whose parts glibc returns to the system when
    freed, under a cap that holds about one entry: entries are evicted while other threads
    read them. Same bits as one call at a time with the cache off."""
    rng = np.random.default_rng(8)
    N, K, M = 64, 512, 384
    x, _, dy = layer(rng, N, K, M)
    ws = [layer(rng, N, K, M)[1] for _ in range(3)]
    want = [(uncached(cpu_ref.qlinear_forward, x, w), uncached(cpu_ref.qlinear_backward, dy, x, w)) for w in ws]
    cpu_ref.qlinear_backward(dy, x, ws[0])
    e = wcache_stats()["bytes"]
    errors = []

    def work(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(40):
                k = int(r.integers(3))
                assert_bits_equal(cpu_ref.qlinear_forward(x, ws[k]), want[k][0], "y")
                check_bwd(cpu_ref.qlinear_backward(dy, x, ws[k]), want[k][1], f"w{k}")
        except AssertionError as err:        # pragma: no cover - reported below
            errors.append(err)
    with wcache(cap=e + e // 2), settings(threads=2):
        ts = [threading.Thread(target=work, args=(s,)) for s in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert not errors, errors[0]
    st = wcache_stats()
    assert st["hits"] + st["misses"] == 1 + 3 * 40 * 2 and st["bytes"] <= e + e // 2, st


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_another_thread_is_inside_the_cache():
    """A thread keeps looking the weight up (each hit compares its 2 MB under the cache's lock)
    while this one forks: the children's int8 calls must not wait forever on a lock that only the
    parent's thread held, and must give the same bits."""
    rng = np.random.default_rng(9)
    x, w, _ = layer(rng, 1, 1024, 1024)
    want = uncached(cpu_ref.qlinear_forward, x, w)
    cpu_ref.qlinear_forward(x, w)
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            cpu_ref.qlinear_forward(x, w)
    t = threading.Thread(target=busy)
    t.start()
    hung, failed = 0, 0
    try:
        for _ in range(20):
            pid = os.fork()
            if pid == 0:                              # the child: one stats call, one layer call
                code = 1
                try:
                    wcache_stats()
                    code = 0 if np.array_equal(cpu_ref.qlinear_forward(x, w).view(np.uint32),
                                               want.view(np.uint32)) else 2
                finally:
                    os._exit(code)
            deadline = time.monotonic() + 5
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            if done[0] == 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                hung += 1
            elif done[1] != 0:
                failed += 1
    finally:
        stop.set()
        t.join()
    assert (hung, failed) == (0, 0), f"of 20 forked children {hung} hung, {failed} gave other bits"
