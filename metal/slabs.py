"""Bounded dispatches: how the Metal backend splits its long kernels so that no command buffer runs
into the macOS GPU watchdog.

macOS aborts a command buffer that runs for more than about 5 s ("GPU Timeout Error"), and MLX
encodes many operations into one command buffer before it commits it (up to 50 on large
devices: MLX_MAX_OPS_PER_BUFFER). Our kernels add the contract's sums in order, one accumulator
per output, and at the open1b preset one GEMM or attention call can hold ~10^12 operations. So each
is launched in slabs along an output axis — blocks of rows of C (64-row multiples where a slab
holds that many, whole 64 x 64 tiles of the tiled GEMMs; column blocks when a row alone is too
much: gemm_slabs), ranges of whole 32-row attention tiles (metal/ops.py attention_tile_slabs,
over row_slabs) — each slab a separate dispatch writing its own part of the output. So are the
row-wise and elementwise kernels whose work grows with the batch (held-out evaluation runs a
source's eval_windows windows as one batch: 64 sequences of 4096 tokens at open1b), in ranges of
whole items: rows (sequences for RoPE), the absmax's and the norm's blocks of consecutive
elements, the rotation's blocks of QB rows. A reduction across the items of one tensor (the
absmax's second pass over the block maxima, the norm partials' fold) stays one launch over all of
them, in the contract's order. Every output element is still computed by the same sequence of
operations, whichever launch and threadgroup computes it, so the slabs change no bit (tests check
slabbed == unslabbed with a tiny bound). The pieces are joined on the device (numpy or mx
concatenation: data movement only).

The work bound: a slab may hold MAX_DISPATCH_WORK units, one unit being one of the contract's
fp32 operations in a GEMM's inner loop (mul or add, so a GEMM is 2 I J P units). With a
pessimistic rate of RATE units per second (public plain-fp32 GEMMs on Apple GPUs run ~100 GFLOP/s
with one thread per output on a 10-core M3, tiled ones several times that; we take half the
naive rate), and WATCHDOG_S shared by OPS_PER_BUFFER dispatches in one command buffer, a full
command buffer of maximal slabs still finishes in time:
MAX_DISPATCH_WORK = WATCHDOG_S / OPS_PER_BUFFER * RATE = 5e9 units (0.1 s at the assumed rate).

The functions here are pure (no mlx, no numpy arrays of data): tests check them at every preset's
real shapes without running anything.
"""
from __future__ import annotations

import numpy as np

WATCHDOG_S = 5.0            # macOS command buffer time limit (seconds)
OPS_PER_BUFFER = 50         # dispatches MLX may put in one command buffer (its largest default)
RATE = 50e9                 # units per second of a naive contract kernel on a small Apple GPU (pessimistic)
MAX_DISPATCH_WORK = int(WATCHDOG_S / OPS_PER_BUFFER * RATE)      # 5e9 units per dispatch
GEMM_TILE = 64              # rows and columns of C per threadgroup of gemm.metal and gemm_i8.metal


#: Units per item of the kernels launched in bounded ranges of items (an item is what one range
#: boundary may not split: an element, a row, a block), estimated from the contract operations a
#: thread performs per item and rounded up: exp, log, sin, cos ~30 units; the integer div ~24 (23
#: steps) and sqrt ~48 (24 steps in 64-bit integers); a trunc_normal element counted as two
#: candidates, ~150 units each, though most need one. "per element of a row": the item is a row
#: (a sequence, a block) and the op passes its length as item_slabs' `per`.
ITEM_UNITS = {
    "map": 128,              # the costliest function (silu: exp, add, div, mul)
    "swiglu_forward": 128,   # per output element (per F of a row)
    "swiglu_backward": 192,
    "adamw": 192,            # ~12 mul/add, a div, a sqrt, the bf16 rounding
    "trunc_normal": 600,
    "philox": 64,            # ten rounds of two 32x32 -> 64-bit products
    "convert": 8,            # f32_to_bf16, bf16_to_f32, add, scale: one operation and the store rule
    "div": 32,               # the integer division
    "embedding_forward": 4,  # per element of a row (a widening)
    "rmsnorm": 16,           # per element of a row: forward and backward (two passes of 2-4 ops)
    "rope": 16,              # per element of a sequence (a pair: 3 ops for each of its two values)
    "xent_chunk": 64,        # per logit of a row: xent_forward_chunk (max, sub, exp, add) and _backward_dz
    "attention_vquant": 16,  # per value of a key row (bits, max, mul, level; the row's div amortized)
    "attention_di": 8,       # per element of a sequence (one mul and add)
    "quant_absmax": 8,       # per element of a block of QUANT_BLOCK (bits and compares)
    "quant_apply": 48,       # per element: a div (the inverse), a mul, the level
    "qdequant": 24,          # per element of a row: i2f from halves (2 conversions, mul, add), 2-4 muls
    "qgrad_scale": 8,        # per element of a column block (a widening and a mul)
    "sumsq_blocks": 4,       # per element of a block of NORM_BLOCK (mul, add)
    "hadamard": 16,          # per value of a block of QB rows (7 butterfly stages, load and store)
}


