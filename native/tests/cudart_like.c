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
 *   meminfo [BYTES]             cuMemGetInfo and NVML (memory, and the processes it lists) before
 *                               and after allocating BYTES
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
 *   free_in_turn BYTES WORK LINGER
 *                               allocate and write BYTES, launch a kernel of WORK seconds (once
 *                               PROBE_FREE_AFTER=FILE exists, when set), free BYTES (the free
 *                               waits for the kernel), stay connected LINGER seconds
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
 *   pin BYTES SECONDS           pin BYTES of host memory (cuMemHostRegister), hold them SECONDS,
 *                               unpin; "pinned" carries the driver's answer
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
#include <sys/mman.h>
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

#include "cudart_like_resolve.c"

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

#include "cudart_like_memory.c"
#include "cudart_like_numbers.c"
#include "cudart_like_paths.c"
#include "cudart_like_time.c"
#include "cudart_like_procaddr.c"

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
    } else if (strcmp(scenario, "free_in_turn") == 0 && i + 2 < argc) {
        rc = scenario_free_in_turn(arg_bytes(argc, argv, i, 0), atof(argv[i + 1]),
                                   atof(argv[i + 2]));
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
    } else if (strcmp(scenario, "pin") == 0 && i + 1 < argc) {
        rc = scenario_pin(arg_bytes(argc, argv, i, 0), atof(argv[i + 1]));
    } else {
        rc = usage();
    }
    emit_stats();
    emit("exit", ",\"rc\":%d,\"sigints\":%d", rc, (int)g_sigints);
    return rc;
}
