/*
 * Explicit device memory: what the program gets from cuMemAlloc is a reserved virtual range
 * (cuMemAddressReserve) backed by a physical allocation (cuMemCreate + cuMemMap + cuMemSetAccess).
 * Eviction copies the block into host staging and unmaps and releases the physical memory; restore
 * creates new physical memory, maps it at the SAME virtual address and copies back. Pointers stay
 * valid across moves, the card holds exactly what is mapped (never oversubscribed), and moves run
 * at the bus's speed instead of managed memory's page-migration speed (docs/architecture.md).
 *
 * Blocks: an allocation over half the granularity gets its own block, rounded up to the
 * granularity (2 MiB on current GPUs). Smaller ones share granularity-sized chunks, carved in
 * 512-byte units (cudaMalloc promises 256), so a 1 KiB cudaMalloc does not cost 2 MiB. The quota
 * counts physical memory: a block's rounded size, a chunk once when it is created.
 *
 * One mutex guards the gs_vmm_blocks; allocation is not the hot path. Moves hold it for their whole
 * length: a free during an eviction waits for it.
 */
#include <stdlib.h>
#include <string.h>

#include "vmm.h"

struct gs_vmm_driver gs_vmm_drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

pthread_mutex_t gs_vmm_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t gs_vmm_prepare_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t copies_done = PTHREAD_COND_INITIALIZER;
static size_t copies_in_flight; /* blocks marked copying by a pre-copy */
int gs_vmm_prepare_pending;
unsigned gs_vmm_precopy_wanted;
uint64_t gs_vmm_precopy_asked_at[GS_MEM_DEVICES];
double gs_vmm_last_change;

void gs_vmm_wake_preparer_locked(void)
{
    gs_vmm_prepare_pending = 1;
    pthread_cond_signal(&gs_vmm_prepare_cv);
}
struct block **gs_vmm_blocks;
size_t gs_vmm_nblocks;
uint64_t gs_vmm_use_clock;
static size_t capblocks;
static uint64_t granularity;

#define SYM(field, name) (gs_vmm_drv.field = (__typeof__(gs_vmm_drv.field))gs_driver_sym(name))

static void load_driver(void)
{
    gs_vmm_drv.ok = SYM(reserve, "cuMemAddressReserve") && SYM(addr_free, "cuMemAddressFree") &&
             SYM(map, "cuMemMap") && SYM(unmap, "cuMemUnmap") && SYM(access, "cuMemSetAccess") &&
             SYM(gran, "cuMemGetAllocationGranularity") && SYM(ctx_dev, "cuCtxGetDevice") &&
             SYM(ctx_cur, "cuCtxGetCurrent") && SYM(ctx_push, "cuCtxPushCurrent_v2") &&
             SYM(ctx_pop, "cuCtxPopCurrent_v2") && SYM(ctx_sync, "cuCtxSynchronize") &&
             SYM(stream_create, "cuStreamCreateWithPriority") &&
             SYM(stream_sync, "cuStreamSynchronize") && SYM(event_create, "cuEventCreate") &&
             SYM(event_record, "cuEventRecord") && SYM(event_sync, "cuEventSynchronize") &&
             SYM(event_destroy, "cuEventDestroy_v2") && SYM(d2h, "cuMemcpyDtoHAsync_v2") &&
             SYM(h2d, "cuMemcpyHtoDAsync_v2") && SYM(meminfo, "cuMemGetInfo_v2") &&
             GS_REAL(cuMemCreate) && GS_REAL(cuMemRelease);
    SYM(prio_range, "cuCtxGetStreamPriorityRange"); /* optional: low priority pre-copies */
    if (!gs_vmm_drv.ok)
        GS_INFO("the driver lacks the virtual memory management API: using managed memory");
}

/* Every block is created exportable as a POSIX file descriptor, so CUDA IPC (memory/ipc.c) can
 * hand a block to a peer as it is: re-creating it at export would need a copy, the device and
 * twice the memory. Where the driver refuses the handle type, blocks are made without it and
 * IPC says it cannot work. */
int gs_vmm_exportable = 1;
atomic_uint gs_vmm_defer;
atomic_uint gs_vmm_past_room;

/* Whether a new block of `size` on `dev` is left unbacked: the process waits for the device
 * there, or (holding it) the block would take its backed memory past the grant's room, which
 * makes it wait from now on: the gate is held shut for dev before the block's address is given
 * out, so no call can reach the block before the next grant backs it (gs_vmm_back_deferred).
 * Under gs_vmm_mu, the block's size reserved. */
