#!/usr/bin/env python3
"""Mutation harness: plant each catalogued fault in a scratch copy of the tree and run the tests
meant to catch it.

A mutant (scripts/mutants.toml) names a file, a text that must occur in it exactly once, its
replacement, a description and the focused pytest arguments that should fail once it is planted.
The harness never writes to the tree it was started from. It copies the tree's files (tracked ones
and untracked ones git does not ignore, as they are on disk, uncommitted edits included) to a
scratch directory, makes a virtual environment there that sees the system's packages and installs
the copy into it editable (this builds the C reference), so that the tests, and every
`sys.executable` child they start, import the copy and not the tree's own editable install. The
emulators' compile cache ($XDG_CACHE_HOME/mlx-open1b/emu, keyed by the hash of the full source)
points into the scratch directory, seeded with hard links to (or copies of) the user's cache.
Then, per mutant:

  find the text (stale unless exactly one occurrence), write the mutant, rebuild the C reference
  when a cpu_ref/src file changed, run the tests, restore the file (and the pristine C library).

Outcome per mutant: caught (pytest exit 1: a test failed), not caught (the tests pass, or the
arguments select none), equivalent
(tests pass and the catalogue says why no output can change), stale (the text is not there
exactly once), error (build failure, collection error, or the failing tests fail without the
mutant too), timeout. A catch is confirmed: the tests that failed run again once the file is
restored and must pass, so a test broken in the tree is not mistaken for a catch.

  python scripts/mutation.py                    # the whole catalogue
  python scripts/mutation.py --list             # the catalogue and whether each text is found
  python scripts/mutation.py --only ID,ID --area c,metal --jobs 2 --keep --json report.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10
    import tomli as tomllib

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
CATALOGUE = HERE / "mutants.toml"
AREAS = ("metal", "cuda", "c", "spec", "host", "audit", "hashing", "data", "collectives")
STATUSES = ("caught", "not caught", "equivalent", "stale", "error", "timeout")
C_SOURCES = "cpu_ref/src/"
EMU_CACHE = pathlib.Path("mlx-open1b") / "emu"


class CatalogueError(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    area: str
    file: str             # path relative to the repository root
    find: str             # must occur exactly once in the file
    replace: str
    description: str
    tests: tuple          # pytest arguments (node ids, -k expressions, -m ...)
    equivalent: str = ""  # why no output can change: the mutant is expected to survive
    timeout: float = 0.0  # seconds for this mutant's tests (0: the run's --timeout)

    @property
    def needs_c_build(self) -> bool:
        return self.file.startswith(C_SOURCES)


@dataclasses.dataclass
class Result:
    id: str
    area: str
    file: str
    status: str
    tests: str
    seconds: float
    note: str = ""


def load_catalogue(path=CATALOGUE) -> list[Mutant]:
    """The mutants of a TOML catalogue ([[mutant]] tables), checked for shape."""
    path = pathlib.Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CatalogueError(f"{path}: {e}") from None
    out, seen = [], set()
    fields = {f.name for f in dataclasses.fields(Mutant)}
    for i, raw in enumerate(data.get("mutant", [])):
        where = f"{path}: mutant #{i + 1} ({raw.get('id', '?')})"
        unknown = set(raw) - fields
        missing = {"id", "area", "file", "find", "replace", "description", "tests"} - set(raw)
        if unknown or missing:
            raise CatalogueError(f"{where}: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
        bad = [k for k in ("id", "area", "file", "find", "replace", "description", "equivalent")
               if not isinstance(raw.get(k, ""), str)]
        if bad or not isinstance(raw.get("timeout", 0), (int, float)):
            raise CatalogueError(f"{where}: {', '.join(bad) or 'timeout'} of the wrong type")
        if raw["id"] in seen:
            raise CatalogueError(f"{where}: duplicate id")
        rel = pathlib.PurePosixPath(raw["file"])
        if rel.is_absolute() or ".." in rel.parts:      # the harness writes only inside its scratch copy
            raise CatalogueError(f"{where}: file must be a path inside the repository, got {raw['file']!r}")
        if raw["area"] not in AREAS:
            raise CatalogueError(f"{where}: area {raw['area']!r} not one of {', '.join(AREAS)}")
        if raw["find"] == raw["replace"] or not raw["find"]:
            raise CatalogueError(f"{where}: find must be non-empty and differ from replace")
        if not isinstance(raw["tests"], list) or not raw["tests"] or not all(isinstance(t, str) for t in raw["tests"]):
            raise CatalogueError(f"{where}: tests must be a non-empty list of pytest arguments")
        seen.add(raw["id"])
        out.append(Mutant(**{**raw, "tests": tuple(raw["tests"])}))
    if not out:
        raise CatalogueError(f"{path}: no [[mutant]] entries")
    return out


def stale_reason(root: pathlib.Path, m: Mutant) -> str:
    """'' if the mutant's text occurs exactly once in its file under root, else why not."""
    f = root / m.file
    if not f.is_file():
        return f"{m.file} does not exist"
    n = f.read_text().count(m.find)
    return "" if n == 1 else f"the text occurs {n} times in {m.file} (must be exactly once)"


