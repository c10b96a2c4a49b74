"""host_malloc: glibc's malloc thresholds set once per process by a trainer, and nothing done where
the C library is not glibc."""
from __future__ import annotations

import platform
import sys

import pytest

from mlx_open1b import host_malloc


def test_set_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(host_malloc, "_tuned", None)
    monkeypatch.setattr(host_malloc, "_set", lambda: calls.append(1) or True)
    assert host_malloc.tune() and host_malloc.tune() and calls == [1]


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"),
                    reason="glibc only")
def test_glibc_takes_the_thresholds():
    assert host_malloc._set() is True


def test_nothing_where_the_c_library_is_not_glibc(monkeypatch):
    monkeypatch.setattr(host_malloc.sys, "platform", "darwin")
    assert host_malloc._set() is False
    monkeypatch.setattr(host_malloc.sys, "platform", "linux")

    class Musl:                     # mallopt, but no gnu_get_libc_version
        mallopt = staticmethod(lambda *a: 1)
    monkeypatch.setattr(host_malloc.ctypes, "CDLL", lambda name: Musl())
    assert host_malloc._set() is False

    def no_lib(name):
        raise OSError("no C library")
    monkeypatch.setattr(host_malloc.ctypes, "CDLL", no_lib)
    assert host_malloc._set() is False


def test_a_trainer_tunes_its_process(tmp_path, monkeypatch):
    from mlx_open1b.train import Trainer

    from data_helpers import MICRO_MIX, make_corpus
    from runs import micro_cfg
    make_corpus(tmp_path / "corpus", MICRO_MIX)
    calls = []
    monkeypatch.setattr(host_malloc, "_tuned", None)
    monkeypatch.setattr(host_malloc, "_set", lambda: calls.append(1) or True)
    Trainer(tmp_path / "run", micro_cfg(), tmp_path / "corpus")
    assert calls == [1]
