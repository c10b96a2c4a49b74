"""Binding of the Metal kernel sources: `mx.fast.metal_kernel` on a Mac, the emulator elsewhere.

`MetalKernel(name, input_names, output_names, source, header)` has the call signature of the
object `mx.fast.metal_kernel` returns (inputs, output_shapes, output_dtypes, grid, threadgroup,
template, init_value). Where Metal is available (`mx.metal.is_available()`) it *is* that object,
built with `ensure_row_contiguous=True` and `compile_options={"math_mode": "safe"}`; elsewhere it
runs the same source text in the emulator (`mlx_open1b.metal.emu`), through the same call.
Either way a call takes numpy arrays or mx.arrays and returns numpy arrays (bf16 as uint16), or
with keep=True what the runtime made: lazy mx.arrays on Metal (the caller's graph evaluates them),
numpy arrays from the emulator.

Kernels are built once and reused: `get_kernel` caches them by name, input and output names,
and the SHA-256 of header and source.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import os
import pathlib
import re

import numpy as np

from . import emu

SOURCE_DIR = pathlib.Path(__file__).resolve().parent
HEADER_NAME = "contract"


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of metal/<name>.metal (a kernel body, or the contract header)."""
    return (SOURCE_DIR / f"{name}.metal").read_text()


def header() -> str:
    return source(HEADER_NAME)


@functools.lru_cache(maxsize=1)
def real_metal() -> bool:
    """True where MLX runs on a Metal device (and O1B_METAL_EMULATE is not set)."""
    if os.environ.get("O1B_METAL_EMULATE") == "1":
        return False
    try:
        import mlx.core as mx
        return bool(mx.metal.is_available())
    except Exception:
        return False


def available() -> tuple[bool, str]:
    """(True, what runs the kernels) or (False, why the metal backend cannot run here)."""
    if real_metal():
        import mlx.core as mx
        try:
            name = mx.metal.device_info().get("device_name", "Metal device")
        except Exception:
            name = "Metal device"
        why = mlx_problem(mx)
        return (True, f"Metal ({name}), mlx {mx.__version__}") if why is None else (False, why)
    return emu.available()


#: MLX 0.32 is the first with mx.fast.metal_kernel(compile_options=...) (math_mode "safe") and with
#: custom kernels cached by their whole source rather than their name (DESIGN.md §11).
MIN_MLX = (0, 32)

_VERSION = re.compile(r"\s*v?(\d+)\.(\d+)((?:\.\d+)*)([^+]*)", re.I)
_PRE = re.compile(r"(?:^|[-_.\d])(?:a|b|c|rc|alpha|beta|pre|preview)\d*", re.I)       # PEP 440 pre-releases
_DEV, _POST = re.compile(r"dev", re.I), re.compile(r"post|rev|(?:^|[-_.\d])r\d|^-\d", re.I)


def parse_version(text) -> tuple[int, int, int, bool] | None:
    """(major, minor, patch, final) of a version string such as '0.32.4', '0.32.0.dev20260115+g1a2b3c',
    '0.33.0rc1' or 'v1.0'; final is False for a pre-release or a development release (PEP 440: they
    come before the release they name, so 0.32.0rc1 and 0.32.0.dev1 are older than 0.32.0, as pip's
    'mlx>=0.32' has it); None when it does not start with numbers."""
    m = _VERSION.match(str(text))
    if m is None:
        return None
    patch = int(m.group(3).split(".")[1]) if m.group(3) else 0
    rest = m.group(4).strip()
    final = not _PRE.search(rest) and (not _DEV.search(rest) or bool(_POST.search(rest)))
    return int(m.group(1)), int(m.group(2)), patch, final


def mlx_version_problem(version) -> str | None:
    """Why the installed mlx (its mx.__version__) cannot run the metal backend, or None."""
    v = parse_version(version)
    need = ".".join(map(str, MIN_MLX))
    if v is None:
        return (f"mlx reports the version {version!r}, which is not a version number; the metal backend "
                f"needs mlx >= {need} (pip install -U 'mlx>={need}')")
    if v[:2] < MIN_MLX or (v[:3] == (*MIN_MLX, 0) and not v[3]):
        return (f"mlx {version} is installed; the metal backend needs mlx >= {need} (compile_options with "
                f"math_mode 'safe', kernels cached by their source): pip install -U 'mlx>={need}'")
    return None