def tree_files(repo: pathlib.Path) -> list[str]:
    """Tracked files and untracked files git does not ignore, as they are now (deleted ones out)."""
    r = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, check=True)
    names = sorted({n for n in r.stdout.decode().split("\0") if n})
    return [n for n in names if (repo / n).is_file() or (repo / n).is_symlink()]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_running: set = set()                  # commands in flight (killed together on an interrupt)
_running_lock = threading.Lock()
_stop = threading.Event()              # set on an interrupt: workers take no further mutant


def stop_everything() -> None:
    _stop.set()
    with _running_lock:
        procs = list(_running)
    for p in procs:
        _kill_group(p)


def run_cmd(cmd, cwd, env, timeout) -> tuple[int | None, str]:
    """(exit code or None on timeout, combined output); the command runs in its own process
    group, killed whole on timeout or interrupt."""
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True)
        with _running_lock:
            _running.add(proc)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            rc = None
        except BaseException:
            _kill_group(proc)
            proc.wait()
            raise
        finally:
            with _running_lock:
                _running.discard(proc)
        log.seek(0)
        return rc, log.read()


class Scratch:
    """A copy of the tree with its own interpreter environment.

    `root/repo` is the copy, `python` the interpreter that imports it, `env` the environment the
    tests run in. Scratch.create builds the full thing; Scratch(root, repo, python) wraps an
    existing directory (the harness's own tests use that with a tiny tree)."""

    def __init__(self, root: pathlib.Path, repo: pathlib.Path, python: str, xdg: pathlib.Path | None = None):
        self.root, self.repo, self.python = pathlib.Path(root), pathlib.Path(repo), python
        self.xdg = pathlib.Path(xdg) if xdg else self.root / "xdg"
        self.pristine_lib: pathlib.Path | None = None     # the unmutated C library, when built
        self.build_temp = self.root / "build"

    @property
    def env(self) -> dict:
        # PYTEST_ADDOPTS too: the caller's pytest options (e.g. -rs) would change the runs and the
        # summary lines they are read from
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTEST_ADDOPTS")}
        # no bytecode caches: a mutant and its restore can share size and mtime second, and a stale
        # .pyc would then run the wrong source
        env.update(PYTHONDONTWRITEBYTECODE="1", XDG_CACHE_HOME=str(self.xdg))
        venv_bin = pathlib.Path(self.python).parent
        env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(venv_bin.parent)
        return env

    @classmethod
    def create(cls, source: pathlib.Path, root: pathlib.Path, log=print) -> "Scratch":
        source, root = pathlib.Path(source).resolve(), pathlib.Path(root).resolve()
        if root == source or source in root.parents or root in source.parents:
            raise RuntimeError(f"scratch {root} overlaps the source tree {source}")
        repo = root / "repo"
        t0 = time.perf_counter()
        files = tree_files(source)
        for name in files:
            dst = repo / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, dst, follow_symlinks=False)
        venv = root / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                       check=True, capture_output=True)
        sc = cls(root, repo, str(venv / "bin" / "python"))
        user_cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / EMU_CACHE
        (sc.xdg / EMU_CACHE).mkdir(parents=True, exist_ok=True)
        seeded = 0
        if user_cache.is_dir():          # keyed by the hash of the full source: a copy is safe to reuse
            for so in user_cache.glob("*.so"):
                if not re.fullmatch(r"[0-9a-f]{64}\.so", so.name):      # another process's temporary file
                    continue
                dst = sc.xdg / EMU_CACHE / so.name
                try:    # a hard link where possible: the emulators replace files, never rewrite them
                    try:
                        os.link(so, dst)
                    except OSError:
                        shutil.copy2(so, dst)
                    seeded += 1
                except OSError:         # removed meanwhile by its owner: the scratch compiles its own
                    pass
        rc, out = run_cmd([sc.python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-e", str(repo)], repo, sc.env, 900)
        if rc != 0:
            raise RuntimeError(f"pip install -e of the scratch copy failed (exit {rc}):\n{out[-4000:]}")
        sc.check_imports()
        lib = sc.c_library()
        if lib is not None:
            sc.pristine_lib = root / "pristine" / lib.name
            sc.pristine_lib.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lib, sc.pristine_lib)
        log(f"scratch {root}: {len(files)} files, {seeded} cached emulator libraries, "
            f"installed in {time.perf_counter() - t0:.1f} s")
        return sc

    def check_imports(self) -> None:
        """Every mapped package of the scratch interpreter comes from the copy (never from the
        tree the harness started in)."""
        probe = ("import json, mlx_open1b, mlx_open1b.metal, mlx_open1b.cuda, mlx_open1b.cpu_ref, "
                 "mlx_open1b.cpu_ref._lib, mlx_open1b.parity, mlx_open1b.cli\n"
                 "import sys\n"
                 "print(json.dumps({n: getattr(sys.modules[n], '__file__', '') for n in sys.modules "
                 "if n == 'mlx_open1b' or n.startswith('mlx_open1b.')}))")
        rc, out = run_cmd([self.python, "-c", probe], self.repo, self.env, 300)
        if rc != 0:
            raise RuntimeError(f"the scratch copy does not import:\n{out[-4000:]}")
        files = json.loads(out.strip().splitlines()[-1])
        wrong = {n: f for n, f in files.items() if f and self.repo.resolve() not in pathlib.Path(f).resolve().parents}
        if wrong:
            raise RuntimeError(f"the scratch interpreter imports modules from outside {self.repo}: {wrong}")

    def c_library(self) -> pathlib.Path | None:
        libs = sorted((self.repo / "cpu_ref").glob("_kernels*.so")) + sorted((self.repo / "cpu_ref").glob("_kernels*.pyd"))
        return libs[0] if libs else None

    def build_c(self, timeout: float) -> tuple[bool, str]:
        rc, out = run_cmd([self.python, "setup.py", "-q", "build_ext", "--inplace", "--force", "-j", "2",
                           "--build-temp", str(self.build_temp)], self.repo, self.env, timeout)
        return rc == 0, out

    def restore_c(self) -> None:
        lib = self.c_library()
        if self.pristine_lib is None or lib is None:
            return
        tmp = lib.with_name(lib.name + ".restore")
        shutil.copy2(self.pristine_lib, tmp)
        os.replace(tmp, lib)

    def pytest(self, args, timeout) -> tuple[int | None, str]:
        # -rfE: the short summary's FAILED / ERROR lines, which failed_nodes reads, whatever the config
        cmd = [self.python, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider", *args]
        return run_cmd(cmd, self.repo, self.env, timeout)


def _tail(out: str, n: int = 6) -> str:
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])


