"""`open1b train`, `open1b audit`, `open1b hash`."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import click

from mlx_open1b.checkpoint import CheckpointError
from mlx_open1b.cli import SEED, STEPS, THREADS, WORKERS, Path, Positive, backend_option, fail, step_range

from mlx_open1b.cli.config_cmd import TOKENIZER_VOCAB_HELP, config_options, vocab_of_tokenizer
from mlx_open1b.config import PRESETS, ConfigError, steps_for_tokens
from mlx_open1b.config_file import resolve as resolve_config
from mlx_open1b.data.format import DataError, Manifest
from mlx_open1b.data.prepare import DEFAULT_CORPUS_DIR, prepare_default
from mlx_open1b.fsutil import WriteError
from mlx_open1b.gnmr import GNMRConfig, GNMRError
from mlx_open1b.ledger import LedgerError
from mlx_open1b.rundir import RunDir, RunDirError
from mlx_open1b.step import TrainError

# What only a command runs is imported inside it: training, the distributed workers, the corpus pipeline,
# torch and the audit; `open1b --help` and the other commands start without loading it.


def _default_corpus() -> pathlib.Path:
    """The embedded default corpus, prepared once (data.prepare.prepare_default: idempotent, shared
    by the workers of a distributed run on one machine); a failed write ends the command."""
    path = DEFAULT_CORPUS_DIR
    try:
        prepare_default(path, lambda msg: click.echo(msg, err=True))
    except OSError as e:                 # WriteError included
        e = e if isinstance(e, WriteError) else WriteError(getattr(e, "filename", None) or path, e)
        fail(e.context(at="while preparing the default corpus",
                       intact="the corpus sources finished before it (prepare skips them); no run was started",
                       then="run the same command again"))
    return path


def _write_failed(e, out: pathlib.Path, nproc: int | None = None):
    """A failed write of a training run, with what is intact and the command that continues."""
    rd = RunDir(out)
    if rd.exists() and rd.checkpoints():
        then = (f"continue with `open1b train --resume --out {out}{f' --nproc {nproc}' if nproc else ''}` "
                f"(from the latest checkpoint, bit for bit)")
    else:
        then = f"run the same `open1b train` command again (no step of the run in {out} was kept)"
    return e.context(intact=rd.intact(), then=then)


class _Progress:
    """One status line on stderr: step, loss, lr, tokens/s, ETA; a full line at each eval."""

    def __init__(self, total: int, start: int):
        self.total, self.start, self.t0 = total, start, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, rec: dict, tok_s: float) -> None:
        done = rec["step"] + 1
        el = time.perf_counter() - self.t0
        eta = el / max(1, done - self.start) * (self.total - done)
        flags = "".join(c for c, f in (("C", rec["clipped"]), ("S", rec["skipped"]), ("!", rec["spike"])) if f)
        if rec.get("gnmr", {}).get("active"):
            flags += f"G{len(rec['gnmr']['active'])}"       # units on the GNMR recovery path this step
        line = (f"step {done}/{self.total}  loss {rec['loss']:.4f}  ce {rec['ce']:.4f}  lr {rec['lr']:.2e}  "
                f"|g| {rec['grad_norm']:.3f} {flags:3s} {tok_s:,.0f} tok/s  eta {eta:,.0f}s")
        if "eval" in rec:
            ev = "  ".join(f"{k} {v:.4f}" for k, v in rec["eval"].items())
            click.echo(("\r" if self.tty else "") + line + f"\n  held-out CE: {ev}", err=True)
        elif self.tty:
            click.echo("\r" + line, err=True, nl=False)
        elif done % 10 == 0 or done == self.total:
            click.echo(line, err=True)


@click.command()
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), default=None,
              help="model and recipe preset (default: the --config file's preset key, else tiny)")
@config_options
@click.option("--steps", type=STEPS, default=None, help="optimizer steps to reach (default: the preset's token budget)")
@backend_option(extra=("torch",), workers=True,
                help="auto: metal on Apple silicon, cuda on an NVIDIA GPU, else cpu_ref; cpu_ref: the C reference; "
                     "metal, cuda: the GPU kernels (bit-identical to cpu_ref; emulated on the CPU where no GPU is "
                     "present); torch: the non-reproducible PyTorch baseline")
@click.option("--out", "out", type=Path(file_okay=False), default="runs/tiny", show_default=True,
              help="run directory")
@click.option("--data", "data_dir", type=Path(file_okay=False), default=None,
              help="prepared corpus (default: the embedded default corpus, prepared on first use)")
@click.option("--tokenizer", "tokenizer_path", type=Path(exists=True, dir_okay=False), default=None,
              help="the corpus's tokenizer.json: checked against the SHA-256 the corpus (or, on --resume, the run) "
                   "records, before anything is written; a new run's " + TOKENIZER_VOCAB_HELP)
@click.option("--resume", is_flag=True, help="continue the run in --out from its latest checkpoint")
@click.option("--threads", type=THREADS, default=0, help="kernel threads (0: one per CPU); never changes a bit")
@click.option("--seed", type=SEED, default=None, help="override the preset's seed")
@click.option("--precision", type=click.Choice(["int8", "bf16", "int6", "int4"]), default=None,
              help="linear-layer arithmetic, overriding the preset's (tiny, small: bf16; open1b: int8): int8 "
                   "quantizes the attention Q/K/V/O and FFN GEMMs (CONTRACT.md §6.9)")
@click.option("--gnmr", "gnmr_spec", default=None, metavar="K=V,...",
              help="GNMR precision controller (CONTRACT.md §13) on an int8 run: risky units go to the bf16 path "
                   "for a step, e.g. --gnmr alpha=3,beta=2,maxO=2,lock=5,window=10,mode=op (keys: alpha, "
                   "alpha_init, warm, beta, maxO, lock, window, mode op|block, eps, high); '' for the defaults")
@click.option("--nproc", type=WORKERS, default=None,
              help="data-parallel workers on this machine (torchrun; gloo on CPUs, NCCL with --backend cuda on "
                   "GPUs): the same ledger, bit for bit, at any count from 1 to the microbatches per step")
@click.option("--dist-timeout", type=Positive("number of seconds"), default=120.0, show_default=True,
              help="seconds a worker waits for the others (rendezvous, each collective) before it stops with an "
                   "error; the long phases (opening the run, checkpoints, held-out evaluation) may take longer, "
                   "as long as the working ranks' heartbeats go on, up to a deadline from their size")
@click.option("--phase-timeout-scale", type=Positive("number"), default=1.0, show_default=True,
              help="multiplies the size-derived part of the long phases' deadlines (a slow disk or a shared "
                   "machine: raise it); see mlx_open1b/distributed/phases.py")
@click.option("--recompute-blocks", is_flag=True,
              help="keep only each block's input from the forward and recompute the block in the backward: less "
                   "device memory for about a third more compute; the same bits (not part of the run's config)")
def train(preset_name, config_file, sets, steps, backend, out, data_dir, tokenizer_path, resume, threads, seed,
          precision, gnmr_spec, nproc, dist_timeout, phase_timeout_scale=1.0, recompute_blocks=False,
          selftest_refusal=None):
    """Train a model; every step is hashed into OUT/ledger.jsonl."""
    from mlx_open1b import cpu_ref
    from mlx_open1b.distributed import in_worker_env
    from mlx_open1b.train import Trainer
    out = pathlib.Path(out)
    worker = in_worker_env()
    if nproc is not None and worker:
        fail("--nproc: this process is already a distributed worker (RANK and WORLD_SIZE are set); "
             "the launcher decides the worker count", 2)
    if (nproc is not None or worker) and backend == "torch":
        fail("--backend torch: the PyTorch baseline runs in one process (no --nproc, no torchrun)", 2)
    if not worker:
        cpu_ref.set_num_threads(threads)
    Trainer.recompute_blocks = recompute_blocks
    try:
        # the configuration first: a bad value stops the command before anything is written
        # on --resume, --set and --seed alone apply to the run's own config; a file or a preset is a whole config
        own = resume and config_file is None and preset_name is None
        if tokenizer_path is not None and not resume:
            # a tokenizer that is not the corpus's is named by its hash first (before the default corpus is made)
            _check_tokenizer(tokenizer_path, data_dir, False)
            sets = vocab_of_tokenizer(tokenizer_path, config_file, sets)
        cfg = resolve_config(preset_name, config_file, sets, base=_run_config(out) if own else None)
        if seed is not None:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed))
        if precision is not None:
            cfg = dataclasses.replace(cfg, precision=precision)
        if gnmr_spec is not None:
            if resume:
                fail("--gnmr: a run's controller is part of its configuration (genesis); it cannot be set on "
                     "--resume", 2)
            try:
                cfg = dataclasses.replace(cfg, gnmr=GNMRConfig.parse(gnmr_spec))
                cfg.check()
            except GNMRError as e:
                fail(e, 2)
        if resume:
            _check_resume_config(out, cfg)
        if data_dir is None and not resume:
            data_dir = _default_corpus()
        elif data_dir is not None and not resume:
            Manifest.load(data_dir)          # a prepared corpus, before a run directory is made
        if tokenizer_path is not None:
            _check_tokenizer(tokenizer_path, out if resume else data_dir, resume)
        if nproc is not None:
            return _launch(nproc, cfg, out, data_dir, resume, steps=steps, backend=backend, threads=threads,
                           seed=seed, precision=precision, preset_name=preset_name, timeout=dist_timeout,
                           gnmr_spec=gnmr_spec, config_file=config_file, sets=sets, phase_scale=phase_timeout_scale,
                           recompute_blocks=recompute_blocks)
        if worker:
            return _train_worker(cfg, out, data_dir, resume, steps, backend, threads, precision, dist_timeout,
                                 selftest_refusal, phase_scale=phase_timeout_scale)
        if backend == "torch":
            return _train_torch(cfg, data_dir, steps or 50, threads)
        tr = Trainer.resume(out, backend=backend) if resume else Trainer.new(out, cfg, data_dir, backend=backend)
        if resume and precision is not None and precision != tr.cfg.precision:
            fail(f"--precision {precision}: the run in {out} trains in {tr.cfg.precision} (part of its genesis "
                 f"hash); it cannot be changed on resume", 2)
        total = steps if steps is not None else steps_for_tokens(tr.tcfg, tr.model_cfg, tr.tcfg.total_tokens)
        click.echo(f"run {out}: preset {tr.cfg.preset} ({tr.cfg.precision}), {tr.model_cfg.n_params():,} parameters, "
                   f"steps {tr.state.step} -> {total}, backend {backend}, {cpu_ref.get_num_threads()} threads", err=True)
        h = tr.train(total, progress=_Progress(total, tr.state.step))
        click.echo("", err=True)
        click.echo(f"run hash {h}")
    except WriteError as e:
        click.echo("", err=True)
        fail(_write_failed(e, out))
    except TrainError as e:
        fail(e)
    except (DataError, ConfigError) as e:
        fail(e, 2)


def _check_tokenizer(tokenizer_path, where, resume: bool) -> None:
    """--tokenizer must be the one the corpus was prepared with (or the run recorded): both hashes named.
    where None: the default corpus, prepared with the shipped tokenizer."""
    from mlx_open1b.data.tokenizer import DEFAULT_TOKENIZER_SHA256, Tokenizer
    tok = Tokenizer.load(tokenizer_path)
    if where is None:
        if tok.sha256 != DEFAULT_TOKENIZER_SHA256:
            fail(f"--tokenizer {tokenizer_path}: SHA-256 {tok.sha256}, but without --data the run trains on the "
                 f"default corpus, prepared with the shipped tokenizer {DEFAULT_TOKENIZER_SHA256}; pass --data DIR, a "
                 f"corpus prepared with it (open1b data prepare --tokenizer {tokenizer_path} ...)", 2)
        return
    if resume:
        try:
            want, what = RunDir(where).info().tokenizer_sha256, f"the run in {where}"
        except RunDirError:
            return                       # the trainer reports an unreadable run
    else:
        want, what = Manifest.load(where).tokenizer_sha256, f"{pathlib.Path(where) / 'manifest.json'}"
    if tok.sha256 != want:
        fail(f"--tokenizer {tokenizer_path}: SHA-256 {tok.sha256}, but {what} records tokenizer {want}; "
             f"prepare the corpus with this tokenizer (open1b data prepare --tokenizer {tokenizer_path}) or pass "
             f"the one it was prepared with", 2)


def _run_config(out: pathlib.Path):
    """The config of the run in `out`, or None where there is no readable one (the trainer reports it)."""
    rd = RunDir(out)
    if not rd.exists():
        return None
    try:
        return rd.info().config
    except RunDirError:
        return None


def _check_resume_config(out: pathlib.Path, cfg) -> None:
    """A configuration given on --resume must be the run's own: every key is part of its genesis hash."""
    from mlx_open1b.config_file import first_difference
    have = _run_config(out)
    if have is None:
        return
    diff = first_difference(have, cfg)
    if diff is not None:
        key, was, given = diff
        fail(f"{key}: the run in {out} has {was!r}, the configuration given on --resume has {given!r}; a run's "
             f"configuration is part of its genesis hash and cannot change on resume (resume without "
             f"--config/--set/--preset/--seed to continue it as it is)", 2)


