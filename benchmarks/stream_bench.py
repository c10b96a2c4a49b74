"""Stream throughput and resident memory on a synthetic corpus (the data pipeline's benchmark).

    python benchmarks/stream_bench.py --tokens 1.2e9 --dir /tmp/o1b_stream_bench

Writes a corpus of random documents (3 sources, shards of 2^20 tokens) once, then streams
windows of seq_len+1 tokens and prints tokens/s and the process's peak resident memory after
each phase, so flat memory shows as the same peak for small and large prefixes/corpora.
"""
from __future__ import annotations

import argparse
import pathlib
import resource
import time

import numpy as np

from mlx_open1b.data.format import Manifest, ShardInfo, SourceInfo, write_shard
from mlx_open1b.data.stream import Stream
from mlx_open1b.fsutil import sha256_file


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(root: pathlib.Path, total_tokens: int, shard_tokens: int = 1 << 20) -> None:
    if (root / "manifest.json").exists():
        m = Manifest.load(root)
        if sum(s.tokens for s in m.sources) >= total_tokens * 0.95:
            return
    rng = np.random.default_rng(0)
    sources = []
    for name, share, mean_len in (("web", 0.6, 600), ("code", 0.3, 2000), ("math", 0.1, 250)):
        want, shards, k, docs_total, tok_total = int(total_tokens * share), [], 0, 0, 0
        while tok_total < want:
            lens = rng.integers(1, 2 * mean_len, shard_tokens // mean_len)
            values = rng.integers(1, 8000, int(lens.sum()), dtype=np.uint32)
            docs = np.split(values, np.cumsum(lens)[:-1])
            f = f"{name}/shard-{k:05d}.arrow"
            write_shard(root / f, docs)
            shards.append(ShardInfo(f, len(docs), int(lens.sum()), sha256_file(root / f)))
            docs_total, tok_total, k = docs_total + len(docs), tok_total + int(lens.sum()), k + 1
        sources.append(SourceInfo(name, share, docs_total, tok_total, tok_total / docs_total, shards))
        print(f"  wrote {name}: {tok_total / 1e6:.0f}M tokens in {k} shards", flush=True)
    Manifest("0" * 64, 8000, 0, sources, created_by="stream_bench").save(root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=2e8, help="corpus size in tokens")
    ap.add_argument("--dir", default="/tmp/o1b_stream_bench")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--stream-tokens", type=float, default=2e8, help="tokens to stream per phase")
    a = ap.parse_args()
    root = pathlib.Path(a.dir)
    t0 = time.perf_counter()
    build(root, int(a.tokens))
    print(f"corpus ready in {time.perf_counter() - t0:.0f}s; RSS {rss_mb():.0f} MB")
    s = Stream(root, 42, a.seq_len)
    n = int(a.stream_tokens) // (a.seq_len + 1)
    for phase in range(3):
        t0 = time.perf_counter()
        checksum = 0
        for _ in range(n):
            checksum ^= int(s.next_window()[7])
        dt = time.perf_counter() - t0
        print(f"phase {phase}: {n * (a.seq_len + 1) / dt / 1e6:.1f} M tokens/s materialized, "
              f"RSS {rss_mb():.0f} MB, windows so far {s.windows_emitted}")
    t0 = time.perf_counter()
    s.skip(n)
    dt = time.perf_counter() - t0
    print(f"skip: {n * (a.seq_len + 1) / dt / 1e6:.1f} M tokens/s (lengths only), RSS {rss_mb():.0f} MB")


if __name__ == "__main__":
    main()
