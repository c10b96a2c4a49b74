"""`open1b data`: prepare, verify and inspect token corpora (DESIGN §6)."""
from __future__ import annotations

import pathlib
import sys
import time

import click

from mlx_open1b.cli import INT64_MAX, Path, Positive, fail
from mlx_open1b.data.format import MANIFEST, DataError, Manifest
from mlx_open1b.fsutil import WriteError

# What only a command runs is imported inside it: the corpus pipeline (prepare, the readers, the tokenizer,
# the default corpus, the stream); `open1b --help` and the other commands start without loading it.

DONE_FILE = "_done.json"         # data.prepare.DONE: a finished source's record

# seed and sequence length `inspect --window` uses when none are given
DEFAULT_SEED = 42
DEFAULT_SEQ_LEN = 1024


class _DataGroup(click.Group):
    """A DataError from any subcommand: its message on stderr, exit code 2, no traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DataError as e:
            fail(e)


@click.group(cls=_DataGroup)
def data() -> None:
    """Prepare, verify and inspect token corpora."""


def _load_tokenizer(path: str | None):
    from mlx_open1b.data.tokenizer import Tokenizer
    return Tokenizer.load(path)


def _si(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class _PrepareProgress:
    """Per-source progress on stderr: one live line on a terminal, periodic lines otherwise."""

    def __init__(self, stream=None, interval: float | None = None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.25 if self.tty else 15.0)
        self.last = 0.0
        self.live = False

    def _line(self, text: str, live: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text + ("" if live else "\n"))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.live = live

    def __call__(self, p) -> None:
        now = time.monotonic()
        if p.event == "check":
            if self.tty:
                self._line(f"{p.source}: checking earlier work", live=True)
        elif p.event == "redo":
            self._line(f"{p.source}: preparing again ({p.message})")
        elif p.event == "skip":
            self._line(f"{p.source}: already prepared and intact ({p.documents:,} documents, "
                       f"{_si(p.tokens)} tokens, {p.shards} shards), skipped")
        elif p.event == "start":
            self.last = now
            self._line(f"{p.source}: tokenizing", live=True)
        elif p.event == "update":
            if now - self.last >= self.interval:
                self.last = now
                rate = p.tokens / p.seconds if p.seconds > 0 else 0.0
                self._line(f"{p.source}: {p.documents:,} documents, {_si(p.tokens)} tokens, {p.shards} shards, "
                           f"{_si(p.chars)} chars, {_si(rate)} tokens/s, {p.seconds:.0f} s", live=True)
        elif p.event == "done":
            i = p.info
            rate = p.tokens / p.seconds if p.seconds > 0 else 0.0
            held = (f"held-out {i.heldout.documents:,} documents / {i.heldout.tokens:,} tokens"
                    if i.heldout else "no held-out")
            dropped = f", {p.dropped:,} empty dropped" if p.dropped else ""
            self._line(f"{p.source}: {i.documents:,} documents, {i.tokens:,} tokens in {len(i.shards)} shards, "
                       f"{held}{dropped}; {p.seconds:.1f} s, {_si(rate)} tokens/s")


def _parse_sources(specs: tuple[str, ...], shares: tuple[float, ...], text_field: str):
    from mlx_open1b.data.prepare import check_sources
    from mlx_open1b.data.readers import file_source
    if shares and len(shares) != len(specs):
        raise click.UsageError(f"{len(specs)} --source but {len(shares)} --share: give one --share per "
                               f"--source (paired in order), or none for equal shares")
    out = []
    for i, spec in enumerate(specs):
        name, eq, pattern = spec.partition("=")
        if not eq or not name or not pattern:
            raise click.BadParameter(f"{spec!r}: expected NAME=GLOB", param_hint="--source")
        try:
            out.append(file_source(name, shares[i] if shares else 1.0, pattern, text_field=text_field))
        except DataError as e:
            raise click.BadParameter(f"{spec!r}: {e}", param_hint="--source") from None
    try:
        check_sources(out)
    except DataError as e:
        raise click.BadParameter(str(e), param_hint="--source") from None
    return out


@data.command()
@click.option("--default", "use_default", is_flag=True,
              help="The embedded default corpus (wiki / code / math, shares 0.5 / 0.3 / 0.2).")
@click.option("--source", "source_specs", multiple=True, metavar="NAME=GLOB",
              help="A source: files matching GLOB (*.parquet, *.jsonl, *.jsonl.zst, *.txt; ** recurses). Repeatable.")
@click.option("--share", "shares", multiple=True, type=Positive("share"), metavar="X",
              help="Token share of the --source at the same position (normalized to sum to 1). Repeatable.")
@click.option("--text-field", default="text", show_default=True, help="Parquet column / JSON field holding the text.")
@click.option("--tokenizer", "tokenizer_path", type=Path(dir_okay=False), default=None,
              help="A tokenizer.json (default: the packaged tokenizer).")
@click.option("--shard-tokens", type=click.IntRange(1, (1 << 31) - 1), default=1 << 20, show_default=True,
              help="Tokens per shard (whole documents; a bigger document gets its own shard).")
@click.option("--heldout-tokens", type=click.IntRange(0, (1 << 31) - 1), default=16384, show_default=True,
              help="Held-out tokens per source (at most 10% of its documents; 0: none).")
@click.option("--force", is_flag=True, help="Overwrite a corpus prepared with another tokenizer.")
@click.option("--out", "out_dir", required=True, type=Path(file_okay=False), help="Output directory.")
def prepare(use_default, source_specs, shares, text_field, tokenizer_path, shard_tokens, heldout_tokens, force, out_dir):
    """Tokenize sources into Arrow token shards and a manifest. Restartable: a rerun skips the
    sources already finished and redoes an interrupted one."""
    from mlx_open1b.data.prepare import prepare as run_prepare
    if use_default == bool(source_specs):
        raise click.UsageError("give either --default or one or more --source NAME=GLOB")
    if use_default and shares:
        raise click.UsageError("--share goes with --source, not --default")
    tok = _load_tokenizer(tokenizer_path)
    if use_default:
        from mlx_open1b.data.corpus import default_sources
        sources = default_sources()
    else:
        sources = _parse_sources(source_specs, shares, text_field)
    t0 = time.perf_counter()
    progress = _PrepareProgress()
    try:
        m = run_prepare(sources, out_dir, tok, shard_tokens=shard_tokens, heldout_tokens=heldout_tokens,
                        progress=progress, force=force)
    except WriteError as e:
        if progress.live and progress.tty:
            progress.stream.write("\n")
            progress.live = False
        fail(e.context(intact=f"the sources finished before it, each with its {DONE_FILE} (no manifest until "
                              f"every source is done, so no command reads {out_dir} as a corpus)",
                       then="run the same `open1b data prepare` command again: it skips the finished sources"))
    finally:
        if progress.live and progress.tty:     # end a live status line before any error message
            progress.stream.write("\n")
    _summary(pathlib.Path(out_dir), m, f"prepared in {time.perf_counter() - t0:.1f} s")


def _summary(out: pathlib.Path, m: Manifest, what: str) -> None:
    size = sum((out / f.file).stat().st_size for s in m.sources
               for f in list(s.shards) + ([s.heldout] if s.heldout else []) if (out / f.file).is_file())
    click.echo(f"{out / MANIFEST}: {what}; tokenizer {m.tokenizer_sha256[:12]}… (vocab {m.vocab_size}, "
               f"separator {m.eot_id})")
    click.echo(f"  {'source':12s} {'share':>6s} {'documents':>11s} {'tokens':>13s} {'mean len':>9s} "
               f"{'shards':>6s} {'held-out docs/tokens':>21s}")
    for s in m.sources:
        held = f"{s.heldout.documents:,}/{s.heldout.tokens:,}" if s.heldout else "-"
        click.echo(f"  {s.name:12s} {s.share:6.3f} {s.documents:11,d} {s.tokens:13,d} {s.mean_doc_len:9.1f} "
                   f"{len(s.shards):6d} {held:>21s}")
    click.echo(f"  total {sum(s.tokens for s in m.sources):,} training tokens, "
               f"{sum(len(s.shards) for s in m.sources)} shards, {_bytes(size)} on disk")


@data.command()
@click.argument("corpus_dir", type=Path(file_okay=False))
@click.option("--tokenizer", "tokenizer_path", type=Path(dir_okay=False), default=None,
              help="Also check that the corpus was prepared with this tokenizer.json.")
def verify(corpus_dir, tokenizer_path):
    """Rehash every shard and held-out file against the manifest. Exit 0 when intact, 1 listing
    every problem."""
    from mlx_open1b.data.prepare import verify as run_verify
    out = pathlib.Path(corpus_dir)
    m = Manifest.load(out)
    tok = _load_tokenizer(tokenizer_path) if tokenizer_path else None
    files = [f for s in m.sources for f in list(s.shards) + ([s.heldout] if s.heldout else [])]
    total = sum((out / f.file).stat().st_size for f in files if (out / f.file).is_file())
    with click.progressbar(length=max(total, 1), label="hashing", file=sys.stderr) as bar:
        problems = run_verify(out, tok, progress=lambda _f, n: bar.update(n))
    if problems:
        for p in problems:
            click.echo(p)
        click.echo(f"{out}: {len(problems)} problem{'s' if len(problems) != 1 else ''}")
        sys.exit(1)
    _summary(out, m, f"intact, {len(files)} files match their SHA-256"
             + (f", tokenizer {tokenizer_path} matches" if tok else ""))


def _decode_pieces(tok, window, pieces, eot: int):
    """(piece, text, has_separator) for each provenance piece of a window."""
    at = 0
    for p in pieces:
        n = p[4] - p[3]
        ids = window[at:at + n]
        at += n
        sep = bool(n) and int(ids[-1]) == eot
        yield p, tok.decode([int(x) for x in (ids[:-1] if sep else ids)]), sep


@data.command()
@click.argument("corpus_dir", type=Path(file_okay=False))
@click.option("--window", "window", type=click.IntRange(0, INT64_MAX), default=None, help="Window index N of the canonical stream.")
@click.option("--seed", type=click.IntRange(0, 2 ** 64 - 1), default=DEFAULT_SEED, show_default=True)
@click.option("--seq-len", type=click.IntRange(1, (1 << 31) - 1), default=DEFAULT_SEQ_LEN, show_default=True)
@click.option("--source", default=None, help="With --doc: a stored document of this source.")
@click.option("--doc", type=click.IntRange(0, INT64_MAX), default=None, help="Training document index of --source.")
@click.option("--heldout", is_flag=True, help="With --doc: index into the held-out documents.")
@click.option("--ids", is_flag=True, help="Print token ids as well.")
@click.option("--tokenizer", "tokenizer_path", type=Path(dir_okay=False), default=None,
              help="The corpus's tokenizer.json (default: the packaged tokenizer).")
def inspect(corpus_dir, window, seed, seq_len, source, doc, heldout, ids, tokenizer_path):
    """Decoded text and provenance of window N of the canonical stream (--window N), or of one
    stored document (--source NAME --doc I)."""
    out = pathlib.Path(corpus_dir)
    if (window is None) == (doc is None):
        raise click.UsageError("give either --window N or --source NAME --doc I")
    if doc is not None and source is None:
        raise click.UsageError("--doc needs --source NAME")
    m = Manifest.load(out)
    if doc is not None and source not in [s.name for s in m.sources]:
        raise click.BadParameter(f"{source!r} is not a source of {out} (its sources: "
                                 f"{', '.join(s.name for s in m.sources)})", param_hint="--source")
    tok = _load_tokenizer(tokenizer_path)
    if tok.sha256 != m.tokenizer_sha256:
        raise DataError(f"{out / MANIFEST}: prepared with tokenizer {m.tokenizer_sha256[:12]}…, the tokenizer "
                        f"loaded ({tokenizer_path or 'packaged default'}) is {tok.sha256[:12]}…; pass --tokenizer PATH")
    if doc is not None:
        from mlx_open1b.data.prepare import document_tokens
        tokens, file, i = document_tokens(out, source, doc, heldout=heldout)
        click.echo(f"# {'held-out' if heldout else 'training'} document {doc} of source {source!r}: "
                   f"{file} document {i}, {tokens.size} tokens")
        if ids:
            click.echo("# ids: " + " ".join(str(int(x)) for x in tokens))
        click.echo(tok.decode([int(x) for x in tokens]))
        return
    from mlx_open1b.data.stream import Stream
    st = Stream(out, seed, seq_len)
    w = st.window(window)
    pieces = st.window_sources(window)
    click.echo(f"# window {window} of {out} (seed {seed}, seq_len {seq_len}): {w.size} tokens in "
               f"{len(pieces)} piece{'s' if len(pieces) != 1 else ''}")
    if ids:
        click.echo("# ids: " + " ".join(str(int(x)) for x in w))
    for (name, shard, d, a, b), text, sep in _decode_pieces(tok, w, pieces, m.eot_id):
        file = m.source(name).shards[shard].file
        click.echo(f"# --- source {name!r}, {file} document {d}, tokens [{a}, {b - 1 if sep else b})"
                   + (" + separator" if sep else ""))
        click.echo(text)
        if sep:
            click.echo("# <end of text>")


@data.group(cls=_DataGroup)
def tokenizer() -> None:
    """Train a tokenizer on your own corpus."""


@tokenizer.command(name="train")
@click.option("--default", "use_default", is_flag=True, help="Train on the embedded default corpus.")
@click.option("--source", "source_specs", multiple=True, metavar="NAME=GLOB",
              help="Training text: files matching GLOB (*.parquet, *.jsonl, *.jsonl.zst, *.txt; ** recurses), "
                   "the same --source as `data prepare`. Repeatable; read in the order given.")
@click.option("--text-field", default="text", show_default=True, help="Parquet column / JSON field holding the text.")
@click.option("--vocab", "vocab_size", type=click.IntRange(257, (1 << 31) - 1), required=True,
              help="Vocabulary size: the separator, the 256 bytes, then merges (fewer when the text runs out "
                   "of pairs seen twice; the size trained is printed).")
@click.option("--force", is_flag=True, help="Replace an existing --out file with different content.")
@click.option("--out", "out_file", required=True, type=Path(dir_okay=False), help="The tokenizer.json to write.")
def tokenizer_train(use_default, source_specs, text_field, vocab_size, force, out_file):
    """Train a byte-level BPE tokenizer (the default's recipe) on the sources. Deterministic: the
    same files in the same order give the same bytes; its SHA-256 is printed and is what
    `data prepare --tokenizer` records in the manifest and every run records in run.json."""
    import hashlib

    from mlx_open1b.data.tokenizer import Tokenizer, train_tokenizer_bytes
    from mlx_open1b.fsutil import write_bytes_atomic
    if use_default == bool(source_specs):
        raise click.UsageError("give either --default or one or more --source NAME=GLOB")
    if use_default:
        from mlx_open1b.data.corpus import default_sources
        sources = default_sources()
    else:
        sources = _parse_sources(source_specs, (), text_field)

    def texts():
        for s in sources:
            yield from s.documents()

    out = pathlib.Path(out_file)
    if out.exists() and not out.is_file():
        raise DataError(f"{out}: exists and is not a file")
    t0 = time.perf_counter()
    data = train_tokenizer_bytes(texts(), vocab_size)    # reads every document before anything is written
    sha = hashlib.sha256(data).hexdigest()
    if out.exists() and not force and hashlib.sha256(out.read_bytes()).hexdigest() != sha:
        raise DataError(f"{out}: exists with other content (a corpus prepared with it would no longer match); "
                        f"use --force to replace it or choose another --out")
    try:
        write_bytes_atomic(out, data)
    except WriteError as e:
        fail(e.context(intact=f"any earlier {out} (the file is replaced whole)", then="run the same command again"))
    tok = Tokenizer.load(out)
    click.echo(f"{out}: vocab {tok.vocab_size} (asked {vocab_size}), separator {tok.eot_id}, sha256 {sha}; "
               f"trained in {time.perf_counter() - t0:.1f} s")
    click.echo(f"next: open1b data prepare --tokenizer {out} --source ... --out DIR, then open1b train --data DIR "
               f"--tokenizer {out} (model.vocab_size {tok.vocab_size}, from the tokenizer)")
