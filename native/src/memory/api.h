/*
 * The memory engine's API: what the doors (hooks/) and the client call (gs_mem_*). The engine's
 * own declarations are in memory.h; what it needs from the client, in client.h.
 */
#ifndef GPUSHARE_MEMORY_API_H
#define GPUSHARE_MEMORY_API_H

#include <stdint.h>

#include "base/cuda_abi.h"


struct gs_mem_totals {
    uint64_t used;    /* everything, context estimate included */
    uint64_t managed; /* evictable */
    uint64_t pinned;  /* context, pools and what they keep, graph memory, cuMemCreate, device */
    uint64_t evicted; /* managed bytes now on the host */
    uint64_t quota;
    uint64_t pool;
    uint64_t precopied;        /* resident bytes whose host copy is current: evicting is an unmap */
    uint64_t staging_pinned;   /* host staging registered with the driver (GPUSHARE_HOST_BUDGET) */
    uint64_t staging_pageable; /* host staging past the budget: pageable, slower copies */
    uint64_t staging_fallbacks; /* staging buffers that fell back to pageable memory */
    uint64_t short_bytes; /* device bytes the driver refused beyond the room (REQUEST's field) */
    /* Host memory (the node's budget, docs/protocol.md): all the engine holds on the host
     * (staging, pageable copies, the bounce ring), and the staging of resident blocks in it. */
    uint64_t host_bytes;
    uint64_t staging_resident; /* gs_mem_totals_dev only (it waits for the engine's lock) */
};
/* The memory engine keeps one account per device (docs/architecture.md, "Several devices"):
 * ordinals 0..GS_MEM_DEVICES-1 each have their own; a higher one shares the last (the session
 * registers GS_MAX_LINKS + 1 = 8 devices at most). */
#define GS_MEM_DEVICES 8
#define GS_MEM_ALL_DEVICES ((CUdevice)-1)
static inline int gs_mem_slot(CUdevice dev)
{
    return dev >= 0 && dev < GS_MEM_DEVICES ? (int)dev : GS_MEM_DEVICES - 1;
}
/* Every device's memory together, never waiting for a move in flight (the status API: the wait
 * line polls it while this process's memory moves). During a move the engine's part (precopied,
 * IPC-pinned) is the last one read; the accounts' part (used, evicted, ...) is current. */
void gs_mem_totals_now(struct gs_mem_totals *out);
/* Device `dev`'s memory: what its registration reports (GS_MEM_ALL_DEVICES: every device's). */
void gs_mem_totals_dev(CUdevice dev, struct gs_mem_totals *out);
/* Each device's registration sets that device's quota and pool. */
void gs_mem_set_quota(CUdevice dev, uint64_t quota);
void gs_mem_set_pool(CUdevice dev, uint64_t pool);
/* The process has a context on `dev`: its estimate counts there (once per device). */
void gs_mem_count_context(CUdevice dev);
/* Generation counter bumped on every change, for the coalesced MEMORY report. */
uint64_t gs_mem_generation(void);
/* Move device `dev`'s movable memory to the host / back to `dev` (each allocation to the device
 * it was made on). A context of `dev` must be current on the calling thread. */
/* The next gs_mem_evict of `dev` frees at least `bytes` (0: everything; the scheduler's
 * evict_bytes), then the target is forgotten. */
void gs_mem_set_evict_target(CUdevice dev, uint64_t bytes);
/* While set, an eviction asks stop(arg, bytes freed so far) between blocks (and between a
 * bounced block's slots): 1 = no longer needed, stop, keeping what was moved (memory/move.c). */
void gs_mem_set_evict_check(int (*stop)(void *arg, uint64_t freed), void *arg);
int gs_mem_evict(CUdevice dev, uint64_t *bytes_moved, uint64_t *micros);
int gs_mem_restore(CUdevice dev, uint64_t *bytes_moved, uint64_t *micros);
/* Copy device `dev`'s resident explicit memory to the host at low priority, leaving it resident
 * (PRECOPY): in the background; progress shows in gs_mem_totals_dev(dev).precopied. */
void gs_mem_precopy_async(CUdevice dev);
/* The process stopped holding device `dev`: explicit memory it allocates there from now on gets
 * its address but no physical memory until gs_mem_back_deferred(dev), which the grant calls
 * before the gate opens (and every path that lets the process run: GS_MEM_ALL_DEVICES). */
void gs_mem_defer_backing(CUdevice dev);
void gs_mem_back_deferred(CUdevice dev);
/* The same at a grant of `dev` (after its restore): memory the driver has no room for (the card
 * fuller than the pool's accounting) keeps the gate held for `dev` and is asked for again, the
 * REQUEST saying how much the driver lacked (issue 34; memory/defer.c). */
void gs_mem_back_granted(CUdevice dev);
/* Whether `dev` gave up waiting for room after several grants without progress (cleared by the
 * call): the gated call that asks fails with out of memory, the next one tries again. */
int gs_mem_take_hopeless(CUdevice dev);
int gs_mem_hopeless(CUdevice dev); /* the same, without clearing it */
/* The same news for the shim's thread (its own copy, cleared by it): it must not ask again. */
int gs_mem_take_given_up(CUdevice dev);
/* Room (issue 21, "memory that would only be evicted is never backed"): the GRANT's room_bytes
 * for device `dev` (0: no limit). While the process holds `dev` with a room, a new block that
 * would take its backed memory there past the room gets no physical memory: the engine defers
 * backing on `dev` (as for a waiter), holds the gate shut for it (gs_gate_hold) and wakes the
 * client, which gives the device back and asks for it again (gs_mem_past_room says which
 * devices); the next grant's gs_mem_back_deferred backs the blocks, copying nothing, and lifts
 * the hold. A release (gs_mem_defer_backing) forgets the room; gs_mem_back_deferred of
 * GS_MEM_ALL_DEVICES (running without the scheduler's grants) forgets every device's. */
void gs_mem_set_room(CUdevice dev, uint64_t room);
/* The device slots (bit gs_mem_slot(dev)) whose memory went past the room and waits for a grant. */
unsigned gs_mem_past_room(void);
/* STAGING: the most host staging the process may hold for its resident memory (the scheduler's
 * share of the node's host budget); the engine makes staging up to it and gives back the rest. */
void gs_mem_set_staging_allowance(uint64_t bytes);
/* Prepare host staging for explicit memory that has none (called when the process goes idle). */
void gs_mem_prepare_staging(void);
void gs_mem_after_fork_child(void);
/* A context was destroyed or reset: what the engine cached in it (its private stream) died with
 * it. (ctx NULL: a primary context; the engine may forget every cached handle.) */
void gs_mem_context_gone(CUcontext ctx);
void gs_mem_lock_for_fork(void);
void gs_mem_unlock_after_fork(void);
/* cuGraphLaunch of a graph with memory nodes (memory/graphs.c): reserve against the quota what
 * its launch would back (*held), refused with the shim's line when it does not fit; then count
 * it once the driver answered `r`, giving the reservation back. Others: one atomic load. */
CUresult gs_mem_graph_launch_check(CUgraphExec exec, uint64_t *held);
void gs_mem_graph_launched(CUgraphExec exec, CUresult r, uint64_t held);

#endif /* GPUSHARE_MEMORY_API_H */
