/*
 * The memory engine's accounts, one per device (docs/architecture.md, "Several devices"): what
 * the process holds there (the table's allocations, the explicit engine's blocks, the context
 * estimate), what of it is on the host, the reservations in flight, and that device's quota and
 * pool (its registration's: each device's connection sets its own). Each device's registration
 * reports its own account; status sums them. Also the process's view (cuMemGetInfo, NVML) of the
 * current context's device.
 */
#include <string.h>

#include "memory.h"

pthread_mutex_t gs_mem_mu = PTHREAD_MUTEX_INITIALIZER;
struct gs_mem_account gs_mem_acct[GS_MEM_DEVICES];
static int quota_from_env_loaded;
static atomic_ulong mem_gen;

/* The account of the current context's device (the first one's when none is current). */
int gs_mem_current_slot(void)
{
    typedef CUresult (*get_fn)(CUdevice *);
    static get_fn get;
    if (!get)
        get = (get_fn)gs_driver_sym("cuCtxGetDevice");
    CUdevice d = 0;
    if (!get || get(&d) != CUDA_SUCCESS)
        d = 0;
    return gs_mem_slot(d);
}

/* ---- totals, quota ---- */

/* GPUSHARE_QUOTA is each registration's, so each device's, until the scheduler sets another. */
static void load_quota_locked(void)
{
    if (!quota_from_env_loaded) {
        quota_from_env_loaded = 1;
        for (int i = 0; i < GS_MEM_DEVICES; i++)
            gs_mem_acct[i].quota = gs_config()->quota;
    }
}

static uint64_t used_locked(const struct gs_mem_account *a)
{
    return a->context + a->managed + a->pinned_alloc + a->engine + a->driver_reserve;
}

void gs_mem_changed_locked(void) { atomic_fetch_add_explicit(&mem_gen, 1, memory_order_relaxed); }

uint64_t gs_mem_generation(void) { return atomic_load_explicit(&mem_gen, memory_order_relaxed); }

void gs_mem_account_totals(CUdevice dev, struct gs_mem_totals *out)
{
    pthread_mutex_lock(&gs_mem_mu);
    load_quota_locked();
    /* GS_MEM_ALL_DEVICES: the sums, and the largest quota and pool of the devices the process
     * has a context on (device 0's before it has any). */
    int any_context = 0;
    for (int i = 0; i < GS_MEM_DEVICES; i++)
        any_context |= gs_mem_acct[i].context != 0;
    for (int i = 0; i < GS_MEM_DEVICES; i++) {
        const struct gs_mem_account *a = &gs_mem_acct[i];
        if (dev != GS_MEM_ALL_DEVICES && i != gs_mem_slot(dev))
            continue;
        out->used += used_locked(a);
        out->managed += a->managed + a->engine;
        out->pinned += a->context + a->pinned_alloc + a->driver_reserve;
        out->evicted += a->evicted + a->engine_evicted;
        out->short_bytes += a->short_bytes;
        if (dev == GS_MEM_ALL_DEVICES && (any_context ? !a->context : i != 0))
            continue;
        out->quota = a->quota > out->quota ? a->quota : out->quota;
        out->pool = a->pool > out->pool ? a->pool : out->pool;
    }
    pthread_mutex_unlock(&gs_mem_mu);
}

void gs_memtab_set_driver_reserve(CUdevice dev, uint64_t bytes)
{
    if (dev < 0 || dev >= GS_RESERVE_DEVICES)
        return;
    pthread_mutex_lock(&gs_mem_mu);
    struct gs_mem_account *a = &gs_mem_acct[gs_mem_slot(dev)];
    int changed = a->driver_reserve != bytes;
    a->driver_reserve = bytes;
    if (changed)
        gs_mem_changed_locked();
    pthread_mutex_unlock(&gs_mem_mu);
    if (changed)
        gs_client_wake();
}

void gs_mem_set_quota(CUdevice dev, uint64_t quota)
{
    pthread_mutex_lock(&gs_mem_mu);
    load_quota_locked();
    gs_mem_acct[gs_mem_slot(dev)].quota = quota;
    pthread_mutex_unlock(&gs_mem_mu);
}

void gs_mem_set_pool(CUdevice dev, uint64_t pool)
{
    pthread_mutex_lock(&gs_mem_mu);
    gs_mem_acct[gs_mem_slot(dev)].pool = pool;
    pthread_mutex_unlock(&gs_mem_mu);
}

void gs_mem_set_room(CUdevice dev, uint64_t room)
{
    pthread_mutex_lock(&gs_mem_mu);
    for (int i = 0; i < GS_MEM_DEVICES; i++)
        if (dev == GS_MEM_ALL_DEVICES || i == gs_mem_slot(dev)) {
            gs_mem_acct[i].room = room;
            /* A grant with a room: the room the last REQUEST was short of is made (a release
             * forgets the room, room 0, and keeps the shortfall for the REQUEST that follows). */
            if (room)
                gs_mem_acct[i].short_bytes = 0;
        }
    pthread_mutex_unlock(&gs_mem_mu);
}

int gs_mem_has_room_on(CUdevice dev)
{
    pthread_mutex_lock(&gs_mem_mu);
    int has = gs_mem_acct[gs_mem_slot(dev)].room != 0;
    pthread_mutex_unlock(&gs_mem_mu);
    return has;
}

