"""Where a tree fold's idle entries wait on a device with memory of its own (step.TreeFold): in
reused pinned host buffers, copied on a copy stream while the next microbatch computes.

The fold parks an entry of level >= PARK_LEVEL once a push leaves it idle under a new top, and the
binary-carry rule says which later push (or the final sum) reads it again, so the fold asks for it
back one microbatch ahead (`prefetch`) and takes it (`unpark`) just before its add. Only where an
operand waits changes; the adds, their operands and their order are the fold's, so every bit is.

cupy, overlapped (the default):
* park: the entry's bytes go to a pinned buffer of the pool (`PinnedPool`) by a copy on the copy
  stream that first waits for an event recorded on the compute stream after the kernels that
  wrote the entry. The device array stays referenced until `settle` (the next push) has made the
  compute stream wait for the copy's end: cupy's pool hands a freed block only to later allocations
  on the stream it was allocated on (the compute stream; no event is waited for), so no kernel can
  reuse the memory before the copy has read it.
* prefetch: a device buffer allocated on the compute stream and filled on the copy stream after
  an event recorded on the compute stream (the block may be one that queued kernels still use),
  after the park's copy of the same pinned buffer (one copy stream: in order).
* unpark: the compute stream waits for the prefetch's event (no host block). The pinned buffer goes
  back to the pool at once: only copies on the copy stream touch it, queued after this one.
numpy (tests: the same schedule, copies done at once) and the shape kind (the memory model: the
buffers and the traffic recorded in the ledger, no values). overlap=False: the blocking copies into
pageable memory (arrays.to_host, arrays.from_host), for comparison.

A copy counts as overlapped when a microbatch was computed between its start and the point the
compute stream waits for it (`settle` counts the pushes), blocking otherwise (`moved`; on the shape
kind the ledger's d2h_async / h2d_async).
"""
from __future__ import annotations

import numpy as np

from . import arrays
from .state_hashes import copy_down, pinned_empty


class PinnedPool:
    """Reused pinned host buffers of one array kind, keyed by shape and dtype: a park takes one, its
    unpark gives it back; a new one is allocated only when none of the key is free, so once a step
    has held its most entries at once the later steps allocate none."""

    def __init__(self, kind: str):
        self.kind, self._free, self.allocated, self.nbytes = kind, {}, 0, 0

    @staticmethod
    def _key(shape, dtype) -> tuple:
        return tuple(map(int, shape)), np.dtype(dtype).str

    def take(self, shape, dtype):
        free = self._free.get(self._key(shape, dtype))
        if free:
            return free.pop()
        buf = pinned_empty(tuple(shape), dtype, self.kind)
        self.allocated, self.nbytes = self.allocated + 1, self.nbytes + buf.nbytes
        return buf

    def give(self, buf) -> None:
        self._free.setdefault(self._key(buf.shape, arrays.dtype(buf)), []).append(buf)


class Parked:
    """An entry waiting on the host: its pinned buffer; while a copy is under way, the device array
    it reads (source) or writes (device) and its event; the push count when that copy started."""
    __slots__ = ("host", "shape", "dtype", "source", "down", "device", "up", "since")

    def __init__(self, host, shape, dtype):
        self.host, self.shape, self.dtype = host, shape, dtype
        self.source = self.down = self.device = self.up = None
        self.since = 0

    def on_device(self) -> list:
        """The device arrays it holds now (the memory model's fold stack)."""
        return [a for a in (self.source, self.device) if a is not None]


