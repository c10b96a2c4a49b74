"""The int8 layer's fused and parallel kernels on the emulators, against the C reference bit for bit:
CUDA's one-launch absmax (block trees of maxes, the last block folds the partials and writes the
scale, then resets its counter), the warp rotations fused with their operand and scale
(o1b_q_rotate_g / _d / _i8, o1b_hadamard_rows: stages 32 and 64 by shuffles), the weight quantizer
in one launch (a warp per row), the GEMMs with the layer's epilogues (o1b_qgemm_y / _dx / _dw), and
Metal's threadgroup absmax and rotations. Shapes cross every
block (Q_CHUNK elements, QR_COLS columns, QB rows, partial warps); each kernel also runs under the
race check (a missing barrier shows up there), and planted faults (a missing barrier, a counter
left set) are caught.

The per-tensor scale is a max (exact in any order) and each butterfly stage pairs disjoint rows,
so how the work is spread over threads cannot change a bit: these tests check that the spreading
is done right."""
from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest

from mlx_open1b import cpu_ref as C
from mlx_open1b.cuda import emu as cuda_emu, ops as G, runtime as cuda_runtime
from mlx_open1b.metal import ops as M
from mlx_open1b.metal.emu import counters
from mlx_open1b.spec.arith import f32_to_bf16

from helpers import assert_bits_equal, rand_bf16

QB = C.quant.QB


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def _same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want) if isinstance(got, tuple) else [(got, want)]):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and np.array_equal(_bits(g), _bits(w)), f"{what} [{i}]"


def _tensor_with(rng, n, pos, value):
    x = rand_bf16(rng, (n,))
    if pos is not None:
        x[pos] = value
    return x


