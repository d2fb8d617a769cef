/*
 * CUDA graphs that allocate memory (mem-alloc nodes: cuGraphAddMemAllocNode, or cuMemAllocAsync
 * captured into a graph). The driver backs their memory when the graph is launched, from the
 * device's graph pool (memory/reserves.c counts what that pool holds). This file keeps, for each
 * instantiated graph with alloc nodes, how much its launch needs, so that a launch that would
 * take the process over its quota is refused with the shim's one line, before the driver backs
 * anything. A graph without memory nodes costs its launch one atomic load here.
 *
 * Until a graph has run, its allocations (those not freed inside it) have an address and no
 * memory, and the driver refuses to free one (CUDA_ERROR_INVALID_VALUE). After a launch the shim
 * refused, a program drops the output: PyTorch's cudaMallocAsync deleter turns that error into a
 * terminate. So such a free is answered here, without the driver: there is nothing to free.
 * Should the program launch that graph later all the same, the allocation it dropped is backed
 * and counted as graph memory, and a relaunch with auto-free-on-launch (PyTorch's) frees it.
 */
#include <stdlib.h>

#include "memory.h"

struct exec_need {
    CUgraphExec exec;
    CUdevice dev;
    uint64_t need; /* bytes of its alloc nodes */
    uint64_t net;  /* of those, not freed inside the graph: still allocated after a launch */
    int auto_free; /* instantiated with AutoFreeOnLaunch: a relaunch frees the last one's first */
    int launched;
};

static pthread_mutex_t graphs_mu = PTHREAD_MUTEX_INITIALIZER;
static struct exec_need *execs;
static size_t n_execs, execs_cap;
static atomic_int any_execs; /* read without the lock by every graph launch */

/* Allocations of graphs that have not run (exec NULL: its graph is destroyed, never having run). */
struct unbacked {
    CUdeviceptr dptr;
    CUgraphExec exec;
};
static struct unbacked *unbacked;
static size_t n_unbacked, unbacked_cap;
static atomic_int any_unbacked; /* read without the lock by every free */

static void add_unbacked_locked(CUgraphExec exec, CUdeviceptr dptr)
{
    for (size_t i = 0; i < n_unbacked; i++)
        if (unbacked[i].dptr == dptr) { /* an address a destroyed graph left, given out again */
            unbacked[i].exec = exec;
            return;
        }
    if (n_unbacked == unbacked_cap) {
        size_t cap = unbacked_cap ? unbacked_cap * 2 : 16;
        struct unbacked *grown = realloc(unbacked, cap * sizeof *grown);
        if (!grown)
            return; /* then the driver answers that free, as without the shim */
        unbacked = grown;
        unbacked_cap = cap;
    }
    unbacked[n_unbacked++] = (struct unbacked){dptr, exec};
    atomic_store(&any_unbacked, 1);
}

/* `exec` ran (its allocations have memory now) or is gone (they never will): NULL marks gone. */
static void settle_unbacked_locked(CUgraphExec exec, int ran)
{
    for (size_t i = 0; i < n_unbacked; i++) {
        if (unbacked[i].exec != exec)
            continue;
        if (ran)
            unbacked[i--] = unbacked[--n_unbacked];
        else
            unbacked[i].exec = NULL;
    }
    atomic_store(&any_unbacked, n_unbacked > 0);
}

int gs_graphs_free_unbacked(CUdeviceptr dptr)
{
    if (GS_LIKELY(!atomic_load_explicit(&any_unbacked, memory_order_relaxed)))
        return 0;
    int found = 0;
    pthread_mutex_lock(&graphs_mu);
    for (size_t i = 0; i < n_unbacked && !found; i++)
        if (unbacked[i].dptr == dptr) {
            unbacked[i] = unbacked[--n_unbacked];
            found = 1;
        }
    atomic_store(&any_unbacked, n_unbacked > 0);
    pthread_mutex_unlock(&graphs_mu);
    return found;
}

typedef CUresult (*get_nodes_fn)(CUgraph, CUgraphNode *, size_t *);
typedef CUresult (*node_type_fn)(CUgraphNode, CUgraphNodeType *);
typedef CUresult (*alloc_params_fn)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *);
typedef CUresult (*free_params_fn)(CUgraphNode, CUdeviceptr *);

/* The alloc nodes of `graph` (memory nodes cannot be in child graphs: top level only); those it
 * does not free are remembered as `exec`'s, without memory until it runs. */
