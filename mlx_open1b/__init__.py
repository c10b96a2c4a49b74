"""mlx-open1b: fully auditable, bitwise-reproducible training of decoder-only language models
on Apple GPUs (Metal via MLX), NVIDIA GPUs (CUDA via CuPy) and CPUs (a C reference).

The arithmetic is defined by CONTRACT.md; `mlx_open1b.cpu_ref` is its C reference and
`mlx_open1b.spec` its executable numpy twin.
"""
__version__ = "0.1.0"
