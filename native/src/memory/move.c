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

#include "vmm.h"

static int precopy_valid(const struct block *b, uint64_t calls)
{
    return b->precopied && b->precopy_mark == calls;
}

/* Queue block b's copy into its staging on stream s, an event after it (*ev NULL: none could be
 * made, and the stream's end is waited for instead). -1 when the driver refused the copy. */
static int queue_copy_out(struct block *b, CUstream s, CUevent *ev)
{
    *ev = NULL;
    if (gs_vmm_drv.d2h(b->staging.host, b->va, b->size, s) != CUDA_SUCCESS)
        return -1;
    if (gs_vmm_drv.event_create(ev, GS_EVENT_DISABLE_TIMING) == CUDA_SUCCESS &&
        gs_vmm_drv.event_record(*ev, s) != CUDA_SUCCESS) {
        gs_vmm_drv.event_destroy(*ev);
        *ev = NULL;
    }
    return 0;
}

/* Device dev's resident blocks that need copying into their staging, in out (blocks without
 * staging, or whose copy was refused, are left out and make *failed 1). With a stream s, each
 * copy is queued on it, an event after each in events; without (NULL), the blocks are only
 * picked, their staging made. skip_clean: blocks with a valid pre-copy need no copy (listed, no
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
        events[k] = NULL;
        if (s && queue_copy_out(b, s, &events[k]) != 0) {
            *failed = 1;
            continue;
        }
        out[k++] = b;
    }
    return k;
}

/* A copy of block b into its staging has completed: the sampled check (memory/verify.c says
 * why). A wrong one is copied again on `check`, synchronously, and checked once more. 0: the
 * staging holds the block (as far as the check sees); -1: it does not (the block must stay). */
static int settle_copy_out(struct block *b, CUstream check)
{
    uint64_t where = 0;
    int r = check ? gs_check_copy_out(b, check, &where) : 0;
    if (r <= 0)
        return r;
    int again = -1;
    if (gs_vmm_drv.d2h(b->staging.host, b->va, b->size, check) == CUDA_SUCCESS &&
        gs_vmm_drv.stream_sync(check) == CUDA_SUCCESS)
        again = gs_check_copy_out(b, check, &where);
    char a[32];
    GS_WARN("a copy of %s to host staging came back wrong (checked against the device: from "
            "byte %llu): copied again, %s",
            gs_format_size(b->size, a, sizeof a), (unsigned long long)where,
            again == 0 ? "now right" : "still wrong: the block stays on the device");
    return again == 0 ? 0 : -1;
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
    int *copied; /* a pre-copy's: whether block k's copy was queued and completed */
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
    b->copied = calloc(gs_vmm_nblocks, sizeof *b->copied);
    return b->stream && b->list && b->events && b->copied ? 0 : -1;
}

static void batch_close(struct batch *b)
{
    free(b->list);
    free(b->events);
    free(b->copied);
}

/* Set by the shim's thread around the eviction a scheduler's message asked for (lifecycle.c):
 * only that thread evicts then, and only it reads these. */
static int (*evict_stop)(void *, uint64_t);
static void *evict_stop_arg;
static uint64_t evict_freed; /* what the eviction in progress has freed */

void gs_mem_set_evict_check(int (*stop)(void *arg, uint64_t freed), void *arg)
{
    evict_stop = stop;
    evict_stop_arg = arg;
}

static int evict_unneeded(void)
{
    return evict_stop && evict_stop(evict_stop_arg, evict_freed);
}

/* The order an eviction takes device dev's blocks in: those whose pre-copy is valid first (an
 * unmap each), then the least recently used (the smallest last_use). */
static int evict_before(const struct block *a, const struct block *b, uint64_t calls)
{
    int ca = precopy_valid(a, calls), cb = precopy_valid(b, calls);
    if (ca != cb)
        return ca > cb;
    return a->last_use < b->last_use;
}

/* Device dev's evictable blocks in eviction order, as many as free `target` bytes (0: all).
 * Returns the count. */
static size_t pick_victims(CUdevice dev, uint64_t target, uint64_t calls, struct block **out)
{
    size_t n = 0;
    for (size_t i = 0; i < gs_vmm_nblocks; i++) {
        struct block *b = gs_vmm_blocks[i];
        if (!gs_vmm_on(b, dev) || !b->resident || b->ipc_pinned)
            continue; /* a pinned block is mapped by a peer process: never pulled from under it */
        size_t k = n++; /* insertion sort: a process has tens of blocks, not thousands */
        while (k > 0 && evict_before(b, out[k - 1], calls)) {
            out[k] = out[k - 1];
            k--;
        }
        out[k] = b;
    }
    uint64_t sum = 0;
    for (size_t k = 0; k < n && target; k++)
        if ((sum += out[k]->size) >= target)
            return k + 1;
    return n;
}

/* Copy block b out through the bounce ring into pageable staging (made now if it has none):
 * its staging was not ready, or is pageable past the host budget. Synchronous. */
