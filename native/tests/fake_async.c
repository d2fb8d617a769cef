/*
 * The stand-in driver's asynchronous copies (included by fake_libcuda.c, which owns the lock and
 * the streams this file uses).
 *
 * With GPUSHARE_FAKE_ASYNC_COPIES=1, an asynchronous copy (cuMemcpy*Async) is not made when it is
 * queued: it is made when its stream is synchronised (cuStreamSynchronize, cuStreamQuery that
 * answers success), at cuEventSynchronize/cuEventQuery of an event recorded after it on its
 * stream, at cuCtxSynchronize, or before any synchronous copy (the legacy stream waits for every
 * stream), as on a real device where the copy engine runs after the call returned. A device
 * range unmapped (cuMemUnmap) while a copy from or into it is still queued makes that copy read
 * what an unmapped page holds: its destination is filled with 0xDB and the stats count it in
 * "async_copies_lost". So a program that frees or unmaps memory before the copy out of it
 * completed gets wrong data, every time, not only when a race is lost.
 * GPUSHARE_FAKE_COPY_GBPS still makes the stream busy for the copy's duration.
 */

struct fk_pending {
    void *dst;
    const void *src;
    size_t n;
    struct CUstream_st *s;
    uint64_t seq;
};
static struct fk_pending *g_pend;
static size_t g_npend, g_cappend;
static uint64_t g_copy_seq; /* the last queued copy's number: an event remembers it */
static unsigned long long g_async_queued, g_async_lost;

static int fk_async_copies(void) {
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("GPUSHARE_FAKE_ASYNC_COPIES");
        on = v && *v && strcmp(v, "0") != 0;
    }
    return on;
}

/* Queue a copy (g_lock not held); 1 when queued, 0 when the caller copies now. */
static int fk_async_queue(void *dst, const void *src, size_t n, struct CUstream_st *s) {
    if (!fk_async_copies() || !s) return 0;
    pthread_mutex_lock(&g_lock);
    GROW(g_pend, g_npend, g_cappend);
    g_pend[g_npend++] = (struct fk_pending){dst, src, n, s, ++g_copy_seq};
    g_async_queued++;
    pthread_mutex_unlock(&g_lock);
    return 1;
}

/* The sequence number an event recorded on s now waits for (g_lock not held). */
static uint64_t fk_async_mark(void) {
    pthread_mutex_lock(&g_lock);
    uint64_t m = g_copy_seq;
    pthread_mutex_unlock(&g_lock);
    return m;
}

/* Make the queued copies of stream s (NULL: every stream) numbered up to `upto`, in order. Under
 * g_lock: an unmap cannot come between the check and the copy. */
static void fk_async_complete(struct CUstream_st *s, uint64_t upto) {
    if (!fk_async_copies()) return;
    pthread_mutex_lock(&g_lock);
    size_t k = 0;
    for (size_t i = 0; i < g_npend; i++) {
        struct fk_pending *p = &g_pend[i];
        if ((s && p->s != s) || p->seq > upto) {
            g_pend[k++] = *p;
            continue;
        }
        memmove(p->dst, p->src, p->n);
    }
    g_npend = k;
    pthread_mutex_unlock(&g_lock);
}

static int fk_overlaps(uintptr_t a, size_t an, uintptr_t b, size_t bn) {
    return a < b + bn && b < a + an;
}

/* cuMemUnmap of [base, base+size), g_lock held, before the range goes: the copies still queued
 * from or into it never see its memory. */
static void fk_async_unmapped_locked(uintptr_t base, size_t size) {
    size_t k = 0;
    for (size_t i = 0; i < g_npend; i++) {
        struct fk_pending *p = &g_pend[i];
        int from = fk_overlaps((uintptr_t)p->src, p->n, base, size);
        int into = fk_overlaps((uintptr_t)p->dst, p->n, base, size);
        if (!from && !into) {
            g_pend[k++] = *p;
            continue;
        }
        if (from && !into) memset(p->dst, 0xDB, p->n);
        g_async_lost++;
    }
    g_npend = k;
}

/* Appended to fakecuda_stats_json (g_lock held). */
#define FK_ASYNC_STATS(APPEND)                                                                    \
    APPEND("\"async_copies_queued\":%llu,\"async_copies_lost\":%llu,", g_async_queued,            \
           g_async_lost)
