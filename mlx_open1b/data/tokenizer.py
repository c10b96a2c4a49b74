"""The tokenizer: byte-level BPE (`tokenizers`) with the Llama-3 pre-tokenizer regex and one
end-of-text separator token (DESIGN §6).

The default tokenizer was trained once on the default corpus (tools/train_tokenizer.py) and is
shipped as assets/tokenizer.json; its SHA-256 is pinned below. A user's tokenizer.json is
accepted if it is a `tokenizers` file with the special token EOT.

Documents can never inject a separator: encode_batch encodes with special-token matching off
(`encode_special_tokens`), so "<|endoftext|>" inside a text is ordinary bytes, and it checks that
no id of the result is the EOT id (a user vocabulary could otherwise spell it from merges).
"""
from __future__ import annotations

import hashlib
import importlib.resources
import pathlib
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from .format import DataError

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
EOT = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192

# SHA-256 of assets/tokenizer.json as written by tools/train_tokenizer.py.
DEFAULT_TOKENIZER_SHA256 = "3c5a5664b3c85fd6493426459e8c74599b68bd0ac0fc87656b646e8f2c91f23c"


def default_tokenizer_path() -> pathlib.Path:
    return pathlib.Path(str(importlib.resources.files("mlx_open1b.data") / "assets" / "tokenizer.json"))


def build_tokenizer_model():
    """An untrained byte-level BPE tokenizer: Llama-3 regex split, byte-level alphabet, no
    normalizer, no continuing-subword prefix, ByteLevel decoder, EOT a special token."""
    tok = HFTokenizer(models.BPE(fuse_unk=False, byte_fallback=False))   # no unk, no prefix/suffix
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_default_tokenizer(texts_iter: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train the byte-level BPE on the texts; EOT gets id 0, the 256 byte symbols the next ids.
    Returns a `tokenizers.Tokenizer` (serialize with .to_str())."""
    tok = build_tokenizer_model()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts_iter, trainer=trainer)
    if tok.token_to_id(EOT) != 0:
        raise AssertionError("EOT did not get id 0")
    return tok


MIN_VOCAB_SIZE = 257     # EOT and the 256 byte symbols: a vocabulary below it cannot encode every text


def train_tokenizer_bytes(texts_iter: Iterable[str], vocab_size: int) -> bytes:
    """The tokenizer.json bytes of a byte-level BPE trained on the texts (as the shipped default:
    same model, trainer and serialization), so the same texts in the same order give the same
    bytes and hence the same SHA-256, which every corpus prepared with it and every run records."""
    if not MIN_VOCAB_SIZE <= vocab_size <= (1 << 31) - 1:
        raise DataError(f"vocab_size: {vocab_size} is outside {MIN_VOCAB_SIZE}..{(1 << 31) - 1} "
                        f"(EOT and the 256 bytes come first)")
    return train_default_tokenizer(texts_iter, vocab_size=vocab_size).to_str(pretty=True).encode("utf-8")


class Tokenizer:
    """A loaded tokenizer.json: .path, .sha256 (of the file's bytes), .vocab_size, .eot_id."""

    def __init__(self, hf, path: pathlib.Path, sha256: str):
        self._tok = hf
        self.path = path
        self.sha256 = sha256
        self.vocab_size = int(hf.get_vocab_size(with_added_tokens=True))
        self.eot_id = int(hf.token_to_id(EOT))

    @classmethod
    def load(cls, path=None) -> "Tokenizer":
        """path None: the shipped default (its hash must equal DEFAULT_TOKENIZER_SHA256)."""
        default = path is None
        path = default_tokenizer_path() if default else pathlib.Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read tokenizer file ({e.strerror or e})") from None
        sha = hashlib.sha256(data).hexdigest()
        if default and sha != DEFAULT_TOKENIZER_SHA256:
            raise DataError(f"{path}: the shipped default tokenizer has SHA-256 {sha}, expected "
                            f"{DEFAULT_TOKENIZER_SHA256} (the package's tokenizer.json was changed)")
        try:
            hf = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as e:   # tokenizers raises plain Exception for malformed files
            raise DataError(f"{path}: not a valid tokenizers JSON file ({str(e)[:200]})") from None
        eot = hf.token_to_id(EOT)
        added = hf.get_added_tokens_decoder()
        if eot is None or eot not in added or not added[eot].special:
            raise DataError(f"{path}: tokenizer has no special token {EOT!r} (needed as the document separator)")
        hf.encode_special_tokens = True   # special-token text inside documents is ordinary bytes
        hf.no_padding()
        hf.no_truncation()
        return cls(hf, path, sha)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids (uint32) of each text; no special tokens added, none recognized in the text."""
        texts = list(texts)
        if not texts:
            return []
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)   # _fast: no offsets
        encs = encode(texts, add_special_tokens=False)
        out = [np.array(e.ids, dtype=np.uint32) for e in encs]
        for k, ids in enumerate(out):
            if ids.size and bool((ids == self.eot_id).any()):
                raise DataError(f"{self.path}: the tokenizer encodes ordinary text as the separator id "
                                f"{self.eot_id} (document {k} of the batch: {texts[k][:80]!r})")
        return out

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        """Text of token ids (special tokens shown as their text)."""
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]}…)"
