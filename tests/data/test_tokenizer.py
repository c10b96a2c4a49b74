"""The tokenizer: shipped file pinned, lossless round trip, no separator injection, bad files."""
import hashlib
import json
import subprocess
import sys
import pathlib

import numpy as np
import pytest

from mlx_open1b.data import tokenizer as T
from mlx_open1b.data.format import DataError
from mlx_open1b.data.tokenizer import EOT, Tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.load()


def test_shipped_file_hash_pinned(tok):
    path = T.default_tokenizer_path()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == T.DEFAULT_TOKENIZER_SHA256
    assert tok.sha256 == T.DEFAULT_TOKENIZER_SHA256
    assert tok.path == path
    assert tok.vocab_size == T.DEFAULT_VOCAB_SIZE == 8192
    assert tok.eot_id == 0


def test_shipped_file_configuration():
    d = json.loads(T.default_tokenizer_path().read_text())
    assert d["normalizer"] is None and d["post_processor"] is None
    assert d["added_tokens"] == [{"id": 0, "content": EOT, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True}]
    split, byte_level = d["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["pattern"] == {"Regex": T.LLAMA3_PATTERN}
    assert split["behavior"] == "Isolated" and not split["invert"]
    assert byte_level["type"] == "ByteLevel" and not byte_level["add_prefix_space"]
    assert not byte_level["use_regex"]
    assert d["decoder"]["type"] == "ByteLevel"
    m = d["model"]
    assert m["type"] == "BPE" and m["continuing_subword_prefix"] is None and m["unk_token"] is None
    assert not m["byte_fallback"] and m["end_of_word_suffix"] is None
    from tokenizers.pre_tokenizers import ByteLevel
    assert set(ByteLevel.alphabet()) <= set(m["vocab"])      # every byte is a symbol
    assert len(m["vocab"]) == 8192


def test_llama3_pattern_literal():
    assert T.LLAMA3_PATTERN == (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_shipped_file_changed_is_detected(tmp_path, monkeypatch):
    bad = tmp_path / "tokenizer.json"
    data = bytearray(T.default_tokenizer_path().read_bytes())
    data[-3] ^= 0x01
    bad.write_bytes(bytes(data))
    monkeypatch.setattr(T, "default_tokenizer_path", lambda: bad)
    with pytest.raises(DataError, match=f"{bad}.*SHA-256.*{T.DEFAULT_TOKENIZER_SHA256}"):
        Tokenizer.load()


def _random_unicode(rng, n):
    ranges = [(0x00, 0x7F), (0x00, 0x1F), (0x80, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
              (0x900, 0x97F), (0x2000, 0x206F), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
              (0xE000, 0xF8FF), (0xFE00, 0xFE0F), (0x1F300, 0x1FAFF), (0x10000, 0x10FFFF)]
    pieces = ["\r\n", "\n\n", "\r", "\t", " ", "  ", "\u00a0", "\u2028", "\ufeff", "\u200d", "'s", "'LL",
              "1234567", "<|endoftext|>", "<|", "|>", "👩‍👩‍👧", "e\u0301", "\x00", "\x7f", "\U0010FFFF"]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(int(rng.integers(0, 60))):
            if rng.random() < 0.2:
                chars.append(pieces[int(rng.integers(len(pieces)))])
            else:
                lo, hi = ranges[int(rng.integers(len(ranges)))]
                c = int(rng.integers(lo, hi + 1))
                if 0xD800 <= c <= 0xDFFF:       # surrogates are not text
                    c = 0xFFFD
                chars.append(chr(c))
        out.append("".join(chars))
    return out


def test_round_trip_random_unicode(tok):
    texts = _random_unicode(np.random.default_rng(1234), 400) + ["", " ", "\r\n", "a\r\nb\n\r\nc"]
    encs = tok.encode_batch(texts)
    assert len(encs) == len(texts)
    for t, ids in zip(texts, encs):
        assert ids.dtype == np.uint32 and ids.ndim == 1
        assert ((ids > 0) & (ids < tok.vocab_size)).all()
        assert tok.decode(ids) == t
    assert tok.encode_batch([]) == []
    assert tok.encode("").size == 0


def test_round_trip_corpus_like_text(tok):
    texts = ["def f(x):\n    return x ** 2  # square\n", "The 100 metres (109.36\u00a0yd) dash…",
             "Solve for x: 3x - 7 = 20.\n\nAnswer: x = 9", "\u6f22\u5b57\u304b\u306a\u6df7\u3058\u308a\u6587"]
    for t, ids in zip(texts, tok.encode_batch(texts)):
        assert tok.decode(ids) == t
        assert len(ids) <= len(t.encode())
        if t.isascii():
            assert len(ids) < len(t.encode())        # the BPE compresses English, code, math


@pytest.mark.parametrize("text", [EOT, f"a{EOT}b", f"{EOT}{EOT}", f"x <|endoftext|>\n{EOT} y", "<|endoftext|"])
def test_eot_text_is_not_the_separator(tok, text):
    ids = tok.encode(text)
    assert tok.eot_id not in ids.tolist()
    assert len(ids) > 1
    assert tok.decode(ids) == text


def test_decode_shows_separator(tok):
    a, b = tok.encode_batch(["first doc", "second doc"])
    joined = np.concatenate([a, [tok.eot_id], b]).astype(np.uint32)
    assert tok.decode(joined) == f"first doc{EOT}second doc"


def test_digits_split_in_groups_of_at_most_three(tok):
    pre = T.build_tokenizer_model().pre_tokenizer
    pieces = [p for p, _ in pre.pre_tokenize_str("1234567 x12 0000000000 45")]
    assert pieces == ["123", "456", "7", "Ġx", "12", "Ġ", "000", "000", "000", "0", "Ġ", "45"]
    assert [p for p, _ in pre.pre_tokenize_str("don't WE'LL")] == ["don", "'t", "ĠWE", "'LL"]
    # the trained vocabulary never spans more than 3 digits in one token
    for text in ["1234567890123", "x = 98765432 + 1", "3190859 ÷ 92"]:
        ids = tok.encode(text)
        for i in ids.tolist():
            piece = tok.decode([i])
            assert sum(ch.isdigit() for ch in piece) <= 3, (text, piece)
        assert tok.decode(ids) == text


def test_user_tokenizer_file(tmp_path):
    hf = T.train_default_tokenizer(["hello world, hello tokenizer 12345"] * 20, vocab_size=300)
    path = tmp_path / "user.json"
    path.write_text(hf.to_str())
    t = Tokenizer.load(path)
    assert t.path == path and t.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert t.eot_id == 0 and t.vocab_size == hf.get_vocab_size()
    ids = t.encode(f"hello {EOT} world")
    assert 0 not in ids.tolist() and t.decode(ids) == f"hello {EOT} world"


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


def test_bad_tokenizer_files(tmp_path):
    shipped = T.default_tokenizer_path().read_bytes()
    no_eot = T.build_tokenizer_model()
    no_eot.add_special_tokens(["</s>"])
    plain_eot = T.build_tokenizer_model()
    plain_eot.add_tokens([EOT])                      # present, but not special
    cases = {
        "missing.json": None,
        "empty.json": b"",
        "garbage.json": b"\x89PNG\r\n\x1a\n\x00\xff",
        "notjson.json": "tokenizer: yes",
        "foreign.json": json.dumps({"vocab": {"a": 0}, "merges": []}),
        "truncated.json": shipped[: len(shipped) // 2],
        "noeot.json": no_eot.to_str(),
        "plaineot.json": plain_eot.to_str(),
    }
    for name, data in cases.items():
        path = tmp_path / name if data is None else _write(tmp_path, name, data)
        with pytest.raises(DataError) as e:
            Tokenizer.load(path)
        assert str(path) in str(e.value), (name, str(e.value))
        if name in ("noeot.json", "plaineot.json"):
            assert EOT in str(e.value)


def test_vocabulary_that_spells_the_separator_is_refused(tmp_path):
    # A user's tokenizer whose model maps the text "<|endoftext|>" to the separator id even with
    # special-token matching off: encode_batch must refuse rather than inject a separator.
    d = {"version": "1.0", "truncation": None, "padding": None,
         "added_tokens": [{"id": 0, "content": EOT, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": True}],
         "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
         "decoder": None,
         "model": {"type": "WordLevel", "vocab": {EOT: 0, "a": 1, "[UNK]": 2}, "unk_token": "[UNK]"}}
    path = _write(tmp_path, "wordlevel.json", json.dumps(d))
    t = Tokenizer.load(path)
    assert t.encode("a a").tolist() == [1, 1]
    with pytest.raises(DataError, match="separator"):
        t.encode_batch(["a", f"a {EOT} a"])


@pytest.mark.slow
def test_training_reproduces_shipped_file():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "train_tokenizer.py"), "--check"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