static int copy_out_bounced(struct block *b, CUstream s)
{
    if (!b->staging.host && gs_staging_get_pageable(&b->staging, b->size) != 0)
        return -1;
    int r = gs_bounce_copy_out(b->staging.host, b->va, b->size, s, evict_unneeded);
    if (r == 1) { /* no ring: straight into pageable memory, the driver's slow path */
        if (gs_vmm_drv.d2h(b->staging.host, b->va, b->size, s) != CUDA_SUCCESS)
            return -1;
        r = gs_vmm_drv.stream_sync(s) == CUDA_SUCCESS ? 0 : -1;
    }
    return r;
}

int gs_vmm_evict(CUdevice dev, uint64_t target, uint64_t *bytes_moved, uint64_t *micros)
{
    double t0 = gs_now();
    *bytes_moved = *micros = 0;
    if (!gs_vmm_drv.ok)
        return 0;
    pthread_mutex_lock(&gs_vmm_mu);
    gs_vmm_wait_copies_locked(NULL); /* a pre-copy in flight: its blocks then need no copy */
    uint64_t freed = 0, copied = 0, bounced = 0, calls = gs_total_gated_calls();
    int stopped = 0;
    struct batch bt;
    int failed = batch_open(&bt, 0) != 0;
    if (!failed && bt.stream) {
        size_t n = pick_victims(dev, target, calls, bt.list);
        if (target) {
            char a[32];
            GS_INFO("partial eviction: %s asked, %zu block(s) picked",
                    gs_format_size(target, a, sizeof a), n);
        }
        /* Blocks with registered staging: every copy queued now, each with its event, so the
         * copy engine never idles between blocks while earlier ones are unmapped. */
        for (size_t k = 0; k < n; k++) {
            struct block *b = bt.list[k];
            bt.copied[k] = !precopy_valid(b, calls) && b->staging.pinned;
            if (bt.copied[k] && queue_copy_out(b, bt.stream, &bt.events[k]) != 0) {
                bt.list[k] = NULL; /* refused: the block stays resident, its data intact */
                failed = 1;
            }
        }
        evict_freed = 0;
        CUstream check = gs_vmm_move_stream(1);
        size_t k = 0;
        for (; k < n && !(stopped = k > 0 && evict_unneeded()); k++) {
            struct block *b = bt.list[k];
            if (!b)
                continue;
            int r = 0, clean = precopy_valid(b, calls);
            if (bt.copied[k])
                r = wait_copy(bt.events[k], bt.stream) == CUDA_SUCCESS ? 0 : -1;
            else if (!clean) {
                r = copy_out_bounced(b, bt.stream);
                bounced += r == 0 ? b->size : 0;
            }
            if (r == 2) { /* stopped inside a bounced block: it stays resident, intact */
                stopped = 1;
                k++;
                break;
            }
            /* Checked on the other stream: this one still runs the next blocks' copies. */
            if (r == 0 && !clean && settle_copy_out(b, check) != 0)
                r = -1;
            if (r != 0) {
                failed = 1; /* the copy failed: the block stays resident, its data intact */
                continue;
            }
            /* Only now, the copy complete: unmapping first loses what the copy had not read. */
            if (gs_verify_on())
                gs_verify_before_unmap(b, bt.stream);
            gs_vmm_unback(b);
            copied += clean ? 0 : b->size;
            b->precopied = 0;
            freed += b->size;
            evict_freed = freed;
        }
        if (stopped) { /* the blocks left: their queued copies finish, nothing else happens */
            gs_vmm_drv.stream_sync(bt.stream);
            for (; k < n; k++)
                if (bt.list[k] && bt.copied[k] && bt.events[k])
                    gs_vmm_drv.event_destroy(bt.events[k]);
        }
    }
    batch_close(&bt);
    gs_mem_engine_account(dev, 0, 0, (int64_t)freed);
    pthread_mutex_unlock(&gs_vmm_mu);
    *bytes_moved = copied;
    *micros = (uint64_t)((gs_now() - t0) * 1e6);
    if (stopped) {
        char a[32];
        GS_INFO("eviction stopped, no longer needed: %s moved off the device stays off it",
                gs_format_size(freed, a, sizeof a));
    }
    if (bounced) {
        char a[32];
        GS_INFO("evicted %s through the bounce ring (staging not ready)",
                gs_format_size(bounced, a, sizeof a));
    }
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
        b->last_use = ++gs_vmm_use_clock; /* restored for this turn: the most recently used */
        if (b->unbacked) {
            b->unbacked = 0; /* never written: nothing to copy back */
            backed += b->size;
            continue;
        }
        if (gs_verify_on())
            gs_verify_before_restore(b);
        if (gs_vmm_drv.h2d(b->va, b->staging.host, b->size, s) != CUDA_SUCCESS) {
            gs_vmm_unback(b);
            failed = 1;
            break;
        }
        if (gs_verify_on() && gs_vmm_drv.stream_sync(s) == CUDA_SUCCESS)
            gs_verify_after_restore(b, s);
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

/* The program's work launched before the pre-copy was asked may still be queued or running on
 * its own streams: a cell returns once its kernels and copies are launched, and the scheduler
 * asks for the pre-copy at the cell's end. The pre-copy's stream is non-blocking, so without a
 * wait it reads memory that work has not written yet, and nothing tells: no gated call comes
 * after it, and the check reads back the same stale device memory. The eviction then trusts the
 * copy (an unmap) and the data is lost. So every context holding one of the blocks finishes its
 * work first (for a kernel idle since its last call, at once). */
#define PRECOPY_MAX_CONTEXTS 16

static int precopy_wait_for_the_program(struct block *const *list, size_t n)
{
    CUcontext done[PRECOPY_MAX_CONTEXTS];
    size_t ndone = 0;
    int failed = 0;
    for (size_t k = 0; k < n; k++) {
        CUcontext ctx = list[k]->ctx;
        int seen = 0;
        for (size_t i = 0; i < ndone && !seen; i++)
            seen = done[i] == ctx;
        if (seen)
            continue;
        if (ndone < PRECOPY_MAX_CONTEXTS)
            done[ndone++] = ctx;
        CUresult r = gs_vmm_drv.ctx_push(ctx);
        if (r == CUDA_SUCCESS) {
            r = gs_vmm_drv.ctx_sync();
            CUcontext popped;
            gs_vmm_drv.ctx_pop(&popped);
        }
        if (r != CUDA_SUCCESS) {
            GS_WARN("cannot wait for the program's work before a pre-copy (error %d): "
                    "nothing is pre-copied this time",
                    r);
            failed = 1;
        }
    }
    return failed;
}

/* The blocks are picked under the lock, their copies queued and waited for without it: a
 * pre-copy of 14 GiB takes 0.3 s on an H100 (seconds on the stand-in's memcpy), and the lock
 * guards every allocation, free and memory report; holding it that long made a request for the
 * device wait behind the pre-copy (0.5 s seen on the stand-in). */
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
    size_t n = 0;
    if (!failed && bt.stream) {
        n = queue_copies_out(dev, NULL, bt.list, bt.events, 0, calls, &failed); /* picked only */
        for (size_t k = 0; k < n; k++)
            bt.list[k]->copying = 1;
        gs_vmm_copies_begin_locked(n);
    }
    pthread_mutex_unlock(&gs_vmm_mu);
    /* After `calls` was read: work the program launches from now on is a gated call, which
     * makes this copy stale; what it launched before is finished here. */
    int waited = precopy_wait_for_the_program(bt.list, n) == 0;
    /* Queued without the lock too: a driver may copy before the call returns (the stand-in's
     * memcpy does). The blocks marked copying are neither freed nor unmapped meanwhile. A copy
     * that might be stale is not made: an eviction then copies. */
    for (size_t k = 0; k < n; k++)
        bt.copied[k] = waited && queue_copy_out(bt.list[k], bt.stream, &bt.events[k]) == 0;
    for (size_t k = 0; k < n; k++)
        if (bt.copied[k])
            bt.copied[k] = wait_copy(bt.events[k], bt.stream) == CUDA_SUCCESS;
    /* Every copy done, so the checks read on the same stream. A gated call meanwhile makes the
     * pre-copy stale anyway (and the device may differ for that reason): not checked then. */
    for (size_t k = 0; k < n; k++)
        if (bt.copied[k] && gs_total_gated_calls() == calls)
            bt.copied[k] = settle_copy_out(bt.list[k], bt.stream) == 0;
    pthread_mutex_lock(&gs_vmm_mu);
    for (size_t k = 0; k < n; k++) {
        struct block *b = bt.list[k];
        int spoiled = b->copy_spoiled;
        b->copying = b->copy_spoiled = 0;
        failed |= !bt.copied[k];
        if (!bt.copied[k] || spoiled)
            continue;
        b->precopied = 1;
        b->precopy_mark = calls; /* a gated call made meanwhile has already spoiled it */
        copied += b->size;
    }
    gs_vmm_copies_end_locked(n);
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

static void totals_locked(CUdevice dev, struct gs_vmm_totals *out)
{
    *out = (struct gs_vmm_totals){0};
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
}

void gs_vmm_totals(CUdevice dev, struct gs_vmm_totals *out)
{
    pthread_mutex_lock(&gs_vmm_mu);
    totals_locked(dev, out);
    pthread_mutex_unlock(&gs_vmm_mu);
}

int gs_vmm_totals_try(CUdevice dev, struct gs_vmm_totals *out)
{
    if (pthread_mutex_trylock(&gs_vmm_mu) != 0)
        return -1;
    totals_locked(dev, out);
    pthread_mutex_unlock(&gs_vmm_mu);
    return 0;
}
