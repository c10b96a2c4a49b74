"""The training step of CONTRACT.md §12, written once for one process and for N workers.

A step (0-based index t) is a pure function of the state after step t-1 and the canonical data
stream (CONTRACT.md §7, §10):
  1. M microbatches of the step's windows (the phase's M, by consumed tokens);
  2. per microbatch: loss and gradient (the model program); the step's gradient is the tree fold
     of the microbatch gradients over microbatch index, times the reciprocal 1/M; the loss the same;
  3. the pre-clip global norm; the spike protocol; clipping at clip_norm;
  4. AdamW with the token-anchored learning rate (weight decay on linear layers and the LM head);
  5. a ledger record with the batch, gradient, parameter and optimizer-state hashes (the last three
     computed in the background while the next step computes: PendingHashes, state_hashes.py).

What one process and N workers do differently is a reducer's (`Reduce`): which microbatches this
process computes (each run of them folded into one partial by the tree fold), how the partials meet
in the step's fold over microbatch index, which elements of the parameter buffer this process
owns (it clips and updates only those; a range may cut a tensor) and how the per-microbatch
scalars, tensor hashes (or a cut tensor's Merkle leaves) and norm partials reach every process. `LocalReduce` is one process: every microbatch in one fold, every tensor its own, nothing
to move. The workers' reducer (distributed/reduce.py) only moves bytes; every add, product and
decision is made here, in the same order at any worker count, so the bits are the same.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Iterator, Protocol

import numpy as np

from . import arrays, hashing
from .errors import Open1bError
from .hostmath import f32, reciprocal
from .parking import Parked, Parking
from .state_hashes import HashStage, submit, timed


class TrainError(Open1bError, RuntimeError):
    """Training cannot go on; the message names the step and the cause. exit_code for the CLI."""

    exit_code = 3


# ---------------------------------------------------------------------- the reductions of §7
PARK_LEVEL = 2      # fold-stack entries of this level or higher may wait off the device (TreeFold)


class TreeFold:
    """The binary-carry fold of CONTRACT.md §7 over arrays, lower index on the left; `add` is the
    backend's elementwise contract add: in place on its first argument (returning None, like
    ops.add_inplace) or returning the sum (like arrays.add_into).

    Parking (optional): where an entry of level PARK_LEVEL or more waits while a push leaves it
    idle under the top of the stack, and how it comes back before its add: a parking.Parking, or
    two functions park / unpark (e.g. arrays.to_host, ops.to_device). An entry of level L waits at
    least 2^L pushes, so the device keeps at most the entries of the lowest levels and each
    transfer is spread over many microbatches. The carry rule says which entries the next push
    reads (and, once `pushes` values are known to come, which the final sum reads): the first of
    them that waits is asked back as soon as a push returns, under the next microbatch's compute,
    and while one is added the next is on its way. The last two pushes park nothing (the sum reads
    what they would park at once). Only where an operand waits changes: the adds, their operands
    and their order, so every bit, are the same.

    release (optional): called with each operand an in-place add has consumed (its values now
    counted in the entry it was added into; the fold holds it no more), e.g. BufferPool.give."""

    def __init__(self, add, park=None, unpark=None, *, parking=None, pushes: int | None = None, release=None):
        self.add, self.stack, self.release = add, [], release
        self.parking = parking if parking is not None else None if park is None else _Calls(park, unpark)
        self.pushes, self._pushed = pushes, 0
        self._parked: list[bool] = []       # per stack entry: it waits parked

    def _reads(self, level: int, last: bool) -> list:
        """[(entry, parked)] in the order the next push of `level` reads them (the entries it
        carries into), then, if that push is the last, the order result() reads the rest."""
        items, k = [], len(self.stack) - 1
        while k >= 0 and self.stack[k][0] == level:
            items.append((self.stack[k][1], self._parked[k]))
            k, level = k - 1, level + 1
        return items + ([(self.stack[j][1], self._parked[j]) for j in range(k + 1)] if last else [])

    def _prefetch(self, items, n: int) -> None:
        """Start bringing back the first n parked entries of items."""
        for a in [a for a, parked in items if parked][:n]:
            self.parking.prefetch(a)

    def _read(self, items, i: int):
        """items[i] on the device; it and the next parked entry asked back first."""
        a, parked = items[i]
        if self.parking is not None:
            self._prefetch(items[i:], 1 + parked)
            if parked:
                a = self.parking.unpark(a)
        return a

    def _sum(self, lower, v):
        r = self.add(lower, v)
        if r is None or r is lower:         # added in place: v is spent
            if self.release is not None:
                self.release(v)
            return lower
        return r

    def push(self, v: np.ndarray, level: int = 0) -> None:
        """Push the next value in index order; a value at level L stands for an aligned block of
        2^L leaves already folded by this same tree (CONTRACT.md §7), e.g. a worker's partial."""
        p = self.parking
        if p is not None:
            p.settle()
        self._pushed += 1
        last = self.pushes is not None and self._pushed >= self.pushes
        first, items, i = level, self._reads(level, last), 0
        while self.stack and self.stack[-1][0] == level:
            self.stack.pop()
            self._parked.pop()
            v, level, i = self._sum(self._read(items, i), v), level + 1, i + 1
        del items
        summed_next = self.pushes is not None and self._pushed + 1 >= self.pushes     # the next push is the last
        if p is not None and not summed_next and self.stack and self.stack[-1][0] >= PARK_LEVEL \
                and not self._parked[-1]:       # (the sum would read it within a push)
            idle_level, idle = self.stack[-1]
            self.stack[-1], self._parked[-1] = (idle_level, p.park(idle)), True
        self.stack.append((level, v))
        self._parked.append(False)
        if p is not None and not last:      # assumes the next push is of this one's level
            self._prefetch(self._reads(first, summed_next), 1)

    def result(self) -> np.ndarray:
        items = list(zip((a for _, a in self.stack), self._parked))
        acc = self._read(items, 0)
        for i in range(1, len(items)):
            acc = self._sum(acc, self._read(items, i))
        return acc

    def held(self):
        """The device arrays the fold holds: entries that do not wait parked, and those parked
        entries' copies under way (the memory model's "fold stack")."""
        for (_, a), parked in zip(self.stack, self._parked):
            if not parked:
                yield a
            elif isinstance(a, Parked):
                yield from a.on_device()


