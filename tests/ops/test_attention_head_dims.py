"""The tiled attention kernels at large head dims: their static on-chip tiles fit the devices'
limits (48 KiB of static shared memory a CUDA block, 32 KiB of threadgroup memory a Metal
threadgroup) for every head dim the presets and the tests use up to 256, and the forward kernels,
whose key tiles shrink with D (cuda/attention.cu ATTN_FWD_TILE, ATTN_I8_TILE; metal
attention_forward*.metal AT_FT), still give cpu_ref's bits there. The emulators have no such
limit, so the compile and arithmetic checks here are what sees a tile that grows past it."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest

from helpers import assert_bits_equal, attention_i8_inputs, rand_bf16

import mlx_open1b.cpu_ref as ref

HEAD_DIMS = [8, 64, 128, 150, 192, 256]
NVCC = shutil.which("nvcc")
CXX = shutil.which("g++")
METAL_LIMIT = 32768
METAL_KERNELS = ["attention_forward", "attention_forward_i8", "attention_dq", "attention_dkv"]


def _nvcc(tmp_path, head_dims):
    """{D: (returncode, output)} of attention.cu built for each head dim to an sm_90 cubin; ptxas
    refuses a kernel whose static shared memory passes 48 KiB ("uses too much shared data"). -G
    (no device optimization) keeps it fast (~2 s a head dim) and allocates the same static
    __shared__ arrays. Two builds at a time."""
    from mlx_open1b.cuda import runtime
    text = runtime.read_source("attention.cu")
    procs, done = [], {}
    for D in head_dims:
        src = tmp_path / f"attention_{D}.cu"
        src.write_text(f"#define ATTN_D {D}\n" + text)
        procs.append((D, subprocess.Popen(
            [NVCC, "--cubin", "-G", "-arch=sm_90", "-ftz=true", *runtime.OPTIONS, str(src), "-o",
             str(tmp_path / f"attention_{D}.cubin")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        while len(procs) >= 2 or (procs and D == head_dims[-1]):
            D0, p = procs.pop(0)
            done[D0] = (p.returncode if p.wait() is not None else None, p.communicate()[0])
    return done


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
def test_nvcc_attention_fits_shared_memory(tmp_path):
    """attention.cu compiles for sm_90 at each head dim."""
    for D, (rc, out) in _nvcc(tmp_path, HEAD_DIMS).items():
        assert rc == 0, f"attention.cu at D = {D}:\n{out}"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
def test_cuda_head_dim_limit_is_the_source_s(tmp_path):
    """cuda/ops.py ATTN_MAX_HEAD_DIM is attention.cu's: it compiles there and not one above, for
    want of shared memory; the backend refuses the one above before any launch, naming head_dim."""
    from mlx_open1b.cuda import ops
    top = ops.ATTN_MAX_HEAD_DIM
    got = _nvcc(tmp_path, [top, top + 1])
    assert got[top][0] == 0, got[top][1]
    assert got[top + 1][0] != 0 and "too much shared data" in got[top + 1][1], got[top + 1][1]
    _refused(ops, top + 1)


def _refused(ops, D):
    q = np.zeros((1, 1, 1, D), np.uint16)
    with pytest.raises(ValueError, match=rf"head_dim {D} .*limit of {D - 1}"):
        ops.attention_forward(q, q, q, 0, 1.0)
    with pytest.raises(ValueError, match=rf"head_dim {D} .*limit of {D - 1}"):
        ops.attention_forward_i8(q, q, q, 0, 1.0)
    f = np.zeros((1, 1, 1, D), np.float32)
    with pytest.raises(ValueError, match=rf"head_dim {D} .*limit of {D - 1}"):
        ops.attention_backward(f, q, q, q, f, np.zeros((1, 1, 1), np.float32), 0, 1.0)


def metal_threadgroup_program(head_dims) -> tuple[list, list]:
    """A C++ program printing, for each (kernel, D) of the returned list, the bytes of the kernel's
    `threadgroup` arrays, computed by g++ from the kernel
    text's own #define, constexpr and threadgroup lines (the contract header's constants defined
    as in metal/contract.metal), each kernel and head dim in a namespace of its own."""
    from mlx_open1b.metal import ops
    root = pathlib.Path(ops.__file__).resolve().parent
    contract = (root / "contract.metal").read_text()
    consts = [ln for ln in contract.splitlines() if re.match(r"#define O1B_ATTN_BK\b", ln)]
    assert consts, "metal/contract.metal defines O1B_ATTN_BK"
    prog = ["#include <cstdio>", "typedef unsigned short ushort; typedef unsigned int uint;", *consts]
    names = []
    for kernel in METAL_KERNELS:
        lines = (root / f"{kernel}.metal").read_text().splitlines()
        keep, arrays, macros, i = [], [], [], 0
        while i < len(lines):
            ln = lines[i].split("//")[0].rstrip()
            if ln.startswith("#define"):
                macros.append(ln.split()[1].split("(")[0])
                keep.append(ln)
            elif ln.startswith("constexpr"):
                while not ln.endswith(";"):        # a constexpr over several lines
                    i += 1
                    ln += " " + lines[i].split("//")[0].strip()
                keep.append(ln)
            elif ln.startswith("threadgroup "):
                m = re.match(r"threadgroup\s+(\w+)\s+(\w+)\s*\[(.*)\]\s*;", ln)
                assert m, f"{kernel}.metal: unexpected threadgroup line {ln!r}"
                arrays.append(m.group(2))
                keep.append(f"{m.group(1)} {m.group(2)}[{m.group(3)}];")
            i += 1
        assert arrays, f"{kernel}.metal declares threadgroup arrays"
        defines = [k for k in keep if k.startswith("#define")]
        body = [k for k in keep if not k.startswith("#define")]
        prog += defines
        for D in head_dims:
            ns = f"{kernel}_{D}"
            prog += [f"namespace {ns} {{ constexpr int D = {D};", *body,
                     f"constexpr unsigned long bytes = {' + '.join(f'sizeof({a})' for a in arrays)}; }}"]
            names.append((kernel, D, ns))
        prog += [f"#undef {m}" for m in macros]
    prog += ["int main() {"] + [f'    std::printf("%lu\\n", {ns}::bytes);' for _, _, ns in names] + ["}"]
    return prog, names


def _metal_bytes(tmp_path, head_dims) -> dict:
    prog, names = metal_threadgroup_program(head_dims)
    src, exe = tmp_path / "tg.cpp", tmp_path / "tg"
    src.write_text("\n".join(prog) + "\n")
    out = subprocess.run([CXX, "-std=c++17", "-w", str(src), "-o", str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    sizes = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert len(sizes) == len(names) and min(sizes) > 0
    return {(k, D): n for (k, D, _), n in zip(names, sizes)}


@pytest.mark.skipif(CXX is None, reason="g++ not found on PATH")
def test_metal_threadgroup_memory_fits(tmp_path):
    """Every tiled Metal attention kernel's threadgroup arrays, at each head dim, fit 32 KiB."""
    over = {kd: n for kd, n in _metal_bytes(tmp_path, HEAD_DIMS).items() if n > METAL_LIMIT}
    assert not over, f"threadgroup bytes over {METAL_LIMIT}: {over}"


