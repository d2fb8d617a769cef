/*
 * Host staging: the host memory an eviction copies into and a restore copies from.
 *
 * Measured on an H100 (docs/architecture.md): D2H into registered host memory runs at 54 GB/s,
 * into fresh pageable memory at 1.4 GB/s (first touch) and 14 GB/s after; registering touched
 * pageable memory (1.8 s for 16 GiB) is 4.7x faster than allocating fresh pinned memory. So a
 * staging buffer is anonymous memory populated up front (every page touched, a piece at a time)
 * and then registered with the driver, prepared off the critical path and kept for the block's life.
 *
 * Registered memory cannot be swapped: GPUSHARE_HOST_BUDGET bounds it. Past the budget staging is
 * pageable (still populated, so copies run at the after-touch speed), said once in the log and
 * counted in status.
 *
 * On a node with a scheduler, host memory is also a node-wide budget (docs/architecture.md, "Host
 * memory is a budget"): the scheduler says how much staging this process may hold for its
 * resident memory (STAGING), and the preparer (memory/prepare.c) makes staging only up to that
 * allowance, giving back what a lowered one leaves over.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "memory.h"

typedef CUresult (*host_register_fn)(void *, size_t, unsigned int);
typedef CUresult (*host_unregister_fn)(void *);

static pthread_mutex_t staging_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t pinned_bytes, pageable_bytes, fallbacks;
static int fallback_said;
/* The scheduler's allowance for staging of resident memory (UINT64_MAX: never said) and, on the
 * thread that runs a pre-copy for the preparer, what of it is left for staging made on the way. */
static _Atomic uint64_t allowance = UINT64_MAX;
static __thread int bounded;
static __thread uint64_t bounded_room;

void gs_staging_set_allowance(uint64_t bytes)
{
    atomic_store(&allowance, bytes);
}

uint64_t gs_staging_allowance(void) { return atomic_load(&allowance); }

void gs_staging_bound(int on, uint64_t room)
{
    bounded = on;
    bounded_room = room;
}

/* The host memory the engine holds changed: the next MEMORY report says so. */
static void host_changed(void)
{
    gs_mem_changed_locked(); /* an atomic counter: gs_mem_mu is not needed for it */
    gs_client_wake();
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* Populated a piece at a time by the engine's CPU workers (memory/workers.c), in transparent
 * huge pages where the kernel has them. One MAP_POPULATE of a whole block holds the process's
 * memory-map lock for as long as it takes to fault in every page, and the program's own
 * cudaMalloc (whose mapping needs that lock) waits behind it: seen on an H100, 40 blocks of 1 GiB
 * took 11.3 s to allocate (0.015 s unshimmed) while their staging was populated one 4 KiB page at
 * a time on one thread. Huge pages make faulting in ~10x cheaper (one fault per 2 MiB) and
 * registering cheaper too (fewer pages to pin); the workers fault pieces in side by side, a batch
 * of one piece per worker at a time. */
#define PIECE (64ull << 20)

struct populate_job {
    char *p;
    uint64_t first, size; /* this batch's first piece's offset; the buffer's size */
};

static void populate_piece(void *arg, unsigned i)
{
    const struct populate_job *j = arg;
    uint64_t off = j->first + (uint64_t)i * PIECE;
    if (off >= j->size)
        return;
    uint64_t len = j->size - off < PIECE ? j->size - off : PIECE;
    if (madvise(j->p + off, len, MADV_POPULATE_WRITE) == 0)
        return;
    long page = sysconf(_SC_PAGESIZE);
    for (uint64_t b = 0; b < len; b += (uint64_t)page) /* older kernels: touch each page */
        ((volatile char *)j->p)[off + b] = 0;
}

/* Anonymous memory for size bytes, in huge pages where it can be (not populated). */
static void *mapped(uint64_t size)
{
    char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, size, MADV_HUGEPAGE); /* advice: refused where THP is off, and that is fine */
#endif
    return p;
}

static void *populated(uint64_t size)
{
    char *p = mapped(size);
    if (!p)
        return NULL;
    unsigned workers = gs_workers_count();
    for (uint64_t off = 0; off < size; off += (uint64_t)workers * PIECE) {
        struct populate_job j = {.p = p, .first = off, .size = size};
        gs_workers_run(populate_piece, &j, workers);
    }
    return p;
}

struct copy_job {
    char *dst;
    const char *src;
    uint64_t size;
};

static void copy_piece(void *arg, unsigned i)
{
    const struct copy_job *j = arg;
    uint64_t off = (uint64_t)i * PIECE;
    if (off < j->size)
        memcpy(j->dst + off, j->src + off, j->size - off < PIECE ? j->size - off : PIECE);
}

