"""The memory ledger of a shape-only run: every allocation and free of one worker's arrays.

One `MemoryLedger` per simulated worker (the thread that runs it activates it): live bytes and their
peak on the device and on the host, bytes moved host<->device and over the network, and at each new
device peak a breakdown of the live bytes by owner:

  params, moments      the trainer's state arrays (registered roots)
  fold stack           arrays held by a TreeFold (the microbatch or owner fold): its entries on the
                       device, parked entries' copies under way (TreeFold.held)
  activations          arrays held by a model Cache (what the backward reads)
  gradients            a gradient buffer being written (arrays.FlatBuffer), a run's partial, the
                       step's gradient
  communication        buffers the collectives allocate (send, receive, gather, padding)
  constants            registered long-lived arrays (RoPE tables)
  transients           everything else (op outputs on their way, op scratch)

The owners of fold stack and activations are found by what references an array (the frames of the
running thread are walked for TreeFold and Cache objects), the others by where the memory was asked
for (the "site": the first code outside this package, and the backend op it called), so the
breakdown needs no tags in the code it measures. On the host the owner is the site. A breakdown costs a walk over the live arrays, so it is taken when the peak grows
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


COUNTED_COPY = 1 << 18     # bytes: a copy this size or more is counted in moved["h2d_n"] etc.
OPS_MODULE = _HERE + ".cuda_ops"        # the CUDA backend's op code as this package loads it (ops.py)
_SKIP = (_HERE, "mlx_open1b.derived_ops")
GRADIENT_SITE = "arrays.FlatBuffer"
UNPARKED = ("step._microbatches", "parking.")    # partials brought back from the host (step.py, parking.py)


def _site(frame, place: str) -> str:
    """Who asked for memory: 'caller/op' (the op of the backend, the first code outside the backend
    that called it); on the host the caller of arrays.to_host."""
    codes, f = [], frame
    while f is not None and len(codes) < 12:        # the key: the code objects up the stack
        codes.append(f.f_code)
        f = f.f_back
    key = (place, tuple(codes))
    site = _SITES.get(key)
    if site is None:
        site = _SITES[key] = _site_of(frame, place)
    return site


_SITES: dict = {}


def _site_of(frame, place: str) -> str:
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


#: The classes whose instances own "fold stack" and "activations" memory (step.TreeFold, model.Cache).
#: shape.run fills them in: shape arrays import this module, so it imports nothing of the model.
OWNER_TYPES: dict[str, tuple] = {"fold stack": (), "activations": ()}


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
        # h2d, d2h: bytes copied, of them *_async on a copy stream under later compute; *_n: copies
        # of at least COUNTED_COPY bytes (not the many small uploads: kernel placeholders, windows)
        self.moved = {"h2d": 0, "d2h": 0, "h2d_async": 0, "d2h_async": 0, "h2d_n": 0, "d2h_n": 0,
                      "h2d_async_n": 0, "d2h_async_n": 0, "net_out": 0, "net_in": 0, "net_objects": 0,
                      "gather_out": 0, "gather_in": 0}
        self.allocs = 0
        self.roots: list = []
        self.tag: str | None = None
        self.trace: list | None = None      # events, while a call is recorded (replay.py)
        self.site: str | None = None

    # ---- recording
    def alloc(self, nbytes: int, place: str) -> int:
        frame = sys._getframe(2)
        site = self.site or _site(frame, place)
        with self._lock:
            self._serial += 1
            serial = self._serial
            self.live[serial] = Alloc(int(nbytes), place, self.tag, site)
            self.allocs += 1
            if self.trace is not None:
                self.trace.append(("alloc", serial, int(nbytes), place, self.tag, site, _where(frame)))
            b = self.bytes[place] = self.bytes[place] + int(nbytes)
            if b > self.peak[place]:
                self._new_peak(place, b, frame, (), None)
        return serial

    def _new_peak(self, place: str, b: int, frame, extra, where) -> None:
        self.peak[place] = b
        snap = self.breakdown[place]
        if b > snap.bytes * (1 + self.resolution):
            self.breakdown[place] = self._snapshot(place, frame, extra, where)
        else:
            snap.after = b - snap.bytes

    def burst(self, place: str, high: int, extra, where: str) -> None:
        """A replayed call whose allocations rose `high` bytes above the live bytes now, at a point
        where they were `extra` (Allocs) at call path `where`, and were freed again."""
        with self._lock:
            b = self.bytes[place] + high
            if b > self.peak[place]:
                self._new_peak(place, b, sys._getframe(1), extra, where)

    def free(self, serial: int) -> None:
        with self._lock:
            if self.trace is not None:
                self.trace.append(("free", serial))
            a = self.live.pop(serial, None)
            if a is not None:
                self.bytes[a.place] -= a.nbytes

    def count(self, key: str, nbytes: int) -> None:
        with self._lock:
            if self.trace is not None:
                self.trace.append(("count", key, int(nbytes)))
            self.moved[key] += int(nbytes)
            if key + "_n" in self.moved and nbytes >= COUNTED_COPY:
                self.moved[key + "_n"] += 1

    def reset(self) -> None:
        """Start a new measurement: peaks from the live bytes now, traffic from zero."""
        with self._lock:
            for p in (DEVICE, HOST):
                self.peak[p] = self.bytes[p]
                self.breakdown[p] = self._snapshot(p, sys._getframe(1))
            self.moved = dict.fromkeys(self.moved, 0)

    @contextlib.contextmanager
    def tagged(self, tag: str | None = None, site: str | None = None):
        """Allocations inside are tagged (the collectives' buffers: "communication"), or given a
        site (a replayed allocation: the site it had when recorded)."""
        old = self.tag, self.site
        self.tag, self.site = tag or self.tag, site or self.site
        try:
            yield
        finally:
            self.tag, self.site = old

    def activate(self) -> "MemoryLedger":
        """Make this the ledger of the calling thread's allocations."""
        _current.ledger = self
        return self

    # ---- breakdowns
    def _owners_by_reference(self, frame) -> dict[int, str]:
        fold_types, cache_types = OWNER_TYPES["fold stack"], OWNER_TYPES["activations"]
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
                if isinstance(v, fold_types):
                    folds.append(v)
                elif isinstance(v, cache_types):
                    caches.append(v)
            if f.f_code.co_flags & inspect.CO_OPTIMIZED:
                # a function frame's f_locals is a snapshot the frame keeps: left filled, it would
                # hold arrays the function has dropped (and so change the live bytes measured)
                loc.clear()
            del loc
            f = f.f_back
        for fold in folds:
            for a in fold.held():
                mark("fold stack", a)
        for c in caches:
            for a in cache_arrays(c):
                mark("activations", a)
        return marks

    def _snapshot(self, place: str, frame, extra=(), where: str | None = None) -> Peak:
        marks = self._owners_by_reference(frame) if place == DEVICE else {}
        owners, sites, total = {}, {}, self.bytes[place]
        allocs = [(marks.get(serial), a) for serial, a in self.live.items() if a.place == place]
        allocs += [(None, a) for a in extra]
        total += sum(a.nbytes for a in extra)
        for owner, a in allocs:
            if a.tag == "activations":
                owner = owner or "activations"
            if owner in (None, "fold stack", "activations") and (a.tag == "communication"
                                                                or a.site.startswith("collectives.")):
                owner = "communication"
            if owner is None:
                owner = "gradients" if a.site == GRADIENT_SITE or a.site.startswith(UNPARKED) else "transients"
            if place == HOST:
                owner = a.tag or a.site
            owners[owner] = owners.get(owner, 0) + a.nbytes
            if owner == "transients":
                sites[a.site] = sites.get(a.site, 0) + a.nbytes
        return Peak(total, owners, sites, where or _where(frame))


def cache_arrays(cache):
    """The shape arrays a model Cache holds (what the backward reads)."""
    for a in (cache.x0, cache.rstd_emb, cache.h_last, cache.rstd_final, cache.hn_b, cache.lse, cache.inputs,
              cache.targets, *(v for lc in cache.layers for v in (vars(lc).values() if hasattr(lc, "__dict__")
                                                                  else (lc,)))):    # a block's input alone
        if getattr(a, "_buf", None) is not None:
            yield a


class _Current(threading.local):
    ledger: MemoryLedger | None = None


_current = _Current()
_default = MemoryLedger("unattributed")


def current() -> MemoryLedger:
    """The calling thread's ledger (one that collects what no worker claimed, if none is active)."""
    return _current.ledger or _default
