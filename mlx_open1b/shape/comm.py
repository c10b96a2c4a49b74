"""A process group of W workers simulated in one process: one thread per rank, collectives that
move nothing and record their buffers and the bytes they would carry.

`SimComm` is a distributed.Comm whose array collectives allocate what Comm's allocate on the
transport's side (all_to_all: the receive buffer; all_gather_into: nothing, it writes in place),
check that every rank's counts agree, and count the bytes each rank sends to and receives from the
others (net_out, net_in; a rank's piece for itself is not network traffic; the all-gather's also
as gather_out, gather_in). The process group is NCCL-like (device "cuda:0"): device arrays travel as they
are, with no host copy. Object collectives pass the Python objects through (their pickled size is
counted). Every collective is a barrier of the W threads; an error on one rank breaks the barrier
so the others stop too (`SimWorld.run` raises the first real error). SimWorld(values=True) moves
the values of numpy arrays instead (the workers on the CPU backend, for tests of the reducer's bits).
"""
from __future__ import annotations

import contextlib
import pickle
import threading

import numpy as np

from ..distributed.collectives import Comm
from . import array as xp
from .ledger import current


class SimWorld:
    """W ranks as threads of this process; `run(fn)` calls fn(rank) on each and returns the results
    by rank."""

    def __init__(self, world: int, values: bool = False):
        self.world, self.values = world, values
        self.barrier = threading.Barrier(world)
        self.slots: list = [None] * world

    def exchange(self, rank: int, value) -> list:
        """Every rank's value, by rank (a barrier on both sides)."""
        self.slots[rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        self.slots[rank] = None          # every rank has read it: the world holds nothing after
        return got

    def run(self, fn) -> list:
        results, errors = [None] * self.world, [None] * self.world

        def body(rank):
            try:
                results[rank] = fn(rank)
            except threading.BrokenBarrierError as e:
                errors[rank] = e
            except BaseException as e:  # noqa: BLE001 - re-raised below, after every thread has stopped
                errors[rank] = e
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"shape-rank-{r}") for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if real:
            raise real[0]
        if any(errors):
            raise next(e for e in errors if e is not None)
        return results


class SimComm(Comm):
    """Rank `rank` of a SimWorld, as the trainers see a process group."""

    def __init__(self, world: SimWorld, rank: int):
        super().__init__(rank, world.world, device="cuda:0", backend="nccl", timeout_s=float("inf"))
        self.sim = world

    def _exchange(self, value) -> list:
        self.calls += 1
        return self.sim.exchange(self.rank, value)

    @staticmethod
    def _net(out_bytes: int, in_bytes: int) -> None:
        led = current()
        led.count("net_out", out_bytes)
        led.count("net_in", in_bytes)

    # ---- collectives on arrays
    def all_to_all(self, send, send_counts, recv_counts):
        item = send.dtype.itemsize
        if self.sim.values:
            return self._all_to_all_values(send, send_counts, recv_counts)
        with current().tagged("communication"):
            recv = xp.empty(int(sum(recv_counts)), send.dtype)
            xp.ascontiguousarray(send)
        got = self._exchange([int(c) for c in send_counts])
        for src, counts in enumerate(got):
            if counts[self.rank] != int(recv_counts[src]):
                raise ValueError(f"all_to_all: rank {src} sends {counts[self.rank]} elements to rank {self.rank}, "
                                 f"which expects {int(recv_counts[src])}")
        me = self.rank
        self._net(sum(int(c) for r, c in enumerate(send_counts) if r != me) * item,
                  sum(int(c) for r, c in enumerate(recv_counts) if r != me) * item)
        return recv

    # ---- with values (numpy arrays on the CPU backend: tests compare the workers' bits)
    def _all_to_all_values(self, send, send_counts, recv_counts):
        got = self._exchange((np.array(send), [int(c) for c in send_counts]))
        pieces = []
        for src, (data, counts) in enumerate(got):
            if counts[self.rank] != int(recv_counts[src]):
                raise ValueError(f"all_to_all: rank {src} sends {counts[self.rank]} elements to rank {self.rank}, "
                                 f"which expects {int(recv_counts[src])}")
            at = sum(counts[:self.rank])
            pieces.append(data[at:at + counts[self.rank]])
        return np.concatenate(pieces) if pieces else np.zeros(0, send.dtype)

    def all_gather_into(self, buf, counts):
        counts = [int(c) for c in counts]
        if len(buf) != sum(counts) or len(counts) != self.world:
            raise ValueError(f"all_gather_into: a buffer of {len(buf)} elements for counts of {len(counts)} ranks "
                             f"summing to {sum(counts)}")
        offs = np.cumsum([0] + counts)
        mine = slice(int(offs[self.rank]), int(offs[self.rank + 1]))
        got = self._exchange((counts, np.array(buf[mine]) if self.sim.values else None))
        for src, (c, piece) in enumerate(got):
            if c != counts:
                raise ValueError(f"all_gather_into: rank {src} has counts {c}, rank {self.rank} {counts}")
            if self.sim.values and src != self.rank:
                buf[offs[src]:offs[src + 1]] = piece
        item = buf.dtype.itemsize
        out, into = (self.world - 1) * counts[self.rank] * item, (sum(counts) - counts[self.rank]) * item
        self._net(out, into)
        current().count("gather_out", out)
        current().count("gather_in", into)

    def broadcast(self, arr, src: int = 0) -> None:
        self._exchange(None)
        n = arr.nbytes
        self._net((self.world - 1) * n if self.rank == src else 0, 0 if self.rank == src else n)

    def send(self, arr, dst: int) -> None:
        raise NotImplementedError("point-to-point sends are not simulated (start-up and checkpoints are not modelled)")

    def recv(self, out, src: int) -> None:
        raise NotImplementedError("point-to-point receives are not simulated (start-up and checkpoints are not modelled)")

    # ---- small Python objects
    def all_gather_object(self, obj) -> list:
        wire = self._exchange(pickle.dumps(obj))
        current().count("net_objects", (self.world - 1) * len(wire[self.rank])
                        + sum(len(w) for r, w in enumerate(wire) if r != self.rank))
        return [obj if r == self.rank else pickle.loads(w) for r, w in enumerate(wire)]

    def broadcast_object(self, obj, src: int = 0):
        wire = self._exchange(pickle.dumps(obj) if self.rank == src else None)[src]
        current().count("net_objects", (self.world - 1) * len(wire) if self.rank == src else len(wire))
        return obj if self.rank == src else pickle.loads(wire)

    @contextlib.contextmanager
    def phase(self, what: str, busy=(0,)):
        yield                   # the ranks that do not work meet the others in the next collective

    def close(self) -> None:
        pass
