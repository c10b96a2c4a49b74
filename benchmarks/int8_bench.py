"""Throughput of the exact int8 GEMM (cpu_ref.gemm_i8) against the bf16 contract GEMM
(cpu_ref.linear_forward) and numpy float32 matmul, on the same threads; then the whole linear
layer (forward + backward: quantization, Hadamard rotations, both gradient GEMMs) int8 (§6.9)
against bf16 (§6.1) at the tiny and small presets' shapes and a larger one.

    python benchmarks/int8_bench.py [--threads N] [--reps R]
    python benchmarks/int8_bench.py --phases [--preset small] [--threads N] [--reps R]

--phases: where the int8 layer's time goes instead, for the four layers of a block of the preset
(weights held and process memory set up as in a training step): each phase's wall time per
block, its tasks' time summed over the threads (and their ratio to wall x the threads its runs used:
how busy those threads kept; a run with few tasks uses fewer threads), and the pieces inside each phase (cpu_ref.quant.layer_profile; AVX-512 VNNI path).
The ideal line is the block's three GEMMs at the int8 kernel's measured peak (a 12-accumulator
vpdpbusd loop on this core, times the threads): a prediction of the bound, not a measurement, and no
bound where the GEMM blocks run on AMX tiles (then said instead).
GOPS = 2·N·K·M / time per GEMM (multiply and add counted as two operations; a layer's forward
and backward are three GEMMs). Times are medians of R calls, int8 and bf16 alternated."""
from __future__ import annotations

import argparse
import time

import numpy as np

from common import medians
from mlx_open1b import cpu_ref
from mlx_open1b.spec.arith import f32_to_bf16


def best(fn, reps=5):
    fn()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return min(t)


# (name, N tokens, K in, M out): the four quantized GEMMs of a block (fused QKV, wo, gate_up, down)
LAYERS = [("tiny qkv", 512, 128, 256), ("tiny wo", 512, 128, 128), ("tiny gate_up", 512, 128, 704),
          ("tiny down", 512, 352, 128), ("small qkv", 1024, 256, 384), ("small wo", 1024, 256, 256),
          ("small gate_up", 1024, 256, 1408), ("small down", 1024, 704, 256), ("big", 4096, 512, 1408)]


