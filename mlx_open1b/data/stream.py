"""The canonical window stream W0, W1, ... of a prepared corpus (CONTRACT.md §10).

The stream is a pure function of (seed, manifest): three kinds of Philox generators decide it —
the mix generator picks the source of each next document with probability proportional to
share / mean document length; per source and epoch a permutation orders the shards; per shard a
permutation orders its documents. Documents are joined with the end-of-text separator and cut
into consecutive windows of seq_len + 1 tokens. Nothing depends on workers, ranks or machines:
every worker of a distributed run reads every window of a step and computes its own microbatches.

The position is a small JSON record (`Stream.state()`): windows emitted, mix draws, per source
(epoch, shard position, document position), and the document being cut with its offset. A
stream restored from it continues with exactly the windows the uninterrupted stream would give.
"""
from __future__ import annotations

import hashlib
import pathlib
from dataclasses import dataclass

import numpy as np

from ..contract import STREAM_DATA_DOCS, STREAM_DATA_MIX, STREAM_DATA_SHARDS
from ..cpu_ref.random import philox_blocks
from .format import DataError, Manifest, SourceInfo, read_shard

STATE_VERSION = 1
_BATCH_BLOCKS = 1024   # Philox blocks fetched at a time (only a cache: values do not depend on it)


def source_hash(name: str) -> str:
    """H(source): SHA-256 of the source name's UTF-8 bytes, hex."""
    return hashlib.sha256(name.encode()).hexdigest()


def generator_key(kind: str, seed: int, *fields) -> int:
    """The 64-bit Philox key of one generator: the first 8 bytes (little endian) of SHA-256 of
    'open1b-stream/1|kind|seed|field|field...' (ASCII decimal integers, hex hashes)."""
    text = "|".join(["open1b-stream/1", kind, str(int(seed))] + [str(f) for f in fields])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


class Words:
    """The word sequence w0, w1, ... of a generator: block b = Philox(key, (b lo, b hi, stream, 0)),
    w[4b + j] = word j of block b."""

    def __init__(self, key: int, stream: int, position: int = 0):
        self.key, self.stream, self.position = key, stream, int(position)
        self._base, self._buf = -1, np.zeros(0, np.uint32)

    def next(self) -> int:
        i = self.position - self._base
        if self._base < 0 or i >= self._buf.size:
            block = self.position // 4
            self._buf = philox_blocks(self.key, self.stream, block, _BATCH_BLOCKS).reshape(-1)
            self._base = block * 4
            i = self.position - self._base
        self.position += 1
        return int(self._buf[i])

    def bounded(self, n: int) -> int:
        """Uniform integer in [0, n), 1 <= n <= 2^32, unbiased: words below 2^32 mod n are
        rejected, the next word is drawn, and the result is w mod n."""
        reject_below = (1 << 32) % n
        while True:
            w = self.next()
            if w >= reject_below:
                return w % n


def permutation(key: int, stream: int, n: int) -> np.ndarray:
    """Fisher–Yates from the top: for i = n-1 down to 1, j = bounded(i + 1), swap p[i], p[j]."""
    p = np.arange(n, dtype=np.int64)
    w = Words(key, stream)
    for i in range(n - 1, 0, -1):
        j = w.bounded(i + 1)
        p[i], p[j] = p[j], p[i]
    return p


def mix_thresholds(sources: list[SourceInfo]) -> list[int]:
    """Cumulative 32-bit thresholds T_k = floor(2^32 (q_0 + ... + q_k) / Q) with q = share / mean
    document length and Q the sum (binary64, in manifest order); the last is 2^32. Word w picks
    the first source k with w < T_k."""
    q = [s.mix_weight for s in sources]
    total, acc, out = sum(q), 0.0, []
    for x in q[:-1]:
        acc += x
        out.append(int(acc / total * 4294967296.0))
    return out + [1 << 32]


def manifest_fingerprint(m: Manifest) -> str:
    """What the stream depends on: tokenizer, and per source its name, share, mean length and
    shard hashes (SHA-256 over a canonical text)."""
    parts = [m.tokenizer_sha256, str(m.eot_id)]
    for s in m.sources:
        parts += [s.name, repr(float(s.share)), repr(float(s.mean_doc_len))] + [sh.sha256 for sh in s.shards]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@dataclass
class _SourceCursor:
    """Where a source is: epoch, position in its shard order, position in the current shard's
    document order. Permutations are derived from these, never stored."""
    epoch: int = 0
    shard_pos: int = 0
    doc_pos: int = 0


