/*
 * The stand-in driver's stream-ordered pools and graph memory (included by fake_libcuda.c, which
 * owns the lock, the allocations and the streams this file uses).
 *
 * Pools: every device has a default pool (its current one until cuDeviceSetMemPool);
 * cuMemPoolCreate makes more. A pool's reserved memory grows with its allocations and stays after
 * cuMemFreeAsync up to its release threshold (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, default 0): the
 * real driver gives the excess back at the next synchronise, this one at the free.
 * cuMemPoolTrimTo lowers it.
 *
 * Graphs: cuGraphCreate, cuGraphAddMemAllocNode / cuGraphAddMemFreeNode, and cuMemAllocAsync /
 * cuMemFreeAsync on a capturing stream (recorded as alloc and free nodes of the capture's graph,
 * with no memory until a launch, as on the real driver). An alloc node's address is fixed when
 * the node is made. Launching an instantiated graph backs its alloc nodes from the device's graph
 * pool (used grows, reserved follows; with AUTO_FREE_ON_LAUNCH the last launch's allocations are
 * freed first, as PyTorch instantiates) and runs its free nodes; cuMemFreeAsync of a graph
 * allocation outside the graph frees it (one whose graph has not run has no memory: its free fails
 * with CUDA_ERROR_INVALID_VALUE, as the H100's driver answered PyTorch); cuDeviceGraphMemTrim
 * gives back what no graph uses.
 * cuDeviceGetGraphMemAttribute and cuMemPoolGetAttribute report the numbers; so do the stats.
 */

#define FK_GRAPH_NODES 64
#define FK_MAX_POOLS 64
#define FK_MAX_EXECS 256

struct CUgraphNode_st {
    int type; /* CU_GRAPH_NODE_TYPE_MEM_ALLOC / _MEM_FREE, 0 for anything else */
    int dev;
    size_t bytes;
    CUdeviceptr dptr;
};

struct CUgraph_st {
    int n;
    struct CUgraphNode_st nodes[FK_GRAPH_NODES];
};
static struct CUgraph_st g_graph; /* what a capture with no memory nodes ends with */

struct CUgraphExec_st {
    struct CUgraph_st g; /* a copy: the graph may be changed or destroyed afterwards */
    unsigned long long flags; /* CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH = 1 */
};
static struct CUgraphExec_st *g_execs[FK_MAX_EXECS];

static struct CUmemPoolHandle_st *g_created_pools[FK_MAX_POOLS];
static int g_ncreated_pools;
static struct CUmemPoolHandle_st *g_current_pool[FK_MAX_DEV];

/* Allocations of pools, so a free knows its pool; live graph allocations. */
struct fk_owned {
    CUdeviceptr base;
    size_t size;
    struct CUmemPoolHandle_st *pool; /* NULL: a graph allocation */
    int dev;
};
static struct fk_owned *g_owned;
static size_t g_nowned, g_capowned;
static unsigned long long g_graph_used[FK_MAX_DEV], g_graph_reserved[FK_MAX_DEV];
static unsigned long long g_graph_used_high[FK_MAX_DEV], g_graph_reserved_high[FK_MAX_DEV];

/* The graph each capturing stream records into. */
static struct {
    struct CUstream_st *s;
    struct CUgraph_st *g;
} g_capture_graphs[64];

static int fk_cur_dev(void) { return cur_ctx() ? cur_ctx()->dev : 0; }

static struct CUmemPoolHandle_st *fk_current_pool(int dev) {
    return g_current_pool[dev] ? g_current_pool[dev] : &g_default_pools[dev];
}

static int fk_pool_ok(struct CUmemPoolHandle_st *p) {
    if (!p || p->destroyed) return 0;
    for (int d = 0; d < FK_MAX_DEV; d++)
        if (p == &g_default_pools[d]) return 1;
    for (int i = 0; i < g_ncreated_pools; i++)
        if (p == g_created_pools[i]) return 1;
    return 0;
}

