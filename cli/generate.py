"""`open1b generate`: text from a run's checkpoint, the same tokens on every backend (mlx_open1b.generate)."""
from __future__ import annotations

import sys

import click

from mlx_open1b.cli import INT64_MAX, SEED, STEP, Path, Positive, backend_option, fail

MAX_TOKENS = click.IntRange(0, 1 << 20)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected token ids separated by commas, got {text!r}",
                                 param_hint="--prompt-ids") from None


@click.command()
@click.argument("run", type=Path(exists=True, file_okay=False))
@click.option("--step", type=STEP, default=None, help="checkpoint step (default: the latest)")
@click.option("--prompt", default=None, help="the text to continue")
@click.option("--prompt-ids", default=None, metavar="ID,ID,...", help="the prompt as token ids instead of text")
@click.option("--max-tokens", type=MAX_TOKENS, default=64, show_default=True,
              help="tokens to generate at most (generation also stops at the end-of-text token)")
@click.option("--temperature", type=Positive("temperature", zero=True), default=0.0, show_default=True,
              help="0: greedy (the largest logit, ties to the smallest id); > 0: sample from softmax(logits / T)")
@click.option("--top-k", type=click.IntRange(0, INT64_MAX), default=0, show_default=True,
              help="sample among the k largest logits only (0: all)")
@click.option("--seed", type=SEED, default=0, show_default=True, help="the seed of the Philox draws of sampling")
@click.option("--tokenizer", type=Path(exists=True, dir_okay=False), default=None,
              help="the run's tokenizer.json (default: the shipped one; its SHA-256 must be the run's)")
@click.option("--ids", "show_ids", is_flag=True, help="also print the generated token ids (stderr)")
@click.option("--kv-cache/--no-kv-cache", default=None,
              help="decode each new position alone on cached keys and values (default: in bf16 runs, where it "
                   "gives the full forward's bits; quantized runs recompute every window) or recompute every "
                   "window; the tokens are the same either way")
@backend_option()
def generate(run, step, prompt, prompt_ids, max_tokens, temperature, top_k, seed, tokenizer, show_ids, kv_cache,
             backend):
    """Continue a prompt with RUN's model; tokens are printed as they come.

    Greedy or sampled: a checkpoint, a prompt and a seed give the same tokens on every backend
    (the rule: mlx_open1b/generate.py)."""
    from mlx_open1b.generate import GenerateError, Generator, Sampling
    if (prompt is None) == (prompt_ids is None):
        fail("give the prompt as --prompt TEXT or as --prompt-ids ID,ID,... (one of them)", 2)
    try:
        g = Generator(run, step, backend=backend, tokenizer=tokenizer, kv_cache=kv_cache)
        ids = g.encode(prompt) if prompt is not None else g.check_ids(_ids(prompt_ids), "--prompt-ids")
        how = "greedy" if temperature == 0 else f"temperature {temperature}, top-k {top_k or 'all'}, seed {seed}"
        click.echo(f"{run} step {g.step}, backend {backend}, {how}, "
                   f"{'KV cache' if g.kv_cache else 'recompute every window'}", err=True)

        def show(text):
            click.echo(text, nl=False)
            sys.stdout.flush()

        out = g.generate(ids, max_tokens, Sampling(temperature, top_k, seed), on_text=show)
    except GenerateError as e:
        click.echo("", err=True)
        fail(e)
    click.echo("")
    if show_ids:
        click.echo("ids: " + ",".join(map(str, out)), err=True)
