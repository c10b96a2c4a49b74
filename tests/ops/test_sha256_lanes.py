"""The C Merkle leaves (cpu_ref/src/sha256_mb.c: 16 equal-length messages per AVX-512 pass, the
rest one at a time) against hashlib, byte for byte: every padding edge of SHA-256 with the leaf's
one-byte prefix, group sizes around 16, mixed lengths, unaligned buffers, at every SIMD level."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mlx_open1b import cpu_ref as C
from mlx_open1b.cpu_ref import sha256
from mlx_open1b.hashing import CHUNK

LEVELS = sorted({0, C.simd_level()})
HAS16 = sha256.lanes() == 16


def ref(b) -> bytes:
    h = hashlib.sha256(b"\x00")
    h.update(b)
    return h.digest()


def pool(nbytes: int, seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).bytes(nbytes + 64))


def check(bufs, level, want16=None):
    with C.settings(simd=level):
        got, k = sha256.leaves_counted(bufs)
    want = [ref(b) for b in bufs]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"leaves {bad[:5]} (lengths {[len(bufs[i]) for i in bad[:5]]}) differ from hashlib"
    if level >= 2 and HAS16 and want16 is not None:
        assert k == want16, f"{k} leaves hashed 16 at a time, expected {want16}"
    if level == 0:
        assert k == 0
    return got


# message length = data length + 1 (the prefix): the padding's edges are at message lengths
# 55/56 (length fits the block or not), 63/64 (0x80 fits or not) mod 64, and whole blocks
EDGES = sorted(set(range(0, 201)) | {64 * k + r - 1 for k in (3, 17, 256) for r in
                                     (54, 55, 56, 57, 62, 63, 64, 65, 118, 119, 120, 121)})


@pytest.mark.parametrize("level", LEVELS)
def test_every_padding_edge_16_lanes(level):
    mem = pool(max(EDGES) * 16, 1)
    for n in EDGES:
        bufs = [mem[i * n:(i + 1) * n] for i in range(16)]
        check(bufs, level, want16=16)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("count", [1, 15, 16, 17, 31, 32, 33])
def test_group_sizes(level, count):
    n = 1000
    mem = pool(n * count, count)
    bufs = [mem[i * n:(i + 1) * n] for i in range(count)]
    got = check(bufs, level, want16=count // 16 * 16)
    assert len(set(got)) == count       # distinct data, distinct leaves: no lane copied to another


@pytest.mark.parametrize("level", LEVELS)
def test_whole_chunks_and_one_byte_short(level):
    mem = pool(16 * CHUNK, 2)
    for n in (CHUNK, CHUNK - 1):
        check([mem[i * n:(i + 1) * n] for i in range(16)], level, want16=16)


@pytest.mark.parametrize("level", LEVELS)
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
    check(bufs, level, want16=32 + 16 + 16)


def test_nothing():
    assert sha256.leaves_counted([]) == ([], 0)
