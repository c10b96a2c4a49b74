"""The tests' own bit-equality assertion (tests/helpers.py): it passes on equal bits only and
reports the first differing element, also for 0-d arrays and scalars."""
import numpy as np
import pytest

from helpers import assert_bits_equal


def test_equal_bits_pass_and_signed_zeros_or_nan_payloads_do_not():
    x = np.array([1.0, -0.0, np.nan], np.float32)
    assert_bits_equal(x, x.copy(), "same")
    assert_bits_equal(np.float32(2.5), np.float32(2.5))
    with pytest.raises(AssertionError, match=r"z: 1 of 3 elements differ; first at \(1,\): -0\.0 \(0x80000000\) "
                                             r"vs 0\.0 \(0x00000000\)"):
        assert_bits_equal(x, np.array([1.0, 0.0, np.nan], np.float32), "z")
    other_nan = x.copy()
    other_nan.view(np.uint32)[2] ^= 1
    with pytest.raises(AssertionError, match=r"first at \(2,\)"):
        assert_bits_equal(x, other_nan)


def test_zero_dimensional_arrays_report_their_mismatch():
    with pytest.raises(AssertionError, match=r"s: 1 of 1 elements differ; first at \(\): 1\.0 \(0x3f800000\) vs "
                                             r"1\.0000001 \(0x3f800001\)"):
        assert_bits_equal(np.array(1.0, np.float32), np.nextafter(np.float32(1), np.float32(2)), "s")


def test_multi_dimensional_index_and_bf16_and_bad_pairs():
    a = np.zeros((2, 3), np.uint16)
    b = a.copy()
    b[1, 2] = 0x3F80
    with pytest.raises(AssertionError, match=r"first at \(1, 2\): .*\(0x0000\) vs .*\(0x3f80\)"):
        assert_bits_equal(a, b)
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_bits_equal(a, a.reshape(3, 2))
    with pytest.raises(AssertionError, match="float32 and float64 cannot be compared"):
        assert_bits_equal(np.float32(1), 1.0)
