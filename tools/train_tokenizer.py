"""Train the default tokenizer on the default corpus and write mlx_open1b/data/assets/tokenizer.json.

    python tools/train_tokenizer.py            # train, write the asset, print its SHA-256
    python tools/train_tokenizer.py --check    # train, compare with the shipped asset, write nothing

Run once; the result is shipped and its SHA-256 pinned as DEFAULT_TOKENIZER_SHA256 in
mlx_open1b/data/tokenizer.py. The training text is the verified default corpus (wiki, code, math:
every document of each source, in canonical order), so the inputs are pinned by corpus.py.
"""
from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys
import time

from mlx_open1b.data import corpus
from mlx_open1b.data.tokenizer import (DEFAULT_TOKENIZER_SHA256, DEFAULT_VOCAB_SIZE, default_tokenizer_path,
                                       train_default_tokenizer)
from mlx_open1b.fsutil import write_bytes_atomic


def training_texts():
    for name in corpus.DEFAULT_SHARES:
        yield from corpus.verified_documents(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=None, help="output file (default: the package asset)")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    ap.add_argument("--check", action="store_true", help="compare with the shipped asset; write nothing")
    args = ap.parse_args(argv)
    t0 = time.time()
    tok = train_default_tokenizer(training_texts(), vocab_size=args.vocab_size)
    data = tok.to_str(pretty=True).encode("utf-8")
    sha = hashlib.sha256(data).hexdigest()
    print(f"trained vocab_size={tok.get_vocab_size()} in {time.time() - t0:.1f} s; sha256 {sha}")
    if args.check:
        ok = sha == DEFAULT_TOKENIZER_SHA256
        print("matches the pinned DEFAULT_TOKENIZER_SHA256" if ok else
              f"DIFFERS from the pinned DEFAULT_TOKENIZER_SHA256 {DEFAULT_TOKENIZER_SHA256}")
        return 0 if ok else 1
    out = args.out or default_tokenizer_path()
    write_bytes_atomic(out, data)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
