import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import pytest


@pytest.fixture(scope="session")
def default_corpus(tmp_path_factory):
    """The embedded default corpus, prepared once per test session (about 7 s)."""
    from mlx_open1b.data.corpus import default_sources
    from mlx_open1b.data.prepare import prepare
    from mlx_open1b.data.tokenizer import Tokenizer
    out = tmp_path_factory.mktemp("default_corpus")
    prepare(default_sources(), out, Tokenizer.load(None))
    return out


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The two-source micro corpus (data_helpers.MICRO_MIX) the training tests read, built once per
    session; tests only read it (a module may define its own `corpus`)."""
    from data_helpers import MICRO_MIX, make_corpus
    d = tmp_path_factory.mktemp("micro") / "corpus"
    make_corpus(d, MICRO_MIX)
    return d
