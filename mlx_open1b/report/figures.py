"""The report's figures: the paper's diagnostics of a run as Plots, each with its id and caption.

  fig-loss        training CE per step, its short and long trailing means, held-out mixture CE
                  (records with "eval") and per-source held-out CE                (paper Fig. 1a)
  fig-gradnorm    pre-clip global gradient norm per step and its trailing mean, the clip threshold,
                  clipped steps, spike (skip-protocol) events and skipped steps   (Fig. 2a)
  fig-gradhist    distribution of pre-clip norms, warmup vs. steady state        (Fig. 2b)
  fig-lr          learning rate per step                                           (Fig. 3a)
  fig-batch       batch schedule: tokens and microbatches per optimizer step      (Fig. 3b)
  fig-update      |Δ log ‖W‖| per 1,000 steps by branch, from checkpoints          (Fig. 3c)
  fig-wq, fig-wk, fig-wv   per-layer Frobenius norms of the Q/K/V projections      (Fig. 4a-c)
  fig-emb         Frobenius norms of the input embedding and the LM head          (Fig. 4d)
  fig-zloss       z-loss term per step
  fig-gnmr        units on GNMR's recovery path per step (only when records carry "gnmr")
  fig-speed       tokens/s (where step times are logged: the trainer's RUN/timing.jsonl, kept
                  beside the ledger since times would make equal runs' ledgers differ, or a
                  RUN/metrics.jsonl with lines {"step": t, "seconds": s})
"""
from __future__ import annotations

import math

import numpy as np

from .data import gnmr_active, trailing_mean, windows
from .plot import PALETTE, Plot, shade

FIGURE_IDS = ("fig-loss", "fig-gradnorm", "fig-gradhist", "fig-lr", "fig-batch", "fig-update", "fig-wq", "fig-wk",
              "fig-wv", "fig-emb", "fig-zloss", "fig-gnmr", "fig-speed")


def _branches(cfg) -> dict[str, list[str]]:
    L = cfg.n_layers
    return {"W_Q": [f"layers.{l}.wq" for l in range(L)], "W_K": [f"layers.{l}.wk" for l in range(L)],
            "W_V": [f"layers.{l}.wv" for l in range(L)],
            "FFN": [f"layers.{l}.{w}" for l in range(L) for w in ("w_gate_up", "w_down")],
            "embedding": ["wte"], "unembedding": ["lm_head"]}


