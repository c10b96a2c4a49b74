"""Ingest / prepare / verify / inspect and `open1b data` (DESIGN §6).

Two tokenizers: ByteTok (token = UTF-8 byte + 1, separator 0) makes token counts exact and
obvious for the shard and held-out rules; a real byte-level BPE trained here on a few strings
exercises the pipeline with the project's Tokenizer class."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from mlx_open1b.cli.main import cli
from mlx_open1b.data import prepare as prep
from mlx_open1b.data import readers
from mlx_open1b.data.corpus import SourceSpec
from mlx_open1b.data.format import MANIFEST, DataError, Manifest, read_shard, write_shard
from mlx_open1b.data.prepare import document_tokens, prepare, verify
from mlx_open1b.data.readers import FileDocuments, file_source, read_documents


# ------------------------------------------------------------------------------ tokenizers
class ByteTok:
    """Token id = UTF-8 byte + 1; separator 0. Same interface as data.tokenizer.Tokenizer."""

    def __init__(self, tag: str = "bytes"):
        self.sha256 = hashlib.sha256(f"test-byte-tokenizer/{tag}".encode()).hexdigest()
        self.vocab_size, self.eot_id, self.path = 257, 0, f"<ByteTok {tag}>"

    def encode_batch(self, texts):
        return [np.frombuffer(t.encode(), np.uint8).astype(np.uint32) + 1 for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) - 1 for i in ids).decode("utf-8", errors="replace")


BPE_TRAIN = ["The quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x * 2\n",
             "Solve 3x + 4 = 19. Subtract 4: 3x = 15. Divide by 3: x = 5. Answer: 5",
             "Zürich, naïve café — ünïcödé text."]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory) -> pathlib.Path:
    """A small byte-level BPE tokenizer.json trained on a few strings (the project's recipe)."""
    from mlx_open1b.data.tokenizer import train_default_tokenizer
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_default_tokenizer(BPE_TRAIN * 2, vocab_size=300).to_str(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bpe(bpe_path):
    from mlx_open1b.data.tokenizer import Tokenizer
    return Tokenizer.load(str(bpe_path))


# ------------------------------------------------------------------------------ input files
def write_parquet(path, texts, field="text", row_group_size=None, **extra):
    pq.write_table(pa.table({field: pa.array(texts, pa.string()), **extra}), path, row_group_size=row_group_size)


def write_jsonl(path, records):
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    if str(path).endswith(".zst"):
        with pa.CompressedOutputStream(str(path), "zstd") as out:
            out.write(data)
    else:
        pathlib.Path(path).write_bytes(data)


def list_source(name, texts, share=1.0):
    return SourceSpec(name=name, share=share, documents=lambda: iter(list(texts)), inputs=[f"test:{name}:{len(texts)}"])


def decode_file(tok, path) -> list[str]:
    tokens, offsets = read_shard(path)
    return [tok.decode(tokens[offsets[i]:offsets[i + 1]]) for i in range(offsets.size - 1)]


def training_texts(tok, out, info) -> list[str]:
    return [t for sh in info.shards for t in decode_file(tok, out / sh.file)]


def tree_bytes(d: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != prep.LOCK}


# ------------------------------------------------------------------------------ readers
def test_every_format_in_sorted_order(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    write_parquet(d / "b.parquet", ["parquet one", "parquet two"], other=pa.array([1, 2]))
    write_jsonl(d / "a.jsonl", [{"text": "jsonl one", "id": 1}, {"text": "jsonl two", "meta": {"x": [1]}}])
    write_jsonl(d / "c.jsonl.zst", [{"text": "zst one"}, {"text": "zst \u00e9 two"}])
    (d / "sub" / "d.txt").write_text("a whole\nfile\n", encoding="utf-8")
    src = file_source("mix", 1.0, str(d / "**" / "*"))
    assert list(src.documents()) == ["jsonl one", "jsonl two", "parquet one", "parquet two",
                                     "zst one", "zst \u00e9 two", "a whole\nfile\n"]
    assert [i.split(" ")[0].rsplit("/", 1)[1] for i in src.inputs] == ["a.jsonl", "b.parquet", "c.jsonl.zst", "d.txt"]
    sha = hashlib.sha256((d / "a.jsonl").read_bytes()).hexdigest()
    assert f"bytes={(d / 'a.jsonl').stat().st_size} sha256={sha} field=text" in src.inputs[0]
    assert "field=" not in src.inputs[3]


def test_custom_text_field(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["p1", "p2"], field="content")
    write_jsonl(tmp_path / "b.jsonl.zst", [{"content": "j1", "text": 5}, {"content": "j2"}])
    assert list(file_source("s", 1, str(tmp_path / "*"), text_field="content").documents()) == ["p1", "p2", "j1", "j2"]
    with pytest.raises(DataError, match=r"a\.parquet.*no column 'text'"):
        list(read_documents(tmp_path / "a.parquet"))


def test_empty_and_whitespace_documents_dropped(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": ""}, {"text": "keep"}, {"text": " \n\t\u00a0"}, {"text": "x"}])
    write_parquet(tmp_path / "b.parquet", ["", "  ", "also kept"])
    (tmp_path / "c.txt").write_text("\n\n  \n")
    docs = FileDocuments(readers.expand_glob(str(tmp_path / "*")))
    assert list(docs()) == ["keep", "x", "also kept"]
    assert (docs.documents, docs.dropped) == (3, 5)


def test_large_files_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "PARQUET_BATCH_ROWS", 3)
    monkeypatch.setattr(readers, "JSON_BLOCK_BYTES", 64)      # lines longer than a block: retried, no duplicates
    texts = [f"document {i} " + "y" * (i * 7) for i in range(40)]
    write_parquet(tmp_path / "a.parquet", texts, row_group_size=7)
    write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in texts])
    write_jsonl(tmp_path / "c.jsonl.zst", [{"text": t} for t in texts])
    for f in ("a.parquet", "b.jsonl", "c.jsonl.zst"):
        assert list(read_documents(tmp_path / f)) == texts, f


def test_non_utf8_names_the_file(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"fine\xff\xfe")
    with pytest.raises(DataError, match=r"bad\.txt.*not valid UTF-8"):
        list(read_documents(tmp_path / "bad.txt"))
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "b\xffd"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl: row 1: 'text' is not valid UTF-8"):
        list(read_documents(tmp_path / "bad.jsonl"))
    ok = pa.array([b"good", b"ba\xc3d"], pa.binary())
    col = pa.Array.from_buffers(pa.string(), 2, ok.buffers())      # a string column with invalid bytes
    pq.write_table(pa.table({"text": col}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: row 1: 'text' is not valid UTF-8"):
        list(read_documents(tmp_path / "bad.parquet"))


def test_missing_or_wrong_field_names_file_and_row(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["x"], field="body")
    with pytest.raises(DataError, match=r"a\.parquet: no column 'text'"):
        list(read_documents(tmp_path / "a.parquet"))
    pq.write_table(pa.table({"text": pa.array([1, 2])}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n\.parquet: 'text' holds values of type int64"):
        list(read_documents(tmp_path / "n.parquet"))
    pq.write_table(pa.table({"text": pa.array(["a", None])}), tmp_path / "null.parquet")
    with pytest.raises(DataError, match=r"null\.parquet: row 1: 'text' is missing or null"):
        list(read_documents(tmp_path / "null.parquet"))
    write_jsonl(tmp_path / "m.jsonl", [{"text": "a"}, {"text": "b"}, {"body": "c"}])
    with pytest.raises(DataError, match=r"m\.jsonl: row 2: 'text' is missing or null"):
        list(read_documents(tmp_path / "m.jsonl"))
    write_jsonl(tmp_path / "v.jsonl", [{"text": "a"}, {"text": 7}])
    with pytest.raises(DataError, match=r"v\.jsonl: row 1: .*string field 'text'"):
        list(read_documents(tmp_path / "v.jsonl"))
    (tmp_path / "j.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"j\.jsonl: row 1"):
        list(read_documents(tmp_path / "j.jsonl"))
    (tmp_path / "z.jsonl.zst").write_bytes(b"not zstd at all")
    with pytest.raises(DataError, match=r"z\.jsonl\.zst"):
        list(read_documents(tmp_path / "z.jsonl.zst"))
    (tmp_path / "p.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"p\.parquet: cannot read as parquet"):
        list(read_documents(tmp_path / "p.parquet"))


def test_glob_errors(tmp_path):
    with pytest.raises(DataError, match=r"source 'w'.*matches no files"):
        file_source("w", 1, str(tmp_path / "*.jsonl"))
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(DataError, match=r"notes\.md: unsupported file type"):
        file_source("w", 1, str(tmp_path / "*"))


# ------------------------------------------------------------------------------ prepare: rules
def docs_of_lengths(lengths, tag="d"):
    """Documents whose ByteTok lengths are exactly `lengths` (distinct texts)."""
    out = []
    for i, n in enumerate(lengths):
        head = f"{tag}{i}:"
        assert n >= len(head)
        out.append(head + "x" * (n - len(head)))
    return out


@pytest.mark.parametrize("lengths,heldout_tokens,expect_h", [
    ([10], 100, 0),                        # one document: no held-out
    ([10, 10], 100, 1),                    # >= 2 documents: at least 1
    ([10] * 100, 35, 4),                   # enough tokens after 4 documents
    ([10] * 100, 30, 3),                   # exactly reached
    ([10] * 100, 100000, 10),              # capped at 10% of documents
    ([10] * 5, 100000, 1),                 # cap is at least 1
    ([10] * 30 + [50], 20, 1),             # one long last document suffices
    ([10] * 20, 0, 0),                     # heldout_tokens = 0: none
])
def test_heldout_rule(tmp_path, lengths, heldout_tokens, expect_h):
    tok, texts = ByteTok(), docs_of_lengths(lengths)
    m = prepare([list_source("s", texts)], tmp_path, tok, shard_tokens=64, heldout_tokens=heldout_tokens)
    s = m.sources[0]
    assert (s.heldout.documents if s.heldout else 0) == expect_h
    assert s.documents == len(texts) - expect_h
    assert training_texts(tok, tmp_path, s) == texts[:len(texts) - expect_h]
    if expect_h:
        assert decode_file(tok, tmp_path / s.heldout.file) == texts[len(texts) - expect_h:]
        assert s.heldout.tokens == sum(lengths[len(texts) - expect_h:])
    else:
        assert not (tmp_path / "s" / "heldout.arrow").exists()


def test_shard_boundaries(tmp_path):
    tok = ByteTok()
    texts = ["aaa", "bbb", "ccc", "d" * 10, "ee", "ff", "g" * 6, "h", "end"]
    m = prepare([list_source("s", texts)], tmp_path, tok, shard_tokens=6, heldout_tokens=0)
    s = m.sources[0]
    assert [decode_file(tok, tmp_path / sh.file) for sh in s.shards] == \
        [["aaa", "bbb"], ["ccc"], ["d" * 10], ["ee", "ff"], ["g" * 6], ["h", "end"]]
    assert [sh.file for sh in s.shards] == [f"s/shard-{i:05d}.arrow" for i in range(6)]
    for sh in s.shards:
        tokens, offsets = read_shard(tmp_path / sh.file)
        assert (sh.documents, sh.tokens) == (offsets.size - 1, tokens.size)
        assert sh.sha256 == hashlib.sha256((tmp_path / sh.file).read_bytes()).hexdigest()


def test_names_shares_and_sizes_are_checked(tmp_path):
    tok, one = ByteTok(), ["some text"]
    bad = [
        ([list_source("a b", one)], "names must match"),
        ([list_source("..", one)], "not start with"),
        ([list_source(MANIFEST, one)], "names must match"),
        ([list_source("a", one), list_source("A", one)], "duplicate"),
        ([list_source("a", one, share=0)], "share must be"),
        ([list_source("a", one, share=float("nan"))], "share must be"),
        ([list_source("a", one, share=-1)], "share must be"),
        ([], "no sources"),
    ]
    for sources, msg in bad:
        with pytest.raises(DataError, match=msg):
            prepare(sources, tmp_path / "o", tok)
    with pytest.raises(DataError, match="shard_tokens"):
        prepare([list_source("a", one)], tmp_path / "o", tok, shard_tokens=0)
    m = prepare([list_source("a", one, 2), list_source("b", one, 6)], tmp_path / "o", tok)
    assert [s.share for s in m.sources] == [0.25, 0.75]


def test_source_without_documents_names_the_source(tmp_path):
    write_jsonl(tmp_path / "e.jsonl", [{"text": "  "}, {"text": ""}])
    src = file_source("empty_src", 1, str(tmp_path / "e.jsonl"))
    with pytest.raises(DataError, match=r"source 'empty_src' has no documents \(2 empty ones dropped\).*e\.jsonl"):
        prepare([list_source("ok", ["fine"]), src], tmp_path / "o", ByteTok())
    assert not (tmp_path / "o" / MANIFEST).exists()
    with pytest.raises(DataError, match=r"source 'nothing' has no documents"):
        prepare([list_source("nothing", [])], tmp_path / "o2", ByteTok())


def test_reader_errors_name_source_and_file(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "b\xffd"}\n')
    with pytest.raises(DataError, match=r"source 'web': .*bad\.jsonl: row 0"):
        prepare([file_source("web", 1, str(tmp_path / "bad.jsonl"))], tmp_path / "o", ByteTok())


# ------------------------------------------------------------------------------ prepare: real tokenizer
@pytest.fixture
def three_sources(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    rng = np.random.default_rng(7)
    words = ["alpha", "beta", "gamma", "delta", "über", "naïve", "x=1", "def", "return", "\n", "42", "π"]
    def doc(n):
        return " ".join(rng.choice(words, n))
    wiki = [doc(int(rng.integers(5, 60))) for _ in range(60)]
    code = [doc(int(rng.integers(20, 200))) for _ in range(25)]
    math_ = [doc(int(rng.integers(1, 30))) for _ in range(40)]
    write_jsonl(d / "wiki-0.jsonl", [{"text": t} for t in wiki[:30]])
    write_jsonl(d / "wiki-1.jsonl.zst", [{"text": t} for t in wiki[30:]] + [{"text": "   "}])
    write_parquet(d / "code.parquet", code, row_group_size=10)
    (d / "math").mkdir()
    for i, t in enumerate(math_):
        (d / "math" / f"{i:03d}.txt").write_text(t, encoding="utf-8")
    sources = lambda: [file_source("wiki", 0.5, str(d / "wiki-*")), file_source("code", 0.3, str(d / "code.parquet")),
                       file_source("math", 0.2, str(d / "math" / "*.txt"))]
    return sources, {"wiki": wiki, "code": code, "math": math_}


def test_prepare_round_trip_and_manifest(tmp_path, three_sources, bpe):
    sources, texts = three_sources
    out = tmp_path / "out"
    m = prepare(sources(), out, bpe, shard_tokens=500, heldout_tokens=300)
    assert Manifest.load(out) == m
    assert (m.tokenizer_sha256, m.vocab_size, m.eot_id) == (bpe.sha256, bpe.vocab_size, bpe.eot_id)
    assert m.created_by.endswith(__import__("mlx_open1b").__version__)
    assert [s.name for s in m.sources] == ["wiki", "code", "math"] and [s.share for s in m.sources] == [0.5, 0.3, 0.2]
    for s in m.sources:
        src = texts[s.name]
        h = s.heldout.documents
        assert 1 <= h <= max(1, len(src) // 10)
        assert s.documents + h == len(src)
        train, held = training_texts(bpe, out, s), decode_file(bpe, out / s.heldout.file)
        assert train == src[:s.documents] and held == src[s.documents:]
        ids = [bpe.encode_batch([t])[0] for t in src]
        assert s.tokens == sum(len(x) for x in ids[:s.documents]) == sum(sh.tokens for sh in s.shards)
        assert s.heldout.tokens == sum(len(x) for x in ids[s.documents:])
        assert s.heldout.tokens >= 300 or h == max(1, len(src) // 10)
        assert s.mean_doc_len == s.tokens / s.documents
        for a, b in zip(s.shards, s.shards[1:]):        # a new shard only when the next document would overflow
            first_next = decode_file(bpe, out / b.file)[0]
            assert a.tokens <= 500 or a.documents == 1
            assert a.tokens + len(bpe.encode_batch([first_next])[0]) > 500
        assert len(s.inputs) >= 1 and all("sha256=" in i for i in s.inputs)
    assert verify(out, bpe) == []
    assert not list(out.rglob("*.tmp"))


def test_shard_bytes_are_deterministic(tmp_path, three_sources, bpe):
    sources, _ = three_sources
    prepare(sources(), tmp_path / "a", bpe, shard_tokens=400, heldout_tokens=200)
    prepare(sources(), tmp_path / "b", bpe, shard_tokens=400, heldout_tokens=200)
    a, b = tree_bytes(tmp_path / "a"), tree_bytes(tmp_path / "b")
    assert a == b and len(a) > 6
    docs = [np.arange(n, dtype=np.uint32) * 7 for n in (1, 5, 3, 1000)]
    write_shard(tmp_path / "x.arrow", docs)
    write_shard(tmp_path / "y.arrow", [d.copy() for d in docs])
    assert (tmp_path / "x.arrow").read_bytes() == (tmp_path / "y.arrow").read_bytes()


def test_rerun_is_idempotent_and_skips_work(tmp_path, three_sources, bpe):
    sources, _ = three_sources
    out = tmp_path / "out"
    prepare(sources(), out, bpe, shard_tokens=400, heldout_tokens=200)
    before = tree_bytes(out)
    mtime = (out / MANIFEST).stat().st_mtime_ns
    events = []
    specs = sources()
    for s in specs:
        s.documents = lambda: pytest.fail("a finished source was read again")
    prepare(specs, out, bpe, shard_tokens=400, heldout_tokens=200, progress=events.append)
    assert tree_bytes(out) == before
    assert (out / MANIFEST).stat().st_mtime_ns == mtime
    assert [e.event for e in events if e.event in ("skip", "start")] == ["skip"] * 3
    # another option changes every fingerprint: all are prepared again
    events.clear()
    prepare(sources(), out, bpe, shard_tokens=300, heldout_tokens=200, progress=events.append)
    assert [e.source for e in events if e.event == "done"] == ["wiki", "code", "math"]
    # a changed input file changes only that source
    events.clear()
    (tmp_path / "in" / "math" / "000.txt").write_text("a changed document", encoding="utf-8")
    prepare(sources(), out, bpe, shard_tokens=300, heldout_tokens=200, progress=events.append)
    assert [e.source for e in events if e.event == "done"] == ["math"]
    assert verify(out, bpe) == []


def test_restart_after_crash_mid_source(tmp_path, three_sources, bpe, monkeypatch):
    sources, _ = three_sources
    ref = tmp_path / "ref"
    prepare(sources(), ref, bpe, shard_tokens=300, heldout_tokens=200)
    out = tmp_path / "out"
    real = prep.write_shard

    def crashing(path, docs):
        if pathlib.Path(path).as_posix().endswith("code/shard-00001.arrow"):   # crash inside source 2
            real(path, docs)         # written ...
            raise KeyboardInterrupt("simulated crash")   # ... but never recorded
        return real(path, docs)

    monkeypatch.setattr(prep, "write_shard", crashing)
    with pytest.raises(KeyboardInterrupt):
        prepare(sources(), out, bpe, shard_tokens=300, heldout_tokens=200)
    monkeypatch.setattr(prep, "write_shard", real)
    assert not (out / MANIFEST).exists()
    assert (out / "wiki" / prep.DONE).exists() and not (out / "code" / prep.DONE).exists()
    assert list((out / "code").glob("shard-*.arrow"))
    (out / "code" / ".shard-00009.arrow.abc.tmp").write_bytes(b"junk left by a crash")
    events = []
    prepare(sources(), out, bpe, shard_tokens=300, heldout_tokens=200, progress=events.append)
    assert [(e.source, e.event) for e in events if e.event in ("skip", "done", "redo")] == \
        [("code", "redo"), ("wiki", "skip"), ("code", "done"), ("math", "done")]
    assert tree_bytes(out) == tree_bytes(ref)
    assert not list(out.rglob("*.tmp"))


def test_changed_shard_is_detected_and_redone(tmp_path, three_sources, bpe):
    sources, _ = three_sources
    out = tmp_path / "out"
    prepare(sources(), out, bpe, shard_tokens=300, heldout_tokens=200)
    before = tree_bytes(out)
    f = out / "code" / "shard-00001.arrow"
    b = bytearray(f.read_bytes()); b[-100] ^= 1; f.write_bytes(bytes(b))
    events = []
    prepare(sources(), out, bpe, shard_tokens=300, heldout_tokens=200, progress=events.append)
    assert [(e.source, e.message) for e in events if e.event == "redo"] == [("code", "code/shard-00001.arrow changed")]
    assert tree_bytes(out) == before


def test_other_tokenizer_needs_force(tmp_path, bpe):
    out = tmp_path / "out"
    prepare([list_source("a", ["hello world", "more text"])], out, bpe)
    with pytest.raises(DataError, match=r"manifest\.json: was prepared with tokenizer .*--force"):
        prepare([list_source("a", ["hello world", "more text"])], out, ByteTok())
    assert Manifest.load(out).tokenizer_sha256 == bpe.sha256
    m = prepare([list_source("a", ["hello world", "more text"])], out, ByteTok(), force=True)
    assert Manifest.load(out) == m and m.tokenizer_sha256 == ByteTok().sha256
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON.*--force"):
        prepare([list_source("a", ["hello world"])], out, ByteTok())


def test_one_prepare_per_directory(tmp_path):
    import fcntl
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / prep.LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(DataError, match="another `open1b data prepare`"):
            prepare([list_source("a", ["text"])], out, ByteTok())
    finally:
        os.close(fd)
    prepare([list_source("a", ["text"])], out, ByteTok())


# ------------------------------------------------------------------------------ verify / inspect
@pytest.fixture
def prepared(tmp_path, three_sources, bpe):
    sources, texts = three_sources
    out = tmp_path / "out"
    prepare(sources(), out, bpe, shard_tokens=300, heldout_tokens=200)
    return out, texts


def test_verify_names_each_bad_file(prepared, bpe):
    out, _ = prepared
    assert verify(out, bpe) == []
    f = out / "wiki" / "shard-00001.arrow"
    b = bytearray(f.read_bytes()); b[len(b) // 2] ^= 0x10; f.write_bytes(bytes(b))
    (out / "code" / "shard-00000.arrow").unlink()
    (out / "math" / "heldout.arrow").write_bytes(b"")
    problems = verify(out, ByteTok())
    assert len(problems) == 4, problems
    assert "manifest.json: prepared with tokenizer sha256" in problems[0] and "<ByteTok bytes>" in problems[0]
    assert str(f) in problems[1] and "differs from the manifest" in problems[1]
    assert problems[2] == f"{out / 'code' / 'shard-00000.arrow'}: missing"
    assert str(out / "math" / "heldout.arrow") in problems[3]
    (out / MANIFEST).unlink()
    with pytest.raises(DataError, match=r"manifest\.json: no manifest"):
        verify(out)


def test_document_tokens(prepared, bpe):
    out, texts = prepared
    m = Manifest.load(out)
    code = m.source("code")
    for i in (0, code.shards[0].documents, code.documents - 1):
        ids, file, j = document_tokens(out, "code", i)
        assert bpe.decode(ids) == texts["code"][i]
    ids, file, j = document_tokens(out, "code", 0, heldout=True)
    assert bpe.decode(ids) == texts["code"][code.documents] and file == "code/heldout.arrow"
    with pytest.raises(DataError, match="out of range"):
        document_tokens(out, "code", code.documents)
    with pytest.raises(DataError, match="no source named 'web'"):
        document_tokens(out, "web", 0)


# ------------------------------------------------------------------------------ CLI
def test_cli_prepare_verify_inspect(tmp_path, three_sources, bpe_path, bpe):
    sources, texts = three_sources
    src = tmp_path / "in"
    out = tmp_path / "out"
    runner = CliRunner()
    args = ["data", "prepare", "--source", f"wiki={src}/wiki-*", "--share", "0.5",
            "--source", f"code={src}/code.parquet", "--share", "0.3",
            "--source", f"math={src}/math/*.txt", "--share", "0.2",
            "--tokenizer", str(bpe_path), "--shard-tokens", "300", "--heldout-tokens", "200", "--out", str(out)]
    r = runner.invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "wiki: " in r.stderr and "tokens/s" in r.stderr
    assert "training tokens" in r.stdout
    ref = tmp_path / "ref"
    prepare(sources(), ref, bpe, shard_tokens=300, heldout_tokens=200)
    assert tree_bytes(out) == tree_bytes(ref)
    r = runner.invoke(cli, args)
    assert r.exit_code == 0 and r.stderr.count("skipped") == 3, r.output

    r = runner.invoke(cli, ["data", "verify", str(out), "--tokenizer", str(bpe_path)])
    assert r.exit_code == 0 and "intact" in r.stdout, r.output

    r = runner.invoke(cli, ["data", "inspect", str(out), "--source", "code", "--doc", "3", "--tokenizer", str(bpe_path)])
    assert r.exit_code == 0, r.output
    assert texts["code"][3] in r.stdout and "code/shard-" in r.stdout

    r = runner.invoke(cli, ["data", "inspect", str(out), "--window", "5", "--seed", "3", "--seq-len", "64",
                            "--tokenizer", str(bpe_path)])
    assert r.exit_code == 0, r.output
    assert "# window 5" in r.stdout and "# --- source " in r.stdout

    f = out / "math" / "shard-00000.arrow"
    f.write_bytes(f.read_bytes()[:-1] + b"\x01")
    (out / "code" / "heldout.arrow").unlink()
    r = runner.invoke(cli, ["data", "verify", str(out)])
    assert r.exit_code == 1
    assert str(f) in r.stdout and str(out / "code" / "heldout.arrow") in r.stdout and "2 problems" in r.stdout


def test_cli_errors(tmp_path, bpe_path):
    runner = CliRunner()
    r = runner.invoke(cli, ["data", "verify", str(tmp_path)])
    assert r.exit_code == 2 and "error: " in r.stderr and "no manifest" in r.stderr
    assert "Traceback" not in r.output
    r = runner.invoke(cli, ["data", "prepare", "--source", f"w={tmp_path}/*.jsonl", "--tokenizer", str(bpe_path),
                            "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "matches no files" in r.stderr and "Traceback" not in r.output
    (tmp_path / "a.txt").write_text("text")
    r = runner.invoke(cli, ["data", "prepare", "--source", f"w={tmp_path}/a.txt", "--share", "1", "--share", "2",
                            "--tokenizer", str(bpe_path), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--share" in r.stderr
    r = runner.invoke(cli, ["data", "prepare", "--tokenizer", str(bpe_path), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--default" in r.stderr
    (tmp_path / "bad.txt").write_bytes(b"\xff")
    r = runner.invoke(cli, ["data", "prepare", "--source", f"w={tmp_path}/bad.txt", "--tokenizer", str(bpe_path),
                            "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "bad.txt" in r.stderr and "UTF-8" in r.stderr


@pytest.mark.slow
def test_cli_prepare_default_corpus(tmp_path):
    out = tmp_path / "default"
    t0 = time.perf_counter()
    r = CliRunner().invoke(cli, ["data", "prepare", "--default", "--out", str(out)])
    seconds = time.perf_counter() - t0
    assert r.exit_code == 0, r.output
    m = Manifest.load(out)
    assert [s.name for s in m.sources] == ["wiki", "code", "math"]
    size = sum(p.stat().st_size for p in out.rglob("*.arrow"))
    print(f"\ndefault prepare: {seconds:.1f} s, {size / 2**20:.1f} MiB")
    print(r.stdout)
    r = CliRunner().invoke(cli, ["data", "verify", str(out)])
    assert r.exit_code == 0, r.output
    t0 = time.perf_counter()
    r = CliRunner().invoke(cli, ["data", "prepare", "--default", "--out", str(out)])
    assert r.exit_code == 0 and r.stderr.count("skipped") == 3, r.output
    print(f"rerun (all skipped): {time.perf_counter() - t0:.1f} s")


def test_corpus_dir_prepares_the_default_and_names_a_missing_corpus(tmp_path, default_corpus, monkeypatch):
    """The commands' and benchmarks' corpus: a path given must hold a prepared corpus (the error
    names its manifest); none is the embedded default corpus in runs/data-default under the working
    directory, reused as it is when finished (prepare runs and skips every source: the manifest's
    bytes unchanged, nothing said) and made, with one line said, when missing."""
    import shutil
    missing = tmp_path / "not-prepared"
    with pytest.raises(DataError, match=re.escape(str(missing / "manifest.json"))):
        prep.corpus_dir(missing)
    assert prep.corpus_dir(default_corpus) == default_corpus          # a prepared one, given
    monkeypatch.chdir(tmp_path)
    default = pathlib.Path("runs") / "data-default"
    shutil.copytree(default_corpus, default)
    before = (default / MANIFEST).read_bytes()
    told = []
    assert prep.corpus_dir(None, log=told.append) == default
    assert told == [] and (default / MANIFEST).read_bytes() == before
    assert (tmp_path / "runs" / ".data-default.lock").exists()
    shutil.rmtree(default)
    made = []      # the making itself (about 7 s) is the default_corpus fixture's; here, that it runs
    monkeypatch.setattr(prep, "prepare", lambda sources, out, tok: made.append(pathlib.Path(out)))
    assert prep.corpus_dir(None, log=told.append) == default
    assert made == [default] and told == [f"preparing the embedded default corpus in {default} (once, ~10 s)"]


def test_benchmark_without_a_corpus_is_a_clear_error(tmp_path):
    """A benchmark given a corpus that is not prepared stops with one line naming it (no
    traceback), exit code 1."""
    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "train_bench.py"
    r = subprocess.run([sys.executable, str(script), "--data", str(tmp_path / "none"), "--steps", "1"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr, r.stderr
    assert (f"error: {tmp_path / 'none' / 'manifest.json'}: no manifest (run `open1b data prepare` first)"
            in r.stderr.splitlines()), r.stderr