class _Calls:
    """Parking by two functions: each copy blocks, nothing is asked back ahead."""

    def __init__(self, park, unpark):
        self.park, self.unpark = park, unpark

    def settle(self) -> None:
        pass

    def prefetch(self, a) -> None:
        pass


def norm_partials(ops, tensors) -> dict:
    """{name: the §7 sum-of-squares block partials (host fp32)} of (name, array) pairs; from
    device arrays the partials come to the host in one transfer."""
    parts = {name: ops.sumsq_blocks(a) for name, a in tensors}
    if not parts or not arrays.is_device(next(iter(parts.values()))):
        return parts
    flat = arrays.to_host(arrays.concat(list(parts.values())))
    out, at = {}, 0
    for name, a in parts.items():
        out[name], at = flat[at:at + a.size], at + a.size
    return out


def norm_from_partials(partials, ops) -> float:
    """sqrt(tree fold of the block partials of every tensor, tensors in canonical order): exactly
    ops.global_norm of the whole gradient (CONTRACT.md §7). Partials on the host are folded there
    by the C reference (the contract's treefold and sqrt: the same bits as ops', without a launch
    and a blocking read back of a single-thread fold)."""
    joined = arrays.concat(partials)
    if arrays.kind(joined) == arrays.NUMPY:
        ops = _host_ops()
        joined = np.ascontiguousarray(joined, np.float32)
    return float(ops.scalar_sqrt(ops.treefold(joined)))


def _host_ops():
    """The C reference: the contract's ops on host scalars and host arrays."""
    from . import cpu_ref
    return cpu_ref


