"""The mutation harness (scripts/mutation.py, scripts/mutants.toml).

Mechanics on a tiny tree of its own (a few seconds): a planted fault is caught and the file comes
back byte for byte; a text found 0 or 2 times is "stale" and nothing is written; a surviving
mutant is "not caught", or "equivalent" when the catalogue says why; a test run past its timeout
is killed and the file still restored; a failing test that also fails without the mutant makes it
an error, not a catch. The catalogue: well formed, every area covered, every text found exactly once in the tree.
End to end on a scratch copy of this repository (about a minute): one C mutant (rebuilt C
reference), one Metal mutant (recompiled in the emulator) and one host-step mutant are each caught,
and this tree's files are untouched."""
from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("o1b_mutation", REPO / "scripts" / "mutation.py")
mutation = importlib.util.module_from_spec(_spec)
sys.modules["o1b_mutation"] = mutation      # dataclasses look their module up by name
_spec.loader.exec_module(mutation)

E2E = ("c-bf16-round-half-up", "metal-adamw-v-association", "host-adamw-bc1-step")


def _tiny(tmp_path) -> "mutation.Scratch":
    """A tree with one module and one test, run by this interpreter."""
    repo = tmp_path / "tree"
    repo.mkdir()
    (repo / "mod.py").write_text(textwrap.dedent("""\
        import time

        def f():
            return 1  # the answer

        def slow():
            return 0
        """))
    (repo / "test_mod.py").write_text(textwrap.dedent("""\
        import mod

        def test_f():
            assert mod.f() == 1
            assert mod.slow() == 0
        """))
    (repo / "pytest.ini").write_text("[pytest]\n")          # keeps pytest's rootdir in the tree
    return mutation.Scratch(tmp_path, repo, sys.executable, xdg=tmp_path / "xdg")


def _mutant(find, replace, equivalent="", tests=("test_mod.py",), file="mod.py", timeout=0.0):
    return mutation.Mutant(id="m", area="host", file=file, find=find, replace=replace, description="d",
                           tests=tuple(tests), equivalent=equivalent, timeout=timeout)


