"""On-disk format of a prepared corpus: token shards (Arrow IPC) and the manifest (JSON).

A prepared corpus is a directory:

    manifest.json                      the Manifest below, written last and atomically
    <source>/shard-00000.arrow         token shards of a source (training documents)
    <source>/heldout.arrow             the source's held-out documents (never in training windows)

A shard is an Arrow IPC *file* holding one record batch with one column `tokens` of type
list<uint32>: one list per document, in the source's canonical (sorted input) order. Read it
memory-mapped: the flat token values and the int32 offsets come out as zero-copy numpy arrays.
Documents never contain the separator; the stream appends it.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pyarrow as pa

from ..errors import Open1bError
from ..fsutil import write_bytes_atomic, write_json_atomic

FORMAT = "open1b-data/1"
MANIFEST = "manifest.json"


class DataError(Open1bError):
    """A prepared corpus or a source is unusable; the message names the file or source."""


@dataclasses.dataclass
class ShardInfo:
    file: str            # path relative to the corpus directory
    documents: int
    tokens: int          # tokens in documents (separators not counted)
    sha256: str          # of the shard file's bytes


@dataclasses.dataclass
class SourceInfo:
    name: str
    share: float         # configured token share (the shares of a manifest sum to 1)
    documents: int       # training documents (held-out excluded)
    tokens: int          # training tokens
    mean_doc_len: float  # tokens / documents
    shards: list[ShardInfo]
    heldout: ShardInfo | None = None
    inputs: list[str] = dataclasses.field(default_factory=list)   # what it was read from

    @property
    def mix_weight(self) -> float:
        """The probability weight of choosing this source for the next document."""
        return self.share / self.mean_doc_len


@dataclasses.dataclass
class Manifest:
    tokenizer_sha256: str
    vocab_size: int
    eot_id: int
    sources: list[SourceInfo]
    format: str = FORMAT
    created_by: str = ""

    def source(self, name: str) -> SourceInfo:
        for s in self.sources:
            if s.name == name:
                return s
        raise DataError(f"manifest has no source named {name!r} (sources: {[s.name for s in self.sources]})")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict, where: str = MANIFEST) -> "Manifest":
        try:
            if d.get("format") != FORMAT:
                raise DataError(f"{where}: format {d.get('format')!r}, expected {FORMAT!r}")
            sources = []
            for s in d["sources"]:
                shards = [ShardInfo(**x) for x in s["shards"]]
                held = ShardInfo(**s["heldout"]) if s.get("heldout") else None
                sources.append(SourceInfo(**{**s, "shards": shards, "heldout": held}))
            return cls(**{**d, "sources": sources})
        except (KeyError, TypeError, AttributeError) as e:      # AttributeError: an entry that is not an object
            raise DataError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, corpus_dir) -> "Manifest":
        path = pathlib.Path(corpus_dir) / MANIFEST
        if not path.exists():
            raise DataError(f"{path}: no manifest (run `open1b data prepare` first)")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise DataError(f"{path}: not valid JSON ({e})") from None
        return cls.from_json(d, str(path))

    def save(self, corpus_dir) -> None:
        write_json_atomic(pathlib.Path(corpus_dir) / MANIFEST, self.to_json())


SCHEMA = pa.schema([pa.field("tokens", pa.list_(pa.uint32()))])


def write_shard(path, docs: list[np.ndarray]) -> None:
    """Write documents (each a 1-D integer array of token ids) as one shard, atomically."""
    offsets = np.zeros(len(docs) + 1, np.int32)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    values = np.concatenate(docs).astype(np.uint32) if docs else np.zeros(0, np.uint32)
    arr = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.uint32()))
    batch = pa.record_batch([arr], schema=SCHEMA)
    sink = pa.BufferOutputStream()      # the shard in memory, then one atomic write (fsutil)
    with pa.ipc.new_file(sink, SCHEMA) as w:
        w.write_batch(batch)
    write_bytes_atomic(path, sink.getvalue())


def read_shard(path) -> tuple[np.ndarray, np.ndarray]:
    """(tokens uint32 (T,), offsets int64-compatible (D+1,)) of a shard, memory-mapped, zero-copy.
    Document d is tokens[offsets[d]:offsets[d+1]]."""
    path = pathlib.Path(path)
    if not path.exists():
        raise DataError(f"{path}: shard file is missing")
    bad = (pa.ArrowException, IndexError, OSError, ValueError)    # every Arrow error, undecodable metadata
    try:
        source = pa.memory_map(str(path), "r")
        batch = pa.ipc.open_file(source).get_batch(0)
    except bad as e:
        raise DataError(f"{path}: not a valid token shard ({e})") from None
    if batch.schema != SCHEMA:
        raise DataError(f"{path}: unexpected schema {batch.schema}")
    try:
        # lengths and offsets inside their buffers, checked before numpy views them: arrays that
        # claim more than the file holds would make a view over memory that is not there
        batch.validate(full=True)
        col = batch.column(0)
        tokens = col.values.to_numpy(zero_copy_only=True)
        offsets = col.offsets.to_numpy(zero_copy_only=True)
    except bad as e:
        raise DataError(f"{path}: not a valid token shard ({e})") from None
    return tokens, offsets
