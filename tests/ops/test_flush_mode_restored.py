"""The C reference's kernels that run under the hardware flush mode (x86 FTZ/DAZ, arm64 FZ): vmath.c's
O1B_VM_DISPATCH_FTZ kernels (RMSNorm, SwiGLU, RoPE, add, scale_inplace; the global norm's block sums
are checked with them) and attention.c's SIMD rows set it for the call only: afterwards the calling
thread again makes and reads subnormals, so numpy (the spec, host-side math) in the same thread keeps
IEEE gradual underflow. The caller's thread runs a share of every call (with one thread all of it),
so a mode left set on any of its paths shows here. Worker threads only ever run these kernels, which
set the mode themselves or give the same bits either way."""
import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.cpu_ref import attention as CA, layers as L, mathfn as M
from mlx_open1b.spec.arith import f32_to_bf16

LEVELS = list(range(C.simd_level() + 1))


def gradual_underflow() -> bool:
    """True when this thread's float32 arithmetic makes a subnormal (no FTZ) and reads one (no DAZ)."""
    made = np.array([2.0 ** -126], np.float32) * np.float32(0.5)
    read = np.array([2.0 ** -140], np.float32) * np.float32(2.0 ** 20)
    return bool(made[0] == np.float32(2.0 ** -127) and read[0] == np.float32(2.0 ** -120))


def _inputs():
    rng = np.random.default_rng(3)
    B, T, H, G, D, N, F = 1, 9, 2, 1, 16, 37, 40
    x = rng.standard_normal((N, 64)).astype(np.float32)
    g = f32_to_bf16(rng.uniform(0.5, 1.5, 64).astype(np.float32))
    h = rng.standard_normal((N, 2 * F)).astype(np.float32)
    q = f32_to_bf16(rng.standard_normal((B, T, H, D)).astype(np.float32))
    k = f32_to_bf16(rng.standard_normal((B, T, G, D)).astype(np.float32))
    v = f32_to_bf16(rng.standard_normal((B, T, G, D)).astype(np.float32))
    dout = rng.standard_normal((B, T, H, D)).astype(np.float32)
    xr = rng.standard_normal((2, T, H, D)).astype(np.float32)
    return x, g, h, (q, k, v, dout), xr


def _ops():
    x, g, h, (q, k, v, dout), xr = _inputs()
    cos, sin = L.rope_tables(xr.shape[1], xr.shape[3], 10000.0)
    y, rstd = L.rmsnorm_forward(x, g, 1e-5)
    o, lse = CA.attention_forward(q, k, v, 0, 0.25)
    return {
        "rmsnorm_forward": lambda: L.rmsnorm_forward(x, g, 1e-5),
        "rmsnorm_backward": lambda: L.rmsnorm_backward(y, x, g, rstd),
        "swiglu_forward": lambda: L.swiglu_forward(h),
        "swiglu_backward": lambda: L.swiglu_backward(h[:, :40].copy(), h),
        "rope_forward": lambda: L.rope_forward(xr, cos, sin),
        "rope_backward": lambda: L.rope_backward(xr, cos, sin),
        "add": lambda: M.add(x, y),
        "add_inplace": lambda: M.add_inplace(x.copy(), y),
        "scale_inplace": lambda: M.scale_inplace(x.copy(), 0.75),
        "sumsq_blocks": lambda: C.sumsq_blocks(np.resize(x, 40 * C.optim.NORM_BLOCK + 7)),
        "attention_forward": lambda: CA.attention_forward(q, k, v, 0, 0.25),
        "attention_forward_i8": lambda: CA.attention_forward_i8(q, k, v, 0, 0.25),
        # one kv head: one thread runs the fused backward, two threads its two passes
        "attention_backward": lambda: CA.attention_backward(dout, q, k, v, o, lse, 0, 0.25),
    }


NAMES = ["rmsnorm_forward", "rmsnorm_backward", "swiglu_forward", "swiglu_backward", "rope_forward",
         "rope_backward", "add", "add_inplace", "scale_inplace", "sumsq_blocks", "attention_forward",
         "attention_forward_i8", "attention_backward"]


def test_names_cover_the_ops():
    assert sorted(NAMES) == sorted(_ops())


@pytest.mark.parametrize("name", NAMES)
def test_flush_mode_restored_after_the_call(name):
    assert gradual_underflow(), "a flush mode was set before this test (left set by an earlier call?)"
    op = _ops()[name]
    assert gradual_underflow(), "flush mode left set by rmsnorm_forward or attention_forward (inputs)"
    for lv in LEVELS:
        for threads in (1, 2):
            with C.settings(simd=lv, threads=threads):
                op()
                assert gradual_underflow(), f"{name}: flush mode left set (level {lv}, {threads} threads)"
