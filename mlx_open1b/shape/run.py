"""The trainers on the shape backend, and one measured step per batch phase.

`shape_trainer` builds a Trainer (one process) or a DistributedTrainer (rank of a SimWorld) whose
state is shape arrays on the simulated device, without a run directory, corpus or checkpoint: the
attributes Trainer.__init__ / DistributedTrainer._distribute_state leave behind (model, layout,
reducer, the state in the backend's arrays: every parameter on every rank, the moments on their
owners), and a stream that hands out windows of token 0. Start-up (initialization, the first
checkpoint, the state broadcast), checkpoints and held-out evaluation are not run: they read and
write values. The step is: `compute_step`, i.e. step.take_step with the trainer's reducer, the code
a training run runs.

`measure(cfg, workers)` runs one step of every batch phase (the step's consumed tokens set to the
phase's start) on every worker and returns what each worker's ledger saw in it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import RunConfig
from .. import arrays
from ..model import Cache
from ..parking import Parking
from ..step import TreeFold
from ..train import Trainer, TrainState
from . import array as xp
from .comm import SimComm, SimWorld
from .ledger import DEVICE, HOST, MemoryLedger, Peak
from .replay import install
from . import ledger as _ledger

_ledger.OWNER_TYPES.update({"fold stack": (TreeFold,), "activations": (Cache,)})


class ZeroStream:
    """Windows of token 0, one shared host array per batch size; the rank's ledger holds its bytes
    (a real stream hands every worker the step's windows) until the next batch."""

    _cache: dict = {}

    def __init__(self, seq_len: int):
        self.seq_len, self.windows_emitted, self._held = seq_len, 0, None

    def next_windows(self, n: int) -> np.ndarray:
        shape = (n, self.seq_len + 1)
        w = self._cache.get(shape)
        if w is None:
            w = self._cache.setdefault(shape, np.zeros(shape, np.uint32))
        from .ledger import current
        self._held = None
        with current().tagged("stream windows"):
            self._held = xp.Buffer(w.nbytes, HOST)
        self.windows_emitted += n
        return w

    def state(self) -> dict:
        return {"windows": self.windows_emitted}


def shape_trainer(cfg: RunConfig, comm: SimComm | None = None, backend: str = "shape") -> Trainer:
    """A trainer of cfg on the shape backend: one process, or rank comm.rank of a SimWorld. Another
    backend (cpu_ref) gives real values: the initial parameters of cfg's seed, zero moments."""
    from ..backend import load
    from ..model import init_params
    from ..distributed.reduce import DistributedReduce
    from ..distributed.trainer import DistributedTrainer
    tr = Trainer.__new__(Trainer) if comm is None else DistributedTrainer.__new__(DistributedTrainer)
    tr.cfg = cfg.check()
    tr.model_cfg, tr.tcfg = tr.cfg.model, tr.cfg.train
    tr.backend, tr.ops = backend, load(backend)
    tr.dir, tr.log, tr.readonly, tr.ledger, tr._probes = None, (lambda msg: None), False, None, None
    tr._build_model()
    tr.stream = ZeroStream(tr.model_cfg.seq_len)
    P = tr.model_cfg.n_params()
    own = P
    if comm is not None:
        tr.comm, tr.after_microbatches, tr._sharded, tr._in_checkpoint, tr.last_checkpoint = comm, None, True, False, 0
        tr.reduce = DistributedReduce(comm, tr.ops, tr.shapes, tr.timing, None)
        tr.shards, tr.own = tr.reduce.shards, tr.reduce.mine
        own = tr.own.size
        for k in ("compute", "reduce", "optim", "comm"):
            tr.timing[k] = 0.0
    if backend == "shape":
        params, m, v = xp.empty(P, np.uint16), xp.zeros(own, np.float32), xp.zeros(own, np.float32)
    else:
        params, m, v = init_params(tr.model_cfg, tr.tcfg.seed), np.zeros(own, np.float32), np.zeros(own, np.float32)
    tr.state = TrainState(0, 0, 0, 0, params, m, v, tr.stream.state(), tr.gnmr.fresh() if tr.gnmr else None)
    return tr


@dataclass
class Measure:
    """One worker's step of one batch phase."""
    rank: int
    microbatches: int               # M of the phase
    computed: int                   # microbatches this worker computed
    owned: int                      # parameter elements this worker owns
    before: dict                    # live bytes {place: bytes} when the step began
    peak: dict                      # {place: bytes}
    device: Peak                    # what the device peak is made of
    host: Peak
    moved: dict                     # h2d, d2h, net_out, net_in bytes in the step


def _roots(tr):
    st = lambda: tr.state                                      # noqa: E731 - read at each breakdown
    return [("params", lambda: [st().params]), ("moments", lambda: [st().m, st().v]),
            ("constants", lambda: [a for t in tr.model._tables.values() for a in t])]


def _worker(cfg: RunConfig, comm: SimComm | None, phases, resolution: float, replay: bool,
            overlap: bool, recompute_blocks: bool = False) -> list[Measure]:
    rank = 0 if comm is None else comm.rank
    led = MemoryLedger(f"rank {rank}", resolution).activate()
    tr = shape_trainer(cfg, comm)
    tr.parking = Parking(arrays.SHAPE, overlap)
    tr.model.recompute_blocks = recompute_blocks
    install(tr, replay)
    led.roots = _roots(tr)
    reduce = tr._reducer()
    out = []
    for start, M in phases:
        tr.state.consumed = start
        led.reset()
        before = dict(led.bytes)
        tr.compute_step()
        computed = sum(n for _, n in reduce.blocks(M))
        out.append(Measure(rank, M, computed, reduce.size, before, dict(led.peak), led.breakdown[DEVICE],
                           led.breakdown[HOST], dict(led.moved)))
    return out


def measure(cfg: RunConfig, workers: int = 1, phases=None, resolution: float = 0.002,
            replay: bool = True, overlap: bool = True, recompute_blocks: bool = False) -> list[list[Measure]]:
    """[phase][rank] Measures of one step per batch phase (default: every phase of cfg) on `workers`
    workers (1: the single-process Trainer; more: the DistributedTrainer on a SimWorld). replay:
    the model program runs once per shape and is replayed after (replay.py); False runs it at every
    microbatch (slow at the open1b preset; the same numbers). overlap=False: fold entries parked
    by blocking copies into pageable memory (parking.py) instead of the pinned, overlapped ones.
    recompute_blocks: the model keeps each block's input alone and recomputes its cache in the
    backward (Model(recompute_blocks=True))."""
    from ..distributed.sharding import check_worker_count
    check_worker_count(workers, cfg.train.phases)          # as the distributed trainer does at start-up
    phases = [tuple(p) for p in (cfg.train.phases if phases is None else phases)]
    if workers == 1:
        per_rank = [_worker(cfg, None, phases, resolution, replay, overlap, recompute_blocks)]
    else:
        world = SimWorld(workers)
        per_rank = world.run(lambda r: _worker(cfg, SimComm(world, r), phases, resolution, replay, overlap,
                                               recompute_blocks))
    return [[per_rank[r][i] for r in range(workers)] for i in range(len(phases))]
