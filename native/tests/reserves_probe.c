/*
 * A test program for the memory the driver keeps outside allocations (native/src/memory/reserves.c,
 * memory/graphs.c), linked against the stand-in driver and run under the shim. One JSON object per
 * line; each step's event carries the driver's return code ("rc"), the status API's numbers
 * ("status") and the driver's own ("driver": the pools' reserved and used bytes on device 0, the
 * graph pool's, on the device RESERVES_DEVICE names, default 0); then the stand-in's stats ("stats") and {"event":"exit","rc":N}. SIZE in bytes.
 *
 *   reserves_probe pool current|created KEEP SIZE N [HOLD]
 *       N stream-ordered allocations of SIZE from the device's current pool (cuMemAllocAsync) or
 *       a created one (cuMemPoolCreate + cuMemAllocFromPoolAsync), with the release threshold at
 *       the maximum when KEEP is 1; all freed ("freed"); cuMemAlloc of SIZE ("alloc_after_free");
 *       cuMemAllocAsync of SIZE again and its free ("reuse"); cuMemPoolTrimTo(0) ("trimmed");
 *       cuMemAlloc of SIZE ("alloc_after_trim"). With HOLD, waits HOLD seconds after "freed"
 *       (event "holding"), for the scheduler's view to be read.
 *   reserves_probe allocnode SIZE
 *       cuGraphAddMemAllocNode of SIZE ("node").
 *   reserves_probe graph SIZE N
 *       a graph of N alloc nodes of SIZE, instantiated ("instantiated") and launched
 *       ("launched"); if that worked, each allocation freed with cuMemFreeAsync ("freed"), then
 *       cuDeviceGraphMemTrim ("trimmed").
 *   reserves_probe capture SIZE INNER LAUNCHES [FLAGS]
 *       a stream capture of one cuMemAllocAsync of SIZE ("captured_alloc", during the capture),
 *       freed inside the capture when INNER is 1; instantiated with FLAGS (1: auto-free on
 *       launch, as PyTorch does) ("instantiated"), launched
 *       LAUNCHES times ("launched": the last one's rc, and how many worked), the allocation freed
 *       after the launches when INNER is 0 ("freed"), cuDeviceGraphMemTrim ("trimmed").
 */
#include "base/cuda_abi.h"
#include "gpushare.h"
#include "probe_events.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamBeginCapture_v2(CUstream, CUstreamCaptureMode);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuDeviceGetMemPool(CUmemoryPool *, CUdevice);
CUresult cuMemPoolCreate(CUmemoryPool *, const CUmemPoolProps *);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
CUresult cuMemPoolGetAttribute(CUmemoryPool, CUmemPool_attribute, void *);
CUresult cuMemPoolSetAttribute(CUmemoryPool, CUmemPool_attribute, void *);
CUresult cuGraphCreate(CUgraph *, unsigned int);
CUresult cuGraphAddMemAllocNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                                CUDA_MEM_ALLOC_NODE_PARAMS *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuDeviceGraphMemTrim(CUdevice);
CUresult cuDeviceGetGraphMemAttribute(CUdevice, CUgraphMem_attribute, void *);

static CUstream g_stream;
static CUmemoryPool g_pool;
static CUdevice g_dev; /* RESERVES_DEVICE: the ordinal everything runs on (default 0) */

/* A step: its rc, the shim's status, and the driver's numbers. */
static void step(const char *event, int rc, const char *extra)
{
    struct gpushare_status st;
    memset(&st, 0, sizeof st);
    int (*get)(struct gpushare_status *, size_t) =
        (int (*)(struct gpushare_status *, size_t))dlsym(RTLD_DEFAULT, "gpushare_get_status");
    if (get)
        get(&st, sizeof st);
    cuuint64_t pr = 0, pu = 0, gr = 0, gu = 0;
    if (g_pool) {
        cuMemPoolGetAttribute(g_pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &pr);
        cuMemPoolGetAttribute(g_pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &pu);
    }
    cuDeviceGetGraphMemAttribute(g_dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &gr);
    cuDeviceGetGraphMemAttribute(g_dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &gu);
    emit(event,
         ",\"rc\":%d,\"status\":{\"used_bytes\":%llu,\"pinned_bytes\":%llu,\"managed_bytes\":%llu,"
         "\"quota_bytes\":%llu},\"driver\":{\"pool_reserved\":%llu,\"pool_used\":%llu,"
         "\"graph_reserved\":%llu,\"graph_used\":%llu}%s",
         rc, (unsigned long long)st.used_bytes, (unsigned long long)st.pinned_bytes,
         (unsigned long long)st.managed_bytes, (unsigned long long)st.quota_bytes,
         (unsigned long long)pr, (unsigned long long)pu, (unsigned long long)gr,
         (unsigned long long)gu, extra ? extra : "");
}

