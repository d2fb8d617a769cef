/*
 * A test driver that reaches the CUDA driver the way the CUDA runtime (cudart >= 11.3) does: it does
 * not link libcuda, it dlopen()s libcuda.so.1, dlsym()s cuGetProcAddress_v2 (or cuGetProcAddress
 * with --getproc v1) and asks it for every entry point by base name, CUDA version and flags. Built
 * with -DCUDART_LIKE_DIRECT it links libcuda instead and calls the exported versioned symbols (the
 * exported-symbol door).
 *
 *   cudart_like [--cuda-version N] [--ptds] [--getproc v1|v2] [--null-stream] [--sigint-handler]
 *               SCENARIO [ARGS...]
 *
 * It prints one JSON object per line; every line has "event", "t_mono" (CLOCK_MONOTONIC seconds),
 * "t_real" (CLOCK_REALTIME seconds) and "pid". The last lines are {"event":"stats",...} (the stand-in
 * driver's counters, when it is the driver) and {"event":"exit","rc":N}.
 *
 * Scenarios:
 *   resolve                     resolve every entry point; print which library and symbol each is
 *   dlsym                       dlsym() every exported versioned symbol from the libcuda handle
 *   meminfo [BYTES]             cuMemGetInfo and NVML before and after allocating BYTES
 *   alloc PATH BYTES            allocate through PATH (alloc|pitch|managed|async|pool|create),
 *                               check a data round trip, free
 *   quota BYTES [PATH] [MAX]    allocate BYTES at a time until an allocation fails (at most MAX)
 *   saxpy N                     y = a*x + y through cuLaunchKernel, cuLaunchKernelEx and
 *                               cuLaunchCooperativeKernel; check the numbers on the host
 *   copies N                    every cuMemcpy and cuMemset path, each checked
 *   paths                       every gated entry point once, with the status API's gated_calls and
 *                               the stand-in's call counts before and after
 *   hold SECONDS [BYTES [US [TEMP]]]
 *                               launch "sleep" kernels (US microseconds each) back to back for
 *                               SECONDS after the first launch got through, holding BYTES; with
 *                               TEMP, a scratch buffer of TEMP bytes is allocated and freed twice
 *                               once the device is granted (before the kernels)
 *   grow FIRST BYTES HOLD       launches for FIRST seconds with no memory (a small first cell),
 *                               then allocate BYTES and write them (that copy may wait: memory
 *                               past the grant's room), hold HOLD seconds, read them back; with
 *                               PROBE_GROW_AFTER=FILE it allocates once FILE exists
 *   idle SECONDS [HOLD [BYTES]] hold BYTES for HOLD seconds (default 0.3), then no GPU calls for
 *                               SECONDS
 *   status [BYTES]              allocate, launch once, print gpushare_get_status()
 *   ipc PATH                    allocate 1 MiB through PATH, ask cuIpcGetMemHandle for it
 *   ipc_export BYTES SECONDS [EXTRA]
 *                               allocate BYTES filled with 0x11 (and EXTRA bytes not shared), print
 *                               the IPC handle, then for up to SECONDS watch for an importer's 0x22
 *                               in the last byte and for the importer's close (status: pinned
 *                               bytes back to evictable), with no GPU call meanwhile
 *   ipc_import HANDLE BYTES SECONDS
 *                               open the hex HANDLE, check its first byte is 0x11, write 0x22 in
 *                               byte BYTES-1, hold the import SECONDS, close it
 *   ctx_teardown BYTES          allocate BYTES through alloc, managed and create in a context of
 *                               its own, destroy it, then allocate again in the primary one
 *   precopy_cycle BYTES IDLE1 HOLD2 IDLE2
 *                               fill BYTES with pattern 1, hold briefly, idle IDLE1 s, fill with
 *                               pattern 2, hold HOLD2 s, idle IDLE2 s, then check pattern 2
 *   precopy_pending BYTES IDLE  fill BYTES with pattern 1, hold briefly, queue pattern 2 on a
 *                               non-blocking stream without waiting, idle IDLE s, check pattern 2
 *   deep_idle BYTES IDLE        fill BYTES with pattern 1, hold briefly, no GPU calls for IDLE s
 *                               (ticks with the status), then time the first call (a copy back)
 *                               and check pattern 1
 *   procaddr                    get cuGetProcAddress through cuGetProcAddress_v2 and use it as v1
 */
#include "base/cuda_abi.h"
#include "gpushare.h"

#include <dlfcn.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct CUmod_st *CUmodule;

/* Real layout (cuda.h); cuda_abi.h leaves it opaque. */
struct CUmemAllocationProp_st {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_NONE = 0 */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
};

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} CUmemAccessDesc;

typedef CUresult fn_getproc_v1(const char *, void **, int, cuuint64_t);
typedef CUresult fn_getproc_v2(const char *, void **, int, cuuint64_t,
                               CUdriverProcAddressQueryResult *);
typedef CUresult fn_prefetch_v1(CUdeviceptr, size_t, CUdevice, CUstream);

/* (base name, exported symbol, per-thread exported symbol, parameters) */
#define API(X)                                                                                   \
    X(cuInit, cuInit, cuInit, (unsigned int))                                                    \
    X(cuDriverGetVersion, cuDriverGetVersion, cuDriverGetVersion, (int *))                       \
    X(cuDeviceGet, cuDeviceGet, cuDeviceGet, (CUdevice *, int))                                  \
    X(cuDeviceGetCount, cuDeviceGetCount, cuDeviceGetCount, (int *))                             \
    X(cuDeviceGetName, cuDeviceGetName, cuDeviceGetName, (char *, int, CUdevice))                \
    X(cuDeviceGetUuid, cuDeviceGetUuid_v2, cuDeviceGetUuid_v2, (CUuuid *, CUdevice))             \
    X(cuDeviceTotalMem, cuDeviceTotalMem_v2, cuDeviceTotalMem_v2, (size_t *, CUdevice))          \
    X(cuDeviceGetDefaultMemPool, cuDeviceGetDefaultMemPool, cuDeviceGetDefaultMemPool,           \
      (CUmemoryPool *, CUdevice))                                                                \
    X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain,              \
      (CUcontext *, CUdevice))                                                                   \
    X(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease_v2,     \
      (CUdevice))                                                                                \
    X(cuCtxSetCurrent, cuCtxSetCurrent, cuCtxSetCurrent, (CUcontext))                            \
    X(cuCtxCreate, cuCtxCreate_v4, cuCtxCreate_v4,                                               \
      (CUcontext *, CUctxCreateParams *, unsigned int, CUdevice))                                \
    X(cuCtxDestroy, cuCtxDestroy_v2, cuCtxDestroy_v2, (CUcontext))                               \
    X(cuCtxGetCurrent, cuCtxGetCurrent, cuCtxGetCurrent, (CUcontext *))                          \
    X(cuCtxSynchronize, cuCtxSynchronize, cuCtxSynchronize, (void))                              \
    X(cuStreamCreate, cuStreamCreate, cuStreamCreate, (CUstream *, unsigned int))                \
    X(cuStreamDestroy, cuStreamDestroy_v2, cuStreamDestroy_v2, (CUstream))                       \
    X(cuStreamQuery, cuStreamQuery, cuStreamQuery_ptsz, (CUstream))                              \
    X(cuStreamSynchronize, cuStreamSynchronize, cuStreamSynchronize_ptsz, (CUstream))            \
    X(cuMemGetInfo, cuMemGetInfo_v2, cuMemGetInfo_v2, (size_t *, size_t *))                      \
    X(cuMemAlloc, cuMemAlloc_v2, cuMemAlloc_v2, (CUdeviceptr *, size_t))                         \
    X(cuMemAllocPitch, cuMemAllocPitch_v2, cuMemAllocPitch_v2,                                   \
      (CUdeviceptr *, size_t *, size_t, size_t, unsigned int))                                   \
    X(cuMemAllocManaged, cuMemAllocManaged, cuMemAllocManaged,                                   \
      (CUdeviceptr *, size_t, unsigned int))                                                     \
    X(cuMemAllocAsync, cuMemAllocAsync, cuMemAllocAsync_ptsz, (CUdeviceptr *, size_t, CUstream)) \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz,            \
      (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                                           \
    X(cuMemFree, cuMemFree_v2, cuMemFree_v2, (CUdeviceptr))                                      \
    X(cuMemFreeAsync, cuMemFreeAsync, cuMemFreeAsync_ptsz, (CUdeviceptr, CUstream))              \
    X(cuIpcGetMemHandle, cuIpcGetMemHandle, cuIpcGetMemHandle, (CUipcMemHandle *, CUdeviceptr))  \
    X(cuIpcOpenMemHandle, cuIpcOpenMemHandle_v2, cuIpcOpenMemHandle_v2,                          \
      (CUdeviceptr *, CUipcMemHandle, unsigned int))                                             \
    X(cuIpcCloseMemHandle, cuIpcCloseMemHandle, cuIpcCloseMemHandle, (CUdeviceptr))               \
    X(cuMemRetainAllocationHandle, cuMemRetainAllocationHandle, cuMemRetainAllocationHandle,     \
      (CUmemGenericAllocationHandle *, void *))                                                  \
    X(cuArrayCreate, cuArrayCreate_v2, cuArrayCreate_v2, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *)) \
    X(cuArray3DCreate, cuArray3DCreate_v2, cuArray3DCreate_v2,                                    \
      (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *))                                              \
    X(cuMipmappedArrayCreate, cuMipmappedArrayCreate, cuMipmappedArrayCreate,                    \
      (CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int))                       \
    X(cuArrayDestroy, cuArrayDestroy, cuArrayDestroy, (CUarray))                                 \
    X(cuMipmappedArrayDestroy, cuMipmappedArrayDestroy, cuMipmappedArrayDestroy,                 \
      (CUmipmappedArray))                                                                        \
    X(cuMemCreate, cuMemCreate, cuMemCreate,                                                     \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long)) \
    X(cuMemRelease, cuMemRelease, cuMemRelease, (CUmemGenericAllocationHandle))                  \
    X(cuMemMap, cuMemMap, cuMemMap,                                                              \
      (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))           \
    X(cuMemUnmap, cuMemUnmap, cuMemUnmap, (CUdeviceptr, size_t))                                 \
    X(cuMemAddressReserve, cuMemAddressReserve, cuMemAddressReserve,                             \
      (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                          \
    X(cuMemAddressFree, cuMemAddressFree, cuMemAddressFree, (CUdeviceptr, size_t))               \
    X(cuMemSetAccess, cuMemSetAccess, cuMemSetAccess,                                            \
      (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))                                    \
    X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity,                              \
      cuMemGetAllocationGranularity, (size_t *, const CUmemAllocationProp *, int))               \
    X(cuMemPrefetchAsync, cuMemPrefetchAsync_v2, cuMemPrefetchAsync_v2_ptsz,                     \
      (CUdeviceptr, size_t, CUmemLocation, unsigned int, CUstream))                              \
    X(cuModuleLoadData, cuModuleLoadData, cuModuleLoadData, (CUmodule *, const void *))          \
    X(cuModuleGetFunction, cuModuleGetFunction, cuModuleGetFunction,                             \
      (CUfunction *, CUmodule, const char *))                                                    \
    X(cuLaunchKernel, cuLaunchKernel, cuLaunchKernel_ptsz,                                       \
      (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,         \
       unsigned int, unsigned int, CUstream, void **, void **))                                  \
    X(cuLaunchKernelEx, cuLaunchKernelEx, cuLaunchKernelEx_ptsz,                                 \
      (const CUlaunchConfig *, CUfunction, void **, void **))                                    \
    X(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz,      \
      (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,         \
       unsigned int, unsigned int, CUstream, void **))                                           \
    X(cuGraphLaunch, cuGraphLaunch, cuGraphLaunch_ptsz, (CUgraphExec, CUstream))                 \
    X(cuMemcpy, cuMemcpy, cuMemcpy_ptds, (CUdeviceptr, CUdeviceptr, size_t))                     \
    X(cuMemcpyAsync, cuMemcpyAsync, cuMemcpyAsync_ptsz,                                          \
      (CUdeviceptr, CUdeviceptr, size_t, CUstream))                                              \
    X(cuMemcpyHtoD, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds, (CUdeviceptr, const void *, size_t))  \
    X(cuMemcpyDtoH, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds, (void *, CUdeviceptr, size_t))        \
    X(cuMemcpyDtoD, cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds, (CUdeviceptr, CUdeviceptr, size_t))   \
    X(cuMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz,                        \
      (CUdeviceptr, const void *, size_t, CUstream))                                             \
    X(cuMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz,                        \
      (void *, CUdeviceptr, size_t, CUstream))                                                   \
    X(cuMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz,                        \
      (CUdeviceptr, CUdeviceptr, size_t, CUstream))                                              \
    X(cuMemcpyPeer, cuMemcpyPeer, cuMemcpyPeer_ptds,                                             \
      (CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t))                                  \
    X(cuMemcpyPeerAsync, cuMemcpyPeerAsync, cuMemcpyPeerAsync_ptsz,                              \
      (CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream))                        \
    X(cuMemsetD8, cuMemsetD8_v2, cuMemsetD8_v2_ptds, (CUdeviceptr, unsigned char, size_t))       \
    X(cuMemsetD16, cuMemsetD16_v2, cuMemsetD16_v2_ptds, (CUdeviceptr, unsigned short, size_t))   \
    X(cuMemsetD32, cuMemsetD32_v2, cuMemsetD32_v2_ptds, (CUdeviceptr, unsigned int, size_t))     \
    X(cuMemsetD8Async, cuMemsetD8Async, cuMemsetD8Async_ptsz,                                    \
      (CUdeviceptr, unsigned char, size_t, CUstream))                                            \
    X(cuMemsetD16Async, cuMemsetD16Async, cuMemsetD16Async_ptsz,                                 \
      (CUdeviceptr, unsigned short, size_t, CUstream))                                           \
    X(cuMemsetD32Async, cuMemsetD32Async, cuMemsetD32Async_ptsz,                                 \
      (CUdeviceptr, unsigned int, size_t, CUstream))

#define DECLARE_TYPE(base, sym, ptsym, params) typedef CUresult fn_##base params;
API(DECLARE_TYPE)
#define DECLARE_PTR(base, sym, ptsym, params) static fn_##base *p_##base;
API(DECLARE_PTR)

#ifdef CUDART_LIKE_DIRECT
#define DECLARE_EXTERN(base, sym, ptsym, params) extern fn_##base sym, ptsym;
API(DECLARE_EXTERN)
extern fn_getproc_v1 cuGetProcAddress;
extern fn_getproc_v2 cuGetProcAddress_v2;
#endif

/* ------------------------------------------------------------------------------------------ */
/* Options, output                                                                              */
/* ------------------------------------------------------------------------------------------ */

static int g_version = 12080;
static int g_ptds;
static int g_getproc_v1;
static int g_null_stream;
static volatile sig_atomic_t g_sigints;
static void *g_lib;
static fn_getproc_v1 *g_gpa1;
static fn_getproc_v2 *g_gpa2;

static double clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* emit("name", ",\"k\":%d", v): one JSON line; the format adds fields after the common ones. */
static void emit(const char *event, const char *fmt, ...) {
    char extra[8192] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(extra, sizeof(extra), fmt, ap);
        va_end(ap);
    }
    printf("{\"event\":\"%s\",\"t_mono\":%.6f,\"t_real\":%.6f,\"pid\":%d%s}\n", event,
           clock_s(CLOCK_MONOTONIC), clock_s(CLOCK_REALTIME), (int)getpid(), extra);
    fflush(stdout);
}

