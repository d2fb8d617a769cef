/*
 * The memory engine's internal interface: memory.c keeps the quota, the allocation table and the
 * process's view; memory/vmm.c owns explicit device memory (reserved virtual ranges backed by
 * physical allocations) and moves it between the device and host staging; memory/staging.c owns
 * the host staging and its budget. Lock order: the engine's lock, then memory.c's.
 */
#ifndef GPUSHARE_MEMORY_H
#define GPUSHARE_MEMORY_H

#include <stdint.h>

#include "api.h"
#include "base/shim.h"
#include "client.h"

/* ---- the driver's virtual memory management ABI (cuda.h 12.x/13.x layouts) ---- */

enum { GS_MEM_ALLOCATION_TYPE_PINNED = 1, GS_MEM_HANDLE_TYPE_NONE = 0, GS_MEM_HANDLE_TYPE_POSIX_FD = 1 };
enum { GS_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 };
enum { GS_MEM_ALLOC_GRANULARITY_MINIMUM = 0 };
enum { GS_MEMHOSTREGISTER_PORTABLE = 1 };
enum { GS_EVENT_DISABLE_TIMING = 2 };

struct CUmemAllocationProp_st {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
};

typedef struct gs_mem_access_desc {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} gs_mem_access_desc;

/* ---- memory/account.c: each device's account, quota and pool; the process's view ---- */

/* One device's account (under gs_mem_mu). */
struct gs_mem_account {
    uint64_t managed, pinned_alloc, evicted, reserved; /* the table's allocations */
    uint64_t engine, engine_evicted; /* explicit memory (memory/vmm.c) */
    uint64_t context;                /* the estimate, once the process has a context there */
    uint64_t driver_reserve;         /* pools' reserves and graph memory (memory/reserves.c) */
    uint64_t quota, pool;            /* this device's registration's */
    uint64_t room; /* the current grant's room_bytes (0: no limit): see gs_mem_past_room_on */
    /* Device bytes the driver refused although the room said they fit (the card fuller than
     * the pool's accounting): the next REQUEST says so (short_bytes); a grant clears it. */
    uint64_t short_bytes;
};
/* Guards the accounts and the allocation table (lock order: the engine's lock, then this). */
extern pthread_mutex_t gs_mem_mu;
extern struct gs_mem_account gs_mem_acct[GS_MEM_DEVICES];
void gs_mem_changed_locked(void);
/* gs_mem_slot() of the current context's device (0 when none is current). */
int gs_mem_current_slot(void);
/* Reserve bytes on device `dev` against its quota and pool; on refusal logs the one line that
 * says why and returns CUDA_ERROR_OUT_OF_MEMORY. Without _on: on the current context's device. */
CUresult gs_mem_reserve_on(CUdevice dev, uint64_t size);
void gs_mem_unreserve_on(CUdevice dev, uint64_t size);
/* Whether device `dev`'s backed memory (what it holds there, less what is on the host, plus the
 * reservations in flight: the new block's included) is past the room its grant gave it. 0 when
 * the grant set no room. */
int gs_mem_past_room_on(CUdevice dev, uint64_t *backed, uint64_t *room);
/* Whether the process holds `dev` under a grant that gave it a room (a scheduler that weighs
 * memory): there, a driver out-of-memory is a wait for room, never an error (memory/defer.c). */
int gs_mem_has_room_on(CUdevice dev);
/* The driver refused `wanted` bytes on `dev` with `driver_free` free: note the shortfall. */
void gs_mem_note_short(CUdevice dev, uint64_t wanted, uint64_t driver_free);
CUresult gs_mem_reserve(uint64_t size);
void gs_mem_unreserve(uint64_t size);
/* Drop `reserved` from device `dev`'s reservations, then change its explicit memory's counted
 * bytes by `total_delta` and its evicted bytes by `evicted_delta`. */
void gs_mem_engine_account(CUdevice dev, uint64_t reserved, int64_t total_delta,
                           int64_t evicted_delta);
/* The accounts' part of gs_mem_totals_dev (memory.c adds the engine's and the staging's); adds
 * into *out. dev GS_MEM_ALL_DEVICES: every device's sums, and the largest quota and pool of
 * the devices the process has a context on. */
void gs_mem_account_totals(CUdevice dev, struct gs_mem_totals *out);
/* The process's view of the current context's device: total (quota, else pool, else
 * real_total), free and used. */
void gs_mem_view(uint64_t real_total, uint64_t *total, uint64_t *free_out, uint64_t *used_out);
void gs_mem_account_after_fork_child(void);

/* ---- memory/table.c: the allocation table ---- */

enum { NS_EMPTY = 0, NS_PTR = 1, NS_HANDLE = 2, NS_ARRAY = 3, NS_MAP = 4 };
enum {
    KIND_MANAGED = 0, /* cuMemAllocManaged, or cuMemAlloc made managed: evictable */
    KIND_DEVICE = 1,  /* plain device memory (GPUSHARE_MEMORY=device): counted, pinned */
    KIND_POOL = 2,    /* stream-ordered pools: pinned */
    KIND_HANDLE = 3,  /* cuMemCreate handles: pinned until cuMemRelease */
    KIND_ENGINE = 4,  /* explicit memory: counted by memory/vmm.c, never in the table */
    KIND_MAP = 5      /* a mapping of a counted handle: not counted itself */
};

