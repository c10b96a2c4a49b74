"""The C reference's attention, forward and backward, per microbatch of a preset: every layer's call
at its window (global layers causal only), summed, as the training step makes them; and the int8
precision's forward (CONTRACT.md §6.10, o1b_attention_forward_i8) on the same inputs.

    python benchmarks/attention_bench.py --preset small --threads 2
    python benchmarks/attention_bench.py --preset small --lib /tmp/before.so --lib /tmp/after.so

With --lib (repeatable), each path is a build of the C library (cpu_ref/src/*.c compiled as
setup.py does, e.g. from another commit) loaded side by side and run in turn, round after round,
so that every build sees the same machine load; their outputs must agree bit for bit (checked).
Without it, the installed library. Prints the median and minimum over --rounds rounds, in ms per
microbatch; on a busy machine say so with the figures. Process memory is set up as in training
(host_malloc.tune: the kernels' scratch comes from the heap, not fresh zeroed mappings).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

import numpy as np

I64, F32, PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def load(path: str):
    lib = ctypes.CDLL(os.path.abspath(path))
    lib.o1b_attention_forward.argtypes = [I64] * 6 + [F32] + [PTR] * 5
    lib.o1b_attention_forward.restype = ctypes.c_int
    lib.o1b_attention_forward_i8.argtypes = [I64] * 6 + [F32] + [PTR] * 5
    lib.o1b_attention_forward_i8.restype = ctypes.c_int
    lib.o1b_attention_backward.argtypes = [I64] * 6 + [F32] + [PTR] * 9
    lib.o1b_attention_backward.restype = ctypes.c_int
    lib.o1b_set_num_threads.argtypes = [ctypes.c_int]
    return lib


def layers(cfg, rng):
    """(window, q, k, v, dout) per layer at one microbatch; q, k, v bf16 (as uint16)."""
    from mlx_open1b.spec.arith import f32_to_bf16
    m, t = cfg.model, cfg.train
    B, T, H, G, D = t.microbatch_seqs, m.seq_len, m.n_heads, m.n_kv_heads, m.head_dim
    out = []
    for layer in range(m.n_layers):
        x = lambda n: f32_to_bf16(rng.standard_normal((B, T, n, D)).astype(np.float32))
        dout = (rng.standard_normal((B, T, H, D)) * 1e-2).astype(np.float32)
        out.append((m.layer_window(layer), x(H), x(G), x(G), dout))
    return out


def run(lib, data, scale):
    """Forward, backward and int8 forward (§6.10) seconds over the layers, and every output."""
    tf = tb = ti = 0.0
    outs = []
    p = lambda a: a.ctypes.data
    for W, q, k, v, dout in data:
        B, T, H, D = q.shape
        G = k.shape[2]
        o, lse = np.empty((B, T, H, D), np.float32), np.empty((B, H, T), np.float32)
        dq, dk, dv = np.empty_like(o), np.empty((B, T, G, D), np.float32), np.empty((B, T, G, D), np.float32)
        o8, lse8 = np.empty_like(o), np.empty_like(lse)
        t0 = time.perf_counter()
        rc = lib.o1b_attention_forward(B, T, H, G, D, W, scale, p(q), p(k), p(v), p(o), p(lse))
        t1 = time.perf_counter()
        rc |= lib.o1b_attention_backward(B, T, H, G, D, W, scale, p(dout), p(q), p(k), p(v), p(o), p(lse),
                                         p(dq), p(dk), p(dv))
        t2 = time.perf_counter()
        rc |= lib.o1b_attention_forward_i8(B, T, H, G, D, W, scale, p(q), p(k), p(v), p(o8), p(lse8))
        t3 = time.perf_counter()
        if rc:
            raise SystemExit("attention_bench: out of memory")
        tf, tb, ti = tf + t1 - t0, tb + t2 - t1, ti + t3 - t2
        outs += [o, lse, dq, dk, dv, o8, lse8]
    return tf, tb, ti, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--lib", action="append", default=[], help="a build of the C library (repeatable)")
    args = ap.parse_args()
    from mlx_open1b import host_malloc
    from mlx_open1b.config import preset
    host_malloc.tune()
    cfg = preset(args.preset)
    if args.lib:
        libs = [(path, load(path)) for path in args.lib]
    else:
        from mlx_open1b.cpu_ref import _lib
        libs = [("installed", load(_lib.lib._name))]
    for _, lib in libs:
        lib.o1b_set_num_threads(args.threads)
    data = layers(cfg, np.random.default_rng(0))
    scale = float(np.float32(1 / np.sqrt(cfg.model.head_dim)))
    times = {name: [] for name, _ in libs}
    ref = None
    for rnd in range(args.rounds + 1):                 # round 0 warms up
        for name, lib in libs:
            tf, tb, ti, outs = run(lib, data, scale)
            if ref is None:
                ref = outs
            elif not all((a.view(np.uint32) == b.view(np.uint32)).all() for a, b in zip(outs, ref)):
                raise SystemExit(f"attention_bench: {name} gives other bits than {libs[0][0]}")
            if rnd:
                times[name].append((tf * 1e3, tb * 1e3, ti * 1e3))
    print(f"attention per microbatch, preset {args.preset}, {args.threads} threads, {args.rounds} rounds (ms):")
    for name, ts in times.items():
        a = np.array(ts)
        print(f"  {name}: forward median {np.median(a[:, 0]):.1f} min {a[:, 0].min():.1f}   "
              f"backward median {np.median(a[:, 1]):.1f} min {a[:, 1].min():.1f}   "
              f"int8 forward median {np.median(a[:, 2]):.1f} min {a[:, 2].min():.1f}")


if __name__ == "__main__":
    main()