static int defer_new_block(CUdevice dev, uint64_t size)
{
    unsigned bit = 1u << gs_mem_slot(dev);
    if (atomic_load(&gs_vmm_defer) & bit)
        return 1;
    uint64_t backed, room;
    if (!gs_mem_past_room_on(dev, &backed, &room))
        return 0;
    atomic_fetch_or(&gs_vmm_defer, bit);
    atomic_fetch_or(&gs_vmm_past_room, bit);
    gs_gate_hold(bit);
    char a[32], b[32], c[32];
    GS_INFO("allocating %s on device %d would take this process to %s there, past its grant's "
            "room of %s: not backed; its GPU calls wait for a grant with room",
            gs_format_size(size, a, sizeof a), (int)dev, gs_format_size(backed, b, sizeof b),
            gs_format_size(room, c, sizeof c));
    return 1;
}

/* The driver refused a new block's physical memory although the grant's room said it fits: the
 * card holds memory the pool's accounting does not see (other processes, contexts larger than
 * their estimate). Where a scheduler gave a room, that is a wait for room like any past the room,
 * never an out-of-memory for the program (issue 34): the block stays unbacked, the gate is held
 * for `dev`, and the REQUEST that follows says by how much the driver fell short. */
static int defer_refused_block(CUdevice dev, uint64_t size)
{
    if (!gs_mem_has_room_on(dev))
        return 0; /* no scheduler weighs this memory: the driver's answer stands */
    size_t free_now = 0, total = 0;
    if (gs_vmm_drv.meminfo(&free_now, &total) != CUDA_SUCCESS)
        free_now = 0;
    gs_mem_note_short(dev, size, free_now);
    unsigned bit = 1u << gs_mem_slot(dev);
    atomic_fetch_or(&gs_vmm_defer, bit);
    atomic_fetch_or(&gs_vmm_past_room, bit);
    gs_gate_hold(bit);
    char a[32], f[32];
    GS_INFO("the device has no room for %s (%s free): not backed; its GPU calls wait while the "
            "scheduler moves other kernels' memory",
            gs_format_size(size, a, sizeof a), gs_format_size(free_now, f, sizeof f));
    return 1;
}

static CUmemAllocationProp prop_for(CUdevice dev)
{
    return (CUmemAllocationProp){.type = GS_MEM_ALLOCATION_TYPE_PINNED,
                                 .requestedHandleTypes = gs_vmm_exportable
                                                             ? GS_MEM_HANDLE_TYPE_POSIX_FD
                                                             : GS_MEM_HANDLE_TYPE_NONE,
                                 .location = {CU_MEM_LOCATION_TYPE_DEVICE, dev}};
}

int gs_vmm_driver_ready(void)
{
    pthread_once(&drv_once, load_driver);
    return gs_vmm_drv.ok;
}

/* ---- streams for moves ---- */

/* Each device's moves run in a context of that device, on streams of that context: kept per
 * device, so moving device 0's memory and then device 1's does not make streams again. */
static struct {
    CUcontext ctx;
    CUstream move, precopy;
} streams[GS_MEM_DEVICES];

void gs_vmm_forget_streams(void) { memset(streams, 0, sizeof streams); }

CUstream gs_vmm_move_stream(int low_priority)
{
    CUcontext cur = NULL;
    CUdevice dev = 0;
    gs_vmm_drv.ctx_cur(&cur);
    gs_vmm_drv.ctx_dev(&dev);
    int d = gs_mem_slot(dev);
    if (cur != streams[d].ctx) {
        /* Streams belong to their context: a new current context needs its own. */
        streams[d].move = streams[d].precopy = NULL;
        streams[d].ctx = cur;
    }
    CUstream *slot = low_priority ? &streams[d].precopy : &streams[d].move;
    if (!*slot) {
        int least = 0, greatest = 0;
        if (gs_vmm_drv.prio_range)
            gs_vmm_drv.prio_range(&least, &greatest);
        if (gs_vmm_drv.stream_create(slot, GS_STREAM_NON_BLOCKING,
                                     low_priority ? least : greatest) != CUDA_SUCCESS) {
            *slot = NULL;
            GS_WARN("cannot create a stream for moving memory");
        }
    }
    return *slot;
}

/* ---- the sorted block index ---- */

