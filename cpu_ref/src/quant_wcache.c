/* quant_wcache.c — the weight-operand cache of the int8 layer (see quant_wcache.h for what an
 * entry holds and why a hit cannot change a bit).
 *
 * One mutex guards the list, the counters and every entry's links, parts mask and reference
 * count. Entries are kept most recently used first; past the cap the least recently used are
 * unlinked. An unlinked entry is freed by whoever drops its last reference, so an entry a call
 * is reading is never freed under it. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "quant_wcache.h"
#include "runtime.h"

/* The bound on the cache's memory (W copies and derived operands together). Every weight of the
 * `small` preset fits (about 28 MB of entries: 5 bytes or so per weight element); an entry
 * larger than this (the open1b preset's FFN matrices) is never made, and the others are
 * evicted least recently used first, so the cache can never hold more than this. */
#define WC_CAP_DEFAULT ((size_t)64 << 20)

struct wc_entry {
    wc_entry *prev, *next;                 /* the list, most recently used first */
    wc_key key;
    void *w; size_t wbytes;                /* the private copy of W's bytes */
    const void *src;                       /* where W was read from: only a hint (see store) */
    void *p[WC_NPART]; size_t n[WC_NPART]; float f[WC_NPART];
    unsigned have;                         /* the parts present (set once, never removed) */
    size_t bytes;
    int refs, linked;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static wc_entry *g_head, *g_tail;
static size_t g_bytes, g_cap = WC_CAP_DEFAULT;
static int64_t g_entries, g_hits, g_misses;
static int g_on = 1;

/* A fork while another thread holds the lock would leave it held for good in the child (that
 * thread does not exist there): the fork waits for the lock, and both sides release it. */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static void wc_before_fork(void) { pthread_mutex_lock(&g_lock); }
static void wc_after_fork(void) { pthread_mutex_unlock(&g_lock); }
static void wc_once(void) { pthread_atfork(wc_before_fork, wc_after_fork, wc_after_fork); }
static void wc_lock(void) {
    pthread_once(&g_once, wc_once);
    pthread_mutex_lock(&g_lock);
}

static void *alloc64(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }
static void entry_free(wc_entry *e) {
    for (int i = 0; i < WC_NPART; i++) free(e->p[i]);
    free(e->w);
    free(e);
}
static void link_head(wc_entry *e) {
    e->prev = NULL; e->next = g_head;
    if (g_head) g_head->prev = e; else g_tail = e;
    g_head = e;
}
static void unlink_only(wc_entry *e) {
    if (e->prev) e->prev->next = e->next; else g_head = e->next;
    if (e->next) e->next->prev = e->prev; else g_tail = e->prev;
    e->prev = e->next = NULL;
}
/* Out of the cache: freed now, or by its last holder. */
static void drop(wc_entry *e) {
    unlink_only(e);
    e->linked = 0;
    g_bytes -= e->bytes;
    g_entries--;
    if (e->refs == 0) entry_free(e);
}
static void evict_to(size_t cap, const wc_entry *keep) {
    for (wc_entry *e = g_tail; e && g_bytes > cap;) {
        wc_entry *prev = e->prev;
        if (e != keep) drop(e);
        e = prev;
    }
}
static int same(const wc_entry *e, wc_key key, const void *w, size_t wbytes) {
    return e->key.M == key.M && e->key.K == key.K && e->key.qmax == key.qmax && e->wbytes == wbytes &&
           memcmp(e->w, w, wbytes) == 0;
}
static wc_entry *lookup(wc_key key, const void *w, size_t wbytes) {
    for (wc_entry *e = g_head; e; e = e->next)
        if (same(e, key, w, wbytes)) return e;
    return NULL;
}

wc_entry *o1b_wc_find(wc_key key, const void *w, size_t wbytes, unsigned need, unsigned *have) {
    *have = 0;
    wc_lock();
    wc_entry *e = g_on ? lookup(key, w, wbytes) : NULL;
    if (e) {
        e->refs++;
        unlink_only(e);
        link_head(e);
        *have = e->have;
    }
    if (g_on) {
        if ((*have & need) == need && e) g_hits++;
        else g_misses++;
    }
    pthread_mutex_unlock(&g_lock);
    return e;
}
void *o1b_wc_part(const wc_entry *e, int id) { return e->p[id]; }
float o1b_wc_scalar(const wc_entry *e, int id) { return e->f[id]; }
static void release_locked(wc_entry *e) {
    if (--e->refs == 0 && !e->linked) entry_free(e);
}
void o1b_wc_release(wc_entry *e) {
    if (!e) return;
    wc_lock();
    release_locked(e);
    pthread_mutex_unlock(&g_lock);
}

int o1b_wc_fill_open(wc_fill *f, unsigned want, const size_t size[WC_NPART], size_t wbytes) {
    memset(f, 0, sizeof *f);
    size_t total = wbytes;
    for (int i = 0; i < WC_NPART; i++) total += size[i];
    wc_lock();
    int ok = g_on && total <= g_cap;
    pthread_mutex_unlock(&g_lock);
    if (!ok) return 0;
    f->want = want;
    for (int i = 0; i < WC_NPART; i++)
        if ((want >> i) & 1u) {
            f->n[i] = size[i];
            f->p[i] = alloc64(size[i] > 0 ? size[i] : 1);
            if (!f->p[i]) { o1b_wc_fill_drop(f); return 0; }
        }
    return 1;
}
void o1b_wc_fill_drop(wc_fill *f) {
    for (int i = 0; i < WC_NPART; i++) { free(f->p[i]); f->p[i] = NULL; }
    f->want = 0;
}
void o1b_wc_fill_store(wc_fill *f, wc_entry *held, wc_key key, const void *w, size_t wbytes) {
    void *wcopy = NULL;
    if (!held) {                               /* the copy is made outside the lock */
        wcopy = malloc(wbytes > 0 ? wbytes : 1);
        if (wcopy) memcpy(wcopy, w, wbytes);
    }
    wc_lock();
    wc_entry *t = held && held->linked ? held : NULL;
    if (!held && g_on) {
        t = lookup(key, w, wbytes);            /* another call may have stored these bits meanwhile */
        if (!t && wcopy && (t = (wc_entry *)calloc(1, sizeof *t)) != NULL) {
            /* W's buffer at this address no longer holds an older entry's bits: that entry is
             * (most likely) dead, so it goes now rather than when the LRU order reaches it */
            for (wc_entry *e = g_head; e;) {
                wc_entry *next = e->next;
                if (e->src == w && e->key.M == key.M && e->key.K == key.K && e->key.qmax == key.qmax) drop(e);
                e = next;
            }
            t->key = key; t->w = wcopy; t->wbytes = wbytes; t->src = w;
            t->bytes = wbytes; t->linked = 1;
            wcopy = NULL;
            link_head(t);
            g_bytes += wbytes;
            g_entries++;
        }
    }
    if (t) {
        for (int i = 0; i < WC_NPART; i++) {
            if (!((f->want >> i) & 1u) || ((t->have >> i) & 1u)) continue;
            t->p[i] = f->p[i]; t->n[i] = f->n[i]; t->f[i] = f->f[i];
            f->p[i] = NULL;
            t->have |= 1u << i;
            t->bytes += f->n[i];
            g_bytes += f->n[i];
        }
        unlink_only(t);
        link_head(t);
        evict_to(g_cap, t);
        if (g_bytes > g_cap) drop(t);          /* the cap was lowered meanwhile */
    }
    if (held) release_locked(held);
    pthread_mutex_unlock(&g_lock);
    free(wcopy);
    o1b_wc_fill_drop(f);                       /* the parts the cache did not take */
}

/* ------------------------------------------------------------------ control, for tests */
/* Off: no lookups, nothing stored, not counted (what is held stays, for when it is on again);
 * on: the default. */
O1B_API void o1b_q_wcache_enable(int on) {
    wc_lock();
    g_on = on != 0;
    pthread_mutex_unlock(&g_lock);
}
/* Drops every entry and zeroes the counters. */
O1B_API void o1b_q_wcache_clear(void) {
    wc_lock();
    evict_to(0, NULL);
    g_hits = g_misses = 0;
    pthread_mutex_unlock(&g_lock);
}
/* Sets the cap in bytes (bytes < 0: the default) and evicts to fit; returns the old cap. */
O1B_API int64_t o1b_q_wcache_set_cap(int64_t bytes) {
    wc_lock();
    int64_t old = (int64_t)g_cap;
    g_cap = bytes < 0 ? WC_CAP_DEFAULT : (size_t)bytes;
    evict_to(g_cap, NULL);
    pthread_mutex_unlock(&g_lock);
    return old;
}
/* out: hits, misses, entries, bytes held, cap, on. */
O1B_API void o1b_q_wcache_stats(int64_t *out) {
    wc_lock();
    out[0] = g_hits; out[1] = g_misses; out[2] = g_entries; out[3] = (int64_t)g_bytes;
    out[4] = (int64_t)g_cap; out[5] = g_on;
    pthread_mutex_unlock(&g_lock);
}
