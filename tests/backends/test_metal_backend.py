"""The Metal backend's binding (metal/runtime.py): the mx.fast.metal_kernel path gets the call the
emulator gets, and the kernel sources' compile-time guards hold.

The op results on every backend are tests/ops/test_backend_ops.py's and test_backend_quant.py's;
the emulator's own tests are tests/emulators/test_metal_emu.py's.
"""
from __future__ import annotations

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.metal import ops as M, runtime

from helpers import SPECIAL_F32, assert_bits_equal

EXTRA_F32 = np.array([2.0 ** -126 * 1.5, np.float32(1.1754942e-38), -(2.0 ** -125), 88.72, -103.5, -87.4,
                      1e10, -3e9, 2.0 ** 31, 3.4e38, 25000.0, 0.5, -0.5, 1e-30], np.float32)
SPECIALS = np.concatenate([SPECIAL_F32, EXTRA_F32])


def sweep(stride: int) -> np.ndarray:
    """Every stride-th fp32 bit pattern (both signs, all exponents), plus the specials."""
    u = np.arange(0, 2 ** 32, stride, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([u.view(np.float32), SPECIALS])


def test_real_binding_accepts_the_same_call(monkeypatch):
    """The mx.fast.metal_kernel path gets the same arguments the emulator gets: on a Mac the op
    runs and matches cpu_ref; elsewhere MLX accepts the kernel and the call and stops only at
    'No Metal back-end'."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install mlx[cpu])")
    monkeypatch.setattr(runtime, "real_metal", lambda: True)
    monkeypatch.setattr(runtime, "_kernels", {})
    x = sweep(2 ** 32 // 1000)
    try:
        got = M.exp(x)
    except RuntimeError as e:
        assert not mx.metal.is_available() and "No Metal back-end" in str(e)
    else:
        assert_bits_equal(got, C.exp(x), "exp on Metal")
    k = runtime.kernel("gemm", *M.KERNELS["gemm"])
    assert k.real and k.header == runtime.header()


def test_kernels_reject_other_qmax_at_compile_time():
    v, s = np.ones(4, np.float32), np.ones(1, np.float32)
    with pytest.raises(RuntimeError, match="QMAX must be 127"):
        M._run("quant_apply", [v, s, M._i64(1)], [((4,), np.int8), ((4,), np.uint8)], (4, 1, 1),
               template=[("PER_ROW", 0), ("QMAX", 8)])
