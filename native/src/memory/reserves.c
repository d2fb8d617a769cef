/*
 * Memory the driver keeps for the process outside the per-allocation table, counted per device
 * as pinned, against the quota and in what the scheduler sees (memory/table.c holds the number):
 *
 *  - Stream-ordered pools. cuMemAllocAsync / cuMemAllocFromPoolAsync are counted per allocation;
 *    after cuMemFreeAsync the pool keeps the memory reserved up to its release threshold (PyTorch's
 *    cudaMallocAsync backend sets it to the maximum, so nothing goes back). What every pool the
 *    process uses holds beyond its live allocations (RESERVED_MEM_CURRENT - USED_MEM_CURRENT) is
 *    counted. An allocation that the pool's idle reserve covers is charged only what it adds.
 *  - Graph memory. A mem-alloc node (cuGraphAddMemAllocNode, or cuMemAllocAsync captured into a
 *    graph) is backed when the graph is launched, from the device's graph pool, which keeps it
 *    until cuDeviceGraphMemTrim. The driver's RESERVED_MEM_CURRENT of graph memory is counted; a
 *    captured allocation is never in the table (it has no memory until a launch), so nothing is
 *    counted twice. memory/graphs.c keeps what each instantiated graph's alloc nodes need, so that
 *    a launch that would take the process over its quota is refused before the driver backs it.
 *
 * The driver is asked at cheap points only: after a pool allocation, free (the graph pool too
 * while graph memory is in use), trim, a context's teardown or a launch of a graph with memory
 * nodes (on the caller's thread), and when the process goes idle. Never on other launches, never from the shim's thread otherwise (a process frozen by
 * a checkpoint blocks every driver call), never while a stream captures (the next cheap point
 * does it).
 */
#include <string.h>

#include "memory.h"

#define MAX_POOLS 64

struct res_pool {
    CUmemoryPool pool;
    CUdevice dev;
};

struct res_device {
    int seen;
    CUmemoryPool current;   /* the device's current pool (cuMemAllocAsync's), once asked */
    uint64_t pool_idle;     /* pools' reserved - used */
    uint64_t graph_reserved, graph_used;
};

static pthread_mutex_t res_mu = PTHREAD_MUTEX_INITIALIZER;
static struct res_pool pools[MAX_POOLS];
static int n_pools;
static struct res_device devs[GS_RESERVE_DEVICES];

typedef CUresult (*pool_attr_fn)(CUmemoryPool, CUmemPool_attribute, void *);
typedef CUresult (*graph_attr_fn)(CUdevice, CUgraphMem_attribute, void *);

/* ---- the driver's numbers ---- */

static int device_ok(CUdevice dev) { return dev >= 0 && dev < GS_RESERVE_DEVICES; }

/* The current context's device: the one a stream-ordered call works on, unless it names an
 * explicit stream of another device's context (then that device's reserve is seen at its next
 * cheap point, and this allocation is charged on the current device). */
static CUdevice current_device(void)
{
    typedef CUresult (*get_device_fn)(CUdevice *);
    static _Atomic(get_device_fn) get;
    get_device_fn fn = atomic_load(&get);
    if (!fn) {
        fn = (get_device_fn)gs_driver_sym("cuCtxGetDevice");
        atomic_store(&get, fn);
    }
    CUdevice dev = 0;
    if (!fn || fn(&dev) != CUDA_SUCCESS)
        return 0;
    return dev;
}

static void push_locked(CUdevice dev)
{
    struct res_device *d = &devs[dev];
    gs_memtab_set_driver_reserve(dev, d->pool_idle + d->graph_reserved);
}

static int track_pool_locked(CUmemoryPool pool, CUdevice dev)
{
    if (!pool || !device_ok(dev))
        return -1;
    devs[dev].seen = 1;
    for (int i = 0; i < n_pools; i++)
        if (pools[i].pool == pool)
            return 0;
    if (n_pools == MAX_POOLS) {
        GS_WARN("more than %d memory pools: the reserve of the others is not counted", MAX_POOLS);
        return -1;
    }
    pools[n_pools++] = (struct res_pool){pool, dev};
    return 0;
}

static void untrack_pool_locked(CUmemoryPool pool)
{
    for (int i = 0; i < n_pools; i++)
        if (pools[i].pool == pool)
            pools[i--] = pools[--n_pools];
    for (int d = 0; d < GS_RESERVE_DEVICES; d++)
        if (devs[d].current == pool)
            devs[d].current = NULL;
}