def even_slabs(n: int, units: int, bound: int | None = None) -> list[tuple[int, int]]:
    """Consecutive (a, b) ranges of n items of `units` each, at most `bound` units a range (at least
    one item); [(0, 0)] for no items."""
    bound = MAX_DISPATCH_WORK if bound is None else int(bound)
    n, step = int(n), max(1, bound // max(1, int(units)))
    return [(a, min(n, a + step)) for a in range(0, n, step)] or [(0, 0)]


def item_slabs(kernel: str, n: int, per: int = 1, bound: int | None = None) -> list[tuple[int, int]]:
    """even_slabs of n items of ITEM_UNITS[kernel] * per units each: the plan of an op's bounded
    ranges (the ops and the tests call this one function)."""
    return even_slabs(n, ITEM_UNITS[kernel] * max(1, int(per)), bound)


def attention_pair_work(D: int) -> int:
    """Units per (query row, visible key) pair of the attention kernels, the costliest one counted
    (attention_dkv: the score, dp, dk and dv dot products of D terms, 2 units a term, and the exp
    and scalar ops around them, ~64 units)."""
    return 8 * int(D) + 64


def gemm_slabs(I: int, J: int, P: int, bound: int | None = None) -> list[tuple[int, int, int, int]]:
    """(i0, i1, j0, j1) blocks of C (I, J) covering it row-block by row-block (j ascending within a
    row block), each of at most `bound` units (2 (i1 - i0)(j1 - j0) P): whole rows when a row fits
    (a multiple of GEMM_TILE rows when the bound allows that many), else column blocks (a multiple of
    GEMM_TILE columns when that fits) of GEMM_TILE rows when a tile's square fits, of one row
    otherwise. A single output element (2 P units) must fit."""
    bound = MAX_DISPATCH_WORK if bound is None else int(bound)
    I, J, P = int(I), int(J), int(P)
    if I <= 0 or J <= 0:
        return [(0, I, 0, J)]
    per_elem = 2 * max(P, 1)
    if per_elem > bound:
        raise ValueError(f"gemm: one output element sums {P} products ({per_elem} units), more than one "
                         f"dispatch may hold ({bound})")
    if per_elem * J <= bound:
        rows = _tile_multiple(bound // (per_elem * J))
        return [(i0, min(I, i0 + rows), 0, J) for i0 in range(0, I, rows)]
    rows = GEMM_TILE if per_elem * GEMM_TILE * GEMM_TILE <= bound else 1
    cols = _tile_multiple(bound // (per_elem * rows))
    return [(i0, min(I, i0 + rows), j0, min(J, j0 + cols)) for i0 in range(0, I, rows) for j0 in range(0, J, cols)]


def _tile_multiple(n: int) -> int:
    """n rounded down to a multiple of GEMM_TILE when it is at least one tile (n >= 1)."""
    return n - n % GEMM_TILE if n >= GEMM_TILE else max(1, n)


def row_slabs(work: np.ndarray, bound: int | None = None) -> list[tuple[int, int]]:
    """Consecutive (r0, r1) ranges of rows whose summed work is at most `bound` (a row costing more
    than the bound alone gets a range of its own), greedy from row 0; [(0, 0)] for no rows."""
    bound = MAX_DISPATCH_WORK if bound is None else int(bound)
    work = np.asarray(work, np.int64)
    n = work.size
    if n == 0:
        return [(0, 0)]
    c = np.concatenate([[0], np.cumsum(work)])
    out, r0 = [], 0
    while r0 < n:
        r1 = int(np.searchsorted(c, c[r0] + bound, side="right")) - 1
        r1 = min(n, max(r1, r0 + 1))
        out.append((r0, r1))
        r0 = r1
    return out


def query_keys(T: int, W: int) -> np.ndarray:
    """(T,) keys visible to query i: i + 1, at most W when W > 0 (CONTRACT.md §6.6)."""
    i = np.arange(int(T), dtype=np.int64)
    return np.minimum(i + 1, W) if W > 0 else i + 1


def key_queries(T: int, W: int) -> np.ndarray:
    """(T,) queries that see key j: T - j, at most W when W > 0."""
    j = np.arange(int(T), dtype=np.int64)
    return np.minimum(T - j, W) if W > 0 else T - j


def slab_work(slabs, work: np.ndarray) -> list[int]:
    """The summed work of each (r0, r1) slab."""
    c = np.concatenate([[0], np.cumsum(np.asarray(work, np.int64))])
    return [int(c[r1] - c[r0]) for r0, r1 in slabs]