@pytest.mark.skipif(CXX is None, reason="g++ not found on PATH")
def test_metal_head_dim_limit_is_the_source_s(tmp_path):
    """metal/ops.py ATTN_MAX_HEAD_DIM is the kernels': all fit 32 KiB there, not all one above;
    the backend refuses the one above before any launch, naming head_dim."""
    from mlx_open1b.metal import ops
    top = ops.ATTN_MAX_HEAD_DIM
    got = _metal_bytes(tmp_path, [top, top + 1])
    assert max(n for (k, D), n in got.items() if D == top) <= METAL_LIMIT, got
    assert max(n for (k, D), n in got.items() if D == top + 1) > METAL_LIMIT, got
    _refused(ops, top + 1)


def _backend(name):
    from mlx_open1b.cuda import ops as C
    from mlx_open1b.metal import ops as M
    ops = {"cuda": C, "metal": M}[name]
    ok, why = ops.available()
    if not ok:
        pytest.skip(why)
    return ops


@pytest.mark.parametrize("name", ["cuda", "metal"])
@pytest.mark.parametrize("D", [150, 256])
def test_large_head_dim_forward_matches_cpu_ref(name, D, monkeypatch):
    """Forward (bf16 and int8) at head dims whose key tiles are smaller than the 64-key block on
    some backend (CUDA: int8 at 150 and 256; Metal: both at 256, int8 at 150), bit for bit; T = 70
    crosses a block and W = 40 starts a row's keys inside one. On the emulators, under their race
    checks (two thread orders): a missing barrier between sub-tiles changes a result."""
    ops = _backend(name)
    if name == "cuda":
        from mlx_open1b.cuda import emu, runtime
        if not runtime.real_cuda():
            with emu.options(race_check=True):
                return _check_forward(ops, name, D)
    else:
        from mlx_open1b.metal import runtime
        if not runtime.real_metal():
            monkeypatch.setenv("O1B_EMU_RACECHECK", "1")
    _check_forward(ops, name, D)


def _check_forward(ops, name, D):
    B, T, H, G, W = 1, 70, 2, 1, 40
    rng = np.random.default_rng([0x4D, D])
    q, k, v = rand_bf16(rng, (B, T, H, D), 2.0), rand_bf16(rng, (B, T, G, D), 2.0), rand_bf16(rng, (B, T, G, D))
    scale = float(np.float32(1 / np.sqrt(D)))
    for got, want, what in zip(ops.attention_forward(q, k, v, W, scale), ref.attention_forward(q, k, v, W, scale),
                               ("o", "lse")):
        assert_bits_equal(got, want, f"{name} D={D} {what}")
    q, k, v = attention_i8_inputs(rng, B, T, H, G, D, False)
    for got, want, what in zip(ops.attention_forward_i8(q, k, v, W, scale),
                               ref.attention_forward_i8(q, k, v, W, scale), ("o", "lse")):
        assert_bits_equal(got, want, f"{name} D={D} i8 {what}")
