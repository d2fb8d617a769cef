/*
 * The stand-in driver's cuGetProcAddress (v1 and _v2): the table of every export and of
 * (base name, cudaVersion, per-thread) -> versioned export, as the real driver answers
 * (included by fake_libcuda.c, after every export it names; not compiled alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* cuGetProcAddress                                                                             */
/* ------------------------------------------------------------------------------------------ */

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus);

/* Every export, for the name -> own-address table. */
#define FK_EXPORTS(X)                                                                            \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName)        \
    X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2) X(cuDeviceTotalMem_v2) X(cuDeviceGetAttribute)      \
    X(cuDeviceGetDefaultMemPool) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease_v2)     \
    X(cuDevicePrimaryCtxGetState) X(cuCtxCreate) X(cuCtxCreate_v2) X(cuCtxCreate_v3)             \
    X(cuCtxCreate_v4) X(cuCtxDestroy_v2) X(cuCtxSetCurrent) X(cuCtxGetCurrent)                   \
    X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) X(cuCtxGetDevice) X(cuCtxSynchronize)           \
    X(cuStreamCreate) X(cuStreamCreateWithPriority) X(cuStreamDestroy) X(cuStreamDestroy_v2)     \
    X(cuStreamQuery) X(cuStreamQuery_ptsz) X(cuStreamSynchronize) X(cuStreamSynchronize_ptsz)    \
    X(cuEventCreate) X(cuEventRecord) X(cuEventRecord_ptsz) X(cuEventQuery)                      \
    X(cuEventSynchronize) X(cuEventDestroy_v2) X(cuMemAlloc) X(cuMemGetInfo) X(cuMemAlloc_v2)    \
    X(cuMemAllocPitch_v2) X(cuMemAllocManaged) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz)        \
    X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) X(cuMemFree_v2)                   \
    X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuMemGetAddressRange_v2) X(cuPointerGetAttribute) \
    X(cuMemGetInfo_v2) X(cuMemGetAllocationGranularity) X(cuMemCreate) X(cuMemRelease)           \
    X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)       \
    X(cuMemPrefetchAsync) X(cuMemPrefetchAsync_ptsz) X(cuMemPrefetchAsync_v2)                    \
    X(cuMemPrefetchAsync_v2_ptsz) X(cuMemAdvise) X(cuMemAdvise_v2) X(cuModuleLoadData)           \
    X(cuModuleUnload) X(cuModuleGetFunction) X(cuLaunchKernel) X(cuLaunchKernel_ptsz)            \
    X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz) X(cuLaunchCooperativeKernel)                    \
    X(cuLaunchCooperativeKernel_ptsz) X(cuGraphLaunch) X(cuGraphLaunch_ptsz) X(cuMemcpy)         \
    X(cuMemcpy_ptds) X(cuMemcpyAsync) X(cuMemcpyAsync_ptsz) X(cuMemcpyHtoD_v2)                   \
    X(cuMemcpyHtoD_v2_ptds) X(cuMemcpyDtoH_v2) X(cuMemcpyDtoH_v2_ptds) X(cuMemcpyDtoD_v2)        \
    X(cuMemcpyDtoD_v2_ptds) X(cuMemcpyHtoDAsync_v2) X(cuMemcpyHtoDAsync_v2_ptsz)                 \
    X(cuMemcpyDtoHAsync_v2) X(cuMemcpyDtoHAsync_v2_ptsz) X(cuMemcpyDtoDAsync_v2)                 \
    X(cuMemcpyDtoDAsync_v2_ptsz) X(cuMemcpyPeer) X(cuMemcpyPeer_ptds) X(cuMemcpyPeerAsync)       \
    X(cuMemcpyPeerAsync_ptsz) X(cuMemsetD8_v2) X(cuMemsetD8_v2_ptds) X(cuMemsetD16_v2)           \
    X(cuMemsetD16_v2_ptds) X(cuMemsetD32_v2) X(cuMemsetD32_v2_ptds) X(cuMemsetD8Async)           \
    X(cuMemsetD8Async_ptsz) X(cuMemsetD16Async) X(cuMemsetD16Async_ptsz) X(cuMemsetD32Async)     \
    X(cuMemsetD32Async_ptsz) X(cuGetErrorName) X(cuGetErrorString) X(cuGetProcAddress)           \
    X(cuGetProcAddress_v2) FK_VMM_EXPORTS(X) FK_EXPORTS_CORE(X) FK_GRAPH_EXPORTS(X)

