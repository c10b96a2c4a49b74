"""The CUDA backend's binding (cuda/ops.py, cuda/runtime.py): every source compiles with nvcc as
NVRTC gets it, without fp32 FMA; device arrays in and out (cupy arrays on a GPU; elsewhere the
cupy stand-in of tests/fake_cupy.py on the emulator); what the backend adds beyond the interface.

The op results on every backend are tests/ops/test_backend_ops.py's and test_backend_quant.py's;
the emulator's own tests are tests/emulators/test_cuda_emu.py's.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from fake_cupy import FakeCupyArray, fake_gpu  # noqa: F401 (fake_gpu: a fixture)
from helpers import assert_bits_equal, rand_bf16, rand_f32

import mlx_open1b.cpu_ref as ref
from mlx_open1b import arrays
from mlx_open1b.cuda import emu, ops as cu, runtime

OK, HOW = cu.available()
pytestmark = pytest.mark.skipif(not OK, reason=HOW)
HAVE_GXX = emu.compiler_available()[0]
needs_emulator = pytest.mark.skipif(not HAVE_GXX, reason="the CUDA emulator needs g++")
CU_FILES = sorted(p.name for p in runtime.SOURCE_DIR.glob("*.cu"))


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng([ord(c) for c in name])


def test_gemm_i8_has_vnni_is_cpu_only():
    assert cu.gemm_i8_has_vnni() is False


# ================================================================== device arrays: cupy in, cupy out
def _device_cases(rng):
    """(name, call(ops, to_dev)) for a spread of ops; to_dev maps a numpy input to the kind under test."""
    N, K, M, V, C = 9, 37, 21, 1500, 11
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K)), rand_bf16(rng, (N, M))
    tokens = rng.integers(0, 17, 29).astype(np.int32)
    wte, dout_e = rand_bf16(rng, (19, C)), rand_f32(rng, (29, C))
    xf, g = rand_f32(rng, (N, K), 3.0), rand_bf16(rng, (K,))
    rstd = ref.rmsnorm_forward(xf, g, 1e-5)[1]
    cos_t, sin_t = ref.rope_tables(13, 6, 10000.0)
    xr = rand_f32(rng, (2, 13, 3, 6))
    hs = rand_f32(rng, (N, 2 * 10), 4.0)
    B, T, H, G, D, W = 1, 70, 2, 1, 5, 33
    q, k, v = rand_bf16(rng, (B, T, H, D)), rand_bf16(rng, (B, T, G, D)), rand_bf16(rng, (B, T, G, D))
    o, lse_a = ref.attention_forward(q, k, v, W, 0.5)
    dout_a = rand_f32(rng, (B, T, H, D))
    h, wv = rand_bf16(rng, (N, C)), rand_bf16(rng, (V, C))
    targets = rng.integers(0, V, N).astype(np.int32)
    lse_x, dloss = ref.xent_forward(h, wv, targets, 1e-4)[1], rand_f32(rng, (N,), 0.1)
    a8, b8 = rng.integers(-127, 128, (N, K)).astype(np.int8), rng.integers(-127, 128, (M, K)).astype(np.int8)
    fh = rand_f32(rng, (128, 5))
    big = rand_f32(rng, (5000,))
    tensors = [big, rand_f32(rng, (7, 9)), rand_f32(rng, (4096,))]
    fa, fb = rand_f32(rng, (1001,)), rand_f32(rng, (1001,))
    p, m, vv = rand_bf16(rng, (1001,)), rand_f32(rng, (1001,), 1e-2), np.abs(rand_f32(rng, (1001,), 1e-3))
    return [
        ("exp", lambda o_, d: o_.exp(d(fa))),
        ("f32_to_bf16", lambda o_, d: o_.f32_to_bf16(d(xf))),
        ("bf16_to_f32", lambda o_, d: o_.bf16_to_f32(d(x))),
        ("linear_forward", lambda o_, d: o_.linear_forward(d(x), d(w))),
        ("linear_backward", lambda o_, d: o_.linear_backward(d(dy), d(x), d(w))),
        ("linear_backward dw only", lambda o_, d: o_.linear_backward(d(dy), d(x), d(w), need_dx=False)),
        ("embedding_forward", lambda o_, d: o_.embedding_forward(d(tokens), d(wte))),
        ("embedding_backward", lambda o_, d: o_.embedding_backward(d(tokens), d(dout_e), 19)),
        ("rmsnorm_forward", lambda o_, d: o_.rmsnorm_forward(d(xf), d(g), 1e-5)),
        ("rmsnorm_backward", lambda o_, d: o_.rmsnorm_backward(d(xf), d(xf), d(g), d(rstd))),
        ("rmsnorm_backward no gain", lambda o_, d: o_.rmsnorm_backward(d(xf), d(xf), None, d(rstd))),
        ("rope_forward", lambda o_, d: o_.rope_forward(d(xr), d(cos_t), d(sin_t))),
        ("swiglu_backward", lambda o_, d: o_.swiglu_backward(d(hs[:, :10].copy()), d(hs))),
        ("attention_forward", lambda o_, d: o_.attention_forward(d(q), d(k), d(v), W, 0.5)),
        ("attention_forward_i8", lambda o_, d: o_.attention_forward_i8(d(q), d(k), d(v), W, 0.5)),
        ("attention_backward", lambda o_, d: o_.attention_backward(d(dout_a), d(q), d(k), d(v), d(o), d(lse_a), W, 0.5)),
        ("xent_forward", lambda o_, d: o_.xent_forward(d(h), d(wv), d(targets), 1e-4)),
        ("xent_backward", lambda o_, d: o_.xent_backward(d(h), d(wv), d(targets), 1e-4, d(lse_x), d(dloss))),
        ("quant_weight_rows", lambda o_, d: o_.quant_weight_rows(d(w))),
        ("quant_tensor", lambda o_, d: o_.quant_tensor(d(xf))),
        ("gemm_i8", lambda o_, d: o_.gemm_i8(d(a8), d(b8))),
        ("hadamard_rows", lambda o_, d: o_.hadamard_rows(d(fh))),
        ("qlinear_forward", lambda o_, d: o_.qlinear_forward(d(x), d(w))),
        ("qlinear_backward", lambda o_, d: o_.qlinear_backward(d(dy), d(x), d(w))),
        ("qlinear_backward int4", lambda o_, d: o_.qlinear_backward(d(dy), d(x), d(w), qmax=7)),
        ("sumsq_blocks", lambda o_, d: o_.sumsq_blocks(d(big))),
        ("treefold", lambda o_, d: o_.treefold(d(fa[:100]))),
        ("global_norm", lambda o_, d: o_.global_norm([d(t) for t in tensors])),
        ("add", lambda o_, d: o_.add(d(fa), d(fb))),
        ("scale", lambda o_, d: o_.scale(d(fa), 1.0 / 3)),
        ("adamw", lambda o_, d: o_.adamw(d(p), d(fa), d(m), d(vv), lr=3e-4, weight_decay=0.1, step=3)),
    ]


def _leaves(result):
    return [u for r in result for u in _leaves(r)] if isinstance(result, tuple) else [result]


def _same_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if b.dtype.itemsize in (2, 4):
        assert_bits_equal(a, b, what)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), what


def _check_device_case(name, call, to_dev, device_kind):
    """call on device inputs: every array result of device_kind and bit-equal to cpu_ref's on numpy
    inputs, float results floats; the inputs unchanged (the functional ops copy)."""
    inputs = []

    def d(a):
        inputs.append((a.copy(), to_dev(a)))
        return inputs[-1][1]
    got, want = _leaves(call(cu, d)), _leaves(call(ref, lambda a: a))
    assert len(got) == len(want), name
    for i, (a, b) in enumerate(zip(got, want)):
        what = f"{name} result {i}"
        if b is None:
            assert a is None, what
        elif isinstance(b, float):
            assert type(a) is float and np.float32(a).view(np.uint32) == np.float32(b).view(np.uint32), what
        elif isinstance(b, np.generic):      # quant_tensor's scale: a 0-d array of the kind given
            if device_kind == arrays.NUMPY:
                assert type(a) is type(b), what
            else:
                assert arrays.kind(a) == device_kind and a.shape == (), what
                a = arrays.to_host(a)
            _same_bits(np.asarray(a), np.asarray(b), what)
        else:
            assert arrays.kind(a) == device_kind, f"{what}: {type(a).__name__}"
            assert arrays.dtype(a) == b.dtype, what
            _same_bits(arrays.to_host(a), b, what)
    for before, dev in inputs:
        _same_bits(arrays.to_host(dev), before, f"{name}: an input changed")


@needs_emulator
def test_device_arrays_in_device_arrays_out(fake_gpu):
    """Device mode without a GPU: every op given (fake) cupy arrays returns cupy arrays, copies
    nothing to the host on the way (FakeCupyArray refuses it) and gives cpu_ref's bits."""
    for name, call in _device_cases(rng_for("device")):
        _check_device_case(name, call, fake_gpu.asarray, arrays.CUPY)