def _sha(p: pathlib.Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_caught_and_restored(tmp_path):
    sc = _tiny(tmp_path)
    before = (sc.repo / "mod.py").read_bytes()
    r = mutation.run_mutant(sc, _mutant("return 1", "return 2"), timeout=120)
    assert r.status == "caught", r
    assert (sc.repo / "mod.py").read_bytes() == before


def test_not_caught_and_equivalent(tmp_path):
    sc = _tiny(tmp_path)
    r = mutation.run_mutant(sc, _mutant("# the answer", "# an answer"), timeout=120)
    assert r.status == "not caught", r
    r = mutation.run_mutant(sc, _mutant("# the answer", "# an answer", equivalent="a comment"), timeout=120)
    assert r.status == "equivalent" and r.note == "a comment", r
    # the arguments select no test: nothing catches the mutant
    r = mutation.run_mutant(sc, _mutant("return 1", "return 2", tests=("test_mod.py", "-k", "nothing_here")),
                            timeout=120)
    assert r.status == "not caught" and "no test selected" in r.note, r


@pytest.mark.parametrize("find", ["return 3", "return"], ids=["absent", "twice"])
def test_stale_text_writes_nothing(tmp_path, find):
    sc = _tiny(tmp_path)
    f = sc.repo / "mod.py"
    before, mtime = _sha(f), f.stat().st_mtime_ns
    r = mutation.run_mutant(sc, _mutant(find, "return 2"), timeout=120)
    assert r.status == "stale" and ("0 times" if find == "return 3" else "2 times") in r.note, r
    assert _sha(f) == before and f.stat().st_mtime_ns == mtime
    r = mutation.run_mutant(sc, _mutant("x", "y", file="gone.py"), timeout=120)
    assert r.status == "stale" and "does not exist" in r.note


def test_timeout_kills_the_tests_and_restores(tmp_path):
    sc = _tiny(tmp_path)
    before = _sha(sc.repo / "mod.py")
    r = mutation.run_mutant(sc, _mutant("    return 0", "    time.sleep(60)\n    return 0", timeout=3), timeout=120)
    assert r.status == "timeout" and r.seconds < 30, r
    assert _sha(sc.repo / "mod.py") == before


def test_restored_when_the_harness_fails(tmp_path, monkeypatch):
    sc = _tiny(tmp_path)
    before = _sha(sc.repo / "mod.py")

    def boom(args, timeout):
        assert (sc.repo / "mod.py").read_text().count("return 2") == 1      # the mutant is in place
        raise KeyboardInterrupt
    monkeypatch.setattr(sc, "pytest", boom)
    with pytest.raises(KeyboardInterrupt):
        mutation.run_mutant(sc, _mutant("return 1", "return 2"), timeout=120)
    assert _sha(sc.repo / "mod.py") == before


def test_a_test_failing_without_the_mutant_is_an_error_not_a_catch(tmp_path):
    sc = _tiny(tmp_path)
    (sc.repo / "test_broken.py").write_text("def test_broken():\n    assert False\n")
    r = mutation.run_mutant(sc, _mutant("return 1", "return 2", tests=("test_mod.py", "test_broken.py")),
                            timeout=120)
    assert r.status == "caught", r          # test_mod fails first (-x) and passes once restored
    r = mutation.run_mutant(sc, _mutant("# the answer", "# an answer", tests=("test_broken.py",)), timeout=120)
    assert r.status == "error" and "without the mutant too" in r.note and "test_broken.py::test_broken" in r.note, r
    r = mutation.run_mutant(sc, _mutant("# the answer", "# an answer", tests=("test_broken.py",)), timeout=120,
                            check=False)
    assert r.status == "caught", r


def test_the_callers_pytest_options_do_not_change_the_runs(tmp_path, monkeypatch):
    """A PYTEST_ADDOPTS of the caller's (here -rs: the short summary without its FAILED lines) does
    not reach the mutant's runs, whose failures are read from those lines."""
    monkeypatch.setenv("PYTEST_ADDOPTS", "-rs")
    sc = _tiny(tmp_path)
    (sc.repo / "test_broken.py").write_text("def test_broken():\n    assert False\n")
    r = mutation.run_mutant(sc, _mutant("return 1", "return 2", tests=("test_mod.py", "test_broken.py")),
                            timeout=120)
    assert r.status == "caught", r


def test_failed_nodes_from_the_short_summary():
    out = ("....F\n=== short test summary info ===\n"
           "FAILED tests/test_gemm.py::test_fast_equals_definition[37x53x19] - AssertionError: y - simd=1\n"
           "ERROR tests/test_a.py::test_b[plain-hashes.batch-0] - AssertionError\n"
           "FAILED tests/test_gemm.py::test_fast_equals_definition[37x53x19] - again\n"
           "1 failed, 1 error in 2.00s\n")
    assert mutation.failed_nodes(out) == ["tests/test_gemm.py::test_fast_equals_definition[37x53x19]",
                                          "tests/test_a.py::test_b[plain-hashes.batch-0]"]
    assert mutation.failed_nodes("1 passed in 0.1s") == []


def test_catalogue_checks(tmp_path):
    good = textwrap.dedent("""\
        [[mutant]]
        id = "a"
        area = "c"
        file = "x.c"
        find = "a"
        replace = "b"
        description = "d"
        tests = ["t.py"]
        """)
    p = tmp_path / "cat.toml"
    for bad, what in ((good + good, "duplicate id"), (good.replace('"c"', '"gpu"'), "area 'gpu'"),
                      (good.replace('replace = "b"', 'replace = "a"'), "differ"),
                      (good.replace('tests = ["t.py"]', 'tests = []'), "non-empty list"),
                      (good.replace('description = "d"\n', ""), "missing ['description']"),
                      (good + 'colour = "red"\n', "unknown fields ['colour']"), ("", "no [[mutant]]"),
                      (good.replace('"x.c"', '"../x.c"'), "a path inside the repository"),
                      (good.replace('"x.c"', '"/etc/x.c"'), "a path inside the repository"),
                      (good + "equivalent = 3\n", "equivalent of the wrong type")):
        p.write_text(bad)
        with pytest.raises(mutation.CatalogueError, match=__import__("re").escape(what)):
            mutation.load_catalogue(p)
    with pytest.raises(mutation.CatalogueError, match="unknown mutant ids: zz"):
        mutation.select(mutation.load_catalogue(mutation.CATALOGUE), only="zz")


def test_catalogue_covers_every_area_and_matches_the_tree():
    """Loud on purpose: a change to a line a mutant plants its fault in makes the mutant stale;
    update its `find` text in scripts/mutants.toml (python scripts/mutation.py --list)."""
    ms = mutation.load_catalogue(mutation.CATALOGUE)
    assert len(ms) >= 30
    assert {m.area for m in ms} == set(mutation.AREAS)
    stale = {m.id: mutation.stale_reason(REPO, m) for m in ms}
    stale = {k: v for k, v in stale.items() if v}
    assert not stale, f"stale mutants (update scripts/mutants.toml): {stale}"
    for i in E2E:
        assert i in {m.id for m in ms}


def test_three_mutants_caught_end_to_end(tmp_path):
    """A C, a Metal (emulator) and a host-step mutant, each caught on a scratch copy that imports
    itself (checked by Scratch.create), the failing test passing again once the file is restored."""
    ms = mutation.select(mutation.load_catalogue(mutation.CATALOGUE), only=",".join(E2E))
    assert {m.area for m in ms} == {"c", "metal", "host"} and ms[0].needs_c_build
    files = {m.file: _sha(REPO / m.file) for m in ms}
    sc = mutation.Scratch.create(REPO, tmp_path / "scratch", log=lambda s: None)
    lib = sc.c_library()
    for m in ms:
        r = mutation.run_mutant(sc, m, timeout=300)     # the failing test passes once restored
        assert r.status == "caught", r
        assert (sc.repo / m.file).read_bytes() == (REPO / m.file).read_bytes() or _sha(REPO / m.file) != files[m.file]
    assert lib.read_bytes() == sc.pristine_lib.read_bytes()          # the unmutated C library is back
    assert {f: _sha(REPO / f) for f in files} == files                # this tree was never written