def figures(data: dict) -> list[tuple[str, str, Plot]]:
    """[(id, caption, plot)] of every figure the run's data supports (drawn by page.py: mpl.png(plot),
    or plot.svg() and plot.png() without matplotlib)."""
    recs, cfg = data["records"], data["info"].config
    steps = np.array([r["step"] for r in recs], float)
    n = len(recs)
    ws, wl = windows(n)
    figs = []
    # Figure 1: loss
    ce = np.array([r["ce"] for r in recs], float)
    p = Plot("fig-loss", "Cross-entropy: training vs. held-out", "step", "cross-entropy (nats)", logy=True)
    p.line(steps, ce, "training CE", PALETTE[0], 1.0, 0.35)
    p.line(steps, trailing_mean(ce, ws), f"{ws}-step mean", PALETTE[0], 1.5, 0.8)
    p.line(steps, trailing_mean(ce, wl), f"{wl}-step mean", PALETTE[0], 2.5)
    evals = [r for r in recs if "eval" in r]
    if evals:
        ex = [r["step"] for r in evals]
        p.line(ex, [r["eval"].get("mixture", float("nan")) for r in evals], "held-out (mixture)", PALETTE[1], 2)
        p.points(ex, [r["eval"].get("mixture", float("nan")) for r in evals], "", PALETTE[1])
        sources = sorted({k for r in evals for k in r["eval"] if k != "mixture"})
        for j, s in enumerate(sources):
            p.line(ex, [r["eval"].get(s, float("nan")) for r in evals], f"held-out {s}", PALETTE[2 + j % 7], 1, 0.7,
                   "3,2")
    figs.append(("fig-loss", "Figure 1. Training cross-entropy per step (light), its trailing means, and the "
                 "held-out cross-entropy (mixture and per source) at each evaluation (paper Fig. 1a).", p))
    # Figure 2a: gradient norm
    g = np.array([r["grad_norm"] for r in recs], float)
    clip = cfg.train.clip_norm
    p = Plot("fig-gradnorm", "Pre-clip global gradient norm", "step", "‖g‖ (pre-clip)", logy=True)
    p.line(steps, g, "per step", PALETTE[0], 1.0, 0.4)
    p.line(steps, trailing_mean(g, ws), f"{ws}-step mean", PALETTE[0], 2)
    p.hline(clip, f"clip threshold {clip:g}", "#555")
    p.hline(cfg.train.spike_threshold, f"spike threshold {cfg.train.spike_threshold:g}", PALETTE[1], "2,3")
    cl = [r for r in recs if r["clipped"]]
    p.points([r["step"] for r in cl], [r["grad_norm"] for r in cl], f"clipped ({len(cl)})", PALETTE[3], 2.0)
    sk = [r for r in recs if r["skipped"]]
    p.points([r["step"] for r in sk], [r["grad_norm"] for r in sk], f"skipped ({len(sk)})", PALETTE[4], 3.0)
    p.vlines([r["step"] for r in recs if r["spike"]], f"spike events ({sum(r['spike'] for r in recs)})", PALETTE[1])
    figs.append(("fig-gradnorm", "Figure 2a. Pre-clip gradient norm per step and its trailing mean; the clip and "
                 "spike thresholds, clipped and skipped steps, and the spike-protocol activations (dotted).", p))
    # Figure 2b: distribution
    warm = cfg.train.warmup_tokens
    gp = g[g > 0]
    p = Plot("fig-gradhist", "Distribution of pre-clip gradient norms", "log10 ‖g‖", "fraction of steps")
    if gp.size:
        lo, hi = math.log10(gp.min()), math.log10(gp.max())
        if hi <= lo:
            lo, hi = lo - 0.5, hi + 0.5
        edges = np.linspace(lo, hi, 31)
        for j, (name, sel) in enumerate((("warmup", [r["tokens"] <= warm for r in recs]),
                                         ("steady state", [r["tokens"] > warm for r in recs]))):
            v = g[np.array(sel) & (g > 0)]
            if v.size:
                h, _ = np.histogram(np.log10(v), edges)
                p.bars(edges, h / len(g), f"{name} ({v.size})", PALETTE[j * 3], 0.5)
    figs.append(("fig-gradhist", "Figure 2b. Distribution of pre-clip gradient norms, warmup vs. steady state.",
                 p))
    # Figure 3a, 3b: schedules
    p = Plot("fig-lr", "Learning-rate schedule", "step", "learning rate", zero=True)
    p.line(steps, [r["lr"] for r in recs], "lr", PALETTE[0], 2)
    figs.append(("fig-lr", "Figure 3a. Learning rate of each step (token-anchored warmup and cosine).", p))
    tok = np.diff(np.concatenate([[0], [r["tokens"] for r in recs]]))
    if recs[0]["step"] != 0:
        tok[0] = tok[1] if len(tok) > 1 else tok[0]
    p = Plot("fig-batch", "Batch schedule", "step", "tokens per step / microbatches", zero=True)
    p.line(steps, tok, "tokens per step", PALETTE[0], 2)
    mb = np.array([r.get("microbatches", float("nan")) for r in recs], float)
    scale = float(np.nanmax(tok) / np.nanmax(mb)) if np.isfinite(mb).any() and np.nanmax(mb) > 0 else 1.0
    p.line(steps, mb * scale, f"microbatches (× {scale:,.0f})", PALETTE[1], 1.5, 1.0, "5,3")
    figs.append(("fig-batch", "Figure 3b. Batch schedule: tokens per optimizer step and microbatches per step "
                 "(scaled onto the same axis).", p))
    # Figure 3c and 4: weight norms from checkpoints
    norms = data["norms"]
    br = _branches(cfg.model)
    if len(norms) >= 2:
        p = Plot("fig-update", "Effective relative update rate by branch", "step", "|Δ log ‖W‖| per 1,000 steps",
                 logy=True)
        for j, (b, names) in enumerate(br.items()):
            tot = [math.sqrt(sum(c["tensors"][nm] ** 2 for nm in names)) for c in norms]
            xs, ys = [], []
            for c0, c1, w0, w1 in zip(norms, norms[1:], tot, tot[1:]):
                ds = c1["step"] - c0["step"]
                if ds > 0 and w0 > 0 and w1 > 0:
                    xs.append(c1["step"]), ys.append(abs(math.log(w1 / w0)) * 1000 / ds)
            p.line(xs, ys, b, PALETTE[j], 1.8)
        figs.append(("fig-update", "Figure 3c. Effective relative weight-update rate |Δ log ‖W‖| per 1,000 steps by "
                     "parameter branch (aggregated across layers), between consecutive checkpoints.", p))
    cx = [c["step"] for c in norms]
    L = cfg.model.n_layers
    for key, title in (("wq", "query"), ("wk", "key"), ("wv", "value")):
        p = Plot(f"fig-{key}", f"Per-layer ‖W_{key[1].upper()}‖ ({title} projection)", "step", "Frobenius norm")
        for l in range(L):
            label = f"layer {l}" if L <= 12 or l in (0, L // 2, L - 1) else ""
            p.line(cx, [c["tensors"][f"layers.{l}.{key}"] for c in norms], label, shade(l, L), 1.6)
            if len(norms) == 1:
                p.points(cx, [c["tensors"][f"layers.{l}.{key}"] for c in norms], "", shade(l, L))
        figs.append((f"fig-{key}", f"Figure 4{'abc'['wq wk wv'.split().index(key)]}. Frobenius norm of each layer's "
                     f"{title} projection at every checkpoint; shade encodes depth (layer 0 light).", p))
    p = Plot("fig-emb", "Embedding matrices", "step", "Frobenius norm")
    p.line(cx, [c["tensors"]["wte"] for c in norms], "input embedding (wte)", PALETTE[0], 2)
    p.line(cx, [c["tensors"]["lm_head"] for c in norms], "unembedding (lm_head)", PALETTE[1], 2)
    figs.append(("fig-emb", "Figure 4d. Frobenius norms of the input embedding and the LM head at every checkpoint.",
                 p))
    # z-loss
    p = Plot("fig-zloss", "z-loss term", "step", "z-loss (mean zcoef·lse²)", logy=True)
    p.line(steps, [r.get("zloss", float("nan")) for r in recs], "per step", PALETTE[2], 1.0, 0.4)
    p.line(steps, trailing_mean([r.get("zloss", float("nan")) for r in recs], ws), f"{ws}-step mean", PALETTE[2], 2)
    figs.append(("fig-zloss", "The z-loss term of the loss per step (the LM head's log-partition penalty).", p))
    # GNMR
    act = [(r["step"], gnmr_active(r)) for r in recs]
    act = [(s, a) for s, a in act if a is not None]
    if act:
        p = Plot("fig-gnmr", "GNMR: units on the recovery path", "step", "active units")
        p.line([s for s, _ in act], [len(a) for _, a in act], "active units", PALETTE[4], 1.2)
        if cfg.gnmr is not None:
            p.hline(cfg.gnmr.max_o, f"budget maxO = {cfg.gnmr.max_o}", "#555")
        figs.append(("fig-gnmr", "GNMR activity: number of units on the higher-precision recovery path per step.",
                     p))
    # speed
    times = data["times"]
    if times:
        tk = {r["step"]: t for r, t in zip(recs, tok)}
        xs = sorted(s for s in times if s in tk and times[s] > 0)
        p = Plot("fig-speed", "Throughput", "step", "tokens / s")
        p.line(xs, [tk[s] / times[s] for s in xs], "tokens/s", PALETTE[5], 1.2)
        figs.append(("fig-speed", "Training throughput per step (from the logged step times).", p))
    return figs
