"""The GNMR experiment (the shape of the seed's Table 1 at our scale): one preset trained on the
same tokens with a fixed low-cost path (int4, or int6 with low="int6"), GNMR low-cost/recovery
(int4 → int8, or int6 → int8), fixed int8 and bf16; per arm the held-out mixture CE, the final training CE, GNMR's promotion ratio (recovered
unit-steps / all unit-steps) and hit-maxO rate (steps whose active set is full), and a plot.

Each arm is an ordinary run directory under OUT (resumed if it exists), so every arm is itself
ledgered and auditable."""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from .config import RunConfig
from .fsutil import write_bytes_atomic, write_json_atomic
from .gnmr import GNMRConfig, units
from .report import Plot, trailing_mean
from .rundir import RunDir
from .train import Trainer

#: the low-cost precisions of the fixed-low and GNMR arms (CONTRACT.md §6.9's simulated paths)
LOWS = ("int4", "int6")


def arms_for(low: str = "int4") -> tuple[str, ...]:
    """The experiment's arms with low-cost precision `low`: fixed low, GNMR low -> int8, int8, bf16."""
    if low not in LOWS:
        raise ValueError(f"low: expected one of {', '.join(LOWS)}, got {low!r}")
    return (low, f"gnmr-{low}-int8", "int8", "bf16")


ARMS = arms_for("int4")
COLORS = {"int4": "#d62728", "gnmr-int4-int8": "#2ca02c", "int6": "#ff7f0e", "gnmr-int6-int8": "#9467bd",
          "int8": "#1f77b4", "bf16": "#222222"}


def arm_config(base: RunConfig, arm: str, gnmr: GNMRConfig, low: str = "int4") -> RunConfig:
    if arm == low and arm in LOWS:
        return dataclasses.replace(base, precision=low, gnmr=None)
    if arm == f"gnmr-{low}-int8" and low in LOWS:
        return dataclasses.replace(base, precision=low, gnmr=dataclasses.replace(gnmr, high="int8"))
    if arm in ("int8", "bf16"):
        return dataclasses.replace(base, precision=arm, gnmr=None)
    raise ValueError(f"unknown arm {arm!r} (arms: {', '.join(arms_for(low))})")


def _records(run: pathlib.Path) -> list[dict]:
    return RunDir(run).records()


