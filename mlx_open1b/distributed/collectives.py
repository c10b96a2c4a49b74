"""Deterministic collectives: torch.distributed moves bytes, our kernels do every sum.

Only data-movement primitives touch training values: all_to_all_single (the gradient
reduce-scatter), broadcast (the parameter all-gather, one owner's range at a time, and the state at
start-up), send/recv (state at start-up and checkpoints), all_gather_object (hashes, small records). Arrays
travel as raw bytes (a uint8 view of the buffer, handed to torch without a copy: torch.from_numpy
for a numpy array, DLPack for a cupy array, which stays on its GPU for NCCL), so no library ever
interprets, converts or adds them; NCCL's and gloo's own reductions are never used. Every
collective returns (or writes) arrays of the kind it was given, numpy or cupy.

The reductions themselves are pure functions, testable without a process group:

* `owner_fold`: the owner of a parameter range receives, from every worker, the partials of that
  worker's aligned dyadic microbatch blocks (sharding.dyadic_blocks), restricted to its range, in
  whatever order they arrive. It sorts them by microbatch index and pushes them, each at its
  block's level, into the binary-carry tree fold of CONTRACT.md §7 — the same tree, so the same
  bits, as folding the M microbatch gradients on one device (elementwise adds on a slice give the
  slice of the elementwise adds).
* `norm_from_partials`: the global gradient norm from the per-tensor block partials of §7,
  gathered from the owners and concatenated in canonical tensor order.

Phases (`Comm.phase`): opening the run, writing a checkpoint (rank 0 writes what every owner
streams to it in turn) and held-out evaluation take longer than a step's collectives — minutes at
the open1b preset, past the collective timeout (--dist-timeout, 120 s) of a rank that would wait for
them in a collective. So nobody waits in a collective: the working ranks bump a heartbeat counter
in the process group's key-value store (torchrun's TCPStore) from a thread, and mark their phase
done when they finish; the others poll the store. A working rank whose heartbeat stops for the
collective timeout is reported lost (a dead rank 0 is still detected within --dist-timeout, as in
a collective); one that is alive but not done by the phase's own deadline (phases.py: derived from
the phase's size, configurable) is reported too slow, naming the phase and the rank. Only then does
everyone enter the collective that follows, which takes its usual short time. Within a phase a rank
can wait its turn (`await_turn`) under the same watch, e.g. to send its range to the writer.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import threading
import time
from typing import Iterable, Sequence

import numpy as np

from .. import arrays
from ..errors import Open1bError
from ..step import TreeFold, norm_from_partials  # noqa: F401  (norm_from_partials re-exported)
from .sharding import Shard

class DistError(Open1bError, RuntimeError):
    """The process group cannot be set up (missing or failed rendezvous); exit_code for the CLI."""


class CommError(RuntimeError):
    """A collective failed: a peer died, closed its connection or did not answer within the
    timeout. `op` names the collective, `cause` the transport's message (first line)."""

    def __init__(self, op: str, cause: BaseException):
        self.op = op
        msg = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        msg = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", msg)            # gloo's source location
        self.cause = msg.split(" This is typically caused by")[0]               # and its generic advice
        super().__init__(f"{op}: {self.cause}")


# ----------------------------------------------------------------------------- pure reductions
def owner_fold(parts: Iterable[tuple[int, int, np.ndarray]], M: int, add_inplace) -> np.ndarray:
    """The tree fold (CONTRACT.md §7) over microbatch index 0 … M-1 from block partials
    (start, level, array), given in any order: each stands for the 2^level microbatches from
    `start` (a multiple of 2^level) already folded by the same tree. The blocks must tile
    [0, M). Arrays are modified in place (the lower-index operand accumulates)."""
    parts = sorted(parts, key=lambda p: p[0])
    nxt = 0
    for start, level, _ in parts:
        if start != nxt or level < 0 or start % (1 << level):
            raise ValueError(f"owner_fold: block ({start}, level {level}) does not continue an aligned tiling "
                             f"of microbatches at {nxt} (of {M})")
        nxt += 1 << level
    if nxt != M or not parts:
        raise ValueError(f"owner_fold: the blocks cover microbatches 0-{nxt - 1}, the step has {M}")
    fold = TreeFold(add_inplace)
    for _, level, a in parts:
        fold.push(a, level)
    return fold.result()


