/*
 * Moving explicit device memory: eviction (copy out, unmap, release), restore (create, map, copy
 * back at the same address) and pre-copy (copy out, stay resident).
 *
 * Eviction queues every block's D2H copy on one stream with an event after each, then retires the
 * blocks in order: block i is unmapped and released while the copies of blocks i+1.. still run, so
 * the copy engine never idles between blocks. A block whose pre-copy is still valid is not copied
 * at all: its eviction is an unmap.
 *
 * A pre-copy is valid while no gated call (launch, copy, set, graph) was made since it started:
 * gs_total_gated_calls() is the process's monotonic count of them, so "unchanged" proves nothing
 * could have written device memory through the driver. (A call already past the gate when the
 * pre-copy starts is not seen; the scheduler asks only idle kernels, whose calls have returned.)
 */
#include <stdlib.h>

#include "memory_vmm.h"

static int precopy_valid(const struct block *b, uint64_t calls)
{
    return b->precopied && b->precopy_mark == calls;
}

/* Copy device dev's resident blocks into their staging on stream s, an event after each. Returns
 * how many were queued into out/events (blocks without staging or whose copy was refused are left
 * out and make *failed 1). skip_clean: blocks with a valid pre-copy need no copy (queued, no
 * event). */
static size_t queue_copies_out(CUdevice dev, CUstream s, struct block **out, CUevent *events,
                               int skip_clean, uint64_t calls, int *failed)
{
    size_t k = 0;
    for (size_t i = 0; i < gs_vmm_nblocks; i++) {
        struct block *b = gs_vmm_blocks[i];
        if (!gs_vmm_on(b, dev) || !b->resident || b->ipc_pinned)
            continue; /* a pinned block is mapped by a peer process: never pulled from under it */
        if (skip_clean && precopy_valid(b, calls)) {
            events[k] = NULL;
            out[k++] = b;
            continue;
        }
        if (!skip_clean && precopy_valid(b, calls))
            continue; /* a pre-copy: already there */
        if (!b->staging.host && gs_staging_get(&b->staging, b->size) != 0) {
            *failed = 1;
            continue;
        }
        if (gs_vmm_drv.d2h(b->staging.host, b->va, b->size, s) != CUDA_SUCCESS) {
            *failed = 1;
            continue;
        }
        events[k] = NULL;
        if (gs_vmm_drv.event_create(&events[k], GS_EVENT_DISABLE_TIMING) == CUDA_SUCCESS &&
            gs_vmm_drv.event_record(events[k], s) != CUDA_SUCCESS) {
            gs_vmm_drv.event_destroy(events[k]);
            events[k] = NULL;
        }
        out[k++] = b;
    }
    return k;
}

/* Wait until block k's copy is done: its event, else the whole stream. */
static CUresult wait_copy(CUevent ev, CUstream s)
{
    if (!ev)
        return gs_vmm_drv.stream_sync(s);
    CUresult r = gs_vmm_drv.event_sync(ev);
    gs_vmm_drv.event_destroy(ev);
    return r;
}

/* The working set of one eviction or pre-copy: room for every block and its event. */
struct batch {
    CUstream stream;
    struct block **list;
    CUevent *events;
};

/* 0 when there is nothing to do or the batch is ready; -1 when it could not be set up. */
static int batch_open(struct batch *b, int low_priority)
{
    *b = (struct batch){0};
    if (!gs_vmm_nblocks)
        return 0;
    b->stream = gs_vmm_move_stream(low_priority);
    b->list = calloc(gs_vmm_nblocks, sizeof *b->list);
    b->events = calloc(gs_vmm_nblocks, sizeof *b->events);
    return b->stream && b->list && b->events ? 0 : -1;
}

static void batch_close(struct batch *b)
{
    free(b->list);
    free(b->events);
}