def summarize_arm(run: pathlib.Path, cfg: RunConfig, steps: int | None = None) -> dict:
    """The arm's numbers over its first `steps` records (all when None): arms resumed past the
    experiment's length are compared over the same steps."""
    recs = _records(run)[:steps]
    evals = [(r["step"], r["eval"]["mixture"]) for r in recs if "eval" in r]
    tail = max(1, len(recs) // 10)
    out = {"steps": len(recs), "tokens": recs[-1]["tokens"] if recs else 0,
           "train_ce_tail": float(np.mean([r["ce"] for r in recs[-tail:]])) if recs else float("nan"),
           "heldout_ce": evals[-1][1] if evals else float("nan"),
           "heldout_step": evals[-1][0] if evals else None,
           "run_hash": recs[-1]["hash"] if recs else None}
    if cfg.gnmr is not None and recs:
        n_units = len(units(cfg.model, cfg.gnmr.mode))
        active = [len(r["gnmr"]["active"]) for r in recs]
        out["promotion_ratio"] = sum(active) / (len(recs) * n_units)
        out["hit_maxo_rate"] = (sum(a == cfg.gnmr.max_o for a in active) / len(recs)) if cfg.gnmr.max_o else 0.0
        out["units"] = n_units
        out["max_o"] = cfg.gnmr.max_o
    return out


def run_experiment(out_dir, base: RunConfig, corpus_dir, steps: int, gnmr: GNMRConfig, arms=None,
                   backend: str = "cpu_ref", log=print, low: str = "int4") -> dict:
    """Train (or resume) every arm (default: all of arms_for(low)) to `steps` steps; write
    summary.json and curves.svg; return the summary."""
    arms = arms_for(low) if arms is None else arms
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfgs = {arm: arm_config(base, arm, gnmr, low).check() for arm in arms}   # every arm valid before any trains
    used = next((c.gnmr for c in cfgs.values() if c.gnmr is not None), None)
    summary, curves = {"steps": steps, "preset": base.preset, "low": low,
                       "gnmr": dataclasses.asdict(used) if used is not None else None, "arms": {}}, {}
    for arm in arms:
        cfg = cfgs[arm]
        run = out / arm
        resume = RunDir(run).exists()
        tr = Trainer.resume(run, backend=backend) if resume else Trainer.new(run, cfg, corpus_dir, backend=backend)
        if resume and tr.cfg != cfg:
            raise ValueError(f"{run}: holds a run of another configuration; remove it or choose another --out")
        log(f"arm {arm}: steps {tr.state.step} -> {steps}")
        t0 = dict(tr.timing)
        def progress(rec, tok_s, arm=arm):
            if (rec["step"] + 1) % 50 == 0 or rec["step"] + 1 == steps:
                ev = f"  held-out {rec['eval']['mixture']:.4f}" if "eval" in rec else ""
                log(f"  {arm} step {rec['step'] + 1}/{steps}  ce {rec['ce']:.4f}{ev}  {tok_s:,.0f} tok/s")
        tr.train(steps, progress=progress)
        s = summarize_arm(run, cfg, steps)
        n = tr.timing["n"] - t0["n"]
        if n:
            s["step_seconds"] = (tr.timing["steps"] - t0["steps"]) / n
            if cfg.gnmr is not None:
                s["controller_fraction"] = (tr.timing["gnmr"] - t0["gnmr"]) / (tr.timing["steps"] - t0["steps"])
        summary["arms"][arm] = s
        recs = _records(run)[:steps]
        curves[arm] = ([r["step"] for r in recs], [r["ce"] for r in recs],
                       [(r["step"], r["eval"]["mixture"]) for r in recs if "eval" in r])
    write_json_atomic(out / "summary.json", summary)
    write_bytes_atomic(out / "curves.svg", plot(curves).encode())
    return summary


def plot(curves: dict) -> str:
    """Training CE (trailing mean) and held-out mixture CE per arm, two SVG panels stacked."""
    a = Plot("gnmr-train", "training CE (trailing mean of 20 steps)", "step", "CE (nats)")
    b = Plot("gnmr-heldout", "held-out mixture CE", "step", "CE (nats)")
    for arm, (xs, ce, ev) in curves.items():
        a.line(xs, trailing_mean(ce, 20), arm, COLORS.get(arm, "#888"))
        if ev:
            b.line([e[0] for e in ev], [e[1] for e in ev], arm, COLORS.get(arm, "#888"))
            b.points([e[0] for e in ev], [e[1] for e in ev], "", COLORS.get(arm, "#888"))
    W, H = Plot.W, Plot.H
    inner = a.svg().replace("<svg", '<svg y="0"', 1) + b.svg().replace("<svg", f'<svg y="{H}"', 1)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{2 * H}" '
            f'viewBox="0 0 {W} {2 * H}">{inner}</svg>')


def table(summary: dict) -> str:
    rows = [f"{'arm':16s} {'held-out CE':>11s} {'train CE':>9s} {'promotion':>9s} {'hit maxO':>8s} {'s/step':>7s}"]
    for arm, s in summary["arms"].items():
        pr = f"{100 * s['promotion_ratio']:.2f}%" if "promotion_ratio" in s else "-"
        hm = f"{100 * s['hit_maxo_rate']:.1f}%" if "hit_maxo_rate" in s else "-"
        rows.append(f"{arm:16s} {s['heldout_ce']:11.4f} {s['train_ce_tail']:9.4f} {pr:>9s} {hm:>8s} "
                    f"{s.get('step_seconds', float('nan')):7.3f}")
    return "\n".join(rows)