@needs_emulator
def test_numpy_in_numpy_out_through_device_copies(fake_gpu):
    """The same ops given numpy arrays on a (fake) GPU: inputs copied to the device, numpy out."""
    for name, call in _device_cases(rng_for("device")):
        _check_device_case(name, call, lambda a: a, arrays.NUMPY)


@needs_emulator
def test_mixed_kinds_give_device_arrays(fake_gpu):
    """An op given numpy and cupy arguments together works on the device (its numpy arguments are
    moved up) and returns cupy arrays: nested calls (global_norm's partials) and the functional
    ops (add with a numpy left operand) included."""
    rng = rng_for("device mixed")
    a, b = rand_f32(rng, (5000,)), rand_f32(rng, (33, 7))
    assert cu.global_norm([fake_gpu.asarray(a), b]) == ref.global_norm([a, b])
    c = rand_f32(rng, (5000,))
    got = cu.add(a, fake_gpu.asarray(c))
    assert type(got) is FakeCupyArray
    assert_bits_equal(arrays.to_host(got), ref.add(a, c), "add(numpy, cupy)")
    x, w = rand_bf16(rng, (9, 64)), rand_bf16(rng, (17, 64))
    y = cu.qlinear_forward(fake_gpu.asarray(x), w)
    assert type(y) is FakeCupyArray
    assert_bits_equal(arrays.to_host(y), ref.qlinear_forward(x, w), "qlinear_forward(cupy, numpy)")


