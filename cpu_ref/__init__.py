"""The C reference backend: every contract op on numpy arrays (bf16 held as uint16).

The readable, portable definition that the Metal and CUDA sources must match bit for bit.
"""
from .runtime import (contract_version, get_num_threads, set_num_threads, settings, simd_level,
                      simd_name)
from .mathfn import (FUNCTIONS, add_inplace, bf16_to_f32, cos, div_int, exp, f32_to_bf16, log, rsqrt,
                     scale_inplace, sigmoid, silu, sin, sqrt, sqrt_int)
from .linear import linear_backward, linear_forward

NAME = "cpu_ref"
from .layers import (embedding_backward, embedding_forward, rmsnorm_backward, rmsnorm_forward,
                     rope_backward, rope_forward, rope_tables, swiglu_backward, swiglu_forward)
from .optim import adamw_step, clip_coef, global_norm, sumsq_blocks, treefold
from .random import philox_blocks, trunc_normal
from .attention import attention_forward, attention_forward_i8, attention_backward
from .xent import xent_forward, xent_backward, XENT_CHUNK
from .quant import (gemm_i8, gemm_i8_has_vnni, hadamard_rows, qlinear_backward, qlinear_forward,
                    quant_tensor, quant_weight_rows)

from mlx_open1b.arrays import functional_ops as _functional_ops

add, scale, adamw = _functional_ops(add_inplace, scale_inplace, adamw_step)


def to_device(a):
    """The backend's array for host data: for cpu_ref the numpy array itself."""
    return a


def to_host(a):
    """A numpy array (cpu_ref's arrays already are)."""
    return a
