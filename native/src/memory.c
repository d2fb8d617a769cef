/*
 * Memory virtualisation: the allocation table, the quota, the process's view of memory, and the
 * bulk moves (eviction to the host, restore to the device) done at a handoff.
 *
 * Allocation is not the hot path (caching allocators ask the driver rarely), so one mutex guards
 * the table and the totals. The quota check reserves the bytes under that mutex before the driver
 * is called, so two threads cannot both squeeze under the quota with the same headroom.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpushare.h"
#include "memory.h"

enum { NS_EMPTY = 0, NS_PTR = 1, NS_HANDLE = 2 };
enum {
    KIND_MANAGED = 0, /* cuMemAllocManaged, or cuMemAlloc made managed: evictable */
    KIND_DEVICE = 1,  /* plain device memory (GPUSHARE_MANAGED=0): counted, pinned */
    KIND_POOL = 2,    /* stream-ordered pools: pinned */
    KIND_HANDLE = 3,  /* cuMemCreate handles: pinned until cuMemRelease */
    KIND_ENGINE = 4   /* explicit memory: counted by memory_vmm.c, never in this table */
};

struct entry {
    uint64_t key;
    uint64_t size;
    uint8_t ns;
    uint8_t kind;
    uint8_t evicted;
};

static pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
static struct entry *table;
static size_t table_cap, table_len; /* cap: power of two */

static uint64_t managed_bytes, pinned_alloc_bytes, evicted_bytes, reserved_bytes;
static uint64_t engine_bytes, engine_evicted; /* explicit memory (memory_vmm.c) */
static size_t reserved_slots; /* table slots promised to allocations the driver is making */
static uint64_t context_bytes; /* counted once the process has a context */
static uint64_t quota_bytes, pool_bytes;
static int quota_from_env_loaded;
static atomic_ulong mem_gen;

static CUstream move_stream; /* private stream for evict/restore, in the app's context */

/* ---- the table: open addressing, linear probing, backward-shift deletion (no tombstones) ---- */

static size_t slot_of(uint64_t key, uint8_t ns)
{
    uint64_t h = key ^ ((uint64_t)ns << 61);
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return (size_t)h & (table_cap - 1);
}

static struct entry *find(uint64_t key, uint8_t ns)
{
    if (!table_cap)
        return NULL;
    for (size_t i = slot_of(key, ns);; i = (i + 1) & (table_cap - 1)) {
        struct entry *e = &table[i];
        if (e->ns == NS_EMPTY)
            return NULL;
        if (e->key == key && e->ns == ns)
            return e;
    }
}

static int grow(void)
{
    size_t ncap = table_cap ? table_cap * 2 : 1024;
    struct entry *nt = calloc(ncap, sizeof *nt);
    if (!nt)
        return -1;
    struct entry *old = table;
    size_t ocap = table_cap;
    table = nt;
    table_cap = ncap;
    for (size_t i = 0; i < ocap; i++) {
        if (old[i].ns == NS_EMPTY)
            continue;
        size_t j = slot_of(old[i].key, old[i].ns);
        while (table[j].ns != NS_EMPTY)
            j = (j + 1) & (table_cap - 1);
        table[j] = old[i];
    }
    free(old);
    return 0;
}

/* Room for one more entry, promised before the driver is called (reserve() below), so that
 * insert() cannot fail once the driver has handed the memory out. */
static int promise_slot_locked(void)
{
    if ((table_len + reserved_slots + 1) * 10 > table_cap * 7 && grow() != 0)
        return -1;
    reserved_slots++;
    return 0;
}

static void insert(uint64_t key, uint8_t ns, uint64_t size, uint8_t kind)
{
    struct entry *e = find(key, ns);
    if (!e) {
        /* A slot was promised (promise_slot_locked); growing again is only a safety net. */
        if ((table_len + 1) * 10 > table_cap * 7)
            grow();
        size_t i = slot_of(key, ns);
        while (table[i].ns != NS_EMPTY)
            i = (i + 1) & (table_cap - 1);
        e = &table[i];
        table_len++;
    } else {
        /* The driver reused an address we still had (a free we did not see): replace it. */
        if (e->kind == KIND_MANAGED)
            managed_bytes -= e->size;
        else
            pinned_alloc_bytes -= e->size;
        if (e->evicted)
            evicted_bytes -= e->size;
    }
    *e = (struct entry){.key = key, .size = size, .ns = ns, .kind = kind, .evicted = 0};
    if (kind == KIND_MANAGED)
        managed_bytes += size;
    else
        pinned_alloc_bytes += size;
}

