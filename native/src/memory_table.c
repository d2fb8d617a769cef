/*
 * The memory engine's accounting: the allocation table, the quota and the pool, the totals that
 * status and the scheduler see, and the process's view (total, free, used).
 *
 * Allocation is not the hot path (caching allocators ask the driver rarely), so one mutex guards
 * the table and the totals. The quota check reserves the bytes under that mutex before the driver
 * is called, so two threads cannot both squeeze under the quota with the same headroom; it also
 * promises a table slot, so an allocation the driver made is never left uncounted.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory.h"

struct entry {
    uint64_t key;
    uint64_t size;
    uint64_t aux;  /* NS_MAP: the handle mapped there */
    CUcontext ctx; /* current when it was allocated: its memory goes with that context */
    uint32_t refs; /* NS_HANDLE: cuMemCreate + cuMemRetainAllocationHandle - cuMemRelease */
    uint32_t maps; /* NS_HANDLE: live cuMemMap mappings of it */
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
/* Memory the driver keeps for the process outside the table, per device (memory_reserves.c):
 * what stream-ordered pools hold beyond their live allocations, and graph memory. Pinned. */
static uint64_t driver_reserve[GS_RESERVE_DEVICES], driver_reserve_sum;
static atomic_ulong mem_gen;

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

static CUcontext current_context(void)
{
    typedef CUresult (*get_fn)(CUcontext *);
    static get_fn get;
    if (!get)
        get = (get_fn)gs_driver_sym("cuCtxGetCurrent");
    CUcontext c = NULL;
    if (get)
        get(&c);
    return c;
}

static void count_locked(const struct entry *e, int sign)
{
    uint64_t d = sign > 0 ? e->size : (uint64_t)0 - e->size;
    if (e->kind == KIND_MANAGED)
        managed_bytes += d;
    else if (e->kind != KIND_MAP)
        pinned_alloc_bytes += d;
    if (e->evicted && sign < 0)
        evicted_bytes -= e->size;
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
        count_locked(e, -1);
    }
    *e = (struct entry){.key = key, .size = size, .refs = 1, .ns = ns, .kind = kind,
                        .ctx = current_context()};
    count_locked(e, 1);
}

static void erase(struct entry *e)
{
    count_locked(e, -1);
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
    return context_bytes + managed_bytes + pinned_alloc_bytes + engine_bytes + driver_reserve_sum;
}

static void changed_locked(void) { atomic_fetch_add_explicit(&mem_gen, 1, memory_order_relaxed); }

uint64_t gs_mem_generation(void) { return atomic_load_explicit(&mem_gen, memory_order_relaxed); }

void gs_memtab_set_driver_reserve(CUdevice dev, uint64_t bytes)
{
    if (dev < 0 || dev >= GS_RESERVE_DEVICES)
        return;
    pthread_mutex_lock(&mem_mu);
    int changed = driver_reserve[dev] != bytes;
    driver_reserve_sum += bytes - driver_reserve[dev];
    driver_reserve[dev] = bytes;
    if (changed)
        changed_locked();
    pthread_mutex_unlock(&mem_mu);
    if (changed)
        gs_client_wake();
}

