"""A reference module (cpu_ref, a spec module) whose pure functions are computed once per distinct
arguments: the op tests hold every GPU backend to the same reference results, so the second backend
reuses the first one's instead of computing them again.

SharedReference(module) answers like the module; its functions return copies of the first result
for arguments equal bit for bit (arrays by dtype, shape and bytes; other values by type and repr),
except the functions named in `in_place` (they write their arguments) and results larger than
`max_bytes` (cheaper to compute again than to hold). `scope(owner)` forgets every result when the
owner (the test function) changes, so one test's cases are held at a time.
"""
from __future__ import annotations

import functools
import hashlib
import inspect

import numpy as np


def _key(v):
    if isinstance(v, np.ndarray):
        return ("a", v.dtype.str, v.shape, hashlib.blake2b(np.ascontiguousarray(v).tobytes(), digest_size=16).digest())
    if isinstance(v, np.generic):
        return ("g", v.dtype.str, v.tobytes())
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_key(x) for x in v))
    if isinstance(v, dict):
        return ("d", tuple((k, _key(x)) for k, x in sorted(v.items())))
    return (type(v).__name__, repr(v))


def _copy(v):
    if isinstance(v, np.ndarray):
        return v.copy()
    if isinstance(v, (tuple, list)):
        return type(v)(_copy(x) for x in v)
    return v


def _nbytes(v) -> int:
    if isinstance(v, np.ndarray):
        return v.nbytes
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    return 0


class SharedReference:
    def __init__(self, module, in_place=(), max_bytes: int = 1 << 23):
        self._module, self._in_place, self._max_bytes = module, frozenset(in_place), max_bytes
        self._memo: dict = {}
        self._owner = None
        self.hits = 0

    def scope(self, owner) -> None:
        if owner is not self._owner:
            self._memo.clear()
            self._owner = owner

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if (name.startswith("_") or name in self._in_place or not callable(value) or inspect.isclass(value)
                or inspect.ismodule(value)):
            return value

        @functools.wraps(value)
        def shared(*args, **kwargs):
            key = (name, _key(args), _key(kwargs))
            if key in self._memo:
                self.hits += 1
                return _copy(self._memo[key])
            out = value(*args, **kwargs)
            if _nbytes(out) <= self._max_bytes:
                self._memo[key] = _copy(out)
            return out
        return shared