static size_t lower_bound(CUdeviceptr va)
{
    size_t lo = 0, hi = gs_vmm_nblocks;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (gs_vmm_blocks[mid]->va < va)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

struct block *gs_vmm_find(CUdeviceptr p)
{
    size_t i = lower_bound(p + 1);
    if (i == 0)
        return NULL;
    struct block *b = gs_vmm_blocks[i - 1];
    return p >= b->va && p - b->va < b->size ? b : NULL;
}

static int index_add(struct block *b)
{
    if (gs_vmm_nblocks == capblocks) {
        size_t ncap = capblocks ? capblocks * 2 : MAX_BLOCKS_GROWTH;
        struct block **nb = realloc(gs_vmm_blocks, ncap * sizeof *nb);
        if (!nb)
            return -1;
        gs_vmm_blocks = nb;
        capblocks = ncap;
    }
    size_t i = lower_bound(b->va);
    memmove(&gs_vmm_blocks[i + 1], &gs_vmm_blocks[i], (gs_vmm_nblocks - i) * sizeof *gs_vmm_blocks);
    gs_vmm_blocks[i] = b;
    gs_vmm_nblocks++;
    return 0;
}

static void index_remove(struct block *b)
{
    size_t i = lower_bound(b->va);
    if (i < gs_vmm_nblocks && gs_vmm_blocks[i] == b) {
        memmove(&gs_vmm_blocks[i], &gs_vmm_blocks[i + 1], (gs_vmm_nblocks - i - 1) * sizeof *gs_vmm_blocks);
        gs_vmm_nblocks--;
    }
}

/* ---- physical backing ---- */

/* Back b->va with new physical memory on b->dev. */
CUresult gs_vmm_back(struct block *b)
{
    CUmemAllocationProp prop = prop_for(b->dev);
    CUmemGenericAllocationHandle h;
    CUresult r = GS_REAL(cuMemCreate)(&h, b->size, &prop, 0);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY && gs_vmm_exportable) {
        gs_vmm_exportable = 0;
        prop = prop_for(b->dev);
        r = GS_REAL(cuMemCreate)(&h, b->size, &prop, 0);
        if (r == CUDA_SUCCESS)
            GS_INFO("the driver refuses exportable device memory: CUDA IPC of this process's "
                    "memory will not work");
    }
    if (r != CUDA_SUCCESS)
        return r;
    r = gs_vmm_drv.map(b->va, b->size, 0, h, 0);
    if (r == CUDA_SUCCESS) {
        gs_mem_access_desc desc = {{CU_MEM_LOCATION_TYPE_DEVICE, b->dev},
                                   GS_MEM_ACCESS_FLAGS_PROT_READWRITE};
        r = gs_vmm_drv.access(b->va, b->size, &desc, 1);
        if (r != CUDA_SUCCESS)
            gs_vmm_drv.unmap(b->va, b->size);
    }
    if (r != CUDA_SUCCESS) {
        GS_REAL(cuMemRelease)(h);
        return r;
    }
    b->handle = h;
    b->resident = 1;
    return CUDA_SUCCESS;
}

void gs_vmm_unback(struct block *b)
{
    gs_vmm_drv.unmap(b->va, b->size);
    GS_REAL(cuMemRelease)(b->handle);
    b->handle = 0;
    b->resident = 0;
}

void gs_vmm_copies_begin_locked(size_t n) { copies_in_flight += n; }

void gs_vmm_copies_end_locked(size_t n)
{
    copies_in_flight -= n;
    pthread_cond_broadcast(&copies_done);
}

void gs_vmm_wait_copies_locked(const struct block *b)
{
    while (b ? b->copying : copies_in_flight > 0)
        pthread_cond_wait(&copies_done, &gs_vmm_mu);
}