void gs_memtab_totals(struct gs_mem_totals *out)
{
    pthread_mutex_lock(&mem_mu);
    load_quota_locked();
    out->used = used_locked();
    out->managed = managed_bytes + engine_bytes;
    out->pinned = context_bytes + pinned_alloc_bytes + driver_reserve_sum;
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
CUresult gs_memtab_reserve(uint64_t size)
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

void gs_memtab_unreserve(uint64_t size)
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
CUresult gs_memtab_settle(CUresult r, uint64_t reserved, const unsigned long long *key, uint8_t ns,
                           uint64_t size, uint8_t kind)
{
    if (r != CUDA_SUCCESS) {
        gs_memtab_unreserve(reserved);
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

void gs_memtab_uncount(uint64_t key, uint8_t ns)
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

/* The program destroyed a context: what was allocated in it is gone (issue 12, item 4). */
void gs_memtab_forget_context(CUcontext ctx)
{
    int hit = 0;
    pthread_mutex_lock(&mem_mu);
    /* Backward-shift deletion only moves entries into the hole at i, so i is looked at again
     * and nothing unvisited is skipped. */
    for (size_t i = 0; i < table_cap;) {
        if (table[i].ns != NS_EMPTY && table[i].ctx == ctx) {
            erase(&table[i]);
            hit = 1;
        } else {
            i++;
        }
    }
    if (hit)
        changed_locked();
    pthread_mutex_unlock(&mem_mu);
    if (hit)
        gs_client_wake();
}

/* ---- physical memory of the VMM API: counted until its last release and its last unmap ---- */

void gs_memtab_handle_retained(uint64_t handle)
{
    pthread_mutex_lock(&mem_mu);
    struct entry *e = find(handle, NS_HANDLE);
    if (e)
        e->refs++;
    pthread_mutex_unlock(&mem_mu);
}

/* Drop the handle's entry when nothing holds or maps it any more. Under mem_mu. */
static int drop_if_unused_locked(uint64_t handle)
{
    struct entry *e = find(handle, NS_HANDLE);
    if (!e || e->refs || e->maps)
        return 0;
    erase(e);
    changed_locked();
    return 1;
}

void gs_memtab_handle_released(uint64_t handle)
{
    pthread_mutex_lock(&mem_mu);
    struct entry *e = find(handle, NS_HANDLE);
    if (e && e->refs)
        e->refs--;
    int dropped = drop_if_unused_locked(handle);
    pthread_mutex_unlock(&mem_mu);
    if (dropped)
        gs_client_wake();
}

void gs_memtab_handle_mapped(uint64_t handle, uint64_t ptr, uint64_t size)
{
    pthread_mutex_lock(&mem_mu);
    struct entry *e = find(handle, NS_HANDLE);
    if (e) {
        e->maps++;
        insert(ptr, NS_MAP, size, KIND_MAP);
        struct entry *m = find(ptr, NS_MAP);
        if (m)
            m->aux = handle;
    }
    pthread_mutex_unlock(&mem_mu);
}

void gs_memtab_range_unmapped(uint64_t ptr, uint64_t size)
{
    int dropped = 0;
    pthread_mutex_lock(&mem_mu);
    /* One cuMemUnmap may cover several consecutive mappings. */
    for (uint64_t p = ptr; p < ptr + size;) {
        struct entry *m = find(p, NS_MAP);
        if (!m)
            break;
        uint64_t handle = m->aux, len = m->size;
        erase(m);
        struct entry *e = find(handle, NS_HANDLE);
        if (e && e->maps)
            e->maps--;
        dropped |= drop_if_unused_locked(handle);
        if (!len)
            break;
        p += len;
    }
    pthread_mutex_unlock(&mem_mu);
    if (dropped)
        gs_client_wake();
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

/* ---- managed memory's moves (memory.c prefetches, this file marks) ---- */


/* Managed allocations whose evicted flag equals `evicted`, copied out under the lock. */
struct gs_span *gs_memtab_managed_spans(int evicted, size_t *count)
{
    pthread_mutex_lock(&mem_mu);
    size_t n = 0;
    for (size_t i = 0; i < table_cap; i++)
        if (table[i].ns == NS_PTR && table[i].kind == KIND_MANAGED && table[i].evicted == evicted)
            n++;
    struct gs_span *s = n ? malloc(n * sizeof *s) : NULL;
    size_t k = 0;
    if (s)
        for (size_t i = 0; i < table_cap && k < n; i++)
            if (table[i].ns == NS_PTR && table[i].kind == KIND_MANAGED &&
                table[i].evicted == evicted)
                s[k++] = (struct gs_span){table[i].key, table[i].size};
    pthread_mutex_unlock(&mem_mu);
    *count = k;
    return s;
}

/* After prefetching spans[i] (ok[i]: the prefetch was accepted): mark what moved. Returns the
 * bytes of the allocations that are still the ones snapshotted. */
uint64_t gs_memtab_mark_moved(const struct gs_span *spans, const unsigned char *ok, size_t n,
                              int to_host)
{
    uint64_t moved = 0;
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
        moved += e->size;
    }
    changed_locked();
    pthread_mutex_unlock(&mem_mu);
    return moved;
}

/* ---- fork ---- */

void gs_mem_lock_for_fork(void) { pthread_mutex_lock(&mem_mu); }
void gs_mem_unlock_after_fork(void) { pthread_mutex_unlock(&mem_mu); }

void gs_memtab_after_fork_child(void)
{
    /* The child has no CUDA context: the parent's allocations are not its own. */
    pthread_mutex_init(&mem_mu, NULL);
    free(table);
    table = NULL;
    table_cap = table_len = 0;
    managed_bytes = pinned_alloc_bytes = evicted_bytes = reserved_bytes = context_bytes = 0;
    engine_bytes = engine_evicted = 0;
    memset(driver_reserve, 0, sizeof driver_reserve);
    driver_reserve_sum = 0;
    reserved_slots = 0;
    pool_bytes = 0;
    quota_from_env_loaded = 0;
    changed_locked();
}