def _signature_text(fn) -> str | None:
    """The parameter list of a Python or nanobind function as text, or None when it has none."""
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):             # nanobind: the first docstring line is the signature
        nb = getattr(fn, "__nb_signature__", None)
        if nb:
            return " ".join(str(o[0]) for o in nb)
        head = (getattr(fn, "__doc__", None) or "").lstrip().split("\n", 1)[0]
        return head if "(" in head else None


def mlx_problem(mx) -> str | None:
    """Why this mlx cannot run the metal backend, or None: its version (mlx_version_problem), and
    the feature itself — mx.fast.metal_kernel taking compile_options (a development build of 0.32
    from before the option would pass a version test and fail at the first kernel)."""
    why = mlx_version_problem(getattr(mx, "__version__", None))
    if why is not None:
        return why
    fn = getattr(getattr(mx, "fast", None), "metal_kernel", None)
    if fn is None:
        return f"mlx {mx.__version__} has no mx.fast.metal_kernel; the metal backend needs it (mlx >= 0.32)"
    sig = _signature_text(fn)
    if sig is not None and "compile_options" not in sig:
        return _no_compile_options(mx.__version__)
    return None


def _no_compile_options(version) -> str:
    need = ".".join(map(str, MIN_MLX))
    return (f"mlx {version}: mx.fast.metal_kernel takes no compile_options, so kernels cannot be built with "
            f"math_mode 'safe'; the metal backend needs a release of mlx >= {need}: pip install -U 'mlx>={need}'")


def _mx_dtype(dt):
    import mlx.core as mx
    if isinstance(dt, mx.Dtype):
        return dt
    return getattr(mx, np.dtype(dt).name)


class MetalKernel:
    """A kernel with the call signature of mx.fast.metal_kernel's object; numpy arrays out."""

    def __init__(self, name: str, input_names, output_names, source: str, header: str = "",
                 race_check: bool | None = None):
        self.name = name
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.source, self.header = source, header
        self.real = real_metal()
        if self.real:
            import mlx.core as mx
            why = mlx_problem(mx)
            if why is not None:
                raise RuntimeError(why)
            try:
                self._kernel = mx.fast.metal_kernel(
                    name=name, input_names=self.input_names, output_names=self.output_names,
                    source=source, header=header, ensure_row_contiguous=True,
                    compile_options={"math_mode": "safe"})
            except TypeError as e:             # an mlx whose signature did not say (mlx_problem)
                if "compile_options" not in str(e) and "incompatible function arguments" not in str(e):
                    raise
                raise RuntimeError(f"{_no_compile_options(mx.__version__)} ({e})") from None
        else:
            self._kernel = emu.EmuKernel(name, self.input_names, self.output_names, source, header,
                                         race_check=race_check)

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None, keep=False):
        if not self.real:
            return self._kernel(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                                grid=grid, threadgroup=threadgroup, template=template,
                                init_value=init_value, verbose=verbose)
        import mlx.core as mx
        ins = [a if isinstance(a, mx.array) else mx.array(np.ascontiguousarray(a)) for a in inputs]
        tmpl = [(n, _mx_dtype(v) if not isinstance(v, (bool, int, np.integer, np.bool_)) else
                 (bool(v) if isinstance(v, (bool, np.bool_)) else int(v))) for n, v in (template or [])]
        kw = dict(inputs=ins, output_shapes=[tuple(int(s) for s in sh) for sh in output_shapes],
                  output_dtypes=[_mx_dtype(d) for d in output_dtypes], grid=tuple(grid),
                  threadgroup=tuple(threadgroup), init_value=init_value, verbose=verbose)
        if tmpl:
            kw["template"] = tmpl
        if stream is not None:
            kw["stream"] = stream
        outs = self._kernel(**kw)
        if keep:
            return list(outs)
        mx.eval(outs)
        return [np.array(o) for o in outs]


_kernels: dict[tuple, MetalKernel] = {}


def get_kernel(name: str, input_names, output_names, source: str, header: str = "") -> MetalKernel:
    """The MetalKernel for this source, built once per process and reused."""
    key = (name, tuple(input_names), tuple(output_names),
           hashlib.sha256(header.encode()).hexdigest(), hashlib.sha256(source.encode()).hexdigest())
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = MetalKernel(name, input_names, output_names, source, header)
    return k


def kernel(name: str, input_names, output_names) -> MetalKernel:
    """The kernel metal/<name>.metal with contract.metal as its header."""
    return get_kernel(name, input_names, output_names, source(name), header())