int gs_vmm_evict(CUdevice dev, uint64_t *bytes_moved, uint64_t *micros)
{
    double t0 = gs_now();
    *bytes_moved = *micros = 0;
    if (!gs_vmm_drv.ok)
        return 0;
    pthread_mutex_lock(&gs_vmm_mu);
    uint64_t moved = 0, calls = gs_total_gated_calls();
    struct batch bt;
    int failed = batch_open(&bt, 0) != 0;
    if (!failed && bt.stream) {
        size_t n = queue_copies_out(dev, bt.stream, bt.list, bt.events, 1, calls, &failed);
        for (size_t k = 0; k < n; k++) {
            struct block *b = bt.list[k];
            int clean = precopy_valid(b, calls);
            if (!clean && wait_copy(bt.events[k], bt.stream) != CUDA_SUCCESS) {
                failed = 1; /* the copy failed: the block stays resident, its data intact */
                continue;
            }
            gs_vmm_unback(b);
            b->precopied = 0;
            moved += b->size;
        }
    }
    batch_close(&bt);
    gs_mem_engine_account(dev, 0, 0, (int64_t)moved);
    pthread_mutex_unlock(&gs_vmm_mu);
    *bytes_moved = moved;
    *micros = (uint64_t)((gs_now() - t0) * 1e6);
    if (failed)
        GS_WARN("eviction incomplete: some device memory could not be copied out and stays on "
                "the device");
    return failed ? -1 : 0;
}

int gs_vmm_restore(CUdevice dev, uint64_t *bytes_moved, uint64_t *micros)
{
    double t0 = gs_now();
    *bytes_moved = *micros = 0;
    if (!gs_vmm_drv.ok)
        return 0;
    pthread_mutex_lock(&gs_vmm_mu);
    uint64_t moved = 0, backed = 0;
    int failed = 0;
    CUstream s = NULL;
    for (size_t i = 0; i < gs_vmm_nblocks; i++) {
        struct block *b = gs_vmm_blocks[i];
        if (b->resident || !gs_vmm_on(b, dev))
            continue;
        size_t free_now = 0, total = 0;
        /* Never oversubscribe: only what the device has free comes back. */
        if (gs_vmm_drv.meminfo(&free_now, &total) != CUDA_SUCCESS || free_now < b->size) {
            char a[32], f[32];
            GS_WARN("restore stopped: %s does not fit the device's %s free; the rest stays on the "
                    "host until there is room",
                    gs_format_size(b->size, a, sizeof a), gs_format_size(free_now, f, sizeof f));
            failed = 1;
            break;
        }
        if (!s && !(s = gs_vmm_move_stream(0))) {
            failed = 1;
            break;
        }
        if (gs_vmm_back(b) != CUDA_SUCCESS) {
            failed = 1;
            break;
        }
        if (b->unbacked) {
            b->unbacked = 0; /* never written: nothing to copy back */
            backed += b->size;
            continue;
        }
        if (gs_vmm_drv.h2d(b->va, b->staging.host, b->size, s) != CUDA_SUCCESS) {
            gs_vmm_unback(b);
            failed = 1;
            break;
        }
        moved += b->size;
    }
    if (s && gs_vmm_drv.stream_sync(s) != CUDA_SUCCESS)
        failed = 1;
    gs_mem_engine_account(dev, 0, 0, -(int64_t)(moved + backed));
    pthread_mutex_unlock(&gs_vmm_mu);
    *bytes_moved = moved;
    *micros = (uint64_t)((gs_now() - t0) * 1e6);
    return failed ? -1 : 0;
}

static unsigned slot_bits(CUdevice dev)
{
    return dev == GS_MEM_ALL_DEVICES ? ~0u : 1u << gs_mem_slot(dev);
}

void gs_vmm_defer_backing(CUdevice dev) { atomic_fetch_or(&gs_vmm_defer, slot_bits(dev)); }

