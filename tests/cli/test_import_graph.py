"""No import circles among the package's modules.

Every module of mlx_open1b (the folders pyproject.toml maps into it: cpu_ref/, metal/, cuda/,
parity/, cli/ as well) is parsed with ast and each of its imports, at module level or inside a
function, becomes an edge to the package module it names. An import inside a function hides a
circle from Python until the function first runs; it is a circle all the same, and this test
finds it. Importing a.b.c also runs the package a.b's __init__, so that is an edge too, except for
packages that hold the importing module (already being imported when it runs).
"""
import ast
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "mlx_open1b"


def package_roots() -> dict[str, pathlib.Path]:
    """{package name: its folder} from pyproject.toml's package-dir (the folders mapped into the package)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in tool["package-dir"].items()}


def modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """{dotted module name: (file, is a package __init__)} of every module under the mapped folders."""
    roots = package_roots()
    mapped = {p.resolve() for p in roots.values()}
    out = {}

    def walk(name: str, folder: pathlib.Path) -> None:
        for f in sorted(folder.iterdir()):
            if f.suffix == ".py" and f.is_file():
                out[name if f.stem == "__init__" else f"{name}.{f.stem}"] = (f, f.stem == "__init__")
            elif f.is_dir() and (f / "__init__.py").exists() and f.resolve() not in mapped:
                walk(f"{name}.{f.name}", f)

    for name, folder in roots.items():
        walk(name, folder)
    return out


def _target(name: str, known) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in known:
            return ".".join(parts[:k])
    return None


def imports_of(module: str, path: pathlib.Path, is_pkg: bool, known) -> set[str]:
    """The package modules `module` imports anywhere in its file (function bodies included)."""
    here = module if is_pkg else module.rpartition(".")[0]
    named = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here.split(".")
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            # `from pkg import name`: name is a submodule or an attribute of pkg
            named += [f"{base}.{a.name}" for a in node.names] if base else []
    out = set()
    own = {".".join(module.split(".")[:k]) for k in range(1, module.count(".") + 2)}
    for name in named:
        t = _target(name, known)
        if t is None:
            continue
        parts = t.split(".")
        for k in range(1, len(parts) + 1):          # the module and the packages it runs first
            p = ".".join(parts[:k])
            if p in known and p not in own:
                out.add(p)
    out.discard(module)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(m, f, is_pkg, mods) for m, (f, is_pkg) in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path a -> ... -> a) per strongly connected component of more than one module."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def strong(v):                      # Tarjan, iterative
        work = [(v, iter(sorted(g[v])))]
        index[v] = low[v] = len(index)
        stack.append(v), on.add(v)
        while work:
            u, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt), on.add(nxt)
                    work.append((nxt, iter(sorted(g[nxt]))))
                elif nxt in on:
                    low[u] = min(low[u], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[u])
            if low[u] == index[u]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == u:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return [_circle(g, comp) for comp in comps]


def _circle(g: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    inside, start = set(comp), comp[0]
    came, frontier = {}, [start]
    while True:
        nxt = []
        for u in frontier:
            for x in sorted(g[u] & inside):
                if x == start:
                    path = [u]
                    while path[0] != start:
                        path.insert(0, came[path[0]])
                    return path + [start]
                if x not in came:
                    came[x] = u
                    nxt.append(x)
        frontier = nxt


def test_modules_are_found():
    mods = modules()
    for name in (PACKAGE, f"{PACKAGE}.train", f"{PACKAGE}.cli.main", f"{PACKAGE}.parity.runner",
                 f"{PACKAGE}.cpu_ref", f"{PACKAGE}.data.stream"):
        assert name in mods, name


def test_every_package_is_packaged():
    # a package folder missing from pyproject's list imports here (editable) and not from a wheel
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {m for m, (_, is_pkg) in modules().items() if is_pkg}
    assert found - listed == set(), f"packages missing from pyproject.toml's packages: {sorted(found - listed)}"


def test_function_level_imports_are_edges():
    g = graph()
    # backend.on_device imports the metal runtime inside its body
    assert f"{PACKAGE}.metal.runtime" in g[f"{PACKAGE}.backend"]


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "import circles among the package's modules:\n" + "\n".join(
        "  " + " -> ".join(c) for c in found)