def adamw_tensors(ops, tcfg, lr: float, step: int, tensors, n: int, like):
    """AdamW over (decayed, p, g, m, v) flat-buffer slices covering n elements in buffer order
    (weight decay on the decayed ones). In place where the kind of `like` (the parameter buffer)
    allows it (numpy, cupy) -> None; on mx.arrays each tensor's new slices are joined into new
    buffers -> (params, m, v)."""
    in_place, k, offs = arrays.writable(like), arrays.kind(like), 0
    new = None if in_place else [arrays.FlatBuffer(n, dt, k) for dt in (np.uint16, np.float32, np.float32)]
    for decayed, p, g, m, v in tensors:
        kw = dict(lr=lr, beta1=tcfg.beta1, beta2=tcfg.beta2, eps=tcfg.eps,
                  weight_decay=tcfg.weight_decay if decayed else 0.0, step=step)
        flat = [a.reshape(-1) for a in (p, g, m, v)]
        if in_place:
            ops.adamw_step(*flat, **kw)
        else:
            for buf, a in zip(new, ops.adamw(*flat, **kw)):
                buf.write(offs, a)
        offs += p.size
    return None if in_place else tuple(b.result() for b in new)


def tensor_views(shapes, buf, lo: int = 0) -> Iterator[tuple]:
    """(name, shape, decayed, at, flat view) of the tensors `shapes` ((name, shape, decayed), buffer
    order, the first at element 0) that `buf` holds part of, `buf` being the elements from `lo` of
    the buffer (all of it by default): the view is the tensor's elements in `buf`, from its element
    `at` — the whole tensor (at 0) unless an owner's range cuts it (distributed/sharding.py)."""
    hi, offs = lo + buf.shape[0], 0
    end = sum(math.prod(s) for _, s, _ in shapes)
    for name, shape, decayed in shapes:
        n = math.prod(shape)
        a, b = max(offs, lo), min(offs + n, hi)
        if a < b or (n == 0 and lo <= offs and (offs < hi or offs == hi == end)):
            yield name, shape, decayed, a - offs, buf[a - lo:b - lo]
        offs += n


# ---------------------------------------------------------------------- who does what
class Reduce(Protocol):
    """One process's part in the step. `size`: the elements of the parameter buffer this process
    owns (a contiguous range, possibly cutting a tensor where its norm blocks and hash chunks
    begin: distributed/sharding.py)."""
    size: int

    def blocks(self, M: int) -> list[tuple[int, int]]:
        """The microbatches this process computes, as (first, count) runs in index order; the
        step folds each run into one partial with the tree fold."""

    def fold(self, parts: list, M: int, step: int):
        """The tree fold over microbatch index 0 … M-1 of every process's partials, restricted to
        the tensors this process owns (its `size` elements); before the 1/M."""

    def own(self, buf):
        """This process's range of a full parameter-sized buffer."""

    def tensors(self, buf) -> Iterator[tuple]:
        """tensor_views' (name, shape, decayed, at, flat view) of the tensors this process owns
        (in whole or part) in a buffer of its range."""

    def gather(self, obj) -> list:
        """`obj` of every process, in rank order (= the buffer order of the owned ranges)."""

    def share_params(self, st, new) -> None:
        """After AdamW on the owned tensors (new: adamw_tensors' (params, m, v) of this range, or
        None when it updated st in place): every process's state holds all updated parameters."""


class LocalReduce:
    """One process: every microbatch in one tree fold, every tensor owned, nothing moved."""

    def __init__(self, shapes, size: int):
        self.shapes, self.size = shapes, size

    def blocks(self, M: int) -> list[tuple[int, int]]:
        return [(0, M)]

    def fold(self, parts: list, M: int, step: int):
        (whole,) = parts
        return whole

    def own(self, buf):
        return buf

    def tensors(self, buf):
        return tensor_views(self.shapes, buf)

    def gather(self, obj) -> list:
        return [obj]

    def share_params(self, st, new) -> None:
        if new is not None:
            st.params, st.m, st.v = new


# ---------------------------------------------------------------------- the step
def _spent(timing: dict, key: str, t0: float) -> None:
    timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0


def _hashed(timing: dict, fn, *args):
    """fn(*args), its time counted as hashing."""
    t0 = time.perf_counter()
    out = fn(*args)
    _spent(timing, "hash", t0)
    return out


