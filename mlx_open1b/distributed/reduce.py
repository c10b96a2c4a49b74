"""The training step's reducer for N workers (step.py's `Reduce`): owners, the all-to-all, gathers.

The step (mlx_open1b/step.py) is the single-device one; this reducer decides only who computes and
who owns what, and moves bytes between the workers (CONTRACT.md §7, "Across workers"):

  1. worker w of N computes the microbatches [w*M//N, (w+1)*M//N) of the step's M (every worker
     reads all of the step's windows, so the stream position stays identical everywhere), as the
     maximal aligned dyadic blocks of that range (sharding.dyadic_blocks), each a tree-folded partial;
  2. reduce-scatter by data movement: all_to_all_single routes every block partial's slice of
     each owner's parameter range to that owner, which pushes the partials by microbatch index
     into the tree fold of CONTRACT.md §7 (collectives.owner_fold); in rounds, each carrying one
     slice of every owner's range, so that no owner holds more than RECV_BYTES of partials at once
     (the fold is elementwise: a slice's fold is the fold's slice, the same bits in any rounds);
  3. the per-microbatch loss, CE and z-loss, the owners' gradient tensor hashes and their
     sum-of-squares block partials are all-gathered, so every worker folds the same scalars and
     norm and takes the same decisions (spike, skip, clip);
  4. each owner updates its own tensors (moments exist only on their owner), and the bf16
     parameters are all-gathered;
  5. the parameter and optimizer-state hashes combine the owners' tensor hashes (gathered).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

from .. import arrays
from ..step import tensor_views
from .collectives import Comm, owner_fold, route
from .sharding import dyadic_blocks, microbatch_range, shard_tensors


RECV_BYTES = 1 << 32      # the most bytes of partials an owner receives in one round of the reduce-scatter


class DistributedReduce:
    """This worker's part: its microbatch blocks and its range of whole tensors (`mine`, one of
    `shards`, by rank). after_microbatches(rank, step), when given, runs once this worker's
    microbatches of a step are computed, before the reduce-scatter (tests stop a worker there)."""

    def __init__(self, comm: Comm, ops, shapes, timing: dict, after_microbatches=None, recv_bytes: int = RECV_BYTES):
        self.comm, self.ops, self.timing = comm, ops, timing
        self.recv_bytes = recv_bytes
        self.shards = shard_tensors([int(np.prod(s)) for _, s, _ in shapes], comm.world)
        self.mine = self.shards[comm.rank]
        self.size = self.mine.size
        self.shapes = shapes[self.mine.t0:self.mine.t1]
        self.after_microbatches = after_microbatches

    def blocks(self, M: int) -> list[tuple[int, int]]:
        return [(start, 1 << level) for start, level in self._dyadic(M, self.comm.rank)]

    def _dyadic(self, M: int, w: int) -> list[tuple[int, int]]:
        return dyadic_blocks(*microbatch_range(M, self.comm.world, w))

    def own(self, buf):
        return buf[self.mine.lo:self.mine.hi]

    def tensors(self, buf):
        return tensor_views(self.shapes, buf)

    def gather(self, obj) -> list:
        out = self.comm.all_gather_object(obj)
        self.timing["comm"] = self.comm.seconds
        return out

    # ---- moving arrays
    def _wire(self, a):
        """An array as the collectives move it: numpy as it is; cupy as it is when the process
        group runs on the GPU (NCCL, by DLPack), else a host copy; an mx.array through a host copy
        (gloo reads host memory)."""
        if arrays.kind(a) == arrays.MLX or (arrays.kind(a) == arrays.CUPY and self.comm.device == "cpu"):
            return arrays.to_host(a)
        return a

    def _unwire(self, a, like):
        """A received array in the kind of `like` (the state's)."""
        return self.ops.to_device(a) if arrays.is_device(like) and not arrays.is_device(a) else a

    def rounds(self, M: int) -> int:
        """Rounds of the step's reduce-scatter: enough that no owner receives more than recv_bytes in
        one (a function of M, the worker count and the shards: the same on every worker)."""
        n = sum(len(self._dyadic(M, w)) for w in range(self.comm.world))
        most = 4 * n * max(sh.size for sh in self.shards)
        return max(1, -(-most // self.recv_bytes))

    def fold(self, parts: list, M: int, step: int):
        """The reduce-scatter: this owner's slice of the step's gradient sum (f32, size elements).
        Consumes `parts` (the list is emptied once they are in the last round's send buffer)."""
        if self.after_microbatches is not None:
            self.after_microbatches(self.comm.rank, step)
        N, size, me = self.comm.world, self.size, self.comm.rank
        blocks = [self._dyadic(M, w) for w in range(N)]
        K, out, on_device = self.rounds(M), None, False
        for k in range(K):      # round k: the k-th of K near-equal slices of every owner's range
            cut = [dataclasses.replace(sh, lo=sh.lo + sh.size * k // K, hi=sh.lo + sh.size * (k + 1) // K)
                   for sh in self.shards]
            send, send_counts = route(parts, cut)
            if k == K - 1:
                parts.clear()   # consumed: not alive beside the last receive buffer
            piece = cut[me].size
            recv = self._unwire(self.comm.all_to_all(self._wire(send), send_counts, [len(b) * piece for b in blocks]),
                                send)
            on_device = arrays.is_device(send)
            del send
            if not piece:
                continue
            t0 = time.perf_counter()
            arrivals, off = [], 0
            for w in range(N):
                for start, level in blocks[w]:
                    arrivals.append((start, level, recv[off:off + piece]))
                    off += piece
            if out is None:     # the sum leaves the receive buffers (every worker's partials) behind
                out = arrays.FlatBuffer(size, np.float32, arrays.kind(recv))
            out.write(cut[me].lo - self.mine.lo, owner_fold(arrivals, M, functools.partial(arrays.add_into, self.ops)))
            del recv, arrivals
            self.timing["reduce"] += time.perf_counter() - t0
        if out is None:
            return self.ops.to_device(np.zeros(0, np.float32)) if on_device else np.zeros(0, np.float32)
        return out.result()

    def share_params(self, st, new) -> None:
        """Every owner's updated parameters to every worker (all-gather, data movement only)."""
        comm, in_place = self.comm, new is None
        if not in_place:
            mine, st.m, st.v = new
        else:
            mine = self.own(st.params)
        pieces = comm.all_gather(self._wire(mine), [sh.size for sh in self.shards])
        if in_place:
            for sh, piece in zip(self.shards, pieces):
                if sh.rank != comm.rank and sh.size:
                    st.params[sh.lo:sh.hi] = self._unwire(piece, st.params)
            return
        full = arrays.FlatBuffer(st.params.size, np.uint16, arrays.kind(st.params))
        for sh, piece in zip(self.shards, pieces):
            if sh.size:
                full.write(sh.lo, mine if sh.rank == comm.rank else self._unwire(piece, st.params))
        st.params = full.result()