def route(parts: Sequence[np.ndarray], shards: Sequence[Shard]) -> tuple[np.ndarray, list[int]]:
    """The all-to-all send buffer: for each owner in rank order, its slice of each partial in
    block order; and the element count sent to each owner."""
    pieces = [p[sh.lo:sh.hi] for sh in shards for p in parts]
    send = arrays.concat(pieces) if pieces else np.zeros(0, np.float32)
    return send, [len(parts) * sh.size for sh in shards]


# ----------------------------------------------------------------------------- the transport
def load_torch():
    """torch, with torch.distributed, imported when a process group is first set up or used: an
    optional dependency (the `torch` extra) that takes seconds to import, so this package imports
    without it."""
    import torch
    import torch.distributed  # noqa: F401  (bound as torch.distributed)
    return torch


def _xp(a):
    """The array module of a's kind: cupy for a cupy array, numpy otherwise."""
    return arrays.module(arrays.CUPY) if arrays.kind(a) == arrays.CUPY else np


def _as_bytes(a):
    """A torch uint8 tensor sharing the memory of a C-contiguous array: torch.from_numpy for numpy,
    DLPack for cupy (a CUDA tensor on the array's device)."""
    torch = load_torch()
    k = arrays.kind(a)
    if k not in (arrays.NUMPY, arrays.CUPY):
        raise ValueError(f"collectives move numpy or cupy arrays, got {type(a).__module__}.{type(a).__name__} "
                         "(move an mx.array with mlx_open1b.arrays.to_host)")
    if not a.flags.c_contiguous:
        raise ValueError("collectives move C-contiguous arrays only")
    if k == arrays.CUPY:
        return torch.from_dlpack(a.reshape(-1).view(arrays.module(arrays.CUPY).uint8))
    return torch.from_numpy(a.reshape(-1).view(np.uint8))


