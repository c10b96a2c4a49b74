"""Data-parallel training on torch.distributed with the bits of one device (DESIGN §5, §9).

N workers run one step together: the step of mlx_open1b/step.py, the same code as on one device,
with the workers' reducer (reduce.py: who computes which microbatches and owns which tensors, the
all-to-all and the gathers), so the ledger records are identical, record for record.

Rank 0 alone writes: run.json, the ledger, checkpoints (the single-device format, so a run resumes
at any worker count). A checkpoint is streamed: every owner hashes its range of the state (the
step's own hashes), then sends it to rank 0 in pieces, in turn, in the file's order; rank 0 writes
each piece as it arrives (checkpoint.StreamedCheckpoint), so no worker holds the whole moments. A
new run starts on every worker at once: each initializes the parameters it owns (element i is a
pure function of (seed, i)), the ranges are all-gathered, the moments start at zero on their owners,
and the checkpoint of step 0 is streamed as any other. Rank 0 alone reads the run directory: on
resume it streams the last checkpoint the same way round — read in file order, each owner's range
of the moments sent to it in turn and in pieces, the parameters broadcast, everything verified
(file, tensor and state hashes) before any step — so the other workers need only the corpus.
Held-out evaluation: in bf16 every probe window is a row of its own, so all the windows are cut
into near-equal runs, one per worker, and each source's CE is the mean over its windows' values
gathered in window order — the same numbers as one process; in the quantized precisions a source's
windows must stay one batch (per-tensor activation scales), so the sources are spread over the
workers.

Each of these runs inside `Comm.phase`, with a deadline that fits its size (phases.py): the ranks
wait on each other's heartbeats, not in a collective, so minutes of work never trip the collective
timeout, a working rank that dies is still reported within it, and one that hangs is reported when
its phase's deadline passes, naming the phase and the rank (collectives.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys

import numpy as np

from .. import arrays, cpu_ref, hashing
from ..checkpoint import CheckpointError
from ..config import ConfigError, RunConfig, steps_for_tokens
from ..contract import CONTRACT_VERSION
from ..data.format import DataError, Manifest
from ..data.stream import Stream, manifest_fingerprint
from ..gnmr import GNMRState
from ..ledger import LedgerError, genesis_hash
from ..rundir import RunDir
from ..train import Trainer, TrainError, TrainState, get_backend, resolve_backend
from ..checkpoint import StreamedCheckpoint, StreamedCheckpointReader, TensorStreams
from ..model import init_params
from ..step import _counter_items
from .collectives import Comm, CommError, DistError, cpu_count, load_torch
from .phases import PhaseTimeouts
from .reduce import DistributedReduce
from .sharding import ShardingError, check_worker_count

_STARTUP_ERRORS = (TrainError, DataError, ConfigError, CheckpointError, LedgerError, ShardingError, OSError,
                   ValueError, KeyError)


class WorkerTerminated(BaseException):
    """SIGTERM while training: the launcher (torchrun) stops the workers, usually because another
    worker failed."""


def _flat(d, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class DistributedTrainer(Trainer):
    """A Trainer whose steps run on all workers of `comm`; every worker constructs one with the
    same arguments (rank 0 opens or creates the run directory) and runs Trainer's loop, this class
    giving its hooks their worker's part. after_microbatches(rank, step): see DistributedReduce."""

    settles_alone = False       # a step's hashes are joined in a collective: never after an error

    def __init__(self, comm: Comm, run_dir, cfg: RunConfig | None = None, corpus_dir=None,
                 backend: str = "cpu_ref", resume: bool = False, log=None, after_microbatches=None,
                 startup_error: tuple[str, int] | None = None, phase_timeouts: PhaseTimeouts | None = None):
        backend = resolve_backend(backend)
        self.comm = comm
        self.after_microbatches = after_microbatches
        self.timeouts = phase_timeouts or PhaseTimeouts(collective=comm.timeout_s)
        self._sharded = False
        self._in_checkpoint = False
        self.last_checkpoint = None
        try:
            cfg, corpus_dir = self._agree(run_dir, cfg, corpus_dir, backend, resume, startup_error)
            err = None
            # rank 0 opens the run directory (and loads the last checkpoint when resuming)
            with comm.phase("opening the run", timeout=self.timeouts.opening(cfg.model.n_params(), resume)):
                try:
                    if comm.rank == 0:
                        Trainer.__init__(self, run_dir, None if resume else cfg, corpus_dir, backend=backend,
                                         resume=resume, log=log)
                    else:
                        self._init_replica(run_dir, cfg, corpus_dir, backend, log)
                except _STARTUP_ERRORS as e:
                    err = (str(e), getattr(e, "exit_code", 2))
            self._all_ok("opening the run (before any training step)", err)
            if resume:
                self._distribute_state()
            else:
                self._start_together()
        except CommError as e:
            raise TrainError(f"worker lost while starting the run (rank {comm.rank} of {comm.world}): {e}. "
                             f"No step was taken.", exit_code=3) from None
        for k in ("compute", "reduce", "optim", "comm"):
            self.timing[k] = 0.0

    # ------------------------------------------------------------------ start-up
    def _all_ok(self, what: str, err) -> None:
        """A barrier that carries each worker's error (None or (message, exit code)): if any worker
        failed, every worker raises the same TrainError naming the ranks."""
        status = self.comm.all_gather_object(err)
        bad = [(r, s) for r, s in enumerate(status) if s is not None]
        if bad:
            msg = "; ".join(f"rank {r}: {m}" for r, (m, _) in bad[:4])
            raise TrainError(f"{what} failed: {msg}", exit_code=bad[0][1][1])

    def _agree(self, run_dir, cfg, corpus_dir, backend, resume, startup_error=None):
        """Every worker's configuration, corpus, contract and backend, compared with rank 0's before
        anything is written; then the worker count against the batch. Returns (cfg, corpus_dir).
        startup_error (message, exit code): this worker cannot start (its device failed the
        self-test); every worker stops here with it."""
        comm = self.comm
        info, err = None, None
        if resume and comm.rank == 0:       # the run's config and corpus path, from rank 0's run directory
            try:
                rd = RunDir(run_dir)
                if not rd.exists():
                    raise TrainError(f"{rd.run_file}: no run to resume (start one without --resume)", exit_code=2)
                ri = rd.info(error=TrainError)
                info = {"config": ri.config, "corpus_dir": ri.corpus_dir}
            except (TrainError, OSError) as e:
                err = (f"{e}", getattr(e, "exit_code", 2))
        info, err = comm.broadcast_object((info, err))      # every worker, resuming or not (same collectives)
        if err is not None:
            raise TrainError(f"rank 0 cannot resume: {err[0]}", exit_code=err[1])
        ident, err = None, None
        try:
            if startup_error is not None:
                raise TrainError(*startup_error)
            if resume:
                if info is None:
                    raise TrainError("started with --resume, rank 0 without", exit_code=2)
                if comm.rank == 0 or corpus_dir is None:
                    corpus_dir = info["corpus_dir"]
                cfg = info["config"]
            if cfg is None or corpus_dir is None:
                raise TrainError("a new run needs a config and a prepared corpus", exit_code=2)
            cfg = cfg.check()
            get_backend(backend)                     # importable and available on this worker
            manifest = Manifest.load(corpus_dir)
            fp = manifest_fingerprint(manifest)
            ident = {"genesis": genesis_hash(cfg.to_json(), fp, manifest.tokenizer_sha256, CONTRACT_VERSION),
                     "config": cfg.to_json(), "manifest_fingerprint": fp, "corpus": str(corpus_dir),
                     "tokenizer_sha256": manifest.tokenizer_sha256, "contract_version": CONTRACT_VERSION,
                     "backend": backend, "resume": bool(resume)}
        except _STARTUP_ERRORS as e:
            err = (str(e), getattr(e, "exit_code", 2))
        got = comm.all_gather_object((ident, err))
        bad = [(r, e) for r, (_, e) in enumerate(got) if e is not None]
        if bad:
            msg = "; ".join(f"rank {r}: {m}" for r, (m, _) in bad[:4])
            raise TrainError(f"workers cannot start: {msg}", exit_code=bad[0][1][1])
        ref, diffs = got[0][0], []
        for r, (mine, _) in enumerate(got[1:], 1):
            what = []
            if mine["config"] != ref["config"]:
                a, b = _flat(ref["config"]), _flat(mine["config"])
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                what += [f"config {k} = {b.get(k)!r} (rank 0: {a.get(k)!r})" for k in keys[:4]]
            for key in ("manifest_fingerprint", "tokenizer_sha256"):
                if mine[key] != ref[key]:
                    what.append(f"{key} {mine[key][:16]}… of corpus {mine['corpus']} (rank 0: {ref[key][:16]}… "
                                f"of {ref['corpus']})")
            for key in ("contract_version", "backend", "resume"):
                if mine[key] != ref[key]:
                    what.append(f"{key} {mine[key]!r} (rank 0: {ref[key]!r})")
            if what:
                diffs.append(f"rank {r}: " + ", ".join(what))
        if diffs:
            raise TrainError("workers disagree before the first step — every worker must run the same "
                             "configuration on the same prepared corpus: " + "; ".join(diffs), exit_code=2)
        try:
            check_worker_count(comm.world, cfg.train.phases)
        except ShardingError as e:
            raise TrainError(str(e), exit_code=2) from None
        return cfg, corpus_dir

    def _init_replica(self, run_dir, cfg: RunConfig, corpus_dir, backend: str, log) -> None:
        """What Trainer.__init__ builds, without touching the run directory (rank 0 owns it)."""
        self._attach(run_dir, backend, log)
        self.cfg = cfg.check()
        self._open_corpus(corpus_dir)
        self._build_model()
        self.readonly, self.ledger = False, None

    def _start_new(self) -> None:
        """Rank 0 inside Trainer.__init__ of a new run: an empty stand-in state; every worker builds
        the real one together (_start_together), then rank 0 writes run.json."""
        empty = np.zeros(0, np.float32)
        self.state = TrainState(0, 0, 0, 0, np.zeros(0, np.uint16), empty, empty,
                                Stream(self.corpus, self.tcfg.seed, self.model_cfg.seq_len).state(), None)

    def _make_reduce(self) -> None:
        self.reduce = DistributedReduce(self.comm, self.ops, self.shapes, self.timing, self.after_microbatches)
        self.shards, self.own = self.reduce.shards, self.reduce.mine

    def _start_together(self) -> None:
        """A new run's state on every worker: each initializes its own range of the parameters (the
        same bits as the whole buffer's slice), the ranges are all-gathered, the moments start at
        zero on their owners; then the checkpoint of step 0 (streamed) and, last, run.json."""
        comm, P = self.comm, self.model_cfg.n_params()
        self._make_reduce()
        own = self.own
        params = np.empty(P, np.uint16)
        with comm.phase("initializing the parameters", busy=range(comm.world),
                        timeout=self.timeouts.opening(P, resume=False)):
            params[own.lo:own.hi] = init_params(self.model_cfg, self.tcfg.seed, lo=own.lo, hi=own.hi)
        st = TrainState(0, 0, 0, 0, params, None, None,
                        Stream(self.corpus, self.tcfg.seed, self.model_cfg.seq_len).state(),
                        self.gnmr.fresh() if self.gnmr else None)
        self.reduce.share_params(st, None)          # every owner's range to every worker, in place
        st.params, st.m, st.v = (self.ops.to_device(a) for a in (st.params, np.zeros(own.size, np.float32),
                                                                  np.zeros(own.size, np.float32)))
        self.state = st
        self.stream = Stream(self.corpus, self.tcfg.seed, self.model_cfg.seq_len, state=st.stream)
        self.last_checkpoint = None
        self._sharded = True
        self._checkpoint()
        err = None
        if comm.rank == 0:
            try:
                self._create_run()
            except (TrainError, OSError) as e:
                err = (f"{e} (no run was created)", getattr(e, "exit_code", 3))
        self._all_ok("creating the run", err)

    def _load_latest(self, at_or_before: int | None = None) -> TrainState:
        """Rank 0 inside Trainer.__init__ (resume): the newest checkpoint opened for streaming
        (meta.json, sizes and header checked); its tensors are read in _distribute_state as they go
        to their owners, and verified there. A stand-in state with the checkpoint's counters."""
        found = self.rundir.latest_checkpoint(at_or_before)
        if found is None:
            raise TrainError(f"{self.dir}: no checkpoint to resume from", exit_code=2)
        path = found[1]
        reader = StreamedCheckpointReader(path)
        meta = reader.meta
        try:
            if meta.get("genesis") != self.genesis:
                raise TrainError(f"{path}: checkpoint belongs to another run (genesis differs)", exit_code=2)
            gnmr = self._gnmr_of(path, meta)
        except BaseException:
            reader.close()
            raise
        self._reader = reader
        empty = np.zeros(0, np.float32)
        return TrainState(int(meta["step"]), int(meta["consumed"]), int(meta["adam_t"]), int(meta["skip_left"]),
                          np.zeros(0, np.uint16), empty, empty, meta["stream"], gnmr)

    def _cut_ledger(self) -> None:
        """Deferred until the checkpoint is read and verified (_read_checkpoint)."""

    def _distribute_state(self) -> None:
        """A resumed run's state on every worker: counters and stream position from rank 0; the
        checkpoint's tensors streamed from rank 0's reader — each owner's range of the moments sent
        to it in turn and in pieces, the parameters broadcast — and verified (file, tensor and
        state hashes) before any step."""
        comm, rank = self.comm, self.comm.rank
        self._make_reduce()
        P = self.model_cfg.n_params()
        st = self.state if rank == 0 else None
        meta = comm.broadcast_object(None if st is None else
                                     {**{k: getattr(st, k) for k in ("step", "consumed", "adam_t", "skip_left", "stream")},
                                      "gnmr": None if st.gnmr is None else st.gnmr.to_json()})
        # start-up moves host buffers (once); the state then lives in the backend's arrays
        params = np.empty(P, np.uint16)
        m = np.empty(self.own.size, np.float32)
        v = np.empty(self.own.size, np.float32)
        what, err = f"reading the checkpoint of step {meta['step']}", None
        with comm.phase(what, busy=range(comm.world), timeout=self.timeouts.opening(P, resume=True)):
            if rank == 0:
                err = self._read_checkpoint(params, m, v)
            elif self.own.size:
                for buf in (m, v):              # the file's order: m, then v, each by rank
                    comm.await_turn(0)
                    for lo, hi in self._pieces(self.own.size, 4):
                        comm.recv(buf[lo:hi], 0)
        self._all_ok(f"{what} (before any training step)", err)
        comm.broadcast(params)
        gnmr = None
        if meta["gnmr"] is not None:
            gnmr = GNMRState.from_json(meta["gnmr"], len(self.gnmr.units), self.gnmr.cfg.window)
        self.state = TrainState(meta["step"], meta["consumed"], meta["adam_t"], meta["skip_left"],
                                *(self.ops.to_device(a) for a in (params, m, v)), meta["stream"], gnmr)
        if rank != 0:
            self.stream = Stream(self.corpus, self.tcfg.seed, self.model_cfg.seq_len, state=meta["stream"])
        self.last_checkpoint = meta["step"]
        self._sharded = True

    def _state_streams(self) -> dict:
        """The "params" and "opt_state" collections' tensors, hashed from a stream of the flat
        buffers (step.param_hash, opt_hash)."""
        return {"params": TensorStreams([(n, "bf16", s) for n, s, _ in self.shapes]),
                "m": TensorStreams([("m." + n, "f32", s) for n, s, _ in self.shapes]),
                "v": TensorStreams([("v." + n, "f32", s) for n, s, _ in self.shapes])}

    def _state_hashes(self, coll: dict, st) -> tuple[str, str]:
        opt = {**coll["m"].digests, **coll["v"].digests, **hashing.tensor_digests(_counter_items(st))}
        return (hashing.collection_hash_from_tensor_hashes("params", coll["params"].digests),
                hashing.collection_hash_from_tensor_hashes("opt_state", opt))

    def _read_checkpoint(self, params, m, v):
        """Rank 0's part of a resume: read the checkpoint in file order, keeping the parameters and
        its own moments, sending each owner its range; then verify. Returns None or (message, exit
        code). A read that fails goes on with zeros, so no owner waits on a reader that gave up."""
        r, st, comm, P = self._reader, self.state, self.comm, self.model_cfg.n_params()
        coll, err = self._state_streams(), None
        if [n for n, _, _ in r.order] != ["m", "v", "params"]:
            err = (f"{r.path}: holds tensors {[n for n, _, _ in r.order]}, a training checkpoint m, v and params", 2)

        def get(name, n, dtype):
            nonlocal err
            if err is None:
                try:
                    a = r.read(name, n)
                    coll[name].update(hashing.byte_view(a))
                    return a
                except (CheckpointError, OSError) as e:
                    err = (str(e), 2)
            return np.zeros(n, dtype)
        try:
            for name, buf in (("m", m), ("v", v)):
                for sh in sorted(self.shards, key=lambda sh: sh.lo):
                    if not sh.size:
                        continue
                    if sh.rank == comm.rank:
                        for lo, hi in self._pieces(sh.size, 4):
                            buf[lo:hi] = get(name, hi - lo, np.float32)
                        continue
                    comm.give_turn(sh.rank)
                    for lo, hi in self._pieces(sh.size, 4):
                        comm.send(np.ascontiguousarray(get(name, hi - lo, np.float32)), sh.rank)
            for lo, hi in self._pieces(P, 2):
                params[lo:hi] = get("params", hi - lo, np.uint16)
            if err is None:
                try:
                    r.finish()
                except CheckpointError as e:
                    err = (str(e), 2)
            if err is None and self._state_hashes(coll, st) != (r.meta["params_hash"], r.meta["opt_hash"]):
                err = (f"{r.path}: tensors do not match the hashes recorded in its meta.json", 2)
        finally:
            r.close()
            self._reader = None
        if err is None:
            Trainer._cut_ledger(self)
        return err

    # ------------------------------------------------------------------ the loop's hooks (Trainer.train)
    def _reducer(self) -> DistributedReduce:
        return self.reduce

    def _last_checkpoint(self) -> str:
        later = " or, if rank 0 finished writing it, the next" if self._in_checkpoint and self.comm.rank else ""
        return (f"the last checkpoint (step {self.last_checkpoint}{later}) is intact: resume with --resume, at any "
                f"worker count")

    def _lost(self, t: int, e: CommError) -> TrainError:
        return TrainError(f"worker lost during step {t}: {e.op} failed on rank {self.comm.rank} of {self.comm.world} "
                          f"({e.cause}); the run stops here, {self._last_checkpoint()}", exit_code=3)

    @contextlib.contextmanager
    def _failures(self, t: int):
        """A lost or stopped worker during step t (or the final checkpoint): a TrainError naming
        this rank and the checkpoint to resume from."""
        try:
            yield
        except CommError as e:
            raise self._lost(t, e) from None
        except WorkerTerminated as e:
            raise TrainError(f"worker stopped during step {t} on rank {self.comm.rank} of {self.comm.world}: {e}; "
                             f"{self._last_checkpoint()}", exit_code=3) from None

    def _eval_work(self) -> list[tuple[int, str, int, int]]:
        sources = [(s.name, len(self._probes[s.name])) for s in self.manifest.sources if len(self._probes[s.name])]
        return eval_work(sources, self.comm.world, self.cfg.precision == "bf16")

    def _eval_rate(self) -> float | None:
        """Tokens this worker trains per second (the steps so far), for the evaluation's deadline."""
        n, secs = self.timing.get("n", 0), self.timing.get("steps", 0.0)
        if not n or secs <= 0:
            return None
        _, tokens = self.tcfg.tokens_per_step(self.model_cfg, self.state.consumed)
        return tokens / self.comm.world / (secs / n)

    def _source_ces(self) -> dict:
        """Trainer._source_ces with the probe windows spread over the workers (_eval_work); each
        source's CE is the mean over its windows' values gathered in window order: the same array,
        so the same number, as one process's."""
        work, T = self._eval_work(), self.model_cfg.seq_len
        load = [0] * self.comm.world
        for w, _, a, b in work:
            load[w] += (b - a) * T
        mine = []
        with self.comm.phase(f"held-out evaluation after step {self.state.step}", busy=[w for w, *_ in work],
                             timeout=self.timeouts.evaluation(max(load), self._eval_rate())):
            for w, name, a, b in work:
                if w == self.comm.rank:
                    mine.append((name, a, self.model.eval_loss(self.state.params, self._probes[name][a:b])))
        return eval_means(self.comm.all_gather_object(mine))

    # ------------------------------------------------------------------ checkpoints
    PIECE_BYTES = 64 << 20      # the most bytes of state a checkpoint moves in one send

    def _checkpoint(self):
        """The single-device checkpoint, streamed: rank 0 writes the file in order — the moments'
        ranges as their owners send them, in turn and in pieces, then the parameters — hashing
        every piece as it passes (the file, its tensors, and the state's collections)."""
        if not self._sharded:                  # rank 0 inside Trainer.__init__: the full state is local
            return Trainer._checkpoint(self)
        comm, st, P = self.comm, self.state, self.model_cfg.n_params()
        self._in_checkpoint = True
        what = f"writing the checkpoint of step {st.step}"
        path, err = None, None
        with comm.phase(what, busy=range(comm.world), timeout=self.timeouts.checkpoint(P)):
            if comm.rank == 0:
                path, err = self._write_checkpoint()
            elif self.own.size:
                for a in (st.m, st.v):          # the file's order: m, then v, each by rank
                    comm.await_turn(0)
                    for lo, hi in self._pieces(self.own.size, 4):
                        comm.send(arrays.to_host(a[lo:hi]), 0)
        self._all_ok(what, err)
        self.last_checkpoint, self._in_checkpoint = st.step, False
        return path

    def _pieces(self, n: int, itemsize: int) -> list[tuple[int, int]]:
        step = max(1, self.PIECE_BYTES // itemsize)
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def _write_checkpoint(self):
        """Rank 0's part: (path or None, error or None). A failed write still takes every owner's
        pieces (and drops them), so no owner waits on a writer that gave up."""
        comm, st, P = self.comm, self.state, self.model_cfg.n_params()
        err = None
        coll = self._state_streams()            # the state's hashes from the same pieces

        def failed(e):
            return (f"{e} (the checkpoint of step {self.last_checkpoint} is intact)", getattr(e, "exit_code", 3))

        specs = {"params": ("bf16", (P,)), "m": ("f32", (P,)), "v": ("f32", (P,))}
        with contextlib.ExitStack() as stack:
            try:
                w = stack.enter_context(StreamedCheckpoint(self.dir, st.step, specs, self._checkpoint_meta(st, "", "")))
            except (CheckpointError, OSError) as e:
                w, err = None, failed(e)

            def put(name, piece):
                nonlocal err
                if err is None:
                    try:
                        w.write(name, piece)
                        coll[name].update(hashing.byte_view(piece))
                    except (CheckpointError, OSError) as e:
                        err = failed(e)
            for name, a in (("m", st.m), ("v", st.v)):
                for sh in sorted(self.shards, key=lambda sh: sh.lo):
                    if not sh.size:
                        continue
                    if sh.rank == comm.rank:
                        for lo, hi in self._pieces(sh.size, 4):
                            put(name, arrays.to_host(a[lo:hi]))
                        continue
                    comm.give_turn(sh.rank)
                    buf = np.empty(min(sh.size, self.PIECE_BYTES // 4), np.float32)
                    for lo, hi in self._pieces(sh.size, 4):
                        comm.recv(buf[:hi - lo], sh.rank)
                        put(name, buf[:hi - lo])
            for lo, hi in self._pieces(P, 2):
                put("params", arrays.to_host(st.params[lo:hi]))
            if err is None:
                p_hash, o_hash = self._state_hashes(coll, st)
                try:
                    return w.finish({"params_hash": p_hash, "opt_hash": o_hash}), None
                except (CheckpointError, OSError) as e:
                    err = failed(e)
        return None, err

    def _run_hash(self) -> str:
        """Rank 0's run hash, on every worker."""
        return self.comm.broadcast_object(Trainer._run_hash(self) if self.comm.rank == 0 else None)


# ---------------------------------------------------------------------- held-out evaluation's split
def eval_work(sources: list[tuple[str, int]], N: int, rows_apart: bool) -> list[tuple[int, str, int, int]]:
    """[(rank, source, first window, end window)]: who evaluates which probe windows of `sources`
    [(name, windows)] (manifest order). rows_apart (bf16: every window is a row of its own,
    Model.eval_loss): all the windows are cut into N near-equal runs, one per worker; else a
    source's windows are one batch (per-tensor activation scales), so whole sources go round the
    workers (source i on rank i mod N)."""
    if not rows_apart:
        return [(i % N, name, 0, n) for i, (name, n) in enumerate(sources)]
    total, out, at = sum(n for _, n in sources), [], 0
    for name, n in sources:
        for r in range(N):
            a, b = max(at, r * total // N), min(at + n, (r + 1) * total // N)
            if a < b:
                out.append((r, name, a - at, b - at))
        at += n
    return out


def eval_means(gathered) -> dict:
    """{source: CE} from every worker's [(source, first window, per-window CE)]: each source's
    values joined in window order (whatever the ranks' order), then np.mean in float64 over the
    array — the very array, so the same number, one process averages."""
    runs: dict = {}
    for g in gathered:
        for name, a, losses in g:
            runs.setdefault(name, []).append((a, losses))
    return {name: float(np.mean(np.concatenate([x for _, x in sorted(r, key=lambda t: t[0])]), dtype=np.float64))
            for name, r in runs.items()}


# ---------------------------------------------------------------------- worker entry point
def in_worker_env() -> bool:
    """True in a process started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return bool(os.environ.get("RANK")) and bool(os.environ.get("WORLD_SIZE"))


def _raise_terminated(signum, frame):
    raise WorkerTerminated(f"terminated by {signal.Signals(signum).name} (the launcher stops every worker when "
                           f"one fails, or the run was interrupted)")


def run_worker(run_dir, cfg: RunConfig | None = None, corpus_dir=None, *, steps: int | None = None,
               backend: str = "cpu_ref", resume: bool = False, timeout: float = 120.0, threads: int = 0,
               progress=None, on_start=None, log=None, close: bool = True, after_microbatches=None,
               phase_hook=None, startup_error: tuple[str, int] | None = None,
               phase_timeouts: PhaseTimeouts | None = None) -> tuple[str, DistributedTrainer]:
    """This process's part of a distributed run (the environment of torchrun): join the process
    group, build the trainer, train until `steps` (default: the token budget). Returns (run hash,
    trainer). Kernel threads default to the CPUs divided by the workers on this node (threads never
    change a bit). on_start(trainer, total_steps) and progress(record, tokens/s) run on rank 0.
    close=False leaves the process group up (trainer.comm) for the caller. after_microbatches and
    phase_hook: see DistributedReduce and Comm. startup_error (message, exit code): this worker
    cannot run (its device failed the self-test): every worker stops at the start-up agreement.
    phase_timeouts: the deadlines of the long phases (default: phases.PhaseTimeouts with `timeout`
    as the collective timeout)."""
    backend = resolve_backend(backend)          # 'auto' -> this machine's GPU backend (or cpu_ref)
    comm = Comm.init_from_env(backend, timeout, phase_hook=phase_hook)
    if comm.device.startswith("cuda"):            # the cuda backend's kernels on this worker's GPU too
        arrays.module(arrays.CUPY).cuda.Device(int(comm.device.split(":")[1])).use()
    n = threads or max(1, cpu_count() // max(1, comm.local_world))
    cpu_ref.set_num_threads(n)
    hashing.set_hash_threads(min(n, 8))
    load_torch().set_num_threads(1)             # torch only moves bytes here: no compute threads of its own
    old = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGTERM,)}
    try:
        tr = DistributedTrainer(comm, run_dir, cfg, corpus_dir, backend=backend, resume=resume, log=log,
                                after_microbatches=after_microbatches, startup_error=startup_error,
                                phase_timeouts=phase_timeouts)
        total = steps if steps is not None else steps_for_tokens(tr.tcfg, tr.model_cfg, tr.tcfg.total_tokens)
        if on_start and comm.rank == 0:
            on_start(tr, total)
        h = tr.train(total, progress=progress)
    except WorkerTerminated as e:
        raise TrainError(f"worker stopped before the first step on rank {comm.rank}: {e}", exit_code=3) from None
    finally:
        for s, h0 in old.items():
            signal.signal(s, h0)
    if close:
        comm.close()
    return h, tr


def worker_main(run_dir, cfg=None, corpus_dir=None, **kw) -> None:
    """run_worker for a process that ends with it: on failure prints `error: [rank r/N] message` and
    exits with the error's code at once (os._exit: no waiting on a broken process group);
    rank 0 prints the run hash on success."""
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    try:
        h, tr = run_worker(run_dir, cfg, corpus_dir, **kw)
    except (TrainError, DistError, ConfigError, DataError, CheckpointError, LedgerError) as e:
        print(f"error: [rank {rank}/{world}] {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(getattr(e, "exit_code", 2))
    if tr.comm.rank == 0:
        print(f"run hash {h}", flush=True)
    return h, tr