/* A reservation for an allocation the table will record: bytes and a table slot, on the current
 * context's device (_on: on device `dev`, for memory made on a device named by the caller). */
CUresult gs_memtab_reserve(uint64_t size);
void gs_memtab_unreserve(uint64_t size);
CUresult gs_memtab_reserve_on(CUdevice dev, uint64_t size);
void gs_memtab_unreserve_on(CUdevice dev, uint64_t size);
/* Settle a reservation once the driver has answered: a success becomes a counted allocation
 * under *key, a failure gives the reservation back. Returns r. */
CUresult gs_memtab_settle(CUresult r, uint64_t reserved, const unsigned long long *key,
                          uint8_t ns, uint64_t size, uint8_t kind);
CUresult gs_memtab_settle_on(CUdevice dev, CUresult r, uint64_t reserved,
                             const unsigned long long *key, uint8_t ns, uint64_t size,
                             uint8_t kind);
void gs_memtab_uncount(uint64_t key, uint8_t ns);
/* The program's own VMM handles: counted until released by every holder (cuMemRelease after
 * cuMemCreate and each cuMemRetainAllocationHandle) and unmapped everywhere. */
void gs_memtab_handle_retained(uint64_t handle);
void gs_memtab_handle_released(uint64_t handle);
void gs_memtab_handle_mapped(uint64_t handle, uint64_t ptr, uint64_t size);
void gs_memtab_range_unmapped(uint64_t ptr, uint64_t size);
struct gs_span {
    uint64_t ptr, size;
};
/* Device `dev`'s managed allocations whose evicted flag equals `evicted` (malloc'd copy). */
struct gs_span *gs_memtab_managed_spans(CUdevice dev, int evicted, size_t *count);
uint64_t gs_memtab_mark_moved(const struct gs_span *spans, const unsigned char *ok, size_t n,
                              int to_host);
void gs_memtab_after_fork_child(void);
void gs_memtab_forget_context(CUcontext ctx);
/* Memory the driver keeps for the process on device `dev` outside the table (pool reserves,
 * graph memory: memory/reserves.c): counted as pinned on that device's account, against its
 * quota. Replaces the last. */
enum { GS_RESERVE_DEVICES = 64 };
void gs_memtab_set_driver_reserve(CUdevice dev, uint64_t bytes);

/* ---- memory/reserves.c: what pools and graph memory hold for the process, per device ---- */

/* After cuMemFreeAsync (memory.c): ask what the pool keeps. */
void gs_reserves_after_free(void);
/* Ask the driver about every device the process used pools or graphs on (at idle). */
void gs_reserves_refresh(void);
void gs_reserves_refresh_device(CUdevice dev);
/* Reserve against the quota what `need` more bytes of graph memory on `dev` add beyond the
 * graph pool's idle memory; *held: bytes to gs_mem_unreserve once counted or given up. */
CUresult gs_reserves_graph_reserve(CUdevice dev, uint64_t need, uint64_t *held);
void gs_reserves_release(CUdevice dev, uint64_t held);
void gs_reserves_graph_launched(CUdevice dev, uint64_t need, uint64_t net);
void gs_reserves_context_gone(void);
void gs_reserves_after_fork_child(void);
/* memory/graphs.c */
void gs_graphs_after_fork_child(void);
/* cuMemFree / cuMemFreeAsync of `dptr`: 1 when it is an allocation of a graph that never ran
 * (its launch refused, or never made): it has no memory, nothing to free (forgotten here). */
int gs_graphs_free_unbacked(CUdeviceptr dptr);

/* ---- memory/staging.c: host memory that copies run from/to at the bus's speed ---- */

struct gs_staging {
    void *host;
    uint64_t size;
    int pinned; /* registered with the driver (counted in the budget) */
};
/* Prepare host memory for `size` bytes: registered while the budget lasts, else pageable (said
 * once in the log and counted). Returns 0, or -1 when the host has no memory at all. */
int gs_staging_get(struct gs_staging *s, uint64_t size);
/* Host memory for `size` bytes at once: mapped, neither populated nor registered (counted as
 * pageable); what an eviction copies into through the bounce ring when a block's staging is not
 * ready. */
int gs_staging_get_pageable(struct gs_staging *s, uint64_t size);
/* Copy src's contents into dst (same size) on the engine's CPU workers. */
void gs_staging_copy(struct gs_staging *dst, const struct gs_staging *src);
void gs_staging_put(struct gs_staging *s);
struct gs_staging_totals {
    uint64_t pinned_bytes, pageable_bytes, budget, fallbacks;
};
void gs_staging_totals(struct gs_staging_totals *out);
/* The scheduler's allowance for staging of resident memory (STAGING; UINT64_MAX: none said). */
void gs_staging_set_allowance(uint64_t bytes);
uint64_t gs_staging_allowance(void);
/* On the calling thread, while `on`: gs_staging_get refuses staging past `room` bytes in all (a
 * pre-copy copies only what the allowance has staging for). */