static void erase(struct entry *e)
{
    if (e->kind == KIND_MANAGED)
        managed_bytes -= e->size;
    else
        pinned_alloc_bytes -= e->size;
    if (e->evicted)
        evicted_bytes -= e->size;
    size_t i = (size_t)(e - table);
    /* Backward shift: pull later members of the probe run into the hole. */
    for (size_t j = (i + 1) & (table_cap - 1); table[j].ns != NS_EMPTY;
         j = (j + 1) & (table_cap - 1)) {
        size_t home = slot_of(table[j].key, table[j].ns);
        /* Move j into i when its home is not cyclically in (i, j]. */
        if (((j - home) & (table_cap - 1)) >= ((j - i) & (table_cap - 1))) {
            table[i] = table[j];
            i = j;
        }
    }
    table[i].ns = NS_EMPTY;
    table_len--;
}

/* ---- totals, quota ---- */

static void load_quota_locked(void)
{
    if (!quota_from_env_loaded) {
        quota_from_env_loaded = 1;
        quota_bytes = gs_config()->quota;
    }
}

static uint64_t used_locked(void)
{
    return context_bytes + managed_bytes + pinned_alloc_bytes + engine_bytes;
}

static void changed_locked(void) { atomic_fetch_add_explicit(&mem_gen, 1, memory_order_relaxed); }

uint64_t gs_mem_generation(void) { return atomic_load_explicit(&mem_gen, memory_order_relaxed); }

void gs_mem_totals(struct gs_mem_totals *out)
{
    pthread_mutex_lock(&mem_mu);
    load_quota_locked();
    out->used = used_locked();
    out->managed = managed_bytes + engine_bytes;
    out->pinned = context_bytes + pinned_alloc_bytes;
    out->evicted = evicted_bytes + engine_evicted;
    out->quota = quota_bytes;
    out->pool = pool_bytes;
    pthread_mutex_unlock(&mem_mu);
}

void gs_mem_set_quota(uint64_t quota)
{
    pthread_mutex_lock(&mem_mu);
    quota_from_env_loaded = 1;
    quota_bytes = quota;
    pthread_mutex_unlock(&mem_mu);
}

void gs_mem_set_pool(uint64_t pool)
{
    pthread_mutex_lock(&mem_mu);
    pool_bytes = pool;
    pthread_mutex_unlock(&mem_mu);
}

void gs_mem_count_context(void)
{
    pthread_mutex_lock(&mem_mu);
    if (!context_bytes) {
        context_bytes = gs_config()->context_bytes;
        changed_locked();
    }
    pthread_mutex_unlock(&mem_mu);
    gs_client_wake();
}

/* Reserve `size` bytes against the quota and the pool. On refusal print the one line that says
 * why, and return CUDA_ERROR_OUT_OF_MEMORY: the driver is not called. */