/* Hidden aliases bind inside this library: their addresses are this library's own definitions,
 * whatever a preloaded library exports under the same names. */
#define FK_SELF_ALIAS(name)                                                                      \
    extern __typeof__(name) name##__self __attribute__((alias(#name), visibility("hidden")));
FK_EXPORTS(FK_SELF_ALIAS)

struct fk_symbol {
    const char *name;
    void *addr;
};
#define FK_SYMBOL(name) {#name, (void *)&name##__self},
static const struct fk_symbol g_symbols[] = {FK_EXPORTS(FK_SYMBOL)};

/* (base name, first cudaVersion, per-thread variant?) -> exported symbol, as cudaTypedefs.h's
 * PFN_<base>_v<version>[_ptds|_ptsz] names them. */
struct fk_proc {
    const char *base;
    int version;
    int per_thread;
    const char *symbol;
};
static const struct fk_proc g_procs[] = {
    {"cuInit", 2000, 0, "cuInit"},
    {"cuDriverGetVersion", 2020, 0, "cuDriverGetVersion"},
    {"cuDeviceGet", 2000, 0, "cuDeviceGet"},
    {"cuDeviceGetCount", 2000, 0, "cuDeviceGetCount"},
    {"cuDeviceGetName", 2000, 0, "cuDeviceGetName"},
    {"cuDeviceGetUuid", 9020, 0, "cuDeviceGetUuid"},
    {"cuDeviceGetUuid", 11040, 0, "cuDeviceGetUuid_v2"},
    {"cuDeviceTotalMem", 3020, 0, "cuDeviceTotalMem_v2"},
    {"cuDeviceGetAttribute", 2000, 0, "cuDeviceGetAttribute"},
    {"cuDeviceGetDefaultMemPool", 11020, 0, "cuDeviceGetDefaultMemPool"},
    {"cuDevicePrimaryCtxRetain", 7000, 0, "cuDevicePrimaryCtxRetain"},
    {"cuDevicePrimaryCtxRelease", 11000, 0, "cuDevicePrimaryCtxRelease_v2"},
    {"cuDevicePrimaryCtxGetState", 7000, 0, "cuDevicePrimaryCtxGetState"},
    {"cuCtxCreate", 2000, 0, "cuCtxCreate"},
    {"cuCtxCreate", 3020, 0, "cuCtxCreate_v2"},
    {"cuCtxCreate", 11040, 0, "cuCtxCreate_v3"},
    {"cuCtxCreate", 12050, 0, "cuCtxCreate_v4"},
    {"cuCtxDestroy", 4000, 0, "cuCtxDestroy_v2"},
    {"cuCtxSetCurrent", 4000, 0, "cuCtxSetCurrent"},
    {"cuCtxGetCurrent", 4000, 0, "cuCtxGetCurrent"},
    {"cuCtxPushCurrent", 4000, 0, "cuCtxPushCurrent_v2"},
    {"cuCtxPopCurrent", 4000, 0, "cuCtxPopCurrent_v2"},
    {"cuCtxGetDevice", 2000, 0, "cuCtxGetDevice"},
    {"cuCtxSynchronize", 2000, 0, "cuCtxSynchronize"},
    {"cuStreamCreate", 2000, 0, "cuStreamCreate"},
    {"cuStreamCreateWithPriority", 5050, 0, "cuStreamCreateWithPriority"},
    {"cuStreamDestroy", 2000, 0, "cuStreamDestroy"},
    {"cuStreamDestroy", 4000, 0, "cuStreamDestroy_v2"},
    {"cuStreamQuery", 2000, 0, "cuStreamQuery"},
    {"cuStreamQuery", 7000, 1, "cuStreamQuery_ptsz"},
    {"cuStreamSynchronize", 2000, 0, "cuStreamSynchronize"},
    {"cuStreamSynchronize", 7000, 1, "cuStreamSynchronize_ptsz"},
    {"cuEventCreate", 2000, 0, "cuEventCreate"},
    {"cuEventRecord", 2000, 0, "cuEventRecord"},
    {"cuEventRecord", 7000, 1, "cuEventRecord_ptsz"},
    {"cuEventQuery", 2000, 0, "cuEventQuery"},
    {"cuEventSynchronize", 2000, 0, "cuEventSynchronize"},
    {"cuEventDestroy", 4000, 0, "cuEventDestroy_v2"},
    {"cuMemGetInfo", 2000, 0, "cuMemGetInfo"},
    {"cuMemGetInfo", 3020, 0, "cuMemGetInfo_v2"},
    {"cuMemAlloc", 2000, 0, "cuMemAlloc"},
    {"cuMemAlloc", 3020, 0, "cuMemAlloc_v2"},
    {"cuMemAllocPitch", 3020, 0, "cuMemAllocPitch_v2"},
    {"cuMemAllocManaged", 6000, 0, "cuMemAllocManaged"},
    {"cuMemAllocAsync", 11020, 0, "cuMemAllocAsync"},
    {"cuMemAllocAsync", 11020, 1, "cuMemAllocAsync_ptsz"},
    {"cuMemAllocFromPoolAsync", 11020, 0, "cuMemAllocFromPoolAsync"},
    {"cuMemAllocFromPoolAsync", 11020, 1, "cuMemAllocFromPoolAsync_ptsz"},
    {"cuMemFree", 3020, 0, "cuMemFree_v2"},
    {"cuMemFreeAsync", 11020, 0, "cuMemFreeAsync"},
    {"cuMemFreeAsync", 11020, 1, "cuMemFreeAsync_ptsz"},
    {"cuMemGetAddressRange", 3020, 0, "cuMemGetAddressRange_v2"},
    {"cuPointerGetAttribute", 4000, 0, "cuPointerGetAttribute"},
    {"cuMemGetAllocationGranularity", 10020, 0, "cuMemGetAllocationGranularity"},
    {"cuMemCreate", 10020, 0, "cuMemCreate"},
    {"cuMemRelease", 10020, 0, "cuMemRelease"},
    {"cuMemAddressReserve", 10020, 0, "cuMemAddressReserve"},
    {"cuMemAddressFree", 10020, 0, "cuMemAddressFree"},
    {"cuMemMap", 10020, 0, "cuMemMap"},
    {"cuMemUnmap", 10020, 0, "cuMemUnmap"},
    {"cuMemSetAccess", 10020, 0, "cuMemSetAccess"},
    {"cuMemPrefetchAsync", 8000, 0, "cuMemPrefetchAsync"},
    {"cuMemPrefetchAsync", 8000, 1, "cuMemPrefetchAsync_ptsz"},
    {"cuMemPrefetchAsync", 12020, 0, "cuMemPrefetchAsync_v2"},
    {"cuMemPrefetchAsync", 12020, 1, "cuMemPrefetchAsync_v2_ptsz"},
    {"cuMemAdvise", 8000, 0, "cuMemAdvise"},
    {"cuMemAdvise", 12020, 0, "cuMemAdvise_v2"},
    {"cuModuleLoadData", 2000, 0, "cuModuleLoadData"},
    {"cuModuleUnload", 2000, 0, "cuModuleUnload"},
    {"cuModuleGetFunction", 2000, 0, "cuModuleGetFunction"},
    {"cuLaunchKernel", 4000, 0, "cuLaunchKernel"},
    {"cuLaunchKernel", 7000, 1, "cuLaunchKernel_ptsz"},
    {"cuLaunchKernelEx", 11060, 0, "cuLaunchKernelEx"},
    {"cuLaunchKernelEx", 11060, 1, "cuLaunchKernelEx_ptsz"},
    {"cuLaunchCooperativeKernel", 9000, 0, "cuLaunchCooperativeKernel"},
    {"cuLaunchCooperativeKernel", 9000, 1, "cuLaunchCooperativeKernel_ptsz"},
    {"cuGraphLaunch", 10000, 0, "cuGraphLaunch"},
    {"cuGraphLaunch", 10000, 1, "cuGraphLaunch_ptsz"},
    {"cuMemcpy", 4000, 0, "cuMemcpy"},
    {"cuMemcpy", 7000, 1, "cuMemcpy_ptds"},
    {"cuMemcpyAsync", 4000, 0, "cuMemcpyAsync"},
    {"cuMemcpyAsync", 7000, 1, "cuMemcpyAsync_ptsz"},
    {"cuMemcpyHtoD", 3020, 0, "cuMemcpyHtoD_v2"},
    {"cuMemcpyHtoD", 7000, 1, "cuMemcpyHtoD_v2_ptds"},
    {"cuMemcpyDtoH", 3020, 0, "cuMemcpyDtoH_v2"},
    {"cuMemcpyDtoH", 7000, 1, "cuMemcpyDtoH_v2_ptds"},
    {"cuMemcpyDtoD", 3020, 0, "cuMemcpyDtoD_v2"},
    {"cuMemcpyDtoD", 7000, 1, "cuMemcpyDtoD_v2_ptds"},
    {"cuMemcpyHtoDAsync", 3020, 0, "cuMemcpyHtoDAsync_v2"},
    {"cuMemcpyHtoDAsync", 7000, 1, "cuMemcpyHtoDAsync_v2_ptsz"},
    {"cuMemcpyDtoHAsync", 3020, 0, "cuMemcpyDtoHAsync_v2"},
    {"cuMemcpyDtoHAsync", 7000, 1, "cuMemcpyDtoHAsync_v2_ptsz"},
    {"cuMemcpyDtoDAsync", 3020, 0, "cuMemcpyDtoDAsync_v2"},
    {"cuMemcpyDtoDAsync", 7000, 1, "cuMemcpyDtoDAsync_v2_ptsz"},
    {"cuMemcpyPeer", 4000, 0, "cuMemcpyPeer"},
    {"cuMemcpyPeer", 7000, 1, "cuMemcpyPeer_ptds"},
    {"cuMemcpyPeerAsync", 4000, 0, "cuMemcpyPeerAsync"},
    {"cuMemcpyPeerAsync", 7000, 1, "cuMemcpyPeerAsync_ptsz"},
    {"cuMemsetD8", 3020, 0, "cuMemsetD8_v2"},
    {"cuMemsetD8", 7000, 1, "cuMemsetD8_v2_ptds"},
    {"cuMemsetD16", 3020, 0, "cuMemsetD16_v2"},
    {"cuMemsetD16", 7000, 1, "cuMemsetD16_v2_ptds"},
    {"cuMemsetD32", 3020, 0, "cuMemsetD32_v2"},
    {"cuMemsetD32", 7000, 1, "cuMemsetD32_v2_ptds"},
    {"cuMemsetD8Async", 3020, 0, "cuMemsetD8Async"},
    {"cuMemsetD8Async", 7000, 1, "cuMemsetD8Async_ptsz"},
    {"cuMemsetD16Async", 3020, 0, "cuMemsetD16Async"},
    {"cuMemsetD16Async", 7000, 1, "cuMemsetD16Async_ptsz"},
    {"cuMemsetD32Async", 3020, 0, "cuMemsetD32Async"},
    {"cuMemsetD32Async", 7000, 1, "cuMemsetD32Async_ptsz"},
    {"cuGetErrorName", 6000, 0, "cuGetErrorName"},
    {"cuGetErrorString", 6000, 0, "cuGetErrorString"},
    {"cuGetProcAddress", 11030, 0, "cuGetProcAddress"},
    {"cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"},
    FK_VMM_PROCS
    FK_PROCS_CORE
    FK_GRAPH_PROCS
};