# ------------------------------------------------------------------ the one-launch absmax (CUDA)
@pytest.mark.parametrize("n", [1, 255, 4096, 4097, 3 * 4096 + 17])
def test_cuda_absmax_in_one_launch(n):
    """The largest |x| and a non-finite value in the first, a middle and the last block, and in the
    last thread of a block: the scale and the levels equal the C reference's, from one absmax launch
    and one levels launch."""
    rng = np.random.default_rng(n)
    for pos in sorted({None, 0, n // 2, n - 1, min(n - 1, 4095)}, key=lambda p: -1 if p is None else p):
        for value in (f32_to_bf16(np.float32(1e6)), 0x7F80, 0xFFC0):
            x = _tensor_with(rng, n, pos, value)
            with counters.counting() as log:
                got = G.quant_tensor(x)
            assert [ln.kernel for ln in log.launches] == ["o1b_q_absmax", "o1b_q_tensor_levels"]
            assert log.launches[0].groups == -(-n // G.Q_CHUNK)
            _same(got, C.quant_tensor(x), f"n={n} at {pos}: {value:#x}")


def _absmax_module(mutate=None, tmp: pathlib.Path | None = None):
    if mutate is None:
        return cuda_runtime.load("quant.cu")
    for f in cuda_runtime.SOURCE_DIR.glob("*.cu*"):
        shutil.copy(f, tmp / f.name)
    src = (tmp / "quant.cu").read_text()
    old, new = mutate
    assert src.count(old) == 1, old
    (tmp / "quant.cu").write_text(src.replace(old, new))
    return cuda_runtime.load("quant.cu", tmp)


def _absmax_twice(mod, x, counter):
    """Two launches of o1b_q_absmax sharing one counter, as on a GPU (one per device)."""
    part, out = np.zeros(-(-x.size // G.Q_CHUNK), np.uint32), []
    for v in (x, x[::-1].copy()):
        sc = np.zeros(2, np.float32)
        mod.get_function("o1b_q_absmax")((part.size,), (G.QA_THREADS,),
                                         (np.int64(v.size), v, np.zeros(1, np.float32), np.int32(0), part, counter,
                                          sc, np.int32(127)))
        out.append(sc)
    return out


def test_cuda_absmax_counter_is_reset_for_the_next_launch(tmp_path):
    rng = np.random.default_rng(5)
    x = rand_bf16(rng, (3 * 4096 + 5,))
    x[7000] = f32_to_bf16(np.float32(300.0))
    want = C.quant_tensor(x)[1]
    counter = np.zeros(1, np.uint32)
    for sc in _absmax_twice(_absmax_module(), x, counter):
        assert np.float32(sc[0]).view(np.uint32) == np.float32(want).view(np.uint32)
    assert counter[0] == 0
    # planted: the last block leaves the count set, so the next launch never finds its last block
    bad = _absmax_module(("        *counter = 0u;\n", ""), tmp_path)
    counter = np.zeros(1, np.uint32)
    first, second = _absmax_twice(bad, x, counter)
    assert np.float32(first[0]) == want and counter[0] != 0
    assert np.float32(second[0]).view(np.uint32) != np.float32(want).view(np.uint32)


def test_cuda_counter_is_its_own_array_per_device(monkeypatch):
    """On a GPU the count lives from launch to launch, one per device, and is never one of _dummy's
    shared placeholders (another op passing a uint32 placeholder must not get the kernel's count)."""
    import types
    device = [0]
    xp = types.SimpleNamespace(zeros=np.zeros, asarray=np.array,
                               cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=device[0])))
    monkeypatch.setattr(G, "_xp", lambda: xp)
    monkeypatch.setattr(G, "_counters", {})
    monkeypatch.setattr(G, "_dummies", {})
    monkeypatch.setattr(cuda_runtime, "real_cuda", lambda: True)
    first = G._counter()
    assert G._counter() is first and first.dtype == np.uint32 and first.tolist() == [0]
    assert G._dummy(np.zeros(1, np.uint32)) is not first
    device[0] = 1
    assert G._counter() is not first


def test_cuda_race_check_sees_a_missing_barrier_in_the_tree(tmp_path):
    """Under the race check the quantizers and rotations pass; without the barrier between the tree's
    levels they do not."""
    rng = np.random.default_rng(6)
    x, w, dy = rand_bf16(rng, (70, 40)), rand_bf16(rng, (130, 40), 0.05), rand_bf16(rng, (70, 130), 1e-3)
    with cuda_emu.options(race_check=True):
        _same(G.qlinear_backward(dy, x, w), C.qlinear_backward(dy, x, w), "race-checked backward")
        _same(G.quant_tensor(x), C.quant_tensor(x), "race-checked quant_tensor")
    step = "        if (tid < h) red[tid] = red[tid + h] > red[tid] ? red[tid + h] : red[tid];\n"
    bad = _absmax_module((step + "        __syncthreads();\n", step), tmp_path)
    v = rand_bf16(rng, (5000,))
    with cuda_emu.options(race_check=True), pytest.raises(cuda_emu.EmuRaceError):
        _absmax_twice(bad, v, np.zeros(1, np.uint32))


def test_cuda_race_check_sees_a_last_block_found_by_its_index(tmp_path):
    """The block that folds the partials is the one whose count comes last, whichever it is: the race
    check's reverse pass runs the blocks last to first, so a kernel that takes the highest block for
    the last reads partials not yet written there (the plant), while the count finds block 0."""
    rng = np.random.default_rng(7)
    v = rand_bf16(rng, (3 * 4096 + 5,))
    v[10] = f32_to_bf16(np.float32(500.0))         # the largest |v| in block 0
    with cuda_emu.options(race_check=True):
        first, second = _absmax_twice(_absmax_module(), v, np.zeros(1, np.uint32))
        want = np.float32(C.quant_tensor(v)[1]).view(np.uint32)
        assert first[:1].view(np.uint32)[0] == second[:1].view(np.uint32)[0] == want
    by_index = ("        last = atomicAdd(counter, 1u) == (u32)(nb - 1);\n",
                "        atomicAdd(counter, 1u);\n        last = b == nb - 1;\n")
    with cuda_emu.options(race_check=True), pytest.raises(cuda_emu.EmuRaceError):
        _absmax_twice(_absmax_module(by_index, tmp_path), v, np.zeros(1, np.uint32))


# ------------------------------------------------------------------ the warp rotations (CUDA)
@pytest.mark.parametrize("R,Cc", [(QB, 1), (QB, 70), (2 * QB, 130)])
def test_cuda_hadamard_rows_warp(R, Cc):
    """Columns that fill no warp (1), a partial block of 64 (70) and more than two blocks (130);
    overflow to inf, inf - inf, cancellations and subnormal inputs in the shuffled stages."""
    rng = np.random.default_rng(R + Cc)
    f = rng.standard_normal((R, Cc)).astype(np.float32)
    f[:, 0] = 3.4028235e38                        # the sums overflow; inf - inf = NaN at stage 64
    f[32, -1], f[96, -1] = 1.0, -1.0              # pairs only at stages 32 and 64
    f[5, Cc // 2] = 1e-40
    with cuda_emu.options(race_check=True):
        _same(G.hadamard_rows(f), C.hadamard_rows(f), f"hadamard {R}x{Cc}")


def test_cuda_rotation_grid_bound():
    """Blocks of QB rows run along the grid's y dimension (at most 65535): the last row count that
    fits is accepted, one block more is refused with the bound named (not a failed launch)."""
    assert G._rot_grid(G.GRID_Y_MAX * QB, 1) == (1, G.GRID_Y_MAX)
    assert G._rot_grid(0, 0) == (1, 1)
    with pytest.raises(ValueError, match=str(G.GRID_Y_MAX * QB)):
        G._rot_grid((G.GRID_Y_MAX + 1) * QB, 1)
    # the transposed levels of a rotated operand run its rows along y in tiles of QT_TILE (a lower
    # bound): refused before the launch, naming it
    rows = G.GRID_Y_MAX * G.QT_TILE + 1
    with pytest.raises(ValueError, match=str(G.GRID_Y_MAX * G.QT_TILE)):
        G._q_levels(rows, None, True, None, None, rows=rows)


@pytest.mark.parametrize("N,K,Mo", [(1, 1, 1), (65, 9, 129), (130, 3, 64), (200, 7, 300)])
def test_cuda_fused_layer_kernels(N, K, Mo):
    """The layer through the fused kernels: G and D rotated from dy where they are made (rows padded
    past M and N, columns past a block of 64), the integer rotations, the GEMM epilogues; NaN and inf
    gradients, a clipped and a NaN weight row; launches per op as the fusion gives them."""
    rng = np.random.default_rng(N * 1000 + Mo)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (Mo, K), 0.05), rand_bf16(rng, (N, Mo), 1e-3)
    if Mo > 2:
        w[1, 0] = f32_to_bf16(np.float32(9.0))
        w[2, 0] = 0x7FC1
    with counters.counting() as log:
        y = G.qlinear_forward(x, w)
    _same(y, C.qlinear_forward(x, w), "y")
    assert [ln.kernel for ln in log.launches] == ["o1b_q_absmax", "o1b_q_tensor_levels", "o1b_q_weight",
                                                 "o1b_qgemm_y"]
    with counters.counting() as log:
        got = G.qlinear_backward(dy, x, w)
    _same(got, C.qlinear_backward(dy, x, w), "dx, dw")
    names = [ln.kernel for ln in log.launches]
    assert len(names) == 13 and "o1b_gemm_i8" not in names, names
    for bad in (0x7F80, 0x7FC1):
        d2 = dy.copy()
        d2[N // 2, Mo - 1] = bad
        _same(G.qlinear_backward(d2, x, w), C.qlinear_backward(d2, x, w), f"dy {bad:#x}")


# ------------------------------------------------------------------ Metal's threadgroup absmax
@pytest.mark.parametrize("n", [1, 257, 4096 + 1, 3 * 4096 + 300])
def test_metal_absmax_threadgroup_tree(n, monkeypatch):
    monkeypatch.setenv("O1B_EMU_RACECHECK", "1")
    rng = np.random.default_rng(n + 1)
    v = (rng.standard_normal(n) * 3).astype(np.float32)
    for pos, value in ((None, 0), (n - 1, -1e5), (n // 3, np.inf), (0, np.nan), (n - 1, 1e-40)):
        x = v.copy()
        if pos is not None:
            x[pos] = value
        _same(M.quant_tensor(x), C.quant_tensor(x), f"metal n={n} at {pos}: {value}")


# ------------------------------------------------------------------ Metal's threadgroup rotations
@pytest.mark.parametrize("R,Cc", [(QB, 1), (2 * QB, 17), (QB, 40)])
def test_metal_hadamard_threadgroup(R, Cc, monkeypatch):
    """The rotation in threadgroup memory (16 columns of a block per threadgroup, a barrier between
    stages) under the race check: columns that fill no group (1), one past a group (17), 2.5 groups;
    overflow, inf - inf, a subnormal input; and the integer rotation of the padded int8 operand."""
    monkeypatch.setenv("O1B_EMU_RACECHECK", "1")
    rng = np.random.default_rng(R * 7 + Cc)
    f = rng.standard_normal((R, Cc)).astype(np.float32)
    f[:, 0] = 3.4028235e38
    f[32, -1], f[96, -1] = 1.0, -1.0
    f[5, Cc // 2] = 1e-40
    _same(M.hadamard_rows(f), C.hadamard_rows(f), f"metal hadamard {R}x{Cc}")
    q = rng.integers(-127, 128, (R - 3, Cc)).astype(np.int8)
    q[:, 0] = 127
    pad = np.zeros((R, Cc), np.float32)
    pad[:R - 3] = q
    _same(M._rotate("hadamard_i8", q, R - 3, Cc), C.hadamard_rows(pad), f"metal hadamard_i8 {R - 3}x{Cc}")


@pytest.mark.parametrize("kernel", ["hadamard", "quant_absmax"])
def test_metal_race_check_sees_a_missing_stage_barrier(kernel, monkeypatch):
    """Without the barrier between the stages of the threadgroup rotation (the butterflies) or of the
    absmax's tree of maxes the kernel is a race, and the race check says so (the plant: the barrier
    at the end of the stage loop removed)."""
    from mlx_open1b.metal import emu as metal_emu, runtime as metal_runtime
    monkeypatch.setenv("O1B_EMU_RACECHECK", "1")
    source, stage_end = metal_runtime.source, "    threadgroup_barrier(mem_flags::mem_threadgroup);\n}\n"

    def planted(name):
        text = source(name)
        if name != kernel:
            return text
        assert text.count(stage_end) == 1
        return text.replace(stage_end, "}\n")
    rng = np.random.default_rng(8)
    f = rng.standard_normal((QB, 17)).astype(np.float32)
    x = rng.standard_normal(3 * 4096 + 300).astype(np.float32)
    monkeypatch.setattr(metal_runtime, "source", planted)
    with pytest.raises(metal_emu.EmuRaceError, match=kernel):
        M.hadamard_rows(f) if kernel == "hadamard" else M.quant_tensor(x)
