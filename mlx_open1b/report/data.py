"""The report's data: a run read from its verified artifacts, and the numbers of its tables.

`load_run_data` reads run.json (the config), the ledger (chain verified first; a broken ledger is
an error, never a partial report) and the checkpoints (each one's parameter hash checked against
the ledger before its weights are used); `summarize` (paper Table 7), `milestones` (Table 8) and
`grad_stats` (Table 9) compute from it with plain numpy.
"""
from __future__ import annotations

import pathlib

import numpy as np

from ..checkpoint import CheckpointError, load_checkpoint
from ..errors import Open1bError
from ..model import ParamLayout
from ..rundir import RunDir, RunInfo
from ..steptimes import TIMING_FILE, read_step_times


class ReportError(Open1bError):
    """The run cannot be reported on; the message names the file and step."""


def load_run_data(run_dir, max_checkpoints: int = 64) -> dict:
    """run.json (info: a RunInfo), the verified ledger records, the step times (RUN/timing.jsonl,
    written beside the ledger), and per-checkpoint weight norms."""
    rd = RunDir(run_dir)
    run = rd.path
    info, run_hash, records = rd.verified_records(
        ReportError, "report", unverified="the run's ledger does not verify, no report is written")
    times = _step_times(run, records)
    norms = checkpoint_norms(run, info, records, max_checkpoints)
    return {"dir": run, "info": info, "records": records, "run_hash": run_hash, "times": times, "norms": norms}


def _step_times(run: pathlib.Path, records: list) -> dict[int, float]:
    """{step: seconds}: records' own "step_seconds"/"seconds" fields (the trainer's ledger has none),
    then the trainer's RUN/timing.jsonl (steptimes.py), then a user's RUN/metrics.jsonl of the same
    form; a later source wins."""
    out = {}
    for r in records:
        for k in ("step_seconds", "seconds"):
            if isinstance(r.get(k), (int, float)):
                out[r["step"]] = float(r[k])
                break
    for name in (TIMING_FILE, "metrics.jsonl"):
        if (run / name).exists():
            out.update(read_step_times(run / name, ReportError))
    return out


def checkpoint_norms(run: pathlib.Path, info: RunInfo, records: list, max_checkpoints: int = 64) -> list[dict]:
    """[{"step", "tensors": {name: Frobenius norm}}] for the checkpoints (at most max_checkpoints,
    evenly spaced, the first and the last always), each one's file SHA-256 and parameter hash
    checked against its meta.json and the ledger (params after step s-1) before its weights are used."""
    cfg = info.config.model
    layout = ParamLayout(cfg)
    by_step = {r["step"]: r for r in records}
    out = []
    ckpts = [(s, p) for s, p in RunDir(run).checkpoints() if s == 0 or s - 1 in by_step]   # checkable ones
    if len(ckpts) > max_checkpoints >= 2:
        keep = sorted({round(i * (len(ckpts) - 1) / (max_checkpoints - 1)) for i in range(max_checkpoints)})
        ckpts = [ckpts[i] for i in keep]
    for step, path in ckpts:
        try:
            tensors, meta = load_checkpoint(path, verify_tensors=False)
        except CheckpointError as e:
            raise ReportError(f"{e}", exit_code=1) from None
        if meta.get("genesis") != info.genesis:
            raise ReportError(f"{path}: belongs to another run (genesis differs)", exit_code=1)
        if step > 0 and meta.get("params_hash") != by_step[step - 1]["hashes"]["params"]:
            raise ReportError(f"{path}: parameter hash differs from the ledger's after step {step - 1}", exit_code=1)
        bits = tensors["params"][0]
        vals = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
        norms = {}
        for t in layout:
            v = vals[t.offset:t.offset + t.size].astype(np.float64)
            norms[t.name] = float(np.sqrt(np.dot(v, v)))
        out.append({"step": step, "tokens": int(meta.get("consumed", 0)), "tensors": norms})
    return out


# ------------------------------------------------------------------------------- numbers
def trailing_mean(ys, w: int) -> np.ndarray:
    """Mean of the last w values (fewer at the start)."""
    y = np.asarray(ys, float)
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(0, i - w)
    return (c[i] - c[lo]) / (i - lo)


def windows(n: int) -> tuple[int, int]:
    """Trailing-mean windows (short, long) for n steps (the paper: 100 and 2,000 of 80,957)."""
    return max(2, round(n / 100)), max(5, round(n / 20))


def _pct(a, q):
    return float(np.percentile(np.asarray(a, float), q)) if len(a) else float("nan")


