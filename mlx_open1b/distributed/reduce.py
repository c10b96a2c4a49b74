"""The training step's reducer for N workers (step.py's `Reduce`): owners, the all-to-all, gathers.

The step (mlx_open1b/step.py) is the single-device one; this reducer decides only who computes and
who owns what, and moves bytes between the workers (CONTRACT.md §7, "Across workers"):

  1. worker w of N computes the microbatches [w*M//N, (w+1)*M//N) of the step's M (every worker
     reads all of the step's windows, so the stream position stays identical everywhere), as the
     maximal aligned dyadic blocks of that range (sharding.dyadic_blocks), each a tree-folded partial;
  2. reduce-scatter by data movement: every worker owns a near-equal element range of the
     parameter buffer (sharding.shard_elements); all_to_all_single routes every block partial's
     slice of each owner's range to that owner, which pushes the partials by microbatch index
     into the tree fold of CONTRACT.md §7 (collectives.owner_fold); streamed in rounds, each
     carrying one slice of every owner's range, so that no owner receives more than RECV_BYTES of
     partials at once and no worker sends more (the fold is elementwise: a slice's fold is the
     fold's slice, the same bits in any rounds);
  3. the per-microbatch loss, CE and z-loss, the owners' gradient hashes (a tensor's digest, or
     the Merkle leaves of a piece of one) and their sum-of-squares block partials are
     all-gathered, so every worker joins the same hashes and folds the same scalars and norm and
     takes the same decisions (spike, skip, clip);
  4. each owner updates its own range (moments exist only on their owner; AdamW is elementwise),
     and the bf16 parameters are all-gathered in place, each owner's range into every worker's
     parameter buffer, with no padding (collectives.Comm.all_gather_into);
  5. the parameter and optimizer-state hashes join the owners' digests and leaves (gathered).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

from .. import arrays
from ..step import tensor_views
from .collectives import Comm, owner_fold, route
from .sharding import dyadic_blocks, microbatch_range, shard_elements


RECV_BYTES = 1 << 32      # the most bytes of partials a worker receives (or sends) in one round of the reduce-scatter


class DistributedReduce:
    """This worker's part: its microbatch blocks and its element range of the parameter buffer
    (`mine`, one of `shards`, by rank). after_microbatches(rank, step), when given, runs once this
    worker's microbatches of a step are computed, before the reduce-scatter (tests stop a worker
    there)."""

    def __init__(self, comm: Comm, ops, shapes, timing: dict, after_microbatches=None, recv_bytes: int = RECV_BYTES):
        self.comm, self.ops, self.timing = comm, ops, timing
        self.recv_bytes = recv_bytes
        self.shards = shard_elements([int(np.prod(s)) for _, s, _ in shapes], comm.world)
        self.mine = self.shards[comm.rank]
        self.size = self.mine.size
        self.shapes = shapes
        self.after_microbatches = after_microbatches

    def blocks(self, M: int) -> list[tuple[int, int]]:
        return [(start, 1 << level) for start, level in self._dyadic(M, self.comm.rank)]

    def _dyadic(self, M: int, w: int) -> list[tuple[int, int]]:
        return dyadic_blocks(*microbatch_range(M, self.comm.world, w))

    def own(self, buf):
        return buf[self.mine.lo:self.mine.hi]

    def tensors(self, buf):
        return tensor_views(self.shapes, buf, self.mine.lo)

    def gather(self, obj) -> list:
        out = self.comm.all_gather_object(obj)
        self.timing["comm"] = self.comm.seconds
        return out

    # ---- moving arrays
    def _travels(self, a) -> bool:
        """The collectives move `a` where it is: numpy; cupy when the process group runs on the GPU
        (NCCL, by DLPack). Not an mx.array, nor cupy on gloo (it reads host memory)."""
        return not (arrays.kind(a) == arrays.MLX or (arrays.kind(a) == arrays.CUPY and self.comm.device == "cpu"))

    def _wire(self, a):
        """An array as the collectives move it: itself where it travels, else a host copy."""
        return a if self._travels(a) else arrays.to_host(a)

    def _unwire(self, a, like):
        """A received array in the kind of `like` (the state's)."""
        return self.ops.to_device(a) if arrays.is_device(like) and not arrays.is_device(a) else a

    def rounds(self, M: int) -> int:
        """Rounds of the step's reduce-scatter: enough that no owner receives more than recv_bytes in
        one, and no worker sends more (its send buffer is a copy of its partials' slices); a function
        of M, the worker count and the shards: the same on every worker."""
        per = [len(self._dyadic(M, w)) for w in range(self.comm.world)]
        sizes = [sh.size for sh in self.shards]

        def most(K: int) -> int:        # bytes of the fullest round's receive or send buffer, at most
            return 4 * max(sum(per) * -(-max(sizes) // K), max(per) * sum(-(-n // K) for n in sizes))
        K = max(1, -(-4 * max(sum(per) * max(sizes), max(per) * sum(sizes)) // self.recv_bytes))
        while most(K) > self.recv_bytes and K < max(sizes):
            K += 1
        return K

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
        """Every owner's updated parameters to every worker: an all-gather into the parameter
        buffer itself (data movement only, no padding, no gathered copy) when the process group
        reaches it (numpy on gloo, cupy on NCCL, updated in place: new is None); else into a host
        copy of it, which becomes the state's parameters (mx.arrays, which AdamW returns new; cupy on gloo)."""
        counts = [sh.size for sh in self.shards]
        if new is not None:
            mine, st.m, st.v = new
        if new is None and self._travels(st.params):
            self.comm.all_gather_into(st.params, counts)
            return
        host = np.require(arrays.to_host(st.params), requirements="W")
        if new is not None:
            host[self.mine.lo:self.mine.hi] = arrays.to_host(mine)
        self.comm.all_gather_into(host, counts)
        st.params = self._unwire(host, st.params)