def _failure(out: str) -> str:
    """The first failed test of a pytest run (its short-summary line), else the output's tail."""
    for ln in out.splitlines():
        if ln.startswith(("FAILED ", "ERROR ")):
            return ln
    return _tail(out, 2)


def failed_nodes(out: str) -> list[str]:
    """Node ids of the failed / errored tests in pytest's short summary ("FAILED id - message")."""
    ids = []
    for ln in out.splitlines():
        if ln.startswith(("FAILED ", "ERROR ")):
            node = ln.split(" ", 1)[1].split(" - ", 1)[0].strip()
            if "::" in node and node not in ids:
                ids.append(node)
    return ids


def confirm(sc: Scratch, m: Mutant, out: str, timeout: float) -> str:
    """'' if the tests that failed with the mutant pass on the restored copy (the catch is the
    mutant's doing), else why not. Without node ids to rerun, the mutant's whole test set runs."""
    nodes = failed_nodes(out) or list(m.tests)
    rc, text = sc.pytest(nodes, timeout)
    if rc == 0:
        return ""
    return "timeout" if rc is None else f"{' '.join(nodes)}: exit {rc}: {_failure(text)}"


def run_mutant(sc: Scratch, m: Mutant, timeout: float, check: bool = True) -> Result:
    """Plant one mutant in the scratch copy, run its tests, restore the file (always); with
    `check`, a catch counts only if the failing tests pass again once the file is restored."""
    t0 = time.perf_counter()
    tests = " ".join(m.tests)
    res = lambda status, note="": Result(m.id, m.area, m.file, status, tests,         # noqa: E731
                                         round(time.perf_counter() - t0, 1), note)
    why = stale_reason(sc.repo, m)
    if why:
        return res("stale", why)
    path = sc.repo / m.file
    original = path.read_bytes()
    text = original.decode()
    try:
        path.write_text(text.replace(m.find, m.replace, 1))
        if m.needs_c_build:
            ok, out = sc.build_c(timeout)
            if not ok:
                return res("error", f"the C reference does not build with the mutant: {_tail(out)}")
        rc, out = sc.pytest(m.tests, m.timeout or timeout)
    finally:
        path.write_bytes(original)
        if m.needs_c_build:
            sc.restore_c()
        if path.read_bytes() != original:
            raise RuntimeError(f"{path}: could not restore the original text")
    if rc is None:
        return res("timeout", f"tests ran past {m.timeout or timeout:.0f} s")
    if rc == 1:
        unmutated = confirm(sc, m, out, m.timeout or timeout) if check else ""
        if unmutated:
            return res("error", f"the failing tests fail without the mutant too: {unmutated}")
        return res("caught", ("marked equivalent, yet a test fails: the note or the test is wrong; "
                              if m.equivalent else "") + _failure(out))
    if rc in (0, 5):                # 5: the arguments select no test, so nothing catches it
        why = _tail(out, 1) if rc == 0 else "no test selected (pytest exit 5)"
        return res("equivalent", m.equivalent) if m.equivalent else res("not caught", why)
    return res("error", f"pytest exit {rc}: {_tail(out)}")


