"""Parity under adversarial flushing: the Metal and CUDA kernels on an fp32 unit that answers every tiny
result (exact value nonzero, below 2^-126) with the IEEE value, +0 or -0, chosen pseudo-randomly
per operation (emu.hardware(adversarial_flush=True)), still equal cpu_ref bit for bit.

The CI test runs a few cases of ops from every kernel family whose arithmetic meets tiny values
(the §4 functions, the scalar primitives, GEMM, RMSNorm, SwiGLU, attention, cross-entropy, AdamW,
the int8 layer), on a small set of kernels because each one is compiled again for this mode; the
slow test runs every parity op. The parity cases rarely make a sum of two normals that cancels
below 2^-126, so one more test hands add, scale and div operands that do, of both signs. The whole
suite runs under the mode with O1B_EMU_ADVERSARIAL=1.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
import mlx_open1b.cuda.ops as CU
import mlx_open1b.metal.ops as M
from mlx_open1b import parity as P
from mlx_open1b.cuda import runtime as cuda_runtime
from mlx_open1b.cuda import emu as cuda_emu
from mlx_open1b.metal import emu as metal_emu

pytestmark = pytest.mark.skipif(not cuda_emu.compiler_available()[0], reason="the emulators need g++")

CI_OPS = ["silu", "scalar_div", "linear_forward", "rmsnorm_forward", "swiglu_backward", "attention_forward",
          "xent_forward", "adamw_step", "qlinear_forward"]


@contextlib.contextmanager
def adversarial(seed: int):
    with metal_emu.hardware(adversarial_flush=True, seed=seed), cuda_emu.hardware(adversarial_flush=True, seed=seed):
        yield


def run_adversarial(ops, cases: int, seed: int):
    with adversarial(seed):
        report = P.run(["cpu_ref", "metal", "cuda"], ops=ops, cases=cases, seed=seed)
    assert report.ok and not report.missing, P.format_table(report)
    assert report.total_cases == len(ops) * cases


def test_ci_ops_match_cpu_ref_under_adversarial_flushing():
    assert set(CI_OPS) <= set(P.OPS)
    run_adversarial(CI_OPS, cases=3, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 7])
def test_every_op_matches_cpu_ref_under_adversarial_flushing(seed):
    run_adversarial(list(P.OPS), cases=3, seed=seed)


def tiny_operands(n: int = 2000):
    """(a, b, s): a + b, a * s and a / b tiny (exact values nonzero, below 2^-126), of both signs."""
    rng = np.random.default_rng(2026)
    sign = lambda: rng.choice(np.float32([1, -1]), n)                       # noqa: E731
    t = (rng.uniform(1, 1.9, n) * 2.0 ** -126).astype(np.float32) * sign()
    big = (rng.uniform(1, 2, n) * 2.0 ** 30).astype(np.float32) * sign()
    a = np.concatenate([t, t * np.float32(1.5)]).astype(np.float32)
    b = np.concatenate([-(t * np.float32(1.5)), big]).astype(np.float32)
    return a, b, 0.375


def test_tiny_sums_products_quotients_under_adversarial_flushing():
    a, b, s = tiny_operands()
    da, db = a.astype(np.float64), b.astype(np.float64)
    for exact in (da + db, da * s, da / db):                                 # the inputs do it
        assert ((exact != 0) & (np.abs(exact) < 2.0 ** -126)).sum() >= 2000
    want = {"add": C.add(a, b), "scale": C.scale(a, s), "div_int": C.div_int(a, b)}
    with adversarial(3), cuda_runtime.emulate():
        for name, ops in (("metal", M), ("cuda", CU)):
            got = {"add": ops.add(a, b), "scale": ops.scale(a, s), "div_int": ops.div_int(a, b)}
            for op, w in want.items():
                assert np.array_equal(np.asarray(got[op]).view(np.uint32), w.view(np.uint32)), (name, op)