static int setup(void)
{
    CUdevice dev;
    CUcontext ctx;
    const char *ordinal = getenv("RESERVES_DEVICE");
    if (cuInit(0) || cuDeviceGet(&dev, ordinal ? atoi(ordinal) : 0) ||
        cuDevicePrimaryCtxRetain(&ctx, dev) ||
        cuCtxSetCurrent(ctx) || cuStreamCreate(&g_stream, 0)) {
        emit("error", ",\"what\":\"setup\"");
        return 1;
    }
    g_dev = dev;
    return 0;
}

static CUresult pool_alloc(CUdeviceptr *p, size_t size, int created)
{
    return created ? cuMemAllocFromPoolAsync(p, size, g_pool, g_stream)
                   : cuMemAllocAsync(p, size, g_stream);
}

static int scenario_pool(int created, int keep, size_t size, int n, double hold)
{
    if (created) {
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = 1;
        props.location = (CUmemLocation){CU_MEM_LOCATION_TYPE_DEVICE, g_dev};
        if (cuMemPoolCreate(&g_pool, &props))
            return 1;
    } else if (cuDeviceGetMemPool(&g_pool, g_dev)) {
        return 1;
    }
    cuuint64_t max = ~0ull;
    if (keep)
        cuMemPoolSetAttribute(g_pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &max);
    CUdeviceptr p[64];
    int ok = 0, rc = 0;
    for (int i = 0; i < n && i < 64 && !rc; i++)
        if (!(rc = pool_alloc(&p[i], size, created)))
            ok++;
    char extra[64];
    snprintf(extra, sizeof extra, ",\"ok\":%d", ok);
    step("allocated", rc, extra);
    rc = 0;
    for (int i = 0; i < ok; i++)
        rc |= cuMemFreeAsync(p[i], g_stream);
    cuStreamSynchronize(g_stream);
    step("freed", rc, NULL);
    if (hold > 0) {
        emit("holding", NULL);
        struct timespec ts = {(time_t)hold, (long)((hold - (double)(time_t)hold) * 1e9)};
        nanosleep(&ts, NULL);
    }
    CUdeviceptr d = 0;
    rc = cuMemAlloc_v2(&d, size);
    step("alloc_after_free", rc, NULL);
    if (!rc)
        cuMemFree_v2(d);
    rc = pool_alloc(&d, size, created);
    step("reuse", rc, NULL);
    if (!rc)
        cuMemFreeAsync(d, g_stream);
    rc = cuMemPoolTrimTo(g_pool, 0);
    step("trimmed", rc, NULL);
    rc = cuMemAlloc_v2(&d, size);
    step("alloc_after_trim", rc, NULL);
    if (!rc)
        cuMemFree_v2(d);
    return 0;
}

static CUDA_MEM_ALLOC_NODE_PARAMS node_params(size_t size)
{
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.poolProps.allocType = 1;
    p.poolProps.location = (CUmemLocation){CU_MEM_LOCATION_TYPE_DEVICE, g_dev};
    p.bytesize = size;
    return p;
}

static int scenario_allocnode(size_t size)
{
    CUgraph g;
    CUgraphNode node;
    if (cuGraphCreate(&g, 0))
        return 1;
    CUDA_MEM_ALLOC_NODE_PARAMS p = node_params(size);
    step("node", cuGraphAddMemAllocNode(&node, g, NULL, 0, &p), NULL);
    return 0;
}

static int scenario_graph(size_t size, int n)
{
    CUgraph g;
    CUgraphExec exec;
    CUgraphNode node;
    CUdeviceptr ptrs[64];
    if (cuGraphCreate(&g, 0))
        return 1;
    int rc = 0;
    for (int i = 0; i < n && i < 64 && !rc; i++) {
        CUDA_MEM_ALLOC_NODE_PARAMS p = node_params(size);
        rc = cuGraphAddMemAllocNode(&node, g, NULL, 0, &p);
        ptrs[i] = p.dptr;
    }
    if (!rc)
        rc = cuGraphInstantiateWithFlags(&exec, g, 0);
    step("instantiated", rc, NULL);
    if (rc)
        return 1;
    rc = cuGraphLaunch(exec, g_stream);
    step("launched", rc, NULL);
    if (rc)
        return 0;
    int frc = 0;
    for (int i = 0; i < n && i < 64; i++)
        frc |= cuMemFreeAsync(ptrs[i], g_stream);
    step("freed", frc, NULL);
    step("trimmed", cuDeviceGraphMemTrim(g_dev), NULL);
    return 0;
}

/* One graph allocates `first` bytes and is launched; its allocation is freed outside the graph
 * (as PyTorch frees a graph's output tensor); then a second graph allocating `second` bytes is
 * launched: the graph pool serves it from what the first left idle. */
static int scenario_regraph(size_t first, size_t second)
{
    CUgraph g1, g2;
    CUgraphExec e1, e2;
    CUgraphNode node;
    CUDA_MEM_ALLOC_NODE_PARAMS p1 = node_params(first), p2 = node_params(second);
    if (cuGraphCreate(&g1, 0) || cuGraphAddMemAllocNode(&node, g1, NULL, 0, &p1) ||
        cuGraphInstantiateWithFlags(&e1, g1, 0) || cuGraphCreate(&g2, 0) ||
        cuGraphAddMemAllocNode(&node, g2, NULL, 0, &p2) ||
        cuGraphInstantiateWithFlags(&e2, g2, 0))
        return 1;
    int rc = cuGraphLaunch(e1, g_stream);
    step("first_launched", rc, NULL);
    if (rc)
        return 1;
    step("freed_outside", cuMemFreeAsync(p1.dptr, g_stream), NULL);
    step("second_launched", cuGraphLaunch(e2, g_stream), NULL);
    return 0;
}