def take_step(tr, reduce: Reduce, settle=None) -> "PendingHashes":
    """Advance tr.state (the trainer's: state, stream, model, configs, backend ops, GNMR controller,
    timing) by one optimizer step, this process's part given by `reduce`; returns the step's ledger
    record (no hash) with its gradient and state hashes still being computed (PendingHashes.settle
    completes it). settle(), if given, completes the previous step's: it is called once this step's
    microbatches are computed, before this step writes anything those hashes read."""
    st, ops, tcfg, t = tr.state, tr.ops, tr.tcfg, tr.state.step
    M, tokens = tcfg.tokens_per_step(tr.model_cfg, st.consumed)
    mb = tcfg.microbatch_seqs
    w0 = tr.stream.windows_emitted
    windows = tr.stream.next_windows(M * mb)
    batch_hash = _hashed(tr.timing, hashing.collection_hash, "batch", [("windows", windows, "u32")])
    _gnmr_begin(tr)
    parts, scalars = _microbatches(tr, reduce.blocks(M), windows, mb)
    if settle is not None:      # the previous step's hashes, read while the microbatches were computed
        settle()
    total = reduce.fold(parts, M, t)
    del parts
    grads = arrays.scale_into(ops, total, reciprocal(M)) if total.size else total
    grads_hashing = _hash_grads(tr, reduce, grads)
    (loss, ce, zl), partials = _gather_step(tr, reduce, M, scalars, grads)
    if not math.isfinite(loss):
        raise TrainError(f"step {t}: loss is {loss} (windows {w0}..{w0 + M * mb - 1}); the run stops here. "
                         f"The last checkpoint is intact; inspect the data or lower the learning rate.")
    norm = norm_from_partials(list(partials.values()), ops)      # = ops.global_norm (§7)
    spike = not (norm <= tcfg.spike_threshold)
    skipped = st.skip_left > 0
    clipped, lent = False, None
    pool = _grad_pool(tr)
    lr = f32(tcfg.lr_at(st.consumed + tokens))
    if not skipped and math.isfinite(norm):
        t0 = time.perf_counter()
        coef = _host_ops().clip_coef(norm, tcfg.clip_norm)   # two host scalars: no launch
        if coef < 1.0:
            if grads.size:                  # a worker may own no tensor; the pre-clip bytes are hashed
                # a copy while the hash reads: into a free buffer of the gradient pool where it fits
                # (memory already touched; a first-touched gradient-sized buffer costs a page fault
                # per page, about 100 ms for the small preset's 39 MB with transparent huge pages)
                fits = pool is not None and grads.shape == (pool.n,) and grads.dtype == pool.dt
                src = grads
                grads = arrays.scale_into(ops, _stage(tr).writable("grads", grads, grads_hashing,
                                                                   pool.take if fits else None), coef)
                lent = grads if fits and grads is not src else None
            clipped = True
        st.adam_t += 1
        new = adamw_tensors(ops, tcfg, lr, st.adam_t, _adamw_views(reduce, st, grads), reduce.size, st.params)
        _spent(tr.timing, "optim", t0)
        reduce.share_params(st, new)
    elif not math.isfinite(norm):
        raise TrainError(f"step {t}: gradient norm is {norm}; the run stops here (last checkpoint intact)")
    st.skip_left = tcfg.spike_skip if spike else max(0, st.skip_left - 1) if skipped else 0
    st.step, st.consumed = t + 1, st.consumed + tokens
    st.stream = tr.stream.state()
    state_hashing, counters = _hash_state(tr, reduce, st)
    record = {"step": t, "windows": [w0, w0 + M * mb], "tokens": st.consumed, "lr": lr, "loss": loss,
              "ce": ce, "zloss": zl, "grad_norm": norm, "clipped": clipped, "skipped": skipped,
              "spike": spike, "microbatches": M, "hashes": {"batch": batch_hash}}
    _gnmr_end(tr, partials, st.consumed, record)        # every process: the same inputs, the same decisions
    if pool is not None:        # the step is done with its fold's sum; its hash may still read it (the pool waits)
        pool.give(total)
        if lent is not None:    # and with the clip's copy, taken from the pool
            pool.give(lent)
    return PendingHashes(record, reduce, grads_hashing, state_hashing, counters)


