"""The C reference backend: every contract op on numpy arrays (bf16 held as uint16).

The readable, portable definition that the Metal and CUDA sources must match bit for bit. Each
op's arguments, shapes and dtypes: the interface, mlx_open1b/backend.py. Its arrays are numpy
arrays (to_device and to_host return them as they are); what it adds: the threads and SIMD level
of the kernels (`settings`, `set_num_threads`, `simd_name`), none of which changes a bit, and
`weights_held` (the int8 layer's weight operands computed once per weight array while held: a
training step's microbatches), which changes none either.
"""
from mlx_open1b import derived_ops, opargs

from .runtime import (available, contract_version, get_num_threads, set_num_threads, settings,
                      simd_level, simd_name)
from .mathfn import (FUNCTIONS, add, add_inplace, bf16_to_f32, cos, div_int, exp, f32_to_bf16, log,
                     rsqrt, scale_inplace, sigmoid, silu, sin, sqrt, sqrt_int)
from . import mathfn as _mathfn, optim as _optim
from .linear import linear_backward, linear_forward
from .layers import (embedding_backward, embedding_forward, rmsnorm_backward, rmsnorm_forward,
                     rope_backward, rope_forward, rope_tables, swiglu_backward, swiglu_forward)
from .optim import adamw_step, clip_coef, sumsq_blocks, treefold
from .random import philox_blocks, trunc_normal
from .attention import attention_forward, attention_forward_i8, attention_backward
from .xent import xent_forward, xent_backward, XENT_CHUNK
from .quant import (gemm_i8, gemm_i8_has_vnni, hadamard_rows, qlinear_backward, qlinear_forward,
                    quant_tensor, quant_weight_rows, weights_held)

NAME = "cpu_ref"
_SCALAR_C = (_mathfn.scalar_add, _mathfn.scalar_sub, _mathfn.scalar_mul, _mathfn.scalar_div)


def _scalar(op: int, a: float, b: float = 0.0) -> float:
    """The C library's host-side contract arithmetic, by opargs.SCALAR_OPS code."""
    return _optim.scalar_sqrt(a) if op == 4 else _SCALAR_C[op](a, b)


scalar_add, scalar_sub, scalar_mul, scalar_div, scalar_sqrt = opargs.scalar_functions(_scalar)
_, scale, adamw = derived_ops.functional_ops(add_inplace, scale_inplace, adamw_step)   # add: its own kernel
global_norm = derived_ops.global_norm_of(sumsq_blocks, treefold, scalar_sqrt)


def to_device(a):
    return a


def to_host(a):
    return a
