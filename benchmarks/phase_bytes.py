"""Host bytes per worker in the long phases of a distributed run — opening a new run, writing a
checkpoint, resuming — by formula, before and after they stopped being rank-0-only.

    python benchmarks/phase_bytes.py --preset open1b --workers 1,8,48,64 [--json F]

memory_model.py runs the step's code on shapes; these phases read and write values (initial
parameters, checkpoint bytes, hashes), which the shape backend cannot run, so their bytes are
counted here from the code's own layout: the parameter count P, each rank's owned range
(sharding.shard_elements), the checkpoint's piece size (DistributedTrainer.PIECE_BYTES) and
10 bytes a parameter in a checkpoint (bf16 parameters, f32 first and second moments). Labelled
[FORMULA]: live host bytes by what the code holds, not measured; the allocator, the file cache and
torch's transport buffers are outside it. Device bytes: these phases hold the state the step holds
(parameters, the owned moments) and nothing more, except held-out evaluation's forward, whose
activations are the step's forward's for fewer windows (bf16: the windows cut over all workers).

"before" is the rank-0-only code these phases replaced (rank 0 initialized, gathered, read and
wrote the whole state), on a GPU backend (the state's host copies counted).

Columns (GB = 10^9 bytes; the worker with the most, and which):
  new run     initialization and the checkpoint of step 0
  checkpoint  writing a checkpoint (rank 0 writes, the owners stream their moments to it)
  resume      reading the last checkpoint and handing out the state
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mlx_open1b.config import preset  # noqa: E402
from mlx_open1b.distributed.phases import CKPT_BYTES_PER_PARAM  # noqa: E402
from mlx_open1b.distributed.sharding import shard_elements  # noqa: E402
from mlx_open1b.distributed.trainer import DistributedTrainer  # noqa: E402
from mlx_open1b.model import _INIT_CHUNK  # noqa: E402

GB = 1e9


def phase_bytes(P: int, own: list[int], piece: int) -> dict:
    """{phase: {"before": [bytes by rank], "after": [...]}} for P parameters and the ranks' owned
    element counts `own` (rank 0 first)."""
    W, C = len(own), CKPT_BYTES_PER_PARAM * P
    piece_f32 = lambda n: 4 * min(n, piece // 4)          # noqa: E731  one piece of a range of n moments
    before = {
        # rank 0: the whole initial state (params, zero moments) and the checkpoint's host copy of it;
        # the others: the broadcast parameters and their moments
        "new run": [2 * C] + [2 * P + 8 * n for n in own[1:]],
        # rank 0 gathers every moment and copies the parameters; the owners copy their range out
        "checkpoint": [C + 8 * own[0]] + [8 * n for n in own[1:]],
        # rank 0 reads the whole file and copies its tensors out of it, then slices the moments
        "resume": [2 * C] + [2 * P + 8 * n for n in own[1:]],
    }
    init = 4 * min(_INIT_CHUNK, max(own))                  # one chunk of f32 truncated normals
    after = {
        # every rank: the parameter buffer the ranges are all-gathered into, its zero moments, one
        # chunk of its own initialization; then the checkpoint (below)
        "new run": [max(2 * P + 8 * n + init, 2 * P + (piece_f32(max(own)) + piece if r == 0 else piece_f32(n)))
                    for r, n in enumerate(own)],
        # rank 0: a receive buffer and one piece of its own (moments or parameters); the owners: one piece
        "checkpoint": [piece_f32(max(own)) + piece] + [piece_f32(n) for n in own[1:]],
        # every rank: the parameter buffer (broadcast) and its own moments; rank 0 one piece read
        "resume": [2 * P + 8 * own[0] + piece] + [2 * P + 8 * n for n in own[1:]],
    }
    return {k: {"before": before[k], "after": after[k]} for k in before}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="open1b")
    ap.add_argument("--workers", default="1,8,48,64")
    ap.add_argument("--json", type=pathlib.Path)
    a = ap.parse_args(argv)
    cfg = preset(a.preset).model
    sizes = [int(__import__("math").prod(s)) for _, s, _ in cfg.param_shapes()]
    P, piece, rows = sum(sizes), DistributedTrainer.PIECE_BYTES, []
    print(f"[FORMULA] {a.preset}: P = {P:,} parameters, checkpoint {CKPT_BYTES_PER_PARAM * P / GB:.1f} GB, "
          f"pieces of {piece / 2**20:.0f} MiB; host GB per worker, before -> after (the worker with the most)")
    print(f"{'W':>4} " + " ".join(f"{k:>24}" for k in ("new run", "checkpoint", "resume")))
    for W in (int(x) for x in a.workers.split(",")):
        own = [sh.size for sh in shard_elements(sizes, W)]
        ph = phase_bytes(P, own, piece)
        row = {"workers": W}
        cells = []
        for k, v in ph.items():
            b, f = max(v["before"]), max(v["after"])
            row[k] = {"before_gb": b / GB, "after_gb": f / GB, "before_rank": v["before"].index(b),
                      "after_rank": v["after"].index(f)}
            cells.append(f"{b / GB:7.1f} -> {f / GB:6.1f} (r{v['after'].index(f)})")
        rows.append(row)
        print(f"{W:>4} " + " ".join(f"{c:>24}" for c in cells))
    if a.json:
        a.json.write_text(json.dumps({"preset": a.preset, "params": P, "piece_bytes": piece, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