def _microbatches(tr, blocks, windows, mb: int) -> tuple[list, dict]:
    """(one tree-folded gradient per run of `blocks`, {microbatch index: (loss, ce, zloss)})."""
    t0, ops, params = time.perf_counter(), tr.ops, tr.state.params
    parts, scalars = [], {}
    # on a device with memory of its own, what waits idle waits on the host: the fold's high levels
    # (TreeFold) and each run's partial while the later runs are computed
    park = _parking(tr) if arrays.own_memory(params) else None
    # on the host, the gradient buffers the folds consume go back to the model's pool for the next
    # microbatches' gradients
    pool = None if park else _grad_pool(tr)
    # the microbatches only read the params: a backend that can hold the weights' derived operands
    # (cpu_ref.weights_held: the int8 layer's) computes them once for all of them (the same bits)
    held = getattr(ops, "weights_held", None)
    try:
        with held() if held is not None else contextlib.nullcontext():
            for k, (start, n) in enumerate(blocks):
                fold = TreeFold(functools.partial(arrays.add_into, ops), parking=park, pushes=n,
                                release=None if pool is None else pool.give)
                for i in range(start, start + n):
                    loss, ce, zl, g = tr.model.loss_and_grad(params, windows[i * mb:(i + 1) * mb])
                    scalars[i] = (loss, ce, zl)
                    fold.push(g)
                    del g   # held by the fold, or added into it: not alive while the next one is computed
                parts.append(park.park(fold.result()) if park and k + 1 < len(blocks) else fold.result())
        if park:
            for p in parts[:-1]:
                park.prefetch(p)
            parts = [park.unpark(p) for p in parts[:-1]] + parts[-1:]
    except BaseException:
        if park:
            park.drain()    # no copy still under way into or out of what the folds let go
        raise
    _spent(tr.timing, "compute", t0)
    return parts, scalars


def _grad_pool(tr) -> arrays.BufferPool | None:
    """The pool the model takes its numpy gradient buffers from (arrays.BufferPool), set up on first
    use; None where the trainer recycles none (Trainer.recycle_grads) or the params are not numpy."""
    model = tr.model
    if not getattr(tr, "recycle_grads", False) or arrays.kind(tr.state.params) != arrays.NUMPY:
        if getattr(model, "grad_buffers", None) is not None:
            model.grad_buffers = None
        return None
    pool = getattr(model, "grad_buffers", None)
    if pool is None and hasattr(model, "n_params"):
        pool = model.grad_buffers = arrays.BufferPool(model.n_params, np.float32)
    return pool


def _parking(tr) -> Parking:
    """The trainer's parking of fold entries (its pinned buffers reused from step to step)."""
    p = getattr(tr, "parking", None)
    if p is None:
        p = tr.parking = Parking(arrays.kind(tr.state.params))
    return p


def _gather_step(tr, reduce: Reduce, M: int, scalars: dict, grads):
    """The step's means (loss, ce, zloss) and {name: norm partials} of every tensor in canonical
    order, the same on every process."""
    ops = tr.ops
    sumsq = norm_partials(ops, ((n, a) for n, _, _, _, a in reduce.tensors(grads)))
    every, partials = {}, []
    for sc, p in reduce.gather((scalars, sumsq)):
        every.update(sc)
        partials.append(p)
    rM = reciprocal(M)
    means = tuple(float(np.float32(_host_ops().treefold(np.array([every[i][k] for i in range(M)], np.float32)))
                        * np.float32(rM)) for k in range(3))
    return means, join_partials(partials)


def _adamw_views(reduce: Reduce, st, grads):
    """(decayed, p, g, m, v) of the owned tensors: p in the full parameter buffer, g, m, v in
    buffers of the owned range."""
    own = reduce.tensors
    return ((d, p, g, m, v) for (_, _, d, _, p), (*_, g), (*_, m), (*_, v) in zip(
        own(reduce.own(st.params)), own(grads), own(st.m), own(st.v)))


