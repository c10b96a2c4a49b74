"""The memory ledger of a shape-only run: every allocation and free of one worker's arrays.

One `MemoryLedger` per simulated worker (the thread that runs it activates it): live bytes and their
peak on the device and on the host, bytes moved host<->device and over the network, and at each new
device peak a breakdown of the live bytes by owner:

  params, moments      the trainer's state arrays (registered roots)
  fold stack           arrays held in a TreeFold's stack (the microbatch or owner fold)
  activations          arrays held by a model Cache (what the backward reads)
  gradients            a gradient buffer being written (arrays.FlatBuffer) or the step's gradient
  communication        buffers the collectives allocate (send, receive, gather, padding)
  constants            registered long-lived arrays (RoPE tables)
  transients           everything else (op outputs on their way, op scratch)

The owners of fold stack and activations are found by what references an array (the frames of the
running thread are walked for TreeFold and Cache objects), so the breakdown needs no tags in the
code it measures. A breakdown costs a walk over the live arrays, so it is taken when the peak grows
by more than `resolution` (a fraction); the peak itself is exact, and the breakdown says how much
the peak grew after it was taken (`after`).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from dataclasses import dataclass, field

DEVICE, HOST = "device", "host"
OWNERS = ("params", "moments", "gradients", "fold stack", "activations", "communication", "constants",
          "transients")

_HERE = __name__.rsplit(".", 1)[0]          # mlx_open1b.shape: frames of this package are not sites


@dataclass
class Alloc:
    nbytes: int
    place: str
    tag: str | None            # "communication" for the collectives' buffers, else None
    site: str                  # module.function that asked for the memory


@dataclass
class Peak:
    """Live bytes at a peak and what they are: {owner: bytes}, the biggest transient sites, and the
    call path where the peak was reached (take_step downwards)."""
    bytes: int = 0
    owners: dict = field(default_factory=dict)
    sites: dict = field(default_factory=dict)
    where: str = ""
    after: int = 0             # bytes the peak grew after this breakdown was taken


OPS_MODULE = _HERE + ".cuda_ops"        # the CUDA backend's op code as this package loads it (ops.py)
_SKIP = (_HERE, "mlx_open1b.derived_ops")
GRADIENT_SITE = "arrays.FlatBuffer"


def _site(frame, place: str) -> str:
    """Who asked for memory: 'caller/op' (the op of the backend, the first code outside the backend
    that called it); on the host the caller of arrays.to_host."""
    op = None
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        name = frame.f_code.co_name
        if mod == OPS_MODULE:
            if not name.startswith("_"):
                op = name
        elif mod == "mlx_open1b.arrays" and name == "__init__":
            return GRADIENT_SITE        # a FlatBuffer: the gradient buffer the model program writes
        elif not mod.startswith(_SKIP) and mod != "mlx_open1b.arrays":
            caller = f"{mod.rsplit('.', 1)[-1]}.{name}"
            return caller if op is None else f"{caller}/{op}"
        frame = frame.f_back
    return "?" if op is None else op


_STAGES = ("take_step", "compute_step")


def _where(frame) -> str:
    """The call path from take_step down to the allocation (functions of this package left out)."""
    names = []
    while frame is not None:
        name = frame.f_code.co_name
        if not frame.f_globals.get("__name__", "").startswith(_SKIP):
            names.append(name)
        if name in _STAGES:
            break
        frame = frame.f_back
    return " > ".join(reversed(names))


class MemoryLedger:
    """One worker's allocations. `roots`: [(owner, fn() -> arrays)] evaluated at each breakdown."""

    def __init__(self, name: str = "", resolution: float = 0.002):
        self.name, self.resolution = name, resolution
        self._lock = threading.RLock()
        self._serial = 0
        self.live: dict[int, Alloc] = {}
        self.bytes = {DEVICE: 0, HOST: 0}
        self.peak = {DEVICE: 0, HOST: 0}
        self.breakdown = {DEVICE: Peak(), HOST: Peak()}
        self.moved = {"h2d": 0, "d2h": 0, "net_out": 0, "net_in": 0}
        self.allocs = 0
        self.roots: list = []
        self.tag: str | None = None

    # ---- recording
    def alloc(self, nbytes: int, place: str) -> int:
        frame = sys._getframe(2)
        with self._lock:
            self._serial += 1
            serial = self._serial
            self.live[serial] = Alloc(int(nbytes), place, self.tag, _site(frame, place))
            self.allocs += 1
            b = self.bytes[place] = self.bytes[place] + int(nbytes)
            if b > self.peak[place]:
                self.peak[place] = b
                snap = self.breakdown[place]
                if b > snap.bytes * (1 + self.resolution):
                    self.breakdown[place] = self._snapshot(place, frame)
                else:
                    snap.after = b - snap.bytes
        return serial

    def free(self, serial: int) -> None:
        with self._lock:
            a = self.live.pop(serial, None)
            if a is not None:
                self.bytes[a.place] -= a.nbytes

    def count(self, key: str, nbytes: int) -> None:
        with self._lock:
            self.moved[key] += int(nbytes)

    def reset(self) -> None:
        """Start a new measurement: peaks from the live bytes now, traffic from zero."""
        with self._lock:
            for p in (DEVICE, HOST):
                self.peak[p] = self.bytes[p]
                self.breakdown[p] = self._snapshot(p, sys._getframe(1))
            self.moved = dict.fromkeys(self.moved, 0)

    @contextlib.contextmanager
    def tagged(self, tag: str):
        """Allocations inside are tagged (the collectives' buffers: "communication")."""
        old, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = old

    def activate(self) -> "MemoryLedger":
        """Make this the ledger of the calling thread's allocations."""
        _current.ledger = self
        return self

    # ---- breakdowns
    def _owners_by_reference(self, frame) -> dict[int, str]:
        from ..model import Cache
        from ..step import TreeFold
        marks: dict[int, str] = {}

        def mark(owner, a):
            buf = getattr(a, "_buf", None)
            if buf is not None and buf.ledger is self:
                marks.setdefault(buf.serial, owner)

        for owner, fn in self.roots:
            for a in fn():
                mark(owner, a)
        folds, caches = [], []
        f = frame
        while f is not None:
            loc = f.f_locals
            for v in loc.values():
                if isinstance(v, TreeFold):
                    folds.append(v)
                elif isinstance(v, Cache):
                    caches.append(v)
            if f.f_code.co_flags & inspect.CO_OPTIMIZED:
                # a function frame's f_locals is a snapshot the frame keeps: left filled, it would
                # hold arrays the function has dropped (and so change the live bytes measured)
                loc.clear()
            del loc
            f = f.f_back
        for fold in folds:
            for _, a in fold.stack:
                mark("fold stack", a)
        for c in caches:
            for a in (c.x0, c.rstd_emb, c.h_last, c.rstd_final, c.hn_b, c.lse, c.inputs, c.targets):
                mark("activations", a)
            for lc in c.layers:
                for a in vars(lc).values():
                    mark("activations", a)
        return marks

    def _snapshot(self, place: str, frame) -> Peak:
        marks = self._owners_by_reference(frame) if place == DEVICE else {}
        owners, sites = {}, {}
        for serial, a in self.live.items():
            if a.place != place:
                continue
            owner = marks.get(serial)
            if owner in (None, "fold stack", "activations") and (a.tag == "communication"
                                                                or a.site.startswith("collectives.")):
                owner = "communication"
            if owner is None:
                owner = "gradients" if a.site == GRADIENT_SITE else "transients"
            if place == HOST:
                owner = a.tag or a.site
            owners[owner] = owners.get(owner, 0) + a.nbytes
            if owner == "transients":
                sites[a.site] = sites.get(a.site, 0) + a.nbytes
        return Peak(self.bytes[place], owners, sites, _where(frame))


class _Current(threading.local):
    ledger: MemoryLedger | None = None


_current = _Current()
_default = MemoryLedger("unattributed")


def current() -> MemoryLedger:
    """The calling thread's ledger (one that collects what no worker claimed, if none is active)."""
    return _current.ledger or _default
