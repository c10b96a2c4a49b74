"""Memory at scale, measured on the shape-only backend: per worker and per batch phase, the peak
device bytes and what makes it, host bytes, and the bytes moved host<->device and over the network
in one step.

    python benchmarks/memory_model.py --preset open1b --workers 1,8,48,64

It runs the code a training run runs (mlx_open1b.shape): the model program on the CUDA backend's op
code with launches that do nothing, Trainer.compute_step on one worker, DistributedTrainer's on W
workers simulated as threads of this process, so a change that adds a buffer shows up here (the
model program runs once per shape and its allocations are replayed for the other microbatches:
mlx_open1b/shape/replay.py; --no-replay runs it every time, same figures, minutes). No arithmetic
is done, so the figures do not depend on the machine (and need no quiet one); a configuration
takes seconds (64 workers: about 20 s on two cores).

Columns (GB = 10^9 bytes, per worker; the worker with the highest device peak is shown, and the
lowest peak among the workers):
  M           microbatches per step in the phase; mb: those this worker computes
  peak        the device peak of the step; min: the lowest worker's
  params ... transients   what the live bytes were at the peak, by owner (mlx_open1b/shape/ledger.py)
  host        the host peak of the step: the fold entries and partials that wait on the host, the
              full-size copies the hashes read (the highest among the workers)
  pinned      of host, page-locked buffers (the hashes' copies, the pool of parked fold entries)
  h2d, d2h    bytes copied host->device and device->host in the step (the most among the workers)
  ovl h2d/d2h of h2d, d2h: the bytes copied on a copy stream while later work computes (parked fold
              entries asked back a microbatch ahead, parks, the hashes' copies); the rest block
              (--details: the number of copies of 256 KiB or more; --park sync: every park
              blocking, into pageable memory)
  net out/in  bytes a worker sends to / receives from the others, arrays only (its own piece
              excluded; the most among the workers)
  a2a in      of net in, the gradient partials an owner receives in the reduce-scatter (the most)
  gath in     of net in, the parameters a worker receives in the all-gather (the most)
  at          the call path where the peak is reached (innermost functions)
Not modelled: start-up (initialization, the first checkpoint, the state broadcast), checkpoints
and held-out evaluation (they read and write values; their host bytes by formula:
benchmarks/phase_bytes.py), the caching allocator's fragmentation, the CUDA context and NCCL's own
buffers.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mlx_open1b.config import ConfigError, preset  # noqa: E402
from mlx_open1b.distributed.sharding import ShardingError  # noqa: E402
from mlx_open1b.fsutil import write_bytes_atomic  # noqa: E402
from mlx_open1b.shape.run import measure  # noqa: E402

G = 1e9
LABEL = "MODEL"
SHORT = {"fold stack": "fold", "activations": "activ", "communication": "comm", "transients": "trans",
         "gradients": "grads", "moments": "moments", "params": "params", "constants": "const"}
COLUMNS = ("params", "moments", "gradients", "fold stack", "activations", "communication", "transients")


def _gb(n: int) -> str:
    return f"{n / G:7.2f}"


def _at(where: str, n: int = 3) -> str:
    names = [w.strip(" []") for w in where.replace("[", "> ").split(">") if w.strip(" []")]
    return " > ".join(names[-n:])


def rows(cfg, workers: int, phases=None, replay: bool = True, overlap: bool = True,
         recompute_blocks: bool = False) -> list[dict]:
    out = []
    for ranks in measure(cfg, workers, phases, replay=replay, overlap=overlap, recompute_blocks=recompute_blocks):
        top = max(ranks, key=lambda m: m.peak["device"])
        owners = dict(top.device.owners)
        out.append({
            "workers": workers, "M": top.microbatches, "rank": top.rank, "mb": top.computed, "owned": top.owned,
            "peak": top.peak["device"], "min_peak": min(m.peak["device"] for m in ranks),
            "owners": owners, "after": top.device.after, "sites": top.device.sites,
            "host": max(m.peak["host"] for m in ranks), "host_owners": top.host.owners,
            "pinned": max(m.host.owners.get("pinned", 0) for m in ranks),
            "moved": {k: max(m.moved[k] for m in ranks) for k in top.moved},
            "a2a_in": max(m.moved["net_in"] - m.moved["gather_in"] for m in ranks),
            "at": top.device.where, "owners_of_rank": {m.rank: m.owned for m in ranks if m.owned}})
    return out


def table(all_rows: list[dict]) -> str:
    head = (f"{'W':>3} {'M':>4} {'rank':>4} {'mb':>4} {'peak':>7} {'min':>7} "
            + " ".join(f"{SHORT[c]:>7}" for c in COLUMNS)
            + f" {'host':>7} {'pinned':>7} {'h2d':>7} {'ovl h2d':>7} {'d2h':>7} {'ovl d2h':>7}"
              f" {'netout':>7} {'netin':>7} {'a2a in':>7} {'gath in':>7}  at")
    lines = [head]
    for r in all_rows:
        o = r["owners"]
        other = sum(v for k, v in o.items() if k not in COLUMNS)
        lines.append(f"{r['workers']:>3} {r['M']:>4} {r['rank']:>4} {r['mb']:>4} {_gb(r['peak'])} {_gb(r['min_peak'])} "
                     + " ".join(_gb(o.get(c, 0)) for c in COLUMNS)
                     + f" {_gb(r['host'])} {_gb(r['pinned'])} {_gb(r['moved']['h2d'])} {_gb(r['moved']['h2d_async'])}"
                       f" {_gb(r['moved']['d2h'])} {_gb(r['moved']['d2h_async'])} "
                       f"{_gb(r['moved']['net_out'])} {_gb(r['moved']['net_in'])} {_gb(r['a2a_in'])} "
                       f"{_gb(r['moved']['gather_in'])}  {_at(r['at'])}"
                     + (f"  (+{other / G:.2f} other)" if other >= 0.005 * G else ""))
    return "\n".join(lines)


def details(r: dict) -> str:
    sites = sorted(r["sites"].items(), key=lambda kv: -kv[1])[:4]
    host = sorted(r["host_owners"].items(), key=lambda kv: -kv[1])[:3]
    mv = r["moved"]
    owners = sorted(r["owners_of_rank"].values(), reverse=True)
    return (f"  W={r['workers']} M={r['M']}: peak at {r['at']}\n"
            "    transients: " + ", ".join(f"{k} {v / G:.2f}" for k, v in sites) + "\n"
            "    host: " + ", ".join(f"{k} {v / G:.2f}" for k, v in host) + "\n"
            f"    ranks owning parameters: {len(owners)} of {r['workers']} (largest {owners[0] / 1e6:.0f} M elements)\n"
            + "    copies: " + ", ".join(f"{k} {mv[k + '_n']} ({mv[k + '_async_n']} overlapped: "
                                          f"{mv[k + '_async'] / G:.2f} of {mv[k] / G:.2f} GB)" for k in ("h2d", "d2h")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="open1b")
    ap.add_argument("--workers", default="1,8,48,64", help="worker counts, comma-separated")
    ap.add_argument("--json", default=None, help="also write every row to this JSON file")
    ap.add_argument("--details", action="store_true", help="per row: the transient sites, host owners, owners")
    ap.add_argument("--park", choices=("async", "sync"), default="async",
                    help="fold entries parked by pinned copies under compute (the trainer's) or blocking ones")
    ap.add_argument("--recompute-blocks", action="store_true",
                    help="keep each block's input alone and recompute its cache in the backward (open1b train "
                         "--recompute-blocks)")
    ap.add_argument("--no-replay", action="store_true",
                    help="run the model program at every microbatch (slow; the same numbers)")
    a = ap.parse_args(argv)
    try:
        cfg = preset(a.preset)
        workers = [int(w) for w in a.workers.split(",")]
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    P = cfg.model.n_params()
    print(f"{a.preset}: {P / 1e9:.2f} B parameters, batch phases {cfg.train.phases} (microbatches of "
          f"{cfg.train.microbatch_seqs} x {cfg.model.seq_len} tokens), precision {cfg.precision}; "
          f"one step per phase; GB = 1e9 bytes per worker")
    print(f"[{LABEL}] the live bytes of the shape-only backend's allocations, not measured on a device: "
          "no allocator rounding or fragmentation, CUDA context, library workspaces or NCCL buffers")
    all_rows = []
    for w in workers:
        t0 = time.perf_counter()
        try:
            got = rows(cfg, w, replay=not a.no_replay, overlap=a.park == "async", recompute_blocks=a.recompute_blocks)
        except ShardingError as e:      # a worker count the batch cannot be split over
            print(f"error: {e}", file=sys.stderr)
            return 2
        all_rows += got
        print(f"  {w} workers measured in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(table(all_rows))
    if a.details:
        for r in all_rows:
            print(details(r))
    if a.json:
        write_bytes_atomic(a.json, json.dumps(all_rows, indent=1, sort_keys=True).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
