"""The parts of a backend that every backend builds the same way from its own kernels.

A backend's kernels either update buffers in place (cpu_ref, cuda, the spec) or return new arrays
(metal: mx.arrays cannot be written in place). Each kind gets the other form here, so every backend
has both (mlx_open1b/backend.py lists them); either way the backend's own kernels run on the same
values, so the bits are those of its own ops:

- functional_ops: add, scale, adamw returning new arrays, from add_inplace, scale_inplace and
  adamw_step run on copies;
- inplace_ops: add_inplace, scale_inplace and adamw_step on numpy buffers, from add, scale and
  adamw with the results written back;
- global_norm_of: the global norm of §7 from sumsq_blocks, treefold and scalar_sqrt;
- returns_given_kind: the decorator of a device backend's ops (metal, cuda) that makes each op
  return the kind of arrays it is given;
- into: an op's result written into the output array its caller gave (linear_backward's dw_out).
"""
from __future__ import annotations

import functools

from . import arrays, opargs


def functional_ops(add_inplace, scale_inplace, adamw_step):
    """add(a, b), scale(a, s) and adamw(...) returning new arrays, from a backend's in-place ops run
    on copies (for kinds that can be written in place: numpy, cupy)."""
    def add(a, b):
        out = arrays.copy(a)
        add_inplace(out, b)
        return out

    def scale(a, s):
        out = arrays.copy(a)
        scale_inplace(out, s)
        return out

    def adamw(p_, g, m, v, *, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step):
        p2, m2, v2 = arrays.copy(p_), arrays.copy(m), arrays.copy(v)
        adamw_step(p2, g, m2, v2, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
        return p2, m2, v2

    return add, scale, adamw


def _write_back(dst, new) -> None:
    dst.reshape(-1)[...] = arrays.to_host(new).reshape(-1)


def inplace_ops(add, scale, adamw):
    """add_inplace, scale_inplace and adamw_step on numpy buffers, from a backend's ops that return
    new arrays: the arguments are checked as writable (an mx.array is refused, naming the functional
    op), the functional op runs and its results are written back."""
    def add_inplace(a, b):
        opargs.add_inplace(a, b)
        _write_back(a, add(a, b))

    def scale_inplace(a, s):
        opargs.scale_inplace(a)
        _write_back(a, scale(a, s))

    def adamw_step(p_, g, m, v, *, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step):
        opargs.adamw(p_, g, m, v, lr, beta1, beta2, eps, weight_decay, step)
        outs = adamw(p_, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
        for dst, new in zip((p_, m, v), outs):
            _write_back(dst, new)

    return add_inplace, scale_inplace, adamw_step


def global_norm_of(sumsq_blocks, treefold, scalar_sqrt):
    """global_norm(tensors): sqrt of the tree fold of the block partials of every tensor, tensors in
    the given (canonical) order, the partials joined in the kind the backend returned them."""
    def global_norm(tensors):
        parts = [sumsq_blocks(t) for t in opargs.global_norm(tensors)]
        return float(scalar_sqrt(treefold(arrays.concat(parts))))
    return global_norm


#: The keyword arguments that name where an op writes a result (never moved to the device).
OUTPUTS = ("dw_out",)


def into(out, value):
    """value itself when out is None; else value's elements written into out (a numpy or cupy array
    of value's shape and dtype, checked by the op), and out. A device value goes to a numpy out
    through the host."""
    if out is None or value is None:
        return value
    if arrays.kind(out) == arrays.NUMPY and arrays.kind(value) != arrays.NUMPY:
        value = arrays.to_host(value)
    out[...] = value
    return out


def returns_given_kind(lift, mode):
    """A decorator for the ops of a device backend: an op is in device mode while it runs iff any of
    its array arguments (or an array in a list or tuple argument) is a device array; then its numpy
    arguments are first moved up with `lift` (the backend's to_device), so that the kernels, nested
    ops and joins see one kind, and the results are device arrays; given numpy only it returns
    numpy. An output argument (OUTPUTS: dw_out) decides nothing and is never moved: the op writes
    its result there as given (into). `mode(device, values)` is a context manager around the op in which the backend keeps
    what it needs per op (where results go, uploads shared by nested ops). An in-place op
    (decorate(op, in_place=True)) keeps its arguments: it writes numpy or cupy buffers in place."""
    def decorate(op, in_place: bool = False):
        @functools.wraps(op)
        def wrapper(*args, **kwargs):
            values = args + tuple(v for k, v in kwargs.items() if k not in OUTPUTS)
            device = arrays.any_device(values) is not None
            if device and not in_place:
                args = arrays.map_numpy(lift, args)
                # an output array (dw_out) stays as given: the op writes its result there (into)
                kwargs = {k: v if k in OUTPUTS else arrays.map_numpy(lift, v) for k, v in kwargs.items()}
            with mode(device, values):
                return op(*args, **kwargs)
        return wrapper
    return decorate
