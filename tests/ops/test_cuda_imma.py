"""The CUDA int8 GEMM on tensor cores (cuda/quant.cu's o1b_gemm_i8 on cuda/imma.cuh's
o1b_mma_s8_16x8x32) against the C reference and numpy's exact integer product, bit for bit.

- The instruction itself: one warp's mma on operands placed in its fragment registers by the PTX
  ISA's layout for mma.m16n8k32 .s8, written out here in numpy independently of imma.cuh. On a GPU
  (sm_80+) this runs the real instruction, so it also checks that reading of the layout; in the
  emulator it checks the model, and that a lane missing from the collective step is an error.
- The GEMM on shapes that cross every tile boundary (128-row output tiles in both dimensions, the
  64-byte contraction step, the 16-byte vector path and the byte path), strided and transposed
  operands, the ±127 / −128 extremes (at the length bound: slow), under the emulator's race check.
- The whole int8 layer (forward, dx, dW) at tile-crossing shapes, equal to cpu_ref, with race check.
- The transposed quantizer equals the plain one transposed (data movement only), with race check.
- The fallback below sm_80 (warp shuffles) equals the instruction, in the emulator.
- nvcc emits the instruction for sm_90 and the fallback for sm_75.
- Planted faults (wrong fragment lane mapping in the model, the fallback and the kernel, missing
  accumulate, a wrong epilogue row, a dropped last step) are each caught by the checks above (slow:
  one emulator build per fault).
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from helpers import rand_bf16

import mlx_open1b.cpu_ref as ref
from mlx_open1b.cuda import emu, ops as cu, runtime

OK, HOW = cu.available()
pytestmark = pytest.mark.skipif(not OK, reason=HOW)
HAVE_GXX = emu.compiler_available()[0]
Q_MAX_P = cu.Q_MAX_P
TILE = cu.GI_TILE


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng([ord(c) for c in name])


def rand_i8(rng, shape, lo=-127):
    return rng.integers(lo, 128, shape, dtype=np.int64).astype(np.int8)


def exact(a, b):
    """sum_p a[i, p] b[j, p] in int64, wrapped to int32 as the instruction does."""
    return (a.astype(np.int64) @ b.astype(np.int64).T).astype(np.uint32).view(np.int32)


# ================================================================== the instruction (one warp)
MMA_TEST_SOURCE = r'''
#include "contract.cuh"
#include "imma.cuh"
/* lane l: a[4l ... 4l + 3], b[2l, 2l + 1] (even rounds) or a2, b2 (odd rounds), d[4l ... 4l + 3]
 * in place; `rounds` calls in a row; lanes >= `lanes` return before the instruction (a divergent
 * warp). Different operands in consecutive calls catch a model whose next call overwrites the
 * operands another lane is still reading. */
extern "C" __global__ void o1b_test_mma(const u32 *a, const u32 *b, const u32 *a2, const u32 *b2, int *d,
                                        int rounds, int lanes) {
    int l = (int)threadIdx.x;
    if (l >= lanes) return;
    u32 ra[2][4] = {{a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]},
                    {a2[4 * l], a2[4 * l + 1], a2[4 * l + 2], a2[4 * l + 3]}};
    u32 rb[2][2] = {{b[2 * l], b[2 * l + 1]}, {b2[2 * l], b2[2 * l + 1]}};
    int rd[4] = {d[4 * l], d[4 * l + 1], d[4 * l + 2], d[4 * l + 3]};
    for (int r = 0; r < rounds; r++) o1b_mma_s8_16x8x32(rd, ra[r & 1], rb[r & 1]);
    for (int i = 0; i < 4; i++) d[4 * l + i] = rd[i];
}
'''


def mma_module(source: str = MMA_TEST_SOURCE):
    return runtime.CudaModule(runtime.read_source_text(source, "test_mma.cu"), name="test_mma.cu")


def fragments(A, B, C):
    """Per-lane registers from the PTX ISA's layout for mma.m16n8k32 with .s8 operands:
    groupID = lane >> 2, threadID_in_group = lane % 4, element i of a fragment in byte i % 4 of
    register i // 4."""
    a = np.zeros((32, 16), np.int8)
    b = np.zeros((32, 8), np.int8)
    c = np.zeros((32, 4), np.int32)
    for lane in range(32):
        gid, tig = lane >> 2, lane % 4
        for i in range(16):
            row = gid if (i < 4 or 8 <= i < 12) else gid + 8
            col = tig * 4 + (i & 3) + (16 if i >= 8 else 0)
            a[lane, i] = A[row, col]
        for i in range(8):
            row = tig * 4 + (i & 3) + (16 if i >= 4 else 0)
            b[lane, i] = B[row, gid]
        for i in range(4):
            row = gid if i < 2 else gid + 8
            c[lane, i] = C[row, tig * 2 + (i & 1)]
    return a.view(np.uint32).reshape(-1), b.view(np.uint32).reshape(-1), c.reshape(-1)