/* The device's current pool, asked of the driver once (cuDeviceSetMemPool is hooked). */
static void note_current_pool(CUdevice dev)
{
    pthread_mutex_lock(&res_mu);
    int known = devs[dev].current != NULL;
    devs[dev].seen = 1;
    pthread_mutex_unlock(&res_mu);
    if (known)
        return;
    typedef CUresult (*get_pool_fn)(CUmemoryPool *, CUdevice);
    get_pool_fn get = (get_pool_fn)gs_driver_sym("cuDeviceGetMemPool");
    CUmemoryPool pool = NULL;
    if (!get || get(&pool, dev) != CUDA_SUCCESS || !pool)
        return;
    pthread_mutex_lock(&res_mu);
    devs[dev].current = pool;
    track_pool_locked(pool, dev);
    pthread_mutex_unlock(&res_mu);
}

/* Ask the driver what device `dev`'s pools (and, with `graphs`, its graph pool) hold. Skipped
 * while a stream captures: the next cheap point asks again. */
static void refresh(CUdevice dev, int graphs)
{
    if (!device_ok(dev) || gs_capture_active())
        return;
    static _Atomic(pool_attr_fn) pool_get;
    static _Atomic(graph_attr_fn) graph_get;
    pool_attr_fn pget = atomic_load(&pool_get);
    graph_attr_fn gget = atomic_load(&graph_get);
    if (!pget || !gget) {
        pget = (pool_attr_fn)gs_driver_sym("cuMemPoolGetAttribute");
        gget = (graph_attr_fn)gs_driver_sym("cuDeviceGetGraphMemAttribute");
        atomic_store(&pool_get, pget);
        atomic_store(&graph_get, gget);
    }
    CUmemoryPool mine[MAX_POOLS];
    int n = 0;
    pthread_mutex_lock(&res_mu);
    for (int i = 0; i < n_pools; i++)
        if (pools[i].dev == dev)
            mine[n++] = pools[i].pool;
    pthread_mutex_unlock(&res_mu);
    uint64_t reserved = 0, used = 0;
    for (int i = 0; pget && i < n; i++) {
        cuuint64_t r = 0, u = 0;
        if (pget(mine[i], CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &r) == CUDA_SUCCESS &&
            pget(mine[i], CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &u) == CUDA_SUCCESS) {
            reserved += r;
            used += u;
        }
    }
    cuuint64_t g_reserved = 0, g_used = 0;
    int graph_ok = graphs && gget &&
                   gget(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &g_reserved) == CUDA_SUCCESS &&
                   gget(dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &g_used) == CUDA_SUCCESS;
    pthread_mutex_lock(&res_mu);
    struct res_device *d = &devs[dev];
    d->seen = 1;
    d->pool_idle = reserved > used ? reserved - used : 0;
    if (graph_ok) {
        d->graph_reserved = g_reserved;
        d->graph_used = g_used;
    }
    push_locked(dev);
    pthread_mutex_unlock(&res_mu);
}

/* Every device the process used pools or graphs on (at idle; after trims). */
void gs_reserves_refresh(void)
{
    for (CUdevice dev = 0; dev < GS_RESERVE_DEVICES; dev++) {
        pthread_mutex_lock(&res_mu);
        int seen = devs[dev].seen;
        pthread_mutex_unlock(&res_mu);
        if (seen)
            refresh(dev, 1);
    }
}

/* ---- stream-ordered allocations ---- */

/* Take up to `bytes` of the device's idle pool reserve for an allocation the pool will serve
 * from it: those bytes are counted already. */
static uint64_t take_idle(CUdevice dev, uint64_t bytes)
{
    if (!device_ok(dev))
        return 0;
    pthread_mutex_lock(&res_mu);
    struct res_device *d = &devs[dev];
    uint64_t taken = bytes < d->pool_idle ? bytes : d->pool_idle;
    d->pool_idle -= taken;
    if (taken)
        push_locked(dev);
    pthread_mutex_unlock(&res_mu);
    return taken;
}

static void give_back_idle(CUdevice dev, uint64_t taken)
{
    if (!taken)
        return;
    pthread_mutex_lock(&res_mu);
    devs[dev].pool_idle += taken;
    push_locked(dev);
    pthread_mutex_unlock(&res_mu);
}

/* Would `need` more bytes of graph memory on `dev` fit the quota? What the graph pool holds idle
 * is counted already. On success *held bytes stay reserved against the quota until released. */