/* A new block of `size` bytes (granularity-aligned), counted against the quota. */
static CUresult new_block(uint64_t size, uint64_t requested, int is_chunk, struct block **out)
{
    CUdevice dev = 0;
    gs_vmm_drv.ctx_dev(&dev);
    CUresult r = gs_mem_reserve_on(dev, size); /* the quota of this device's registration */
    if (r != CUDA_SUCCESS)
        return r;
    struct block *b = calloc(1, sizeof *b);
    struct chunk *c = is_chunk ? calloc(1, sizeof *c) : NULL;
    r = CUDA_ERROR_OUT_OF_MEMORY;
    if (b && (!is_chunk || c)) {
        b->size = size;
        b->requested = requested;
        b->chunk = c;
        if (c)
            c->units = (unsigned)(size / UNIT);
        b->dev = dev;
        gs_vmm_drv.ctx_cur(&b->ctx);
        r = gs_vmm_drv.reserve(&b->va, size, granularity, 0, 0);
        b->unbacked = r == CUDA_SUCCESS && defer_new_block(dev, size);
        if (r == CUDA_SUCCESS) {
            r = b->unbacked ? CUDA_SUCCESS : gs_vmm_back(b);
            if (r == CUDA_ERROR_OUT_OF_MEMORY && defer_refused_block(dev, size)) {
                b->unbacked = 1;
                r = CUDA_SUCCESS;
            }
            if (r == CUDA_SUCCESS && index_add(b) != 0) {
                gs_vmm_unback(b);
                r = CUDA_ERROR_OUT_OF_MEMORY;
            }
            if (r != CUDA_SUCCESS)
                gs_vmm_drv.addr_free(b->va, size);
        }
    }
    if (r != CUDA_SUCCESS) {
        free(c);
        free(b);
        gs_mem_unreserve_on(dev, size);
        return r;
    }
    static uint64_t next_id;
    b->id = ++next_id;
    b->last_use = ++gs_vmm_use_clock;
    b->made_at = gs_now();
    /* An unbacked block counts as on the host: the scheduler never sees it resident. */
    gs_mem_engine_account(dev, size, (int64_t)size, b->unbacked ? (int64_t)size : 0);
    gs_vmm_last_change = gs_now(); /* the preparer waits until allocations pause */
    gs_vmm_wake_preparer_locked(); /* its host staging, off the critical path */
    *out = b;
    return CUDA_SUCCESS;
}

static void destroy_block(struct block *b)
{
    gs_vmm_last_change = gs_now();
    index_remove(b);
    /* Read before the unmap, which clears it: a resident block was never counted as evicted
     * (reading it after took every freed resident block's size off the evicted total). */
    int evicted = !b->resident;
    if (b->resident)
        gs_vmm_unback(b);
    gs_vmm_drv.addr_free(b->va, b->size);
    gs_staging_put(&b->staging);
    gs_mem_engine_account(b->dev, 0, -(int64_t)b->size, evicted ? -(int64_t)b->size : 0);
    free(b->chunk);
    free(b);
}

/* ---- allocation ---- */

/* First fit of n units in a chunk; returns the first unit or -1. */
static long chunk_fit(struct chunk *c, unsigned n)
{
    unsigned run = 0;
    for (unsigned u = 0; u < c->units;) {
        if (c->len[u]) {
            u += c->len[u];
            run = 0;
            continue;
        }
        if (++run == n)
            return (long)(u + 1 - n);
        u++;
    }
    return -1;
}

static CUresult small_alloc(CUdeviceptr *dptr, uint64_t bytes)
{
    unsigned n = (unsigned)((bytes + UNIT - 1) / UNIT);
    CUdevice dev = 0;
    CUcontext ctx = NULL;
    gs_vmm_drv.ctx_dev(&dev);
    gs_vmm_drv.ctx_cur(&ctx);
    for (size_t i = 0; i < gs_vmm_nblocks; i++) {
        struct block *b = gs_vmm_blocks[i];
        long u;
        if (!b->chunk || b->ctx != ctx || b->dev != dev || b->chunk->units - b->chunk->used < n ||
            (u = chunk_fit(b->chunk, n)) < 0)
            continue;
        b->chunk->len[u] = (uint16_t)n;
        b->chunk->used += n;
        b->precopied = 0; /* a new allocation's contents are not in the staging copy */
        b->copy_spoiled = b->copying; /* nor in one being made */
        *dptr = b->va + (CUdeviceptr)u * UNIT;
        return CUDA_SUCCESS;
    }
    struct block *b;
    CUresult r = new_block(granularity, 0, 1, &b);
    if (r != CUDA_SUCCESS)
        return r;
    b->chunk->len[0] = (uint16_t)n;
    b->chunk->used = n;
    *dptr = b->va;
    return CUDA_SUCCESS;
}

CUresult gs_vmm_alloc(CUdeviceptr *dptr, size_t bytes)
{
    if (!gs_vmm_driver_ready())
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&gs_vmm_mu);
    CUresult r = CUDA_SUCCESS;
    if (!granularity) {
        CUdevice dev = 0;
        gs_vmm_drv.ctx_dev(&dev);
        CUmemAllocationProp prop = prop_for(dev);
        size_t g = 0;
        r = gs_vmm_drv.gran(&g, &prop, GS_MEM_ALLOC_GRANULARITY_MINIMUM);
        if (r == CUDA_SUCCESS && (!g || g % UNIT || g / UNIT > CHUNK_UNITS_MAX))
            r = CUDA_ERROR_NOT_SUPPORTED;
        if (r == CUDA_SUCCESS)
            granularity = g;
    }
    if (r == CUDA_SUCCESS) {
        if (bytes <= granularity / 2) {
            r = small_alloc(dptr, bytes);
        } else {
            uint64_t size = (bytes + granularity - 1) / granularity * granularity;
            struct block *b;
            r = size < bytes ? CUDA_ERROR_OUT_OF_MEMORY : new_block(size, bytes, 0, &b);
            if (r == CUDA_SUCCESS)
                *dptr = b->va;
        }
    }
    pthread_mutex_unlock(&gs_vmm_mu);
    return r;
}