def run_mma(mod, A, B, C, rounds=1, lanes=32, A2=None, B2=None):
    """D after `rounds` calls: A, B in even rounds, A2, B2 (default A, B) in odd ones."""
    a, b, c = fragments(A, B, C)
    a2, b2, _ = fragments(A if A2 is None else A2, B if B2 is None else B2, C)
    xp = cu._xp()
    da, db, da2, db2, dd = (xp.asarray(v) for v in (a, b, a2, b2, c))
    mod.get_function("o1b_test_mma")((1,), (32,), (da, db, da2, db2, dd, np.int32(rounds), np.int32(lanes)))
    return cu.to_host(dd)


def check_mma(mod):
    """D = A B + C (twice in a row: the accumulator is read) for random and extreme operands."""
    rng = rng_for("mma")
    cases = [(rand_i8(rng, (16, 32), -128), rand_i8(rng, (32, 8), -128),
              rng.integers(-2**20, 2**20, (16, 8)).astype(np.int32))]
    A, B = np.full((16, 32), -128, np.int8), np.full((32, 8), -128, np.int8)
    A[3, ::2] = 127
    B[:, 5] = 127
    cases.append((A, B, np.full((16, 8), -7, np.int32)))
    for A, B, C in cases:
        want = C.astype(np.int64)
        for rounds in (1, 2):
            want = want + A.astype(np.int64) @ B.astype(np.int64)
            got = run_mma(mod, A, B, C, rounds)
            _, _, w = fragments(A, B, want.astype(np.uint32).view(np.int32))
            assert np.array_equal(got, w), f"mma, {rounds} round(s): lanes {np.argwhere(got != w)[:4].tolist()}"
    (A, B, C), (A2, B2, _) = cases          # different operands in consecutive calls
    want = C.astype(np.int64)
    for r in range(4):
        want = want + (A2 if r & 1 else A).astype(np.int64) @ (B2 if r & 1 else B).astype(np.int64)
    got = run_mma(mod, A, B, C, 4, A2=A2, B2=B2)
    _, _, w = fragments(A, B, want.astype(np.uint32).view(np.int32))
    assert np.array_equal(got, w), f"mma, 4 alternating rounds: lanes {np.argwhere(got != w)[:4].tolist()}"


def test_mma_matches_the_documented_layout():
    check_mma(mma_module())


@pytest.mark.skipif(not HAVE_GXX, reason="g++ not found")
def test_mma_emulated_needs_every_lane():
    with runtime.emulate():
        mod = mma_module()
        A, B, C = np.ones((16, 32), np.int8), np.ones((32, 8), np.int8), np.zeros((16, 8), np.int32)
        assert run_mma(mod, A, B, C).tolist() == [32] * 128
        with pytest.raises(emu.EmuLaunchError, match="warp divergence"):
            run_mma(mod, A, B, C, lanes=31)
        a, b, c = fragments(A, B, C)
        with pytest.raises(emu.EmuLaunchError, match="warp divergence"):    # a partial warp
            mod.get_function("o1b_test_mma")((1,), (48,), (np.tile(a, 2), np.tile(b, 2), np.tile(a, 2),
                                                           np.tile(b, 2), np.tile(c, 2), np.int32(1), np.int32(48)))