void gs_staging_copy(struct gs_staging *dst, const struct gs_staging *src)
{
    struct copy_job j = {.dst = dst->host, .src = src->host, .size = src->size};
    gs_workers_run(copy_piece, &j, (unsigned)((src->size + PIECE - 1) / PIECE));
}

int gs_staging_get_pageable(struct gs_staging *s, uint64_t size)
{
    void *host = mapped(size);
    if (!host)
        return -1;
    pthread_mutex_lock(&staging_mu);
    pageable_bytes += size;
    pthread_mutex_unlock(&staging_mu);
    *s = (struct gs_staging){.host = host, .size = size, .pinned = 0};
    host_changed();
    return 0;
}

int gs_staging_get(struct gs_staging *s, uint64_t size)
{
    if (bounded) { /* a pre-copy past the scheduler's allowance copies what has staging only */
        if (size > bounded_room)
            return -1;
        bounded_room -= size;
    }
    uint64_t budget = gs_config()->host_budget;
    pthread_mutex_lock(&staging_mu);
    int pin = pinned_bytes + size <= budget && pinned_bytes + size >= pinned_bytes;
    if (pin)
        pinned_bytes += size; /* claimed before the slow part, so two threads cannot overrun */
    pthread_mutex_unlock(&staging_mu);

    void *host = populated(size);
    if (!host) {
        if (pin) {
            pthread_mutex_lock(&staging_mu);
            pinned_bytes -= size;
            pthread_mutex_unlock(&staging_mu);
        }
        return -1;
    }
    host_register_fn reg = (host_register_fn)gs_driver_sym("cuMemHostRegister_v2");
    CUresult r = CUDA_ERROR_NOT_SUPPORTED;
    if (pin && reg)
        r = reg(host, size, GS_MEMHOSTREGISTER_PORTABLE);
    pthread_mutex_lock(&staging_mu);
    if (pin && r != CUDA_SUCCESS)
        pinned_bytes -= size;
    int is_pinned = pin && r == CUDA_SUCCESS;
    int say = 0;
    if (!is_pinned) {
        pageable_bytes += size;
        fallbacks++;
        say = !fallback_said;
        fallback_said = 1;
    }
    pthread_mutex_unlock(&staging_mu);
    if (say) {
        char a[32], b[32];
        if (pin)
            GS_WARN("cannot register host staging with the driver (error %d): evictions copy "
                    "through pageable memory, several times slower",
                    r);
        else
            GS_WARN("host staging budget GPUSHARE_HOST_BUDGET=%s is spent (%s registered): "
                    "evictions beyond it copy through pageable memory, several times slower; "
                    "raise GPUSHARE_HOST_BUDGET to keep them at the bus's speed",
                    gs_format_size(budget, a, sizeof a), gs_format_size(pinned_bytes, b, sizeof b));
    }
    *s = (struct gs_staging){.host = host, .size = size, .pinned = is_pinned};
    host_changed();
    return 0;
}

void gs_staging_put(struct gs_staging *s)
{
    if (!s->host)
        return;
    if (s->pinned) {
        host_unregister_fn unreg = (host_unregister_fn)gs_driver_sym("cuMemHostUnregister");
        if (unreg)
            unreg(s->host);
    }
    munmap(s->host, s->size);
    pthread_mutex_lock(&staging_mu);
    if (s->pinned)
        pinned_bytes -= s->size;
    else
        pageable_bytes -= s->size;
    pthread_mutex_unlock(&staging_mu);
    *s = (struct gs_staging){0};
    host_changed();
}

void gs_staging_totals(struct gs_staging_totals *out)
{
    pthread_mutex_lock(&staging_mu);
    *out = (struct gs_staging_totals){.pinned_bytes = pinned_bytes,
                                      .pageable_bytes = pageable_bytes,
                                      .budget = gs_config()->host_budget,
                                      .fallbacks = fallbacks};
    pthread_mutex_unlock(&staging_mu);
}

void gs_staging_after_fork_child(void)
{
    /* The child's copy of the parent's staging is not registered in its own (absent) context,
     * and the engine that owned it starts empty in the child. */
    pthread_mutex_init(&staging_mu, NULL);
    pinned_bytes = pageable_bytes = fallbacks = 0;
    fallback_said = 0;
    atomic_store(&allowance, UINT64_MAX); /* the child has its own scheduler connection */
    bounded = 0;
    gs_workers_after_fork_child();
}
