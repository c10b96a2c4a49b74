"""Philox4x32-10 and the truncated normal initializer (CONTRACT.md §5)."""
import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.contract import STREAM_INIT
from mlx_open1b.spec import optim as S

from helpers import assert_bits_equal

# Known-answer vectors of Philox4x32-10 published with Random123 (kat_vectors): counter, key ->
# output. Golden values pinned across machines and versions; they were not produced by our code.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _block(ctr, key):
    return C.philox_blocks(key[0] | key[1] << 32, ctr[2], ctr[0] | ctr[1] << 32, 1, ctr[3])[0]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    assert tuple(int(w) for w in _block(ctr, key)) == want
    assert tuple(int(w) for w in S.philox(key, np.array([ctr], np.uint32))[0]) == want


def test_philox_equals_independent_implementation():
    # numpy.random.Philox is Philox4x64-10 (not 4x32), so the independent check is randomgen's
    # Philox(number=4, width=32), which increments its counter before each block.
    randomgen = pytest.importorskip("randomgen")
    rng = np.random.default_rng(0)
    for _ in range(20):
        key = [int(k) for k in rng.integers(0, 2 ** 32, 2)]
        ctr = [int(c) for c in rng.integers(0, 2 ** 32, 4)]
        c128 = ctr[0] | ctr[1] << 32 | ctr[2] << 64 | ctr[3] << 96
        bg = randomgen.Philox(number=4, width=32, key=key[0] | key[1] << 32, counter=(c128 - 1) % 2 ** 128)
        theirs = [int(x) for x in bg.random_raw(4)]
        assert [int(w) for w in _block(ctr, key)] == theirs


def test_philox_mapping_of_seed_stream_index():
    seed, stream = 0x0123456789ABCDEF, 7
    blocks = C.philox_blocks(seed, stream, 2 ** 32 - 2, 4, sub=3)
    for i, b in enumerate(blocks):
        idx = 2 ** 32 - 2 + i
        ctr = (idx & 0xFFFFFFFF, idx >> 32, stream, 3)
        assert_bits_equal(b, S.philox((seed & 0xFFFFFFFF, seed >> 32), np.array([ctr], np.uint32))[0])


def test_trunc_normal_bits_and_independence():
    a = C.trunc_normal(42, STREAM_INIT, 0, 5000)
    assert_bits_equal(a, S.trunc_normal(42, STREAM_INIT, 0, 5000, np.float32(0.02)), "spec")
    # element i depends only on (seed, stream, index): a slice computed alone is the same bits
    assert_bits_equal(C.trunc_normal(42, STREAM_INIT, 1234, 100), a[1234:1334], "offset")
    with C.settings(threads=1):
        b = C.trunc_normal(42, STREAM_INIT, 0, 5000)
    assert_bits_equal(a, b, "threads")
    assert not np.array_equal(a, C.trunc_normal(43, STREAM_INIT, 0, 5000))


def test_trunc_normal_distribution():
    from math import erf, sqrt
    n = 200000
    x = C.trunc_normal(7, STREAM_INIT, 0, n).astype(np.float64) / 0.02
    assert np.abs(x).max() <= 2.0
    # Kolmogorov–Smirnov distance to N(0,1) truncated at +-2; 1.95/sqrt(n) is the 0.1% level
    Phi = lambda z: 0.5 * (1 + erf(z / sqrt(2)))
    xs = np.sort(x)
    cdf = (np.vectorize(Phi)(xs) - Phi(-2)) / (Phi(2) - Phi(-2))
    emp = np.arange(1, n + 1) / n
    assert np.max(np.abs(emp - cdf)) < 1.95 / np.sqrt(n)
    assert abs(x.std() - 0.8796) < 0.01       # std of the standard normal truncated at +-2


def test_bad_input():
    with pytest.raises(ValueError, match="seed: expected an integer in"):
        C.philox_blocks(-1, 0, 0, 1)
    with pytest.raises(ValueError, match="stream"):
        C.trunc_normal(0, 2 ** 32, 0, 1)