def _gnmr_begin(tr) -> None:
    """The step's recovered units: the active set chosen after the previous step (CONTRACT.md §13)."""
    if tr.gnmr is not None:
        tr.model.set_paths(tr.gnmr.paths(tr.state.gnmr))


def _gnmr_end(tr, partials: dict, consumed_after: int, record: dict) -> None:
    """Update the GNMR controller from the step's per-tensor norm partials ({name: sumsq blocks});
    the record lists the units recovered in this step and those chosen for the next."""
    if tr.gnmr is None:
        return
    t0 = time.perf_counter()
    tr.model.set_paths(None)       # recovered units apply to the step's forward/backward only (§13)
    st, ctl = tr.state, tr.gnmr
    used = st.gnmr.active
    st.gnmr, scores = ctl.update(st.gnmr, ctl.unit_norms(partials, tr.ops), consumed_after)
    record["gnmr"] = {"active": [ctl.names[b] for b in used], "next": [ctl.names[b] for b in st.gnmr.active],
                      "max_risk": float(np.max(scores["risk"])) if len(ctl.names) else 0.0}
    _spent(tr.timing, "gnmr", t0)
    record["hashes"]["gnmr"] = gnmr_hash(tr, st.gnmr)


# ---------------------------------------------------------------------- the step's hashes, in the background
# The gradient, parameters and moments are captured where the hashes read them (state_hashes.py) and
# hashed on a background thread while the trainer goes on; what each process hashes is the part it
# owns, joined with every other process's when the record is settled.
def _stage(tr) -> HashStage:
    stage = getattr(tr, "hash_stage", None)
    if stage is None:
        stage = tr.hash_stage = HashStage()
    return stage


def _hash_grads(tr, reduce: Reduce, grads):
    """A Future of (piece_digests of this process's gradient, background seconds)."""
    t0 = time.perf_counter()
    g = _stage(tr).capture("grads", grads)
    _spent(tr.timing, "hash", t0)
    return submit(lambda: timed(piece_digests, [(n, s, "f32", at, a) for n, s, _, at, a in reduce.tensors(g.wait())]))


def _hash_state(tr, reduce: Reduce, st):
    """(a Future of ((piece_digests of this process's parameters, of its moments), background
    seconds), {name: digest} of the optimizer counters, hashed now: they are Python ints)."""
    t0 = time.perf_counter()
    stage = _stage(tr)
    p, m, v = (stage.capture(role, a) for role, a in (("params", reduce.own(st.params)), ("m", st.m), ("v", st.v)))
    counters = hashing.tensor_digests(_counter_items(st))
    _spent(tr.timing, "hash", t0)

    def digests():
        params = piece_digests(_param_items(reduce.tensors(p.wait())))
        moments = piece_digests([(f"{k}.{n}", s, "f32", at, a) for k, c in (("m", m), ("v", v))
                                 for n, s, _, at, a in reduce.tensors(c.wait())])
        return params, moments
    return submit(timed, digests), counters


class PendingHashes:
    """A step's ledger record (no hash) whose gradient, parameter and optimizer-state hashes are
    being computed in the background. settle() waits for them, joins every process's digests (a
    collective: every process settles a step at the same point of the loop) and returns the record
    complete."""

    def __init__(self, record: dict, reduce: Reduce, grads, state, counters: dict):
        self.record, self.step = record, record["step"]
        self._reduce, self._grads, self._state, self._counters = reduce, grads, state, counters

    def settle(self, timing: dict) -> dict:
        t0 = time.perf_counter()
        (dg, sg), ((dp, do), ss) = self._grads.result(), self._state.result()
        self._grads = self._state = None         # the captured buffers are free for the next step
        _spent(timing, "hash", t0)
        timing["hash_background"] = timing.get("hash_background", 0.0) + sg + ss
        got = self._reduce.gather((dg, dp, do))
        t0 = time.perf_counter()
        allg, allp, allo = (join_digests([g[k] for g in got]) for k in range(3))
        allo.update(self._counters)
        h = self.record["hashes"]
        for key, kind, d in (("grads", "grads", allg), ("params", "params", allp), ("opt_state", "opt_state", allo)):
            h[key] = hashing.collection_hash_from_tensor_hashes(kind, d)
        _spent(timing, "hash", t0)
        return self.record


