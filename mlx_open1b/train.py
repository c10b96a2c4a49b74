"""The training loop: one optimizer step at a time, every step hashed into the chained ledger.

The step itself (CONTRACT.md §12) is step.py's, shared with the distributed trainer; this module
holds the run around it: the state, checkpoints, the ledger, held-out evaluation.

The state lives in the backend's arrays (`ops.to_device`: mx.array on metal, cupy on cuda, numpy
on cpu_ref); each step moves to the host only what it hashes (the gradient, the parameters and
moments) and a few scalars. Checkpoints hold everything the next step needs (params, moments,
Adam step, stream position, spike state, consumed tokens), so a resumed run writes exactly the
ledger of an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import sys
import time

import numpy as np

from . import __version__, arrays, host_malloc
from .checkpoint import load_checkpoint, save_checkpoint
from .config import ConfigError, RunConfig
from .contract import CONTRACT_VERSION
from .data.format import Manifest
from .data.stream import Stream, heldout_windows, manifest_fingerprint
from .gnmr import Controller, GNMRError, GNMRState
from .ledger import genesis_hash
from .model import Model, ParamLayout, init_params
from .rundir import RunDir, RunInfo
from .steptimes import TIMING_FILE, StepTimes
from .backend import load as get_backend, resolve as resolve_backend  # noqa: F401  (training's names for them)
from .step import LocalReduce, Reduce, TrainError, gnmr_hash, opt_hash, param_hash, take_step


@dataclasses.dataclass
class TrainState:
    """Everything the next step depends on (all of it in the checkpoint and the hashes)."""
    step: int                    # steps completed
    consumed: int                # tokens consumed
    adam_t: int                  # optimizer updates applied (bias correction)
    skip_left: int               # spike protocol: updates still to skip
    params: np.ndarray           # (P,) bf16 as uint16
    m: np.ndarray                # (P,) f32
    v: np.ndarray                # (P,) f32
    stream: dict                 # data-stream position at the step boundary
    gnmr: object = None          # GNMRState when the run has a GNMR controller (CONTRACT.md §13)


class Trainer:
    """One process's training of a run: Trainer.new starts one, Trainer.resume continues it from its
    latest checkpoint, Trainer.replay opens it read-only at a checkpoint to recompute its steps (the
    audit); the constructor takes the same choices as flags."""

    def __init__(self, run_dir, cfg: RunConfig | None = None, corpus_dir=None, backend: str = "cpu_ref",
                 resume: bool = False, log=None, readonly: bool = False, at_step: int | None = None):
        self._attach(run_dir, backend, log)
        rd, run_file = self.rundir, self.rundir.run_file
        if resume or readonly:
            if not rd.exists():
                raise TrainError(f"{run_file}: no run to resume (start one without --resume)", exit_code=2)
            if not readonly:
                rd.lock(error=TrainError)    # the one writer, before the ledger or a checkpoint is touched
            info = rd.info(error=TrainError)
            if info.contract_version != CONTRACT_VERSION:
                raise TrainError(f"{run_file}: written under contract v{info.contract_version}, "
                                 f"this is v{CONTRACT_VERSION}; it cannot be continued bit for bit", exit_code=2)
            try:
                self.cfg = info.config.check()
            except ConfigError as e:
                raise TrainError(f"{run_file}: {e}", exit_code=2) from None
            corpus_dir = info.corpus_dir
        else:
            if rd.exists():
                raise TrainError(f"{run_file}: a run already exists here; use --resume or another --out", exit_code=2)
            if cfg is None or corpus_dir is None:
                raise TrainError("a new run needs a config and a prepared corpus", exit_code=2)
            self.cfg = cfg.check()
        self._open_corpus(corpus_dir)
        if resume or readonly:
            for key, mine in (("manifest_fingerprint", self.fingerprint), ("genesis", self.genesis),
                              ("tokenizer_sha256", self.manifest.tokenizer_sha256)):
                if getattr(info, key) != mine:
                    raise TrainError(f"{run_file}: {key} {getattr(info, key)[:16]}… does not match the corpus "
                                     f"{self.corpus} ({mine[:16]}…)", exit_code=2)
        else:
            rd.lock(error=TrainError)        # the one writer, before run.json is written
            if rd.exists():
                raise TrainError(f"{run_file}: a run already exists here; use --resume or another --out", exit_code=2)
        self._build_model()
        self.readonly = readonly
        self.ledger = None if readonly else rd.ledger(self.genesis)
        if readonly:
            self.state = self._load_latest(at_step)
        elif resume:
            self.state = self._load_latest()
            self._cut_ledger()
        else:
            self._start_new()
        st = self.state              # the state in the backend's arrays (mx.array, cupy; numpy: itself)
        st.params, st.m, st.v = (self.ops.to_device(a) for a in (st.params, st.m, st.v))
        self.stream = Stream(self.corpus, self.tcfg.seed, self.model_cfg.seq_len, state=self.state.stream)

    def _start_new(self) -> None:
        """A new run's state (step 0), its checkpoint, then its run.json."""
        P = self.model_cfg.n_params()
        params = init_params(self.model_cfg, self.tcfg.seed)
        stream = Stream(self.corpus, self.tcfg.seed, self.model_cfg.seq_len)
        self.state = TrainState(0, 0, 0, 0, params, np.zeros(P, np.float32), np.zeros(P, np.float32), stream.state(),
                                self.gnmr.fresh() if self.gnmr else None)
        self._checkpoint()
        self._create_run()

    def _create_run(self) -> None:
        # run.json last: a run exists once the checkpoint it starts from does, so a crash or a full
        # disk before leaves no run, and the same command starts it again
        self.rundir.create(RunInfo(self.cfg, CONTRACT_VERSION, f"mlx-open1b {__version__}", str(self.corpus.resolve()),
                                   self.fingerprint, self.manifest.tokenizer_sha256, self.genesis))

    @classmethod
    def new(cls, run_dir, cfg: RunConfig, corpus_dir, backend: str = "cpu_ref", log=None) -> "Trainer":
        """Start a run in run_dir (which holds none yet): the checkpoint of step 0, then its run.json."""
        return cls(run_dir, cfg, corpus_dir, backend=backend, log=log)

    @classmethod
    def resume(cls, run_dir, backend: str = "cpu_ref", log=None) -> "Trainer":
        """Continue the run in run_dir from its latest checkpoint (its ledger cut back to it)."""
        return cls(run_dir, backend=backend, resume=True, log=log)

    @classmethod
    def replay(cls, run_dir, at_step: int | None = None, backend: str = "cpu_ref", log=None) -> "Trainer":
        """The run in run_dir at its newest checkpoint at or before at_step, read-only: its steps
        are recomputed (compute_step) and nothing is written."""
        return cls(run_dir, backend=backend, readonly=True, at_step=at_step, log=log)

    def _attach(self, run_dir, backend: str, log) -> None:
        """This process's handles: the run directory (nothing read yet), the log, the backend."""
        self.dir = pathlib.Path(run_dir)
        self.rundir = RunDir(run_dir)
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.backend = resolve_backend(backend)
        self.ops = get_backend(self.backend)
        self.step_times = StepTimes(self.dir / TIMING_FILE, self.log)    # beside the ledger, written by the writer
        self._probes = None

    def _open_corpus(self, corpus_dir) -> None:
        """The corpus of self.cfg: its manifest, fingerprint and the run's genesis hash."""
        self.model_cfg, self.tcfg = self.cfg.model, self.cfg.train
        self.corpus = pathlib.Path(corpus_dir)
        self.manifest = Manifest.load(self.corpus)
        if self.manifest.vocab_size != self.model_cfg.vocab_size:
            raise TrainError(f"corpus {self.corpus}: vocabulary {self.manifest.vocab_size}, model.vocab_size "
                             f"{self.model_cfg.vocab_size}", exit_code=2)
        self.fingerprint = manifest_fingerprint(self.manifest)
        self.genesis = genesis_hash(self.cfg.to_json(), self.fingerprint, self.manifest.tokenizer_sha256,
                                    CONTRACT_VERSION)

    # per-block recomputation in the backward (Model(recompute_blocks)): how this process computes,
    # never part of a run's configuration (the same bits either way); `open1b train --recompute-blocks`
    recompute_blocks = False

    def _build_model(self) -> None:
        host_malloc.tune()          # a step's host arrays reuse the previous step's memory (no bits change)
        self.model = Model(self.model_cfg, self.ops, precision=self.cfg.precision, attention_pv=self.cfg.attention_pv,
                           recompute_blocks=self.recompute_blocks)
        self.layout = ParamLayout(self.model_cfg)
        self.shapes = self.model_cfg.param_shapes()
        self.timing = {"hash": 0.0, "steps": 0.0, "n": 0, "gnmr": 0.0}   # seconds hashing / in compute_step / GNMR
        self.gnmr = None
        if self.cfg.gnmr is not None:
            self.gnmr = Controller(self.cfg.gnmr, self.model_cfg, self.tcfg.total_tokens)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self) -> pathlib.Path:
        st = self.state
        host = dataclasses.replace(st, params=arrays.to_host(st.params), m=arrays.to_host(st.m),
                                   v=arrays.to_host(st.v))          # one transfer, hashed and written
        # the state a step just left was hashed for its record (the same bytes: nothing writes the
        # state between a step's end and the next step); load_state checks them against the file
        known = getattr(self, "_hashed_state", None)
        hashes = known[1:] if known and known[0] == st.step else (param_hash(self, host.params), opt_hash(self, host))
        meta = self._checkpoint_meta(st, *hashes)
        tensors = {"params": (host.params, "bf16"), "m": (host.m, "f32"), "v": (host.v, "f32")}
        return save_checkpoint(self.dir, st.step, tensors, meta)

    def _checkpoint_meta(self, st: TrainState, params_hash: str, opt_state_hash: str) -> dict:
        """A checkpoint's meta.json fields for state st, given its "params" and "opt_state" hashes."""
        meta = {"step": st.step, "consumed": st.consumed, "adam_t": st.adam_t, "skip_left": st.skip_left,
                "stream": st.stream, "config": self.cfg.to_json(), "contract_version": CONTRACT_VERSION,
                "tokenizer_sha256": self.manifest.tokenizer_sha256, "genesis": self.genesis,
                "params_hash": params_hash, "opt_hash": opt_state_hash}
        if st.gnmr is not None:
            meta["gnmr"], meta["gnmr_hash"] = st.gnmr.to_json(), gnmr_hash(self, st.gnmr)
        return meta

    def _load_latest(self, at_or_before: int | None = None) -> TrainState:
        found = self.rundir.latest_checkpoint(at_or_before)
        if found is None:
            raise TrainError(f"{self.dir}: no checkpoint to resume from", exit_code=2)
        return self.load_state(found[1])

    def _cut_ledger(self) -> None:
        """A resumed run's ledger cut back to its checkpoint, once the checkpoint is verified."""
        self.ledger.truncate_after(self.state.step - 1)

    def load_state(self, path) -> TrainState:
        tensors, meta = load_checkpoint(path)
        if meta.get("genesis") != self.genesis:
            raise TrainError(f"{path}: checkpoint belongs to another run (genesis differs)", exit_code=2)
        st = TrainState(int(meta["step"]), int(meta["consumed"]), int(meta["adam_t"]), int(meta["skip_left"]),
                        *(np.array(tensors[k][0], copy=True) for k in ("params", "m", "v")), meta["stream"])
        if param_hash(self, st.params) != meta["params_hash"] or opt_hash(self, st) != meta["opt_hash"]:
            raise TrainError(f"{path}: tensors do not match the hashes recorded in its meta.json", exit_code=2)
        st.gnmr = self._gnmr_of(path, meta)
        return st

    def _gnmr_of(self, path, meta: dict):
        """The GNMR controller state in a checkpoint's meta (None without a controller), checked."""
        if self.gnmr is None:
            return None
        if "gnmr" not in meta:
            raise TrainError(f"{path}: meta.json has no GNMR controller state, but the run configures gnmr",
                             exit_code=2)
        try:
            g = GNMRState.from_json(meta["gnmr"], len(self.gnmr.units), self.gnmr.cfg.window)
        except GNMRError as e:
            raise TrainError(f"{path}: {e}", exit_code=2) from None
        if gnmr_hash(self, g) != meta.get("gnmr_hash"):
            raise TrainError(f"{path}: the GNMR state does not match gnmr_hash in its meta.json", exit_code=2)
        return g

    # ------------------------------------------------------------------ the loop
    # One loop for one process and for N workers; a distributed trainer overrides the hooks:
    # _reducer (who computes and owns what), _source_ces (held-out sources spread over the workers),
    # _checkpoint (moments gathered to rank 0), _run_hash (rank 0's, broadcast), _failures (a lost
    # worker named); `writer` is the one process that writes the ledger.
    @property
    def writer(self) -> bool:
        """This process appends the ledger records (rank 0 of a distributed run; not a replay)."""
        return self.ledger is not None

    def train(self, steps: int, progress=None) -> str:
        """Run until `steps` steps are completed in total; returns the run hash (on every worker).
        progress(record, tokens/s) runs in the writer after each record is appended."""
        t0, tok0 = time.perf_counter(), self.state.consumed
        for rec in self.records(steps):
            if progress and self.writer:
                dt = time.perf_counter() - t0
                progress(rec, (self.state.consumed - tok0) / dt if dt > 0 else 0.0)
        with self._failures(self.state.step):
            if self.state.step % self.tcfg.checkpoint_every:
                self._checkpoint()
            return self._run_hash()

    def step(self) -> dict:
        """Compute the next step, append its ledger record, checkpoint when due."""
        if self.readonly:      # a replay computes steps (compute_step) and never writes the run
            raise TrainError(f"{self.dir}: opened read-only (a replay); it cannot take training steps")
        (record,) = self.records(self.state.step + 1)
        return record

    #: an exception from a step may still append the previous step's record, whose hashes this
    #: process can complete alone (a distributed trainer's need every worker: they are left out)
    settles_alone = True
    #: False: each step's hashes are waited for at the end of the step (the same records, bytes and
    #: order; for measuring what the overlap saves, and for tests)
    overlap_hashes = True
    #: False: every microbatch's gradient in a new buffer instead of one the step's folds are done
    #: with, and the clip's copy of a gradient still being hashed in the hash stage's own buffer
    #: (step._grad_pool; the same bits: every element of a gradient buffer is written)
    recycle_grads = True

    def records(self, steps: int):
        """Take steps until `steps` are completed in total, yielding each step's record in step
        order, complete (in the writer: appended to the ledger), with the held-out CE where due and
        checkpoints where due. Step t's gradient and state hashes are computed in the background
        while step t+1 computes its microbatches (step.take_step); its record is completed before
        step t+1 writes the state, and appended after step t+1 is computed. A checkpoint waits for
        the records before it (a checkpoint is never ahead of the ledger), as does the last step.
        A crash (exception, KeyboardInterrupt, kill) loses at most the records not yet appended;
        resuming from the last checkpoint writes them again, the same bytes."""
        pending, done, spent = None, [], {}

        def settle():
            nonlocal pending
            if pending is not None:
                p, pending = pending, None
                rec = p.settle(self.timing)
                self._hashed_state = (rec["step"] + 1, rec["hashes"]["params"], rec["hashes"]["opt_state"])
                done.append(rec)

        def append() -> list:
            out = list(done)
            done.clear()
            for rec in out if self.writer else ():
                rec["hash"] = self.ledger.append(rec)
            return out

        try:
            while self.state.step < steps:
                t, t0, tok0 = self.state.step, time.perf_counter(), self.state.consumed
                with self._failures(t):
                    nxt = self._take_step(settle)
                    # pending (owed the ledger on an error) only once complete: an evaluation that
                    # fails leaves this step's record out rather than appended without its eval
                    self.add_eval(nxt.record)
                    pending = nxt
                    due = not self.readonly and self.state.step % self.tcfg.checkpoint_every == 0
                    if due or self.state.step >= steps or not self.overlap_hashes:
                        t1 = time.perf_counter()
                        settle()
                        self.timing["steps"] += time.perf_counter() - t1
                    written = append()
                    if due:
                        self._checkpoint()
                if self.writer:      # wall-clock beside the ledger: equal runs keep equal ledgers
                    spent[t] = (time.perf_counter() - t0, self.state.consumed - tok0)
                    for rec in written:
                        self.step_times.append(rec["step"], *spent.pop(rec["step"]))
                yield from written
        except BaseException as e:
            # what is still owed the ledger, where it is complete: the error that stopped the run
            # is the one reported (a failure to append leaves the ledger as it was)
            if pending is not None and isinstance(e, Exception) and self.settles_alone:
                with contextlib.suppress(Exception):
                    settle()        # the state it hashes is intact: nothing writes it before a settle
            with contextlib.suppress(Exception):
                append()
            raise

    def _take_step(self, settle):
        """take_step on this process's reducer, timed; settle: see take_step."""
        t0 = time.perf_counter()
        pending = take_step(self, self._reducer(), settle)
        self.timing["steps"] += time.perf_counter() - t0
        self.timing["n"] += 1
        return pending

    def _failures(self, t: int):
        """Where step t (or the final checkpoint, t = steps done) turns a lost worker into a
        TrainError; one process has no workers to lose."""
        return contextlib.nullcontext()

    def _run_hash(self) -> str:
        """The hash of the ledger's last record (the genesis before the first step)."""
        return self.ledger.last_hash or self.genesis

    def add_eval(self, record: dict) -> dict:
        """The step's record with the held-out CE added where the schedule has one (after every
        eval_every-th step); the audit replays it through here too."""
        if self.tcfg.eval_every and (self.state.step % self.tcfg.eval_every == 0):
            record["eval"] = self.heldout_ce()
        return record

    def compute_step(self) -> dict:
        """Advance the state by one optimizer step and return its ledger record (no hash yet),
        its state hashes computed before it returns (records() overlaps them with the next step)."""
        pending = self._take_step(None)
        t0 = time.perf_counter()
        record = pending.settle(self.timing)
        self.timing["steps"] += time.perf_counter() - t0
        return record

    def _reducer(self) -> Reduce:
        """This process's part in the step (step.py): every microbatch and every tensor."""
        return LocalReduce(self.shapes, self.model_cfg.n_params())

    def heldout_ce(self) -> dict:
        """Held-out CE per source (the first eval_windows probe windows) and the mixture CE
        (weighted by the configured shares)."""
        if self._probes is None:
            self._probes = {s.name: heldout_windows(self.corpus, s.name, self.model_cfg.seq_len,
                                                    self.tcfg.eval_windows) for s in self.manifest.sources}
        got = self._source_ces()
        out, mix = {}, 0.0
        for s in self.manifest.sources:
            if s.name in got:
                out[s.name] = got[s.name]
                mix += s.share * got[s.name]
        out["mixture"] = mix
        return out

    def _source_ces(self) -> dict:
        """{source: held-out CE} of every source with probe windows, in the manifest's order."""
        return {s.name: self._source_ce(s.name) for s in self.manifest.sources if len(self._probes[s.name])}

    def _source_ce(self, name: str) -> float:
        """A source's held-out CE: the mean over its probe windows, evaluated as one batch (with int8
        linear layers the activation scales are per tensor, so a window's CE depends on the windows
        batched with it)."""
        return float(np.mean(self.model.eval_loss(self.state.params, self._probes[name]), dtype=np.float64))