class _Heartbeat:
    """A thread that bumps a counter in the store every `every` seconds while its rank works alone
    (threads run while the main thread hashes or writes: hashlib and file I/O release the GIL)."""

    def __init__(self, store, key: str, every: float):
        self.store, self.key, self.every = store, key, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="open1b-heartbeat", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the waiting ranks notice the silence
                return
            if self._stop.wait(self.every):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()       # the store is the main thread's again before the next collective


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Comm:
    """The process group, as byte-moving collectives on numpy or cupy arrays (results in the kind
    given). Every call either returns or raises CommError; `seconds` accumulates the time spent
    inside collectives (waiting included). phase_hook(rank, what), when given, runs at the end of
    every phase this rank works in, inside its heartbeat (tests make a rank slow or die there)."""

    def __init__(self, rank: int, world: int, local_rank: int = 0, local_world: int = 1, device: str = "cpu",
                 backend: str = "gloo", timeout_s: float = 120.0, phase_hook=None):
        self.rank, self.world = rank, world
        self.phase_hook = phase_hook
        self.local_rank, self.local_world = local_rank, local_world
        self.device, self.backend, self.timeout_s = device, backend, timeout_s
        self.seconds = 0.0
        self.calls = 0
        self._store = None
        self._phases_done = [0] * world     # phases each rank has worked in so far (the same on every rank)
        self._turns = 0                     # turns this rank has been given (await_turn)
        self._deadline = None               # (phase, start, timeout s or None) of the phase this rank is in

    # ---- setting up
    @classmethod
    def init_from_env(cls, compute_backend: str = "cpu_ref", timeout_s: float = 120.0, phase_hook=None) -> "Comm":
        """Join the process group described by torchrun's environment (RANK, WORLD_SIZE,
        MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE): NCCL when the compute backend is
        cuda and torch sees a GPU, gloo otherwise."""
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise DistError(f"rendezvous: environment variable{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                            f"not set; start the workers with torchrun (or `open1b train --nproc N`)")
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        except ValueError as e:
            raise DistError(f"rendezvous: malformed worker environment ({e})") from None
        if not (world >= 1 and 0 <= rank < world):
            raise DistError(f"rendezvous: RANK {rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE {world})")
        torch = load_torch()
        dist = torch.distributed
        if not dist.is_available():
            raise DistError("this torch build has no torch.distributed")
        device, backend = "cpu", "gloo"
        if compute_backend == "cuda" and torch.cuda.is_available():
            backend, device = "nccl", f"cuda:{local_rank % torch.cuda.device_count()}"
            torch.cuda.set_device(torch.device(device))
        elif not dist.is_gloo_available():
            raise DistError("this torch build has no gloo backend (needed for CPU workers)")
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=float(timeout_s)))
        except Exception as e:  # noqa: BLE001 - every rendezvous failure becomes one clear error
            raise DistError(f"rendezvous at {where} failed for rank {rank} of {world} workers within "
                            f"{timeout_s:g} s ({backend}): {CommError('init', e).cause}") from None
        return cls(rank, world, local_rank, local_world, device, backend, timeout_s, phase_hook)

    def close(self) -> None:
        dist = load_torch().distributed
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- work some ranks do alone, without a collective timeout
    def _kv(self):
        """The process group's key-value store (torchrun's TCPStore), under a prefix of ours."""
        if self._store is None:
            dist = load_torch().distributed
            self._store = dist.PrefixStore("open1b/phase/", dist.distributed_c10d._get_default_store())
        return self._store

    @contextlib.contextmanager
    def phase(self, what: str, busy: Sequence[int] = (0,), timeout: float | None = None):
        """A stretch of work only the `busy` ranks do (every rank enters it, in the same order, with
        the same `busy`): the busy ranks run the body with a heartbeat; on leaving, every rank waits
        until every busy rank has finished, as long as each unfinished one shows a heartbeat within
        timeout_s and the phase is younger than `timeout` seconds (phases.PhaseTimeouts; None: no
        deadline), else CommError naming the phase and the rank. Then the collective that follows
        meets every rank on time. Inside the body, a rank can wait its turn (await_turn) for one
        that gives it (give_turn), under the same watch."""
        busy = sorted(set(int(r) for r in busy))
        if self.world == 1:
            yield
            return
        for r in busy:
            self._phases_done[r] += 1
        self._deadline = (what, time.perf_counter(), timeout)
        try:
            if self.rank in busy:
                ok = False
                try:
                    with _Heartbeat(self._kv(), f"beat/{self.rank}", self._beat_every()):
                        yield
                        if self.phase_hook is not None:
                            self.phase_hook(self.rank, what)
                    ok = True
                finally:                # done, failed or not: a failure travels in the collective that follows
                    try:
                        self._kv().add(f"done/{self.rank}", 1)
                    except Exception as e:  # noqa: BLE001
                        if ok:
                            raise CommError(f"finishing {what}", e) from None
            else:
                yield
            self._wait_for({r: (f"done/{r}", self._phases_done[r]) for r in busy if r != self.rank}, "finish")
        finally:
            self._deadline = None

    def give_turn(self, rank: int) -> None:
        """Inside a phase: let `rank`, waiting in await_turn, go on (e.g. send what this rank is now
        ready to receive)."""
        try:
            self._kv().add(f"turn/{rank}", 1)
        except Exception as e:  # noqa: BLE001
            raise CommError(f"giving rank {rank} its turn ({self._deadline[0] if self._deadline else 'no phase'})",
                            e) from None

    def await_turn(self, src: int) -> None:
        """Inside a phase (busy on this rank and on src): wait until src gives this rank its next
        turn, for as long as src's heartbeat goes on and the phase's deadline allows — so waiting
        behind other ranks' turns never meets a transport timeout."""
        self._turns += 1
        self._wait_for({src: (f"turn/{self.rank}", self._turns)}, "give rank " + str(self.rank) + " its turn in")

    def _beat_every(self) -> float:
        return min(5.0, max(0.05, self.timeout_s / 8))

    def _wait_for(self, want: dict, doing: str) -> None:
        """Poll until, for each rank r in `want` ({r: (store counter, value)}), the counter reaches
        its value; a rank whose heartbeat counter does not move for timeout_s is lost, one that has
        not arrived by the phase's deadline is too slow."""
        what, began, limit = self._deadline
        t0 = time.perf_counter()
        poll = min(1.0, max(0.02, self.timeout_s / 16))
        seen = {r: (None, t0) for r in want}          # rank -> (last heartbeat count, when it changed)
        try:
            while seen:
                now = time.perf_counter()
                for r in list(seen):
                    op = f"waiting for rank {r} ({what})"
                    key, value = want[r]
                    try:
                        if self._kv().add(key, 0) >= value:
                            del seen[r]
                            continue
                        beat = self._kv().add(f"beat/{r}", 0)
                    except Exception as e:  # noqa: BLE001 - the store is gone with its host
                        raise CommError(op, e) from None
                    last, since = seen[r]
                    if beat != last:
                        seen[r] = (beat, now)
                    elif now - since > self.timeout_s:
                        raise CommError(op, TimeoutError(
                            f"no heartbeat from rank {r} for {self.timeout_s:g} s (it died, or its host did)"))
                    # past the deadline and beating (a silent rank is left to the heartbeat rule above)
                    beating = now - seen[r][1] <= 2 * (self._beat_every() + poll)
                    if limit is not None and now - began > limit and beating:
                        raise CommError(op, TimeoutError(
                            f"rank {r} did not {doing} {what} within the phase's timeout of {limit:.0f} s (alive: "
                            f"its heartbeat goes on; a hung disk or device? a slow one: raise --phase-timeout-scale)"))
                if seen:
                    time.sleep(poll)
        finally:
            self.seconds += time.perf_counter() - t0

    # ---- plumbing
    def _call(self, op: str, fn):
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a collective's failure is a lost worker or a timeout
            raise CommError(op, e) from None
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def _dev(self, t):
        """t on the process group's device: t itself when it is there already (a numpy buffer on
        gloo, a cupy buffer on this worker's GPU with NCCL), else a copy (_back writes it back)."""
        return t if str(t.device) == self.device else t.to(self.device)

    def _back(self, host, dev) -> None:
        if dev is not host:
            host.copy_(dev.cpu())

    # ---- collectives on arrays
    def all_to_all(self, send: np.ndarray, send_counts: Sequence[int], recv_counts: Sequence[int]) -> np.ndarray:
        """Element counts per peer (rank order); returns the received elements, by source rank."""
        dist = load_torch().distributed
        xp = _xp(send)
        item = send.dtype.itemsize
        recv = xp.empty(int(sum(recv_counts)), send.dtype)
        si, ro = _as_bytes(xp.ascontiguousarray(send)), _as_bytes(recv)

        def run():
            di, do = self._dev(si), self._dev(ro)
            dist.all_to_all_single(do, di, [int(c) * item for c in recv_counts], [int(c) * item for c in send_counts])
            self._back(ro, do)
        self._call("all_to_all_single", run)
        return recv

    def all_gather_into(self, buf: np.ndarray, counts: Sequence[int]) -> None:
        """An all-gather in place, without padding: `buf` (sum(counts) elements, the same layout on
        every rank) holds this rank's counts[rank] elements at offset sum(counts[:rank]); on return
        it holds every rank's, each written straight into its place. Pieces of unequal size, so
        one broadcast per rank that owns any (all_gather_into_tensor wants equal pieces, which
        padding would give at the cost of a world x widest buffer and a copy out of it)."""
        dist = load_torch().distributed
        if len(buf) != sum(int(c) for c in counts) or len(counts) != self.world:
            raise ValueError(f"all_gather_into: a buffer of {len(buf)} elements for counts of {len(counts)} ranks "
                             f"summing to {sum(int(c) for c in counts)}")
        off = 0
        for r, c in enumerate(int(c) for c in counts):
            if c:
                b = _as_bytes(buf[off:off + c])

                def run(b=b, r=r):
                    d = self._dev(b)
                    dist.broadcast(d, r)
                    self._back(b, d)
                self._call(f"all_gather (rank {r}'s range, broadcast)", run)
            off += c

    def broadcast(self, arr: np.ndarray, src: int = 0) -> None:
        """arr (same shape and dtype everywhere) takes src's contents, in place."""
        dist = load_torch().distributed
        b = _as_bytes(arr)

        def run():
            d = self._dev(b)
            dist.broadcast(d, src)
            self._back(b, d)
        self._call("broadcast", run)

    def send(self, arr: np.ndarray, dst: int) -> None:
        dist = load_torch().distributed
        b = _as_bytes(_xp(arr).ascontiguousarray(arr))
        self._call(f"send to rank {dst}", lambda: dist.send(self._dev(b), dst))

    def recv(self, out: np.ndarray, src: int) -> None:
        """Receive into `out` (a C-contiguous array or view; written in place)."""
        dist = load_torch().distributed
        b = _as_bytes(out)

        def run():
            d = self._dev(b)
            dist.recv(d, src)
            self._back(b, d)
        self._call(f"receive from rank {src}", run)

    # ---- small Python objects (hashes, records, status)
    def all_gather_object(self, obj) -> list:
        dist = load_torch().distributed
        out = [None] * self.world
        self._call("all_gather_object", lambda: dist.all_gather_object(out, obj))
        return out

    def broadcast_object(self, obj, src: int = 0):
        dist = load_torch().distributed
        box = [obj if self.rank == src else None]
        self._call("broadcast_object", lambda: dist.broadcast_object_list(box, src))
        return box[0]