void gs_staging_bound(int on, uint64_t room);
void gs_staging_after_fork_child(void);

/* ---- memory/workers.c: CPU threads for bulk host work ---- */

/* Run fn(arg, i) for i in [0, n) on the workers and the calling thread; returns when all ran. */
void gs_workers_run(void (*fn)(void *, unsigned), void *arg, unsigned n);
/* How many threads a batch runs on (GPUSHARE_STAGING_THREADS, the caller included). */
unsigned gs_workers_count(void);
void gs_workers_after_fork_child(void);
/* memory/bounce.c (its interface is the engine's own, in memory/vmm.h) */
void gs_bounce_after_fork_child(void);

/* ---- memory/vmm.c: the explicit engine ---- */

/* cudaMalloc's memory, explicit. CUDA_ERROR_NOT_SUPPORTED when the driver lacks the VMM API (the
 * caller falls back). Counted against the quota (granularity-rounded; small allocations share
 * granularity-sized chunks, each chunk counted once). */
CUresult gs_vmm_alloc(CUdeviceptr *dptr, size_t bytes);
/* 1 when dptr is the engine's (freed, *r the result), 0 when it is not. */
int gs_vmm_free(CUdeviceptr dptr, CUresult *r);
/* The allocation containing p, as cuMemGetAddressRange answers. 1 when p is the engine's. */
int gs_vmm_range(CUdeviceptr p, CUdeviceptr *base, size_t *size);
/* Copy out and unmap blocks of device `dev` until `target` bytes are off the device (0: every
 * block; pre-copied blocks first, then the least recently used) / map and copy back every evicted
 * block (its own physical memory, at its own address). A context of `dev` must be current.
 * *bytes_moved: what was copied (an unmap of a pre-copied block copies nothing). */
int gs_vmm_evict(CUdevice dev, uint64_t target, uint64_t *bytes_moved, uint64_t *micros);
int gs_vmm_restore(CUdevice dev, uint64_t *bytes_moved, uint64_t *micros);
/* Copy device `dev`'s resident blocks to staging at low priority, leaving them resident; valid
 * until the next gated call. */
int gs_vmm_precopy(CUdevice dev, uint64_t *bytes_copied, uint64_t *micros);
/* Prepare staging for every block that has none (off the critical path: on idle). */
void gs_vmm_prepare_staging(void);
/* memory/prepare.c: the background thread that prepares staging and runs pre-copies. */
void gs_vmm_preparer_start(void);
/* A pre-copy of device `dev`'s blocks in the background, after every block's staging is ready;
 * progress shows in gs_vmm_totals (precopied_valid). */
void gs_vmm_precopy_async(CUdevice dev);
void gs_vmm_prepare_after_fork_child(void);
/* The staging held for resident blocks (what an eviction of them copies into without taking
 * more host memory). Waits for the engine's lock. */
uint64_t gs_vmm_resident_staging(void);
/* The scheduler's allowance changed: the preparer makes staging up to it, or gives back what
 * it holds past it for resident blocks. */
void gs_vmm_staging_allowance_changed(void);
struct gs_vmm_totals {
    uint64_t bytes, evicted, precopied_valid, blocks;
    uint64_t ipc_pinned; /* resident blocks pinned for CUDA IPC: not evictable */
};
/* Device `dev`'s blocks (GS_MEM_ALL_DEVICES: every device's). */
void gs_vmm_totals(CUdevice dev, struct gs_vmm_totals *out);
/* The same without waiting: -1 while another thread holds the engine's lock (an eviction, a
 * restore or a pre-copy holds it for as long as it copies: seconds for many GiB). */
int gs_vmm_totals_try(CUdevice dev, struct gs_vmm_totals *out);
/* From now on, new blocks on `dev` get no physical memory until gs_vmm_back_deferred(dev), which
 * backs them (and stops deferring there) before the gate opens. */
void gs_vmm_defer_backing(CUdevice dev);
void gs_vmm_back_deferred(CUdevice dev, int granted);
/* Clear and return which of `bits` (device slots) gave up waiting for room (memory/defer.c):
 * the program's call's copy and the shim thread's copy. */
unsigned gs_vmm_take_hopeless(unsigned bits);
unsigned gs_vmm_take_given_up(unsigned bits);
unsigned gs_vmm_hopeless_bits(void);
/* The slots whose memory went past the grant's room (memory/api.h, gs_mem_past_room). */
unsigned gs_vmm_past_room_bits(void);
/* Forget the blocks of a destroyed context (their memory went with it); NULL: only the streams. */
void gs_vmm_forget_context(CUcontext ctx);
void gs_vmm_after_fork_child(void);

#endif /* GPUSHARE_MEMORY_H */
