"""PREPARE: sources -> token shards + manifest; VERIFY: rehash a prepared corpus; INSPECT helpers.

prepare(sources, out_dir, tokenizer) reads every source's documents in canonical order, tokenizes
them in batches and writes, per source (layout in format.py):

    <source>/shard-00000.arrow ...   training documents, whole documents per shard; a new shard is
                                     started when adding the next document would exceed
                                     shard_tokens (a bigger document gets a shard of its own)
    <source>/heldout.arrow           the held-out documents (never in training windows)
    <source>/_done.json              completion record: fingerprint + the source's SourceInfo

and last, atomically, manifest.json. Documents that tokenize to no tokens are dropped.

Held-out rule. Let N be the source's document count. The held-out documents are the last h
documents in canonical order, h = min(cap, k), where k is the least k >= 1 such that the last k
documents hold >= heldout_tokens tokens (k = N if there is none) and cap = max(1, floor(N/10))
for N >= 2, cap = 0 for N = 1. heldout_tokens = 0 means no held-out set. Documents are released
to the shard writer as soon as the documents after them already hold heldout_tokens tokens, so
memory stays bounded by about shard_tokens + heldout_tokens tokens.

Restart and idempotence. A source's fingerprint is SHA-256 of (format, PREPARE_VERSION,
tokenizer SHA-256, source name, inputs, shard_tokens, heldout_tokens). A rerun skips a source
whose _done.json carries the same fingerprint and whose files still hash as recorded; any other
source (interrupted, changed, or tampered with) has its files removed and is prepared again.
An existing manifest is removed before any source is rewritten, so a manifest never describes
files that are being replaced. Shard bytes are a pure function of the token ids (checked in
tests), so rerunning a finished prepare yields a byte-identical manifest.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from .. import __version__
from ..fsutil import sha256_file, write_json_atomic
from .format import FORMAT, MANIFEST, DataError, Manifest, ShardInfo, SourceInfo, read_shard, write_shard

if TYPE_CHECKING:   # pragma: no cover
    from .corpus import SourceSpec
    from .tokenizer import Tokenizer

PREPARE_VERSION = 1          # bump when the mapping documents -> shard files changes
DONE = "_done.json"
LOCK = ".prepare.lock"
NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
ENCODE_BATCH_DOCS = 512
ENCODE_BATCH_CHARS = 4 << 20
MAX_SHARD_TOKENS = (1 << 31) - 1   # shard offsets are int32


@dataclasses.dataclass
class Progress:
    """What prepare reports to its progress callback.
    event: 'check' (re-hashing a finished source), 'skip' (finished source reused), 'start',
    'update' (after each tokenized batch), 'done' (source written), 'redo' (message says why)."""
    source: str
    event: str
    documents: int = 0        # documents kept so far (training + held-out)
    tokens: int = 0           # their tokens
    shards: int = 0           # training shards written so far
    dropped: int = 0          # documents dropped (empty / whitespace-only / no tokens)
    chars: int = 0            # characters read
    seconds: float = 0.0      # since the source started
    message: str = ""
    info: SourceInfo | None = None   # with 'skip' and 'done'


# ------------------------------------------------------------------------------ checks
def check_sources(sources: list["SourceSpec"]) -> list[float]:
    """Validate names and shares; the normalized shares (summing to 1, in binary64)."""
    if not sources:
        raise DataError("no sources given")
    seen: dict[str, str] = {}
    for s in sources:
        name = s.name
        if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name.startswith(".") or name == MANIFEST:
            raise DataError(f"source name {name!r}: names must match [A-Za-z0-9_.-]+, not start with '.', "
                            f"and not be {MANIFEST!r}")
        if name.lower() in seen:   # case-insensitive file systems would merge the two directories
            raise DataError(f"source name {name!r}: duplicate of {seen[name.lower()]!r}")
        seen[name.lower()] = name
        share = s.share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) or share <= 0:
            raise DataError(f"source {name!r}: share must be a finite number > 0, got {share!r}")
    total = math.fsum(float(s.share) for s in sources)
    return [float(s.share) / total for s in sources]


def _check_sizes(shard_tokens: int, heldout_tokens: int) -> None:
    if isinstance(shard_tokens, bool) or int(shard_tokens) != shard_tokens or not 1 <= shard_tokens <= MAX_SHARD_TOKENS:
        raise DataError(f"shard_tokens must be an integer in [1, {MAX_SHARD_TOKENS}], got {shard_tokens!r}")
    if isinstance(heldout_tokens, bool) or int(heldout_tokens) != heldout_tokens or heldout_tokens < 0:
        raise DataError(f"heldout_tokens must be an integer >= 0, got {heldout_tokens!r}")


def source_fingerprint(spec: "SourceSpec", tokenizer_sha256: str, shard_tokens: int, heldout_tokens: int) -> str:
    record = {"format": FORMAT, "prepare": PREPARE_VERSION, "tokenizer_sha256": tokenizer_sha256,
              "source": spec.name, "inputs": list(spec.inputs),
              "shard_tokens": int(shard_tokens), "heldout_tokens": int(heldout_tokens)}
    return hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


# ------------------------------------------------------------------------------ per source
def _source_files(info: SourceInfo) -> list[ShardInfo]:
    return list(info.shards) + ([info.heldout] if info.heldout is not None else [])


def _finished(out: pathlib.Path, name: str, fingerprint: str) -> tuple[SourceInfo | None, str]:
    """The SourceInfo of a finished source whose record matches and whose files hash as recorded,
    else (None, why it must be prepared)."""
    path = out / name / DONE
    if not path.exists():
        return None, "" if not (out / name).exists() else "no completion record (interrupted earlier?)"
    try:
        rec = json.loads(path.read_text())
        if rec.get("fingerprint") != fingerprint:
            return None, "tokenizer, inputs or options changed"
        d = rec["source"]
        info = SourceInfo(**{**d, "share": 0.0, "shards": [ShardInfo(**x) for x in d["shards"]],
                             "heldout": ShardInfo(**d["heldout"]) if d.get("heldout") else None})
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"unreadable completion record ({e})"
    for sh in _source_files(info):
        f = out / sh.file
        if not f.is_file():
            return None, f"{sh.file} is missing"
        if sha256_file(f) != sh.sha256:
            return None, f"{sh.file} changed"
    return info, ""


def _clean_source_dir(d: pathlib.Path) -> None:
    """Remove what prepare writes in a source directory (and leftover temporary files)."""
    if not d.exists():
        return
    for f in d.iterdir():
        n = f.name
        if f.is_file() and (n == DONE or n == "heldout.arrow" or (n.startswith("shard-") and n.endswith(".arrow"))
                            or (n.startswith(".") and n.endswith(".tmp"))):
            f.unlink()


class _ShardWriter:
    def __init__(self, out: pathlib.Path, name: str, shard_tokens: int):
        self.out, self.name, self.limit = out, name, shard_tokens
        self.docs: list[np.ndarray] = []
        self.tokens = 0
        self.shards: list[ShardInfo] = []

    def add(self, doc: np.ndarray) -> None:
        if self.docs and self.tokens + doc.size > self.limit:
            self.flush()
        self.docs.append(doc)
        self.tokens += int(doc.size)

    def flush(self) -> None:
        if self.docs:
            rel = f"{self.name}/shard-{len(self.shards):05d}.arrow"
            self.shards.append(_write(self.out, rel, self.docs))
            self.docs, self.tokens = [], 0


def _write(out: pathlib.Path, rel: str, docs: list[np.ndarray]) -> ShardInfo:
    tokens = sum(int(d.size) for d in docs)
    if tokens > MAX_SHARD_TOKENS:
        raise DataError(f"{out / rel}: a document of {tokens} tokens does not fit a shard (int32 offsets)")
    write_shard(out / rel, docs)
    return ShardInfo(file=rel, documents=len(docs), tokens=tokens, sha256=sha256_file(out / rel))


def _batches(texts: Iterable[str]) -> Iterable[list[str]]:
    batch, chars = [], 0
    for t in texts:
        if not isinstance(t, str):
            raise DataError(f"document {type(t).__name__} is not a string")
        batch.append(t)
        chars += len(t)
        if len(batch) >= ENCODE_BATCH_DOCS or chars >= ENCODE_BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _prepare_source(spec: "SourceSpec", out: pathlib.Path, tokenizer: "Tokenizer", shard_tokens: int,
                    heldout_tokens: int, fingerprint: str, report: Callable[..., None]) -> SourceInfo:
    name = spec.name
    _clean_source_dir(out / name)
    (out / name).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    writer = _ShardWriter(out, name, shard_tokens)
    tail: deque[np.ndarray] = deque()      # documents that may still be held out
    tail_tokens = 0
    kept = tokens = dropped = chars = 0
    vocab, eot = int(tokenizer.vocab_size), int(tokenizer.eot_id)
    docs_iter = spec.documents()
    report("start")
    try:
        for batch in _batches(docs_iter):
            chars += sum(len(t) for t in batch)
            for ids in tokenizer.encode_batch(batch):
                ids = np.asarray(ids)
                if ids.size == 0:
                    dropped += 1
                    continue
                if ids.dtype != np.uint32:
                    if ids.min() < 0:
                        raise DataError(f"source {name!r}: tokenizer returned a negative token id")
                    ids = ids.astype(np.uint32)
                if int(ids.max()) >= vocab or bool((ids == eot).any()):
                    raise DataError(f"source {name!r}: document {kept + dropped} tokenized to an id outside the "
                                    f"vocabulary or to the separator {eot} (tokenizer {tokenizer.sha256[:12]}…)")
                kept += 1
                tokens += int(ids.size)
                tail.append(ids)
                tail_tokens += int(ids.size)
                while tail and tail_tokens - tail[0].size >= heldout_tokens:
                    d = tail.popleft()
                    tail_tokens -= int(d.size)
                    writer.add(d)
            report("update", documents=kept, tokens=tokens, shards=len(writer.shards),
                   dropped=dropped + getattr(spec.documents, "dropped", 0), chars=chars,
                   seconds=time.perf_counter() - t0)
    except DataError as e:
        msg = str(e)
        raise DataError(msg if msg.startswith("source ") else f"source {name!r}: {msg}") from None
    if kept == 0:
        all_dropped = dropped + getattr(spec.documents, "dropped", 0)
        files = [i.split(" ")[0] for i in spec.inputs]
        raise DataError(f"source {name!r} has no documents"
                        + (f" ({all_dropped} empty ones dropped)" if all_dropped else "")
                        + (f"; inputs: {', '.join(files[:5])}{', …' if len(files) > 5 else ''}" if files else ""))
    # held-out: the last h documents (rule in the module docstring)
    cap = 0 if kept == 1 else max(1, kept // 10)
    k, acc = len(tail), 0
    if heldout_tokens > 0:
        for j in range(len(tail)):
            acc += int(tail[-1 - j].size)
            if acc >= heldout_tokens:
                k = j + 1
                break
    else:
        k = 0
    h = min(cap, k)
    tail_list = list(tail)
    for d in tail_list[:len(tail_list) - h]:
        writer.add(d)
    writer.flush()
    held_docs = tail_list[len(tail_list) - h:]
    heldout = _write(out, f"{name}/heldout.arrow", held_docs) if h else None
    train_docs = sum(s.documents for s in writer.shards)
    train_tokens = sum(s.tokens for s in writer.shards)
    info = SourceInfo(name=name, share=0.0, documents=train_docs, tokens=train_tokens,
                      mean_doc_len=train_tokens / train_docs, shards=writer.shards, heldout=heldout,
                      inputs=list(spec.inputs))
    record = {"fingerprint": fingerprint, "source": {k: v for k, v in dataclasses.asdict(info).items() if k != "share"}}
    write_json_atomic(out / name / DONE, record)
    report("done", documents=kept, tokens=tokens, shards=len(writer.shards),
           dropped=dropped + getattr(spec.documents, "dropped", 0), chars=chars,
           seconds=time.perf_counter() - t0, info=info)
    return info


@contextlib.contextmanager
def _locked(out: pathlib.Path):
    """One prepare at a time per output directory (advisory lock; a no-op where fcntl is absent)."""
    try:
        import fcntl
    except ImportError:   # pragma: no cover
        yield
        return
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"{out}: another `open1b data prepare` is writing this directory") from None
        yield
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ prepare
def prepare(sources: list["SourceSpec"], out_dir, tokenizer: "Tokenizer", shard_tokens: int = 1 << 20,
            heldout_tokens: int = 16384, progress: Callable[[Progress], None] | None = None,
            force: bool = False) -> Manifest:
    """Prepare `sources` into `out_dir` (see the module docstring); returns the manifest written.
    force: overwrite a directory whose manifest was made with another tokenizer (or is not a
    manifest this version can read)."""
    shares = check_sources(sources)
    _check_sizes(shard_tokens, heldout_tokens)
    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)

    def reporter(name: str):
        def report(event: str, **kw):
            if progress is not None:
                progress(Progress(source=name, event=event, **kw))
        return report

    with _locked(out):
        mpath = out / MANIFEST
        if mpath.exists() and not force:
            try:
                old = Manifest.load(out)
            except DataError as e:
                raise DataError(f"{e}; use --force (force=True) to overwrite this directory") from None
            if old.tokenizer_sha256 != tokenizer.sha256:
                raise DataError(f"{mpath}: was prepared with tokenizer {old.tokenizer_sha256[:12]}…, not "
                                f"{tokenizer.sha256[:12]}… ({getattr(tokenizer, 'path', None) or 'given tokenizer'}); "
                                f"use --force (force=True) to replace it")
        fps = [source_fingerprint(s, tokenizer.sha256, shard_tokens, heldout_tokens) for s in sources]
        done: list[SourceInfo | None] = []
        for s, fp in zip(sources, fps):
            reporter(s.name)("check")
            info, why = _finished(out, s.name, fp)
            if info is None and why:
                reporter(s.name)("redo", message=why)
            done.append(info)
        if any(i is None for i in done):
            with contextlib.suppress(FileNotFoundError):
                mpath.unlink()          # never leave a manifest that describes files being replaced
        infos = []
        for s, fp, info in zip(sources, fps, done):
            if info is None:
                info = _prepare_source(s, out, tokenizer, shard_tokens, heldout_tokens, fp, reporter(s.name))
            else:
                reporter(s.name)("skip", documents=info.documents, tokens=info.tokens,
                                 shards=len(info.shards), info=info)
            infos.append(info)
        manifest = Manifest(tokenizer_sha256=tokenizer.sha256, vocab_size=int(tokenizer.vocab_size),
                            eot_id=int(tokenizer.eot_id),
                            sources=[dataclasses.replace(i, share=sh) for i, sh in zip(infos, shares)],
                            created_by=f"mlx-open1b {__version__}")
        new = (json.dumps(manifest.to_json(), indent=2) + "\n").encode()
        if not (mpath.is_file() and mpath.read_bytes() == new):
            manifest.save(out)
        return manifest


# ------------------------------------------------------------------------------ the default corpus
#: where the commands keep the embedded default corpus when they are given no corpus
DEFAULT_CORPUS_DIR = pathlib.Path("runs") / "data-default"


def prepare_default(path=DEFAULT_CORPUS_DIR, log: Callable[[str], None] | None = None) -> pathlib.Path:
    """The embedded default corpus, prepared at `path` on first use: a finished one is reused, an
    interrupted one continued (prepare skips the sources it finished), and a lock file beside it
    lets processes on one machine (the workers of a distributed run) share it. log: told once when
    the corpus is being made. OSError (WriteError) where it cannot be written."""
    from .corpus import default_sources
    from .tokenizer import Tokenizer
    try:
        import fcntl
    except ImportError:   # pragma: no cover  (no advisory locks: one process at a time)
        fcntl = None
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if log is not None and not (path / MANIFEST).exists():
            log(f"preparing the embedded default corpus in {path} (once, ~10 s)")
        prepare(default_sources(), path, Tokenizer.load(None))
    return path


def corpus_dir(path=None, log: Callable[[str], None] | None = None) -> pathlib.Path:
    """The corpus of a run or a benchmark, by the rule of `open1b train`: no path (None) is the
    embedded default corpus in DEFAULT_CORPUS_DIR, prepared on first use (prepare_default); a
    path given must hold a prepared corpus (DataError naming its manifest if not)."""
    if path is None:
        return prepare_default(DEFAULT_CORPUS_DIR, log)
    path = pathlib.Path(path)
    Manifest.load(path)
    return path


# ------------------------------------------------------------------------------ verify
def verify(out_dir, tokenizer: "Tokenizer | None" = None,
           progress: Callable[[str, int], None] | None = None) -> list[str]:
    """Every problem of a prepared corpus, each naming the file: missing or changed shard and
    held-out files (SHA-256 against the manifest), shards whose contents disagree with the
    manifest's counts or hold ids outside the vocabulary or the separator, inconsistent totals,
    and a manifest made with another tokenizer than `tokenizer` (when given). An empty list means
    the corpus is intact. An unreadable manifest raises DataError.
    progress(file, bytes) is called after each file is hashed."""
    out = pathlib.Path(out_dir)
    m = Manifest.load(out)
    mpath = out / MANIFEST
    problems: list[str] = []
    if tokenizer is not None:
        where = getattr(tokenizer, "path", None) or "the given tokenizer"
        if tokenizer.sha256 != m.tokenizer_sha256:
            problems.append(f"{mpath}: prepared with tokenizer sha256 {m.tokenizer_sha256}, but {where} "
                            f"has sha256 {tokenizer.sha256}")
        elif (int(tokenizer.vocab_size), int(tokenizer.eot_id)) != (m.vocab_size, m.eot_id):
            problems.append(f"{mpath}: vocab_size/eot_id {m.vocab_size}/{m.eot_id} differ from {where}'s "
                            f"{tokenizer.vocab_size}/{tokenizer.eot_id}")
    if m.sources and not math.isclose(math.fsum(s.share for s in m.sources), 1.0, rel_tol=0, abs_tol=1e-9):
        problems.append(f"{mpath}: source shares sum to {math.fsum(s.share for s in m.sources)}, not 1")
    for s in m.sources:
        if s.shards and (sum(x.documents for x in s.shards), sum(x.tokens for x in s.shards)) != (s.documents, s.tokens):
            problems.append(f"{mpath}: source {s.name!r}: documents/tokens {s.documents}/{s.tokens} differ from "
                            f"the sum over its shards")
        if not s.shards or s.documents < 1:
            problems.append(f"{mpath}: source {s.name!r} has no training documents")
        for sh in _source_files(s):
            problems += _verify_file(out, sh, m, progress)
    return problems


def _verify_file(out: pathlib.Path, sh: ShardInfo, m: Manifest, progress) -> list[str]:
    path = out / sh.file
    if not path.is_file():
        return [f"{path}: missing"]
    try:
        digest = sha256_file(path)
    except OSError as e:
        return [f"{path}: cannot read ({e.strerror or e})"]
    if progress is not None:
        progress(sh.file, path.stat().st_size)
    if digest != sh.sha256:
        return [f"{path}: sha256 {digest} differs from the manifest's {sh.sha256} (file changed)"]
    try:
        tokens, offsets = read_shard(path)
    except DataError as e:
        return [str(e)]
    probs = []
    if (offsets.size - 1, tokens.size) != (sh.documents, sh.tokens):
        probs.append(f"{path}: holds {offsets.size - 1} documents / {tokens.size} tokens, the manifest says "
                     f"{sh.documents} / {sh.tokens}")
    if tokens.size and (int(tokens.max()) >= m.vocab_size or bool((tokens == m.eot_id).any())):
        probs.append(f"{path}: holds token ids outside the vocabulary ({m.vocab_size}) or the separator {m.eot_id}")
    if offsets.size > 1 and bool((np.diff(offsets) <= 0).any()):
        probs.append(f"{path}: holds an empty document")
    return probs


# ------------------------------------------------------------------------------ inspect
def document_tokens(out_dir, source: str, index: int, heldout: bool = False) -> tuple[np.ndarray, str, int]:
    """(tokens, shard file, index within the shard) of training document `index` of a source,
    counting across its shards in manifest order (or of held-out document `index`)."""
    out = pathlib.Path(out_dir)
    info = Manifest.load(out).source(source)
    files = ([info.heldout] if info.heldout else []) if heldout else info.shards
    total = sum(f.documents for f in files)
    if not 0 <= index < total:
        kind = "held-out" if heldout else "training"
        raise DataError(f"source {source!r} has {total} {kind} documents; index {index} is out of range")
    for f in files:
        if index < f.documents:
            tokens, offsets = read_shard(out / f.file)
            return np.array(tokens[offsets[index]:offsets[index + 1]]), f.file, index
        index -= f.documents
    raise AssertionError("unreachable")
