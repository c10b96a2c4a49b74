"""The shape-only backend: the CUDA backend's own op code (cuda/ops.py) run on shape arrays.

`load()` imports a private copy of mlx_open1b.cuda.ops (module name mlx_open1b.shape.cuda_ops) and
gives it a runtime in which the device's array module is this package's (array.py) and a kernel
launch does nothing. Every op then checks its arguments (opargs), allocates its outputs and its
scratch buffers (the xent logit chunks, the int8 operands and int32 accumulators, the attention
scratch) exactly as on a GPU, and computes nothing: the ledger sees the allocations of a CUDA run.
Scalar results (treefold, clip_coef, the scalar ops) come back as 0.0; the step then takes the
path of a finite norm that is clipped, which allocates nothing more than the others.

It implements the interface of mlx_open1b/backend.py under the name "shape"; it is not a training
choice (the CLI's --backend refuses it): its hashes cover shapes only.
"""
from __future__ import annotations

import importlib.util
import sys

from . import array as xp
from .ledger import OPS_MODULE

NAME = "shape"


class _NoKernel:
    """What the shape runtime gives for any kernel: a launch that does nothing."""

    def get_function(self, name):
        return lambda *a, **k: None


class _Runtime:
    @staticmethod
    def real_cuda() -> bool:
        return True

    @staticmethod
    def describe() -> tuple[bool, str]:
        return True, "shape-only: no kernel runs, allocations recorded (mlx_open1b.shape)"

    @staticmethod
    def load(file, *args, **kwargs):
        return _NoKernel()


_ops = None


def load():
    """The backend module (built once per process)."""
    global _ops
    if _ops is None:
        import mlx_open1b.cuda as cuda_pkg
        spec = importlib.util.spec_from_file_location(OPS_MODULE, cuda_pkg.__path__[0] + "/ops.py",
                                                      submodule_search_locations=None)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = "mlx_open1b.cuda"          # its relative import (runtime) resolves
        sys.modules[OPS_MODULE] = mod
        spec.loader.exec_module(mod)
        mod.runtime = _Runtime
        mod._xp = lambda: xp
        mod._launch1d = lambda *a, **k: None
        mod._gemm = lambda *a, **k: None
        mod.NAME = NAME
        mod.available = _Runtime.describe
        mod.to_torch = mod.from_torch = _no_torch
        _ops = mod
    return _ops


def _no_torch(x):
    raise TypeError("the shape-only backend has no torch interop")