/* A captured allocation of `size` whose launch is refused (`other` bytes allocated meanwhile),
 * then dropped, as PyTorch drops a graph's output tensor (after the graph itself with
 * `destroy_first`). Then, room made, a second capture of the same size is launched and freed. */
static int scenario_unbacked(size_t size, size_t other, int destroy_first)
{
    CUgraph g;
    CUgraphExec exec;
    CUdeviceptr d = 0, o = 0;
    if (cuStreamBeginCapture_v2(g_stream, CU_STREAM_CAPTURE_MODE_GLOBAL) ||
        cuMemAllocAsync(&d, size, g_stream) || cuStreamEndCapture(g_stream, &g) ||
        cuGraphInstantiateWithFlags(&exec, g, 1) || cuMemAlloc_v2(&o, other))
        return 1;
    step("refused", cuGraphLaunch(exec, g_stream), NULL);
    if (destroy_first)
        cuGraphExecDestroy(exec);
    step("dropped", cuMemFreeAsync(d, g_stream), NULL);
    cuMemFree_v2(o);
    if (cuStreamBeginCapture_v2(g_stream, CU_STREAM_CAPTURE_MODE_GLOBAL) ||
        cuMemAllocAsync(&d, size, g_stream) || cuStreamEndCapture(g_stream, &g) ||
        cuGraphInstantiateWithFlags(&exec, g, 1))
        return 1;
    step("launched", cuGraphLaunch(exec, g_stream), NULL);
    step("freed", cuMemFreeAsync(d, g_stream), NULL);
    step("trimmed", cuDeviceGraphMemTrim(g_dev), NULL);
    return 0;
}

static int scenario_capture(size_t size, int inner, int launches, unsigned long long flags)
{
    CUgraph g;
    CUgraphExec exec;
    CUdeviceptr d = 0;
    if (cuStreamBeginCapture_v2(g_stream, CU_STREAM_CAPTURE_MODE_GLOBAL))
        return 1;
    int rc = cuMemAllocAsync(&d, size, g_stream);
    step("captured_alloc", rc, NULL);
    if (!rc && inner)
        rc = cuMemFreeAsync(d, g_stream);
    int erc = cuStreamEndCapture(g_stream, &g);
    if (rc || erc) {
        emit("capture_failed", ",\"rc\":%d,\"end_rc\":%d", rc, erc);
        return 0;
    }
    rc = cuGraphInstantiateWithFlags(&exec, g, flags);
    step("instantiated", rc, NULL);
    if (rc)
        return 1;
    int ok = 0;
    for (int i = 0; i < launches; i++)
        if (!(rc = cuGraphLaunch(exec, g_stream)))
            ok++;
    char extra[64];
    snprintf(extra, sizeof extra, ",\"ok\":%d", ok);
    step("launched", rc, extra);
    if (!inner && ok)
        step("freed", cuMemFreeAsync(d, g_stream), NULL);
    step("trimmed", cuDeviceGraphMemTrim(g_dev), NULL);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3 || setup())
        return 2;
    const char *s = argv[1];
    int rc = 2;
    if (!strcmp(s, "pool") && argc >= 6)
        rc = scenario_pool(!strcmp(argv[2], "created"), atoi(argv[3]),
                           (size_t)strtoull(argv[4], NULL, 10), atoi(argv[5]),
                           argc > 6 ? atof(argv[6]) : 0);
    else if (!strcmp(s, "allocnode"))
        rc = scenario_allocnode((size_t)strtoull(argv[2], NULL, 10));
    else if (!strcmp(s, "graph") && argc >= 4)
        rc = scenario_graph((size_t)strtoull(argv[2], NULL, 10), atoi(argv[3]));
    else if (!strcmp(s, "regraph") && argc >= 4)
        rc = scenario_regraph((size_t)strtoull(argv[2], NULL, 10),
                              (size_t)strtoull(argv[3], NULL, 10));
    else if (!strcmp(s, "unbacked") && argc >= 5)
        rc = scenario_unbacked((size_t)strtoull(argv[2], NULL, 10),
                               (size_t)strtoull(argv[3], NULL, 10), atoi(argv[4]));
    else if (!strcmp(s, "capture") && argc >= 5)
        rc = scenario_capture((size_t)strtoull(argv[2], NULL, 10), atoi(argv[3]), atoi(argv[4]),
                              argc > 5 ? strtoull(argv[5], NULL, 10) : 0);
    emit_stats();
    printf("{\"event\":\"exit\",\"rc\":%d,\"pid\":%d}\n", rc, (int)getpid());
    fflush(stdout);
    return rc;
}