CUresult gs_mem_reserve(uint64_t size)
{
    pthread_mutex_lock(&mem_mu);
    load_quota_locked();
    uint64_t in_use = used_locked() + reserved_bytes;
    uint64_t after = in_use + size;
    int over_quota = quota_bytes && (after > quota_bytes || after < in_use);
    int over_pool = !over_quota && pool_bytes && (after > pool_bytes || after < in_use);
    uint64_t limit = over_quota ? quota_bytes : pool_bytes;
    if (!over_quota && !over_pool)
        reserved_bytes += size;
    pthread_mutex_unlock(&mem_mu);
    if (!over_quota && !over_pool)
        return CUDA_SUCCESS;
    if (gs_log_enabled(GS_LOG_WARN)) {
        char a[32], b[32], c[32], d[32];
        gs_log(GS_LOG_WARN,
               "out of memory: allocating %s would take this process to %s, over %s of %s "
               "(%s in use)",
               gs_format_size(size, a, sizeof a), gs_format_size(after, b, sizeof b),
               over_quota ? "its quota" : "the GPU's shared pool", gs_format_size(limit, c, sizeof c),
               gs_format_size(in_use, d, sizeof d));
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

void gs_mem_unreserve(uint64_t size)
{
    pthread_mutex_lock(&mem_mu);
    reserved_bytes -= size;
    pthread_mutex_unlock(&mem_mu);
}

/* A reservation for an allocation the table will record: bytes and a table slot. */
static CUresult reserve(uint64_t size)
{
    pthread_mutex_lock(&mem_mu);
    int no_room = promise_slot_locked() != 0;
    pthread_mutex_unlock(&mem_mu);
    if (no_room) {
        GS_WARN("out of host memory for the allocation table: refusing a device allocation "
                "rather than leaving it uncounted");
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = gs_mem_reserve(size);
    if (r != CUDA_SUCCESS) {
        pthread_mutex_lock(&mem_mu);
        reserved_slots--;
        pthread_mutex_unlock(&mem_mu);
    }
    return r;
}

static void unreserve(uint64_t size)
{
    pthread_mutex_lock(&mem_mu);
    reserved_bytes -= size;
    reserved_slots--;
    pthread_mutex_unlock(&mem_mu);
}

void gs_mem_engine_account(uint64_t reserved, int64_t total_delta, int64_t evicted_delta)
{
    pthread_mutex_lock(&mem_mu);
    reserved_bytes -= reserved;
    engine_bytes += (uint64_t)total_delta;
    engine_evicted += (uint64_t)evicted_delta;
    changed_locked();
    pthread_mutex_unlock(&mem_mu);
    gs_client_wake();
}

/* Settle a reservation once the driver has answered: a success becomes a counted allocation
 * under *key, a failure gives the reserved bytes back. Returns the driver's answer. */
static CUresult settle(CUresult r, uint64_t reserved, const unsigned long long *key, uint8_t ns,
                       uint64_t size, uint8_t kind)
{
    if (r != CUDA_SUCCESS) {
        unreserve(reserved);
        return r;
    }
    pthread_mutex_lock(&mem_mu);
    reserved_bytes -= reserved;
    reserved_slots--;
    insert(*key, ns, size, kind);
    changed_locked();
    pthread_mutex_unlock(&mem_mu);
    gs_client_wake();
    return r;
}

static void uncount(uint64_t key, uint8_t ns)
{
    int hit = 0;
    pthread_mutex_lock(&mem_mu);
    struct entry *e = find(key, ns);
    if (e) {
        erase(e);
        changed_locked();
        hit = 1;
    }
    pthread_mutex_unlock(&mem_mu);
    if (hit)
        gs_client_wake();
}

/* ---- allocation handlers (hooks.def) ---- */

/* cudaMalloc's memory, by GPUSHARE_MEMORY: explicit (vmm, the default: the shim owns the physical
 * memory behind a stable address), managed (moved by prefetch and page faults) or plain device
 * memory (counted, never moved). Each falls back to the next where the driver cannot do it. */
static CUresult alloc_movable(gs_fn_cuMemAllocManaged managed, CUdeviceptr *dptr, size_t bytes,
                              uint8_t *kind)
{
    int mode = gs_config()->memory_mode;
    CUresult r = CUDA_ERROR_NOT_SUPPORTED;
    if (mode == GS_MEMORY_VMM) {
        r = gs_vmm_alloc(dptr, bytes); /* counts itself */
        *kind = KIND_ENGINE;
        if (r != CUDA_ERROR_NOT_SUPPORTED)
            return r;
    }
    if (mode != GS_MEMORY_DEVICE && managed) {
        r = reserve(bytes);
        if (r != CUDA_SUCCESS)
            return r;
        r = managed(dptr, bytes, CU_MEM_ATTACH_GLOBAL);
        if (r != CUDA_ERROR_NOT_SUPPORTED) {
            *kind = KIND_MANAGED;
            return settle(r, bytes, dptr, NS_PTR, bytes, KIND_MANAGED);
        }
        unreserve(bytes);
        GS_INFO("managed memory is not supported here: using device memory (not evictable)");
    }
    *kind = KIND_DEVICE;
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult gs_mem_alloc(gs_fn_cuMemAlloc_v2 real, CUdeviceptr *dptr, size_t bytesize)
{
    if (gs_config()->disabled || !dptr || !bytesize)
        return real(dptr, bytesize); /* the driver gives the right error for bad arguments */
    uint8_t kind;
    CUresult r = alloc_movable(GS_REAL(cuMemAllocManaged), dptr, bytesize, &kind);
    if (kind != KIND_DEVICE)
        return r;
    r = reserve(bytesize);
    if (r != CUDA_SUCCESS)
        return r;
    return settle(real(dptr, bytesize), bytesize, dptr, NS_PTR, bytesize, KIND_DEVICE);
}

CUresult gs_mem_alloc_pitch(gs_fn_cuMemAllocPitch_v2 real, CUdeviceptr *dptr, size_t *pPitch,
                            size_t WidthInBytes, size_t Height, unsigned int ElementSizeBytes)
{
    int valid = dptr && pPitch && WidthInBytes && Height &&
                (ElementSizeBytes == 4 || ElementSizeBytes == 8 || ElementSizeBytes == 16);
    if (gs_config()->disabled || !valid)
        return real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    /* 512 bytes: at least the texture pitch alignment of every GPU the driver supports, so rows
     * stay aligned the way callers of cuMemAllocPitch expect. */
    size_t pitch = (WidthInBytes + 511) & ~(size_t)511;
    if (pitch < WidthInBytes || Height > SIZE_MAX / pitch)
        return CUDA_ERROR_INVALID_VALUE;
    size_t bytes = pitch * Height;
    uint8_t kind;
    CUresult r = alloc_movable(GS_REAL(cuMemAllocManaged), dptr, bytes, &kind);
    if (kind != KIND_DEVICE) {
        if (r == CUDA_SUCCESS)
            *pPitch = pitch;
        return r;
    }
    r = reserve(bytes);
    if (r != CUDA_SUCCESS)
        return r;
    r = real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    return settle(r, bytes, dptr, NS_PTR, r == CUDA_SUCCESS ? (uint64_t)*pPitch * Height : 0,
                  KIND_DEVICE);
}

CUresult gs_mem_alloc_managed(gs_fn_cuMemAllocManaged real, CUdeviceptr *dptr, size_t bytesize,
                              unsigned int flags)
{
    if (gs_config()->disabled || !dptr || !bytesize)
        return real(dptr, bytesize, flags);
    CUresult r = reserve(bytesize);
    if (r != CUDA_SUCCESS)
        return r;
    return settle(real(dptr, bytesize, flags), bytesize, dptr, NS_PTR, bytesize, KIND_MANAGED);
}

/* Stream-ordered pools cannot hand out managed memory: pass through, count as pinned. */
CUresult gs_mem_alloc_async(gs_fn_cuMemAllocAsync real, CUdeviceptr *dptr, size_t bytesize,
                            CUstream hStream)
{
    if (gs_config()->disabled || !dptr || !bytesize)
        return real(dptr, bytesize, hStream);
    CUresult r = reserve(bytesize);
    if (r != CUDA_SUCCESS)
        return r;
    return settle(real(dptr, bytesize, hStream), bytesize, dptr, NS_PTR, bytesize, KIND_POOL);
}

CUresult gs_mem_alloc_from_pool(gs_fn_cuMemAllocFromPoolAsync real, CUdeviceptr *dptr,
                                size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    if (gs_config()->disabled || !dptr || !bytesize)
        return real(dptr, bytesize, pool, hStream);
    CUresult r = reserve(bytesize);
    if (r != CUDA_SUCCESS)
        return r;
    return settle(real(dptr, bytesize, pool, hStream), bytesize, dptr, NS_PTR, bytesize,
                  KIND_POOL);
}

/* Physical memory of the virtual memory management API (PyTorch expandable segments, NCCL):
 * counted per handle from cuMemCreate to cuMemRelease, however often it is mapped. */
CUresult gs_mem_create(gs_fn_cuMemCreate real, CUmemGenericAllocationHandle *handle, size_t size,
                       const CUmemAllocationProp *prop, unsigned long long flags)
{
    if (gs_config()->disabled || !handle || !size)
        return real(handle, size, prop, flags);
    CUresult r = reserve(size);
    if (r != CUDA_SUCCESS)
        return r;
    return settle(real(handle, size, prop, flags), size, handle, NS_HANDLE, size, KIND_HANDLE);
}

CUresult gs_mem_release(gs_fn_cuMemRelease real, CUmemGenericAllocationHandle handle)
{
    CUresult r = real(handle);
    if (r == CUDA_SUCCESS && !gs_config()->disabled)
        uncount(handle, NS_HANDLE);
    return r;
}

CUresult gs_mem_free(gs_fn_cuMemFree_v2 real, CUdeviceptr dptr)
{
    CUresult r;
    if (dptr && !gs_config()->disabled && gs_vmm_free(dptr, &r))
        return r;
    r = real(dptr);
    if (r == CUDA_SUCCESS && dptr && !gs_config()->disabled)
        uncount(dptr, NS_PTR);
    return r;
}

CUresult gs_mem_free_async(gs_fn_cuMemFreeAsync real, CUdeviceptr dptr, CUstream hStream)
{
    CUresult r;
    /* cudaFreeAsync of cudaMalloc memory is legal: freed at once, after a synchronise. */
    if (dptr && !gs_config()->disabled && gs_vmm_free(dptr, &r))
        return r;
    r = real(dptr, hStream);
    if (r == CUDA_SUCCESS && dptr && !gs_config()->disabled)
        uncount(dptr, NS_PTR);
    return r;
}

/* Total as this process may use it: its quota, else the pool, else what the device has. */
void gs_mem_view(uint64_t real_total, uint64_t *total, uint64_t *free_out, uint64_t *used_out)
{
    pthread_mutex_lock(&mem_mu);
    load_quota_locked();
    uint64_t t = quota_bytes ? quota_bytes : pool_bytes ? pool_bytes : real_total;
    uint64_t used = used_locked();
    pthread_mutex_unlock(&mem_mu);
    *total = t;
    *free_out = t > used ? t - used : 0;
    *used_out = used;
}

/* ---- eviction and restore ---- */

struct span {
    uint64_t ptr, size;
};

/* Managed allocations whose evicted flag equals `evicted`, copied out under the lock. */
static struct span *snapshot(int evicted, size_t *count)
{
    pthread_mutex_lock(&mem_mu);
    size_t n = 0;
    for (size_t i = 0; i < table_cap; i++)
        if (table[i].ns == NS_PTR && table[i].kind == KIND_MANAGED && table[i].evicted == evicted)
            n++;
    struct span *s = n ? malloc(n * sizeof *s) : NULL;
    size_t k = 0;
    if (s)
        for (size_t i = 0; i < table_cap && k < n; i++)
            if (table[i].ns == NS_PTR && table[i].kind == KIND_MANAGED &&
                table[i].evicted == evicted)
                s[k++] = (struct span){table[i].key, table[i].size};
    pthread_mutex_unlock(&mem_mu);
    *count = k;
    return s;
}

/* Prefetch every span to the host (to_host) or to device `dev`, on the private stream, and wait.
 * Marks what moved. The app's context must be current. */
static int move_all(int to_host, CUdevice dev, uint64_t *bytes_moved, uint64_t *micros)
{
    typedef CUresult (*stream_create_fn)(CUstream *, unsigned int);
    typedef CUresult (*stream_sync_fn)(CUstream);
    double t0 = gs_now();
    *bytes_moved = 0;
    *micros = 0;
    if (!move_stream) {
        stream_create_fn create = (stream_create_fn)gs_driver_sym("cuStreamCreate");
        if (!create || create(&move_stream, GS_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
            move_stream = NULL;
            GS_WARN("cannot create the stream for moving memory; pages will move on demand");
            return -1;
        }
    }
    stream_sync_fn sync = (stream_sync_fn)gs_driver_sym("cuStreamSynchronize");
    gs_fn_cuMemPrefetchAsync_v2 p2 = GS_REAL(cuMemPrefetchAsync_v2);
    gs_fn_cuMemPrefetchAsync p1 = p2 ? NULL : GS_REAL(cuMemPrefetchAsync);
    if (!sync || (!p1 && !p2))
        return -1;

    size_t n;
    struct span *spans = snapshot(to_host ? 0 : 1, &n);
    unsigned char *ok = n ? calloc(n, 1) : NULL;
    if (n && (!spans || !ok)) {
        free(spans);
        free(ok);
        return -1;
    }
    CUmemLocation loc = {to_host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE,
                         to_host ? 0 : dev};
    for (size_t i = 0; i < n; i++) {
        CUresult r = p2 ? p2(spans[i].ptr, spans[i].size, loc, 0, move_stream)
                        : p1(spans[i].ptr, spans[i].size, to_host ? CU_DEVICE_CPU : dev,
                             move_stream);
        /* A span freed by the program since the snapshot fails here: skip it. */
        ok[i] = r == CUDA_SUCCESS;
    }
    CUresult sr = sync(move_stream);
    pthread_mutex_lock(&mem_mu);
    for (size_t i = 0; i < n; i++) {
        struct entry *e;
        if (!ok[i] || !(e = find(spans[i].ptr, NS_PTR)) || e->size != spans[i].size ||
            e->kind != KIND_MANAGED)
            continue;
        if (to_host && !e->evicted) {
            e->evicted = 1;
            evicted_bytes += e->size;
        } else if (!to_host && e->evicted) {
            e->evicted = 0;
            evicted_bytes -= e->size;
        }
        *bytes_moved += e->size;
    }
    changed_locked();
    pthread_mutex_unlock(&mem_mu);
    free(spans);
    free(ok);
    *micros = (uint64_t)((gs_now() - t0) * 1e6);
    return sr == CUDA_SUCCESS ? 0 : -1;
}

/* Both kinds of movable memory: the engine's explicit blocks, then the program's own managed
 * memory (and cuMemAlloc made managed under GPUSHARE_MEMORY=managed) by prefetch. */
static int move_everything(int to_host, CUdevice dev, uint64_t *bytes_moved, uint64_t *micros)
{
    uint64_t b1 = 0, u1 = 0, b2 = 0, u2 = 0;
    int r1 = to_host ? gs_vmm_evict(&b1, &u1) : gs_vmm_restore(&b1, &u1);
    int r2 = move_all(to_host, dev, &b2, &u2);
    *bytes_moved = b1 + b2;
    *micros = u1 + u2;
    return r1 == 0 && r2 == 0 ? 0 : -1;
}

int gs_mem_evict(CUdevice dev, uint64_t *bytes_moved, uint64_t *micros)
{
    return move_everything(1, dev, bytes_moved, micros);
}

int gs_mem_restore(CUdevice dev, uint64_t *bytes_moved, uint64_t *micros)
{
    return move_everything(0, dev, bytes_moved, micros);
}

/* ---- fork ---- */

void gs_mem_lock_for_fork(void) { pthread_mutex_lock(&mem_mu); }
void gs_mem_unlock_after_fork(void) { pthread_mutex_unlock(&mem_mu); }

void gs_mem_after_fork_child(void)
{
    /* The child has no CUDA context: the parent's allocations are not its own. */
    pthread_mutex_init(&mem_mu, NULL);
    free(table);
    table = NULL;
    table_cap = table_len = 0;
    managed_bytes = pinned_alloc_bytes = evicted_bytes = reserved_bytes = context_bytes = 0;
    engine_bytes = engine_evicted = 0;
    reserved_slots = 0;
    gs_vmm_after_fork_child();
    gs_staging_after_fork_child();
    pool_bytes = 0;
    quota_from_env_loaded = 0;
    move_stream = NULL;
    changed_locked();
}
