"""The Metal emulator (metal/emu) itself: the x86 FTZ|DAZ mode standing in for a flushing GPU
(the contract's bits must not depend on it), a planted one-ulp fault caught, barriers and the race
check, barrier divergence, compile errors, MLX's kernel signature, shapes and template arguments
reaching the kernel, and the compile caches (in memory, on disk, across processes).

The op results on every backend are tests/ops/test_backend_ops.py's and test_backend_quant.py's;
the real mx.fast.metal_kernel binding is tests/backends/test_metal_backend.py's.
"""
from __future__ import annotations

import platform
import subprocess
import sys

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.metal import emu, ops as M, runtime
from mlx_open1b.spec import arith as A

from helpers import SPECIAL_F32, assert_bits_equal, near_min_normal_pairs

EXTRA_F32 = np.array([2.0 ** -126 * 1.5, np.float32(1.1754942e-38), -(2.0 ** -125), 88.72, -103.5, -87.4,
                      1e10, -3e9, 2.0 ** 31, 3.4e38, 25000.0, 0.5, -0.5, 1e-30], np.float32)
SPECIALS = np.concatenate([SPECIAL_F32, EXTRA_F32])


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng([0x0E7A1, *key])


def sweep(stride: int) -> np.ndarray:
    """Every stride-th fp32 bit pattern (both signs, all exponents), plus the specials."""
    u = np.arange(0, 2 ** 32, stride, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([u.view(np.float32), SPECIALS])


# The results are written as the primitives return them, without o1b_store: a primitive must flush
# its own result (§3), and a flushing store would hide one that does not. Only NaN payloads are
# left to compare canonically (o1b_store's other job), through raw().
PRIM_SRC = """
uint i = thread_position_in_grid.x;
float x = o1b_load(a[i]), y = o1b_load(b[i]);
mul_out[i] = o1b_mul(x, y);
div_out[i] = o1b_div(x, y);
add_out[i] = o1b_add(x, y);
max_out[i] = o1b_max(x, y);
"""


def raw(out: np.ndarray) -> np.ndarray:
    """A primitive's unstored result with its NaNs made canonical and nothing else changed."""
    return A.canon(out)



# ---------------------------------------------------------------------------------------------
# The kernels are the contract: a one-ulp change in a source is caught
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ftz", [False, True] if platform.machine() in ("x86_64", "AMD64") else [False])
def test_results_do_not_depend_on_hardware_flushing(ftz):
    """The header's primitives give the contract's bits whether or not the hardware flushes
    subnormals (emulated with x86 FTZ|DAZ, tininess after rounding, as a flushing GPU)."""
    rng = rng_for(16)
    na, nb_mul, nb_div = near_min_normal_pairs(rng, 5000)
    tiny = (rng.uniform(-4, 4, 5000) * 2.0 ** -126).astype(np.float32)     # sums near and below 2^-126
    a = np.concatenate([na, na, tiny, rng.choice(SPECIALS, 2000)]).astype(np.float32)
    b = np.concatenate([nb_mul, nb_div, -(tiny * np.float32(1.5)), rng.choice(SPECIALS, 2000)]).astype(np.float32)
    k = emu.EmuKernel("test_primitives_raw_ftz", ["a", "b"], ["mul_out", "div_out", "add_out", "max_out", "sub_out"],
                      PRIM_SRC + "sub_out[i] = o1b_sub(x, y);", runtime.header(), ftz=ftz)
    outs = k(inputs=[a, b], output_shapes=[a.shape] * 5, output_dtypes=[np.float32] * 5,
             grid=(a.size, 1, 1), threadgroup=(256, 1, 1))
    fa, fb = A.flush(a), A.flush(b)
    for got, want, what in zip(outs, (A.mul(fa, fb), A.div(fa, fb), A.add(fa, fb), A.maximum(fa, fb),
                                      A.sub(fa, fb)), ("mul", "div", "add", "max", "sub")):
        assert_bits_equal(raw(got), A.store(want), f"{what} (ftz={ftz})")
    x = sweep(99991)
    (y,) = emu.EmuKernel("map_ftz", ["x"], ["y"], runtime.source("map"), runtime.header(), ftz=ftz)(
        inputs=[x], output_shapes=[x.shape], output_dtypes=[np.float32], grid=(x.size, 1, 1),
        threadgroup=(256, 1, 1), template=[("OP", 7)])
    assert_bits_equal(y, C.silu(x), f"silu (ftz={ftz})")


def test_planted_one_ulp_mutation_is_caught():
    header = runtime.header()
    assert header.count("0x3E2AAAABu") == 1          # exp's 1/3! coefficient (0x1.555556p-3)
    mutated = header.replace("0x3E2AAAABu", "0x3E2AAAAAu")
    x = sweep(9973)
    want = C.exp(x)
    for hdr, expect_equal in ((header, True), (mutated, False)):
        k = runtime.get_kernel("map_mutation_check" + ("" if expect_equal else "_planted"), ["x"], ["y"],
                               runtime.source("map"), hdr)
        (got,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[np.float32], grid=(x.size, 1, 1),
                   threadgroup=(256, 1, 1), template=[("OP", 0)])
        same = np.array_equal(got.view(np.uint32), want.view(np.uint32))
        assert same == expect_equal, (f"{'unchanged' if expect_equal else 'mutated'} exp: "
                                      f"{np.count_nonzero(got.view(np.uint32) != want.view(np.uint32))} mismatches")


# ---------------------------------------------------------------------------------------------
# The emulator: barriers, race check, compile errors, the signature, the cache
# ---------------------------------------------------------------------------------------------
REDUCE_SRC = """
threadgroup uint buf[64];
uint t = thread_position_in_threadgroup.x;
uint g = threadgroup_position_in_grid.x;
buf[t] = x[g * 64 + t];
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint s = 32; s > 0; s >>= 1) {
    if (t < s) buf[t] = buf[t] + buf[t + s];
    BARRIER
}
if (t == 0) out[g] = buf[0];
"""
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


@pytest.fixture(params=[False, True], ids=["fast-switch", "ucontext"])
def fibers(request, monkeypatch):
    """Both fiber implementations of the emulator (fiber_switch.h's x86-64 stack switch, where
    available, and ucontext's swapcontext with O1B_EMU_UCONTEXT=1)."""
    if request.param:
        monkeypatch.setenv("O1B_EMU_UCONTEXT", "1")
    else:
        monkeypatch.delenv("O1B_EMU_UCONTEXT", raising=False)
    return request.param


FAST_SWITCH_HOST = platform.machine() == "x86_64" and sys.platform.startswith("linux")


def test_fibers_use_the_switch_they_are_asked_for(fibers):
    """The fixture's two modes differ: fiber_switch.h's stack switch on x86-64 Linux, ucontext with
    O1B_EMU_UCONTEXT=1 or on any other host (the built library reports which)."""
    k = emu.EmuKernel("switch_probe", ["x"], ["out"], "uint t = thread_position_in_threadgroup.x;\n"
                      "threadgroup_barrier(mem_flags::mem_threadgroup);\nout[t] = x[(t + 1) % 4];")
    x = np.arange(4, dtype=np.float32)
    (out,) = k(inputs=[x], output_shapes=[(4,)], output_dtypes=[np.float32], grid=(4, 1, 1),
               threadgroup=(4, 1, 1))
    np.testing.assert_array_equal(out, np.roll(x, -1))
    assert k.library.o1b_emu_fast_switch() == int(FAST_SWITCH_HOST and not fibers)


def _reduce(src, x, race_check, real=False):
    if real:
        k = runtime.MetalKernel("tree_reduce_real", ["x"], ["out"], src)
    else:
        k = emu.EmuKernel("tree_reduce", ["x"], ["out"], src, race_check=race_check)
    (out,) = k(inputs=[x], output_shapes=[(x.size // 64,)], output_dtypes=[np.uint32],
               grid=(x.size, 1, 1), threadgroup=(64, 1, 1))
    return out


def test_barrier_reduction_gives_the_right_answer(fibers):
    x = rng_for(14).integers(0, 2 ** 20, 64 * 5).astype(np.uint32)
    want = x.reshape(5, 64).sum(1).astype(np.uint32)
    np.testing.assert_array_equal(_reduce(REDUCE_SRC.replace("BARRIER", BARRIER), x, True), want)
    np.testing.assert_array_equal(_reduce(REDUCE_SRC.replace("BARRIER", BARRIER), x, False, real=True), want)


def test_missing_barrier_is_detected(fibers):
    x = rng_for(15).integers(0, 2 ** 20, 64 * 5).astype(np.uint32)
    want = x.reshape(5, 64).sum(1).astype(np.uint32)
    src = REDUCE_SRC.replace("BARRIER", "")
    with pytest.raises(emu.EmuRaceError, match="tree_reduce.*missing threadgroup_barrier"):
        _reduce(src, x, True)
    # without the race check the forward order already gives a wrong sum
    assert not np.array_equal(_reduce(src, x, False), want)


def test_barrier_holds_every_thread(fibers):
    # each thread reads its neighbour's value after the barrier: right only if no thread passes early
    src = """
    threadgroup float buf[100];
    uint t = thread_position_in_threadgroup.x, n = threads_per_threadgroup.x;
    buf[t] = x[thread_position_in_grid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float v = buf[(t + 1) % n];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    buf[t] = v * 2.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = buf[(t + n - 1) % n];
    """
    x = np.arange(250, dtype=np.float32)                    # groups of 100, 100, 50 (a partial group)
    k = emu.EmuKernel("neighbour", ["x"], ["out"], src, race_check=True)
    (out,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[np.float32], grid=(250, 1, 1),
               threadgroup=(100, 1, 1))
    np.testing.assert_array_equal(out, 2 * x)


def test_barrier_divergence_is_an_error(fibers):
    src = """
    threadgroup float buf[8];
    uint t = thread_position_in_threadgroup.x;
    if (t == 3) return;
    buf[t] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[t] = buf[0];
    """
    k = emu.EmuKernel("diverge", ["x"], ["out"], src)
    with pytest.raises(emu.EmuError, match="diverge.*barrier divergence"):
        k(inputs=[np.zeros(8, np.float32)], output_shapes=[(8,)], output_dtypes=[np.float32],
          grid=(8, 1, 1), threadgroup=(8, 1, 1))


def test_compile_error_names_the_kernel():
    k = emu.EmuKernel("broken_kernel", ["x"], ["out"], "out[0] = x[0] + undefined_name;", runtime.header())
    with pytest.raises(emu.EmuCompileError) as e:
        k(inputs=[np.zeros(3, np.float32)], output_shapes=[(3,)], output_dtypes=[np.float32],
          grid=(1, 1, 1), threadgroup=(1, 1, 1))
    msg = str(e.value)
    assert "broken_kernel" in msg and "undefined_name" in msg and "error" in msg


def test_signature_is_mlx_s():
    x = np.zeros(10, np.float32)
    tiny = np.zeros(3, np.int64)
    name = emu.kernel_name("k", [x, tiny], [np.dtype(np.uint16)], [("T", np.float32), ("N", 3), ("B", True)])
    assert name == "custom_kernel_k__float_3_1_float_int64_tc_uint16_t"
    src = "out[thread_position_in_grid.x] = x_shape[0] + threads_per_threadgroup.x;"
    text = emu.write_signature(name, "", src, ["x", "prm"], [x, tiny], ["out"], [np.dtype(np.uint16)],
                               [("T", np.float32), ("N", 3)], emu.attributes(src), emu.shape_infos(src, ["x", "prm"]))
    assert text == (
        "template <typename T, int N>\n"
        "[[kernel]] void custom_kernel_k__float_3_1_float_int64_tc_uint16_t(\n"
        "  const device float* x [[buffer(0)]],\n"
        "  const constant int* x_shape [[buffer(1)]],\n"
        "  const constant int64_t* prm [[buffer(2)]],\n"
        "  device uint16_t* out [[buffer(3)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]],\n"
        "  uint3 threads_per_threadgroup [[threads_per_threadgroup]]) {\n"
        + src + "\n}\n")


def test_shape_strides_ndim_and_template_args_reach_the_kernel():
    src = """
    uint i = thread_position_in_grid.x;
    out[i] = T(a_shape[1] * 1000 + a_strides[0] * 10 + a_ndim + N);
    """
    k = emu.EmuKernel("shapes", ["a"], ["out"], src)
    (out,) = k(inputs=[np.zeros((4, 6), np.float32)], output_shapes=[(2,)], output_dtypes=[np.float32],
               grid=(2, 1, 1), threadgroup=(32, 1, 1), template=[("T", np.float32), ("N", 5)])
    np.testing.assert_array_equal(out, [6000 + 60 + 2 + 5] * 2)


def test_compiled_kernels_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    src = "uint i = thread_position_in_grid.x; y[i] = o1b_store(o1b_exp(o1b_load(x[i]))) ; // cache test"
    x = np.linspace(-5, 5, 7, dtype=np.float32)
    call = dict(inputs=[x], output_shapes=[x.shape], output_dtypes=[np.float32], grid=(7, 1, 1),
                threadgroup=(4, 1, 1))
    c0 = emu.stats["compiles"]
    (y1,) = emu.EmuKernel("cached", ["x"], ["y"], src, runtime.header())(**call)
    assert emu.stats["compiles"] == c0 + 1
    assert list(tmp_path.glob("mlx-open1b/emu/*.so"))
    (y2,) = emu.EmuKernel("cached", ["x"], ["y"], src, runtime.header())(**call)   # second construction
    assert emu.stats["compiles"] == c0 + 1
    emu.clear_memory_cache()                                                      # as a new process
    d0 = emu.stats["disk_hits"]
    (y3,) = emu.EmuKernel("cached", ["x"], ["y"], src, runtime.header())(**call)
    assert emu.stats["compiles"] == c0 + 1 and emu.stats["disk_hits"] == d0 + 1
    assert_bits_equal(y1, y2)
    assert_bits_equal(y1, y3)
    assert_bits_equal(y1, C.exp(x))
    # the runtime reuses one MetalKernel per (name, names, source)
    assert runtime.kernel("map", ["x"], ["y"]) is runtime.kernel("map", ["x"], ["y"])


def test_a_fresh_process_reuses_the_disk_cache():
    code = ("import numpy as np; from mlx_open1b.metal import ops, emu; "
            "ops.exp(np.ones(3, np.float32)); print(emu.stats['compiles'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    M.exp(np.ones(3, np.float32))                       # built (and cached) in this process already
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
