"""Builds the C reference (cpu_ref/src/*.c) as mlx_open1b.cpu_ref._kernels.

Portable build: no -march flags; SIMD paths are compiled per function with target attributes
and chosen at run time (cpu_ref/src/cpu.c). -ffp-contract=off keeps every a*b+c as a rounded
multiply followed by a rounded add, as CONTRACT.md requires; no fast-math of any kind.
Set O1B_SANITIZE=address at build time for an AddressSanitizer build (see README).
"""
import glob
import os
import sys

from setuptools import Extension, setup

cflags = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
          "-fno-strict-aliasing", "-Wall", "-Wno-unused-function", "-pthread"]
ldflags = ["-pthread"]
if sys.platform == "darwin":
    ldflags = []
san = os.environ.get("O1B_SANITIZE", "")
if san:
    cflags += [f"-fsanitize={san}", "-fno-omit-frame-pointer", "-O1", "-g"]
    ldflags += [f"-fsanitize={san}"]

sources = sorted(glob.glob("cpu_ref/src/*.c"))
setup(
    ext_modules=[Extension("mlx_open1b.cpu_ref._kernels", sources=sources,
                           depends=sorted(glob.glob("cpu_ref/src/*.h")),
                           extra_compile_args=cflags, extra_link_args=ldflags)],
)