class Stream:
    """Iterate the canonical windows of a prepared corpus.

    next_window() -> (seq_len + 1,) uint32; skip(n) advances without reading tokens (document
    lengths only), which is how a worker passes over windows it does not own."""

    def __init__(self, corpus_dir, seed: int, seq_len: int, state: dict | None = None):
        if int(seed) != seed or not 0 <= seed < 2 ** 64:
            raise DataError(f"seed: expected an integer in [0, 2^64), got {seed!r}")
        if int(seq_len) != seq_len or seq_len < 1:
            raise DataError(f"seq_len: expected a positive integer, got {seq_len!r}")
        self.dir = pathlib.Path(corpus_dir)
        self.manifest = Manifest.load(self.dir)
        self.seed, self.seq_len, self.L = int(seed), int(seq_len), int(seq_len) + 1
        self.eot = int(self.manifest.eot_id)
        self.fingerprint = manifest_fingerprint(self.manifest)
        self.sources = self.manifest.sources
        for s in self.sources:
            if not s.shards or s.documents < 1:
                raise DataError(f"{self.dir / 'manifest.json'}: source {s.name!r} has no training documents")
        self._hashes = [source_hash(s.name) for s in self.sources]
        self._thresholds = mix_thresholds(self.sources)
        self._shards: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._shard_order: dict[int, tuple[int, np.ndarray]] = {}
        self._doc_order: dict[int, tuple[tuple[int, int], np.ndarray]] = {}
        self._mix = Words(generator_key("mix", self.seed), STREAM_DATA_MIX)
        self._cursors = [_SourceCursor() for _ in self.sources]
        self._cur: tuple[int, int, int] | None = None   # (source, shard, doc) being cut
        self._cur_len = 0                                # its length including the separator
        self._offset = 0                                 # tokens of it already emitted
        self.windows_emitted = 0
        if state is not None:
            self._restore(state)

    # ---------------------------------------------------------------- documents
    def _shard(self, s: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        key = (s, k)
        if key not in self._shards:
            info = self.sources[s].shards[k]
            tokens, offsets = read_shard(self.dir / info.file)
            if offsets.size - 1 != info.documents or tokens.size != info.tokens:
                raise DataError(f"{self.dir / info.file}: holds {offsets.size - 1} documents / {tokens.size} "
                                f"tokens, the manifest says {info.documents} / {info.tokens}")
            if len(self._shards) >= max(8, 2 * len(self.sources)):
                # each source reads one shard at a time, so a small cache suffices; dropping the
                # memory maps keeps resident memory flat however large the corpus is
                self._shards.clear()
            self._shards[key] = (tokens, offsets)
        return self._shards[key]

    def _shards_of_epoch(self, s: int, epoch: int) -> np.ndarray:
        cached = self._shard_order.get(s)
        if cached is None or cached[0] != epoch:
            key = generator_key("shards", self.seed, self._hashes[s], epoch)
            cached = (epoch, permutation(key, STREAM_DATA_SHARDS, len(self.sources[s].shards)))
            self._shard_order[s] = cached
        return cached[1]

    def _docs_of_shard(self, s: int, epoch: int, k: int) -> np.ndarray:
        cached = self._doc_order.get(s)
        if cached is None or cached[0] != (epoch, k):
            key = generator_key("docs", self.seed, self._hashes[s], epoch, k)
            cached = ((epoch, k), permutation(key, STREAM_DATA_DOCS, self.sources[s].shards[k].documents))
            self._doc_order[s] = cached
        return cached[1]

    def _next_document(self) -> None:
        """Draw the source of the next document and take that source's next document."""
        w = self._mix.next()
        s = next(i for i, t in enumerate(self._thresholds) if w < t)
        c = self._cursors[s]
        while True:
            shards = self._shards_of_epoch(s, c.epoch)
            if c.shard_pos >= len(shards):
                c.epoch, c.shard_pos, c.doc_pos = c.epoch + 1, 0, 0       # the source's epoch rolls over
                continue
            k = int(shards[c.shard_pos])
            docs = self._docs_of_shard(s, c.epoch, k)
            if c.doc_pos >= len(docs):
                c.shard_pos, c.doc_pos = c.shard_pos + 1, 0
                continue
            d = int(docs[c.doc_pos])
            c.doc_pos += 1
            break
        _, offsets = self._shard(s, k)
        self._cur, self._cur_len, self._offset = (s, k, d), int(offsets[d + 1] - offsets[d]) + 1, 0

    def _doc_tokens(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of the current document followed by its separator."""
        s, k, d = self._cur
        tokens, offsets = self._shard(s, k)
        a, n = int(offsets[d]), self._cur_len - 1
        body = tokens[a + min(lo, n): a + min(hi, n)]
        if hi > n:                                   # the separator is position n
            return np.concatenate([body, np.array([self.eot], np.uint32)])
        return body

    # ---------------------------------------------------------------- windows
    def _advance(self, want: int, pieces: list | None, origin: list | None) -> None:
        """Consume `want` tokens; append token slices to `pieces` and provenance to `origin`."""
        while want > 0:
            if self._cur is None or self._offset >= self._cur_len:
                self._next_document()
            take = min(want, self._cur_len - self._offset)
            if pieces is not None:
                pieces.append(self._doc_tokens(self._offset, self._offset + take))
            if origin is not None:
                s, k, d = self._cur
                origin.append((self.sources[s].name, k, d, self._offset, self._offset + take))
            self._offset += take
            want -= take

    def next_window(self) -> np.ndarray:
        pieces: list[np.ndarray] = []
        self._advance(self.L, pieces, None)
        self.windows_emitted += 1
        return np.concatenate(pieces).astype(np.uint32, copy=False)

    def next_windows(self, n: int) -> np.ndarray:
        out = np.empty((int(n), self.L), np.uint32)
        for i in range(int(n)):
            out[i] = self.next_window()
        return out

    def skip(self, n: int) -> None:
        """Advance n windows using document lengths only (no token reads)."""
        for _ in range(int(n)):
            self._advance(self.L, None, None)
            self.windows_emitted += 1

    def window(self, m: int) -> np.ndarray:
        """Window m, from a fresh stream (O(m) in document lengths)."""
        fresh = Stream(self.dir, self.seed, self.seq_len)
        fresh.skip(m)
        return fresh.next_window()

    def window_sources(self, m: int) -> list[tuple[str, int, int, int, int]]:
        """Provenance of window m: (source, shard, document, start, end) pieces; end may include
        the separator (position = document length)."""
        fresh = Stream(self.dir, self.seed, self.seq_len)
        fresh.skip(m)
        origin: list = []
        fresh._advance(fresh.L, None, origin)
        return origin

    # ---------------------------------------------------------------- state
    def state(self) -> dict:
        """The worker-independent position (JSON-serializable)."""
        cur = None
        if self._cur is not None and self._offset < self._cur_len:
            s, k, d = self._cur
            cur = {"source": self.sources[s].name, "shard": k, "doc": d, "offset": self._offset}
        return {
            "version": STATE_VERSION, "seed": self.seed, "seq_len": self.seq_len,
            "manifest": self.fingerprint, "windows": self.windows_emitted, "mix_draws": self._mix.position,
            "sources": {self.sources[i].name: {"epoch": c.epoch, "shard_pos": c.shard_pos, "doc_pos": c.doc_pos}
                        for i, c in enumerate(self._cursors)},
            "current": cur,
        }

    def _restore(self, st: dict) -> None:
        try:
            if st["version"] != STATE_VERSION:
                raise DataError(f"stream state: version {st['version']}, expected {STATE_VERSION}")
            for field, mine in (("seed", self.seed), ("seq_len", self.seq_len)):
                if st[field] != mine:
                    raise DataError(f"stream state: {field} is {st[field]}, this stream's is {mine}")
            if st["manifest"] != self.fingerprint:
                raise DataError(f"stream state: recorded for another corpus manifest "
                                f"({st['manifest'][:12]}…, {self.dir} is {self.fingerprint[:12]}…)")
            names = [s.name for s in self.sources]
            if sorted(st["sources"]) != sorted(names):
                raise DataError(f"stream state: sources {sorted(st['sources'])} differ from the manifest's {names}")
            self.windows_emitted = int(st["windows"])
            self._mix.position = int(st["mix_draws"])
            for i, name in enumerate(names):
                c = st["sources"][name]
                self._cursors[i] = _SourceCursor(int(c["epoch"]), int(c["shard_pos"]), int(c["doc_pos"]))
            cur = st["current"]
            if cur is not None:
                s = names.index(cur["source"])
                k, d = int(cur["shard"]), int(cur["doc"])
                if not (0 <= k < len(self.sources[s].shards) and 0 <= d < self.sources[s].shards[k].documents):
                    raise DataError(f"stream state: current document {cur} is outside source {cur['source']!r}")
                _, offsets = self._shard(s, k)
                self._cur, self._cur_len = (s, k, d), int(offsets[d + 1] - offsets[d]) + 1
                self._offset = int(cur["offset"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"stream state: malformed record ({e!r})") from None


def heldout_windows(corpus_dir, source: str, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """The fixed held-out probe of a source: its held-out documents in stored order, each followed
    by the separator, cut into windows of seq_len + 1 tokens (a final partial window is dropped).
    Independent of the seed; never part of training windows."""
    d = pathlib.Path(corpus_dir)
    m = Manifest.load(d)
    info = m.source(source)
    L = int(seq_len) + 1
    if info.heldout is None or info.heldout.documents == 0:
        return np.zeros((0, L), np.uint32)
    tokens, offsets = read_shard(d / info.heldout.file)
    pieces = []
    for i in range(offsets.size - 1):
        pieces += [tokens[offsets[i]:offsets[i + 1]], np.array([m.eot_id], np.uint32)]
    flat = np.concatenate(pieces)
    n = flat.size // L if max_windows is None else min(flat.size // L, int(max_windows))
    return flat[: n * L].reshape(n, L).copy()