@pytest.mark.skipif(not HAVE_GXX, reason="g++ not found")
def test_mma_shuffle_fallback_emulated():
    """The fallback for GPUs below sm_80 (warp shuffles), run by the emulator: the same results."""
    with runtime.emulate():
        check_mma(mma_module("#define O1B_IMMA_SHUFFLE\n" + MMA_TEST_SOURCE))


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_GXX, reason="g++ not found")
def test_gemm_on_the_shuffle_fallback_emulated(monkeypatch):
    with runtime.emulate():
        mod = runtime.CudaModule("#define O1B_IMMA_SHUFFLE\n" + runtime.read_source("quant.cu"), name="quant.cu")
        monkeypatch.setattr(runtime, "load", lambda filename, *args, **kwargs: mod)
        check_gemm([(129, 3, 80), (3, 130, 33)], layouts=False)


# ================================================================== the GEMM
# (I, J, P): 1x1x1; remainders in every dimension around the 128 x 128 output tile and the 64-byte
# step; P multiples of 16 (16-byte loads) and not (byte loads); several tiles in I and J.
GEMM_SHAPES = [(1, 1, 1), (3, 5, 48), (127, 129, 64), (128, 128, 65), (129, 127, 17), (257, 3, 129),
               (2, 258, 80)]


def gemm_i8(I, J, P, a, sa_i, sa_p, b, sb_j, sb_p):
    return cu.to_host(cu._gemm_i8(I, J, P, cu._dev(a), sa_i, sa_p, cu._dev(b), sb_j, sb_p))


def check_gemm(shapes=GEMM_SHAPES, layouts=True):
    for I, J, P in shapes:
        rng = rng_for(f"gemm{I},{J},{P}")
        a, b = rand_i8(rng, (I, P)), rand_i8(rng, (J, P))
        want = ref.gemm_i8(a, b)
        assert np.array_equal(want, exact(a, b))
        got = cu.gemm_i8(a, b)
        assert got.dtype == np.int32 and np.array_equal(got, want), (I, J, P)
        if not layouts:
            continue
        # the backward's layouts: contraction along rows (strided) and transposed copies (contiguous)
        at, bt = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
        assert np.array_equal(gemm_i8(I, J, P, at, 1, I, bt, 1, J), want), (I, J, P, "strided")
        assert np.array_equal(gemm_i8(I, J, P, a, P, 1, bt, 1, J), want), (I, J, P, "mixed")


def test_gemm_crosses_every_tile_boundary():
    check_gemm()


@pytest.mark.skipif(not HAVE_GXX, reason="g++ not found")
def test_gemm_race_check():
    with runtime.emulate(), emu.options(race_check=True):
        check_gemm(GEMM_SHAPES[:5], layouts=False)


def check_extremes(P=Q_MAX_P):
    """±127 at the length bound (|acc| = 2^17 · 127² < 2^31), and −128 (which the kernels take,
    though no quantizer makes it) one 16-byte piece below it, where 2^14 · P < 2^31 still holds."""
    a = np.full((3, P), 127, np.int8)
    a[1] = -127
    a[2, ::2] = -127
    b = np.full((2, P), 127, np.int8)
    b[1] = -127
    got = cu.gemm_i8(a, b)
    assert np.array_equal(got.astype(np.int64), a.astype(np.int64) @ b.astype(np.int64).T)
    P2 = P - 16
    a = np.full((2, P2), -128, np.int8)
    a[1, 1::2] = 127
    b = np.full((66, P2), -128, np.int8)
    b[65, ::3] = 127
    want = a.astype(np.int64) @ b.astype(np.int64).T
    assert want.max() == 2**14 * P2 and want.max() < 2**31
    assert np.array_equal(gemm_i8(2, 66, P2, a, P2, 1, b, P2, 1).astype(np.int64), want)


