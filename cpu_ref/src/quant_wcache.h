/* quant_wcache.h — a cache of the int8 layer's weight-side operands (quant_vnni.c), keyed by
 * the weight's bits.
 *
 * In training one weight W (M, K) enters every microbatch's forward and backward unchanged, and
 * everything the layer derives from W alone (row scales, levels, clip marks, the rotated and
 * packed B operands with their column sums and scale) is a pure function of (W's bits, M, K,
 * qmax). An entry holds a private copy of W's bytes beside those operands; a lookup compares
 * the whole copy with the caller's W (never the pointer alone: the optimizer rewrites a buffer
 * in place between steps), so a hit hands back exactly the bytes a recomputation would give.
 *
 * Parts: up to WC_NPART byte buffers (and one float each) per entry, filled by whichever call
 * computed them first; an entry may hold the forward's parts without the backward's. A caller
 * holds the entry it found (a reference) while it reads the parts; eviction and clearing only
 * unlink an entry, which its last holder frees. */
#ifndef O1B_QUANT_WCACHE_H
#define O1B_QUANT_WCACHE_H

#include <stddef.h>
#include <stdint.h>

#define WC_NPART 8

typedef struct wc_entry wc_entry;

/* The key besides W's bytes: the dimensions and whatever else fixes the derived operands. */
typedef struct { int64_t M, K, qmax; } wc_key;

/* The entry whose key and W bytes (wbytes at w) equal these, held (release it), with *have the
 * mask of its parts present now (only those may be read); or NULL (*have = 0). Counts a hit
 * when every part in `need` is there, a miss otherwise. */
wc_entry *o1b_wc_find(wc_key key, const void *w, size_t wbytes, unsigned need, unsigned *have);
void *o1b_wc_part(const wc_entry *e, int id);
float o1b_wc_scalar(const wc_entry *e, int id);
void o1b_wc_release(wc_entry *e);

/* A miss: fresh buffers, 64-byte aligned, for the parts in `want`, which the call computes into
 * and then stores (or drops). size[id] is given for every part an entry of this key can hold
 * (0: none), so that an entry that could outgrow the cap is never started. */
typedef struct { void *p[WC_NPART]; size_t n[WC_NPART]; float f[WC_NPART]; unsigned want; } wc_fill;
int o1b_wc_fill_open(wc_fill *f, unsigned want, const size_t size[WC_NPART], size_t wbytes);
/* Hands the filled parts to the cache (into `held`, the entry found for these bits, if any, or
 * an entry with the same bits, or a new one with a copy of W); releases `held`. */
void o1b_wc_fill_store(wc_fill *f, wc_entry *held, wc_key key, const void *w, size_t wbytes);
void o1b_wc_fill_drop(wc_fill *f);

#endif
