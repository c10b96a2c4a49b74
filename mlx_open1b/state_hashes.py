"""Where a step's gradient and state hashes read their bytes, and the thread that hashes them.

A step's ledger record holds the hashes of its gradient, its parameters and its optimizer state
(CONTRACT.md, "Hashes, ledger and checkpoints"): 14 bytes per parameter, read once per step. The
step hands them to one background thread and goes on; the next step computes while they are
hashed, and its record is completed before that step first writes the state (step.PendingHashes).
What makes the hashed bytes the step's own bytes depends on where they live (`HashStage.capture`):

* numpy (the C reference; the emulated CUDA backend): hashed where they are, no copy. Nothing
  writes the parameters or moments from the end of step t until the update of step t+1, and that
  update waits for step t's hashes. The gradient is written only by the clip, which then writes a
  copy while the gradient's hash is still running (`HashStage.writable`).
* cupy: copied into reused pinned host buffers on a copy stream, after an event recorded on the
  stream that computed them (so the copy reads the finished values), asynchronously; the thread
  hashes a buffer once its copy's event has completed. The clip's kernels wait on the copy's event
  (a stream wait, no host block); the update of the next step waits for the hashes, so the copy is
  done before any kernel writes the parameters or moments again. A device buffer stays referenced
  until its copy has completed, so the caching allocator cannot hand its memory to a kernel that
  could overwrite it first.
* mx.array: immutable; a host copy, hashed in the background.
* shape (the memory model): pinned host buffers recorded as the hashes' host bytes; no values.

The thread only reads; every value it returns is a pure function of the bytes, so the hashes, and
every ledger byte, are those of hashing in line.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from . import arrays

# ------------------------------------------------------------------------------- the background thread
_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _forget_after_fork() -> None:        # a forked child has none of the parent's threads
    global _executor, _lock
    _executor, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def submit(fn, *args) -> Future:
    """fn(*args) on the process's one hashing thread (jobs run in the order submitted); its chunks
    go to mlx_open1b.hashing's thread pool as any hash's do."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="open1b-state-hash")
        ex = _executor
    return ex.submit(fn, *args)


def timed(fn, *args):
    """(fn(*args), seconds it took): the background thread's own time, reported beside the step's."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


# ------------------------------------------------------------------------------- where the bytes are read
class Captured:
    """A host array holding a captured buffer's bytes once `wait()` returns (the background thread
    calls it before hashing)."""
    __slots__ = ("host", "_done", "_source")

    def __init__(self, host, done=None, source=None):
        self.host, self._done, self._source = host, done, source

    def wait(self):
        if self._done is not None:
            self._done.synchronize()     # the copy stream's event: the pinned buffer is filled
            self._done = self._source = None     # the device buffer may be reused from now on
        return self.host


class HashStage:
    """One trainer's reused host buffers for the hashes of device arrays (pinned where the kind
    has pinned memory), the copy stream, and the scratch buffer the clip writes on the host while a
    gradient's hash is running (where the step has no gradient pool to take one from: writable).
    A buffer of a role is reused by the next capture of that role: the step settles a role's
    previous hashes before capturing it again."""

    def __init__(self):
        self._host: dict = {}            # role -> host buffer (pinned for cupy and shape)
        self._stream = None              # cupy: the copy stream
        self._events: dict = {}          # role -> cupy event of the role's last copy
        self._scratch = None             # numpy, no pool: what the clip writes while the gradient is hashed

    def capture(self, role: str, a) -> Captured:
        """The bytes of array `a` (C-contiguous) as they are now, for the background thread."""
        k = arrays.kind(a)
        if k == arrays.NUMPY:
            return Captured(a)
        if a.size == 0:                  # a worker that owns nothing
            return Captured(np.empty(a.shape, arrays.dtype(a)))
        if k == arrays.MLX:
            return Captured(arrays.to_host(a))
        if k == arrays.CUPY:
            return self._copy_async(role, a)
        if k == arrays.SHAPE:
            buf = self._buffer(role, a, k)
            a._buf.ledger.count("d2h", a.nbytes)
            a._buf.ledger.count("d2h_async", a.nbytes)      # on the copy stream, under the next step
            return Captured(buf)
        raise ValueError(f"cannot capture an array of kind {k!r} for hashing")

    def writable(self, role: str, a, hashing: Future | None, take=None):
        """An array with the values of `a` that may be written in place while the hash of its
        capture under `role` may still be reading: `a` itself unless that hash reads `a`'s own
        memory and has not finished (numpy: then a copy, into take() where given, e.g. a free
        buffer of the trainer's gradient pool, else into this stage's reused buffer); on cupy the
        current stream first waits for the capture's copy."""
        k = arrays.kind(a)
        if k == arrays.CUPY:
            ev = self._events.get(role)
            if ev is not None:
                from cupy import cuda
                cuda.get_current_stream().wait_event(ev)
            return a
        if k != arrays.NUMPY or hashing is None or hashing.done():
            return a
        if take is not None:
            out = take()
            np.copyto(out, a)
            return out
        if self._scratch is None or self._scratch.shape != a.shape or self._scratch.dtype != a.dtype:
            self._scratch = np.empty_like(a)
        np.copyto(self._scratch, a)
        return self._scratch

    def host_bytes(self) -> int:
        """Bytes of the reused host buffers (pinned for device arrays)."""
        return sum(b.nbytes for b in self._host.values()) + (0 if self._scratch is None else self._scratch.nbytes)

    def _buffer(self, role: str, a, k: str):
        shape, dt = tuple(a.shape), arrays.dtype(a)
        buf = self._host.get(role)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dt:
            self._host[role] = None            # the old buffer goes before the new one is allocated
            buf = self._host[role] = pinned_empty(shape, dt, k)
        return buf

    def _copy_async(self, role: str, a) -> Captured:
        from cupy import cuda
        buf = self._buffer(role, a, arrays.CUPY)
        if self._stream is None:
            self._stream = cuda.Stream(non_blocking=True)
        done = self._events[role] = copy_down(a, buf, self._stream)
        return Captured(buf, done, a)


def copy_down(a, buf, stream):
    """Queue the copy of cupy array `a` into pinned host buffer `buf` on `stream`, after the kernels
    the current stream has queued so far (those that wrote `a`); returns the event of its end."""
    from cupy import cuda
    written = cuda.Event()
    written.record()                       # on the current stream: after the kernels that wrote `a`
    stream.wait_event(written)
    try:
        a.get(stream=stream, out=buf, blocking=False)
    except TypeError:                      # CuPy before `blocking`: a copy on a given stream is asynchronous
        a.get(stream=stream, out=buf)
    done = cuda.Event()
    done.record(stream)
    return done


def pinned_empty(shape, dtype, kind: str):
    """A host array for the device->host copies of arrays of `kind`: page-locked memory for cupy
    (a copy into it can be asynchronous), a host buffer tagged as pinned for the shape kind."""
    if kind == arrays.CUPY:
        import cupyx
        return cupyx.empty_pinned(shape, dtype)
    if kind == arrays.SHAPE:
        from .shape import array as shape_array
        return shape_array.empty_pinned(shape, dtype)
    return np.empty(shape, dtype)
