"""`open1b audit`: replay and certify steps (`audit RUN --steps A-B`, also `audit replay`), and the
collective audit: `audit plan`, `audit run`, `audit report`, `audit keygen`."""
from __future__ import annotations

import os
import sys

import click

from mlx_open1b.checkpoint import CheckpointError
from mlx_open1b.cli import INT64_MAX, Path, backend_option, fail, step_range

from mlx_open1b.cli.train import audit as replay_cmd
from mlx_open1b.data.format import DataError
from mlx_open1b.fsutil import write_json_atomic
from mlx_open1b.step import TrainError

# What only a command runs is imported inside it: the audit package (the replay and the attestations);
# `open1b --help` and the other commands start without loading it.

SUBCOMMANDS = ("replay", "plan", "run", "report", "keygen")


class _AuditGroup(click.Group):
    """A group that keeps the original form `open1b audit RUN --steps A-B` working: anything that
    is not a subcommand name is handed to `audit replay`. A run directory that happens to be named
    like a subcommand is still taken as a run when it exists and --steps is given
    (`open1b audit run --steps 3` with ./run a run directory); `./run` always works."""

    def parse_args(self, ctx, args):
        if args and args[0] not in ("-h", "--help"):
            legacy = args[0] not in self.commands or (
                args[0] != "replay" and "--steps" in args and os.path.isdir(args[0]))
            if legacy:
                args = ["replay", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_AuditGroup)
def audit() -> None:
    """Replay and certify steps of a run; plan, run and merge a collective audit.

    \b
      open1b audit RUN --steps A-B            replay and certify steps A-B (same as `audit replay`)
      open1b audit plan RUN --auditors K      split the run into checkpoint-aligned ranges
      open1b audit run RUN --plan P --auditor I --key me.pem
                                              certify auditor I's range, write a (signed) attestation
      open1b audit report RUN A1.json A2.json …
                                              verify attestations, print coverage, say whether the
                                              run hash is fully certified
    """


audit.add_command(replay_cmd, name="replay")


def _errors():
    from mlx_open1b.audit import AttestError
    return AttestError, CheckpointError, DataError, TrainError


@audit.command("plan")
@click.argument("run", type=Path(exists=True, file_okay=False))
@click.option("--auditors", "-k", type=click.IntRange(1, INT64_MAX), required=True, help="number of auditors (ranges)")
@click.option("--overlap", type=click.IntRange(0, INT64_MAX), default=0, show_default=True,
              help="steps each range extends into the next one (certified twice)")
@click.option("--out", type=Path(dir_okay=False), default="audit-plan.json", show_default=True,
              help="plan file (JSON)")
def plan_cmd(run, auditors, overlap, out):
    """Split RUN into K checkpoint-aligned ranges, one per auditor, and write the plan."""
    from mlx_open1b.audit import write_plan
    try:
        plan = write_plan(run, auditors, overlap, out)
    except _errors() as e:
        fail(e)
    click.echo(f"plan {out}: {plan['steps']} steps of {run} (run hash {plan['run_hash'][:16]}…), "
               f"{auditors} auditors, overlap {overlap}")
    for r in plan["ranges"]:
        click.echo(f"  auditor {r['auditor']}: steps {r['first']}-{r['last']} ({r['last'] - r['first'] + 1} steps, "
                   f"from checkpoint ckpt-{r['checkpoint']:08d})")


def _parse_range(text: str) -> tuple[int, int]:
    """A:B (or A-B, or A) as (A, B); click.BadParameter naming --range otherwise."""
    return step_range(text, "--range", ":" if ":" in text or "-" not in text.strip() else "-")


@audit.command("run")
@click.argument("run", type=Path(exists=True, file_okay=False))
@click.option("--range", "range_", default=None, metavar="A:B", help="steps A..B (inclusive) to certify")
@click.option("--plan", "plan_file", type=Path(exists=True, dir_okay=False), default=None,
              help="a plan from `audit plan`; with --auditor I, certify that auditor's range")