static CUresult graph_reserve(CUdevice dev, uint64_t need, uint64_t *held)
{
    *held = 0;
    uint64_t idle = 0;
    if (device_ok(dev)) {
        pthread_mutex_lock(&res_mu);
        struct res_device *d = &devs[dev];
        d->seen = 1;
        idle = d->graph_reserved > d->graph_used ? d->graph_reserved - d->graph_used : 0;
        pthread_mutex_unlock(&res_mu);
    }
    if (need <= idle)
        return CUDA_SUCCESS;
    CUresult r = gs_mem_reserve_on(dev, need - idle); /* against that device's quota */
    if (r == CUDA_SUCCESS)
        *held = need - idle;
    return r;
}

static CUresult graph_fits(CUdevice dev, uint64_t need)
{
    uint64_t held;
    CUresult r = graph_reserve(dev, need, &held);
    gs_reserves_release(dev, held);
    return r;
}

typedef CUresult (*alloc_call)(const void *real, CUdeviceptr *dptr, size_t bytes,
                               CUmemoryPool pool, CUstream s);

static CUresult call_async(const void *real, CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                           CUstream s)
{
    return ((gs_fn_cuMemAllocAsync)real)(dptr, bytes, s);
}

static CUresult call_from_pool(const void *real, CUdeviceptr *dptr, size_t bytes,
                               CUmemoryPool pool, CUstream s)
{
    return ((gs_fn_cuMemAllocFromPoolAsync)real)(dptr, bytes, pool, s);
}

/* Stream-ordered pools cannot hand out managed memory: pass through, count as pinned. Captured
 * into a graph, the allocation is a mem-alloc node: checked against the quota, counted as graph
 * memory once a launch backs it. */
static CUresult stream_ordered_alloc(alloc_call call, const void *real, CUdeviceptr *dptr,
                                     size_t bytes, CUmemoryPool pool, CUstream s, int per_thread)
{
    if (gs_config()->disabled || !dptr || !bytes)
        return call(real, dptr, bytes, pool, s);
    CUdevice dev = current_device();
    if (gs_capture_stream_capturing(s, per_thread)) {
        CUresult r = graph_fits(dev, bytes);
        return r != CUDA_SUCCESS ? r : call(real, dptr, bytes, pool, s);
    }
    if (device_ok(dev)) {
        if (pool) {
            pthread_mutex_lock(&res_mu);
            track_pool_locked(pool, dev);
            pthread_mutex_unlock(&res_mu);
        } else {
            note_current_pool(dev);
        }
    }
    uint64_t taken = take_idle(dev, bytes);
    CUresult r = gs_memtab_reserve_on(dev, bytes - taken);
    if (r != CUDA_SUCCESS) {
        give_back_idle(dev, taken);
        return r;
    }
    r = gs_memtab_settle_on(dev, call(real, dptr, bytes, pool, s), bytes - taken, dptr, NS_PTR,
                            bytes, KIND_POOL);
    if (r != CUDA_SUCCESS)
        give_back_idle(dev, taken);
    refresh(dev, 0);
    return r;
}

CUresult gs_mem_alloc_async(gs_fn_cuMemAllocAsync real, CUdeviceptr *dptr, size_t bytesize,
                            CUstream hStream)
{
    return stream_ordered_alloc(call_async, (const void *)real, dptr, bytesize, NULL, hStream, 0);
}

CUresult gs_mem_alloc_async_ptsz(gs_fn_cuMemAllocAsync_ptsz real, CUdeviceptr *dptr,
                                 size_t bytesize, CUstream hStream)
{
    return stream_ordered_alloc(call_async, (const void *)real, dptr, bytesize, NULL, hStream, 1);
}

CUresult gs_mem_alloc_from_pool(gs_fn_cuMemAllocFromPoolAsync real, CUdeviceptr *dptr,
                                size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    return stream_ordered_alloc(call_from_pool, (const void *)real, dptr, bytesize, pool, hStream,
                                0);
}

CUresult gs_mem_alloc_from_pool_ptsz(gs_fn_cuMemAllocFromPoolAsync_ptsz real, CUdeviceptr *dptr,
                                     size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    return stream_ordered_alloc(call_from_pool, (const void *)real, dptr, bytesize, pool, hStream,
                                1);
}

/* After cuMemFreeAsync / cuMemFree: the pool keeps what it does not release (memory.c calls
 * this). The freed pointer may also be a graph allocation freed outside its graph (PyTorch frees a
 * graph's output tensors so): the graph pool then keeps it idle, and a later launch is served from
 * it. While the device has graph memory in use, ask the graph pool too, or its used number stays
 * high and launches that fit are refused until the next idle. */