static struct exec_need measure(CUgraph graph, CUgraphExec exec)
{
    struct exec_need e = {0};
    get_nodes_fn get_nodes = (get_nodes_fn)gs_driver_sym("cuGraphGetNodes");
    node_type_fn node_type = (node_type_fn)gs_driver_sym("cuGraphNodeGetType");
    alloc_params_fn alloc_params = (alloc_params_fn)gs_driver_sym("cuGraphMemAllocNodeGetParams");
    free_params_fn free_params = (free_params_fn)gs_driver_sym("cuGraphMemFreeNodeGetParams");
    size_t n = 0;
    if (!get_nodes || !node_type || !alloc_params || get_nodes(graph, NULL, &n) != CUDA_SUCCESS ||
        !n)
        return e;
    CUgraphNode *nodes = malloc(n * sizeof *nodes);
    CUdeviceptr *allocs = malloc(n * sizeof *allocs), *frees = malloc(n * sizeof *frees);
    uint64_t *sizes = malloc(n * sizeof *sizes);
    size_t n_allocs = 0, n_frees = 0;
    if (nodes && allocs && frees && sizes && get_nodes(graph, nodes, &n) == CUDA_SUCCESS) {
        for (size_t i = 0; i < n; i++) {
            CUgraphNodeType type = 0;
            if (node_type(nodes[i], &type) != CUDA_SUCCESS)
                continue;
            CUDA_MEM_ALLOC_NODE_PARAMS p;
            if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC &&
                alloc_params(nodes[i], &p) == CUDA_SUCCESS) {
                if (!e.need)
                    e.dev = p.poolProps.location.id;
                e.need += p.bytesize;
                allocs[n_allocs] = p.dptr;
                sizes[n_allocs++] = p.bytesize;
            } else if (type == CU_GRAPH_NODE_TYPE_MEM_FREE && free_params &&
                       free_params(nodes[i], &frees[n_frees]) == CUDA_SUCCESS) {
                n_frees++;
            }
        }
    }
    e.net = e.need;
    pthread_mutex_lock(&graphs_mu);
    for (size_t a = 0; a < n_allocs; a++) {
        size_t f = 0;
        while (f < n_frees && allocs[a] != frees[f])
            f++;
        if (f < n_frees)
            e.net -= sizes[a];
        else
            add_unbacked_locked(exec, allocs[a]);
    }
    pthread_mutex_unlock(&graphs_mu);
    free(nodes);
    free(allocs);
    free(frees);
    free(sizes);
    return e;
}

static struct exec_need *find_locked(CUgraphExec exec)
{
    for (size_t i = 0; i < n_execs; i++)
        if (execs[i].exec == exec)
            return &execs[i];
    return NULL;
}

static void forget(CUgraphExec exec)
{
    pthread_mutex_lock(&graphs_mu);
    struct exec_need *e = find_locked(exec);
    if (e) {
        *e = execs[--n_execs];
        atomic_store(&any_execs, n_execs > 0);
    }
    settle_unbacked_locked(exec, 0);
    pthread_mutex_unlock(&graphs_mu);
}

/* After a successful instantiation: remember what the graph's launches allocate. */
static CUresult instantiated(CUresult r, CUgraphExec *exec, CUgraph graph, uint64_t flags)
{
    if (r != CUDA_SUCCESS || !exec || !*exec || gs_config()->disabled)
        return r;
    forget(*exec); /* a handle the driver reuses */
    struct exec_need e = measure(graph, *exec);
    if (!e.need)
        return r;
    e.exec = *exec;
    e.auto_free = (flags & GS_GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH) != 0;
    pthread_mutex_lock(&graphs_mu);
    if (n_execs == execs_cap) {
        size_t cap = execs_cap ? execs_cap * 2 : 16;
        struct exec_need *grown = realloc(execs, cap * sizeof *grown);
        if (grown) {
            execs = grown;
            execs_cap = cap;
        }
    }
    if (n_execs < execs_cap) {
        execs[n_execs++] = e;
        atomic_store(&any_execs, 1);
    } else {
        GS_WARN("out of host memory: a graph's memory nodes are counted only once it has run");
        settle_unbacked_locked(e.exec, 1); /* its launches are not followed: the driver answers */
    }
    pthread_mutex_unlock(&graphs_mu);
    return r;
}

/* CUDA_GRAPH_INSTANTIATE_PARAMS starts with its flags (a cuuint64_t). */
static uint64_t params_flags(const CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    return params ? *(const cuuint64_t *)(const void *)params : 0;
}

CUresult gs_graph_instantiate_with_flags(gs_fn_cuGraphInstantiateWithFlags real,
                                         CUgraphExec *phGraphExec, CUgraph hGraph,
                                         unsigned long long flags)
{
    return instantiated(real(phGraphExec, hGraph, flags), phGraphExec, hGraph, flags);
}

