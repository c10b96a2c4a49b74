"""Who computes which microbatch and who owns which parameter elements (pure functions of the
worker count; nothing here enters the arithmetic).

* Microbatches: worker w of N computes the contiguous microbatches [w*M//N, (w+1)*M//N) of a
  step with M microbatches. It folds them as the maximal aligned dyadic blocks of its range
  (`dyadic_blocks`), each block a sub-fold of the step's canonical tree over microbatch index
  (CONTRACT.md §7), so the owners can push the block partials into the same tree.
* Parameters: the canonical flat buffer (ModelConfig.param_shapes(), buffer order) is cut into N
  contiguous element ranges, near-equal (`shard_elements`); rank r owns range r. A range may end
  inside a tensor, but only ALIGN elements from the tensor's start (or a multiple of it): there a
  norm block (§7, NORM_BLOCK elements) and a hash chunk (§11, CHUNK bytes) of every state the
  owner hashes (bf16 parameters, f32 gradients and moments) begin, so the owners' block partials
  and Merkle leaves, joined in rank order, are the tensor's own — the same norm and hashes as one
  process. Tensors smaller than ALIGN are never cut; ranks may own nothing (more ranks than cuts).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Sequence

from ..contract import NORM_BLOCK
from ..hashing import CHUNK

# elements from a tensor's start where a cut may fall: a norm block and a hash chunk of bf16 (2-byte)
# and f32 (4-byte) elements all begin there
ALIGN = math.lcm(NORM_BLOCK, CHUNK // 2, CHUNK // 4)


class ShardingError(ValueError):
    """A worker count the batch cannot be split over; the message names the valid counts."""


def microbatch_range(M: int, N: int, w: int) -> tuple[int, int]:
    """The microbatches [lo, hi) that worker w of N computes in a step of M microbatches."""
    if not (1 <= N <= M and 0 <= w < N):
        raise ShardingError(f"worker {w} of {N} cannot take a share of {M} microbatches")
    return w * M // N, (w + 1) * M // N


def dyadic_blocks(lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) as maximal aligned dyadic blocks [(start, level)], ascending: each block holds the
    2^level microbatches from start, and start is a multiple of 2^level (a Fenwick tree's cut)."""
    out = []
    while lo < hi:
        level = 0
        while (lo % (2 << level) == 0) and lo + (2 << level) <= hi:
            level += 1
        out.append((lo, level))
        lo += 1 << level
    return out


def valid_worker_counts(phases: Sequence[Sequence[int]]) -> range:
    """Worker counts that every batch phase can be split over: 1 … min over phases of M."""
    return range(1, min(int(m) for _, m in phases) + 1)


def check_worker_count(N: int, phases: Sequence[Sequence[int]]) -> None:
    ok = valid_worker_counts(phases)
    if N not in ok:
        ph = tuple(tuple(int(x) for x in p) for p in phases)
        ms = " and ".join(f"{m} microbatches per step from {start:,} tokens" for start, m in ph)
        raise ShardingError(
            f"{N} workers: a step's batch is split over the workers by whole microbatches, and "
            f"train.phases {ph} gives {ms}; valid worker counts are "
            f"1-{ok[-1]} (at most the smallest number of microbatches per step)")


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank `rank`'s elements [lo, hi) of the flat buffer; they touch the canonical tensors
    [t0, t1) (the first and the last of them possibly in part)."""
    rank: int
    t0: int
    t1: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


def shard_elements(sizes: Sequence[int], N: int) -> list[Shard]:
    """Cut the flat buffer of tensors `sizes` (element counts, canonical order) into N contiguous
    element ranges: cut r is the allowed point nearest r/N of the buffer (ties to the lower), the
    allowed points being the tensors' boundaries and, inside a tensor, every ALIGN elements from
    its start. Allowed points are at most ALIGN apart, so every range holds P/N +- ALIGN elements
    (P the buffer's), or nothing where more ranks than points."""
    if N < 1:
        raise ShardingError(f"shard_elements: N must be >= 1, got {N}")
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + int(s))
    P = offs[-1]

    def nearest(x: int) -> int:
        t = bisect.bisect_right(offs, x) - 1            # x in tensor t: offs[t] <= x < offs[t + 1]
        if t >= len(sizes):
            return P
        below = offs[t] + (x - offs[t]) // ALIGN * ALIGN
        above = min(below + ALIGN, offs[t + 1])
        return below if x - below <= above - x else above

    cuts = [0] + [nearest((r * P + N // 2) // N) for r in range(1, N)] + [P]

    def tensors(lo: int, hi: int) -> tuple[int, int]:
        if lo == hi:
            t = bisect.bisect_right(offs, lo) - 1
            return t, t
        return bisect.bisect_right(offs, lo) - 1, bisect.bisect_left(offs, hi)

    return [Shard(r, *tensors(cuts[r], cuts[r + 1]), cuts[r], cuts[r + 1]) for r in range(N)]