void gs_vmm_back_deferred(CUdevice dev)
{
    pthread_mutex_lock(&gs_vmm_mu);
    /* Under the lock: an allocation either comes before this pass (and is backed by it) or after
     * (and is backed at once). Cleared even when the engine has no block yet: a grant that comes
     * before the first cudaMalloc (PyTorch's expandable segments allocate with cuMemCreate, and
     * cuDNN's first cudaMalloc follows the grant) must not leave later blocks unbacked. */
    atomic_fetch_and(&gs_vmm_defer, ~slot_bits(dev));
    if (!gs_vmm_drv.ok) {
        pthread_mutex_unlock(&gs_vmm_mu);
        return;
    }
    uint64_t backed = 0;
    for (size_t i = 0; i < gs_vmm_nblocks; i++) {
        struct block *b = gs_vmm_blocks[i];
        if (!b->unbacked || !gs_vmm_on(b, dev))
            continue;
        if (gs_vmm_back(b) != CUDA_SUCCESS) {
            char a[32];
            GS_WARN("cannot back %s of memory allocated while waiting: the device is full",
                    gs_format_size(b->size, a, sizeof a));
            continue;
        }
        b->unbacked = 0;
        backed += b->size;
        gs_mem_engine_account(b->dev, 0, 0, -(int64_t)b->size);
    }
    pthread_mutex_unlock(&gs_vmm_mu);
    if (backed) {
        char a[32];
        GS_INFO("backed %s allocated while waiting", gs_format_size(backed, a, sizeof a));
    }
}

int gs_vmm_precopy(CUdevice dev, uint64_t *bytes_copied, uint64_t *micros)
{
    double t0 = gs_now();
    *bytes_copied = *micros = 0;
    if (!gs_vmm_drv.ok)
        return 0;
    pthread_mutex_lock(&gs_vmm_mu);
    uint64_t copied = 0, calls = gs_total_gated_calls();
    struct batch bt;
    int failed = batch_open(&bt, 1) != 0;
    if (!failed && bt.stream) {
        size_t n = queue_copies_out(dev, bt.stream, bt.list, bt.events, 0, calls, &failed);
        for (size_t k = 0; k < n; k++) {
            if (wait_copy(bt.events[k], bt.stream) != CUDA_SUCCESS) {
                failed = 1;
                continue;
            }
            bt.list[k]->precopied = 1;
            bt.list[k]->precopy_mark = calls;
            copied += bt.list[k]->size;
        }
    }
    batch_close(&bt);
    gs_mem_engine_account(dev, 0, 0, 0); /* what is pre-copied changed: report it */
    pthread_mutex_unlock(&gs_vmm_mu);
    *bytes_copied = copied;
    *micros = (uint64_t)((gs_now() - t0) * 1e6);
    char b[32];
    GS_INFO("pre-copied %s of device %d to the host in %.1f ms",
            gs_format_size(copied, b, sizeof b), (int)dev, *micros / 1000.0);
    return failed ? -1 : 0;
}

void gs_vmm_prepare_staging(void)
{
    if (!gs_vmm_drv.ok)
        return;
    pthread_mutex_lock(&gs_vmm_mu);
    gs_vmm_wake_preparer_locked(); /* in the background: the caller answers the scheduler */
    pthread_mutex_unlock(&gs_vmm_mu);
}

void gs_vmm_totals(CUdevice dev, struct gs_vmm_totals *out)
{
    *out = (struct gs_vmm_totals){0};
    pthread_mutex_lock(&gs_vmm_mu);
    uint64_t calls = gs_vmm_nblocks ? gs_total_gated_calls() : 0;
    for (size_t i = 0; i < gs_vmm_nblocks; i++) {
        struct block *b = gs_vmm_blocks[i];
        if (!gs_vmm_on(b, dev))
            continue;
        out->bytes += b->size;
        out->blocks++;
        if (!b->resident)
            out->evicted += b->size;
        else if (b->ipc_pinned)
            out->ipc_pinned += b->size;
        else if (precopy_valid(b, calls))
            out->precopied_valid += b->size;
    }
    pthread_mutex_unlock(&gs_vmm_mu);
}
