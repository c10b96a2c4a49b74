"""One microbatch of the model program on a GPU backend, its state in device arrays, against
cpu_ref on numpy: bit for bit at each precision, and the time of each (device-resident, numpy in
and out of the same backend, cpu_ref). Used by scripts/device_check.sh and scripts/mac_check.sh.

  python scripts/microbatch_timing.py --backend cuda|metal --out RESULT.json [--model tiny|micro]
         [--windows 4] [--reps 3]

Exit 1 when any result differs from cpu_ref's. `--model micro` (a 32-wide, 2-layer model) is for
dry runs on the CPU emulators, where the tiny preset takes minutes.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from mlx_open1b import arrays, cpu_ref
from mlx_open1b.config import ModelConfig, preset
from mlx_open1b.model import Model, init_params
from mlx_open1b.train import get_backend

MICRO = ModelConfig(vocab_size=4000, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden=48,
                    seq_len=16, window=8, global_every=2)


def same(got, ref) -> bool:
    """(loss, ce, zloss, gradient) equal bit for bit."""
    return (all(np.float32(a).view(np.uint32) == np.float32(b).view(np.uint32) for a, b in zip(got[:3], ref[:3]))
            and np.array_equal(arrays.to_host(got[3]).view(np.uint32), ref[3].view(np.uint32)))


def ms_per_call(model, params, windows, reps: int) -> float:
    model.loss_and_grad(params, windows)                       # compiles and caches the kernels
    t = time.perf_counter()
    for _ in range(reps):
        g = model.loss_and_grad(params, windows)[3]
    arrays.to_host(g)                                          # waits for the device's queue
    return (time.perf_counter() - t) / reps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("cuda", "metal"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", choices=("tiny", "micro"), default="tiny")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    cfg = preset("tiny").model if a.model == "tiny" else MICRO
    ops = get_backend(a.backend)
    p = init_params(cfg, 1)
    w = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.windows, cfg.seq_len + 1)).astype(np.uint32)
    out = {"backend": a.backend, "model": a.model, "windows": a.windows, "kind": None, "same": True, "ms": {}}
    for prec in ("bf16", "int8"):
        ref = Model(cfg, cpu_ref, precision=prec).loss_and_grad(p, w)
        got = Model(cfg, ops, precision=prec).loss_and_grad(ops.to_device(p), w)
        out["kind"] = arrays.kind(got[3])
        ok = same(got, ref)
        out["same"] &= ok
        print(f"{prec}: loss {got[0]} (cpu_ref {ref[0]}), gradient on {out['kind']} arrays, bit-identical: {ok}")
    m, r = Model(cfg, ops, precision="int8"), Model(cfg, cpu_ref, precision="int8")
    out["ms"] = {"device": ms_per_call(m, ops.to_device(p), w, a.reps), "numpy_io": ms_per_call(m, p, w, a.reps),
                 "cpu_ref": ms_per_call(r, p, w, a.reps)}
    ms = out["ms"]
    print(f"one microbatch ({a.model}, int8, {a.windows} windows): {a.backend} {ms['device']:.1f} ms on device "
          f"arrays, {ms['numpy_io']:.1f} ms numpy in/out; cpu_ref {ms['cpu_ref']:.1f} ms "
          f"({cpu_ref.get_num_threads()} threads)")
    pathlib.Path(a.out).write_text(json.dumps(out))
    return 0 if out["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