void gs_reserves_after_free(void)
{
    if (gs_config()->disabled)
        return;
    CUdevice dev = current_device();
    int graphs = 0;
    if (device_ok(dev)) {
        pthread_mutex_lock(&res_mu);
        graphs = devs[dev].graph_used > 0;
        pthread_mutex_unlock(&res_mu);
    }
    refresh(dev, graphs);
}

/* ---- the pools themselves ---- */

CUresult gs_mem_pool_create(gs_fn_cuMemPoolCreate real, CUmemoryPool *pool,
                            const CUmemPoolProps *props)
{
    CUresult r = real(pool, props);
    if (r == CUDA_SUCCESS && pool && props && !gs_config()->disabled &&
        props->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        pthread_mutex_lock(&res_mu);
        track_pool_locked(*pool, props->location.id);
        pthread_mutex_unlock(&res_mu);
    }
    return r;
}

static CUdevice device_of_pool(CUmemoryPool pool)
{
    CUdevice dev = -1;
    pthread_mutex_lock(&res_mu);
    for (int i = 0; i < n_pools; i++)
        if (pools[i].pool == pool)
            dev = pools[i].dev;
    pthread_mutex_unlock(&res_mu);
    return dev;
}

CUresult gs_mem_pool_destroy(gs_fn_cuMemPoolDestroy real, CUmemoryPool pool)
{
    CUdevice dev = device_of_pool(pool);
    CUresult r = real(pool);
    if (r == CUDA_SUCCESS && !gs_config()->disabled) {
        pthread_mutex_lock(&res_mu);
        untrack_pool_locked(pool);
        pthread_mutex_unlock(&res_mu);
        refresh(dev, 0);
    }
    return r;
}

CUresult gs_mem_pool_trim(gs_fn_cuMemPoolTrimTo real, CUmemoryPool pool, size_t minBytesToKeep)
{
    CUresult r = real(pool, minBytesToKeep);
    if (r == CUDA_SUCCESS && !gs_config()->disabled)
        refresh(device_of_pool(pool), 0);
    return r;
}

CUresult gs_mem_device_set_pool(gs_fn_cuDeviceSetMemPool real, CUdevice dev, CUmemoryPool pool)
{
    CUresult r = real(dev, pool);
    if (r == CUDA_SUCCESS && !gs_config()->disabled && device_ok(dev)) {
        pthread_mutex_lock(&res_mu);
        devs[dev].current = pool; /* the former one stays tracked: it may still hold memory */
        track_pool_locked(pool, dev);
        pthread_mutex_unlock(&res_mu);
    }
    return r;
}

/* ---- graph memory (memory/graphs.c keeps the graphs) ---- */

CUresult gs_reserves_graph_reserve(CUdevice dev, uint64_t need, uint64_t *held)
{
    return graph_reserve(dev, need, held);
}

void gs_reserves_release(CUdevice dev, uint64_t held)
{
    if (held)
        gs_mem_unreserve_on(dev, held);
}

/* A graph whose alloc nodes need `need` bytes was launched on `dev`, `net` of them still in use
 * when it completes: count that at once, then ask the driver what its graph pool holds. */
void gs_reserves_graph_launched(CUdevice dev, uint64_t need, uint64_t net)
{
    if (!device_ok(dev))
        return;
    pthread_mutex_lock(&res_mu);
    struct res_device *d = &devs[dev];
    if (d->graph_used + need > d->graph_reserved)
        d->graph_reserved = d->graph_used + need;
    d->graph_used += net;
    push_locked(dev);
    pthread_mutex_unlock(&res_mu);
    refresh(dev, 1);
}

void gs_reserves_refresh_device(CUdevice dev) { refresh(dev, 1); }

/* ---- contexts, fork ---- */

/* A context was destroyed or reset (on the program's thread): a reset takes the device's pools'
 * and graph memory with it. Pools belong to the device, not to a context: they stay followed
 * (one that is gone answers nothing and counts nothing); every device is asked again. */
void gs_reserves_context_gone(void)
{
    pthread_mutex_lock(&res_mu);
    for (CUdevice dev = 0; dev < GS_RESERVE_DEVICES; dev++) {
        struct res_device *d = &devs[dev];
        if (!d->seen)
            continue;
        d->current = NULL;
        d->pool_idle = d->graph_reserved = d->graph_used = 0;
        push_locked(dev);
    }
    pthread_mutex_unlock(&res_mu);
    gs_reserves_refresh();
}

void gs_reserves_after_fork_child(void)
{
    pthread_mutex_init(&res_mu, NULL);
    n_pools = 0;
    memset(devs, 0, sizeof devs);
}
