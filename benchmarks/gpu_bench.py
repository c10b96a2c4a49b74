"""First contact with a real GPU: each hot op of the cuda (or metal) backend timed at open1b width,
next to the vendor's matmul on the same shapes and to the speed model's PREDICTION.

For every shape of kernel_model.BENCH (one sequence of 4096 tokens at open1b width: the QKV and
FFN-down GEMMs forward and backward in bf16 and int8, attention forward and backward, global and
windowed, the LM head fused with cross-entropy, RMSNorm, SwiGLU, RoPE, add, the bf16 rounding) it
times the op on device-resident arrays and, for the GEMMs, the same products through the peer:
torch.matmul in fp32 (TF32 off) and in bf16 (cuBLAS) on CUDA, mx.matmul on Metal; attention's peer
is torch's scaled_dot_product_attention. Then one whole microbatch of a model with open1b widths,
2 layers (one windowed, one global) and one sequence, bf16 and int8. Each line: measured time,
TFLOP/s, ours / peer, and the model's predicted time (kernel_model --bench-json; on another GPU
than the one predicted for, read the ratio with that in mind). Everything fits a time budget (default
240 s): a shape whose first call is slow is not repeated, and what the budget leaves out is listed.

    python benchmarks/gpu_bench.py --backend cuda --out DIR            # on the GPU box, offline
    python benchmarks/gpu_bench.py --backend metal --out DIR           # on a Mac
    python benchmarks/gpu_bench.py --backend cuda --out DIR --dry-run  # CPU emulator, tiny shapes

Writes DIR/gpu_bench.txt (the table) and DIR/gpu_bench.json. The prediction file is
benchmarks/kernel_model_prediction.json unless --prediction says otherwise; it records the SHA-256
of the kernel sources it was computed from, and the table says when the sources differ.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import kernel_model as km  # noqa: E402

DEFAULT_PREDICTION = HERE / "kernel_model_prediction.json"
# dry run: every size shrunk to what the emulators run in seconds (tile multiples kept)
TINY = {"N": 128, "K": 128, "M": 128, "T": 128, "V": 1024, "C": 128, "R": 128, "F": 64, "n": 4096}


def tiny_dims(dims: dict) -> dict:
    out = {k: TINY.get(k, v) for k, v in dims.items()}
    if "W" in dims:
        out["W"] = 64 if dims["W"] else 0
    if "H" in dims:
        out.update(B=1, H=4, G=1)
    return out


# ------------------------------------------------------------------ device and peers
class Device:
    """Synchronization, device copies and the peer matmul of one backend."""

    def __init__(self, backend: str, dry_run: bool):
        from mlx_open1b import backend as backend_mod
        self.name, self.dry_run = backend, dry_run
        self.ops = backend_mod.load(backend)
        self.peer = None
        if backend == "cuda" and not dry_run:
            import torch
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            self.peer, self.peer_name, self.torch = "torch", "torch (cuBLAS)", torch
        elif backend == "cuda":
            try:
                import torch
                self.peer, self.peer_name, self.torch = "torch", "torch (CPU, dry run)", torch
            except ImportError:
                self.peer_name = "none (torch not importable)"
        elif backend == "metal":
            try:
                import mlx.core as mx
                self.peer, self.peer_name, self.mx = "mlx", "mx.matmul" + (" (CPU, dry run)" if dry_run else ""), mx
                if dry_run:
                    mx.set_default_device(mx.cpu)
            except ImportError:
                self.peer_name = "none (mlx not importable)"

    def sync(self, result=None):
        """Wait until `result` (an op's return value) is computed."""
        if self.name == "cuda" and not self.dry_run:
            import cupy
            cupy.cuda.Device().synchronize()
        elif self.name == "metal" and not self.dry_run:
            import mlx.core as mx
            arrays = [x for x in (result if isinstance(result, (tuple, list)) else [result])
                      if isinstance(x, mx.array)]
            if arrays:
                mx.eval(arrays)
            mx.synchronize()

    def up(self, a):
        import numpy as np
        return self.ops.to_device(a) if isinstance(a, np.ndarray) else a

    # peer products: [(a_shape, b_shape)] -> seconds per call, fp32 and bf16
    def peer_matmuls(self, products, reps_for) -> dict:
        if self.peer is None:
            return {}
        out = {}
        for dtype in ("fp32", "bf16"):
            if self.peer == "torch":
                t = self.torch
                dev = "cuda" if not self.dry_run else "cpu"
                dt = t.float32 if dtype == "fp32" else t.bfloat16
                mats = [(t.randn(*a, device=dev, dtype=dt), t.randn(*b, device=dev, dtype=dt)) for a, b in products]
                sync = (lambda _: t.cuda.synchronize()) if dev == "cuda" else (lambda _: None)
                run = lambda: [t.matmul(x, y) for x, y in mats]        # noqa: E731
            else:
                mx = self.mx
                dt = mx.float32 if dtype == "fp32" else mx.bfloat16
                mats = [(mx.random.normal(a).astype(dt), mx.random.normal(b).astype(dt)) for a, b in products]
                sync = lambda _: mx.synchronize()                          # noqa: E731
                run = lambda: mx.eval([mx.matmul(x, y) for x, y in mats])  # noqa: E731
            out[dtype] = timed(run, sync, reps_for)
        return out

    def peer_attention(self, d: dict, backward: bool, reps_for) -> dict:
        if self.peer != "torch":
            return {}
        t = self.torch
        import torch.nn.functional as F
        dev = "cuda" if not self.dry_run else "cpu"
        out = {}
        for dtype, dt in (("fp32", t.float32), ("bf16", t.bfloat16)):
            q = t.randn(d["B"], d["H"], d["T"], d["D"], device=dev, dtype=dt, requires_grad=backward)
            k = t.randn(d["B"], d["H"], d["T"], d["D"], device=dev, dtype=dt, requires_grad=backward)
            v = t.randn(d["B"], d["H"], d["T"], d["D"], device=dev, dtype=dt, requires_grad=backward)
            sync = (lambda _: t.cuda.synchronize()) if dev == "cuda" else (lambda _: None)

            def run():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                if backward:
                    o.backward(t.ones_like(o))
                return o
            out[dtype] = timed(run, sync, reps_for)
        return out


def timed(run, sync, reps_for) -> float:
    """Seconds per call: one untimed call (compiles, warms caches), then as many as reps_for(first)."""
    t0 = time.perf_counter()
    sync(run())
    first = time.perf_counter() - t0
    reps = reps_for(first)
    if reps == 0:
        return first
    t0 = time.perf_counter()
    for _ in range(reps):
        res = run()
    sync(res)
    return (time.perf_counter() - t0) / reps


def gemm_products(op: str, d: dict) -> list:
    """The (a, b) shapes of the products an op's GEMMs compute, for the peer."""
    if op in ("linear_forward", "qlinear_forward"):
        return [((d["N"], d["K"]), (d["K"], d["M"]))]
    if op in ("linear_backward", "qlinear_backward"):
        return [((d["N"], d["M"]), (d["M"], d["K"])), ((d["M"], d["N"]), (d["N"], d["K"]))]
    if op == "xent_forward":
        return [((d["N"], d["C"]), (d["C"], d["V"]))]
    if op == "xent_backward":
        return [((d["N"], d["V"]), (d["V"], d["C"])), ((d["V"], d["N"]), (d["N"], d["C"]))]
    return []


# ------------------------------------------------------------------ the run
def run(args, out=print) -> dict:
    import numpy as np
    dev = Device(args.backend, args.dry_run)
    deadline = time.perf_counter() + args.budget
    prediction, pred_note = load_prediction(pathlib.Path(args.prediction), args.backend)
    if args.dry_run:
        prediction, pred_note = {}, "dry run: tiny shapes, no prediction"
    only = {x.strip() for x in args.only.split(",")} if args.only else None

    def reps_for(first: float) -> int:
        left = deadline - time.perf_counter()
        if first > args.slow or left < 3 * first:
            return 0
        return max(1, min(args.reps, int(0.2 / max(first, 1e-6))))

    rows, skipped = [], []
    rng = np.random.default_rng(0)
    for label, op, dims in km.BENCH:
        if only is not None and label not in only:
            continue
        if time.perf_counter() > deadline:
            skipped.append(label)
            continue
        d = tiny_dims(dims) if args.dry_run else dims
        w = km.workload_for(op, d)
        full = dict(w.fixed, **d)
        host_args = w.args(dev.ops, rng, full)
        dev_args = tuple(dev.up(a) for a in host_args)
        fn = getattr(dev.ops, op)
        t = timed(lambda: fn(*dev_args), dev.sync, reps_for)
        flops = 2 * w.macs(full)
        peers = dev.peer_matmuls(gemm_products(op, d), reps_for) if gemm_products(op, d) else {}
        if op.startswith("attention") and not args.dry_run:
            peers = dev.peer_attention(d, op == "attention_backward", reps_for)
        p = prediction.get(label, {}).get("t")
        rows.append({"label": label, "op": op, "dims": d, "t": t, "flops": flops, "peer": peers, "predicted": p})
    models = []
    precisions = [p for p in ("bf16", "int8") if only is None or f"model {p}" in only]
    if time.perf_counter() < deadline:
        models = bench_model(dev, args, prediction, reps_for, precisions)
    else:
        skipped += [f"model {p}" for p in precisions]
    report = {"backend": args.backend, "dry_run": args.dry_run, "peer": dev.peer_name, "prediction": pred_note,
              "rows": rows + models, "skipped": skipped, "label": "MEASURED (predicted: PREDICTION)"}
    print_table(report, out)
    return report


def load_prediction(path: pathlib.Path, backend: str) -> tuple[dict, str]:
    """The model's predicted times of the bench shapes for `backend`, and a note saying whether they
    were computed from the kernel sources of this checkout."""
    if not path.is_file():
        return {}, f"no prediction file ({path})"
    pj = json.loads(path.read_text())
    same = pj.get("sources_sha256") == km.sources_digest(km.ROOT)
    return pj.get("bench", {}).get(backend, {}), (
        f"{path.name} ({pj.get('rev')}): "
        + ("computed from these kernel sources" if same else "computed from OTHER kernel sources (stale)"))


def bench_model(dev, args, prediction, reps_for, precisions) -> list:
    import numpy as np
    from mlx_open1b.config import ModelConfig
    from mlx_open1b.model import Model, init_params
    cfg = ModelConfig(**km.MICRO) if args.dry_run else km.bench_model_config()
    params = dev.up(init_params(cfg, 1, ops=dev.ops))
    windows = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, cfg.seq_len + 1)).astype(np.uint32)
    rows = []
    for prec in precisions:
        model = Model(cfg, ops=dev.ops, precision=prec)
        t = timed(lambda: model.loss_and_grad(params, windows), dev.sync, reps_for)
        p = prediction.get(f"model {prec}", {})
        rows.append({"label": f"model {prec}", "op": "loss_and_grad", "dims": {"layers": cfg.n_layers, "seqs": 1},
                     "t": t, "flops": p.get("flops", 0.0), "peer": {}, "predicted": p.get("t")})
    return rows


