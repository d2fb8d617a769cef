/*
 * The explicit engine's internals, shared by memory/vmm.c (blocks: allocation, free, lookup),
 * memory/move.c (eviction, restore, pre-copy) and the files that work on their blocks:
 * memory/defer.c, prepare.c, verify.c, bounce.c and ipc.c. Nothing else includes this file.
 */
#ifndef GPUSHARE_MEMORY_VMM_H
#define GPUSHARE_MEMORY_VMM_H

#include "memory.h"

#define UNIT 512u
#define CHUNK_UNITS_MAX 8192u /* up to 4 MiB chunks */
#define MAX_BLOCKS_GROWTH 256u

struct chunk {
    unsigned units, used;
    uint16_t len[CHUNK_UNITS_MAX]; /* at an allocation's first unit: its length in units */
};

struct block {
    CUdeviceptr va;
    uint64_t size;      /* reserved = mapped = physical */
    uint64_t requested; /* what the program asked for (own blocks) */
    CUdevice dev;
    CUcontext ctx;
    CUmemGenericAllocationHandle handle; /* 0 while evicted */
    int resident;
    int precopied;         /* staging holds the contents as of precopy_mark */
    int preparing;         /* memory/prepare.c is making its staging */
    int staging_tried;     /* memory/prepare.c made (or failed to make) staging for it once */
    double made_at;        /* gs_now() when it was made (the log says how long staging took) */
    uint64_t id;           /* unique for the process's life: found again after the lock was let go */
    uint64_t precopy_mark; /* gs_total_gated_calls() when the pre-copy started */
    uint64_t last_use;     /* gs_vmm_use_clock when it was made, restored or backed: a partial
                            * eviction takes the smallest first (memory/move.c) */
    int copying;           /* a pre-copy reads it, gs_vmm_mu let go: not freed or unmapped */
    int copy_spoiled;      /* an allocation was carved into it meanwhile: that copy is not whole */
    struct gs_staging staging;
    struct chunk *chunk; /* NULL: one allocation owns the block */
    /* CUDA IPC (memory/ipc.c): pinned from cuIpcGetMemHandle until its last importer is gone;
     * eviction and pre-copy skip a pinned block. */
    uint64_t verify_sum; /* GPUSHARE_VERIFY_MOVES: its staging's checksum at its eviction */
    int verify_summed;
    int unbacked; /* made while the process waited for the device: no physical memory yet, and
                   * nothing to copy back; the grant backs it (gs_vmm_back_deferred) */
    int ipc_pinned;
    unsigned ipc_importers;
    uint8_t ipc_key[16];
};

typedef CUresult (*reserve_fn)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*addr_free_fn)(CUdeviceptr, size_t);
typedef CUresult (*map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                           unsigned long long);
typedef CUresult (*unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*access_fn)(CUdeviceptr, size_t, const gs_mem_access_desc *, size_t);
typedef CUresult (*gran_fn)(size_t *, const CUmemAllocationProp *, int);
typedef CUresult (*ctx_dev_fn)(CUdevice *);
typedef CUresult (*ctx_cur_fn)(CUcontext *);
typedef CUresult (*ctx_push_fn)(CUcontext);
typedef CUresult (*void_fn)(void);
typedef CUresult (*stream_prio_fn)(CUstream *, unsigned int, int);
typedef CUresult (*prio_range_fn)(int *, int *);
typedef CUresult (*stream_fn)(CUstream);
typedef CUresult (*event_create_fn)(CUevent *, unsigned int);
typedef CUresult (*event_record_fn)(CUevent, CUstream);
typedef CUresult (*event_fn)(CUevent);
typedef CUresult (*d2h_fn)(void *, CUdeviceptr, size_t, CUstream);
typedef CUresult (*h2d_fn)(CUdeviceptr, const void *, size_t, CUstream);
typedef CUresult (*meminfo_fn)(size_t *, size_t *);

struct gs_vmm_driver {
    reserve_fn reserve;
    addr_free_fn addr_free;
    map_fn map;
    unmap_fn unmap;
    access_fn access;
    gran_fn gran;
    ctx_dev_fn ctx_dev;
    ctx_cur_fn ctx_cur;
    ctx_push_fn ctx_push; /* a block's context, on a thread that has none (the shim's own) */
    ctx_cur_fn ctx_pop;
    void_fn ctx_sync;
    stream_prio_fn stream_create;
    prio_range_fn prio_range;
    stream_fn stream_sync;
    event_create_fn event_create;
    event_record_fn event_record;
    event_fn event_sync, event_destroy;
    d2h_fn d2h;
    h2d_fn h2d;
    meminfo_fn meminfo;
    int ok;
};
extern struct gs_vmm_driver gs_vmm_drv;

