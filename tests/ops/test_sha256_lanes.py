"""The C Merkle leaves (cpu_ref/src/sha256_mb.c: 16 messages per AVX-512 pass, a lane taking the
next message when its own ends, the last few going on alone from their lanes' states by the SHA
extensions (level 1) or portable C (level 0)) against hashlib, byte for byte: every padding edge
of SHA-256 with the leaf's one-byte prefix, group sizes around 16, mixed lengths, unaligned
buffers, at every SIMD level."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mlx_open1b import cpu_ref as C
from mlx_open1b.cpu_ref import sha256
from mlx_open1b.hashing import CHUNK

# (SIMD cap, SHA extensions allowed): 0 portable, 1 SHA extensions, 2 + 16 lanes; and 2 with the
# extensions off, what an AVX-512 CPU without them runs (Skylake-SP, Cascade Lake: the 16 lanes'
# last leaves finished in portable C from their lanes' states)
LEVELS = [(lv, True) for lv in range(C.simd_level() + 1)] + ([(2, False)] if C.simd_level() >= 2 else [])
HAS16 = sha256.lanes() == 16


def ref(b) -> bytes:
    h = hashlib.sha256(b"\x00")
    h.update(b)
    return h.digest()


def pool(nbytes: int, seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).bytes(nbytes + 64))


def check(bufs, level, want16=None):
    """want16: how many leaves must end in the 16 lanes (at level 2 with AVX-512)."""
    lv, ni = level
    with C.settings(simd=lv, sha_ni=ni):
        got, k = sha256.leaves_counted(bufs)
    want = [ref(b) for b in bufs]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"leaves {bad[:5]} (lengths {[len(bufs[i]) for i in bad[:5]]}) differ from hashlib"
    if lv >= 2 and HAS16 and want16 is not None:
        assert k >= want16, f"{k} leaves ended in the 16 lanes, expected {want16} or more"
    if lv < 2:
        assert k == 0
    return got


# message length = data length + 1 (the prefix): the padding's edges are at message lengths
# 55/56 (length fits the block or not), 63/64 (0x80 fits or not) mod 64, and whole blocks
EDGES = sorted(set(range(0, 201)) | {64 * k + r - 1 for k in (3, 17, 256) for r in
                                     (54, 55, 56, 57, 62, 63, 64, 65, 118, 119, 120, 121)})


@pytest.mark.parametrize("level", LEVELS, ids=lambda m: f"simd{m[0]}" + ("" if m[1] else "-no-sha-ni"))
def test_every_padding_edge_16_lanes(level):
    mem = pool(max(EDGES) * 16, 1)
    for n in EDGES:
        bufs = [mem[i * n:(i + 1) * n] for i in range(16)]
        check(bufs, level, want16=16)


@pytest.mark.parametrize("level", LEVELS, ids=lambda m: f"simd{m[0]}" + ("" if m[1] else "-no-sha-ni"))
@pytest.mark.parametrize("count", [1, 15, 16, 17, 31, 32, 33])
def test_group_sizes(level, count):
    n = 1000
    mem = pool(n * count, count)
    bufs = [mem[i * n:(i + 1) * n] for i in range(count)]
    got = check(bufs, level, want16=count // 16 * 16)      # 16 equal lengths end together
    assert len(set(got)) == count       # distinct data, distinct leaves: no lane copied to another


@pytest.mark.parametrize("level", LEVELS, ids=lambda m: f"simd{m[0]}" + ("" if m[1] else "-no-sha-ni"))
def test_whole_chunks_and_one_byte_short(level):
    mem = pool(16 * CHUNK, 2)
    for n in (CHUNK, CHUNK - 1):
        check([mem[i * n:(i + 1) * n] for i in range(16)], level, want16=16)


@pytest.mark.parametrize("level", LEVELS, ids=lambda m: f"simd{m[0]}" + ("" if m[1] else "-no-sha-ni"))
def test_mixed_lengths_unaligned_and_empty(level):
    rng = np.random.default_rng(3)
    mem = pool(1 << 20, 4)
    # 40 of one length (2 groups + 8 alone), 16 of another, 20 empty, singles; interleaved, every
    # buffer at an odd offset
    lens = [777] * 40 + [64] * 16 + [0] * 20 + [1, 55, 56, 63, 5000]
    rng.shuffle(lens)
    bufs, at = [], 1
    for n in lens:
        bufs.append(mem[at:at + n])
        at += n + int(rng.integers(1, 8))
    bufs += [b"", memoryview(b"")]             # empty buffers without an address
    check(bufs, level, want16=16)


@pytest.mark.parametrize("level", LEVELS, ids=lambda m: f"simd{m[0]}" + ("" if m[1] else "-no-sha-ni"))
def test_lanes_refilled_and_finished_alone(level):
    mem = pool(1 << 20, 6)
    # 15 short messages end after 4 blocks; the long one goes on alone from its lane's state
    bufs = [mem[i * 200 + 3:(i + 1) * 200 + 3] for i in range(15)] + [mem[5001:5001 + 70000]]
    check(bufs, level, want16=15)
    # random lengths: lanes take new messages at every block count, several rounds of them
    rng = np.random.default_rng(7)
    for trial in range(4):
        lens = rng.integers(0, 20000, int(rng.integers(17, 90)))
        starts = rng.integers(0, (1 << 20) - 20000, len(lens))
        check([mem[a:a + n] for a, n in zip(starts, lens)], level, want16=1)


def _cpu_has_sha_ni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " sha_ni" in line for line in f)
    except OSError:
        return False


@pytest.mark.skipif(not HAS16, reason="the 16 lanes need AVX-512")
def test_the_switch_decides_who_finishes_a_few_messages():
    # Three equal messages: with the SHA extensions, fewer than 6 in flight go on alone (none ends in
    # the lanes); without them the lanes run down to 2 in flight (all three end there). So the
    # no-sha-ni tests above do run the other finish, not just the same code under another name.
    mem = pool(3 * 300, 8)
    bufs = [mem[i * 300:(i + 1) * 300] for i in range(3)]
    got = check(bufs, (2, False))
    with C.settings(simd=2, sha_ni=False):
        assert sha256.leaves_counted(bufs) == (got, 3)
    if _cpu_has_sha_ni():
        with C.settings(simd=2):
            assert sha256.leaves_counted(bufs) == (got, 0)


def test_nothing():
    assert sha256.leaves_counted([]) == ([], 0)


def collection(seed: int = 5) -> list:
    """Tensors of many sizes, with groups of equal lengths (whole chunks, equal tails, equal small
    tensors) and lengths alone, as a training state has."""
    rng = np.random.default_rng(seed)
    items = [(f"big{i}", rng.integers(0, 2**16, (5, CHUNK // 4 + 7), dtype=np.uint16)) for i in range(9)]
    items += [(f"mid{i}", rng.standard_normal(CHUNK // 4 + 333).astype(np.float32)) for i in range(18)]
    items += [(f"norm{i}", rng.integers(0, 2**16, 384, dtype=np.uint16)) for i in range(17)]
    items += [("step", np.array([7], np.int64)), ("empty", np.zeros((0, 3), np.float32)),
              ("odd", rng.integers(0, 2**32, 1001, dtype=np.uint32))]
    return items


def test_hashing_uses_the_lanes_and_gives_hashlibs_digests(monkeypatch):
    from mlx_open1b import hashing
    items = collection()
    monkeypatch.setattr(hashing, "_lanes_module", False)            # hashlib for every leaf
    want = hashing.tensor_digests(items)
    want_leaves = hashing.leaf_hashes(items[0][1])
    if not HAS16:
        pytest.skip("no 16-lane SHA-256 here (needs AVX-512)")
    calls = []

    class Counting:
        @staticmethod
        def leaves(bufs):
            calls.append(len(bufs))
            return sha256.leaves(bufs)

    monkeypatch.setattr(hashing, "_lanes_module", Counting)
    for threads in (1, 2):
        monkeypatch.setattr(hashing, "_threads", threads)
        got = hashing.tensor_digests(items)
        assert list(got) == list(want)
        bad = [k for k in want if got[k] != want[k]]
        assert not bad, f"tensor digests differ with the 16-lane leaves: {bad[:5]}"
        assert hashing.leaf_hashes(items[0][1]) == want_leaves
    # every leaf of the collection (more than 16) went to C; leaf_hashes' 3 to hashlib
    nleaves = sum(max(1, -(-a.nbytes // CHUNK)) for _, a in items)
    assert sum(calls) == 2 * nleaves and min(calls) >= 16


def test_hashing_falls_back_to_hashlib(monkeypatch):
    """hashlib's digests where the C leaves cannot serve: C out of memory (-1), or a C library
    built before these leaves (a symbol missing when cpu_ref.sha256 is bound)."""
    import types
    from mlx_open1b import cpu_ref as package, hashing
    items = collection()
    monkeypatch.setattr(hashing, "_lanes_module", False)
    want = hashing.tensor_digests(items)

    class NoMemory:
        @staticmethod
        def leaves(bufs):
            raise MemoryError("sha256 leaves: out of memory")

    monkeypatch.setattr(hashing, "_lanes_module", NoMemory)
    assert hashing.tensor_digests(items) == want
    monkeypatch.setattr(hashing, "_lanes_module", None)
    monkeypatch.setattr(package, "sha256", types.ModuleType("sha256"), raising=False)   # no lanes()
    assert hashing.tensor_digests(items) == want
    assert hashing._lanes_module is False


def guarded(data: bytes, at_end: bool, keep: list):
    """data in a buffer that ends (at_end) or starts right at an inaccessible page, so that a read
    past either end faults instead of reading a neighbour's bytes."""
    import ctypes
    import mmap
    page, n = mmap.PAGESIZE, len(data)
    size = -(-n // page) * page + 2 * page
    m = mmap.mmap(-1, size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base, page, 0) == 0 and libc.mprotect(base + size - page, page, 0) == 0
    start = size - page - n if at_end else page
    m[start:start + n] = data
    keep.append(m)
    return np.frombuffer(m, np.uint8, n, start)


@pytest.mark.skipif(not hasattr(__import__("mmap"), "PROT_READ"), reason="needs mmap page protection")
@pytest.mark.parametrize("level", LEVELS, ids=lambda m: f"simd{m[0]}" + ("" if m[1] else "-no-sha-ni"))
def test_no_read_past_either_end(level):
    """Every padding edge, 16 lanes of a length and mixed lengths, each buffer against a guard page."""
    rng, keep = np.random.default_rng(8), []
    lens = [n for n in EDGES if n < 1200] + [CHUNK - 1, 70001]
    for n in lens[::3]:
        check([guarded(rng.bytes(n), i % 2 == 0, keep) for i in range(16)], level, want16=16)
    check([guarded(rng.bytes(n), i % 2 == 1, keep) for i, n in enumerate(lens)], level)
