"""The C reference backend: every contract op on numpy arrays (bf16 held as uint16).

The readable, portable definition that the Metal and CUDA sources must match bit for bit.
"""
from .runtime import (contract_version, get_num_threads, set_num_threads, settings, simd_level,
                      simd_name)
from .mathfn import (FUNCTIONS, add_inplace, bf16_to_f32, cos, exp, f32_to_bf16, log, rsqrt,
                     scale_inplace, sigmoid, silu, sin, sqrt, sqrt_int)
from .linear import linear_backward, linear_forward

NAME = "cpu_ref"