void gs_mem_note_short(CUdevice dev, uint64_t wanted, uint64_t driver_free)
{
    /* At least what was wanted less what the driver had free; all of it when the driver had
     * "enough" (fragmentation, or memory freed between the refusal and the question). */
    uint64_t short_by = wanted > driver_free ? wanted - driver_free : wanted;
    pthread_mutex_lock(&gs_mem_mu);
    struct gs_mem_account *a = &gs_mem_acct[gs_mem_slot(dev)];
    if (short_by > a->short_bytes)
        a->short_bytes = short_by;
    gs_mem_changed_locked();
    pthread_mutex_unlock(&gs_mem_mu);
}

int gs_mem_past_room_on(CUdevice dev, uint64_t *backed, uint64_t *room)
{
    pthread_mutex_lock(&gs_mem_mu);
    const struct gs_mem_account *a = &gs_mem_acct[gs_mem_slot(dev)];
    uint64_t off = a->evicted + a->engine_evicted;
    uint64_t in_use = used_locked(a) + a->reserved;
    *backed = in_use > off ? in_use - off : 0;
    *room = a->room;
    pthread_mutex_unlock(&gs_mem_mu);
    return *room && *backed > *room;
}

void gs_mem_count_context(CUdevice dev)
{
    pthread_mutex_lock(&gs_mem_mu);
    struct gs_mem_account *a = &gs_mem_acct[gs_mem_slot(dev)];
    int fresh = !a->context;
    if (fresh) {
        a->context = gs_config()->context_bytes;
        gs_mem_changed_locked();
    }
    pthread_mutex_unlock(&gs_mem_mu);
    if (fresh)
        gs_client_wake();
}

/* Reserve `size` bytes on device `dev` against its quota and its pool. On refusal print the one
 * line that says why, and return CUDA_ERROR_OUT_OF_MEMORY: the driver is not called. */
CUresult gs_mem_reserve_on(CUdevice dev, uint64_t size)
{
    pthread_mutex_lock(&gs_mem_mu);
    load_quota_locked();
    struct gs_mem_account *a = &gs_mem_acct[gs_mem_slot(dev)];
    uint64_t in_use = used_locked(a) + a->reserved;
    uint64_t after = in_use + size;
    int over_quota = a->quota && (after > a->quota || after < in_use);
    int over_pool = !over_quota && a->pool && (after > a->pool || after < in_use);
    uint64_t limit = over_quota ? a->quota : a->pool;
    if (!over_quota && !over_pool)
        a->reserved += size;
    pthread_mutex_unlock(&gs_mem_mu);
    if (!over_quota && !over_pool)
        return CUDA_SUCCESS;
    if (gs_log_enabled(GS_LOG_WARN)) {
        char b[32], c[32], d[32], e[32];
        gs_log(GS_LOG_WARN,
               "out of memory: allocating %s would take this process to %s on device %d, "
               "over %s of %s (%s in use)",
               gs_format_size(size, b, sizeof b), gs_format_size(after, c, sizeof c), (int)dev,
               over_quota ? "its quota" : "the GPU's shared pool",
               gs_format_size(limit, d, sizeof d), gs_format_size(in_use, e, sizeof e));
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

void gs_mem_unreserve_on(CUdevice dev, uint64_t size)
{
    pthread_mutex_lock(&gs_mem_mu);
    gs_mem_acct[gs_mem_slot(dev)].reserved -= size;
    pthread_mutex_unlock(&gs_mem_mu);
}

CUresult gs_mem_reserve(uint64_t size) { return gs_mem_reserve_on(gs_mem_current_slot(), size); }

void gs_mem_unreserve(uint64_t size) { gs_mem_unreserve_on(gs_mem_current_slot(), size); }

void gs_mem_engine_account(CUdevice dev, uint64_t reserved, int64_t total_delta,
                           int64_t evicted_delta)
{
    pthread_mutex_lock(&gs_mem_mu);
    struct gs_mem_account *a = &gs_mem_acct[gs_mem_slot(dev)];
    a->reserved -= reserved;
    a->engine += (uint64_t)total_delta;
    a->engine_evicted += (uint64_t)evicted_delta;
    gs_mem_changed_locked();
    pthread_mutex_unlock(&gs_mem_mu);
    gs_client_wake();
}

/* Total as this process may use it on the current context's device: its quota there, else the
 * pool, else what the device has. */
void gs_mem_view(uint64_t real_total, uint64_t *total, uint64_t *free_out, uint64_t *used_out)
{
    int slot = gs_mem_current_slot();
    pthread_mutex_lock(&gs_mem_mu);
    load_quota_locked();
    const struct gs_mem_account *a = &gs_mem_acct[slot];
    uint64_t t = a->quota ? a->quota : a->pool ? a->pool : real_total;
    uint64_t used = used_locked(a);
    pthread_mutex_unlock(&gs_mem_mu);
    *total = t;
    *free_out = t > used ? t - used : 0;
    *used_out = used;
}

/* ---- fork ---- */

void gs_mem_lock_for_fork(void) { pthread_mutex_lock(&gs_mem_mu); }
void gs_mem_unlock_after_fork(void) { pthread_mutex_unlock(&gs_mem_mu); }

void gs_mem_account_after_fork_child(void)
{
    /* The child has no CUDA context: the parent's memory is not its own. */
    pthread_mutex_init(&gs_mem_mu, NULL);
    memset(gs_mem_acct, 0, sizeof gs_mem_acct);
    quota_from_env_loaded = 0;
    gs_mem_changed_locked();
}
