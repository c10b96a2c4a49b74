"""`open1b report`, `open1b export`, `open1b eval`: what a user of a published run needs."""
from __future__ import annotations

import json

import click

from mlx_open1b.checkpoint import CheckpointError
from mlx_open1b.cli import INT64_MAX, Path, STEP, backend_option, fail
from mlx_open1b.config import ConfigError
from mlx_open1b.data.format import DataError
from mlx_open1b.fsutil import WriteError, write_json_atomic

# What only a command runs is imported inside it: the report, the export and the evaluation; `open1b --help`
# and the other commands start without loading it.


@click.command()
@click.argument("run", type=Path(exists=True, file_okay=False))
@click.option("--out", type=Path(file_okay=False), default=None,
              help="output directory (default: RUN/report); the page is OUT/index.html")
@click.option("--max-checkpoints", type=click.IntRange(2, INT64_MAX), default=64, show_default=True,
              help="weight norms from at most this many checkpoints (evenly spaced; each is read whole)")
@click.option("--png/--no-png", default=True, show_default=True,
              help="also write each figure as OUT/<figure id>.png, linked from the page")
@click.option("--png-scale", type=click.IntRange(1, 4), default=2, show_default=True,
              help="PNG pixels per panel unit (the panels are 760 x 300 units)")
@click.option("--figures", "engine", type=click.Choice(["auto", "matplotlib", "builtin"]), default="auto",
              show_default=True,
              help="matplotlib: figures drawn by matplotlib (the report extra), the page shows their PNGs; builtin: "
                   "no plotting library, the page shows inline SVG; auto: matplotlib where it is installed")
def report(run, out, max_checkpoints, png, png_scale, engine):
    """Write a self-contained HTML report of RUN: loss, gradient-norm, schedule and weight-norm
    figures (one PNG per figure next to the page, too) and the run summary, all from the verified
    ledger and checkpoints."""
    from mlx_open1b.report import ReportError, figure_engine, write_report
    try:
        used = figure_engine(engine)
        if engine == "auto" and used == "builtin":
            click.echo("note: matplotlib is not installed; the figures are the built-in ones (pip install "
                       "'mlx-open1b[report]' for matplotlib's)", err=True)
        path = write_report(run, out, max_checkpoints, png, png_scale, used)
    except WriteError as e:
        fail(e.context(intact="the run (a report only reads it); each file of the report is replaced whole, so "
                              "every one there is complete",
                       then=f"run `open1b report {run}{f' --out {out}' if out else ''}` again"))
    except (ReportError, CheckpointError, ConfigError) as e:
        fail(e)
    click.echo(f"report {path}")


@click.command()
@click.argument("run", type=Path(exists=True, file_okay=False))
@click.option("--step", type=STEP, default=None, help="checkpoint step (default: the latest checkpoint)")
@click.option("--format", "fmt", type=click.Choice(["mlx", "hf"]), default="mlx", show_default=True,
              help="mlx: the model program's tensor names + model.py (mlx.nn); hf: Hugging Face Llama names + "
                   "model.embed_norm + the transformers model code")
@click.option("--out", type=Path(file_okay=False), required=True, help="new output directory")
@click.option("--tokenizer", type=Path(exists=True, dir_okay=False), default=None,
              help="the run's tokenizer.json to ship with it (default: the shipped one, when it is the run's; its "
                   "SHA-256 must be the run's)")
@click.option("--float-model", is_flag=True,
              help="export a quantized (int8/int6/int4) run's master weights all the same, as a float model that "
                   "does not compute the run's quantized GEMMs (its logits are not the run's; config.json and "
                   "README.md say so); no effect on a bf16 run")
