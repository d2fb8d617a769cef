/*
 * The allocation table: every allocation the program made through the driver, counted on the
 * account of its device (memory/account.c) from the driver's answer to its free.
 *
 * Allocation is not the hot path (caching allocators ask the driver rarely), so one mutex
 * (gs_mem_mu) guards the table and the accounts. The quota check reserves the bytes under it
 * before the driver is called, so two threads cannot both squeeze under the quota with the same
 * headroom; it also promises a table slot, so an allocation the driver made is never left
 * uncounted. An allocation counts on the device of the context current when it is made
 * (cuMemCreate: the device its properties name; docs/architecture.md, "Several devices").
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
    uint8_t dev;   /* the account it counts on: gs_mem_slot() of its device */
    uint32_t refs; /* NS_HANDLE: cuMemCreate + cuMemRetainAllocationHandle - cuMemRelease */
    uint32_t maps; /* NS_HANDLE: live cuMemMap mappings of it */
    uint8_t ns;
    uint8_t kind;
    uint8_t evicted;
};

static struct entry *table;
static size_t table_cap, table_len; /* cap: power of two */
static size_t reserved_slots; /* table slots promised to allocations the driver is making */

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
    struct gs_mem_account *a = &gs_mem_acct[e->dev];
    if (e->kind == KIND_MANAGED)
        a->managed += d;
    else if (e->kind != KIND_MAP)
        a->pinned_alloc += d;
    if (e->evicted && sign < 0)
        a->evicted -= e->size;
}

static void insert(uint64_t key, uint8_t ns, uint64_t size, uint8_t kind, int slot)
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
                        .ctx = current_context(), .dev = (uint8_t)slot};
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