def _check_resume_precision(out: pathlib.Path, resume: bool, precision) -> None:
    """--precision on --resume must be the run's own (it is part of the genesis hash)."""
    rd = RunDir(out)
    if not (resume and precision is not None and rd.exists()):
        return
    try:
        have = rd.info().config.precision
    except RunDirError:
        return                       # the trainer reports an unreadable run.json
    if precision != have:
        fail(f"--precision {precision}: the run in {out} trains in {have} (part of its genesis hash); it cannot "
             f"be changed on resume", 2)


def _launch(nproc: int, cfg, out: pathlib.Path, data_dir, resume: bool, *, steps, backend, threads, seed,
            precision, preset_name, timeout, gnmr_spec=None, config_file=None, sets=(), phase_scale=1.0,
            recompute_blocks=False) -> None:
    """`open1b train --nproc N`: run this same command as N torchrun workers on this machine."""
    from mlx_open1b.distributed import ShardingError, check_worker_count
    from mlx_open1b.distributed.collectives import cpu_count
    if importlib.util.find_spec("torch") is None:
        fail("--nproc needs PyTorch (torch.distributed): pip install 'mlx-open1b[torch]'", 2)
    rd = RunDir(out)
    if rd.exists():                  # another process writing the run: refused here, before any worker starts
        rd.lock(error=RunDirError)   # (rank 0 takes the lock again when it opens the run)
        rd.unlock()
    if resume and rd.exists():
        try:
            cfg = rd.info().config
        except RunDirError as e:
            fail(e, 2)
        _check_resume_precision(out, resume, precision)
    try:
        check_worker_count(nproc, cfg.train.phases)
    except ShardingError as e:
        fail(f"--nproc {nproc}: {e}", 2)
    per = threads or max(1, cpu_count() // nproc)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "mlx_open1b.cli.main", "train", "--backend", backend, "--out", str(out),
           "--threads", str(per), "--dist-timeout", repr(float(timeout)),
           "--phase-timeout-scale", repr(float(phase_scale)),
           "--skip-selftest"]                 # this process checked every local device the workers use
    for text in sets:
        cmd += ["--set", text]
    for flag, val in (("--preset", preset_name),
                      ("--config", None if config_file is None else str(pathlib.Path(config_file).resolve())),
                      ("--steps", steps), ("--seed", seed), ("--precision", precision), ("--gnmr", gnmr_spec),
                      ("--data", None if data_dir is None else str(pathlib.Path(data_dir).resolve()))):
        if val is not None:
            cmd += [flag, str(val)]
    if resume:
        cmd.append("--resume")
    if recompute_blocks:
        cmd.append("--recompute-blocks")
    env = dict(os.environ, OMP_NUM_THREADS=str(per))
    rc = subprocess.call(cmd, env=env)
    if rc:
        ck = rd.checkpoints()
        where = (f"the last checkpoint in {out} is step {ck[-1][0]} (intact): continue with "
                 f"`open1b train --resume --out {out} --nproc N` at any valid N") if ck else f"{out} holds no checkpoint"
        fail(f"distributed training stopped (torchrun exit code {rc}; the workers' errors are above); {where}", 3)


