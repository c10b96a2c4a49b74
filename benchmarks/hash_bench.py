"""The Merkle leaves' SHA-256: hashlib (OpenSSL, one message at a time) against the C reference's
16-lane AVX-512 leaves (cpu_ref/src/sha256_mb.c), on one thread.

    python benchmarks/hash_bench.py --preset tiny --rounds 5

Two measurements, each the median over --rounds rounds, the two ways alternating within a round
so that both see the same machine load (on a shared machine say so with the figures):

* leaves: --chunks whole 1 MiB chunks, hashlib's leaf one by one vs one call of the C leaves;
* state: one step's hashes of a preset's state as the step computes them (hashing.tensor_digests
  of the gradient (f32), of the parameters (bf16) and of both Adam moments (f32), random values of
  the preset's shapes), with the C leaves off (hashlib alone) and on (mlx_open1b.hashing's split).
"""
from __future__ import annotations

import argparse
import math

import numpy as np

from common import medians
from mlx_open1b import config, hashing
from mlx_open1b.cpu_ref import sha256


def state_items(preset: str, seed: int = 0) -> list[list]:
    """The three hashing calls of a step: [grads], [params], [m and v], as (name, array, dtype)."""
    rng = np.random.default_rng(seed)
    shapes = [(n, s) for n, s, _ in config.preset(preset).model.param_shapes()]
    f32 = lambda s: rng.standard_normal(math.prod(s), dtype=np.float32).reshape(s)   # noqa: E731
    grads = [(n, f32(s), "f32") for n, s in shapes]
    params = [(n, rng.integers(0, 2**16, s, dtype=np.uint16), "bf16") for n, s in shapes]
    moments = [(f"{k}.{n}", f32(s), "f32") for k in "mv" for n, s in shapes]
    return [grads, params, moments]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if sha256.lanes() != 16:
        print("the C leaves hash one message at a time here (no AVX-512): nothing to compare")
        return
    hashing.set_hash_threads(1)

    data = np.random.default_rng(1).bytes(args.chunks * hashing.CHUNK)
    mv = memoryview(data)
    chunks = [mv[i:i + hashing.CHUNK] for i in range(0, len(data), hashing.CHUNK)]
    th, tc = medians([lambda: [hashing._leaf(c) for c in chunks], lambda: sha256.leaves(chunks)], args.rounds, warm=False)
    gb = len(data) / 1e9
    print(f"leaves, {args.chunks} x 1 MiB, 1 thread: hashlib {gb / th:.2f} GB/s, "
          f"16 lanes {gb / tc:.2f} GB/s ({th / tc:.2f}x)")

    calls = state_items(args.preset)
    nbytes = sum(a.nbytes for items in calls for _, a, _ in items)
    module = hashing._c_leaves()

    def step(use_c: bool):
        def run():
            hashing._lanes_module = module if use_c else False
            for items in calls:
                hashing.tensor_digests(items)
        return run

    try:
        th, tc = medians([step(False), step(True)], args.rounds, warm=False)
        hashing._lanes_module = False
        want = [hashing.tensor_digests(items) for items in calls]
        hashing._lanes_module = module
        assert [hashing.tensor_digests(items) for items in calls] == want, "digests differ"
    finally:
        hashing._lanes_module = None
    print(f"state hashing of one {args.preset} step ({nbytes / 1e6:.1f} MB), 1 thread: "
          f"hashlib {th * 1e3:.1f} ms ({nbytes / 1e9 / th:.2f} GB/s), "
          f"with the 16 lanes {tc * 1e3:.1f} ms ({nbytes / 1e9 / tc:.2f} GB/s, {th / tc:.2f}x)")


if __name__ == "__main__":
    main()