class Parking:
    """One trainer's parking of fold entries of device arrays of `kind` (arrays.CUPY, arrays.SHAPE,
    or numpy for tests); `overlap` as in the module docstring."""

    def __init__(self, kind: str, overlap: bool = True):
        self.kind, self.overlap = kind, overlap
        self.pool = PinnedPool(kind)
        self.pushes = 0                      # values the folds were given: microbatches computed
        self._pending: list[Parked] = []     # parked, the device array still held for its copy
        self._stream = None                  # cupy: the copy stream
        self.moved = dict.fromkeys(("d2h", "d2h overlapped", "h2d", "h2d overlapped"), 0)
        self.copies = dict.fromkeys(self.moved, 0)

    # ---- what the fold calls
    def settle(self) -> None:
        """A value was computed since the last call (a push): the parks' copies that started
        before it are waited for by the compute stream and their device arrays let go."""
        self.pushes += 1
        for p in self._pending:
            self._release(p)
        self._pending = []

    def park(self, a):
        """The entry `a` (device) on its way to a pinned buffer; returns what unpark takes."""
        if not self.overlap:
            self._count("d2h", a.nbytes, False)
            return arrays.to_host(a)
        p = Parked(self.pool.take(a.shape, arrays.dtype(a)), tuple(a.shape), arrays.dtype(a))
        p.source, p.since = a, self.pushes
        if self.kind == arrays.CUPY:
            p.down = copy_down(a, p.host, self._copy_stream())
        elif self.kind == arrays.NUMPY:
            np.copyto(p.host, a)
        self._pending.append(p)
        return p

    def prefetch(self, p) -> None:
        """Start bringing parked entry p back to the device (nothing if under way or blocking)."""
        if not self.overlap or p.device is not None or p.source is not None:
            return
        p.since = self.pushes
        if self.kind == arrays.CUPY:
            from cupy import cuda
            p.device = arrays.module(self.kind).empty(p.shape, p.dtype)       # on the compute stream
            stream = self._copy_stream()
            allocated = cuda.Event()
            allocated.record()
            stream.wait_event(allocated)
            p.device.set(p.host, stream=stream)
            p.up = cuda.Event()
            p.up.record(stream)
        elif self.kind == arrays.NUMPY:
            p.device = p.host.copy()
        else:
            p.device = arrays.module(self.kind).empty(p.shape, p.dtype)

    def unpark(self, p):
        """The parked entry p on the device, ready for the compute stream's next kernel."""
        if not self.overlap:
            self._count("h2d", p.nbytes, False)
            return arrays.from_host(p, self.kind)
        if p.source is not None:             # parked and read before a push: its device copy stands
            self._pending.remove(p)
            a = p.source
            self._release(p)
            self.pool.give(p.host)
            return a
        self.prefetch(p)
        if p.up is not None:
            from cupy import cuda
            cuda.get_current_stream().wait_event(p.up)
        a, p.device, p.up = p.device, None, None
        self._count("h2d", a.nbytes, self.pushes > p.since)
        self.pool.give(p.host)
        return a

    def drain(self) -> None:
        """After the folds were abandoned (an exception): the copies under way end before the fold
        lets go of the arrays they read or write (cupy's pool may hand a freed device block to the
        compute stream's next kernel while a queued copy still writes it); the parks' device arrays
        are let go and their pinned buffers go back to the pool."""
        if self._stream is not None:
            self._stream.synchronize()
        for p in self._pending:
            p.source = p.down = None
            self.pool.give(p.host)
        self._pending = []

    def host_bytes(self) -> int:
        return self.pool.nbytes

    # ---- the copies
    def _release(self, p: Parked) -> None:
        if p.down is not None:
            from cupy import cuda
            cuda.get_current_stream().wait_event(p.down)
        self._count("d2h", p.source.nbytes, self.pushes > p.since)
        p.source = p.down = None

    def _copy_stream(self):
        if self._stream is None:
            from cupy import cuda
            self._stream = cuda.Stream(non_blocking=True)
        return self._stream

    def _count(self, key: str, nbytes: int, overlapped: bool) -> None:
        keys = (key, f"{key} overlapped") if overlapped else (key,)
        for k in keys:
            self.moved[k] += int(nbytes)
            self.copies[k] += 1
        if self.kind == arrays.SHAPE and self.overlap:      # blocking copies count themselves there
            from .shape.ledger import current
            for k in keys:
                current().count(k.replace(" overlapped", "_async"), nbytes)
