"""Backends by name: cpu_ref (always), metal and cuda (when their ops module imports and reports
itself available), and the `spec` pseudo-backend (mlx_open1b/spec behind cpu_ref's API).

A backend is any object with cpu_ref's op functions (numpy in, numpy-convertible out).
`register(name, obj)` adds one (tests plant a faulty backend this way). A few parity ops are
variants of an API function called with a fixed keyword argument (VARIANTS: the simulated int4
and int6 paths are the qlinear functions with qmax=7 and qmax=31); `resolve` finds them by the
function's signature.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from mlx_open1b.contract import CONTRACT_VERSION

KNOWN = ("cpu_ref", "metal", "cuda", "spec")
_extra: dict[str, Any] = {}


class BackendUnavailable(RuntimeError):
    """The backend cannot run here; the message says why."""


def register(name: str, backend: Any) -> None:
    _extra[name] = backend


def unregister(name: str) -> None:
    _extra.pop(name, None)


def _gpu_ops(name: str):
    modname = f"mlx_open1b.{name}.ops"
    try:
        mod = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name in (modname, f"mlx_open1b.{name}"):
            raise BackendUnavailable(f"{modname} is not in this install yet") from None
        raise BackendUnavailable(f"{modname} cannot be imported: {e}") from None
    except Exception as e:   # noqa: BLE001 - an import that fails for any reason makes it unavailable
        raise BackendUnavailable(f"{modname} cannot be imported: {type(e).__name__}: {e}") from None
    avail = getattr(mod, "available", None)
    if avail is None:
        raise BackendUnavailable(f"{modname} has no available() function")
    try:
        ok, why = avail()
    except Exception as e:   # noqa: BLE001
        raise BackendUnavailable(f"{modname}.available() raised {type(e).__name__}: {e}") from None
    if not ok:
        raise BackendUnavailable(f"{name}: {why}")
    return mod


def load(name: str):
    """The backend object for `name`, or BackendUnavailable saying why not."""
    if name in _extra:
        return _extra[name]
    if name == "cpu_ref":
        try:
            from mlx_open1b import cpu_ref
        except ImportError as e:
            raise BackendUnavailable(f"cpu_ref: {e}") from None
        if cpu_ref.contract_version() != CONTRACT_VERSION:
            raise BackendUnavailable(f"cpu_ref implements contract v{cpu_ref.contract_version()}, the package "
                                     f"v{CONTRACT_VERSION}; rebuild with `pip install -e .`")
        return cpu_ref
    if name in ("metal", "cuda"):
        return _gpu_ops(name)
    if name == "spec":
        from . import spec_backend
        return spec_backend
    raise BackendUnavailable(f"unknown backend {name!r} (known: {', '.join(names())})")


def names() -> list[str]:
    return list(KNOWN) + [n for n in _extra if n not in KNOWN]


def status() -> list[tuple[str, bool, str]]:
    """(name, available, detail) for every known backend."""
    rows = []
    for n in names():
        try:
            b = load(n)
        except BackendUnavailable as e:
            rows.append((n, False, str(e)))
            continue
        detail = "registered"
        av = getattr(b, "available", None)
        if callable(av):
            try:
                detail = str(av()[1])
            except Exception:   # noqa: BLE001
                pass
        elif n == "cpu_ref":
            detail = f"C reference, {b.get_num_threads()} threads, SIMD {b.simd_name()}"
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
    """The backend's function for op; scalar_* may live in a submodule (cpu_ref keeps them in its
    mathfn and optim modules); a VARIANTS op is its base function with the keywords bound, where
    that function takes them. None when the backend does not have the op."""
    fn = getattr(backend, op, None)
    if fn is None and op in VARIANTS:
        base, kw = VARIANTS[op]
        f = getattr(backend, base, None)
        if f is not None and accepts(f, kw):
            fn = functools.partial(f, **kw)
    if fn is None and op.startswith("scalar_"):
        for sub in ("mathfn", "optim"):
            fn = fn or getattr(getattr(backend, sub, None), op, None)
    return fn
