"""Throughput of the exact int8 GEMM (cpu_ref.gemm_i8) against the bf16 contract GEMM
(cpu_ref.linear_forward) and numpy float32 matmul, on the same threads.

    python benchmarks/int8_bench.py [--threads N]
GOPS = 2·N·K·M / time (multiply and add counted as two operations)."""
from __future__ import annotations

import argparse
import time

import numpy as np

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        cpu_ref.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
