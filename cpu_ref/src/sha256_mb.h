/* sha256_mb.h — the Merkle leaves of mlx_open1b/hashing.py, many at a time (sha256_mb.c). */
#ifndef O1B_SHA256_MB_H
#define O1B_SHA256_MB_H

#include <stdint.h>

/* out[32 i .. 32 i + 32) = SHA-256(0x00 || ptrs[i][0 .. lens[i])) for i < n, on the calling
 * thread. Returns how many leaves ended in the 16 AVX-512 lanes (the others ended alone), or -1
 * for a negative length or no memory. ptrs[i] may be NULL where lens[i] is 0; no alignment is
 * needed. */
int64_t o1b_sha256_leaves(int64_t n, const uint8_t *const *ptrs, const int64_t *lens, uint8_t *out);

/* 16 where o1b_sha256_leaves hashes equal-length leaves 16 at a time, else 1. */
int o1b_sha256_lanes(void);
#endif
