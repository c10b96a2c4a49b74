"""Documents from files: parquet, jsonl, jsonl.zst and plain text, read with pyarrow.

A file source is a glob; its matches are read in sorted order of their POSIX paths, each file's
documents in stored order. Formats, by file name:

    *.parquet     one document per row, from a string column (`text` by default)
    *.jsonl       one JSON object per line, the document in a string field (`text` by default)
    *.jsonl.zst   the same, zstd-compressed
    *.txt         the whole file is one document (strict UTF-8)

Documents that are empty or whitespace-only are dropped and counted. Anything else unusable —
bytes that are not UTF-8, a missing column or field, a value that is not a string (null
included), a file that cannot be read or parsed — is a DataError naming the file and, where
known, the row (0-based, counting records in the file). Large files are read in batches, so
memory stays bounded by the batch, not the file.
"""
from __future__ import annotations

import glob as _glob
import os
import pathlib
import re
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from ..fsutil import sha256_file
from .corpus import SourceSpec
from .format import DataError

SUFFIXES = (".parquet", ".jsonl.zst", ".jsonl", ".txt")
PARQUET_BATCH_ROWS = 1024
JSON_BLOCK_BYTES = 1 << 22        # grows (x4 per retry) when one line is longer than a block
JSON_BLOCK_MAX = 1 << 31


def file_format(path) -> str:
    """'parquet', 'jsonl', 'jsonl.zst' or 'txt', from the file name; DataError otherwise."""
    name = pathlib.PurePath(path).name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return suffix[1:]
    raise DataError(f"{path}: unsupported file type (expected one of {', '.join('*' + s for s in SUFFIXES)})")


def expand_glob(pattern: str) -> list[str]:
    """The files a glob matches (`**` recurses), sorted by POSIX path; directories are skipped."""
    matches = [p for p in _glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)]
    return sorted(matches, key=lambda p: pathlib.PurePath(p).as_posix())


