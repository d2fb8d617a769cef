/*
 * Deferred backing: memory allocated while the process waits for the device, or that would take
 * it past its grant's room, is reserved but not backed (memory/vmm.c decides that at allocation).
 * The next grant backs it here, before the gate opens, so nothing that could only be evicted
 * again is ever backed on the GPU.
 */
#include "vmm.h"

static unsigned slot_bits(CUdevice dev)
{
    return dev == GS_MEM_ALL_DEVICES ? ~0u : 1u << gs_mem_slot(dev);
}

void gs_vmm_defer_backing(CUdevice dev) { atomic_fetch_or(&gs_vmm_defer, slot_bits(dev)); }

unsigned gs_vmm_past_room_bits(void) { return atomic_load(&gs_vmm_past_room); }

/* The grant (or running unshared) backs what waited on the shim's own thread, which has no
 * context current: the driver's memory calls need the block's (CUDA_ERROR_INVALID_CONTEXT
 * otherwise). Pushed and popped, so a caller's own current context is left as it was. */
static CUresult back_in_its_context(struct block *b)
{
    CUcontext cur = NULL;
    if (gs_vmm_drv.ctx_cur(&cur) == CUDA_SUCCESS && cur == b->ctx)
        return gs_vmm_back(b);
    if (gs_vmm_drv.ctx_push(b->ctx) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUresult r = gs_vmm_back(b);
    CUcontext popped;
    gs_vmm_drv.ctx_pop(&popped);
    return r;
}

void gs_vmm_back_deferred(CUdevice dev)
{
    pthread_mutex_lock(&gs_vmm_mu);
    /* Under the lock: an allocation either comes before this pass (and is backed by it) or after
     * (and is backed at once). Cleared even when the engine has no block yet: a grant that comes
     * before the first cudaMalloc (PyTorch's expandable segments allocate with cuMemCreate, and
     * cuDNN's first cudaMalloc follows the grant) must not leave later blocks unbacked. */
    atomic_fetch_and(&gs_vmm_defer, ~slot_bits(dev));
    /* The hold of memory past a room is lifted here, with the lock held: the gate then opens as
     * the grant says, once the blocks below are backed (the caller opens it after this). */
    unsigned held = atomic_fetch_and(&gs_vmm_past_room, ~slot_bits(dev)) & slot_bits(dev);
    if (!gs_vmm_drv.ok) {
        gs_gate_unhold(held);
        pthread_mutex_unlock(&gs_vmm_mu);
        return;
    }
    uint64_t backed = 0;
    for (size_t i = 0; i < gs_vmm_nblocks; i++) {
        struct block *b = gs_vmm_blocks[i];
        if (!b->unbacked || !gs_vmm_on(b, dev))
            continue;
        CUresult r = back_in_its_context(b);
        if (r != CUDA_SUCCESS) {
            char a[32];
            GS_WARN("cannot back %s of memory allocated while waiting: %s (CUDA error %d)",
                    gs_format_size(b->size, a, sizeof a),
                    r == CUDA_ERROR_OUT_OF_MEMORY ? "the device is full" : "the driver refused",
                    (int)r);
            continue;
        }
        b->unbacked = 0;
        b->last_use = ++gs_vmm_use_clock;
        backed += b->size;
        gs_mem_engine_account(b->dev, 0, 0, -(int64_t)b->size);
    }
    gs_gate_unhold(held);
    pthread_mutex_unlock(&gs_vmm_mu);
    if (backed) {
        char a[32];
        GS_INFO("backed %s allocated while waiting", gs_format_size(backed, a, sizeof a));
    }
}
