"""Tiny prepared corpora written straight in the on-disk format (no tokenizer needed)."""
from __future__ import annotations

import numpy as np

from mlx_open1b.data.format import Manifest, ShardInfo, SourceInfo, write_shard
from mlx_open1b.fsutil import sha256_file

EOT = 0
# the small two-source corpus most training tests run on (make_corpus spec: {name: (share, n_docs, mean_len)})
MICRO_MIX = {"web": (0.6, 30, 20), "code": (0.4, 12, 40)}


def make_corpus(root, spec: dict, shard_docs: int = 5, seed: int = 0, heldout_docs: int = 2) -> Manifest:
    """spec: {name: (share, n_docs, mean_len)}. Token ids encode (source, doc) so tests can
    recover provenance: each document is [1000*(source+1) + doc % 1000, ...] of random length."""
    rng = np.random.default_rng(seed)
    sources = []
    for si, (name, (share, n_docs, mean_len)) in enumerate(spec.items()):
        docs = [np.full(max(1, int(rng.integers(1, 2 * mean_len))), 1000 * (si + 1) + (d % 1000), np.uint32)
                for d in range(n_docs + heldout_docs)]
        train, held = docs[:n_docs], docs[n_docs:]
        shards = []
        for k in range(0, n_docs, shard_docs):
            f = f"{name}/shard-{k // shard_docs:05d}.arrow"
            write_shard(root / f, train[k:k + shard_docs])
            part = train[k:k + shard_docs]
            shards.append(ShardInfo(f, len(part), int(sum(map(len, part))), sha256_file(root / f)))
        hf = f"{name}/heldout.arrow"
        write_shard(root / hf, held)
        tokens = int(sum(map(len, train)))
        sources.append(SourceInfo(name, share, n_docs, tokens, tokens / n_docs, shards,
                                  ShardInfo(hf, len(held), int(sum(map(len, held))), sha256_file(root / hf))))
    total = sum(s.share for s in sources)
    for s in sources:
        s.share = s.share / total
    m = Manifest("0" * 64, 4000, EOT, sources, created_by="tests")
    m.save(root)
    return m


def mix_counts(stream, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw n documents: (per-source counts, expected probabilities p, 1-sigma binomial spread)."""
    counts = np.zeros(len(stream.sources))
    for _ in range(n):
        stream._next_document()
        counts[stream._cur[0]] += 1
    w = np.array([src.mix_weight for src in stream.sources])
    p = w / w.sum()
    return counts, p, np.sqrt(n * p * (1 - p))