@needs_emulator
def test_inplace_ops_on_device_arrays(fake_gpu):
    """add_inplace, scale_inplace and adamw_step write device arrays in place (no copy back), and
    numpy arrays through a device copy; mixed kinds work."""
    rng = rng_for("device inplace")
    a, b = rand_f32(rng, (777,)), rand_f32(rng, (777,))
    want = a.copy()
    ref.add_inplace(want, b)
    ref.scale_inplace(want, 0.3)
    for da, db in ((fake_gpu.asarray(a), fake_gpu.asarray(b)), (a.copy(), b), (a.copy(), fake_gpu.asarray(b))):
        cu.add_inplace(da, db)
        cu.scale_inplace(da, 0.3)
        assert_bits_equal(arrays.to_host(da), want, f"{type(da).__name__} += {type(db).__name__}")
    p, g = rand_bf16(rng, (301,)), rand_f32(rng, (301,), 1e-2)
    m, v = rand_f32(rng, (301,), 1e-2), np.abs(rand_f32(rng, (301,), 1e-3))
    pw, mw, vw = p.copy(), m.copy(), v.copy()
    ref.adamw_step(pw, g, mw, vw, lr=1e-3, weight_decay=0.1, step=2)
    dp, dm, dv = (fake_gpu.asarray(t) for t in (p, m, v))
    cu.adamw_step(dp, fake_gpu.asarray(g), dm, dv, lr=1e-3, weight_decay=0.1, step=2)
    for got, w_, what in ((dp, pw, "p"), (dm, mw, "m"), (dv, vw, "v")):
        assert type(got) is FakeCupyArray
        assert_bits_equal(arrays.to_host(got), w_, what)


@pytest.mark.skipif(not runtime.real_cuda(), reason="needs CuPy and a CUDA device")
def test_cupy_arrays_in_cupy_arrays_out():
    """On a GPU: the ops on real cupy arrays return cupy arrays with cpu_ref's bits."""
    import cupy
    for name, call in _device_cases(rng_for("device")):
        _check_device_case(name, call, cupy.asarray, arrays.CUPY)


# ================================================================== compile checks (nvcc)
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_compiles_every_source(arch, tmp_path):
    """Each module text, exactly as handed to NVRTC, compiles to PTX with CuPy's flush mode and our
    options, the PTX holds no fused multiply-add on fp32, and every kernel of the text is an entry."""
    procs = []
    for name in CU_FILES:
        src = tmp_path / name
        src.write_text(runtime.read_source(name))
        procs.append((name, subprocess.Popen(
            [NVCC, "--ptx", f"-arch={arch}", "-ftz=true", *runtime.OPTIONS, str(src), "-o",
             str(tmp_path / f"{name}.ptx")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for name, proc in procs:
        out, _ = proc.communicate()
        assert proc.returncode == 0, f"{name} ({arch}):\n{out}"
        ptx = (tmp_path / f"{name}.ptx").read_text()
        if name in ("linear.cu", "attention.cu"):   # the guarded fast paths' FMA, inline PTX (o1b_fma_ftz)
            ptx, n = re.subn(r"// begin inline asm\s*fma\.rn\.ftz\.f32[^\n]*\n\s*// end inline asm", "", ptx)
            assert n >= (64 if name == "linear.cu" else 4), f"{name}: {n} FMA steps in the PTX"
        assert "fma.rn.f32" not in ptx and "fma.rn.ftz.f32" not in ptx, f"{name}: FMA in the PTX"
        for kernel in emu.kernel_names(runtime.read_source(name)):
            assert f".entry {kernel}(" in ptx, f"{name} ({arch}): no entry {kernel}"