# ------------------------------------------------------------------------------ string columns
def _is_string_type(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _checked_strings(col: pa.Array, path, field: str, row0: int) -> list[str]:
    """Python strings of a string column; DataError naming the file and row on a null, a value
    that is not a string, or bytes that are not UTF-8. row0 = row index of col[0] in the file."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type) and _is_string_type(col.type.value_type):
        col = col.dictionary_decode()
    if not _is_string_type(col.type):
        raise DataError(f"{path}: {field!r} holds values of type {col.type}, expected strings (row {row0})")
    if col.null_count:
        i = pc.index(pc.is_null(col), True).as_py()
        raise DataError(f"{path}: row {row0 + i}: {field!r} is missing or null")
    try:
        col.validate(full=True)                       # checks UTF-8 of every value
    except pa.ArrowInvalid:
        raw = col.cast(pa.large_binary()).to_pylist()
        for i, b in enumerate(raw):
            try:
                b.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: row {row0 + i}: {field!r} is not valid UTF-8 "
                                f"(byte {e.start}: {b[e.start:e.start + 1]!r})") from None
        raise DataError(f"{path}: rows {row0}..{row0 + len(col) - 1}: invalid string data") from None
    return col.to_pylist()


# ------------------------------------------------------------------------------ formats
def _parquet_columns(path, field: str) -> Iterator[tuple[int, list[str]]]:
    try:
        f = pq.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read as parquet ({e})") from None
    if field not in f.schema_arrow.names:
        raise DataError(f"{path}: no column {field!r} (columns: {f.schema_arrow.names})")
    row = 0
    try:
        for batch in f.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            yield row, _checked_strings(batch.column(0), path, field, row)
            row += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read as parquet near row {row} ({e})") from None


_ROW_IN_MESSAGE = re.compile(r"in row (\d+)")


def _jsonl_columns(path, field: str, compressed: bool) -> Iterator[tuple[int, list[str]]]:
    """Rows of a JSON-lines file in batches. Only `field` is parsed as a string; other fields are
    ignored. If one line is longer than the block, reading restarts with a bigger block and skips
    the rows already produced."""
    parse = pj.ParseOptions(explicit_schema=pa.schema([(field, pa.string())]),
                            unexpected_field_behavior="ignore")
    block, done = JSON_BLOCK_BYTES, 0
    while True:
        row = 0
        raw = None
        try:
            raw = pa.OSFile(str(path), "rb")
            stream = pa.CompressedInputStream(raw, "zstd") if compressed else raw
            try:
                reader = pj.open_json(stream, parse_options=parse,
                                      read_options=pj.ReadOptions(use_threads=False, block_size=block))
            except pa.ArrowInvalid as e:
                if "Empty JSON stream" in str(e):
                    return                            # an empty file has no documents
                raise
            for batch in reader:
                n = batch.num_rows
                if row + n > done:                    # skip rows produced before a restart
                    col = batch.column(0)
                    skip = max(0, done - row)
                    yield row + skip, _checked_strings(col.slice(skip), path, field, row + skip)
                    done = row + n
                row += n
            return
        except pa.ArrowInvalid as e:
            msg = str(e)
            if "straddl" in msg and block < JSON_BLOCK_MAX:
                block *= 4
                continue
            m = _ROW_IN_MESSAGE.search(msg)
            where = f"row {row + int(m.group(1))}: " if m else (f"near row {row}: " if row else "")
            raise DataError(f"{path}: {where}cannot read as JSON lines with a string field {field!r} ({msg})") from None
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: cannot read{' (zstd)' if compressed else ''} near row {row} ({e})") from None
        finally:
            if raw is not None:
                raw.close()


def _txt_document(path) -> str:
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


class FileDocuments:
    """The documents of a list of files (in the given order). Calling it yields the documents;
    afterwards `.documents` and `.dropped` count what the last call kept and dropped."""

    def __init__(self, files: list[str], text_field: str = "text"):
        self.files = list(files)
        self.text_field = text_field
        self.documents = 0
        self.dropped = 0

    def __call__(self) -> Iterator[str]:
        self.documents = self.dropped = 0
        for path in self.files:
            yield from self._file(path)

    def _file(self, path) -> Iterator[str]:
        fmt = file_format(path)
        if fmt == "txt":
            batches = iter([(0, [_txt_document(path)])])
        elif fmt == "parquet":
            batches = _parquet_columns(path, self.text_field)
        else:
            batches = _jsonl_columns(path, self.text_field, compressed=(fmt == "jsonl.zst"))
        for _, texts in batches:
            for t in texts:
                if t and not t.isspace():
                    self.documents += 1
                    yield t
                else:
                    self.dropped += 1


def read_documents(path, text_field: str = "text") -> Iterator[str]:
    """The kept documents of one file."""
    return FileDocuments([str(path)], text_field)()


def describe_input(path, text_field: str = "text") -> str:
    """'<posix path> bytes=<size> sha256=<hex>[ field=<name>]': what a source was read from."""
    p = pathlib.Path(path)
    try:
        size, digest = p.stat().st_size, sha256_file(p)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    text = f"{pathlib.PurePath(path).as_posix()} bytes={size} sha256={digest}"
    return text if file_format(path) == "txt" else f"{text} field={text_field}"


def file_source(name: str, share: float, glob: str, text_field: str = "text"):
    """A SourceSpec over the files `glob` matches (sorted by POSIX path). Its inputs name every
    file with its size and SHA-256 (and the text field), so a changed file changes the source's
    fingerprint. DataError when the glob matches no file or a file of an unsupported type."""
    files = expand_glob(glob)
    if not files:
        raise DataError(f"source {name!r}: {glob!r} matches no files")
    for f in files:
        file_format(f)
    inputs = [describe_input(f, text_field) for f in files]
    return SourceSpec(name=name, share=share, documents=FileDocuments(files, text_field), inputs=inputs)
