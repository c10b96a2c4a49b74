"""The backends the parity harness compares: the backends of mlx_open1b.backend (cpu_ref, metal,
cuda, loaded by its one loader), the `spec` pseudo-backend (mlx_open1b/spec behind the backend
interface) and any registered one.

`register(name, obj)` adds one (tests plant a faulty backend this way); a registered object need
not have every op of the interface: an op it lacks is reported missing. A few parity ops are
variants of an interface function called with a fixed keyword argument (VARIANTS: the simulated
int4 and int6 paths are the qlinear functions with qmax=7 and qmax=31); `resolve` finds them by
the function's signature.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from mlx_open1b import backend as _backend
from mlx_open1b.backend import BackendUnavailable  # noqa: F401  (re-exported: the harness's callers catch it)
from . import spec_backend

KNOWN = _backend.BACKENDS + ("spec",)
_extra: dict[str, Any] = {}


def register(name: str, backend: Any) -> None:
    _extra[name] = backend


def unregister(name: str) -> None:
    _extra.pop(name, None)


def load(name: str):
    """The backend object for `name`, or BackendUnavailable saying why not."""
    if name in _extra:
        return _extra[name]
    if name == "spec":
        return spec_backend
    if name not in KNOWN:
        raise BackendUnavailable(f"unknown backend {name!r} (known: {', '.join(names())})")
    return _backend.load(name)


def names() -> list[str]:
    return list(KNOWN) + [n for n in _extra if n not in KNOWN]


def status() -> list[tuple[str, bool, str]]:
    """(name, available, detail) for every known backend."""
    rows = []
    for n in names():
        try:
            b = load(n)
        except BackendUnavailable as e:
            rows.append((n, False, e.reason))
            continue
        detail = "registered"
        if callable(getattr(b, "available", None)):
            try:
                detail = str(b.available()[1])
            except Exception:   # noqa: BLE001 - a registered backend's own report
                pass
        rows.append((n, True, detail))
    return rows


def available() -> list[str]:
    """Names of the backends that run here, spec excluded (it is a self-test stand-in)."""
    return [n for n, ok, _ in status() if ok and n != "spec"]


#: parity op -> (the backend function it calls, the keyword arguments it adds). A backend has the
#: op when it has a function of the op's own name, or the base function with a parameter of every
#: keyword's name (read from its signature); otherwise the op is missing there (reported, not compared).
VARIANTS: dict[str, tuple[str, dict]] = {
    "qlinear4_forward": ("qlinear_forward", {"qmax": 7}),      # the simulated int4 path (CONTRACT.md §6.9)
    "qlinear4_backward": ("qlinear_backward", {"qmax": 7}),
    "qlinear6_forward": ("qlinear_forward", {"qmax": 31}),     # the simulated int6 path (CONTRACT.md §6.9)
    "qlinear6_backward": ("qlinear_backward", {"qmax": 31}),
}


def accepts(fn, names) -> bool:
    """Whether fn's signature has a parameter, passable by keyword, of every one of names."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    ok = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return all(n in params and params[n].kind in ok for n in names)


def resolve(backend: Any, op: str):
    """The backend's function for op; a VARIANTS op is its base function with the keywords bound,
    where that function takes them. None when the backend does not have the op (a registered
    backend may lack some; the interface's backends have every one)."""
    fn = getattr(backend, op, None)
    if fn is None and op in VARIANTS:
        base, kw = VARIANTS[op]
        f = getattr(backend, base, None)
        if f is not None and accepts(f, kw):
            fn = functools.partial(f, **kw)
    return fn