static void *own_symbol(const char *name) {
    for (size_t i = 0; i < sizeof(g_symbols) / sizeof(g_symbols[0]); i++)
        if (strcmp(g_symbols[i].name, name) == 0) return g_symbols[i].addr;
    return NULL;
}

/* The real rule: among the entries for the base name whose version is <= cudaVersion, take the
 * newest; with the per-thread flag a per-thread entry wins over a default one of the same name. */
static CUresult proc_lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                            CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    int known = 0;
    const struct fk_proc *best = NULL, *best_pt = NULL;
    for (size_t i = 0; i < sizeof(g_procs) / sizeof(g_procs[0]); i++) {
        const struct fk_proc *p = &g_procs[i];
        if (strcmp(p->base, symbol) != 0) continue;
        known = 1;
        if (p->version > cudaVersion) continue;
        if (p->per_thread) {
            if (!best_pt || p->version >= best_pt->version) best_pt = p;
        } else {
            if (!best || p->version >= best->version) best = p;
        }
    }
    const struct fk_proc *pick = best;
    if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best_pt &&
        (!best || best_pt->version >= best->version))
        pick = best_pt;
    if (!pick) {
        if (status)
            *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                            : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    void *addr = own_symbol(pick->symbol);
    if (!addr) {
        if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = addr;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    COUNT();
    return proc_lookup(symbol, pfn, cudaVersion, flags, NULL);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus) {
    COUNT();
    return proc_lookup(symbol, pfn, cudaVersion, flags, symbolStatus);
}
