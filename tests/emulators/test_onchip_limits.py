"""The emulators refuse a launch whose static on-chip memory passes the device's limit, as a
device does: 48 KiB of static __shared__ arrays a CUDA block (cuda/emu SHARED_LIMIT), 32 KiB of
threadgroup arrays a Metal threadgroup (metal/emu THREADGROUP_LIMIT). Each limit is met exactly by
one kernel (it launches) and passed by one element (refused, naming the bytes)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("objdump") is None, reason="the limit checks read objdump -t")


def _cuda_kernel(floats: int):
    from mlx_open1b.cuda import emu
    src = ("extern \"C\" __global__ void big(float *x) {\n"
           f"    __shared__ float s[{floats}];\n"
           f"    for (int e = threadIdx.x; e < {floats}; e += blockDim.x) s[e] = (float)e;\n"
           "    __syncthreads();\n"
           f"    if (threadIdx.x == 0) x[0] = s[{floats} - 1];\n"
           "}\n")
    return emu.EmuModule(src, name=f"shared_{floats}.cu").get_function("big")


def test_cuda_emulator_enforces_static_shared_limit():
    from mlx_open1b.cuda import emu
    n = emu.SHARED_LIMIT // 4
    x = np.zeros(1, np.float32)
    _cuda_kernel(n)((1,), (32,), (x,))
    assert x[0] == n - 1
    with pytest.raises(emu.EmuLaunchError, match=f"{4 * (n + 1)} bytes of static shared memory"):
        _cuda_kernel(n + 1)((1,), (32,), (x,))


def _metal_kernel(floats: int):
    from mlx_open1b.metal import emu
    src = (f"threadgroup float s[{floats}];\n"
           "uint t = thread_index_in_threadgroup;\n"
           f"for (uint e = t; e < {floats}; e += 32) s[e] = (float)e;\n"
           "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
           f"if (t == 0) y[0] = s[{floats} - 1];\n")
    return emu.EmuKernel(f"tg_{floats}", ["x"], ["y"], src)


def test_metal_emulator_enforces_threadgroup_limit():
    from mlx_open1b.metal import emu
    n = emu.THREADGROUP_LIMIT // 4
    x = np.zeros(1, np.float32)
    call = dict(inputs=[x], output_shapes=[(1,)], output_dtypes=[np.float32], grid=(32, 1, 1),
                threadgroup=(32, 1, 1))
    (y,) = _metal_kernel(n)(**call)
    assert y[0] == n - 1
    with pytest.raises(emu.EmuError, match=f"{4 * (n + 1)} bytes of threadgroup memory"):
        _metal_kernel(n + 1)(**call)