def _train_worker(cfg, out: pathlib.Path, data_dir, resume: bool, steps, backend: str, threads: int,
                  precision, timeout: float, selftest_refusal: str | None = None, phase_scale: float = 1.0) -> None:
    """One torchrun worker of a distributed run (RANK, WORLD_SIZE, MASTER_ADDR... set by torchrun)."""
    from mlx_open1b import cpu_ref
    from mlx_open1b.distributed import DistError, run_worker
    from mlx_open1b.distributed.phases import PhaseTimeouts
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    prog = {}

    _check_resume_precision(out, resume, precision)

    def on_start(tr, total):
        click.echo(f"run {out}: preset {tr.cfg.preset} ({tr.cfg.precision}), {tr.model_cfg.n_params():,} parameters, "
                   f"steps {tr.state.step} -> {total}, backend {backend}, {tr.comm.world} workers "
                   f"({tr.comm.backend}), {cpu_ref.get_num_threads()} threads each", err=True)
        prog["p"] = _Progress(total, tr.state.step)

    try:
        h, tr = run_worker(out, cfg, data_dir, steps=steps, backend=backend, resume=resume, timeout=timeout,
                           threads=threads, on_start=on_start, progress=lambda rec, tok_s: prog["p"](rec, tok_s),
                           startup_error=None if selftest_refusal is None else (selftest_refusal, 3),
                           phase_timeouts=PhaseTimeouts(collective=timeout, scale=phase_scale))
    except WriteError as e:
        fail(f"[rank {rank}/{world}] {_write_failed(e, out, int(world) if world.isdigit() else None)}", e.exit_code,
             at_once=True)
    except (TrainError, DistError, DataError, ConfigError, CheckpointError, LedgerError) as e:
        fail(f"[rank {rank}/{world}] {e}", getattr(e, "exit_code", 2), at_once=True)  # never wait on a broken group
    if tr.comm.rank == 0:
        click.echo("", err=True)
        click.echo(f"run hash {h}")


