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

/* Grants in a row that left memory of a device off it without progress before the engine gives
 * up (see hold_what_is_off): each is a round trip through the scheduler, which evicts more. */
#define ROOM_TRIES 3

/* Slots whose last ROOM_TRIES grants could not bring memory back, twice over: one set for the
 * program's next gated call (it fails), one for the shim's thread (it does not ask again). Each
 * reader clears its own: with one set the program's call, woken by the same grant, could clear
 * it before the thread looked, and the thread asked for a fifth grant nobody would use. */
static atomic_uint hopeless, given_up;

unsigned gs_vmm_take_hopeless(unsigned bits) { return atomic_fetch_and(&hopeless, ~bits) & bits; }

unsigned gs_vmm_take_given_up(unsigned bits) { return atomic_fetch_and(&given_up, ~bits) & bits; }

unsigned gs_vmm_hopeless_bits(void) { return atomic_load(&hopeless); }

/* Bytes of device `dev`'s explicit memory that are not on it: unbacked, or evicted and not
 * restored (the restore stops where the driver has no room); *one: such a block. Under
 * gs_vmm_mu. */
static uint64_t off_device_locked(CUdevice dev, struct block **one)
{
    uint64_t off = 0;
    for (size_t i = 0; i < gs_vmm_nblocks; i++)
        if (!gs_vmm_blocks[i]->resident && gs_vmm_on(gs_vmm_blocks[i], dev)) {
            off += gs_vmm_blocks[i]->size;
            *one = gs_vmm_blocks[i];
        }
    return off;
}

/* The driver's free memory on b's device, asked in b's context (the shim's thread has none). */
static size_t driver_free_for(struct block *b)
{
    size_t free_now = 0, total = 0;
    int pushed = gs_vmm_drv.ctx_push(b->ctx) == CUDA_SUCCESS;
    if (!pushed || gs_vmm_drv.meminfo(&free_now, &total) != CUDA_SUCCESS)
        free_now = 0;
    CUcontext popped;
    if (pushed)
        gs_vmm_drv.ctx_pop(&popped);
    return free_now;
}

/* After a grant's restore and backing pass some of `dev`'s memory is still off the device: the
 * driver had no room although the scheduler's accounting did (issue 34). The gate must not open
 * on it (a kernel would touch unmapped memory): it stays held for `dev`, as for memory past a
 * room, and the shim's thread gives the device back and asks again, its REQUEST saying how much
 * the driver lacked, so the scheduler evicts that much more. After ROOM_TRIES grants in a row
 * without progress the engine gives up for now: the next GPU call there fails with out of
 * memory and one line (gs_mem_take_hopeless), and the call after it tries again. Returns the
 * slot's bit when the hold stays. Under gs_vmm_mu. */
static unsigned hold_what_is_off(CUdevice dev)
{
    static uint64_t last_off[GS_MEM_DEVICES];
    static int tries[GS_MEM_DEVICES];
    int slot = gs_mem_slot(dev);
    struct block *one = NULL;
    uint64_t off = off_device_locked(dev, &one);
    if (!off) {
        last_off[slot] = 0;
        tries[slot] = 0;
        atomic_fetch_and(&given_up, ~(1u << slot)); /* a stale one must not stop a later ask */
        return 0;
    }
    tries[slot] = last_off[slot] && off >= last_off[slot] ? tries[slot] + 1 : 1;
    last_off[slot] = off;
    size_t free_now = driver_free_for(one);
    unsigned bit = 1u << slot;
    char a[32], f[32];
    gs_format_size(off, a, sizeof a);
    gs_format_size(free_now, f, sizeof f);
    if (tries[slot] > ROOM_TRIES) {
        tries[slot] = 0;
        last_off[slot] = 0;
        atomic_fetch_or(&given_up, bit);
        atomic_fetch_or(&hopeless, bit);
        gs_log(GS_LOG_QUIET,
               "%s of this process's GPU memory cannot come back to device %d (%s free there) "
               "after the scheduler moved what it could: the next GPU call fails with out of "
               "memory; free memory or wait for other kernels to end, then run it again",
               a, (int)dev, f);
    } else {
        atomic_fetch_and(&given_up, ~bit);
        gs_mem_note_short(dev, off, free_now);
        GS_INFO("%s could not come back to device %d (%s free there): waiting for room", a,
                (int)dev, f);
    }
    atomic_fetch_or(&gs_vmm_defer, bit);
    atomic_fetch_or(&gs_vmm_past_room, bit);
    gs_gate_hold(bit);
    return bit;
}

void gs_vmm_back_deferred(CUdevice dev, int granted)
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
            if (!granted || r != CUDA_ERROR_OUT_OF_MEMORY)
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
    /* Under a grant, memory still off the device keeps its device's gate held (one device, or
     * each of every device's: a grant names one). */
    unsigned keep = 0;
    if (granted && dev != GS_MEM_ALL_DEVICES)
        keep = hold_what_is_off(dev);
    gs_gate_unhold(held & ~keep);
    pthread_mutex_unlock(&gs_vmm_mu);
    if (backed) {
        char a[32];
        GS_INFO("backed %s allocated while waiting", gs_format_size(backed, a, sizeof a));
    }
}
