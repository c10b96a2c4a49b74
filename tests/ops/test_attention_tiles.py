"""The tiled attention kernels (cuda/attention.cu; metal/attention_*.metal) against the C reference,
bit for bit: forward (bf16 and the int8 P.V path of CONTRACT.md §6.10), dq and dk/dv, at shapes
that cross every tile boundary — one query, T not a multiple of 64, windows smaller and larger
than a key block, grouped-query heads, odd head dims and head dims whose backward tiles shrink
below 64 rows — with special values, a signed-zero case that a kernel adding a +0 term for an
invisible pair would get wrong, and the emulators' race checks (a missing barrier)."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import SPECIAL_BF16, SPECIAL_F32, assert_bits_equal, attention_i8_inputs, rand_bf16, rand_f32, sprinkle

import mlx_open1b.cpu_ref as ref
from mlx_open1b.spec.arith import f32_to_bf16

# (B, T, H, G, D, W): one query; T not a multiple of 64 and a partial last block; windows of 1, 5
# (inside a block), 33 (crossing one), 64 and 100 (longer than a block), T <= W; G = 1, 2 and H;
# odd D (few head dims: each is a module of its own to compile); D = 66: the backward tiles shrink
# to 32 rows (cuda/attention.cu ATTN_DQ_TILE and ATTN_DKV_TILE, metal/attention_dq.metal AT_NK,
# attention_dkv.metal AT_NQ), so their boundaries fall inside a 64-key block; D = 128 (Metal only,
# the presets' head dim): dk/dv's query tile is 16.
SHAPES = [
    (1, 1, 2, 1, 8, 0),
    (2, 150, 4, 2, 8, 0),
    (1, 70, 3, 3, 5, 33),
    (1, 130, 2, 1, 5, 1),
    (1, 200, 4, 2, 8, 100),
    (2, 67, 2, 2, 8, 5),
    (1, 129, 2, 1, 5, 64),
    (1, 40, 2, 1, 1, 64),
    (1, 97, 2, 1, 66, 70),
]
METAL_ONLY = [(1, 45, 2, 1, 128, 20)]


def _cuda():
    from mlx_open1b.cuda import ops
    return ops


def _metal():
    from mlx_open1b.metal import ops
    return ops


BACKENDS = {"cuda": _cuda, "metal": _metal}
CASES = [(n, *shape) for n in BACKENDS for shape in SHAPES] + [("metal", *shape) for shape in METAL_ONLY]


def backend(name):
    ops = BACKENDS[name]()
    ok, why = ops.available()
    if not ok:
        pytest.skip(why)
    return ops


def inputs(seed, B, T, H, G, D, frac):
    rng = np.random.default_rng([0xA77, seed])
    q, k, v = rand_bf16(rng, (B, T, H, D), 2.0), rand_bf16(rng, (B, T, G, D), 2.0), rand_bf16(rng, (B, T, G, D))
    dout = rand_f32(rng, (B, T, H, D))
    if frac:
        q, k, v = (sprinkle(rng, a, SPECIAL_BF16, frac) for a in (q, k, v))
        dout = sprinkle(rng, dout, SPECIAL_F32, frac)
    return q, k, v, dout


def check_all(ops, q, k, v, dout, W, scale, what):
    o, lse = ref.attention_forward(q, k, v, W, scale)
    for got, want, name in zip(ops.attention_forward(q, k, v, W, scale), (o, lse), ("o", "lse")):
        assert_bits_equal(got, want, f"{what} {name}")
    for got, want, name in zip(ops.attention_backward(dout, q, k, v, o, lse, W, scale),
                               ref.attention_backward(dout, q, k, v, o, lse, W, scale), ("dq", "dk", "dv")):
        assert_bits_equal(got, want, f"{what} {name}")


@pytest.mark.parametrize("name,B,T,H,G,D,W", CASES)
def test_tiles_match_cpu_ref(name, B, T, H, G, D, W):
    ops = backend(name)
    for n, frac in enumerate((0.0, 0.02)):
        q, k, v, dout = inputs(n * 1000 + T * 7 + D + W, B, T, H, G, D, frac)
        check_all(ops, q, k, v, dout, W, float(np.float32(1.1 / np.sqrt(D))), f"{name} {B, T, H, G, D, W} frac={frac}")


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("B,T,H,G,D,W", SHAPES[:7])
def test_i8_tiles_match_cpu_ref(name, B, T, H, G, D, W):
    ops = backend(name)
    rng = np.random.default_rng([0x18, T, D, W])
    for specials, scale in ((False, float(np.float32(1 / np.sqrt(D)))), (True, 1.0)):
        q, k, v = attention_i8_inputs(rng, B, T, H, G, D, specials)
        for got, want, what in zip(ops.attention_forward_i8(q, k, v, W, scale),
                                   ref.attention_forward_i8(q, k, v, W, scale), ("o", "lse")):
            assert_bits_equal(got, want, f"{name} {B, T, H, G, D, W} specials={specials} {what}")


@pytest.mark.parametrize("name", list(BACKENDS))
def test_no_zero_term_for_invisible_pairs(name):
    """dv of key 0 sums dout of the queries that see it (queries 0 and 1, W = 2) with p = 1 each:
    2^-125 + -(2^-125 + 2^-147) is tiny, flushed to -0 (the sign of the larger operand). Query 2
    does not see key 0; adding its pair as a +0 term (p masked to 0, dout > 0) would make it +0.
    Query 1 sees key 0 with score 0 and key 1 with score -200 (p = exp(-200) = +0), so its lse is
    0 and its p for key 0 is exactly 1."""
    ops = backend(name)
    D, W = 1, 2
    q = f32_to_bf16(np.array([0.0, -1.0, 0.0, 0.0], np.float32)).reshape(1, 4, 1, D)
    k = f32_to_bf16(np.array([0.0, 200.0, 1.0, 1.0], np.float32)).reshape(1, 4, 1, D)
    v = f32_to_bf16(np.array([1.0, 2.0, 3.0, 4.0], np.float32)).reshape(1, 4, 1, D)
    dout = np.array([2.0 ** -125, -(2.0 ** -125 + 2.0 ** -147), 1.0, 1.0], np.float32).reshape(1, 4, 1, D)
    o, lse = ref.attention_forward(q, k, v, W, 1.0)
    _, _, dv = ref.attention_backward(dout, q, k, v, o, lse, W, 1.0)
    assert dv.reshape(-1).view(np.uint32)[0] == 0x80000000, "the construction gives dv[0] = -0"
    check_all(ops, q, k, v, dout, W, 1.0, f"{name} signed zero")


def test_cuda_race_check():
    """Each tiled kernel run twice, threads in forward and in reverse order at every barrier phase,
    with shared memory poisoned differently: a missing __syncthreads changes a result."""
    ops = backend("cuda")
    from mlx_open1b.cuda import emu, runtime
    q, k, v, dout = inputs(7, 1, 70, 2, 1, 5, 0.0)
    with runtime.emulate(), emu.options(race_check=True):
        check_all(ops, q, k, v, dout, 33, 0.5, "cuda race check")
        for got, want in zip(ops.attention_forward_i8(q, k, v, 33, 0.5), ref.attention_forward_i8(q, k, v, 33, 0.5)):
            assert_bits_equal(got, want, "cuda race check i8")


def test_metal_race_check(monkeypatch):
    """Each tiled Metal kernel run twice, threadgroups and their threads in forward and in reverse
    round-robin order: a missing threadgroup_barrier changes a result."""
    ops = backend("metal")
    from mlx_open1b.metal import runtime
    if runtime.real_metal():
        pytest.skip("the race check is the emulator's")
    monkeypatch.setenv("O1B_EMU_RACECHECK", "1")
    q, k, v, dout = inputs(7, 1, 70, 2, 1, 5, 0.0)
    check_all(ops, q, k, v, dout, 33, 0.5, "metal race check")
    for got, want in zip(ops.attention_forward_i8(q, k, v, 33, 0.5), ref.attention_forward_i8(q, k, v, 33, 0.5)):
        assert_bits_equal(got, want, "metal race check i8")


@pytest.mark.parametrize("preset_name", ["tiny", "small", "open1b"])
def test_metal_tile_slabs_bound_every_preset_launch(preset_name):
    """The Metal launches of whole tiles (metal/ops.py attention_tile_slabs) at every batch a preset
    runs attention at (training microbatch, held-out evaluation, lm-eval's 8) and every layer window:
    consecutive ranges covering all tiles, none over the dispatch bound (a tile alone fits it)."""
    from mlx_open1b.config import PRESETS
    from mlx_open1b.metal import ops as M, slabs
    m, t = PRESETS[preset_name].model, PRESETS[preset_name].train
    T, H, G, D = m.seq_len, m.n_heads, m.n_kv_heads, m.head_dim
    pair = slabs.attention_pair_work(D)
    nt = -(-T // M.ATTN_ROWS)
    for B in (t.microbatch_seqs, t.eval_windows, 8):
        for W in sorted({m.layer_window(layer) for layer in range(m.n_layers)}):
            for heads, rows in ((H, slabs.query_keys(T, W) * pair), (G, slabs.key_queries(T, W) * (H // G) * pair)):
                plan = M.attention_tile_slabs(B, T, heads, rows)
                assert plan[0][0] == 0 and plan[-1][1] == B * heads * nt
                assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(plan, plan[1:]))
                work = np.zeros(nt * M.ATTN_ROWS, np.int64)
                work[:T] = rows
                tiles = np.tile(work.reshape(nt, M.ATTN_ROWS).sum(1), B * heads)
                assert max(slabs.slab_work(plan, tiles)) <= slabs.MAX_DISPATCH_WORK, (preset_name, B, W, heads)