# ---------------------------------------------------------------------- the state's hashes (CONTRACT.md §11)
# The step hashes each owner's tensors and pieces of tensors and joins the digests (above); a
# checkpoint and the audit hash a whole state in one process (below): the same items, so the same
# hashes.
def piece_digests(items) -> dict:
    """Digests of (name, shape, dtype name, at, flat view) items, the view holding the tensor's
    elements from `at` on: {name: tensor digest} of a whole tensor (at 0, every element), {name:
    (dtype name, shape, at, Merkle leaves)} of a piece of one (`at` a multiple of a hash chunk:
    sharding.ALIGN), in the order of the items. join_digests joins every owner's."""
    whole, out = [], {}
    for name, shape, dn, at, a in items:
        if at == 0 and a.size == math.prod(shape):
            whole.append((name, a.reshape(shape), dn))
            out[name] = None
        else:
            out[name] = (dn, tuple(shape), at, hashing.leaf_hashes(a, at * hashing.DTYPES[dn].itemsize))
    out.update(hashing.tensor_digests(whole))
    return out


def join_digests(owners) -> dict:
    """{name: tensor digest} from every owner's piece_digests, in rank order: a tensor's pieces
    give their leaves in the order of `at`, whose Merkle root is the whole tensor's (§11, Pieces)."""
    out, pieces = {}, {}
    for d in owners:
        for name, v in d.items():
            if isinstance(v, tuple):
                pieces.setdefault(name, []).append(v)
            else:
                out[name] = v
    for name, ps in pieces.items():
        ps.sort(key=lambda p: p[2])
        leaves = [leaf for p in ps for leaf in p[3]]
        out[name] = bytes.fromhex(hashing.tensor_hash_from_leaves(name, ps[0][0], ps[0][1], leaves))
    return out


def join_partials(owners) -> dict:
    """{name: sum-of-squares block partials} from every owner's, in rank order (a tensor cut by the
    owners' ranges: its pieces' partials joined, its own, as they begin at a block, sharding.ALIGN)."""
    out = {}
    for d in owners:
        for name, p in d.items():
            out[name] = arrays.concat([out[name], p]) if name in out else p
    return out


def _param_items(views) -> list:
    return [(n, s, "bf16", at, a) for n, s, _, at, a in views]


def _moment_items(tensors, st) -> list:
    """The Adam moments' items; `tensors` splits a buffer of st.m's range into its tensors."""
    return ([("m." + n, s, "f32", at, a) for n, s, _, at, a in tensors(arrays.to_host(st.m))]
            + [("v." + n, s, "f32", at, a) for n, s, _, at, a in tensors(arrays.to_host(st.v))])


def _counter_items(st) -> list:
    return [("adam_t", np.array([st.adam_t], np.int64), "i64"),
            ("skip_left", np.array([st.skip_left], np.int64), "i64")]


def param_hash(tr, params) -> str:
    """The "params" hash of a whole parameter buffer (tr: shapes, timing)."""
    digests = _hashed(tr.timing, piece_digests, _param_items(tensor_views(tr.shapes, arrays.to_host(params))))
    return _hashed(tr.timing, hashing.collection_hash_from_tensor_hashes, "params", digests)


def opt_hash(tr, st) -> str:
    """The "opt_state" hash of a whole state's moments and optimizer counters."""
    digests = _hashed(tr.timing, piece_digests, _moment_items(functools.partial(tensor_views, tr.shapes), st))
    digests.update(_hashed(tr.timing, hashing.tensor_digests, _counter_items(st)))
    return _hashed(tr.timing, hashing.collection_hash_from_tensor_hashes, "opt_state", digests)


def gnmr_hash(tr, g) -> str:
    """The "gnmr" hash of a GNMR controller state (CONTRACT.md §13)."""
    return _hashed(tr.timing, hashing.collection_hash, "gnmr", g.hash_items())