def _t(s) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3f} ms" if s < 10 else f"{s:.2f} s"


def print_table(r: dict, out=print) -> None:
    out(f"gpu_bench: {r['backend']}{' (dry run on the CPU emulator, tiny shapes)' if r['dry_run'] else ''}; "
        f"peer: {r['peer']}; prediction: {r['prediction']}")
    out(f"{'shape':22s} {'ours':>12s} {'TFLOP/s':>8s} {'peer fp32':>12s} {'peer bf16':>12s} {'ours/fp32':>9s} "
        f"{'ours/bf16':>9s} {'PREDICTED':>12s} {'meas/pred':>9s}")
    for row in r["rows"]:
        tf = row["flops"] / row["t"] / 1e12 if row["t"] and row["flops"] else 0.0
        pf, pb = row["peer"].get("fp32"), row["peer"].get("bf16")
        rf = f"{row['t'] / pf:9.2f}" if pf else f"{'-':>9s}"
        rb = f"{row['t'] / pb:9.2f}" if pb else f"{'-':>9s}"
        mp = f"{row['t'] / row['predicted']:9.2f}" if row["predicted"] else f"{'-':>9s}"
        out(f"{row['label']:22s} {_t(row['t']):>12s} {tf:8.3f} {_t(pf):>12s} {_t(pb):>12s} {rf} {rb} "
            f"{_t(row['predicted']):>12s} {mp}")
    if r["skipped"]:
        out(f"not run (time budget): {', '.join(r['skipped'])}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cuda", "metal"), required=True)
    ap.add_argument("--out", required=True, help="folder for gpu_bench.txt and gpu_bench.json")
    ap.add_argument("--dry-run", action="store_true", help="the backend's CPU emulator at tiny shapes")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run (default %(default)s)")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per shape at most (default %(default)s)")
    ap.add_argument("--slow", type=float, default=5.0,
                    help="a shape whose first call takes longer is timed by that call alone (default %(default)s s)")
    ap.add_argument("--prediction", default=str(DEFAULT_PREDICTION), help="kernel_model --bench-json output")
    ap.add_argument("--only", help="comma-separated shape labels (e.g. 'qkv fwd,model bf16'); default all")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run and args.backend == "metal":
        import os
        os.environ.setdefault("O1B_METAL_EMULATE", "1")
    lines: list[str] = []

    def out(s=""):
        print(s, flush=True)
        lines.append(s)
    report = run(args, out)
    from mlx_open1b.fsutil import write_bytes_atomic
    d = pathlib.Path(args.out)
    d.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(d / "gpu_bench.txt", ("\n".join(lines) + "\n").encode())
    write_bytes_atomic(d / "gpu_bench.json", json.dumps(report, indent=1, default=str).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