@pytest.mark.slow
def test_gemm_extremes_at_the_length_bound():
    check_extremes()


def test_gemm_extreme_levels():
    """-128, -127 and 127 in both operands, on the 16-byte path and the byte path."""
    for P in (1024, 1001):
        rng = rng_for(f"ext{P}")
        a = rng.choice(np.array([-128, -127, 127], np.int8), (3, P))
        b = rng.choice(np.array([-128, -127, 127], np.int8), (130, P))
        b[0], b[129] = -128, 127
        assert np.array_equal(gemm_i8(3, 130, P, a, P, 1, b, P, 1), exact(a, b)), P


# ================================================================== the int8 layer
LAYER_SHAPES = [(1, 1, 1), (129, 70, 130), (130, 64, 65)]     # (N, K, M)


def check_layer(shapes=LAYER_SHAPES):
    for N, K, M in shapes:
        rng = rng_for(f"layer{N},{K},{M}")
        x, w, dy = rand_bf16(rng, (N, K), 1.0), rand_bf16(rng, (M, K), 0.05), rand_bf16(rng, (N, M), 0.01)
        y = cu.qlinear_forward(x, w)
        assert y.view(np.uint32).tobytes() == ref.qlinear_forward(x, w).view(np.uint32).tobytes(), (N, K, M)
        dx, dw = cu.qlinear_backward(dy, x, w)
        rdx, rdw = ref.qlinear_backward(dy, x, w)
        assert dx.view(np.uint32).tobytes() == rdx.view(np.uint32).tobytes(), (N, K, M, "dx")
        assert dw.view(np.uint32).tobytes() == rdw.view(np.uint32).tobytes(), (N, K, M, "dw")


def test_layer_equals_the_reference():
    check_layer()


@pytest.mark.skipif(not HAVE_GXX, reason="g++ not found")
def test_layer_race_check():
    with runtime.emulate(), emu.options(race_check=True):
        check_layer(LAYER_SHAPES[1:2])


def check_levels_t(shapes=((128, 3), (256, 70), (33, 65), (1, 1))):
    """Shapes crossing the 32 x 32 transpose tiles in both dimensions."""
    rng = rng_for("levels_t")
    for R, C in shapes:
        f = (rng.standard_normal((R, C)) * 3).astype(np.float32)
        f[0, 0] = 1e-40                                  # a subnormal: flushed on load
        for v in (f, np.zeros_like(f), np.where(np.arange(C) == C - 1, np.float32(np.nan), f).astype(np.float32)):
            q = cu._empty((R, C), np.int8)
            cu._q_tensor(R * C, cu._dev(v), True, q, cu.QMAX)
            qt = cu._empty((C, R), np.int8)
            cu._q_levels(R * C, cu._dev(v), True, cu._q_scale(R * C, cu._dev(v), True, cu.QMAX), qt, cu.QMAX, rows=R)
            assert np.array_equal(cu.to_host(qt), cu.to_host(q).T), (R, C)


def test_transposed_levels_are_the_levels_transposed():
    check_levels_t()


@pytest.mark.skipif(not HAVE_GXX, reason="g++ not found")
def test_transposed_levels_race_check():
    with runtime.emulate(), emu.options(race_check=True):
        check_levels_t(((33, 65),))