def grad_stats(recs: list, clip: float) -> dict:
    g = np.array([r["grad_norm"] for r in recs], float)
    if not len(g):
        return {"steps": 0}
    i = int(np.nanargmax(g))
    return {"steps": len(g), "median": _pct(g, 50), "mean": float(np.mean(g)), "p95": _pct(g, 95),
            "p99": _pct(g, 99), "max": float(g[i]), "max_step": recs[i]["step"],
            "clipped": int(sum(r["clipped"] for r in recs)), "clip_rate": sum(r["clipped"] for r in recs) / len(g),
            "above_2": int((g > 2).sum()), "above_clip": int((g > clip).sum()),
            "skipped": int(sum(r["skipped"] for r in recs)), "spikes": int(sum(r["spike"] for r in recs))}


def summarize(data: dict) -> dict:
    """The run summary (paper Table 7) from the ledger; plain numbers."""
    recs, info = data["records"], data["info"]
    cfg = info.config
    n = len(recs)
    _, wl = windows(n)
    evals = [r for r in recs if "eval" in r]
    ce = [r["ce"] for r in recs]
    times = [data["times"][r["step"]] for r in recs if r["step"] in data["times"]]
    # tokens/s over the timed steps: each step's tokens (the first record's only from step 0, where
    # nothing was consumed before it) over their seconds
    before = [0 if recs[0]["step"] == 0 else None] + [r["tokens"] for r in recs[:-1]]
    timed = [(r["tokens"] - b, data["times"][r["step"]]) for r, b in zip(recs, before)
             if b is not None and r["step"] in data["times"]]
    timed_seconds = sum(t for _, t in timed)
    warm = cfg.train.warmup_tokens
    steady = [r for r in recs if r["tokens"] > warm]
    s = {"run_hash": data["run_hash"], "genesis": info.genesis, "preset": cfg.preset, "precision": cfg.precision,
         "parameters": cfg.model.n_params(), "steps": n, "first_step": recs[0]["step"], "last_step": recs[-1]["step"],
         "tokens": recs[-1]["tokens"], "final_train_ce": recs[-1]["ce"],
         "final_train_ce_mean": float(np.mean(ce[-wl:])), "train_ce_window": min(wl, n),
         "final_loss": recs[-1]["loss"], "final_zloss": recs[-1].get("zloss"),
         "final_heldout_ce": evals[-1]["eval"].get("mixture") if evals else None,
         "final_heldout_step": evals[-1]["step"] if evals else None,
         "first_heldout_ce": evals[0]["eval"].get("mixture") if evals else None,
         "skipped_steps": int(sum(r["skipped"] for r in recs)), "spike_events": int(sum(r["spike"] for r in recs)),
         "spike_steps": [r["step"] for r in recs if r["spike"]],
         "clipped_steps": int(sum(r["clipped"] for r in recs)),
         "clip_rate": sum(r["clipped"] for r in recs) / n,
         "clip_rate_steady": (sum(r["clipped"] for r in steady) / len(steady)) if steady else None,
         "median_step_seconds": float(np.median(times)) if times else None,
         "training_seconds": float(np.sum(times)) if times else None,
         "tokens_per_second": sum(k for k, _ in timed) / timed_seconds if timed_seconds > 0 else None,
         "checkpoints": [c["step"] for c in data["norms"]]}
    return s


def milestones(recs: list, k: int = 8) -> list[dict]:
    """Loss milestones (paper Table 8): at k evenly spaced steps, the long trailing mean of the
    training CE and the latest held-out mixture CE."""
    n = len(recs)
    _, wl = windows(n)
    ce = trailing_mean([r["ce"] for r in recs], wl)
    out, last_eval = [], None
    idx = sorted({min(n - 1, max(0, round(n * (j + 1) / k) - 1)) for j in range(k)})
    ev = {}
    for i, r in enumerate(recs):
        if "eval" in r:
            last_eval = r["eval"].get("mixture")
        ev[i] = last_eval
    for i in idx:
        out.append({"step": recs[i]["step"], "tokens": recs[i]["tokens"], "train_ce_mean": float(ce[i]),
                    "heldout_ce": ev[i]})
    return out


def gnmr_active(r: dict):
    """The units on GNMR's recovery path in a record's step, or None when it has no controller."""
    g = r.get("gnmr", r.get("gnmr_active"))
    if isinstance(g, dict):
        g = g.get("active", g.get("active_set"))
    return list(g) if isinstance(g, (list, tuple)) else None