CUresult gs_graph_instantiate_with_params(gs_fn_cuGraphInstantiateWithParams real,
                                          CUgraphExec *phGraphExec, CUgraph hGraph,
                                          CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    return instantiated(real(phGraphExec, hGraph, instantiateParams), phGraphExec, hGraph,
                        params_flags(instantiateParams));
}

CUresult gs_graph_instantiate_with_params_ptsz(gs_fn_cuGraphInstantiateWithParams_ptsz real,
                                               CUgraphExec *phGraphExec, CUgraph hGraph,
                                               CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    return instantiated(real(phGraphExec, hGraph, instantiateParams), phGraphExec, hGraph,
                        params_flags(instantiateParams));
}

/* The pre-11.4 ABI (cuGraphInstantiate, cuGraphInstantiate_v2): same signature, one handler. */
CUresult gs_graph_instantiate_v1(gs_fn_cuGraphInstantiate_v2 real, CUgraphExec *phGraphExec,
                                 CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer,
                                 size_t bufferSize)
{
    return instantiated(real(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize),
                        phGraphExec, hGraph, 0);
}

CUresult gs_graph_exec_destroy(gs_fn_cuGraphExecDestroy real, CUgraphExec hGraphExec)
{
    CUresult r = real(hGraphExec);
    if (r == CUDA_SUCCESS && !gs_config()->disabled)
        forget(hGraphExec);
    return r;
}

/* An alloc node is not backed until a launch: refused here only when it alone cannot fit. */
CUresult gs_graph_add_mem_alloc_node(gs_fn_cuGraphAddMemAllocNode real, CUgraphNode *phGraphNode,
                                     CUgraph hGraph, const CUgraphNode *dependencies,
                                     size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    if (!gs_config()->disabled && nodeParams && nodeParams->bytesize) {
        uint64_t held;
        CUdevice dev = nodeParams->poolProps.location.id;
        CUresult r = gs_reserves_graph_reserve(dev, nodeParams->bytesize, &held);
        gs_reserves_release(dev, held);
        if (r != CUDA_SUCCESS)
            return r;
    }
    return real(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
}

CUresult gs_graph_mem_trim(gs_fn_cuDeviceGraphMemTrim real, CUdevice device)
{
    CUresult r = real(device);
    if (r == CUDA_SUCCESS && !gs_config()->disabled)
        gs_reserves_refresh_device(device);
    return r;
}

/* ---- launches (hook.c: before the gate, and after the driver answered) ---- */

CUresult gs_mem_graph_launch_check(CUgraphExec exec, uint64_t *held)
{
    *held = 0;
    if (GS_LIKELY(!atomic_load_explicit(&any_execs, memory_order_relaxed)) ||
        gs_config()->disabled)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&graphs_mu);
    struct exec_need *e = find_locked(exec);
    struct exec_need copy = e ? *e : (struct exec_need){0};
    pthread_mutex_unlock(&graphs_mu);
    if (!copy.need)
        return CUDA_SUCCESS;
    /* A relaunch that frees the last launch's allocations first reuses their memory. */
    uint64_t reused = copy.auto_free && copy.launched ? copy.net : 0;
    return gs_reserves_graph_reserve(copy.dev, copy.need - reused, held);
}

void gs_mem_graph_launched(CUgraphExec exec, CUresult r, uint64_t held)
{
    if (GS_LIKELY(!held && !atomic_load_explicit(&any_execs, memory_order_relaxed)))
        return;
    pthread_mutex_lock(&graphs_mu);
    struct exec_need *e = find_locked(exec);
    struct exec_need copy = e ? *e : (struct exec_need){0};
    if (e && r == CUDA_SUCCESS && !e->launched) {
        e->launched = 1;
        settle_unbacked_locked(exec, 1);
    }
    pthread_mutex_unlock(&graphs_mu);
    /* Counted as graph memory before the reservation goes, so no allocation slips between. */
    uint64_t reused = copy.auto_free && copy.launched ? copy.net : 0;
    if (r == CUDA_SUCCESS && copy.need)
        gs_reserves_graph_launched(copy.dev, copy.need - reused, copy.net - reused);
    gs_reserves_release(copy.dev, held);
}

void gs_graphs_after_fork_child(void)
{
    pthread_mutex_init(&graphs_mu, NULL);
    free(execs);
    execs = NULL;
    n_execs = execs_cap = 0;
    atomic_store(&any_execs, 0);
    free(unbacked);
    unbacked = NULL;
    n_unbacked = unbacked_cap = 0;
    atomic_store(&any_unbacked, 0);
}