int gs_vmm_free(CUdeviceptr dptr, CUresult *r)
{
    if (!gs_vmm_drv.ok)
        return 0;
    pthread_mutex_lock(&gs_vmm_mu);
    struct block *b = gs_vmm_find(dptr);
    while (b && b->copying) { /* never unmapped under a pre-copy's read: then look again */
        gs_vmm_wait_copies_locked(b);
        b = gs_vmm_find(dptr);
    }
    int mine = b != NULL;
    if (b) {
        *r = CUDA_SUCCESS;
        unsigned u = (unsigned)((dptr - b->va) / UNIT);
        if (b->chunk && ((dptr - b->va) % UNIT || !b->chunk->len[u])) {
            *r = CUDA_ERROR_INVALID_VALUE; /* inside a chunk but not an allocation's start */
        } else if (!b->chunk && dptr != b->va) {
            *r = CUDA_ERROR_INVALID_VALUE;
        } else {
            /* cuMemFree synchronises: work still reading the memory finishes first. */
            gs_vmm_drv.ctx_sync();
            if (b->chunk) {
                b->chunk->used -= b->chunk->len[u];
                b->chunk->len[u] = 0;
            }
            if (!b->chunk || !b->chunk->used)
                destroy_block(b);
        }
    }
    pthread_mutex_unlock(&gs_vmm_mu);
    return mine;
}

int gs_vmm_range(CUdeviceptr p, CUdeviceptr *base, size_t *size)
{
    if (!gs_vmm_drv.ok)
        return 0;
    pthread_mutex_lock(&gs_vmm_mu);
    struct block *b = gs_vmm_find(p);
    int found = 0;
    if (b && !b->chunk) {
        found = p - b->va < b->requested;
        *base = b->va;
        *size = b->requested;
    } else if (b) {
        unsigned want = (unsigned)((p - b->va) / UNIT);
        for (unsigned u = 0; u < b->chunk->units;) {
            unsigned n = b->chunk->len[u] ? b->chunk->len[u] : 1;
            if (b->chunk->len[u] && want >= u && want < u + n) {
                *base = b->va + (CUdeviceptr)u * UNIT;
                *size = (size_t)n * UNIT;
                found = 1;
                break;
            }
            u += n;
        }
    }
    pthread_mutex_unlock(&gs_vmm_mu);
    return found;
}

void gs_vmm_forget_context(CUcontext ctx)
{
    if (!gs_vmm_drv.ok)
        return;
    pthread_mutex_lock(&gs_vmm_mu);
    gs_vmm_wait_copies_locked(NULL);
    /* The program destroyed the context its memory was allocated in: that memory is gone with
     * it as far as the program can tell. Give back what the driver still holds and stop
     * counting it. */
    for (size_t i = gs_vmm_nblocks; ctx && i-- > 0;)
        if (gs_vmm_blocks[i]->ctx == ctx)
            destroy_block(gs_vmm_blocks[i]);
    gs_vmm_forget_streams();
    pthread_mutex_unlock(&gs_vmm_mu);
}

void gs_vmm_after_fork_child(void)
{
    /* The child has no CUDA context: the parent's blocks are not its own (their host mirrors
     * stay mapped in the child, copy-on-write, and are simply not used). */
    pthread_mutex_init(&gs_vmm_mu, NULL);
    free(gs_vmm_blocks);
    gs_vmm_blocks = NULL;
    gs_vmm_nblocks = capblocks = 0;
    granularity = 0;
    atomic_store(&gs_vmm_defer, 0);
    gs_gate_unhold(atomic_exchange(&gs_vmm_past_room, 0)); /* the parent's wait is not the child's */
    gs_vmm_forget_streams();
    pthread_cond_init(&gs_vmm_prepare_cv, NULL);
    gs_vmm_prepare_pending = gs_vmm_precopy_wanted = 0;
    pthread_cond_init(&copies_done, NULL);
    copies_in_flight = 0; /* the parent's pre-copy thread is not the child's */
}
