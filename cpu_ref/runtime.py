"""Threads and SIMD selection of the C reference. Neither changes any result bit."""
from __future__ import annotations

import contextlib

from ._lib import (contract_version_c, get_num_threads_c, set_gemm_impl_c, set_num_threads_c,
                   set_attn_vnni_c, set_q_amx_c, set_sha_ni_c, set_simd_c, simd_level_c, simd_name_c)

SIMD_LEVELS = {0: "portable", 1: "avx2", 2: "avx512"}


def set_num_threads(n: int) -> None:
    """Threads used by every kernel (0: one per online CPU)."""
    set_num_threads_c(int(n))


def get_num_threads() -> int:
    return int(get_num_threads_c())


def simd_level() -> int:
    return int(simd_level_c())


def simd_name() -> str:
    return simd_name_c().decode()


def contract_version() -> int:
    return int(contract_version_c())


def available() -> tuple[bool, str]:
    """Always (the library is built, or importing cpu_ref failed): what runs the kernels."""
    return True, f"C reference, {get_num_threads()} threads, SIMD {simd_name()}"


@contextlib.contextmanager
def settings(threads: int | None = None, simd: int | None = None, gemm_fast: bool | None = None,
             amx: bool | None = None, attn_vnni: bool | None = None, sha_ni: bool | None = None):
    """Temporarily change threads, the SIMD cap, the GEMM implementation, whether the int8 GEMM
    may use AMX tiles, whether the int8 attention forward may use VNNI for its P·V product, or
    whether the ledger's SHA-256 leaves may use the SHA extensions (tests use this to show that
    none of them changes a bit)."""
    old_threads = get_num_threads()
    try:
        if threads is not None:
            set_num_threads(threads)
        if simd is not None:
            set_simd_c(int(simd))
        if gemm_fast is not None:
            set_gemm_impl_c(int(bool(gemm_fast)))
        if amx is not None:
            set_q_amx_c(int(bool(amx)))
        if attn_vnni is not None:
            set_attn_vnni_c(int(bool(attn_vnni)))
        if sha_ni is not None:
            set_sha_ni_c(int(bool(sha_ni)))
        yield
    finally:
        set_num_threads(old_threads)
        set_simd_c(-1)
        set_gemm_impl_c(1)
        set_q_amx_c(1)
        set_attn_vnni_c(1)
        set_sha_ni_c(1)