static void fk_pool_release_excess_locked(struct CUmemPoolHandle_st *p, unsigned long long keep) {
    unsigned long long floor = p->used > keep ? p->used : keep;
    if (p->reserved > floor) p->reserved = floor;
}

/* Caller holds g_lock. */
static struct fk_owned *fk_owned_find_locked(CUdeviceptr p) {
    for (size_t i = 0; i < g_nowned; i++)
        if (g_owned[i].base == p) return &g_owned[i];
    return NULL;
}

static void fk_pool_note_alloc(struct CUmemPoolHandle_st *p, CUdeviceptr base, size_t size) {
    pthread_mutex_lock(&g_lock);
    GROW(g_owned, g_nowned, g_capowned);
    g_owned[g_nowned++] = (struct fk_owned){base, size, p, p->dev};
    p->used += size;
    if (p->used > p->used_high) p->used_high = p->used;
    if (p->used > p->reserved) p->reserved = p->used;
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    pthread_mutex_unlock(&g_lock);
}

/* cuMemFreeAsync outside a capture: 1 when `p` was a graph allocation (freed here). */
static int fk_owned_free(CUdeviceptr p) {
    pthread_mutex_lock(&g_lock);
    struct fk_owned *o = fk_owned_find_locked(p);
    int graph = o && !o->pool;
    if (o) {
        if (o->pool) {
            o->pool->used -= o->size;
            fk_pool_release_excess_locked(o->pool, o->pool->threshold);
        } else {
            g_graph_used[o->dev] -= o->size;
        }
        *o = g_owned[--g_nowned];
    }
    pthread_mutex_unlock(&g_lock);
    return graph;
}

/* ---- capture ---- */

static struct CUgraph_st *fk_capture_graph_locked(struct CUstream_st *s, int make) {
    int free_slot = -1;
    for (int i = 0; i < 64; i++) {
        if (g_capture_graphs[i].s == s) return g_capture_graphs[i].g;
        if (!g_capture_graphs[i].s && free_slot < 0) free_slot = i;
    }
    if (!make || free_slot < 0) return NULL;
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (g) g_capture_graphs[free_slot].s = s, g_capture_graphs[free_slot].g = g;
    return g;
}

static CUresult fk_add_node_locked(struct CUgraph_st *g, int type, size_t bytes, CUdeviceptr dptr,
                                   int dev) {
    if (!g || g->n == FK_GRAPH_NODES) return CUDA_ERROR_OUT_OF_MEMORY;
    g->nodes[g->n++] = (struct CUgraphNode_st){type, dev, bytes, dptr};
    return CUDA_SUCCESS;
}

static CUresult fk_graph_capture_alloc(struct CUstream_st *s, CUdeviceptr *dptr, size_t bytes) {
    if (!dptr || !bytes) return CUDA_ERROR_INVALID_VALUE;
    void *p = map_anon(bytes); /* an address, fixed now; backed (counted) at a launch */
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    CUresult r = fk_add_node_locked(fk_capture_graph_locked(s, 1), CU_GRAPH_NODE_TYPE_MEM_ALLOC,
                                    bytes, (CUdeviceptr)(uintptr_t)p, fk_cur_dev());
    g_captured_launches++;
    pthread_mutex_unlock(&g_lock);
    if (r == CUDA_SUCCESS) *dptr = (CUdeviceptr)(uintptr_t)p;
    return r;
}