def _train_torch(cfg, data_dir, steps: int, threads: int) -> None:
    """The PyTorch baseline (float32) on the same windows and recipe: losses and tokens/s, no
    ledger — it is not reproducible and serves as the speed and loss reference."""
    try:
        import torch
    except ImportError:
        fail("--backend torch needs PyTorch: pip install 'mlx-open1b[torch]'", 2)
    from mlx_open1b.data.stream import Stream
    from mlx_open1b.model import init_params
    from mlx_open1b.torch_model import TorchTrainer
    if threads:
        torch.set_num_threads(threads)
    t, m = cfg.train, cfg.model
    stream = Stream(data_dir, t.seed, m.seq_len)
    M, tokens = t.tokens_per_step(m, 0)
    tt = TorchTrainer(m, init_params(m, t.seed), betas=(t.beta1, t.beta2), eps=t.eps,
                      weight_decay=t.weight_decay, clip_norm=t.clip_norm)
    batches = (stream.next_windows(t.microbatch_seqs) for _ in iter(int, 1))
    for i in range(steps):
        res = tt.train_steps(batches, 1, t.lr_at((i + 1) * tokens), microbatches=M)
        if (i + 1) % 10 == 0 or i + 1 == steps:
            click.echo(f"torch step {i + 1}/{steps}  loss {res.losses[0]:.4f}  |g| {res.grad_norms[0]:.3f}  "
                       f"{res.tokens_per_s:,.0f} tok/s", err=True)


