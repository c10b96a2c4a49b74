"""Who computes which microbatch and who owns which parameter tensor (pure functions of the
worker count; nothing here enters the arithmetic).

* Microbatches: worker w of N computes the contiguous microbatches [w*M//N, (w+1)*M//N) of a
  step with M microbatches. It folds them as the maximal aligned dyadic blocks of its range
  (`dyadic_blocks`), each block a sub-fold of the step's canonical tree over microbatch index
  (CONTRACT.md §7), so the owners can push the block partials into the same tree.
* Parameters: the canonical tensor list (ModelConfig.param_shapes(), buffer order) is cut into N
  contiguous ranges of whole tensors, the largest range as small as possible (`shard_tensors`);
  rank r owns range r. Ranks may own no tensor at all (more ranks than there are useful cuts).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence


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
    """Rank `rank`'s tensors: canonical tensor indices [t0, t1) = elements [lo, hi) of the buffer."""
    rank: int
    t0: int
    t1: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


def shard_tensors(sizes: Sequence[int], N: int) -> list[Shard]:
    """Cut tensors (element counts, canonical order) into N contiguous ranges of whole tensors.

    The largest range is the smallest possible (binary search on the cap, greedy fill in order);
    ranges are then filled front to back, so trailing ranks may own nothing."""
    if N < 1:
        raise ShardingError(f"shard_tensors: N must be >= 1, got {N}")
    sizes = [int(s) for s in sizes]

    def pack(cap: int) -> list[int] | None:
        cuts, load = [0], 0
        for i, s in enumerate(sizes):
            if load and load + s > cap:
                cuts.append(i)
                load = 0
            load += s
        cuts.append(len(sizes))
        return cuts if len(cuts) - 1 <= N else None

    lo_cap, hi_cap = max(sizes, default=0), max(1, sum(sizes))
    while lo_cap < hi_cap:
        mid = (lo_cap + hi_cap) // 2
        if pack(mid) is None:
            lo_cap = mid + 1
        else:
            hi_cap = mid
    cuts = pack(lo_cap) if sizes else [0, 0]
    cuts += [len(sizes)] * (N + 1 - len(cuts))
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return [Shard(r, cuts[r], cuts[r + 1], offs[cuts[r]], offs[cuts[r + 1]]) for r in range(N)]