/* memory/verify.c: GPUSHARE_VERIFY_MOVES, a diagnostic that checks each move (under gs_vmm_mu, on
 * the moving thread, the block's context current; s: a stream to read back on). */
int gs_verify_on(void);
/* The sampled check of a copy into b's staging that has completed (memory/verify.c says why):
 * 0 right as far as it sees (or the check is off), 1 wrong (*where: the first wrong window's
 * offset), -1 the device could not be read back. */
int gs_check_copy_out(const struct block *b, CUstream s, uint64_t *where);
void gs_verify_before_unmap(struct block *b, CUstream s);
void gs_verify_before_restore(struct block *b);
void gs_verify_after_restore(struct block *b, CUstream s);

/* Guards everything below; moves hold it for their whole length. */
extern pthread_mutex_t gs_vmm_mu;
extern struct block **gs_vmm_blocks; /* sorted by va */
extern size_t gs_vmm_nblocks;
/* Ticks at each block made, restored or backed (under gs_vmm_mu): the blocks' recency. */
extern uint64_t gs_vmm_use_clock;

CUresult gs_vmm_back(struct block *b);
/* The block containing p, or NULL (under gs_vmm_mu). */
struct block *gs_vmm_find(CUdeviceptr p);
/* Load the driver's VMM functions once; 1 when the engine can run. */
int gs_vmm_driver_ready(void);
/* 1 while cuMemCreate accepts POSIX file descriptor handles (blocks can be exported). */
extern int gs_vmm_exportable;
/* Bit gs_mem_slot(dev) set while the process waits for device dev: new blocks there get their
 * address range but no physical memory until the grant (so a waiter's memory never needs
 * evicting). Read under gs_vmm_mu. */
extern atomic_uint gs_vmm_defer;
/* Bit gs_mem_slot(dev) set from the moment a block on dev went past the grant's room (memory/
 * vmm.c: left unbacked, gate held shut for dev) until gs_vmm_back_deferred(dev) backs it. */
extern atomic_uint gs_vmm_past_room;
/* 1 when block b counts on device dev's account (dev GS_MEM_ALL_DEVICES: every block). */
static inline int gs_vmm_on(const struct block *b, CUdevice dev)
{
    return dev == GS_MEM_ALL_DEVICES || gs_mem_slot(b->dev) == gs_mem_slot(dev);
}
void gs_vmm_unback(struct block *b);
/* Streams for moves, in the current context (recreated when the context changes). NULL when the
 * driver refuses. */
CUstream gs_vmm_move_stream(int low_priority);
void gs_vmm_forget_streams(void);

/* The background preparer (memory/prepare.c) waits on this condition (with gs_vmm_mu) for
 * blocks without staging, or for a pre-copy wanted (bit gs_mem_slot(dev) of each device that
 * wants one). Waking it is data, not a call into it, so the files below it can ask for work.
 * Under gs_vmm_mu. */
extern pthread_cond_t gs_vmm_prepare_cv;
extern int gs_vmm_prepare_pending;
extern unsigned gs_vmm_precopy_wanted;
/* gs_total_gated_calls() when each device slot's pre-copy was asked for: the staging thread drops
 * it if the program made a gated call since (its idle ended: the copy would be stale at once). */
extern uint64_t gs_vmm_precopy_asked_at[GS_MEM_DEVICES];
/* gs_now() when a block was last made or freed (under gs_vmm_mu): the preparer waits for the
 * program's allocations to pause before it populates and registers host memory. */
extern double gs_vmm_last_change;
void gs_vmm_wake_preparer_locked(void);

/* A pre-copy copies with gs_vmm_mu let go (the program and the shim's thread need the lock while
 * a large copy runs), its blocks marked `copying`. What would free, unmap or overwrite a block's
 * memory or staging first waits here (under gs_vmm_mu): for block b, or for every block (NULL). */
void gs_vmm_wait_copies_locked(const struct block *b);
/* The pre-copy marked n blocks copying / cleared them (wakes the waiters). */
void gs_vmm_copies_begin_locked(size_t n);
void gs_vmm_copies_end_locked(size_t n);

/* memory/bounce.c: the pinned ring an eviction copies through when a block's staging is not
 * ready. gs_bounce_prepare makes it (a context current); gs_bounce_copy_out copies size bytes at
 * src into dst (pageable) on stream s and returns 0 once they are there, 1 when there is no ring
 * (nothing done), 2 when stop() said 1 between slots (the copy is incomplete), -1 when a copy
 * failed. */
void gs_bounce_prepare(void);
int gs_bounce_copy_out(void *dst, CUdeviceptr src, uint64_t size, CUstream s, int (*stop)(void));
uint64_t gs_bounce_total(void);

#endif /* GPUSHARE_MEMORY_VMM_H */