@click.option("--auditor", "auditor_index", type=click.IntRange(0, INT64_MAX), default=None,
              help="auditor index I in the plan")
@click.option("--name", default="anonymous", show_default=True, help="auditor name written into the attestation")
@backend_option()
@click.option("--key", type=Path(exists=True, dir_okay=False), default=None,
              help="Ed25519 private key (PEM, from `audit keygen`) to sign the attestation")
@click.option("--out", type=Path(dir_okay=False), default=None,
              help="attestation file (default: attestation-A-B.json in the current directory)")
def run_cmd(run, range_, plan_file, auditor_index, name, backend, key, out):
    """Replay a range of RUN, certify it against the ledger and write a sealed attestation."""
    from mlx_open1b.audit import certify
    first = last = None
    if range_ is not None:
        first, last = _parse_range(range_)
    try:
        att = certify(run, first, last, backend=backend, auditor=name, key=key, plan_file=plan_file,
                      auditor_index=auditor_index,
                      progress=(lambda t, n: click.echo(f"\rreplayed step {t}/{n}", err=True, nl=False))
                      if sys.stderr.isatty() else None)
    except _errors() as e:
        fail(e)
    a, b = att["range"]
    out = out or f"attestation-{a}-{b}.json"
    write_json_atomic(out, att)
    signed = " (signed)" if att.get("signature") else ""
    if att["verdict"] == "certified":
        click.echo(f"certified: steps {a}-{b} of {run} on {backend}, run hash {att['run_hash']}; "
                   f"attestation {out}{signed}")
        return
    m = att["first_mismatch"]
    why = att["error"] or (f"step {m['step']} differs in {m['component']} ({m['field']}: recorded "
                           f"{m['recorded']}, replayed {m['replayed']})")
    click.echo(f"NOT certified: {why}; attestation {out}{signed}")
    sys.exit(1)


@audit.command("report")
@click.argument("run", type=Path(exists=True, file_okay=False))
@click.argument("attestations", nargs=-1, required=True, type=Path(dir_okay=False))
@click.option("--plan", "plans", multiple=True, type=Path(dir_okay=False),
              help="plan(s) the attestations follow: checked against the run and each other; planned ranges "
                   "without an attestation are listed")
@click.option("--trust", multiple=True, metavar="KEY",
              help="accept only attestations signed by this Ed25519 key (64 hex digits or a PEM file; repeatable)")
@click.option("--require-signed", is_flag=True, help="reject unsigned attestations")
@click.option("--allow-prefix", is_flag=True,
              help="accept attestations made while the ledger was shorter (its run hash then was a record of this ledger)")
@click.option("--json", "json_out", type=Path(dir_okay=False), default=None, help="also write the report as JSON")
def report_cmd(run, attestations, plans, trust, require_signed, allow_prefix, json_out):
    """Verify ATTESTATIONS against RUN's ledger and merge them into a coverage table.

    Exit status 0 only when every step is certified, nobody disagrees and no attestation was
    rejected; 1 otherwise; 2 for bad input (unreadable files, plans of another ledger)."""
    from mlx_open1b.audit import format_report, report
    try:
        rep = report(run, list(attestations), plans, list(trust) or None, require_signed, allow_prefix)
    except _errors() as e:
        fail(e)
    click.echo(format_report(rep))
    if json_out:
        write_json_atomic(json_out, rep)
    if not rep["fully_certified"] or rep["rejected"]:
        sys.exit(1)


@audit.command("keygen")
@click.argument("out", type=Path(dir_okay=False))
def keygen_cmd(out):
    """Write a new Ed25519 private key (PEM) to OUT for signing attestations; print its public key."""
    from mlx_open1b.audit import generate_key
    try:
        pub = generate_key(out)
    except _errors() as e:
        fail(e)
    click.echo(pub)
    click.echo(f"private key written to {out} (keep it; publish the public key above)", err=True)