static CUresult fk_graph_capture_free(struct CUstream_st *s, CUdeviceptr dptr) {
    pthread_mutex_lock(&g_lock);
    CUresult r = fk_add_node_locked(fk_capture_graph_locked(s, 1), CU_GRAPH_NODE_TYPE_MEM_FREE, 0,
                                    dptr, fk_cur_dev());
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* The capture on `s` ended: its graph (the empty one when it recorded no memory node). */
static CUgraph fk_graph_end_capture(struct CUstream_st *s, int bad) {
    pthread_mutex_lock(&g_lock);
    struct CUgraph_st *g = fk_capture_graph_locked(s, 0);
    for (int i = 0; i < 64; i++)
        if (g_capture_graphs[i].s == s) g_capture_graphs[i].s = NULL;
    pthread_mutex_unlock(&g_lock);
    if (bad) {
        free(g);
        return NULL;
    }
    return g ? g : &g_graph;
}

/* ---- launch ---- */

static int fk_exec_slot(CUgraphExec e) {
    for (int i = 0; i < FK_MAX_EXECS; i++)
        if (e && g_execs[i] == e) return i;
    return -1;
}

/* Back the alloc nodes and run the free nodes of an executable graph this driver made (others:
 * nothing to do). A graph whose allocations are still live cannot be launched again. */
static CUresult fk_exec_launch(CUgraphExec e) {
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_SUCCESS;
    if (fk_exec_slot(e) >= 0) {
        struct CUgraph_st *g = &e->g;
        for (int i = 0; i < g->n && (e->flags & 1); i++) { /* auto-free on launch */
            struct fk_owned *o = fk_owned_find_locked(g->nodes[i].dptr);
            if (g->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && o && !o->pool) {
                g_graph_used[o->dev] -= o->size;
                *o = g_owned[--g_nowned];
            }
        }
        for (int i = 0; i < g->n && !r; i++)
            if (g->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC &&
                fk_owned_find_locked(g->nodes[i].dptr))
                r = CUDA_ERROR_INVALID_VALUE;
        for (int i = 0; i < g->n && !r; i++) {
            struct CUgraphNode_st *n = &g->nodes[i];
            if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
                GROW(g_owned, g_nowned, g_capowned);
                g_owned[g_nowned++] = (struct fk_owned){n->dptr, n->bytes, NULL, n->dev};
                g_graph_used[n->dev] += n->bytes;
                if (g_graph_used[n->dev] > g_graph_reserved[n->dev])
                    g_graph_reserved[n->dev] = g_graph_used[n->dev];
            } else if (n->type == CU_GRAPH_NODE_TYPE_MEM_FREE) {
                struct fk_owned *o = fk_owned_find_locked(n->dptr);
                if (o && !o->pool) {
                    g_graph_used[o->dev] -= o->size;
                    *o = g_owned[--g_nowned];
                }
            }
        }
        for (int d = 0; d < FK_MAX_DEV; d++) {
            if (g_graph_used[d] > g_graph_used_high[d]) g_graph_used_high[d] = g_graph_used[d];
            if (g_graph_reserved[d] > g_graph_reserved_high[d])
                g_graph_reserved_high[d] = g_graph_reserved[d];
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* ---- pools: the API ---- */

CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    *pool = fk_current_pool(dev);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
    COUNT();
    NEED_INIT();
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    int ok = fk_pool_ok(pool) && pool->dev == dev;
    if (ok) g_current_pool[dev] = pool;
    pthread_mutex_unlock(&g_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    COUNT();
    NEED_INIT();
    if (!pool || !props || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        fk_phys(props->location.id) < 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    p->dev = props->location.id;
    pthread_mutex_lock(&g_lock);
    int full = g_ncreated_pools == FK_MAX_POOLS;
    if (!full) g_created_pools[g_ncreated_pools++] = p;
    pthread_mutex_unlock(&g_lock);
    if (full) {
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pool = p;
    return CUDA_SUCCESS;
}

/* The pool's memory goes with it (allocations still live keep theirs until freed). */
CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    COUNT();
    NEED_INIT();
    pthread_mutex_lock(&g_lock);
    int ok = fk_pool_ok(pool) && pool != &g_default_pools[pool->dev];
    if (ok) {
        pool->destroyed = 1;
        pool->reserved = pool->used;
        if (g_current_pool[pool->dev] == pool) g_current_pool[pool->dev] = NULL;
    }
    pthread_mutex_unlock(&g_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    COUNT();
    NEED_INIT();
    pthread_mutex_lock(&g_lock);
    int ok = fk_pool_ok(pool);
    if (ok) fk_pool_release_excess_locked(pool, minBytesToKeep);
    pthread_mutex_unlock(&g_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    COUNT();
    NEED_INIT();
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult r = fk_pool_ok(pool) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    unsigned long long v = 0;
    if (!r) switch (attr) {
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: v = pool->threshold; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: v = pool->reserved; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: v = pool->reserved_high; break;
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: v = pool->used; break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH: v = pool->used_high; break;
        default: r = CUDA_ERROR_INVALID_VALUE;
        }
    pthread_mutex_unlock(&g_lock);
    if (!r) *(cuuint64_t *)value = v;
    return r;
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    COUNT();
    NEED_INIT();
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    cuuint64_t v = *(cuuint64_t *)value;
    pthread_mutex_lock(&g_lock);
    CUresult r = fk_pool_ok(pool) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (!r) switch (attr) {
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
            pool->threshold = v;
            fk_pool_release_excess_locked(pool, v);
            break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: pool->reserved_high = 0; break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH: pool->used_high = 0; break;
        default: r = CUDA_ERROR_INVALID_VALUE;
        }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* ---- graphs: the API ---- */

CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    COUNT();
    NEED_INIT();
    if (!phGraph || flags) return CUDA_ERROR_INVALID_VALUE;
    *phGraph = calloc(1, sizeof **phGraph);
    return *phGraph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuGraphDestroy(CUgraph hGraph) {
    COUNT();
    if (!hGraph) return CUDA_ERROR_INVALID_VALUE;
    if (hGraph != &g_graph) free(hGraph);
    return CUDA_SUCCESS;
}

CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                const CUgraphNode *dependencies, size_t numDependencies,
                                CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams) {
    COUNT();
    NEED_CTX();
    if (!phGraphNode || !hGraph || hGraph == &g_graph || !nodeParams || !nodeParams->bytesize ||
        nodeParams->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        fk_phys(nodeParams->poolProps.location.id) < 0)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = map_anon(nodeParams->bytesize);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    CUresult r = fk_add_node_locked(hGraph, CU_GRAPH_NODE_TYPE_MEM_ALLOC, nodeParams->bytesize,
                                    (CUdeviceptr)(uintptr_t)p, nodeParams->poolProps.location.id);
    if (!r) *phGraphNode = &hGraph->nodes[hGraph->n - 1];
    pthread_mutex_unlock(&g_lock);
    if (!r) nodeParams->dptr = (CUdeviceptr)(uintptr_t)p;
    return r;
}

CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                               const CUgraphNode *dependencies, size_t numDependencies,
                               CUdeviceptr dptr) {
    COUNT();
    NEED_CTX();
    if (!phGraphNode || !hGraph || hGraph == &g_graph || !dptr) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult r = fk_add_node_locked(hGraph, CU_GRAPH_NODE_TYPE_MEM_FREE, 0, dptr, fk_cur_dev());
    if (!r) *phGraphNode = &hGraph->nodes[hGraph->n - 1];
    pthread_mutex_unlock(&g_lock);
    return r;
}

CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes) {
    COUNT();
    if (!hGraph || !numNodes) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    size_t n = (size_t)hGraph->n;
    if (nodes)
        for (size_t i = 0; i < n && i < *numNodes; i++) nodes[i] = &hGraph->nodes[i];
    *numNodes = nodes && *numNodes < n ? *numNodes : n;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuGraphNodeGetType(CUgraphNode hNode, CUgraphNodeType *type) {
    COUNT();
    if (!hNode || !type) return CUDA_ERROR_INVALID_VALUE;
    *type = hNode->type;
    return CUDA_SUCCESS;
}

CUresult cuGraphMemAllocNodeGetParams(CUgraphNode hNode, CUDA_MEM_ALLOC_NODE_PARAMS *params_out) {
    COUNT();
    if (!hNode || !params_out || hNode->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        return CUDA_ERROR_INVALID_VALUE;
    memset(params_out, 0, sizeof *params_out);
    params_out->poolProps.allocType = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    params_out->poolProps.location = (CUmemLocation){CU_MEM_LOCATION_TYPE_DEVICE, hNode->dev};
    params_out->bytesize = hNode->bytes;
    params_out->dptr = hNode->dptr;
    return CUDA_SUCCESS;
}

CUresult cuGraphMemFreeNodeGetParams(CUgraphNode hNode, CUdeviceptr *dptr_out) {
    COUNT();
    if (!hNode || !dptr_out || hNode->type != CU_GRAPH_NODE_TYPE_MEM_FREE)
        return CUDA_ERROR_INVALID_VALUE;
    *dptr_out = hNode->dptr;
    return CUDA_SUCCESS;
}

/* CUDA_GRAPH_INSTANTIATE_PARAMS starts with its flags (a cuuint64_t). */
static unsigned long long params_flags(const CUDA_GRAPH_INSTANTIATE_PARAMS *params) {
    return params ? *(const cuuint64_t *)(const void *)params : 0;
}

static CUresult instantiate(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags) {
    NEED_CTX();
    if (!phGraphExec || !hGraph) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *e = malloc(sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    e->g = *hGraph;
    e->flags = flags;
    int slot = fk_exec_slot(NULL);
    for (int i = 0; i < FK_MAX_EXECS && slot < 0; i++)
        if (!g_execs[i]) slot = i;
    if (slot >= 0) g_execs[slot] = e;
    pthread_mutex_unlock(&g_lock);
    if (slot < 0) {
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *phGraphExec = e;
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags) {
    COUNT();
    return instantiate(phGraphExec, hGraph, flags);
}

CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                      CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    COUNT();
    return instantiate(phGraphExec, hGraph, params_flags(instantiateParams));
}

CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                           CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    COUNT();
    return instantiate(phGraphExec, hGraph, params_flags(instantiateParams));
}

CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                            char *logBuffer, size_t bufferSize) {
    COUNT();
    return instantiate(phGraphExec, hGraph, 0);
}

CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                               char *logBuffer, size_t bufferSize) {
    COUNT();
    return instantiate(phGraphExec, hGraph, 0);
}

CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    COUNT();
    pthread_mutex_lock(&g_lock);
    int slot = fk_exec_slot(hGraphExec);
    if (slot >= 0) g_execs[slot] = NULL;
    pthread_mutex_unlock(&g_lock);
    if (slot < 0) return CUDA_ERROR_INVALID_VALUE;
    free(hGraphExec);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGraphMemTrim(CUdevice device) {
    COUNT();
    NEED_INIT();
    if (fk_phys(device) < 0) return FK_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    g_graph_reserved[device] = g_graph_used[device];
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value) {
    COUNT();
    NEED_INIT();
    if (fk_phys(device) < 0) return FK_ERROR_INVALID_DEVICE;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    unsigned long long v[] = {g_graph_used[device], g_graph_used_high[device],
                              g_graph_reserved[device], g_graph_reserved_high[device]};
    pthread_mutex_unlock(&g_lock);
    if (attr < 0 || attr > 3) return CUDA_ERROR_INVALID_VALUE;
    *(cuuint64_t *)value = v[attr];
    return CUDA_SUCCESS;
}

/* The stats' numbers, over every device and pool. */
static void fk_graph_totals(unsigned long long out[4]) {
    out[0] = out[1] = out[2] = out[3] = 0;
    for (int d = 0; d < FK_MAX_DEV; d++) {
        out[0] += g_default_pools[d].reserved;
        out[1] += g_default_pools[d].used;
        out[2] += g_graph_reserved[d];
        out[3] += g_graph_used[d];
    }
    for (int i = 0; i < g_ncreated_pools; i++) {
        out[0] += g_created_pools[i]->reserved;
        out[1] += g_created_pools[i]->used;
    }
}

#define FK_GRAPH_STATS(APPEND)                                                                   \
    do {                                                                                         \
        unsigned long long t_[4];                                                                \
        fk_graph_totals(t_);                                                                     \
        APPEND("\"pool_reserved_bytes\":%llu,\"pool_used_bytes\":%llu,"                          \
               "\"graph_reserved_bytes\":%llu,\"graph_used_bytes\":%llu,",                       \
               t_[0], t_[1], t_[2], t_[3]);                                                      \
    } while (0)

#define FK_GRAPH_EXPORTS(X)                                                                      \
    X(cuDeviceGetMemPool) X(cuDeviceSetMemPool) X(cuMemPoolCreate) X(cuMemPoolDestroy)           \
    X(cuMemPoolTrimTo) X(cuMemPoolGetAttribute) X(cuMemPoolSetAttribute) X(cuGraphCreate)        \
    X(cuGraphDestroy) X(cuGraphAddMemAllocNode) X(cuGraphAddMemFreeNode) X(cuGraphGetNodes)      \
    X(cuGraphNodeGetType) X(cuGraphMemAllocNodeGetParams) X(cuGraphMemFreeNodeGetParams)         \
    X(cuGraphInstantiateWithFlags) X(cuGraphInstantiateWithParams)                               \
    X(cuGraphInstantiateWithParams_ptsz) X(cuGraphInstantiate) X(cuGraphInstantiate_v2)          \
    X(cuGraphExecDestroy) X(cuDeviceGraphMemTrim) X(cuDeviceGetGraphMemAttribute)

#define FK_GRAPH_PROCS                                                                           \
    {"cuDeviceGetMemPool", 11020, 0, "cuDeviceGetMemPool"},                                      \
    {"cuDeviceSetMemPool", 11020, 0, "cuDeviceSetMemPool"},                                      \
    {"cuMemPoolCreate", 11020, 0, "cuMemPoolCreate"},                                            \
    {"cuMemPoolDestroy", 11020, 0, "cuMemPoolDestroy"},                                          \
    {"cuMemPoolTrimTo", 11020, 0, "cuMemPoolTrimTo"},                                            \
    {"cuMemPoolGetAttribute", 11020, 0, "cuMemPoolGetAttribute"},                                \
    {"cuMemPoolSetAttribute", 11020, 0, "cuMemPoolSetAttribute"},                                \
    {"cuGraphCreate", 10000, 0, "cuGraphCreate"}, {"cuGraphDestroy", 10000, 0, "cuGraphDestroy"}, \
    {"cuGraphAddMemAllocNode", 11040, 0, "cuGraphAddMemAllocNode"},                              \
    {"cuGraphAddMemFreeNode", 11040, 0, "cuGraphAddMemFreeNode"},                                \
    {"cuGraphGetNodes", 10000, 0, "cuGraphGetNodes"},                                            \
    {"cuGraphNodeGetType", 10000, 0, "cuGraphNodeGetType"},                                      \
    {"cuGraphMemAllocNodeGetParams", 11040, 0, "cuGraphMemAllocNodeGetParams"},                  \
    {"cuGraphMemFreeNodeGetParams", 11040, 0, "cuGraphMemFreeNodeGetParams"},                    \
    {"cuGraphInstantiate", 10000, 0, "cuGraphInstantiate"},                                      \
    {"cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2"},                                   \
    {"cuGraphInstantiateWithFlags", 11040, 0, "cuGraphInstantiateWithFlags"},                    \
    {"cuGraphInstantiateWithParams", 12000, 0, "cuGraphInstantiateWithParams"},                  \
    {"cuGraphInstantiateWithParams", 12000, 1, "cuGraphInstantiateWithParams_ptsz"},             \
    {"cuGraphExecDestroy", 10000, 0, "cuGraphExecDestroy"},                                      \
    {"cuDeviceGraphMemTrim", 11040, 0, "cuDeviceGraphMemTrim"},                                  \
    {"cuDeviceGetGraphMemAttribute", 11040, 0, "cuDeviceGetGraphMemAttribute"},
