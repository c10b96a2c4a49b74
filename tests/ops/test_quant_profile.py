"""cpu_ref.quant.layer_profile: the int8 layer's phase and piece timers (measurement only), and
kernel_peak_macs' loop. Times are not asserted (they belong to benchmarks); these hold the
counters to their structure: off unless a profile runs and no bit changed by them; every call and
every phase that ran counted, none that did not (the held weights' pieces); each piece inside its
own phase (a piece's time is part of its phase's task time, and a phase's task time fits in its
wall time on the threads; a piece booked under the wrong phase breaks that); the phases inside the
C calls. benchmarks/int8_bench.py --phases prints the table from them."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import assert_bits_equal, rand_bf16
from mlx_open1b import cpu_ref
from mlx_open1b.cpu_ref import quant, settings

VNNI = cpu_ref.simd_level() >= 2 and cpu_ref.gemm_i8_has_vnni()
needs_vnni = pytest.mark.skipif(not VNNI, reason="the profiled phases belong to the AVX-512 VNNI path")
WEIGHT_PIECES = {("F1", "weights"), ("B1", "weights"), ("B2", "R = rot(q_w)"), ("B3", "R packed")}
SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "int8_bench.py"


def _operands(N=300, K=200, M=260, seed=0):
    rng = np.random.default_rng(seed)
    return rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.05), rand_bf16(rng, (N, M), 1e-3)


def _raw():
    n = quant.PROFILE_VALUES
    v = np.zeros(n, np.uint64)
    quant._prof_read(quant.p(v), n)
    return v


def _layer(x, w, dy):
    return (cpu_ref.qlinear_forward(x, w), *cpu_ref.qlinear_backward(dy, x, w))


def test_off_unless_profiling_and_no_bit_changed():
    x, w, dy = _operands()
    plain = _layer(x, w, dy)
    assert not _raw().any(), "the counters run outside a profile"
    with quant.layer_profile() as prof:
        profiled = _layer(x, w, dy)
    for a, b in zip(plain, profiled):
        assert_bits_equal(a, b)
    assert not _raw().any(), "a profile leaves its counts behind"
    assert prof.calls == ((1, 1) if VNNI else (0, 0))


@needs_vnni
@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_phase_counted_and_each_piece_inside_its_phase(held, threads):
    x, w, dy = _operands()
    with settings(threads=threads):
        if held:
            with cpu_ref.weights_held(), quant.layer_profile() as prof:
                _layer(x, w, dy)
                _layer(x, w, dy)
        else:
            with quant.layer_profile() as prof:
                _layer(x, w, dy)
                _layer(x, w, dy)
    assert prof.calls == (2, 2)
    for ph in quant.PROFILE_PHASES:
        if held and ph == "B1":      # no work: the weights are held, and the backward's x is the
            assert prof.wall[ph] == prof.tasks[ph] == 0, ph   # forward's, so its s_x is taken
            continue
        assert prof.wall[ph] > 0 and prof.tasks[ph] > 0, ph
        assert prof.wall[ph] <= prof.thread_wall[ph] <= prof.wall[ph] * threads, ph
        assert prof.tasks[ph] <= prof.thread_wall[ph], (ph, prof.tasks[ph], prof.thread_wall[ph])
        pieces = sum(v for (pp, _), v in prof.passes.items() if pp == ph)
        assert pieces <= prof.tasks[ph], (ph, pieces, prof.tasks[ph])
    fwd = prof.wall["F1"] + prof.wall["F2"]
    bwd = sum(prof.wall[ph] for ph in ("B1", "B2", "B3", "B4"))
    assert fwd <= prof.call_wall[0] and bwd <= prof.call_wall[1], (fwd, bwd, prof.call_wall)
    for piece, v in prof.passes.items():
        if held and (piece in WEIGHT_PIECES or piece == ("B1", "absmax of x")):   # computed once,
            assert v == 0, piece         # outside the profiled calls; the forward's s_x taken
        else:
            assert v > 0, piece


@needs_vnni
@pytest.mark.parametrize("need", ["dx", "dw"])
def test_each_gradient_books_its_own_pieces(need):
    """With one gradient asked for, the other's pieces stay 0 and its own run: a piece booked under
    the other gradient's name (within the same phase) shows here."""
    x, w, dy = _operands()
    dx_pieces = {("B2", "absmax of G"), ("B3", "dx's A (G quantized)"), ("B4", "dx GEMM + epilogue"),
                 ("B2", "R = rot(q_w)"), ("B3", "R packed")}
    dw_pieces = {("B1", "absmax of x"), ("B2", "absmax of D"), ("B2", "X = rot(q_x)"),
                 ("B3", "dW's A (D quantized)"), ("B3", "X packed"), ("B4", "dW GEMM + epilogue")}
    with quant.layer_profile() as prof:
        cpu_ref.qlinear_backward(dy, x, w, need_dx=need == "dx", need_dw=need == "dw")
    own, other = (dx_pieces, dw_pieces) if need == "dx" else (dw_pieces, dx_pieces)
    for piece in own:
        assert prof.passes[piece] > 0, piece
    for piece in other:
        assert prof.passes[piece] == 0, piece


@needs_vnni
def test_the_portable_path_is_not_counted():
    x, w, dy = _operands(40, 30, 20)
    with settings(simd=1), quant.layer_profile() as prof:
        _layer(x, w, dy)
    assert prof.calls == (0, 0) and not any(prof.wall.values())


def test_profiles_do_not_nest():
    with quant.layer_profile():
        with pytest.raises(RuntimeError, match="already running"):
            with quant.layer_profile():
                pass
    with quant.layer_profile():     # the first one let go
        pass


def test_peak_loop_runs_every_round():
    """Each round adds 4 * 3 * (-5) = -60 to every lane of the 12 accumulators (lane values start
    at the accumulator's index): the sum over 16 lanes and 12 accumulators, in int32."""
    if not VNNI:
        assert quant.kernel_peak_macs() == 0.0
        return
    for n in (0, 1, 7, 1000):
        want = np.int64(16 * sum(i - 60 * n for i in range(12)))
        assert quant._peak_loop(n) == int(np.array(want).astype(np.int32)), n
    assert quant.kernel_peak_macs(rounds=1 << 12, reps=2) > 0


@needs_vnni
def test_bench_phases_table(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--phases", "--preset", "tiny", "--reps", "2", "--threads", "2"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    m = re.search(r"2 threads, weights held, 2 blocks: ([\d.]+) ms per block", out)
    assert m and float(m.group(1)) > 0, out
    if quant.gemm_i8_has_amx():      # the GEMM blocks run on AMX tiles: no VNNI-rate prediction printed
        assert "ideal: none printed" in out and "ideal (a prediction)" not in out, out
    else:
        assert "ideal (a prediction)" in out, out
    walls = {}
    for ph in quant.PROFILE_PHASES:
        row = re.search(rf"^    {ph}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
        assert row, (ph, out)
        walls[ph] = float(row.group(1))
    assert sum(walls.values()) <= float(m.group(1)) + 0.01 * len(walls), out   # printed to 3 decimals
    assert re.search(r"^      dx GEMM \+ epilogue\s+[\d.]+$", out, re.M), out
    assert not re.search(r"^      R packed", out, re.M), "held weights: R is packed outside the profiled calls"