def phases(preset: str, reps: int) -> None:
    """The int8 layer's phase table for the four layers of a block of `preset` (see the docstring)."""
    from mlx_open1b import host_malloc
    from mlx_open1b.config import ConfigError, preset as get_preset
    from mlx_open1b.cpu_ref import quant
    host_malloc.tune()         # as in training: outputs and scratch from the heap, not fresh mappings
    if not cpu_ref.gemm_i8_has_vnni():
        raise SystemExit("int8_bench --phases: this CPU (or the SIMD cap) has no AVX-512 VNNI path to profile")
    try:
        cfg = get_preset(preset)
    except ConfigError as e:
        raise SystemExit(f"int8_bench --phases: --preset: {e}") from None
    N = cfg.train.microbatch_seqs * cfg.model.seq_len
    w = {n.removeprefix("layers.0."): s for n, s, _ in cfg.model.param_shapes() if n.startswith("layers.0.")}
    shapes = [("qkv", w["wq"][1], w["wq"][0] + w["wk"][0] + w["wv"][0]),   # (name, K in, M out)
              ("wo", w["wo"][1], w["wo"][0]), ("gate_up", w["w_gate_up"][1], w["w_gate_up"][0]),
              ("down", w["w_down"][1], w["w_down"][0])]
    rng = np.random.default_rng(0)
    data = []
    for _, K, M in shapes:
        x = f32_to_bf16(rng.standard_normal((N, K)).astype(np.float32))
        w = f32_to_bf16((rng.standard_normal((M, K)) * 0.02).astype(np.float32))
        dy = f32_to_bf16((rng.standard_normal((N, M)) * 1e-3).astype(np.float32))
        data.append((x, w, dy))

    def block():
        for x, w, dy in data:
            cpu_ref.qlinear_forward(x, w)
            cpu_ref.qlinear_backward(dy, x, w)

    th = cpu_ref.get_num_threads()
    with cpu_ref.weights_held():
        block()
        block()                                       # warm: the held operands, the scratch block
        t0 = time.perf_counter()
        with quant.layer_profile() as prof:
            for _ in range(reps):
                block()
        per = (time.perf_counter() - t0) / reps
    macs = 3 * sum(N * K * M for _, K, M in shapes)
    peak = quant.kernel_peak_macs() * th
    print(f"int8 layer phases, preset {preset} (N = {N}; {', '.join(f'{n} {K}x{M}' for n, K, M in shapes)}), "
          f"{th} threads, weights held, {reps} blocks: {1e3 * per:.3f} ms per block (forward + backward of the four)")
    if quant.gemm_i8_has_amx():
        print("  ideal: none printed (the GEMM blocks run on AMX tiles here, beyond the VNNI loop's rate)")
    else:
        print(f"  ideal (a prediction): the three GEMMs' {macs / 1e9:.3f} G multiply-adds at the kernel's peak "
              f"{peak / 1e9:.0f} GMAC/s ({th} x {peak / th / 1e9:.0f}) = {1e3 * macs / peak:.3f} ms")
    W = 38
    print(f"    {'phase / piece':{W}s} {'wall ms':>8s} {'tasks ms':>9s} {'busy':>6s}")
    for ph in quant.PROFILE_PHASES:
        w, t, tw = prof.wall[ph] / reps, prof.tasks[ph] / reps, prof.thread_wall[ph] / reps
        print(f"    {ph:{W}s} {1e3 * w:8.3f} {1e3 * t:9.3f} {t / tw if tw else 0.0:6.2f}")
        for (pp, piece), v in prof.passes.items():
            if pp == ph and v:
                print(f"      {piece:{W - 2}s} {'':8s} {1e3 * v / reps:9.3f}")
    in_c = sum(prof.call_wall) / reps
    print(f"    {'in the C calls, between phases':{W}s} {1e3 * (in_c - sum(prof.wall.values()) / reps):8.3f}")
    print(f"    {'outside the C calls (Python, outputs)':{W}s} {1e3 * (per - in_c):8.3f}")
    print("  (timed with the profile on: its clock reads are in these figures)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--phases", action="store_true", help="where the int8 layer's time goes, phase by phase")
    ap.add_argument("--preset", default="small", help="with --phases: the preset whose block is profiled")
    args = ap.parse_args()
    if args.threads:
        cpu_ref.set_num_threads(args.threads)
    if args.phases:
        phases(args.preset, max(1, args.reps))
        return
    th = cpu_ref.get_num_threads()
    rng = np.random.default_rng(0)
    print(f"threads {th}, simd {cpu_ref.simd_name()}, int8 VNNI kernel: {cpu_ref.gemm_i8_has_vnni()}")
    for N, K, M in ((4096, 512, 512), (4096, 512, 1408)):
        ops = 2.0 * N * K * M
        a = rng.integers(-127, 128, (N, K)).astype(np.int8)
        b = rng.integers(-127, 128, (M, K)).astype(np.int8)
        xf = rng.standard_normal((N, K)).astype(np.float32)
        wf = (rng.standard_normal((M, K)) * 0.02).astype(np.float32)
        x, w = f32_to_bf16(xf), f32_to_bf16(wf)
        t_i8 = best(lambda: cpu_ref.gemm_i8(a, b))
        t_q = best(lambda: cpu_ref.qlinear_forward(x, w))
        t_bf = best(lambda: cpu_ref.linear_forward(x, w))
        t_np = best(lambda: xf @ wf.T)
        print(f"{N}x{K}x{M}: int8 GEMM {ops / t_i8 / 1e9:7.1f} GOPS | int8 layer fwd (quantize+GEMM+dequant) "
              f"{ops / t_q / 1e9:7.1f} | bf16 contract GEMM {ops / t_bf / 1e9:7.1f} | numpy f32 {ops / t_np / 1e9:7.1f}")
    print("linear layer forward + backward (median ms; GOPS over its three GEMMs):")
    tot = {}
    for name, N, K, M in LAYERS:
        x = f32_to_bf16(rng.standard_normal((N, K)).astype(np.float32))
        w = f32_to_bf16((rng.standard_normal((M, K)) * 0.02).astype(np.float32))
        dy = f32_to_bf16((rng.standard_normal((N, M)) * 1e-3).astype(np.float32))
        ti, tb = medians([lambda: (cpu_ref.qlinear_forward(x, w), cpu_ref.qlinear_backward(dy, x, w)),
                          lambda: (cpu_ref.linear_forward(x, w), cpu_ref.linear_backward(dy, x, w))], args.reps)
        ops = 6.0 * N * K * M
        preset = name.split()[0]
        if preset != "big":
            s = tot.setdefault(preset, [0.0, 0.0])
            s[0] += ti
            s[1] += tb
        print(f"  {name:14s} {N:5d}x{K:4d}x{M:5d}: int8 {1e3 * ti:8.3f} ({ops / ti / 1e9:5.0f} GOPS)  "
              f"bf16 {1e3 * tb:8.3f} ({ops / tb / 1e9:5.0f} GOPS)  bf16/int8 {tb / ti:5.2f}x")
    for preset, (ti, tb) in tot.items():
        print(f"  {preset} block's four layers: int8 {1e3 * ti:.3f} ms, bf16 {1e3 * tb:.3f} ms, bf16/int8 {tb / ti:.2f}x")


if __name__ == "__main__":
    main()
