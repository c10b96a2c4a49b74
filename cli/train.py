"""`open1b train`, `open1b audit`, `open1b hash`."""
from __future__ import annotations

import pathlib
import sys
import time

import click

from mlx_open1b.config import PRESETS, ConfigError, preset
from mlx_open1b.data.format import DataError


def _fail(msg: str, code: int) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)


def _default_corpus(path: pathlib.Path) -> pathlib.Path:
    """Prepare the embedded default corpus once (idempotent: a finished one is reused)."""
    from mlx_open1b.data.corpus import default_sources
    from mlx_open1b.data.prepare import prepare
    from mlx_open1b.data.tokenizer import Tokenizer
    if not (path / "manifest.json").exists():
        click.echo(f"preparing the embedded default corpus in {path} (once, ~10 s)", err=True)
    prepare(default_sources(), path, Tokenizer.load(None))
    return path


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
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True,
              help="model and recipe preset")
@click.option("--steps", type=int, default=None, help="optimizer steps to reach (default: the preset's token budget)")
@click.option("--backend", type=click.Choice(["cpu_ref", "metal", "cuda", "torch"]), default="cpu_ref", show_default=True,
              help="cpu_ref: the reproducible C reference; metal, cuda: the GPU kernels (bit-identical to cpu_ref; "
                   "emulated on the CPU where no GPU is present); torch: the non-reproducible PyTorch baseline")
@click.option("--out", "out", type=click.Path(file_okay=False), default="runs/tiny", show_default=True,
              help="run directory")
@click.option("--data", "data_dir", type=click.Path(file_okay=False), default=None,
              help="prepared corpus (default: the embedded default corpus, prepared on first use)")
@click.option("--resume", is_flag=True, help="continue the run in --out from its latest checkpoint")
@click.option("--threads", type=int, default=0, help="kernel threads (0: one per CPU); never changes a bit")
@click.option("--seed", type=int, default=None, help="override the preset's seed")
@click.option("--precision", type=click.Choice(["int8", "bf16"]), default=None,
              help="linear-layer arithmetic, overriding the preset's (tiny, small: bf16; open1b: int8): int8 "
                   "quantizes the attention Q/K/V/O and FFN GEMMs (CONTRACT.md §6.9)")
def train(preset_name, steps, backend, out, data_dir, resume, threads, seed, precision):
    """Train a model; every step is hashed into OUT/ledger.jsonl."""
    import dataclasses

    from mlx_open1b import cpu_ref
    from mlx_open1b.config import steps_for_tokens
    from mlx_open1b.train import TrainError, Trainer
    cpu_ref.set_num_threads(threads)
    out = pathlib.Path(out)
    try:
        if data_dir is None and not resume:
            data_dir = _default_corpus(pathlib.Path("runs") / "data-default")
        cfg = preset(preset_name)
        if seed is not None:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed))
        if precision is not None:
            cfg = dataclasses.replace(cfg, precision=precision)
        if backend == "torch":
            return _train_torch(cfg, data_dir, steps or 50, threads)
        tr = Trainer(out, None if resume else cfg, data_dir, backend=backend, resume=resume)
        if resume and precision is not None and precision != tr.cfg.precision:
            _fail(f"--precision {precision}: the run in {out} trains in {tr.cfg.precision} (part of its genesis "
                  f"hash); it cannot be changed on resume", 2)
        total = steps if steps is not None else steps_for_tokens(tr.tcfg, tr.model_cfg, tr.tcfg.total_tokens)
        click.echo(f"run {out}: preset {tr.cfg.preset} ({tr.cfg.precision}), {tr.model_cfg.n_params():,} parameters, "
                   f"steps {tr.state.step} -> {total}, backend {backend}, {cpu_ref.get_num_threads()} threads", err=True)
        h = tr.train(total, progress=_Progress(total, tr.state.step))
        click.echo("", err=True)
        click.echo(f"run hash {h}")
    except TrainError as e:
        _fail(str(e), e.exit_code)
    except (DataError, ConfigError) as e:
        _fail(str(e), 2)


def _train_torch(cfg, data_dir, steps: int, threads: int) -> None:
    """The PyTorch baseline (float32) on the same windows and recipe: losses and tokens/s, no
    ledger — it is not reproducible and serves as the speed and loss reference."""
    try:
        import torch
    except ImportError:
        _fail("--backend torch needs PyTorch: pip install 'mlx-open1b[torch]'", 2)
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
@click.argument("run", type=click.Path(exists=True, file_okay=False))
@click.option("--steps", "steps", required=True, help="range A-B (or a single step A)")
@click.option("--backend", type=click.Choice(["cpu_ref", "metal", "cuda"]), default="cpu_ref", show_default=True)
@click.option("--auditor", default="anonymous", show_default=True, help="name written into the attestation")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="attestation file (default: attestation-A-B.json in the current directory)")
def audit(run, steps, backend, auditor, out):
    """Replay steps A-B of RUN and certify them against its ledger."""
    from mlx_open1b.audit import audit as do_audit
    from mlx_open1b.checkpoint import CheckpointError
    from mlx_open1b.train import TrainError
    try:
        a, _, b = steps.partition("-")
        first, last = int(a), int(b or a)
    except ValueError:
        _fail(f"--steps: expected A-B or A, got {steps!r}", 2)
    out = out or f"attestation-{first}-{last}.json"
    try:
        att = do_audit(run, first, last, backend=backend, auditor=auditor, out=out,
                       progress=(lambda t, n: click.echo(f"\rreplayed step {t}/{n}", err=True, nl=False))
                       if sys.stderr.isatty() else None)
    except (TrainError, CheckpointError, DataError) as e:
        _fail(str(e), getattr(e, "exit_code", 2))
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
@click.argument("run", type=click.Path(exists=True, file_okay=False))
def hash_(run):
    """Recompute RUN's run hash from its ledger and checkpoints."""
    from mlx_open1b.audit import run_hash
    from mlx_open1b.checkpoint import CheckpointError
    from mlx_open1b.ledger import LedgerError
    from mlx_open1b.train import TrainError
    try:
        r = run_hash(run)
    except (LedgerError, CheckpointError, TrainError) as e:
        _fail(str(e), getattr(e, "exit_code", 1))
    click.echo(f"{r['run_hash']}  ({r['steps']} steps; checkpoints verified at steps {r['checkpoints_checked']})")