# ================================================================== planted faults
# (fault, text in the expanded quant.cu, its replacement, the check that must catch it)
FAULTS = [
    ("model: A rows of registers 1 and 2 swapped", "int row = (i < 4 || (8 <= i && i < 12)) ? groupID : groupID + 8;",
     "int row = i < 8 ? groupID : groupID + 8;", "mma"),
    ("model: B column from threadID_in_group", "        int col = groupID;\n", "        int col = threadID_in_group;\n",
     "mma"),
    ("model: accumulator not read", "        u32 s = (u32)d[i];\n", "        u32 s = 0u;\n", "mma"),
    ("fallback: A from lane (q, g) instead of (g, q)", "a[2 * h], 4 * g + q);", "a[2 * h], 4 * q + g);",
     "shuffle"),
    ("kernel: A fragment unit without the XOR", "&As[4 * (64 * (GI_MI * wm + mi) + 8 * g + 4 * (s ^ (g & 1)) + t)]",
     "&As[4 * (64 * (GI_MI * wm + mi) + 8 * g + 4 * s + t)]", "gemm"),
    ("kernel: B words of the other instruction", "&fb[ni][2 * s]);", "&fb[ni][2 - 2 * s]);", "gemm"),
    ("kernel: A rows R and R + 8 swapped in a unit",
     "ga[h][0] = r[0][0]; ga[h][1] = r[1][0]; ga[h][2] = r[0][1]; ga[h][3] = r[1][1];",
     "ga[h][0] = r[1][0]; ga[h][1] = r[0][0]; ga[h][2] = r[1][1]; ga[h][3] = r[0][1];", "gemm"),
    ("kernel: epilogue rows g + 8 from the column bit", "g + 8 * (c >> 1), j", "g + 8 * (c & 1), j", "gemm"),
    ("kernel: the last partial step dropped", "for (i64 p0 = 0; p0 < P; p0 += GI_BK)",
     "for (i64 p0 = 0; p0 + GI_BK <= P; p0 += GI_BK)", "gemm"),
]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_GXX, reason="g++ not found")
@pytest.mark.parametrize("fault,old,new,check", FAULTS, ids=[f[0] for f in FAULTS])
def test_planted_fault_is_caught(fault, old, new, check, monkeypatch):
    text = runtime.read_source("quant.cu")
    assert text.count(old) == 1, fault
    mutated = text.replace(old, new)
    with runtime.emulate():
        if check in ("mma", "shuffle"):
            imma = runtime.read_source("imma.cuh")
            assert imma.count(old) == 1, fault
            prefix = "#define O1B_IMMA_SHUFFLE\n" if check == "shuffle" else ""
            mod = runtime.CudaModule(runtime.read_source_text(prefix + MMA_TEST_SOURCE.replace(
                '#include "imma.cuh"', imma.replace(old, new)), "test_mma.cu"), name="test_mma.cu")
            with pytest.raises(AssertionError):
                check_mma(mod)
            if check == "shuffle":
                return
        mod = runtime.CudaModule(mutated, name="quant.cu")
        monkeypatch.setattr(runtime, "load", lambda filename, *args, **kwargs: mod)
        with pytest.raises(AssertionError):
            check_gemm(GEMM_SHAPES[2:6], layouts=False)


# ================================================================== the compiled instruction (nvcc)
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("arch,mma", [("sm_90", True), pytest.param("sm_75", False, marks=pytest.mark.slow)])
def test_nvcc_emits_the_tensor_core_instruction(arch, mma, tmp_path):
    """quant.cu as handed to NVRTC: the GEMM issues mma.sync m16n8k32 s8 (without .satfinite) on
    sm_80+, and the warp-shuffle fallback below."""
    src = tmp_path / "quant.cu"
    src.write_text(runtime.read_source("quant.cu"))
    ptx = tmp_path / "quant.ptx"
    proc = subprocess.run([NVCC, "--ptx", f"-arch={arch}", "-ftz=true", *runtime.OPTIONS, str(src), "-o", str(ptx)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"quant.cu ({arch}):\n{proc.stdout}{proc.stderr}"
    text = ptx.read_text()
    body = text[text.index(".entry o1b_gemm_i8("):]
    if ".entry" in body[1:]:        # that kernel alone: the rotations after it shuffle on every arch
        body = body[:body.index(".entry", 1)]
    assert ("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" in body) == mma
    assert "satfinite" not in body
    assert ("shfl.sync" in body) != mma