/* A reservation for an allocation the table will record: bytes and a table slot. */
CUresult gs_memtab_reserve_on(CUdevice dev, uint64_t size)
{
    pthread_mutex_lock(&gs_mem_mu);
    int no_room = promise_slot_locked() != 0;
    pthread_mutex_unlock(&gs_mem_mu);
    if (no_room) {
        GS_WARN("out of host memory for the allocation table: refusing a device allocation "
                "rather than leaving it uncounted");
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = gs_mem_reserve_on(dev, size);
    if (r != CUDA_SUCCESS) {
        pthread_mutex_lock(&gs_mem_mu);
        reserved_slots--;
        pthread_mutex_unlock(&gs_mem_mu);
    }
    return r;
}

void gs_memtab_unreserve_on(CUdevice dev, uint64_t size)
{
    pthread_mutex_lock(&gs_mem_mu);
    gs_mem_acct[gs_mem_slot(dev)].reserved -= size;
    reserved_slots--;
    pthread_mutex_unlock(&gs_mem_mu);
}

CUresult gs_memtab_reserve(uint64_t size) { return gs_memtab_reserve_on(gs_mem_current_slot(), size); }

void gs_memtab_unreserve(uint64_t size) { gs_memtab_unreserve_on(gs_mem_current_slot(), size); }

/* Settle a reservation once the driver has answered: a success becomes a counted allocation
 * under *key, a failure gives the reserved bytes back. Returns the driver's answer. */
CUresult gs_memtab_settle_on(CUdevice dev, CUresult r, uint64_t reserved,
                             const unsigned long long *key, uint8_t ns, uint64_t size, uint8_t kind)
{
    if (r != CUDA_SUCCESS) {
        gs_memtab_unreserve_on(dev, reserved);
        return r;
    }
    pthread_mutex_lock(&gs_mem_mu);
    int slot = gs_mem_slot(dev);
    gs_mem_acct[slot].reserved -= reserved;
    reserved_slots--;
    insert(*key, ns, size, kind, slot);
    gs_mem_changed_locked();
    pthread_mutex_unlock(&gs_mem_mu);
    gs_client_wake();
    return r;
}

CUresult gs_memtab_settle(CUresult r, uint64_t reserved, const unsigned long long *key, uint8_t ns,
                          uint64_t size, uint8_t kind)
{
    return gs_memtab_settle_on(gs_mem_current_slot(), r, reserved, key, ns, size, kind);
}

void gs_memtab_uncount(uint64_t key, uint8_t ns)
{
    int hit = 0;
    pthread_mutex_lock(&gs_mem_mu);
    struct entry *e = find(key, ns);
    if (e) {
        erase(e);
        gs_mem_changed_locked();
        hit = 1;
    }
    pthread_mutex_unlock(&gs_mem_mu);
    if (hit)
        gs_client_wake();
}

/* The program destroyed a context: what was allocated in it is gone (issue 12, item 4). */
void gs_memtab_forget_context(CUcontext ctx)
{
    int hit = 0;
    pthread_mutex_lock(&gs_mem_mu);
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
        gs_mem_changed_locked();
    pthread_mutex_unlock(&gs_mem_mu);
    if (hit)
        gs_client_wake();
}

/* ---- physical memory of the VMM API: counted until its last release and its last unmap ---- */

void gs_memtab_handle_retained(uint64_t handle)
{
    pthread_mutex_lock(&gs_mem_mu);
    struct entry *e = find(handle, NS_HANDLE);
    if (e)
        e->refs++;
    pthread_mutex_unlock(&gs_mem_mu);
}

/* Drop the handle's entry when nothing holds or maps it any more. Under gs_mem_mu. */
static int drop_if_unused_locked(uint64_t handle)
{
    struct entry *e = find(handle, NS_HANDLE);
    if (!e || e->refs || e->maps)
        return 0;
    erase(e);
    gs_mem_changed_locked();
    return 1;
}

void gs_memtab_handle_released(uint64_t handle)
{
    pthread_mutex_lock(&gs_mem_mu);
    struct entry *e = find(handle, NS_HANDLE);
    if (e && e->refs)
        e->refs--;
    int dropped = drop_if_unused_locked(handle);
    pthread_mutex_unlock(&gs_mem_mu);
    if (dropped)
        gs_client_wake();
}

void gs_memtab_handle_mapped(uint64_t handle, uint64_t ptr, uint64_t size)
{
    pthread_mutex_lock(&gs_mem_mu);
    struct entry *e = find(handle, NS_HANDLE);
    if (e) {
        e->maps++;
        insert(ptr, NS_MAP, size, KIND_MAP, e->dev);
        struct entry *m = find(ptr, NS_MAP);
        if (m)
            m->aux = handle;
    }
    pthread_mutex_unlock(&gs_mem_mu);
}

void gs_memtab_range_unmapped(uint64_t ptr, uint64_t size)
{
    int dropped = 0;
    pthread_mutex_lock(&gs_mem_mu);
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
    pthread_mutex_unlock(&gs_mem_mu);
    if (dropped)
        gs_client_wake();
}

/* ---- managed memory's moves (memory.c prefetches, this file marks) ---- */


static int managed_match(const struct entry *e, int slot, int evicted)
{
    return e->ns == NS_PTR && e->kind == KIND_MANAGED && e->evicted == evicted && e->dev == slot;
}

/* Device `dev`'s managed allocations whose evicted flag equals `evicted`, copied out under the
 * lock. */
struct gs_span *gs_memtab_managed_spans(CUdevice dev, int evicted, size_t *count)
{
    int slot = gs_mem_slot(dev);
    pthread_mutex_lock(&gs_mem_mu);
    size_t n = 0;
    for (size_t i = 0; i < table_cap; i++)
        n += managed_match(&table[i], slot, evicted);
    struct gs_span *s = n ? malloc(n * sizeof *s) : NULL;
    size_t k = 0;
    if (s)
        for (size_t i = 0; i < table_cap && k < n; i++)
            if (managed_match(&table[i], slot, evicted))
                s[k++] = (struct gs_span){table[i].key, table[i].size};
    pthread_mutex_unlock(&gs_mem_mu);
    *count = k;
    return s;
}

/* After prefetching spans[i] (ok[i]: the prefetch was accepted): mark what moved. Returns the
 * bytes of the allocations that are still the ones snapshotted. */
uint64_t gs_memtab_mark_moved(const struct gs_span *spans, const unsigned char *ok, size_t n,
                              int to_host)
{
    uint64_t moved = 0;
    pthread_mutex_lock(&gs_mem_mu);
    for (size_t i = 0; i < n; i++) {
        struct entry *e;
        if (!ok[i] || !(e = find(spans[i].ptr, NS_PTR)) || e->size != spans[i].size ||
            e->kind != KIND_MANAGED)
            continue;
        if (to_host && !e->evicted) {
            e->evicted = 1;
            gs_mem_acct[e->dev].evicted += e->size;
        } else if (!to_host && e->evicted) {
            e->evicted = 0;
            gs_mem_acct[e->dev].evicted -= e->size;
        }
        moved += e->size;
    }
    gs_mem_changed_locked();
    pthread_mutex_unlock(&gs_mem_mu);
    return moved;
}

/* ---- fork ---- */

void gs_memtab_after_fork_child(void)
{
    /* The child has no CUDA context: the parent's allocations are not its own. */
    free(table);
    table = NULL;
    table_cap = table_len = 0;
    reserved_slots = 0;
}