def export(run, step, fmt, out, tokenizer, float_model):
    """Export a checkpoint's weights (bf16, bit-identical) with config.json and tokenizer.json
    (bf16 runs; a quantized run only with --float-model: the float models do not compute its GEMMs).

    \b
    Loads in plain MLX (mx.load; mlx_open1b.export.mlx_forward runs it) and in PyTorch
    (mlx_open1b.export.torch_model -> mlx_open1b.torch_model.TorchModel); --format mlx also ships
    model.py, an mlx.nn model that needs only mlx (model.load(OUT), model.generate); --format hf
    ships the model code, so transformers' AutoModelForCausalLM.from_pretrained(OUT,
    trust_remote_code=True) loads it and generates. What does NOT map onto
    HF / mlx-lm Llama, so the config says model_type "open1b", not "llama":
      - the RMSNorm on the embedding output (embed_norm),
      - QK-norm: gain-free per-head RMSNorm of q and k before RoPE (= Qwen3's q_norm/k_norm with
        all-ones weights),
      - sliding-window attention on local layers (layer_types / sliding_window),
      - z-loss (training only).
    """
    from mlx_open1b.export import ExportError, export as do_export
    try:
        path = do_export(run, step, fmt, out, tokenizer, float_model)
    except WriteError as e:
        again = (f"open1b export {run}{f' --step {step}' if step is not None else ''} --format {fmt} --out {out}"
                 f"{f' --tokenizer {tokenizer}' if tokenizer else ''}{' --float-model' if float_model else ''}")
        fail(e.context(intact=f"the run (an export only reads it); nothing is left under {out} (an export is "
                              f"renamed into place only when complete)", then=f"run `{again}` again"))
    except ExportError as e:
        fail(e)
    click.echo(f"exported {path} ({fmt})")
    if float_model:
        said = json.loads((path / "config.json").read_text())["source"].get("float_model")
        if said:
            click.echo(f"note: {said}", err=True)
    if not (path / "tokenizer.json").exists():      # weights without a tokenizer: other tools cannot encode text
        click.echo(f"note: no tokenizer.json in {path}: the run was trained with its own tokenizer; pass it as "
                   f"--tokenizer F to ship it", err=True)


@click.command(name="eval")
@click.argument("run", type=Path(exists=True, file_okay=False))
@click.option("--step", type=STEP, default=None, help="checkpoint step (default: the latest checkpoint)")
@click.option("--tasks", default="arith,facts,code,text", show_default=True,
              help="comma-separated offline tasks shipped with the package: arith, facts, code (multiple choice), "
                   "text (rolling log-likelihood)")
@backend_option()
@click.option("--limit", type=click.IntRange(1, INT64_MAX), default=None, help="at most this many items per task")
@click.option("--tokenizer", type=Path(exists=True, dir_okay=False), default=None,
              help="the run's tokenizer.json (default: the shipped one; the run's hash must match it)")
@click.option("--json", "json_out", type=Path(dir_okay=False), default=None, help="also write the results as JSON")
def eval_(run, step, tasks, backend, limit, tokenizer, json_out):
    """Evaluate a checkpoint of RUN on the offline task set (the lm-eval adapter is
    mlx_open1b.evaluate.Open1BLM; with lm_eval installed it is registered as model "open1b")."""
    from mlx_open1b.evaluate import TASKS, EvalError, Open1BLM, evaluate
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        what = f"unknown task {unknown[0]!r}" if unknown else "no task given"
        raise click.BadParameter(f"{what} (tasks: {', '.join(TASKS)})", param_hint="--tasks")
    try:
        lm = Open1BLM(run, step, backend, tokenizer=tokenizer)
        res = evaluate(lm, names, limit)
    except (EvalError, DataError) as e:
        fail(e)
    click.echo(f"{run} checkpoint step {lm.step} on {backend} (run hash {lm.run_hash})")
    for name, m in res.items():
        click.echo(f"  {name:6s} " + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in m.items()))
    if json_out:
        try:
            write_json_atomic(json_out, {"run": str(run), "step": lm.step, "backend": backend,
                                         "run_hash": lm.run_hash, "results": res})
        except WriteError as e:
            fail(e.context(intact="the results printed above", then="run the same eval with a --json that can be written"))