static void sleep_s(double s) {
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static int fail(const char *what, CUresult rc) {
    emit("error", ",\"what\":\"%s\",\"rc\":%d", what, rc);
    return 1;
}

#define CHECK(call)                                                                              \
    do {                                                                                         \
        CUresult rc_ = (call);                                                                   \
        if (rc_ != CUDA_SUCCESS) return fail(#call, rc_);                                        \
    } while (0)

/* ------------------------------------------------------------------------------------------ */
/* Helpers from the shim and the stand-in, when they are there                                  */
/* ------------------------------------------------------------------------------------------ */

typedef int fn_status(struct gpushare_status *, size_t);
static fn_status *status_fn(void) {
    return (fn_status *)dlsym(RTLD_DEFAULT, "gpushare_get_status");
}

static void *fake_sym(const char *name) {
    void *p = g_lib ? dlsym(g_lib, name) : NULL;
    return p ? p : dlsym(RTLD_DEFAULT, name);
}

static long fake_count(const char *name) {
    unsigned long (*f)(const char *) = (unsigned long (*)(const char *))fake_sym("fakecuda_call_count");
    return f ? (long)f(name) : -1;
}

static long gated_calls(void) {
    fn_status *f = status_fn();
    struct gpushare_status st;
    if (!f || f(&st, sizeof(st)) != 0) return -1;
    return (long)st.gated_calls;
}

static const char *state_name(uint32_t s) {
    static const char *const names[] = {"inactive", "unshared",  "idle",
                                        "waiting",  "holding",   "releasing", "asleep"};
    return s < 7 ? names[s] : "unknown";
}

/* The status document as JSON fields (",\"status\":{...}" or ",\"status\":null"). */
static void status_fields(char *out, size_t n) {
    fn_status *f = status_fn();
    struct gpushare_status st;
    memset(&st, 0, sizeof(st));
    if (!f) {
        snprintf(out, n, ",\"status\":null");
        return;
    }
    int rc = f(&st, sizeof(st));
    if (rc != 0) {
        snprintf(out, n, ",\"status\":{\"rc\":%d}", rc);
        return;
    }
    snprintf(out, n,
             ",\"status\":{\"rc\":0,\"version\":%u,\"state\":\"%s\",\"state_code\":%u,"
             "\"connected\":%u,\"evicted\":%u,\"used_bytes\":%llu,\"managed_bytes\":%llu,"
             "\"pinned_bytes\":%llu,\"evicted_bytes\":%llu,\"quota_bytes\":%llu,"
             "\"pool_bytes\":%llu,\"gated_calls\":%llu,\"waits\":%llu,\"wait_seconds\":%.6f,"
             "\"current_wait_seconds\":%.6f,\"holding_seconds\":%.6f,\"idle_seconds\":%.6f,"
             "\"client_id\":\"%.127s\",\"socket_path\":\"%.107s\",\"device_uuid\":\"%.47s\","
             "\"precopied_bytes\":%llu,\"staging_pinned_bytes\":%llu,"
             "\"staging_pageable_bytes\":%llu,\"staging_fallbacks\":%llu,\"restores\":%llu,"
             "\"last_restore_bytes\":%llu,\"last_restore_seconds\":%.6f}",
             st.version, state_name(st.state), st.state, st.connected, st.evicted,
             (unsigned long long)st.used_bytes, (unsigned long long)st.managed_bytes,
             (unsigned long long)st.pinned_bytes, (unsigned long long)st.evicted_bytes,
             (unsigned long long)st.quota_bytes, (unsigned long long)st.pool_bytes,
             (unsigned long long)st.gated_calls, (unsigned long long)st.waits, st.wait_seconds,
             st.current_wait_seconds, st.holding_seconds, st.idle_seconds, st.client_id,
             st.socket_path, st.device_uuid, (unsigned long long)st.precopied_bytes,
             (unsigned long long)st.staging_pinned_bytes,
             (unsigned long long)st.staging_pageable_bytes,
             (unsigned long long)st.staging_fallbacks, (unsigned long long)st.restores,
             (unsigned long long)st.last_restore_bytes, st.last_restore_seconds);
}

static void emit_status(const char *event) {
    char buf[2048];
    status_fields(buf, sizeof(buf));
    emit(event, "%s", buf);
}

static void emit_stats(void) {
    int (*f)(char *, size_t) = (int (*)(char *, size_t))fake_sym("fakecuda_stats_json");
    if (!f) {
        emit("stats", ",\"stats\":null");
        return;
    }
    char buf[16384];
    f(buf, sizeof(buf));
    emit("stats", ",\"stats\":%s", buf);
}

/* ------------------------------------------------------------------------------------------ */
/* Resolution                                                                                   */
/* ------------------------------------------------------------------------------------------ */

static uint64_t proc_flags(void) {
    return g_ptds ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
}

static CUresult getproc(const char *name, void **out, int *status) {
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc;
    *out = NULL;
    if (g_getproc_v1) {
        rc = g_gpa1(name, out, g_version, proc_flags());
        st = rc == CUDA_SUCCESS ? CU_GET_PROC_ADDRESS_SUCCESS : st;
    } else {
        rc = g_gpa2(name, out, g_version, proc_flags(), &st);
    }
    if (status) *status = (int)st;
    return rc;
}

static int open_driver(void) {
#ifdef CUDART_LIKE_DIRECT
    g_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    g_gpa1 = cuGetProcAddress;
    g_gpa2 = cuGetProcAddress_v2;
#define ASSIGN(base, sym, ptsym, params) p_##base = g_ptds ? ptsym : sym;
    API(ASSIGN)
#undef ASSIGN
#else
    g_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!g_lib) {
        emit("error", ",\"what\":\"dlopen libcuda.so.1\",\"message\":\"%s\"", dlerror());
        return 1;
    }
    g_gpa2 = (fn_getproc_v2 *)dlsym(g_lib, "cuGetProcAddress_v2");
    g_gpa1 = (fn_getproc_v1 *)dlsym(g_lib, "cuGetProcAddress");
    if (g_getproc_v1 ? !g_gpa1 : !g_gpa2) {
        emit("error", ",\"what\":\"dlsym cuGetProcAddress%s\"", g_getproc_v1 ? "" : "_v2");
        return 1;
    }
#define RESOLVE(base, sym, ptsym, params)                                                        \
    {                                                                                            \
        void *p_;                                                                                \
        getproc(#base, &p_, NULL);                                                               \
        p_##base = (fn_##base *)p_;                                                              \
    }
    API(RESOLVE)
#undef RESOLVE
#endif
    return 0;
}

static int prefetch_is_v2(void) {
#ifdef CUDART_LIKE_DIRECT
    return 1;
#else
    return g_version >= 12020;
#endif
}

/* Where a pointer lives: library basename and nearest exported symbol. */
static void where(void *p, char *out, size_t n) {
    Dl_info info;
    if (!p) {
        snprintf(out, n, "null");
        return;
    }
    if (!dladdr(p, &info) || !info.dli_fname) {
        snprintf(out, n, "{\"lib\":null,\"sym\":null}");
        return;
    }
    const char *base = strrchr(info.dli_fname, '/');
    base = base ? base + 1 : info.dli_fname;
    int exact = info.dli_saddr == p;
    snprintf(out, n, "{\"lib\":\"%s\",\"sym\":%s%s%s,\"exact\":%s}", base,
             info.dli_sname && exact ? "\"" : "", info.dli_sname && exact ? info.dli_sname : "null",
             info.dli_sname && exact ? "\"" : "", exact ? "true" : "false");
}

static int scenario_resolve(void) {
    static const char *const extra[] = {"cuGetProcAddress", "cuCtxCreate", "cuMemAllocHost",
                                        "cuNoSuchFunction", "cuMemPrefetchAsync", "cuMemAlloc",
                                        "cuMemGetInfo",     "cuStreamDestroy"};
    char loc[512];
#define SHOW(base, sym, ptsym, params)                                                           \
    {                                                                                            \
        int st_ = -1;                                                                            \
        void *p_ = NULL;                                                                         \
        CUresult rc_ = 0;                                                                        \
        if (g_lib && !getenv("CUDART_LIKE_NO_GETPROC"))                                          \
            rc_ = getproc(#base, &p_, &st_);                                                     \
        else                                                                                     \
            p_ = (void *)p_##base;                                                               \
        where(p_, loc, sizeof(loc));                                                             \
        emit("resolved",                                                                         \
             ",\"name\":\"%s\",\"rc\":%d,\"symbol_status\":%d,\"where\":%s,\"sym\":\"%s\","            \
             "\"ptsym\":\"%s\"",                                                                  \
             #base, rc_, st_, loc, #sym, #ptsym);                                                \
    }
#ifdef CUDART_LIKE_DIRECT
    setenv("CUDART_LIKE_NO_GETPROC", "1", 1);
#endif
    API(SHOW)
#undef SHOW
#ifndef CUDART_LIKE_DIRECT
    for (size_t i = 0; i < sizeof(extra) / sizeof(extra[0]); i++) {
        void *p = NULL;
        int st = -1;
        CUresult rc = getproc(extra[i], &p, &st);
        where(p, loc, sizeof(loc));
        emit("resolved", ",\"name\":\"%s\",\"rc\":%d,\"symbol_status\":%d,\"where\":%s", extra[i],
             rc, st, loc);
    }
#else
    (void)extra;
#endif
    return 0;
}

/* The dlsym door: each exported versioned symbol looked up by name, as programs that dlopen
 * libcuda without cuGetProcAddress do. */
static int scenario_dlsym(void) {
    char loc[512];
    void *lib = g_lib ? g_lib : dlopen("libcuda.so.1", RTLD_NOW);
#define LOOKUP(base, sym, ptsym, params)                                                         \
    {                                                                                            \
        const char *names_[2] = {#sym, #ptsym};                                                  \
        for (int k_ = 0; k_ < (strcmp(#sym, #ptsym) ? 2 : 1); k_++) {                            \
            where(lib ? dlsym(lib, names_[k_]) : NULL, loc, sizeof(loc));                        \
            emit("dlsym", ",\"name\":\"%s\",\"where\":%s", names_[k_], loc);                   \
        }                                                                                        \
    }
    API(LOOKUP)
#undef LOOKUP
    static const char *const extra[] = {"cuGetProcAddress", "cuGetProcAddress_v2",
                                        "cuMemPrefetchAsync", "cuMemPrefetchAsync_ptsz",
                                        "cuMemAlloc", "cuStreamDestroy"};
    for (size_t i = 0; i < sizeof(extra) / sizeof(extra[0]); i++) {
        where(lib ? dlsym(lib, extra[i]) : NULL, loc, sizeof(loc));
        emit("dlsym", ",\"name\":\"%s\",\"where\":%s", extra[i], loc);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Common set-up: the primary context, a stream, the kernels                                    */
/* ------------------------------------------------------------------------------------------ */

static CUdevice g_dev;
static CUcontext g_ctx;
static CUstream g_stream;
static CUfunction g_k_sleep, g_k_saxpy, g_k_noop;
static int g_graph_dummy;
#define GRAPH ((CUgraphExec)(void *)&g_graph_dummy)

static CUstream work_stream(void) { return g_null_stream ? NULL : g_stream; }

static int setup(void) {
    CHECK(p_cuInit(0));
    CHECK(p_cuDeviceGet(&g_dev, 0));
    CHECK(p_cuDevicePrimaryCtxRetain(&g_ctx, g_dev));
    CHECK(p_cuCtxSetCurrent(g_ctx));
    CHECK(p_cuStreamCreate(&g_stream, 0));
    CUmodule mod;
    CHECK(p_cuModuleLoadData(&mod, "fake module image"));
    CHECK(p_cuModuleGetFunction(&g_k_sleep, mod, "sleep"));
    CHECK(p_cuModuleGetFunction(&g_k_saxpy, mod, "saxpy"));
    CHECK(p_cuModuleGetFunction(&g_k_noop, mod, "noop"));
    return 0;
}

static CUresult launch_sleep(unsigned long long us) {
    void *params[] = {&us};
    return p_cuLaunchKernel(g_k_sleep, 1, 1, 1, 1, 1, 1, 0, work_stream(), params, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* Allocation paths                                                                             */
/* ------------------------------------------------------------------------------------------ */

struct allocation {
    CUdeviceptr ptr;
    size_t size; /* usable bytes */
    size_t mapped;
    CUmemGenericAllocationHandle handle;
    void *array; /* CUarray or CUmipmappedArray */
    int path;
};

enum {
    P_ALLOC, P_PITCH, P_MANAGED, P_ASYNC, P_POOL, P_CREATE,
    /* Ways around a quota that only allocate (no data round trip): */
    P_CREATE_RELEASED, /* cuMemCreate + map, then cuMemRelease while mapped (NCCL's free path) */
    P_CREATE_RETAINED, /* ... then cuMemRetainAllocationHandle + cuMemRelease of that */
    P_ARRAY, P_ARRAY3D, P_MIPMAP,
    P_COUNT
};
static const char *const path_names[P_COUNT] = {
    "alloc", "pitch", "managed", "async", "pool", "create",
    "create_released", "create_retained", "array", "array3d", "mipmap"};

static int path_of(const char *s) {
    for (int i = 0; i < P_COUNT; i++)
        if (strcmp(s, path_names[i]) == 0) return i;
    return -1;
}

static CUresult do_alloc(int path, size_t size, struct allocation *a) {
    memset(a, 0, sizeof(*a));
    a->path = path;
    a->size = size;
    switch (path) {
    case P_ALLOC: return p_cuMemAlloc(&a->ptr, size);
    case P_PITCH: {
        size_t width = 65536, pitch = 0;
        size_t height = (size + width - 1) / width;
        CUresult rc = p_cuMemAllocPitch(&a->ptr, &pitch, width, height, 4);
        if (rc == CUDA_SUCCESS) a->size = pitch * height;
        return rc;
    }
    case P_MANAGED: return p_cuMemAllocManaged(&a->ptr, size, CU_MEM_ATTACH_GLOBAL);
    case P_ASYNC: return p_cuMemAllocAsync(&a->ptr, size, g_stream);
    case P_POOL: {
        CUmemoryPool pool;
        CUresult rc = p_cuDeviceGetDefaultMemPool(&pool, g_dev);
        if (rc) return rc;
        return p_cuMemAllocFromPoolAsync(&a->ptr, size, pool, g_stream);
    }
    case P_CREATE_RELEASED:
    case P_CREATE_RETAINED: {
        CUresult rc = do_alloc(P_CREATE, size, a);
        a->path = path;
        if (rc) return rc;
        if (path == P_CREATE_RETAINED) {
            CUmemGenericAllocationHandle again = 0;
            rc = p_cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)a->ptr);
            if (rc) return rc;
            if (again != a->handle) return CUDA_ERROR_UNKNOWN;
        }
        return p_cuMemRelease(a->handle); /* still mapped: the memory stays */
    }
    case P_ARRAY: {
        /* FLOAT, one channel: 4 bytes an element, rows of 4096 elements. */
        CUDA_ARRAY_DESCRIPTOR d = {4096, size / (4096 * 4), 0x20, 1};
        return p_cuArrayCreate((CUarray *)&a->array, &d);
    }
    case P_ARRAY3D: {
        CUDA_ARRAY3D_DESCRIPTOR d = {1024, 1024, size / (1024 * 1024 * 4), 0x20, 1, 0};
        return p_cuArray3DCreate((CUarray *)&a->array, &d);
    }
    case P_MIPMAP: {
        CUDA_ARRAY3D_DESCRIPTOR d = {4096, size / (4096 * 4), 0, 0x20, 1, 0};
        return p_cuMipmappedArrayCreate((CUmipmappedArray *)&a->array, &d, 1);
    }
    case P_CREATE: {
        struct CUmemAllocationProp_st prop;
        memset(&prop, 0, sizeof(prop));
        prop.type = 1;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = g_dev;
        size_t gran = 0;
        CUresult rc = p_cuMemGetAllocationGranularity(&gran, &prop, 0);
        if (rc) return rc;
        size_t rounded = (size + gran - 1) / gran * gran;
        rc = p_cuMemCreate(&a->handle, rounded, &prop, 0);
        if (rc) return rc;
        rc = p_cuMemAddressReserve(&a->ptr, rounded, 0, 0, 0);
        if (rc) {
            p_cuMemRelease(a->handle);
            return rc;
        }
        rc = p_cuMemMap(a->ptr, rounded, 0, a->handle, 0);
        if (rc) {
            p_cuMemAddressFree(a->ptr, rounded);
            p_cuMemRelease(a->handle);
            return rc;
        }
        CUmemAccessDesc desc = {{CU_MEM_LOCATION_TYPE_DEVICE, g_dev}, 3};
        rc = p_cuMemSetAccess(a->ptr, rounded, &desc, 1);
        a->mapped = rounded;
        a->size = rounded;
        return rc;
    }
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

static CUresult do_free(struct allocation *a) {
    switch (a->path) {
    case P_ASYNC:
    case P_POOL: {
        CUresult rc = p_cuMemFreeAsync(a->ptr, g_stream);
        if (rc) return rc;
        return p_cuStreamSynchronize(g_stream);
    }
    case P_CREATE: {
        CUresult rc = p_cuMemUnmap(a->ptr, a->mapped);
        if (rc) return rc;
        rc = p_cuMemRelease(a->handle);
        if (rc) return rc;
        return p_cuMemAddressFree(a->ptr, a->mapped);
    }
    case P_CREATE_RETAINED:
    case P_CREATE_RELEASED: {
        /* The retain's own reference, then the memory goes at its last unmap. */
        CUresult rc = a->path == P_CREATE_RETAINED ? p_cuMemRelease(a->handle) : CUDA_SUCCESS;
        if (rc) return rc;
        rc = p_cuMemUnmap(a->ptr, a->mapped);
        if (rc) return rc;
        return p_cuMemAddressFree(a->ptr, a->mapped);
    }
    case P_ARRAY:
    case P_ARRAY3D: return p_cuArrayDestroy((CUarray)a->array);
    case P_MIPMAP: return p_cuMipmappedArrayDestroy((CUmipmappedArray)a->array);
    default: return p_cuMemFree(a->ptr);
    }
}

/* Write a pattern through cuMemsetD32 and cuMemcpyHtoD, read it back with cuMemcpyDtoH. */
static int round_trip(CUdeviceptr p, size_t size) {
    size_t n = size < (1u << 20) ? size : (1u << 20);
    n &= ~(size_t)3;
    if (n == 0) return 1;
    unsigned char *h = malloc(n);
    if (!h) return 0;
    int ok = p_cuMemsetD32(p, 0xA5C3E1F0u, n / 4) == CUDA_SUCCESS &&
             p_cuMemcpyDtoH(h, p, n) == CUDA_SUCCESS;
    for (size_t i = 0; ok && i < n; i += 4) {
        uint32_t v;
        memcpy(&v, h + i, 4);
        ok = v == 0xA5C3E1F0u;
    }
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 7 + 3);
    ok = ok && p_cuMemcpyHtoD(p, h, n) == CUDA_SUCCESS;
    memset(h, 0, n);
    ok = ok && p_cuMemcpyDtoH(h, p, n) == CUDA_SUCCESS;
    for (size_t i = 0; ok && i < n; i++) ok = h[i] == (unsigned char)(i * 7 + 3);
    free(h);
    return ok;
}

static void meminfo_fields(char *out, size_t n) {
    size_t fr = 0, tot = 0, dev_total = 0;
    CUresult rc = p_cuMemGetInfo(&fr, &tot);
    CUresult rc_total = p_cuDeviceTotalMem(&dev_total, 0);
    snprintf(out, n, ",\"rc\":%d,\"free\":%zu,\"total\":%zu,\"device_total_rc\":%d,"
             "\"device_total\":%zu", rc, fr, tot, rc_total, dev_total);
}

static int scenario_alloc(int path, size_t size) {
    char mi[256], st[2048];
    meminfo_fields(mi, sizeof(mi));
    emit("meminfo", "%s", mi);
    struct allocation a;
    CUresult rc = do_alloc(path, size, &a);
    status_fields(st, sizeof(st));
    emit("alloc", ",\"path\":\"%s\",\"size\":%zu,\"rc\":%d,\"ptr\":%llu%s", path_names[path], size,
         rc, (unsigned long long)a.ptr, st);
    if (rc) return 1;
    int ok = round_trip(a.ptr, a.size);
    emit("data", ",\"ok\":%s", ok ? "true" : "false");
    meminfo_fields(mi, sizeof(mi));
    emit("meminfo", "%s", mi);
    rc = do_free(&a);
    status_fields(st, sizeof(st));
    emit("free", ",\"path\":\"%s\",\"rc\":%d%s", path_names[path], rc, st);
    meminfo_fields(mi, sizeof(mi));
    emit("meminfo", "%s", mi);
    return rc != CUDA_SUCCESS || !ok;
}

static int scenario_quota(size_t size, int path, long max) {
    struct allocation *as = calloc((size_t)max, sizeof(*as));
    if (!as) return 1;
    long count = 0;
    CUresult rc = CUDA_SUCCESS;
    size_t total = 0;
    while (count < max) {
        rc = do_alloc(path, size, &as[count]);
        if (rc != CUDA_SUCCESS) break;
        total += as[count].size;
        count++;
    }
    char st[2048];
    status_fields(st, sizeof(st));
    emit("quota", ",\"path\":\"%s\",\"size\":%zu,\"count\":%ld,\"allocated\":%zu,\"rc\":%d%s",
         path_names[path], size, count, total, rc, st);
    int bad = 0;
    for (long i = 0; i < count; i++) bad |= do_free(&as[i]) != CUDA_SUCCESS;
    /* After freeing, the same allocation must succeed again. */
    struct allocation again;
    CUresult rc2 = count > 0 ? do_alloc(path, size, &again) : CUDA_SUCCESS;
    if (count > 0 && rc2 == CUDA_SUCCESS) do_free(&again);
    status_fields(st, sizeof(st));
    emit("quota_freed", ",\"free_errors\":%d,\"realloc_rc\":%d%s", bad, rc2, st);
    free(as);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Memory view                                                                                  */
/* ------------------------------------------------------------------------------------------ */

typedef nvmlReturn_t fn_nvml_init(void);
typedef nvmlReturn_t fn_nvml_handle(unsigned int, nvmlDevice_t *);
typedef nvmlReturn_t fn_nvml_mem(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t fn_nvml_mem2(nvmlDevice_t, nvmlMemory_v2_t *);

static void emit_nvml(const char *when) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        emit("nvml", ",\"when\":\"%s\",\"available\":false", when);
        return;
    }
    fn_nvml_init *init = (fn_nvml_init *)dlsym(lib, "nvmlInit_v2");
    fn_nvml_handle *get = (fn_nvml_handle *)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    fn_nvml_mem *mem = (fn_nvml_mem *)dlsym(lib, "nvmlDeviceGetMemoryInfo");
    fn_nvml_mem2 *mem2 = (fn_nvml_mem2 *)dlsym(lib, "nvmlDeviceGetMemoryInfo_v2");
    nvmlDevice_t dev = NULL;
    if (!init || !get || !mem || !mem2 || init() != NVML_SUCCESS || get(0, &dev) != NVML_SUCCESS) {
        emit("nvml", ",\"when\":\"%s\",\"available\":false", when);
        return;
    }
    nvmlMemory_t m1;
    nvmlMemory_v2_t m2;
    memset(&m1, 0, sizeof(m1));
    memset(&m2, 0, sizeof(m2));
    m2.version = (unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24));
    int r1 = mem(dev, &m1), r2 = mem2(dev, &m2);
    emit("nvml",
         ",\"when\":\"%s\",\"available\":true,\"v1\":{\"rc\":%d,\"total\":%llu,\"free\":%llu,"
         "\"used\":%llu},\"v2\":{\"rc\":%d,\"total\":%llu,\"free\":%llu,\"used\":%llu,"
         "\"reserved\":%llu}",
         when, r1, m1.total, m1.free, m1.used, r2, m2.total, m2.free, m2.used, m2.reserved);
}

static int scenario_meminfo(size_t bytes) {
    char mi[256];
    /* One launch first: a connected process has then had its handshake (the pool is known). */
    CHECK(launch_sleep(0));
    CHECK(p_cuStreamSynchronize(work_stream()));
    meminfo_fields(mi, sizeof(mi));
    emit("meminfo", ",\"when\":\"before\"%s", mi);
    emit_nvml("before");
    struct allocation a = {0};
    if (bytes) {
        CUresult rc = do_alloc(P_ALLOC, bytes, &a);
        emit("alloc", ",\"path\":\"alloc\",\"size\":%zu,\"rc\":%d", bytes, rc);
        if (rc) return 1;
    }
    meminfo_fields(mi, sizeof(mi));
    emit("meminfo", ",\"when\":\"after\"%s", mi);
    emit_nvml("after");
    emit_status("status");
    if (bytes) do_free(&a);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Numbers                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static uint64_t fnv1a(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

static int scenario_saxpy(int n) {
    size_t bytes = (size_t)n * sizeof(float);
    float *x = malloc(bytes), *y = malloc(bytes), *ref = malloc(bytes), *out = malloc(bytes);
    if (!x || !y || !ref || !out) return 1;
    for (int i = 0; i < n; i++) {
        x[i] = (float)(i % 97) * 0.25f - 3.0f;
        y[i] = (float)(i % 13) * 1.5f + 0.125f;
        ref[i] = y[i];
    }
    CUdeviceptr dx, dy;
    CHECK(p_cuMemAlloc(&dx, bytes));
    CHECK(p_cuMemAlloc(&dy, bytes));
    CHECK(p_cuMemcpyHtoD(dx, x, bytes));
    CHECK(p_cuMemcpyHtoD(dy, y, bytes));
    const float as[3] = {2.5f, -0.75f, 1.25f};
    float a;
    void *params[] = {&a, &dx, &dy, &n};
    unsigned int grid = (unsigned int)((n + 255) / 256);
    if (grid == 0) grid = 1;
    a = as[0];
    CHECK(p_cuLaunchKernel(g_k_saxpy, grid, 1, 1, 256, 1, 1, 0, work_stream(), params, NULL));
    a = as[1];
    struct CUlaunchConfig_st cfg = {grid, 1, 1, 256, 1, 1, 0, work_stream(), NULL, 0};
    CHECK(p_cuLaunchKernelEx(&cfg, g_k_saxpy, params, NULL));
    a = as[2];
    CHECK(p_cuLaunchCooperativeKernel(g_k_saxpy, grid, 1, 1, 256, 1, 1, 0, work_stream(), params));
    CHECK(p_cuStreamSynchronize(work_stream()));
    CHECK(p_cuMemcpyDtoH(out, dy, bytes));
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < n; i++) ref[i] = as[k] * x[i] + ref[i];
    int mismatches = 0;
    double max_err = 0, sum = 0;
    for (int i = 0; i < n; i++) {
        double e = fabs((double)out[i] - (double)ref[i]);
        if (e > max_err) max_err = e;
        if (memcmp(&out[i], &ref[i], sizeof(float)) != 0) mismatches++;
        sum += out[i];
    }
    emit("saxpy",
         ",\"n\":%d,\"ok\":%s,\"mismatches\":%d,\"max_err\":%.9g,\"sum\":%.9g,\"hash\":\"%016llx\"",
         n, mismatches == 0 ? "true" : "false", mismatches, max_err, sum,
         (unsigned long long)fnv1a(out, bytes));
    CHECK(p_cuMemFree(dx));
    CHECK(p_cuMemFree(dy));
    free(x);
    free(y);
    free(ref);
    free(out);
    return mismatches != 0;
}

static int all_bytes(const unsigned char *g, size_t n, unsigned char v) {
    for (size_t i = 0; i < n; i++)
        if (g[i] != v) return 0;
    return 1;
}

/* Every copy and set path, each checked against the host. */
static int scenario_copies(size_t n) {
    n &= ~(size_t)3;
    if (n < 64) n = 64;
    unsigned char *h = malloc(n), *g = malloc(n);
    if (!h || !g) return 1;
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 13 + 5);
    CUdeviceptr a, b;
    CHECK(p_cuMemAlloc(&a, n));
    CHECK(p_cuMemAlloc(&b, n));
    int all_ok = 1;
#define STEP(name, call, check)                                                                  \
    do {                                                                                         \
        CUresult rc_ = (call);                                                                   \
        if (rc_ == CUDA_SUCCESS) rc_ = p_cuStreamSynchronize(g_stream);                          \
        int ok_ = rc_ == CUDA_SUCCESS && (check);                                                \
        all_ok &= ok_;                                                                           \
        emit("copy", ",\"path\":\"%s\",\"rc\":%d,\"ok\":%s", name, rc_, ok_ ? "true" : "false"); \
    } while (0)
#define READ_B() (p_cuMemcpyDtoH(g, b, n) == CUDA_SUCCESS)
#define SAME_AS_H() (memcmp(g, h, n) == 0)
    STEP("cuMemcpyHtoD", p_cuMemcpyHtoD(a, h, n), 1);
    STEP("cuMemcpyDtoD", p_cuMemcpyDtoD(b, a, n), READ_B() && SAME_AS_H());
    memset(g, 0, n);
    STEP("cuMemcpyDtoH", p_cuMemcpyDtoH(g, a, n), SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpy", p_cuMemcpy(b, a, n), READ_B() && SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpyAsync", p_cuMemcpyAsync(b, a, n, g_stream), READ_B() && SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpyDtoDAsync", p_cuMemcpyDtoDAsync(b, a, n, g_stream), READ_B() && SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpyHtoDAsync", p_cuMemcpyHtoDAsync(b, h, n, g_stream), READ_B() && SAME_AS_H());
    memset(g, 0, n);
    STEP("cuMemcpyDtoHAsync", p_cuMemcpyDtoHAsync(g, a, n, g_stream), SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpyPeer", p_cuMemcpyPeer(b, g_ctx, a, g_ctx, n), READ_B() && SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpyPeerAsync", p_cuMemcpyPeerAsync(b, g_ctx, a, g_ctx, n, g_stream),
         READ_B() && SAME_AS_H());
#define ALL_BYTES(v) all_bytes(g, n, v)
    STEP("cuMemsetD8", p_cuMemsetD8(b, 0x5a, n), READ_B() && ALL_BYTES(0x5a));
    STEP("cuMemsetD8Async", p_cuMemsetD8Async(b, 0x3c, n, g_stream), READ_B() && ALL_BYTES(0x3c));
    STEP("cuMemsetD16", p_cuMemsetD16(b, 0x7171, n / 2), READ_B() && ALL_BYTES(0x71));
    STEP("cuMemsetD16Async", p_cuMemsetD16Async(b, 0x2929, n / 2, g_stream),
         READ_B() && ALL_BYTES(0x29));
    STEP("cuMemsetD32", p_cuMemsetD32(b, 0x66666666u, n / 4), READ_B() && ALL_BYTES(0x66));
    STEP("cuMemsetD32Async", p_cuMemsetD32Async(b, 0x11111111u, n / 4, g_stream),
         READ_B() && ALL_BYTES(0x11));
#undef STEP
    emit("copies", ",\"ok\":%s", all_ok ? "true" : "false");
    p_cuMemFree(a);
    p_cuMemFree(b);
    free(h);
    free(g);
    return !all_ok;
}

/* ------------------------------------------------------------------------------------------ */
/* Every gated entry point once                                                                 */
/* ------------------------------------------------------------------------------------------ */

static int scenario_paths(void) {
    size_t n = 4096;
    CUdeviceptr a, b, m;
    unsigned char *h = calloc(1, n);
    CHECK(p_cuMemAlloc(&a, n));
    CHECK(p_cuMemAlloc(&b, n));
    CHECK(p_cuMemAllocManaged(&m, n, CU_MEM_ATTACH_GLOBAL));
    CUstream s = work_stream();
    void *noargs[] = {NULL};
    struct CUlaunchConfig_st cfg = {1, 1, 1, 1, 1, 1, 0, s, NULL, 0};
    CUmemLocation host = {CU_MEM_LOCATION_TYPE_HOST, 0};
    int all_ok = 1;
#define PATH(base, sym, ptsym, call)                                                             \
    do {                                                                                         \
        long g0_ = gated_calls(), c0_ = fake_count(#sym), t0_ = fake_count(#ptsym);              \
        CUresult rc_ = (call);                                                                   \
        long g1_ = gated_calls(), c1_ = fake_count(#sym), t1_ = fake_count(#ptsym);              \
        all_ok &= rc_ == CUDA_SUCCESS;                                                           \
        emit("path",                                                                             \
             ",\"path\":\"%s\",\"rc\":%d,\"gated_delta\":%ld,\"fake\":{\"%s\":%ld,\"%s\":%ld}",  \
             #base, rc_, g0_ < 0 ? -1 : g1_ - g0_, #sym, c1_ - c0_, #ptsym, t1_ - t0_);          \
    } while (0)
    PATH(cuLaunchKernel, cuLaunchKernel, cuLaunchKernel_ptsz,
         p_cuLaunchKernel(g_k_noop, 1, 1, 1, 1, 1, 1, 0, s, noargs, NULL));
    PATH(cuLaunchKernelEx, cuLaunchKernelEx, cuLaunchKernelEx_ptsz,
         p_cuLaunchKernelEx(&cfg, g_k_noop, noargs, NULL));
    PATH(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz,
         p_cuLaunchCooperativeKernel(g_k_noop, 1, 1, 1, 1, 1, 1, 0, s, noargs));
    PATH(cuGraphLaunch, cuGraphLaunch, cuGraphLaunch_ptsz, p_cuGraphLaunch(GRAPH, s));
    PATH(cuMemcpy, cuMemcpy, cuMemcpy_ptds, p_cuMemcpy(b, a, n));
    PATH(cuMemcpyAsync, cuMemcpyAsync, cuMemcpyAsync_ptsz, p_cuMemcpyAsync(b, a, n, s));
    PATH(cuMemcpyHtoD, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds, p_cuMemcpyHtoD(a, h, n));
    PATH(cuMemcpyDtoH, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds, p_cuMemcpyDtoH(h, a, n));
    PATH(cuMemcpyDtoD, cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds, p_cuMemcpyDtoD(b, a, n));
    PATH(cuMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz,
         p_cuMemcpyHtoDAsync(a, h, n, s));
    PATH(cuMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz,
         p_cuMemcpyDtoHAsync(h, a, n, s));
    PATH(cuMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz,
         p_cuMemcpyDtoDAsync(b, a, n, s));
    PATH(cuMemcpyPeer, cuMemcpyPeer, cuMemcpyPeer_ptds, p_cuMemcpyPeer(b, g_ctx, a, g_ctx, n));
    PATH(cuMemcpyPeerAsync, cuMemcpyPeerAsync, cuMemcpyPeerAsync_ptsz,
         p_cuMemcpyPeerAsync(b, g_ctx, a, g_ctx, n, s));
    PATH(cuMemsetD8, cuMemsetD8_v2, cuMemsetD8_v2_ptds, p_cuMemsetD8(a, 1, n));
    PATH(cuMemsetD16, cuMemsetD16_v2, cuMemsetD16_v2_ptds, p_cuMemsetD16(a, 1, n / 2));
    PATH(cuMemsetD32, cuMemsetD32_v2, cuMemsetD32_v2_ptds, p_cuMemsetD32(a, 1, n / 4));
    PATH(cuMemsetD8Async, cuMemsetD8Async, cuMemsetD8Async_ptsz, p_cuMemsetD8Async(a, 1, n, s));
    PATH(cuMemsetD16Async, cuMemsetD16Async, cuMemsetD16Async_ptsz,
         p_cuMemsetD16Async(a, 1, n / 2, s));
    PATH(cuMemsetD32Async, cuMemsetD32Async, cuMemsetD32Async_ptsz,
         p_cuMemsetD32Async(a, 1, n / 4, s));
    if (prefetch_is_v2())
        PATH(cuMemPrefetchAsync, cuMemPrefetchAsync_v2, cuMemPrefetchAsync_v2_ptsz,
             p_cuMemPrefetchAsync(m, n, host, 0, s));
    else
        PATH(cuMemPrefetchAsync, cuMemPrefetchAsync, cuMemPrefetchAsync_ptsz,
             ((fn_prefetch_v1 *)(void *)p_cuMemPrefetchAsync)(m, n, CU_DEVICE_CPU, s));
#undef PATH
    CHECK(p_cuStreamSynchronize(s));
    emit("paths", ",\"ok\":%s", all_ok ? "true" : "false");
    p_cuMemFree(a);
    p_cuMemFree(b);
    p_cuMemFree(m);
    free(h);
    return !all_ok;
}

/* ------------------------------------------------------------------------------------------ */
/* Time: hold, idle                                                                             */
/* ------------------------------------------------------------------------------------------ */

static void emit_tick(long launches) {
    char st[2048];
    status_fields(st, sizeof(st));
    emit("tick", ",\"launches\":%ld%s", launches, st);
}

/* Launch, synchronise, repeat for `seconds` after the first launch got through. */
static int hold(double seconds, unsigned long long us, long *launches_out, int report_first) {
    double start = clock_s(CLOCK_MONOTONIC), first = -1, last_tick = start;
    long launches = 0;
    for (;;) {
        double before = clock_s(CLOCK_MONOTONIC);
        CUresult rc = launch_sleep(us);
        if (rc) return fail("cuLaunchKernel(sleep)", rc);
        launches++;
        double after = clock_s(CLOCK_MONOTONIC);
        if (first < 0) {
            first = after;
            if (report_first)
                emit("first_launch", ",\"waited\":%.6f,\"call_started\":%.6f", after - start,
                     before);
        }
        rc = p_cuStreamSynchronize(work_stream());
        if (rc) return fail("cuStreamSynchronize", rc);
        double now = clock_s(CLOCK_MONOTONIC);
        if (now - last_tick >= 0.5) {
            emit_tick(launches);
            last_tick = now;
        }
        if (now - first >= seconds) break;
    }
    *launches_out = launches;
    return 0;
}

/* The stand-in's physical device memory in use (its stats' live_device_bytes), or -1. */
static long long fake_device_bytes(void) {
    int (*f)(char *, size_t) = (int (*)(char *, size_t))fake_sym("fakecuda_stats_json");
    char buf[16384];
    if (!f || f(buf, sizeof(buf)) < 0) return -1;
    const char *p = strstr(buf, "\"live_device_bytes\":");
    return p ? atoll(p + strlen("\"live_device_bytes\":")) : -1;
}

/* A scratch buffer of `temp` bytes allocated, written and freed twice while the process holds
 * the device (its block is resident when freed); the status right after says what the shim
 * reports. */
static int free_a_resident_temporary(size_t temp) {
    for (int i = 0; i < 2; i++) {
        CUdeviceptr t = 0;
        CHECK(p_cuMemAlloc(&t, temp));
        CHECK(p_cuMemsetD8(t, 3, temp));
        CHECK(p_cuMemFree(t));
    }
    char st[2048];
    status_fields(st, sizeof(st));
    emit("temporary_freed", ",\"bytes\":%zu%s", temp, st);
    return 0;
}

static int scenario_hold(double seconds, size_t bytes, unsigned long long us, size_t temp) {
    CUdeviceptr d = 0;
    unsigned char *h = NULL, *g = NULL;
    size_t n = bytes < (4u << 20) ? bytes : (4u << 20);
    if (bytes) {
        CHECK(p_cuMemAlloc(&d, bytes));
        h = malloc(n);
        g = malloc(n);
        if (!h || !g) return 1;
        for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 31 + 1);
        char st[2048];
        status_fields(st, sizeof(st));
        emit("allocated", ",\"bytes\":%zu,\"device_bytes\":%lld%s", bytes, fake_device_bytes(),
             st);
    }
    emit("hold_start", ",\"seconds\":%.3f,\"bytes\":%zu,\"kernel_us\":%llu", seconds, bytes, us);
    long launches = 0;
    if (bytes) {
        /* The first GPU call of the turn is this copy: it is what waits for the device. */
        double t0 = clock_s(CLOCK_MONOTONIC);
        CHECK(p_cuMemsetD8(d, 0, bytes));
        CHECK(p_cuMemcpyHtoD(d, h, n));
        double waited = clock_s(CLOCK_MONOTONIC) - t0;
        char st[2048];
        status_fields(st, sizeof(st));
        emit("first_copy", ",\"waited\":%.6f,\"device_bytes\":%lld%s", waited,
             fake_device_bytes(), st);
    }
    if (temp && free_a_resident_temporary(temp)) return 1;
    if (hold(seconds, us, &launches, 1)) return 1;
    int ok = 1;
    if (bytes) {
        CHECK(p_cuMemcpyDtoH(g, d, n));
        ok = memcmp(g, h, n) == 0;
        CHECK(p_cuMemFree(d));
    }
    char st[2048];
    status_fields(st, sizeof(st));
    emit("hold_end", ",\"launches\":%ld,\"data_ok\":%s%s", launches, ok ? "true" : "false", st);
    free(h);
    free(g);
    return !ok;
}

/* Issue 21 item 2, memory past the grant's room: the device is granted for a small first cell
 * (beside another kernel that holds most of the pool), then BYTES are allocated, more than the
 * grant's room. The allocation succeeds; a thread reports the status while the first copy into
 * the new memory waits for a grant with room ("blocked", half a second in); then the memory is
 * written, held HOLD seconds and read back. */
static void *report_blocked(void *arg) {
    (void)arg;
    sleep_s(0.5);
    char st[2048];
    status_fields(st, sizeof(st));
    emit("blocked", ",\"device_bytes\":%lld%s", fake_device_bytes(), st);
    return NULL;
}

static int scenario_grow(double first_s, size_t bytes, double hold_s) {
    long launches = 0;
    if (hold(first_s, 20000, &launches, 0)) return 1;
    char st[2048];
    status_fields(st, sizeof(st));
    emit("granted", ",\"launches\":%ld,\"device_bytes\":%lld%s", launches, fake_device_bytes(),
         st);
    /* PROBE_GROW_AFTER: a file the test makes once the kernel beside has its memory. */
    const char *after = getenv("PROBE_GROW_AFTER");
    while (after && *after && access(after, F_OK) != 0) sleep_s(0.02);
    CUdeviceptr d = 0;
    CHECK(p_cuMemAlloc(&d, bytes));
    status_fields(st, sizeof(st));
    emit("allocated", ",\"bytes\":%zu,\"device_bytes\":%lld%s", bytes, fake_device_bytes(), st);
    size_t n = bytes < (4u << 20) ? bytes : (4u << 20);
    unsigned char *h = malloc(n), *g = malloc(n);
    if (!h || !g) return 1;
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 31 + 7);
    pthread_t reporter;
    if (pthread_create(&reporter, NULL, report_blocked, NULL) != 0) return 1;
    double t0 = clock_s(CLOCK_MONOTONIC);
    CHECK(p_cuMemsetD8(d, 0, bytes));
    CHECK(p_cuMemcpyHtoD(d, h, n));
    double waited = clock_s(CLOCK_MONOTONIC) - t0;
    pthread_join(reporter, NULL);
    status_fields(st, sizeof(st));
    emit("first_copy", ",\"waited\":%.6f,\"device_bytes\":%lld%s", waited, fake_device_bytes(),
         st);
    if (hold(hold_s, 20000, &launches, 0)) return 1;
    CHECK(p_cuMemcpyDtoH(g, d, n));
    int ok = memcmp(g, h, n) == 0;
    CHECK(p_cuMemFree(d));
    emit("hold_end", ",\"launches\":%ld,\"data_ok\":%s", launches, ok ? "true" : "false");
    free(h);
    free(g);
    return !ok;
}

/* The device is granted before any cudaMalloc (a program whose first memory comes from its own
 * allocator, as PyTorch's expandable segments), then cudaMalloc'd memory must be usable at once:
 * a grant made before the engine's first block must not leave later blocks unbacked. */
static int scenario_late_alloc(size_t size) {
    long launches = 0;
    if (hold(0.2, 20000, &launches, 0)) return 1;
    emit("granted", ",\"launches\":%ld,\"device_bytes\":%lld", launches, fake_device_bytes());
    return scenario_alloc(P_ALLOC, size);
}

static int scenario_idle(double seconds, double hold_s, size_t bytes) {
    long launches = 0;
    CUdeviceptr d = 0;
    if (bytes) {
        CHECK(p_cuMemAlloc(&d, bytes));
        emit("allocated", ",\"bytes\":%zu", bytes);
    }
    emit("hold_start", ",\"seconds\":%.3f", hold_s);
    if (bytes) CHECK(p_cuMemsetD8(d, 7, bytes));
    if (hold(hold_s, 20000, &launches, 1)) return 1;
    emit("idle_start", ",\"launches\":%ld", launches);
    double start = clock_s(CLOCK_MONOTONIC);
    while (clock_s(CLOCK_MONOTONIC) - start < seconds) {
        sleep_s(0.25);
        emit_tick(launches);
    }
    emit_status("idle_end");
    if (bytes) CHECK(p_cuMemFree(d));
    return 0;
}

static void fill_pattern(unsigned char *h, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 31 + seed);
}

/* Write pattern `seed` to BYTES at d (all of it; the first n bytes from h). */
static CUresult write_pattern(CUdeviceptr d, size_t bytes, unsigned char *h, size_t n, unsigned seed) {
    fill_pattern(h, n, seed);
    CUresult rc = p_cuMemsetD8(d, (unsigned char)seed, bytes);
    return rc != CUDA_SUCCESS ? rc : p_cuMemcpyHtoD(d, h, n);
}

/* No GPU calls for `seconds` after the event `name`, a status tick every 0.1 s. */
static void idle_ticking(const char *name, double seconds, long launches) {
    emit(name, ",\"launches\":%ld", launches);
    for (double t0 = clock_s(CLOCK_MONOTONIC); clock_s(CLOCK_MONOTONIC) - t0 < seconds;) {
        sleep_s(0.1);
        emit_tick(launches);
    }
}

/* Whether BYTES at d hold pattern `seed` (the first n bytes as in h, the last byte too). */
static int pattern_ok(CUdeviceptr d, size_t bytes, const unsigned char *h, unsigned char *g,
                      size_t n, unsigned seed) {
    unsigned char last = 0;
    if (p_cuMemcpyDtoH(g, d, n) != CUDA_SUCCESS) return 0;
    if (p_cuMemcpyDtoH(&last, d + bytes - 1, 1) != CUDA_SUCCESS) return 0;
    return memcmp(g, h, n) == 0 && (bytes <= n || last == (unsigned char)seed);
}

/* BYTES of device memory holding pattern 1, with host buffers to check it (the first n bytes). */
struct patterned {
    size_t bytes, n;
    unsigned char *h, *g;
    CUdeviceptr d;
};

static CUresult patterned_alloc(struct patterned *p, size_t bytes) {
    p->bytes = bytes;
    p->n = bytes < (4u << 20) ? bytes : (4u << 20);
    p->h = malloc(p->n);
    p->g = malloc(p->n);
    p->d = 0;
    if (!p->h || !p->g || !bytes) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = p_cuMemAlloc(&p->d, bytes);
    return rc != CUDA_SUCCESS ? rc : write_pattern(p->d, bytes, p->h, p->n, 1);
}

static int patterned_free(struct patterned *p, int ok) {
    CHECK(p_cuMemFree(p->d));
    free(p->h);
    free(p->g);
    return !ok;
}

/* Pre-copy and its invalidation (tests/native/test_memory_engine.py): the data written after
 * a pre-copy must be what comes back after an eviction. */
static int scenario_precopy_cycle(size_t bytes, double idle1, double hold2, double idle2) {
    struct patterned p;
    long launches = 0;
    CHECK(patterned_alloc(&p, bytes));
    if (hold(0.3, 20000, &launches, 1)) return 1;
    idle_ticking("idle1_start", idle1, launches);
    CHECK(write_pattern(p.d, bytes, p.h, p.n, 2));
    emit_status("written2");
    if (hold(hold2, 20000, &launches, 0)) return 1;
    idle_ticking("idle2_start", idle2, launches);
    int ok = pattern_ok(p.d, bytes, p.h, p.g, p.n, 2);
    char st[2048];
    status_fields(st, sizeof(st));
    emit("cycle_end", ",\"data_ok\":%s%s", ok ? "true" : "false", st);
    return patterned_free(&p, ok);
}

/* A write still queued when the kernel goes idle (tests/native/test_memory_engine.py): pattern 2
 * is copied over pattern 1 on the program's own non-blocking stream and never waited for, as a
 * cell that returns once its work is launched. The scheduler asks for a pre-copy at the idle and
 * an arrival evicts the kernel; after the next grant the data must be pattern 2. */
static int scenario_precopy_pending(size_t bytes, double idle) {
    struct patterned p;
    long launches = 0;
    unsigned char *next = malloc(bytes);
    if (!next) return 1;
    CHECK(patterned_alloc(&p, bytes));
    if (hold(0.3, 20000, &launches, 1)) return 1;
    memset(next, 2, bytes);
    fill_pattern(next, p.n, 2);
    CHECK(p_cuMemcpyHtoDAsync(p.d, next, bytes, NULL));
    idle_ticking("idle_start", idle, launches);
    fill_pattern(p.h, p.n, 2);
    int ok = pattern_ok(p.d, bytes, p.h, p.g, p.n, 2);
    char st[2048];
    status_fields(st, sizeof(st));
    emit("pending_end", ",\"data_ok\":%s%s", ok ? "true" : "false", st);
    free(next);
    return patterned_free(&p, ok);
}

/* Several blocks, each its own pattern (tests/native/test_partial_eviction.py): allocated in
 * order, used, then idle while the scheduler evicts part of them; every block's data is checked
 * after the next grant. */
static int scenario_blocks(int k, size_t bytes, double idle) {
    CUdeviceptr d[16];
    unsigned char *h = malloc(4u << 20), *g = malloc(4u << 20);
    size_t n = bytes < (4u << 20) ? bytes : (4u << 20);
    long launches = 0;
    if (k < 1 || k > 16 || !h || !g) return 1;
    for (int i = 0; i < k; i++) CHECK(p_cuMemAlloc(&d[i], bytes));
    emit_status("allocated"); /* before the first gated call: it may wait for the device */
    for (int i = 0; i < k; i++) CHECK(write_pattern(d[i], bytes, h, n, (unsigned)i + 1));
    if (hold(0.3, 20000, &launches, 1)) return 1;
    idle_ticking("idle_start", idle, launches);
    int ok = 1;
    for (int i = 0; i < k; i++) {
        fill_pattern(h, n, (unsigned)i + 1);
        ok &= pattern_ok(d[i], bytes, h, g, n, (unsigned)i + 1);
    }
    char st[2048];
    status_fields(st, sizeof(st));
    emit("blocks_end", ",\"data_ok\":%s%s", ok ? "true" : "false", st);
    for (int i = 0; i < k; i++) CHECK(p_cuMemFree(d[i]));
    free(h);
    free(g);
    return !ok;
}

/* A burst of allocations (tests/native/test_cold_eviction.py): k blocks, one every `every`
 * seconds, no GPU call between them; the status at the burst's end says how much staging is
 * ready. */
static int scenario_burst(int k, size_t bytes, double every) {
    CUdeviceptr d[64];
    if (k < 1 || k > 64) return 1;
    for (int i = 0; i < k; i++) {
        CHECK(p_cuMemAlloc(&d[i], bytes));
        sleep_s(every);
    }
    emit_status("burst_end");
    for (int i = 0; i < k; i++) CHECK(p_cuMemFree(d[i]));
    return 0;
}

/* Deep idle (tests/native/test_deep_idle.py): the first call after a long idle wakes the
 * process; the data written before must be intact. */
static int scenario_deep_idle(size_t bytes, double idle) {
    struct patterned p;
    long launches = 0;
    CHECK(patterned_alloc(&p, bytes));
    if (hold(0.3, 20000, &launches, 1)) return 1;
    idle_ticking("idle_start", idle, launches);
    double t0 = clock_s(CLOCK_MONOTONIC);
    int ok = pattern_ok(p.d, bytes, p.h, p.g, p.n, 1);
    double first = clock_s(CLOCK_MONOTONIC) - t0;
    char st[2048];
    status_fields(st, sizeof(st));
    emit("woken", ",\"first_call_s\":%.6f,\"data_ok\":%s%s", first, ok ? "true" : "false", st);
    return patterned_free(&p, ok);
}

static int scenario_ipc(int path) {
    struct allocation a;
    CHECK(do_alloc(path, 1u << 20, &a));
    CUipcMemHandle h;
    CUresult rc = p_cuIpcGetMemHandle(&h, a.ptr);
    emit("ipc", ",\"path\":\"%s\",\"rc\":%d", path_names[path], rc);
    CHECK(do_free(&a));
    return 0;
}

static int usage(void);

static unsigned long long status_pinned(void) {
    char st[2048];
    status_fields(st, sizeof(st));
    const char *p = strstr(st, "\"pinned_bytes\":");
    return p ? strtoull(p + 15, NULL, 10) : 0;
}

static int scenario_ipc_export(size_t bytes, double seconds, size_t extra) {
    CUdeviceptr d, e = 0;
    CHECK(p_cuMemAlloc(&d, bytes));
    if (extra) CHECK(p_cuMemAlloc(&e, extra));
    CHECK(p_cuMemsetD8(d, 0x11, bytes));
    CUipcMemHandle h;
    CUresult rc = p_cuIpcGetMemHandle(&h, d);
    char hex[2 * sizeof h + 1];
    for (size_t i = 0; i < sizeof h; i++)
        snprintf(hex + 2 * i, 3, "%02x", (unsigned char)h.reserved[i]);
    char st[2048];
    status_fields(st, sizeof(st));
    emit("ipc_handle", ",\"rc\":%d,\"handle\":\"%s\"%s", rc, hex, st);
    if (rc != CUDA_SUCCESS) return 1;
    unsigned char last = 0;
    double t0 = clock_s(CLOCK_MONOTONIC);
    while (last != 0x22 && clock_s(CLOCK_MONOTONIC) - t0 < seconds) {
        CHECK(p_cuMemcpyDtoH(&last, d + bytes - 1, 1));
        if (last != 0x22) sleep_s(0.05);
    }
    unsigned long long pinned = status_pinned();
    status_fields(st, sizeof(st));
    emit("ipc_seen", ",\"last\":%u%s", last, st);
    while (status_pinned() >= pinned && clock_s(CLOCK_MONOTONIC) - t0 < seconds) sleep_s(0.05);
    emit_status("ipc_released");
    unsigned char first = 0;
    CHECK(p_cuMemcpyDtoH(&first, d, 1));
    CHECK(p_cuMemFree(d));
    if (extra) CHECK(p_cuMemFree(e));
    if (first != 0x11) return 1;
    emit_status("ipc_freed");
    return last == 0x22 ? 0 : 1;
}

static int scenario_ipc_import(const char *hex, size_t size, double seconds) {
    CUipcMemHandle h;
    if (strlen(hex) != 2 * sizeof h) return usage();
    for (size_t i = 0; i < sizeof h; i++) {
        unsigned v = 0;
        sscanf(hex + 2 * i, "%2x", &v);
        h.reserved[i] = (char)v;
    }
    CUdeviceptr d = 0;
    CUresult rc = p_cuIpcOpenMemHandle(&d, h, 1);
    emit("ipc_open", ",\"rc\":%d", rc);
    if (rc != CUDA_SUCCESS) return 1;
    unsigned char first = 0;
    CHECK(p_cuMemcpyDtoH(&first, d, 1));
    CHECK(p_cuMemsetD8(d + size - 1, 0x22, 1));
    emit("ipc_opened", ",\"first\":%u,\"size\":%zu", first, size);
    sleep_s(seconds);
    rc = p_cuIpcCloseMemHandle(d);
    emit("ipc_closed", ",\"rc\":%d", rc);
    return first == 0x11 && rc == CUDA_SUCCESS ? 0 : 1;
}

static int scenario_ctx_teardown(size_t bytes) {
    CUcontext own = NULL;
    char st[2048];
    CHECK(p_cuCtxCreate(&own, NULL, 0, g_dev)); /* the 12.5+ entry point (default version) */
    CHECK(p_cuCtxSetCurrent(own));
    struct allocation a[3];
    int paths[3] = {P_ALLOC, P_MANAGED, P_CREATE};
    for (int i = 0; i < 3; i++) CHECK(do_alloc(paths[i], bytes, &a[i]));
    status_fields(st, sizeof(st));
    emit("allocated", "%s", st);
    CHECK(p_cuCtxDestroy(own)); /* the program never frees: the context takes it all */
    CHECK(p_cuCtxSetCurrent(g_ctx));
    status_fields(st, sizeof(st));
    emit("destroyed", "%s", st);
    struct allocation again;
    CUresult rc = do_alloc(P_ALLOC, bytes, &again);
    if (rc == CUDA_SUCCESS) rc = round_trip(again.ptr, again.size) ? do_free(&again) : 1;
    status_fields(st, sizeof(st));
    emit("again", ",\"rc\":%d%s", rc, st);
    return rc != CUDA_SUCCESS;
}

static int scenario_status(size_t bytes) {
    CUdeviceptr d = 0;
    if (bytes) CHECK(p_cuMemAlloc(&d, bytes));
    CHECK(launch_sleep(1000));
    CHECK(p_cuStreamSynchronize(work_stream()));
    const char *(*version)(void) = (const char *(*)(void))dlsym(RTLD_DEFAULT, "gpushare_version");
    fn_status *f = status_fn();
    struct gpushare_status st;
    int small_rc = f ? f(&st, 8) : 0;
    int null_rc = f ? f(NULL, sizeof(st)) : 0;
    char buf[2048];
    status_fields(buf, sizeof(buf));
    emit("status", ",\"library_version\":%s%s%s,\"sizeof\":%zu,\"small_rc\":%d,\"null_rc\":%d%s",
         version ? "\"" : "", version ? version() : "null", version ? "\"" : "", sizeof(st), small_rc,
         null_rc, buf);
    if (d) CHECK(p_cuMemFree(d));
    return 0;
}

/* A temporary: allocated, freed LIVE seconds later while the shim may still be preparing its
 * host staging in the background; the status SETTLE seconds after says whether that staging was
 * released. A negative LIVE keeps it until the shim has registered host memory with the driver
 * (its staging made), -LIVE seconds at most: a fixed time races the preparer on a loaded host. */
static int scenario_temporary(size_t bytes, double live, double settle) {
    CUdeviceptr d = 0;
    CHECK(p_cuMemAlloc(&d, bytes));
    if (live >= 0) {
        sleep_s(live);
    } else {
        for (double end = clock_s(CLOCK_MONOTONIC) - live;
             fake_count("cuMemHostRegister_v2") < 1 && clock_s(CLOCK_MONOTONIC) < end;)
            sleep_s(0.01);
    }
    CHECK(p_cuMemFree(d));
    sleep_s(settle);
    char buf[2048];
    status_fields(buf, sizeof(buf));
    emit("temporary", ",\"bytes\":%zu%s", bytes, buf);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* cuGetProcAddress obtained through cuGetProcAddress_v2, used as v1                           */
/* ------------------------------------------------------------------------------------------ */

typedef CUresult fn_getproc_v1_poisoned(const char *, void **, int, cuuint64_t, void *);

static int saxpy_with(fn_getproc_v1 *gpa, int version, const char *label) {
    void *alloc = NULL, *launch = NULL, *htod = NULL, *dtoh = NULL, *mfree = NULL;
    CUresult rc = gpa("cuMemAlloc", &alloc, version, 0);
    rc = rc ? rc : gpa("cuLaunchKernel", &launch, version, 0);
    rc = rc ? rc : gpa("cuMemcpyHtoD", &htod, version, 0);
    rc = rc ? rc : gpa("cuMemcpyDtoH", &dtoh, version, 0);
    rc = rc ? rc : gpa("cuMemFree", &mfree, version, 0);
    if (rc) return fail(label, rc);
    char w[512];
    where(alloc, w, sizeof(w));
    int n = 1000;
    size_t bytes = (size_t)n * sizeof(float);
    float x[1000], y[1000], out[1000];
    for (int i = 0; i < n; i++) {
        x[i] = (float)i * 0.5f;
        y[i] = 1.0f;
    }
    CUdeviceptr dx, dy;
    CHECK(((fn_cuMemAlloc *)alloc)(&dx, bytes));
    CHECK(((fn_cuMemAlloc *)alloc)(&dy, bytes));
    CHECK(((fn_cuMemcpyHtoD *)htod)(dx, x, bytes));
    CHECK(((fn_cuMemcpyHtoD *)htod)(dy, y, bytes));
    float a = 3.0f;
    void *params[] = {&a, &dx, &dy, &n};
    CHECK(((fn_cuLaunchKernel *)launch)(g_k_saxpy, 4, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
    CHECK(((fn_cuMemcpyDtoH *)dtoh)(out, dy, bytes));
    int bad = 0;
    for (int i = 0; i < n; i++) bad += out[i] != 3.0f * x[i] + 1.0f;
    ((fn_cuMemFree *)mfree)(dx);
    ((fn_cuMemFree *)mfree)(dy);
    emit("procaddr_use", ",\"via\":\"%s\",\"ok\":%s,\"mismatches\":%d,\"cuMemAlloc\":%s", label,
         bad ? "false" : "true", bad, w);
    return bad != 0;
}

static int scenario_procaddr(void) {
    char w1[512], w2[512];
    /* cudart asks for "cuGetProcAddress" itself; below 12000 the answer has the v1 ABI. */
    void *v1 = NULL, *v2 = NULL;
    CUdriverProcAddressQueryResult s1 = -1, s2 = -1;
    CUresult r1 = g_gpa2("cuGetProcAddress", &v1, 11080, 0, &s1);
    CUresult r2 = g_gpa2("cuGetProcAddress", &v2, 12000, 0, &s2);
    where(v1, w1, sizeof(w1));
    where(v2, w2, sizeof(w2));
    emit("procaddr", ",\"v1\":{\"rc\":%d,\"status\":%d,\"where\":%s},\"v2\":{\"rc\":%d,\"status\":%d,"
         "\"where\":%s},\"distinct\":%s",
         r1, (int)s1, w1, r2, (int)s2, w2, v1 != v2 ? "true" : "false");
    if (r1 || r2 || !v1 || !v2) return 1;
    int bad = 0;
    bad |= saxpy_with((fn_getproc_v1 *)v1, 12080, "v1");
    /* A v1 caller leaves garbage where a 5th argument would be: make it a pointer that cannot be
     * written. A correct v1 wrapper never looks at it; a v2-shaped one crashes here. */
    void *alloc = NULL;
    CUresult rp = ((fn_getproc_v1_poisoned *)v1)("cuMemAlloc", &alloc, 12080, 0, (void *)(uintptr_t)1);
    where(alloc, w1, sizeof(w1));
    emit("procaddr_poisoned", ",\"rc\":%d,\"where\":%s", rp, w1);
    bad |= rp != CUDA_SUCCESS;
    /* And the v2 ABI obtained the same way. */
    void *p = NULL;
    CUdriverProcAddressQueryResult st = -1;
    CUresult r = ((fn_getproc_v2 *)v2)("cuMemAlloc", &p, 12080, 0, &st);
    where(p, w2, sizeof(w2));
    emit("procaddr_v2_call", ",\"rc\":%d,\"status\":%d,\"where\":%s", r, (int)st, w2);
    bad |= r != CUDA_SUCCESS || st != CU_GET_PROC_ADDRESS_SUCCESS;
    /* Unknown names: CUDA_ERROR_NOT_FOUND, symbol not found, NULL. */
    p = (void *)&bad;
    st = -1;
    r = ((fn_getproc_v2 *)v2)("cuNoSuchFunction", &p, 12080, 0, &st);
    emit("procaddr_unknown", ",\"rc\":%d,\"status\":%d,\"null\":%s", r, (int)st,
         p == NULL ? "true" : "false");
    return bad;
}

/* ------------------------------------------------------------------------------------------ */

static void on_sigint(int sig) {
    (void)sig;
    g_sigints++;
}

/* Like Python's: SIGINT sets a flag and the interrupted call is expected to return. */
static void install_sigint_handler(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
}

static int usage(void) {
    fprintf(stderr, "usage: cudart_like [--cuda-version N] [--ptds] [--getproc v1|v2] "
                    "[--null-stream] [--sigint-handler] SCENARIO [ARGS...]\n");
    return 2;
}

static size_t arg_bytes(int argc, char **argv, int i, size_t dflt) {
    return i < argc ? (size_t)strtoull(argv[i], NULL, 0) : dflt;
}

int main(int argc, char **argv) {
    int i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (strcmp(argv[i], "--cuda-version") == 0 && i + 1 < argc)
            g_version = atoi(argv[++i]);
        else if (strcmp(argv[i], "--ptds") == 0)
            g_ptds = 1;
        else if (strcmp(argv[i], "--getproc") == 0 && i + 1 < argc)
            g_getproc_v1 = strcmp(argv[++i], "v1") == 0;
        else if (strcmp(argv[i], "--null-stream") == 0)
            g_null_stream = 1;
        else if (strcmp(argv[i], "--sigint-handler") == 0)
            install_sigint_handler();
        else
            return usage();
    }
    if (i >= argc) return usage();
    const char *scenario = argv[i++];
#ifdef CUDART_LIKE_DIRECT
    const char *door = "exported";
#else
    const char *door = g_getproc_v1 ? "getproc_v1" : "getproc_v2";
#endif
    emit("start", ",\"scenario\":\"%s\",\"door\":\"%s\",\"cuda_version\":%d,\"ptds\":%s", scenario,
         door, g_version, g_ptds ? "true" : "false");
    if (open_driver()) return 1;
    int rc;
    if (strcmp(scenario, "resolve") == 0) {
        rc = scenario_resolve();
    } else if (strcmp(scenario, "dlsym") == 0) {
        rc = scenario_dlsym();
    } else if ((rc = setup()) != 0) {
        /* reported */
    } else if (strcmp(scenario, "meminfo") == 0) {
        rc = scenario_meminfo(arg_bytes(argc, argv, i, 0));
    } else if (strcmp(scenario, "late_alloc") == 0) {
        rc = scenario_late_alloc(arg_bytes(argc, argv, i, 64 << 20));
    } else if (strcmp(scenario, "alloc") == 0 && i + 1 < argc && path_of(argv[i]) >= 0) {
        rc = scenario_alloc(path_of(argv[i]), arg_bytes(argc, argv, i + 1, 1 << 20));
    } else if (strcmp(scenario, "quota") == 0 && i < argc) {
        int path = i + 1 < argc ? path_of(argv[i + 1]) : P_ALLOC;
        long max = i + 2 < argc ? atol(argv[i + 2]) : 4096;
        rc = path < 0 ? usage() : scenario_quota(arg_bytes(argc, argv, i, 0), path, max);
    } else if (strcmp(scenario, "saxpy") == 0) {
        rc = scenario_saxpy(i < argc ? atoi(argv[i]) : 100000);
    } else if (strcmp(scenario, "copies") == 0) {
        rc = scenario_copies(arg_bytes(argc, argv, i, 1 << 16));
    } else if (strcmp(scenario, "paths") == 0) {
        rc = scenario_paths();
    } else if (strcmp(scenario, "hold") == 0 && i < argc) {
        rc = scenario_hold(atof(argv[i]), arg_bytes(argc, argv, i + 1, 0),
                           i + 2 < argc ? strtoull(argv[i + 2], NULL, 0) : 20000,
                           arg_bytes(argc, argv, i + 3, 0));
    } else if (strcmp(scenario, "grow") == 0 && i + 2 < argc) {
        rc = scenario_grow(atof(argv[i]), arg_bytes(argc, argv, i + 1, 0), atof(argv[i + 2]));
    } else if (strcmp(scenario, "idle") == 0 && i < argc) {
        rc = scenario_idle(atof(argv[i]), i + 1 < argc ? atof(argv[i + 1]) : 0.3,
                           arg_bytes(argc, argv, i + 2, 0));
    } else if (strcmp(scenario, "ipc") == 0 && i < argc && path_of(argv[i]) >= 0) {
        rc = scenario_ipc(path_of(argv[i]));
    } else if (strcmp(scenario, "ipc_export") == 0 && i + 1 < argc) {
        rc = scenario_ipc_export(arg_bytes(argc, argv, i, 0), atof(argv[i + 1]),
                                 arg_bytes(argc, argv, i + 2, 0));
    } else if (strcmp(scenario, "ipc_import") == 0 && i + 2 < argc) {
        rc = scenario_ipc_import(argv[i], arg_bytes(argc, argv, i + 1, 0), atof(argv[i + 2]));
    } else if (strcmp(scenario, "ctx_teardown") == 0) {
        rc = scenario_ctx_teardown(arg_bytes(argc, argv, i, 1u << 20));
    } else if (strcmp(scenario, "burst") == 0 && i + 2 < argc) {
        rc = scenario_burst(atoi(argv[i]), arg_bytes(argc, argv, i + 1, 0), atof(argv[i + 2]));
    } else if (strcmp(scenario, "blocks") == 0 && i + 2 < argc) {
        rc = scenario_blocks(atoi(argv[i]), arg_bytes(argc, argv, i + 1, 0), atof(argv[i + 2]));
    } else if (strcmp(scenario, "precopy_cycle") == 0 && i + 3 < argc) {
        rc = scenario_precopy_cycle(arg_bytes(argc, argv, i, 0), atof(argv[i + 1]),
                                    atof(argv[i + 2]), atof(argv[i + 3]));
    } else if (strcmp(scenario, "precopy_pending") == 0 && i + 1 < argc) {
        rc = scenario_precopy_pending(arg_bytes(argc, argv, i, 0), atof(argv[i + 1]));
    } else if (strcmp(scenario, "deep_idle") == 0 && i + 1 < argc) {
        rc = scenario_deep_idle(arg_bytes(argc, argv, i, 0), atof(argv[i + 1]));
    } else if (strcmp(scenario, "status") == 0) {
        rc = scenario_status(arg_bytes(argc, argv, i, 0));
    } else if (strcmp(scenario, "temporary") == 0 && i + 2 < argc) {
        rc = scenario_temporary(arg_bytes(argc, argv, i, 0), atof(argv[i + 1]), atof(argv[i + 2]));
    } else if (strcmp(scenario, "procaddr") == 0) {
        rc = scenario_procaddr();
    } else {
        rc = usage();
    }
    emit_stats();
    emit("exit", ",\"rc\":%d,\"sigints\":%d", rc, (int)g_sigints);
    return rc;
}