@click.command()
@click.argument("run", type=Path(exists=True, file_okay=False))
@click.option("--steps", "steps", required=True, help="range A-B (or a single step A)")
@backend_option()
@click.option("--auditor", default="anonymous", show_default=True, help="name written into the attestation")
@click.option("--out", "out", type=Path(dir_okay=False), default=None,
              help="attestation file (default: attestation-A-B.json in the current directory)")
def audit(run, steps, backend, auditor, out):
    """Replay steps A-B of RUN and certify them against its ledger."""
    from mlx_open1b.audit import audit as do_audit
    first, last = step_range(steps, "--steps")
    out = out or f"attestation-{first}-{last}.json"
    try:
        att = do_audit(run, first, last, backend=backend, auditor=auditor, out=out,
                       progress=(lambda t, n: click.echo(f"\rreplayed step {t}/{n}", err=True, nl=False))
                       if sys.stderr.isatty() else None)
    except (TrainError, CheckpointError, DataError) as e:
        fail(e)
    click.echo("", err=True)
    if att["verdict"] == "certified":
        click.echo(f"certified: steps {first}-{last} of {run} (replayed from checkpoint step "
                   f"{att['replayed_from_checkpoint_step']}), run hash {att['run_hash']}; attestation {out}")
        return
    if att["error"]:
        click.echo(f"NOT certified: {att['error']}; attestation {out}")
    else:
        m = att["first_mismatch"]
        click.echo(f"NOT certified: step {m['step']} differs in {m['component']} ({m['field']}: recorded "
                   f"{m['recorded']}, replayed {m['replayed']}); attestation {out}")
    sys.exit(1)


@click.command(name="hash")
@click.argument("run", type=Path(exists=True, file_okay=False))
def hash_(run):
    """Recompute RUN's run hash from its ledger and checkpoints."""
    from mlx_open1b.audit import run_hash
    try:
        r = run_hash(run)
    except (LedgerError, CheckpointError, TrainError) as e:
        fail(e, getattr(e, "exit_code", 1))
    click.echo(f"{r['run_hash']}  ({r['steps']} steps; checkpoints verified at steps {r['checkpoints_checked']})")