def select(mutants, only: str = "", areas: str = "") -> list[Mutant]:
    ids = [s for s in only.split(",") if s]
    ars = [s for s in areas.split(",") if s]
    unknown = set(ids) - {m.id for m in mutants}
    if unknown:
        raise CatalogueError(f"unknown mutant ids: {', '.join(sorted(unknown))}")
    bad = set(ars) - set(AREAS)
    if bad:
        raise CatalogueError(f"unknown areas: {', '.join(sorted(bad))} (areas: {', '.join(AREAS)})")
    return [m for m in mutants if (not ids or m.id in ids) and (not ars or m.area in ars)]


def _in_parallel(fn, items: list) -> list:
    """fn over items, one thread each (the calling thread when there is one item); an interrupt
    kills every command in flight, and the threads finish (restoring their files) before it
    propagates."""
    if len(items) == 1:
        return [fn(items[0])]
    with concurrent.futures.ThreadPoolExecutor(len(items)) as ex:
        futs = [ex.submit(fn, x) for x in items]
        try:
            return [f.result() for f in futs]
        except BaseException:
            stop_everything()
            raise


def run_all(mutants, jobs: int = 1, timeout: float = 600, check: bool = True, keep: bool = False,
            source=REPO, log=print) -> tuple[list[Result], dict]:
    """Run mutants over `jobs` scratch copies; returns (results in catalogue order, info). On an
    interrupt (Ctrl-C, SIGTERM) the mutants done so far are returned, info["interrupted"] set."""
    t0 = time.perf_counter()
    _stop.clear()
    base = pathlib.Path(tempfile.mkdtemp(prefix="o1b-mutation-"))
    info = {"scratch": str(base), "jobs": jobs, "interrupted": False}
    results: dict[str, Result] = {}
    lock = threading.Lock()
    try:
        jobs = max(1, min(jobs, len(mutants)))
        scratches = _in_parallel(lambda k: Scratch.create(source, base / f"w{k}", log=log), list(range(jobs)))
        info["setup_s"] = round(time.perf_counter() - t0, 1)
        queue = list(mutants)

        def worker(sc: Scratch):
            while not _stop.is_set():
                with lock:
                    if not queue:
                        return
                    m = queue.pop(0)
                try:
                    r = run_mutant(sc, m, timeout, check)
                except Exception as e:      # a harness failure on one mutant is reported, not fatal
                    r = Result(m.id, m.area, m.file, "error", " ".join(m.tests), 0.0, f"harness: {e}")
                if _stop.is_set():          # its tests were killed: no verdict
                    return
                with lock:
                    results[m.id] = r
                log(f"{r.id:32s} {r.status:11s} {r.seconds:7.1f} s  {r.note[:100]}")

        _in_parallel(worker, scratches)
    except KeyboardInterrupt:
        stop_everything()
        info["interrupted"] = True
        log("interrupted: every mutated file was restored")
    finally:
        if keep:
            log(f"scratch kept: {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    info["total_s"] = round(time.perf_counter() - t0, 1)
    return [results[m.id] for m in mutants if m.id in results], info


def table(results) -> str:
    rows = [("id", "area", "file", "status", "tests", "s")]
    for r in results:
        tests = r.tests if len(r.tests) <= 60 else r.tests[:57] + "..."
        rows.append((r.id, r.area, r.file, r.status, tests, f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(results) -> dict:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def list_catalogue(mutants, root=REPO) -> str:
    rows = [("id", "area", "file", "in tree", "tests")]
    for m in mutants:
        why = stale_reason(pathlib.Path(root), m)
        rows.append((m.id, m.area, m.file, "equivalent" if m.equivalent and not why else ("ok" if not why else "STALE"),
                     " ".join(m.tests)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--catalogue", default=str(CATALOGUE), help="TOML file of [[mutant]] entries")
    ap.add_argument("--list", action="store_true", help="list the mutants and whether each text is in the tree")
    ap.add_argument("--only", default="", help="comma-separated mutant ids")
    ap.add_argument("--area", default="", help=f"comma-separated areas ({', '.join(AREAS)})")
    ap.add_argument("--jobs", type=int, default=1, help="scratch copies working in parallel (default 1)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests (default 600)")
    ap.add_argument("--no-confirm", action="store_true",
                    help="count a failing test as a catch without rerunning it on the restored copy")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--json", default="", help="write the report to this JSON file")
    a = ap.parse_args(argv)
    try:
        mutants = select(load_catalogue(a.catalogue), a.only, a.area)
    except CatalogueError as e:
        print(f"mutation: {e}", file=sys.stderr)
        return 2
    if a.list:
        print(list_catalogue(mutants))
        return 0
    if not mutants:
        print("mutation: no mutant selected", file=sys.stderr)
        return 2
    if a.jobs < 1:
        print("mutation: --jobs must be >= 1", file=sys.stderr)
        return 2
    log = lambda s: print(s, file=sys.stderr, flush=True)      # noqa: E731

    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    git = lambda *args: subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout  # noqa: E731
    tree = {"head": git("rev-parse", "HEAD").strip(), "uncommitted": git("status", "--porcelain").splitlines()}
    try:
        results, info = run_all(mutants, a.jobs, a.timeout, not a.no_confirm, a.keep, REPO, log)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        print(f"mutation: {e}", file=sys.stderr)
        return 2
    print(table(results))
    counts = summary(results)
    if info["interrupted"]:
        print(f"\ninterrupted after {len(results)} of {len(mutants)} mutants")
    print("\n" + ", ".join(f"{v} {k}" for k, v in counts.items()) + f"; {info['total_s']:.0f} s in all")
    for r in results:
        if r.status not in ("caught",) and r.note:
            print(f"  {r.id}: {r.status}: {r.note}")
    if a.json:
        rep = {"results": [dataclasses.asdict(r) for r in results], "summary": counts, **info,
               "catalogue": str(pathlib.Path(a.catalogue).resolve()), **tree}
        tmp = pathlib.Path(a.json).with_name(pathlib.Path(a.json).name + ".tmp")
        try:
            tmp.write_text(json.dumps(rep, indent=1) + "\n")
            os.replace(tmp, a.json)
        except OSError as e:
            print(f"mutation: cannot write the report {a.json}: {e}", file=sys.stderr)
            return 2
    if info["interrupted"]:
        return 130
    return 0 if counts["not caught"] == counts["error"] == counts["stale"] == counts["timeout"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
