/*
 * A test-only stand-in for the CUDA driver (libcuda.so.1) and, built with -DGPUSHARE_FAKE_NVML,
 * for NVML (libnvidia-ml.so.1). CI has no GPU: the tests run the real shim (libgpushare.so) in
 * front of this library.
 *
 * What it models, so that the shim's mistakes show up as test failures:
 *   - the real exported symbols and signatures (cuda.h of CUDA 12.x/13.x), including the _v2, _ptds
 *     and _ptsz variants; cuGetProcAddress (v1, 4 arguments) and cuGetProcAddress_v2 (5 arguments)
 *     map (base name, cudaVersion, flags) to the versioned export the real driver returns and hand
 *     back that export's own address (a hidden alias, so an interposing shim cannot substitute its
 *     own function), which is what the shim identifies variants by;
 *   - device memory is host memory (mmap'd, so untouched pages cost nothing): copies and memsets
 *     really move bytes, kernels really compute, so argument corruption gives wrong numbers;
 *   - managed allocations remember where they live; cuMemPrefetchAsync (v1 and _v2) moves them and
 *     counts bytes per direction; a kernel touching a managed allocation that lives on the host
 *     counts as a page-fault migration (what an explicit restore is meant to avoid);
 *   - streams have a "busy until" time: kernel "sleep" (one unsigned long long parameter:
 *     microseconds) advances it, cuStreamQuery answers CUDA_ERROR_NOT_READY until then and the
 *     synchronise calls wait;
 *   - a context must be current for the calls that need one (CUDA_ERROR_INVALID_CONTEXT otherwise),
 *     and cuInit must have run (CUDA_ERROR_NOT_INITIALIZED otherwise), as on the real driver;
 *   - cuCtxSynchronize waits for its own context's work; a stream belongs to the context it was
 *     made in and dies with it (cuDevicePrimaryCtxReset, the last cuDevicePrimaryCtxRelease);
 *   - stream capture (cuStreamBeginCapture*, cuStreamEndCapture, cuStreamIsCapturing): launches
 *     on a capturing stream are recorded, not run; a cuCtxSynchronize, cuStreamQuery or
 *     cuStreamSynchronize while a stream captures in global or relaxed mode answers 900 and the
 *     capture's end 901, as measured on an H100 (counted in the stats' "captures").
 *
 * Kernels (cuModuleLoadData with any image, then cuModuleGetFunction by name):
 *   "sleep"  (unsigned long long us)                                  the stream is busy for us
 *   "saxpy"  (float a, CUdeviceptr x, CUdeviceptr y, int n)            y = a*x + y, computed at launch
 *   "noop"   ()
 *
 * Devices: GPUSHARE_FAKE_DEVICES (default 1, at most 8) physical devices. The driver honours
 * CUDA_VISIBLE_DEVICES as the real one does: a comma-separated list of indexes or UUIDs ("GPU-..."
 * in full, or a prefix that names one device); the list ends at the first entry that names no
 * device (or one already listed); an empty value hides every device (cuInit: CUDA_ERROR_NO_DEVICE).
 * NVML ignores it, as the real NVML does. Each device has its own memory: an allocation lives on
 * the device of the current context (cuMemCreate: the device its properties name), is refused
 * when that device is full, and cuMemGetInfo answers for the current context's device
 * (fakecuda_stats_json: device_resident_bytes, one entry per physical device).
 *
 * Environment: GPUSHARE_FAKE_DEVICE_TOTAL (bytes, units allowed; default 16GiB; a comma-separated
 * list gives each device its own, the last one repeating), GPUSHARE_FAKE_UUID
 * (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx; comma-separated per device; a device without one gets
 * the default UUID with its last byte plus the device's index), GPUSHARE_FAKE_DRIVER_VERSION
 * (default 13000), GPUSHARE_FAKE_PREFETCH_GBPS (model prefetch time on the stream; default 0 =
 * instantaneous), GPUSHARE_FAKE_TRACE (a file: one JSON line per prefetch and per
 * cuCtxSynchronize), GPUSHARE_FAKE_STATS_FILE (the stats document is written there at exit),
 * GPUSHARE_FAKE_LAUNCH_DELAY_US (a launch stays that long inside the driver before its work is
 * queued; cuCtxSynchronize traces how many are), GPUSHARE_FAKE_MAP_DELAY_US (each cuMemMap takes
 * that long), GPUSHARE_FAKE_UNMAP_DELAY_US (each cuMemUnmap: an eviction that lasts),
 * GPUSHARE_FAKE_OTHER_BYTES (memory other processes hold on the device: cuMemGetInfo's free
 * shrinks by it, and cuMemCreate refuses what would not fit beside it).
 *
 * Test-only exports: fakecuda_stats_json(buf, n) (snprintf-like: returns the length needed),
 * fakecuda_call_count(name) and fakecuda_process_device_bytes(pid) (fake_checkpoint.c: the process
 * checkpoint API across processes, GPUSHARE_FAKE_CHECKPOINT_DIR, GPUSHARE_FAKE_CONTEXT_BYTES).
 * GPUSHARE_FAKE_ASYNC_COPIES=1: asynchronous copies complete at a later synchronisation, and one
 * whose device memory is unmapped first is lost (fake_async.c).
 * GPUSHARE_FAKE_LOSE_H2D_HEAD=N: the process's first asynchronous host-to-device copy of at least
 * 2N bytes leaves its first N bytes zero (a restore the device lost the start of: what
 * GPUSHARE_VERIFY_MOVES must catch and mend); GPUSHARE_FAKE_LOSE_D2H_HEAD=N the same for the
 * first device-to-host one (a copy into host staging that lost its start, as seen on an H100:
 * what the shim's sampled check of each copy out must catch). Not with GPUSHARE_FAKE_ASYNC_COPIES.
 * With GPUSHARE_FAKE_FAULTS_ARMED=PATH, these faults wait until PATH exists (a test arms them at
 * the moment the copy it means is next). GPUSHARE_FAKE_CTX_SYNC_FAILS=PATH: the first
 * cuCtxSynchronize while PATH exists fails (CUDA_ERROR_UNKNOWN) and removes it (a test sees when).
 */
#include "base/cuda_abi.h"

#include <ctype.h>
#include <stdatomic.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------ */
/* Shared helpers (both libraries)                                                              */
/* ------------------------------------------------------------------------------------------ */

static unsigned long long fk_parse_bytes(const char *s, unsigned long long dflt) {
    if (!s || !*s) return dflt;
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || v < 0) return dflt;
    while (*end == ' ') end++;
    unsigned long long mul = 1;
    switch (toupper((unsigned char)*end)) {
    case 'K': mul = 1ULL << 10; break;
    case 'M': mul = 1ULL << 20; break;
    case 'G': mul = 1ULL << 30; break;
    case 'T': mul = 1ULL << 40; break;
    default: break;
    }
    return (unsigned long long)(v * (double)mul);
}

#define FK_MAX_DEV 8

static int fk_ndev(void) {
    const char *s = getenv("GPUSHARE_FAKE_DEVICES");
    int n = s && *s ? atoi(s) : 1;
    return n < 1 ? 1 : n > FK_MAX_DEV ? FK_MAX_DEV : n;
}

/* Item i of a comma-separated list (copied into out), or NULL when the list has fewer. */
static const char *fk_item(const char *list, int i, char *out, size_t n) {
    if (!list || !*list) return NULL;
    for (int k = 0; k < i; k++) {
        list = strchr(list, ',');
        if (!list) return NULL;
        list++;
    }
    size_t len = strcspn(list, ",");
    if (len >= n) len = n - 1;
    memcpy(out, list, len);
    out[len] = 0;
    return out;
}

/* Total memory of physical device `phys` (the list's last entry repeats). */
static unsigned long long fk_phys_total(int phys) {
    const char *list = getenv("GPUSHARE_FAKE_DEVICE_TOTAL");
    char item[64];
    const char *s = NULL;
    for (int i = phys; i >= 0 && !s; i--) s = fk_item(list, i, item, sizeof item);
    return fk_parse_bytes(s, 16ULL << 30);
}

/* UUID bytes of physical device `phys`. */
static void fk_phys_uuid(int phys, unsigned char bytes[16]) {
    static const unsigned char dflt[16] = {0x6a, 0x75, 0x70, 0x79, 0x74, 0x65, 0x72, 0x2d,
                                           0x67, 0x70, 0x75, 0x73, 0x68, 0x61, 0x72, 0x65};
    memcpy(bytes, dflt, 16);
    bytes[15] = (unsigned char)(bytes[15] + phys);
    char item[128];
    const char *s = fk_item(getenv("GPUSHARE_FAKE_UUID"), phys, item, sizeof item);
    if (!s || !*s) return;
    if (strncmp(s, "GPU-", 4) == 0) s += 4;
    unsigned char out[16];
    int k = 0;
    for (const char *p = s; *p && k < 32; p++) {
        if (*p == '-') continue;
        if (!isxdigit((unsigned char)*p)) break;
        int v = isdigit((unsigned char)*p) ? *p - '0' : (tolower((unsigned char)*p) - 'a' + 10);
        if (k % 2 == 0)
            out[k / 2] = (unsigned char)(v << 4);
        else
            out[k / 2] |= (unsigned char)v;
        k++;
    }
    if (k == 32) memcpy(bytes, out, 16);
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (lower case, as nvidia-smi prints it). */
static void fk_phys_uuid_string(int phys, char *out, size_t n) {
    unsigned char b[16];
    fk_phys_uuid(phys, b);
    snprintf(out, n, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

#ifndef GPUSHARE_FAKE_NVML

/* ------------------------------------------------------------------------------------------ */
/* Types the shim treats as opaque, with their real layouts (cuda.h)                           */
/* ------------------------------------------------------------------------------------------ */

enum {
    FK_ERROR_INVALID_DEVICE = 101,
    FK_ERROR_ILLEGAL_ADDRESS = 700,
    FK_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    FK_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    FK_ERROR_ILLEGAL_STATE = 401,
    FK_MEM_LOCATION_TYPE_HOST_NUMA = 3,
    FK_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 4,
};

typedef struct CUmod_st *CUmodule;
typedef struct CUexecAffinityParam_st CUexecAffinityParam;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

/* ------------------------------------------------------------------------------------------ */
/* State                                                                                        */
/* ------------------------------------------------------------------------------------------ */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_inited;
static unsigned long long fk_device_total(void); /* the current context's device */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void sleep_until_ns(uint64_t t) {
    for (;;) {
        uint64_t n = now_ns();
        if (n >= t) return;
        uint64_t d = t - n;
        struct timespec ts = {(time_t)(d / 1000000000ULL), (long)(d % 1000000000ULL)};
        nanosleep(&ts, NULL);
    }
}

/* A delay setting (microseconds, from environment variable `name`), read once into *cache. */
static long env_delay_us(const char *name, long *cache) {
    if (*cache < 0) {
        const char *d = getenv(name);
        *cache = d && *d ? atol(d) : 0;
    }
    return *cache;
}

static void delay_us(long us) {
    if (us > 0) sleep_until_ns(now_ns() + (uint64_t)us * 1000ULL);
}

/* Per-function call counts, keyed by __func__ (= the exported symbol's name). */
#define FK_MAX_FN 320
static const char *g_fn_names[FK_MAX_FN];
static unsigned long g_fn_counts[FK_MAX_FN];
static int g_nfn;

static int fn_index(const char *name) {
    pthread_mutex_lock(&g_lock);
    int i;
    for (i = 0; i < g_nfn; i++)
        if (strcmp(g_fn_names[i], name) == 0) break;
    if (i == g_nfn && g_nfn < FK_MAX_FN) g_fn_names[g_nfn++] = name;
    if (i >= FK_MAX_FN) i = FK_MAX_FN - 1;
    pthread_mutex_unlock(&g_lock);
    return i;
}

static void fk_ckpt_gate(void); /* fake_checkpoint.c: blocks while the process is locked */
static void fk_ckpt_start(void);
#define COUNT()                                                                                  \
    do {                                                                                         \
        fk_ckpt_gate();                                                                          \
        static int idx_ = -1;                                                                    \
        int i_ = __atomic_load_n(&idx_, __ATOMIC_ACQUIRE);                                       \
        if (i_ < 0) {                                                                            \
            i_ = fn_index(__func__);                                                             \
            __atomic_store_n(&idx_, i_, __ATOMIC_RELEASE);                                       \
        }                                                                                        \
        __atomic_fetch_add(&g_fn_counts[i_], 1, __ATOMIC_RELAXED);                               \
    } while (0)

/* Contexts */
#define CTX_MAGIC 0x43545821u
struct CUctx_st {
    uint32_t magic;
    int primary;
    CUdevice dev; /* ordinal */
    uint64_t busy_until; /* CLOCK_MONOTONIC ns: the work of this context's streams */
};
static struct CUctx_st g_primary[FK_MAX_DEV] = {
    {CTX_MAGIC, 1, 0, 0}, {CTX_MAGIC, 1, 1, 0}, {CTX_MAGIC, 1, 2, 0}, {CTX_MAGIC, 1, 3, 0},
    {CTX_MAGIC, 1, 4, 0}, {CTX_MAGIC, 1, 5, 0}, {CTX_MAGIC, 1, 6, 0}, {CTX_MAGIC, 1, 7, 0}};
static int g_primary_refs[FK_MAX_DEV];
static __thread CUcontext t_ctx_stack[32];
static __thread int t_ctx_depth;

static CUcontext cur_ctx(void) { return t_ctx_depth > 0 ? t_ctx_stack[t_ctx_depth - 1] : NULL; }

static int ctx_ok(CUcontext c) { return c && c->magic == CTX_MAGIC; }

/* Streams */
#define STREAM_MAGIC 0x5354524du
struct CUstream_st {
    uint32_t magic;
    uint64_t busy_until; /* CLOCK_MONOTONIC ns */
    struct CUctx_st *ctx; /* NULL for the implicit streams: the current context's */
    int capturing;        /* 1 + CUstreamCaptureMode while a capture is in progress */
    int invalidated;      /* the capture was invalidated by an unsafe call */
};

/* ---- core: stream capture and context teardown (see the block "core: captures, contexts and
 * launch paths" near the end) ---- */
static int fk_capture_unsafe_call(void);
static int fk_stream_captured(struct CUstream_st *s);
static void fk_register_stream(struct CUstream_st *s);
static unsigned long g_captures_ended, g_captures_invalidated, g_capture_unsafe_calls,
    g_captured_launches;
static int g_calls_in_driver; /* launches inside the driver, work not queued yet */
static struct CUstream_st g_legacy_stream = {STREAM_MAGIC, 0, NULL, 0, 0};
static __thread struct CUstream_st t_ptds_stream = {STREAM_MAGIC, 0, NULL, 0, 0};
static uint64_t g_device_busy_until;

/* Events */
#define EVENT_MAGIC 0x45564e54u
struct CUevent_st {
    uint32_t magic;
    uint64_t at;
    struct CUstream_st *s; /* where it was recorded, and the copies queued there before it */
    uint64_t seq;
};

/* Kernels */
enum { K_SLEEP, K_SAXPY, K_NOOP, K_COUNT };
struct CUfunc_st {
    int kind;
    const char *name;
};
static struct CUfunc_st g_funcs[K_COUNT] = {{K_SLEEP, "sleep"}, {K_SAXPY, "saxpy"}, {K_NOOP, "noop"}};
struct CUmod_st {
    int dummy;
};
static struct CUmod_st g_module;
static unsigned long g_kernel_counts[K_COUNT];
static unsigned long g_launches, g_graph_launches;

/* Allocations */
enum { A_DEVICE, A_PITCH, A_MANAGED, A_ASYNC, A_POOL, A_RESERVED };
static const char *const kind_names[] = {"device", "pitch", "managed", "async", "pool", "reserved"};
struct fk_alloc {
    uintptr_t base;
    size_t size;
    int kind;
    int on_host; /* managed only: 1 when it lives in host memory */
    int phys;    /* the physical device it lives on */
};
static struct fk_alloc *g_allocs;
static size_t g_nalloc, g_capalloc;

struct fk_handle {
    unsigned long long id;
    int fd;
    size_t size;
    int released;
    int maps;
    int extra_refs; /* cuMemRetainAllocationHandle: each needs its own cuMemRelease */
    int exportable; /* created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
    int imported;   /* cuMemImportFromShareableHandle: another process's memory, not counted */
    int phys;       /* the physical device its memory is on */
};
static struct fk_handle *g_handles;
static size_t g_nhandles, g_caphandles;
static unsigned long long g_next_handle = 1;

struct fk_mapping {
    uintptr_t base;
    size_t size;
    unsigned long long handle;
};
static struct fk_mapping *g_maps;
static size_t g_nmaps, g_capmaps;

static unsigned long long g_live_device_bytes;  /* device, pitch, async, pool, cuMemCreate */
/* What each physical device holds of this process's: its allocations, handles and arrays, and
 * its managed allocations not on the host. */
static unsigned long long g_dev_resident[FK_MAX_DEV];
static unsigned long long g_live_managed_bytes;
static unsigned long long g_managed_on_host_bytes;
static unsigned long long g_prefetch_to_host_bytes, g_prefetch_to_device_bytes;
static unsigned long g_prefetch_to_host_calls, g_prefetch_to_device_calls;
static unsigned long long g_fault_to_device_bytes;
static unsigned long long g_peak_device_bytes;

/* A stream-ordered pool (fake_graph.c): each device's default one, and those cuMemPoolCreate made. */
struct CUmemPoolHandle_st {
    int dev, destroyed;
    unsigned long long reserved, used, threshold, reserved_high, used_high;
};
static struct CUmemPoolHandle_st g_default_pools[FK_MAX_DEV] = {
    {.dev = 0}, {.dev = 1}, {.dev = 2}, {.dev = 3}, {.dev = 4}, {.dev = 5}, {.dev = 6}, {.dev = 7}};

#define GROW(arr, n, cap)                                                                        \
    do {                                                                                         \
        if ((n) == (cap)) {                                                                      \
            size_t nc_ = (cap) ? (cap) * 2 : 64;                                                 \
            void *p_ = realloc((arr), nc_ * sizeof(*(arr)));                                     \
            if (!p_) abort();                                                                    \
            (arr) = p_;                                                                          \
            (cap) = nc_;                                                                         \
        }                                                                                        \
    } while (0)

static void note_peak(void) {
    unsigned long long resident =
        g_live_device_bytes + g_live_managed_bytes - g_managed_on_host_bytes;
    if (resident > g_peak_device_bytes) g_peak_device_bytes = resident;
}

/* Caller holds g_lock. */
static struct fk_alloc *find_alloc_locked(uintptr_t p, size_t n) {
    for (size_t i = 0; i < g_nalloc; i++) {
        struct fk_alloc *a = &g_allocs[i];
        if (a->kind == A_RESERVED) continue;
        if (p >= a->base && p < a->base + a->size && n <= a->base + a->size - p) return a;
    }
    return NULL;
}

static int mapped_locked(uintptr_t p, size_t n) {
    for (size_t i = 0; i < g_nmaps; i++) {
        struct fk_mapping *m = &g_maps[i];
        if (p >= m->base && p < m->base + m->size && n <= m->base + m->size - p) return 1;
    }
    return 0;
}

/* Is [p, p+n) device memory this driver handed out (an allocation or a cuMemMap'd range)? */
static int dev_range_ok(CUdeviceptr p, size_t n) {
    if (!p) return 0;
    pthread_mutex_lock(&g_lock);
    int ok = find_alloc_locked((uintptr_t)p, n) != NULL || mapped_locked((uintptr_t)p, n);
    pthread_mutex_unlock(&g_lock);
    return ok;
}

static void *map_anon(size_t size) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static int fk_cur_phys(void); /* the physical device of the current context */

static CUresult add_alloc(CUdeviceptr *dptr, size_t size, int kind) {
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    int phys = fk_cur_phys();
    pthread_mutex_lock(&g_lock);
    if (kind != A_MANAGED && g_dev_resident[phys] + size > fk_device_total()) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    void *p = map_anon(size);
    if (!p) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    GROW(g_allocs, g_nalloc, g_capalloc);
    g_allocs[g_nalloc++] = (struct fk_alloc){(uintptr_t)p, size, kind, 0, phys};
    g_dev_resident[phys] += size;
    if (kind == A_MANAGED)
        g_live_managed_bytes += size;
    else
        g_live_device_bytes += size;
    note_peak();
    pthread_mutex_unlock(&g_lock);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

/* Frees an allocation made by the cuMemAlloc family (not a reserved range). */
static CUresult free_alloc(CUdeviceptr dptr) {
    if (!dptr) return CUDA_SUCCESS; /* cuMemFree(0) is a no-op on the real driver */
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_nalloc; i++) {
        struct fk_alloc a = g_allocs[i];
        if (a.base != (uintptr_t)dptr || a.kind == A_RESERVED) continue;
        g_allocs[i] = g_allocs[--g_nalloc];
        if (a.kind != A_MANAGED || !a.on_host) g_dev_resident[a.phys] -= a.size;
        if (a.kind == A_MANAGED) {
            g_live_managed_bytes -= a.size;
            if (a.on_host) g_managed_on_host_bytes -= a.size;
        } else {
            g_live_device_bytes -= a.size;
        }
        pthread_mutex_unlock(&g_lock);
        munmap((void *)a.base, a.size);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_INVALID_VALUE;
}

static FILE *trace_file(void) {
    static FILE *f;
    static int tried;
    if (!tried) {
        tried = 1;
        const char *path = getenv("GPUSHARE_FAKE_TRACE");
        if (path && *path) {
            f = fopen(path, "a");
            if (f) setvbuf(f, NULL, _IOLBF, 0);
        }
    }
    return f;
}

/* ------------------------------------------------------------------------------------------ */
/* Checks                                                                                       */
/* ------------------------------------------------------------------------------------------ */

#define NEED_INIT()                                                                              \
    do {                                                                                         \
        if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;                                        \
    } while (0)

#define NEED_CTX()                                                                               \
    do {                                                                                         \
        NEED_INIT();                                                                             \
        if (!cur_ctx()) return CUDA_ERROR_INVALID_CONTEXT;                                       \
    } while (0)

/* The implicit streams need a current context; an explicit stream carries its own. */
static CUresult get_stream(CUstream h, int per_thread, struct CUstream_st **out) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (h == NULL || h == (CUstream)(uintptr_t)1 || h == (CUstream)(uintptr_t)2) {
        if (!cur_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
        if (h == (CUstream)(uintptr_t)2 || (h == NULL && per_thread))
            *out = &t_ptds_stream;
        else
            *out = &g_legacy_stream;
        return CUDA_SUCCESS;
    }
    if (h->magic != STREAM_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    *out = h;
    return CUDA_SUCCESS;
}

static void stream_add_busy(struct CUstream_st *s, uint64_t ns) {
    struct CUctx_st *ctx = s->ctx ? s->ctx : cur_ctx();
    pthread_mutex_lock(&g_lock);
    uint64_t n = now_ns();
    uint64_t start = s->busy_until > n ? s->busy_until : n;
    s->busy_until = start + ns;
    if (s->busy_until > g_device_busy_until) g_device_busy_until = s->busy_until;
    if (ctx && s->busy_until > ctx->busy_until) ctx->busy_until = s->busy_until;
    pthread_mutex_unlock(&g_lock);
}

static uint64_t stream_busy_until(struct CUstream_st *s) {
    pthread_mutex_lock(&g_lock);
    uint64_t t = s->busy_until;
    pthread_mutex_unlock(&g_lock);
    return t;
}

#include "fake_async.c"

static void wait_device(void) {
    pthread_mutex_lock(&g_lock);
    uint64_t t = g_device_busy_until;
    pthread_mutex_unlock(&g_lock);
    sleep_until_ns(t);
    fk_async_complete(NULL, UINT64_MAX);
}

/* ------------------------------------------------------------------------------------------ */
/* Initialisation, device, context                                                              */
/* ------------------------------------------------------------------------------------------ */

/* CUDA_VISIBLE_DEVICES: ordinal -> physical device. */
static int g_vis[FK_MAX_DEV], g_nvis = -1;
static pthread_once_t g_vis_once = PTHREAD_ONCE_INIT;

static int fk_match_token(const char *tok, int ndev) {
    size_t len = strlen(tok);
    int digits = len > 0;
    for (size_t i = 0; i < len; i++) digits &= isdigit((unsigned char)tok[i]) != 0;
    if (digits) {
        int idx = atoi(tok);
        return idx < ndev ? idx : -1;
    }
    char want[96];
    snprintf(want, sizeof want, "%s%s", strncasecmp(tok, "GPU-", 4) == 0 ? "" : "GPU-", tok);
    int found = -1;
    for (int d = 0; d < ndev; d++) {
        char u[64];
        fk_phys_uuid_string(d, u, sizeof u);
        if (strncasecmp(u, want, strlen(want)) == 0) {
            if (found >= 0) return -1; /* ambiguous prefix */
            found = d;
        }
    }
    return found;
}

static void fk_vis_init(void) {
    int ndev = fk_ndev(), n = 0;
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    if (!env) {
        for (int d = 0; d < ndev; d++) g_vis[n++] = d;
        g_nvis = n;
        return;
    }
    char item[128];
    for (int i = 0; n < FK_MAX_DEV && fk_item(env, i, item, sizeof item); i++) {
        char *t = item;
        while (*t == ' ') t++;
        size_t len = strlen(t);
        while (len > 0 && t[len - 1] == ' ') t[--len] = 0;
        int d = fk_match_token(t, ndev);
        int dup = 0;
        for (int k = 0; k < n; k++) dup |= g_vis[k] == d;
        if (d < 0 || dup) break;
        g_vis[n++] = d;
    }
    g_nvis = n;
}

static int fk_nvis(void) {
    pthread_once(&g_vis_once, fk_vis_init);
    return g_nvis;
}

/* The physical device of ordinal `dev`, or -1 when no visible device has that ordinal. */
static int fk_phys(CUdevice dev) {
    int n = fk_nvis();
    return dev >= 0 && dev < n ? g_vis[dev] : -1;
}

/* Test-only export: the physical device this process's allocations are counted on. */
int fakecuda_physical_device(void) {
    CUcontext c = cur_ctx();
    int phys = fk_phys(c ? c->dev : 0);
    return phys < 0 ? 0 : phys;
}

static int fk_cur_phys(void) { return fakecuda_physical_device(); }

static unsigned long long fk_device_total(void) {
    return fk_phys_total(fakecuda_physical_device());
}

CUresult cuInit(unsigned int flags) {
    COUNT();
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (fk_nvis() == 0) return 100; /* CUDA_ERROR_NO_DEVICE: CUDA_VISIBLE_DEVICES hides them all */
    g_inited = 1;
    static pthread_once_t ckpt_once = PTHREAD_ONCE_INIT;
    pthread_once(&ckpt_once, fk_ckpt_start);
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *driverVersion) {
    COUNT();
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    const char *v = getenv("GPUSHARE_FAKE_DRIVER_VERSION");
    *driverVersion = v && *v ? atoi(v) : 13000;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    COUNT();
    NEED_INIT();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(ordinal) < 0) return FK_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    COUNT();
    NEED_INIT();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = fk_nvis();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", "gpushare stand-in GPU");
    return CUDA_SUCCESS;
}

static CUresult fill_uuid(CUuuid *uuid, CUdevice dev) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    int phys = fk_phys(dev);
    if (phys < 0) return FK_ERROR_INVALID_DEVICE;
    fk_phys_uuid(phys, (unsigned char *)uuid->bytes);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    COUNT();
    return fill_uuid(uuid, dev);
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    COUNT();
    return fill_uuid(uuid, dev);
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    *bytes = (size_t)fk_phys_total(fk_phys(dev));
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case 16: *pi = 132; break;  /* MULTIPROCESSOR_COUNT */
    case 75: *pi = 9; break;    /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *pi = 0; break;    /* COMPUTE_CAPABILITY_MINOR */
    case 83: *pi = 1; break;    /* MANAGED_MEMORY */
    case 89: *pi = 1; break;    /* CONCURRENT_MANAGED_ACCESS */
    case 115: *pi = 1; break;   /* MEMORY_POOLS_SUPPORTED */
    case 102: *pi = 1; break;   /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    default: *pi = 0; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!pool_out) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    *pool_out = &g_default_pools[dev];
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    __atomic_fetch_add(&g_primary_refs[dev], 1, __ATOMIC_RELAXED);
    *pctx = &g_primary[dev];
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    COUNT();
    NEED_INIT();
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    if (__atomic_load_n(&g_primary_refs[dev], __ATOMIC_RELAXED) <= 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    __atomic_fetch_sub(&g_primary_refs[dev], 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    COUNT();
    NEED_INIT();
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    if (flags) *flags = 0;
    if (active) *active = __atomic_load_n(&g_primary_refs[dev], __ATOMIC_RELAXED) > 0;
    return CUDA_SUCCESS;
}

static CUresult ctx_create(CUcontext *pctx, CUdevice dev) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    if (t_ctx_depth >= 32) return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUctx_st *c = calloc(1, sizeof(*c));
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    c->magic = CTX_MAGIC;
    c->dev = dev;
    t_ctx_stack[t_ctx_depth++] = c;
    *pctx = c;
    return CUDA_SUCCESS;
}

/* v1 (cudaVersion < 3020): 32-bit ABI nobody uses any more; present so that a request for an
 * old version resolves to a distinct function, as on the real driver. */
CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    COUNT();
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    COUNT();
    return ctx_create(pctx, dev);
}

CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                        unsigned int flags, CUdevice dev) {
    COUNT();
    return ctx_create(pctx, dev);
}

CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                        CUdevice dev) {
    COUNT();
    return ctx_create(pctx, dev);
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
    COUNT();
    NEED_INIT();
    if (!ctx_ok(ctx) || ctx->primary) return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = t_ctx_depth - 1; i >= 0; i--) {
        if (t_ctx_stack[i] == ctx) {
            memmove(&t_ctx_stack[i], &t_ctx_stack[i + 1],
                    (size_t)(t_ctx_depth - i - 1) * sizeof(CUcontext));
            t_ctx_depth--;
        }
    }
    ctx->magic = 0; /* leaked on purpose: a use after destroy is then detected */
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    COUNT();
    NEED_INIT();
    if (ctx == NULL) {
        if (t_ctx_depth > 0) t_ctx_depth--;
        return CUDA_SUCCESS;
    }
    if (!ctx_ok(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_ctx_depth == 0)
        t_ctx_stack[t_ctx_depth++] = ctx;
    else
        t_ctx_stack[t_ctx_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    COUNT();
    NEED_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = cur_ctx();
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    COUNT();
    NEED_INIT();
    if (!ctx_ok(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_ctx_depth >= 32) return CUDA_ERROR_OUT_OF_MEMORY;
    t_ctx_stack[t_ctx_depth++] = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    COUNT();
    NEED_INIT();
    if (t_ctx_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = t_ctx_stack[--t_ctx_depth];
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device) {
    COUNT();
    NEED_CTX();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    *device = cur_ctx()->dev;
    return CUDA_SUCCESS;
}

/* With GPUSHARE_FAKE_TRACE, each synchronisation leaves a line saying which thread waited, from
 * when to when, and until when the device was busy as it began: what the quit tests read to see
 * that a process killed mid-kernel waited for its work (the line is out before the process dies). */
CUresult cuCtxSynchronize(void) {
    COUNT();
    NEED_CTX();
    const char *fails = getenv("GPUSHARE_FAKE_CTX_SYNC_FAILS");
    if (fails && *fails && unlink(fails) == 0) return CUDA_ERROR_UNKNOWN; /* once, then gone */
    if (fk_capture_unsafe_call()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    uint64_t begin = now_ns();
    int in_driver = __atomic_load_n(&g_calls_in_driver, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&g_lock);
    uint64_t until = g_device_busy_until, ctx_until = cur_ctx()->busy_until;
    pthread_mutex_unlock(&g_lock);
    sleep_until_ns(ctx_until); /* a context waits for its own work only */
    fk_async_complete(NULL, UINT64_MAX);
    FILE *f = trace_file();
    if (f) {
        char name[32] = "";
        pthread_getname_np(pthread_self(), name, sizeof(name));
        fprintf(f,
                "{\"op\":\"ctx_sync\",\"pid\":%d,\"thread\":\"%s\",\"t_begin\":%.6f,"
                "\"t_end\":%.6f,\"busy_until\":%.6f,\"dev\":%d,\"ctx_busy_until\":%.6f,"
                "\"calls_in_driver\":%d}\n",
                (int)getpid(), name, begin / 1e9, now_ns() / 1e9, until / 1e9, cur_ctx()->dev,
                ctx_until / 1e9, in_driver);
    }
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Streams and events                                                                           */
/* ------------------------------------------------------------------------------------------ */

static CUresult stream_create(CUstream *ph) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!cur_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    if (!ph) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = calloc(1, sizeof(*s));
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = STREAM_MAGIC;
    s->ctx = cur_ctx();
    fk_register_stream(s);
    *ph = s;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    COUNT();
    return stream_create(phStream);
}

CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
    COUNT();
    return stream_create(phStream);
}

static CUresult stream_destroy(CUstream h) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!h || h == (CUstream)(uintptr_t)1 || h == (CUstream)(uintptr_t)2 || h->magic != STREAM_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    h->magic = 0; /* leaked on purpose: a use after destroy is then detected */
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy(CUstream hStream) {
    COUNT();
    return stream_destroy(hStream);
}

CUresult cuStreamDestroy_v2(CUstream hStream) {
    COUNT();
    return stream_destroy(hStream);
}

static CUresult stream_query(CUstream h, int per_thread) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (fk_capture_unsafe_call()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (now_ns() < stream_busy_until(s)) return CUDA_ERROR_NOT_READY;
    fk_async_complete(s == &g_legacy_stream ? NULL : s, UINT64_MAX);
    return CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream hStream) {
    COUNT();
    return stream_query(hStream, 0);
}

CUresult cuStreamQuery_ptsz(CUstream hStream) {
    COUNT();
    return stream_query(hStream, 1);
}

static CUresult stream_sync(CUstream h, int per_thread) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (fk_capture_unsafe_call()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (s == &g_legacy_stream)
        wait_device(); /* the legacy stream synchronises with every blocking stream */
    else
        sleep_until_ns(stream_busy_until(s));
    fk_async_complete(s == &g_legacy_stream ? NULL : s, UINT64_MAX);
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream hStream) {
    COUNT();
    return stream_sync(hStream, 0);
}

CUresult cuStreamSynchronize_ptsz(CUstream hStream) {
    COUNT();
    return stream_sync(hStream, 1);
}

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    COUNT();
    NEED_CTX();
    if (!phEvent) return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof(*e));
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = EVENT_MAGIC;
    *phEvent = e;
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent e, CUstream h, int per_thread) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (!e || e->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    e->at = stream_busy_until(s);
    e->s = s == &g_legacy_stream ? NULL : s;
    e->seq = fk_async_mark();
    if (s == &g_legacy_stream) { /* the legacy stream waits for every blocking stream */
        pthread_mutex_lock(&g_lock);
        if (g_device_busy_until > e->at) e->at = g_device_busy_until;
        pthread_mutex_unlock(&g_lock);
    }
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
    COUNT();
    return event_record(hEvent, hStream, 0);
}

CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) {
    COUNT();
    return event_record(hEvent, hStream, 1);
}

CUresult cuEventQuery(CUevent hEvent) {
    COUNT();
    NEED_INIT();
    if (!hEvent || hEvent->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    if (now_ns() < hEvent->at) return CUDA_ERROR_NOT_READY;
    fk_async_complete(hEvent->s, hEvent->seq);
    return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent hEvent) {
    COUNT();
    NEED_INIT();
    if (!hEvent || hEvent->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    sleep_until_ns(hEvent->at);
    fk_async_complete(hEvent->s, hEvent->seq);
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent hEvent) {
    COUNT();
    NEED_INIT();
    if (!hEvent || hEvent->magic != EVENT_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    hEvent->magic = 0;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Memory: allocation                                                                           */
/* ------------------------------------------------------------------------------------------ */

/* v1 (cudaVersion < 3020), 32-bit device pointers: see cuCtxCreate. */
CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytesize) {
    COUNT();
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuMemGetInfo(unsigned int *free, unsigned int *total) {
    COUNT();
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    COUNT();
    NEED_CTX();
    return add_alloc(dptr, bytesize, A_DEVICE);
}

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes) {
    COUNT();
    NEED_CTX();
    if (!pPitch || WidthInBytes == 0 || Height == 0) return CUDA_ERROR_INVALID_VALUE;
    if (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16)
        return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (WidthInBytes + 511) & ~(size_t)511;
    CUresult r = add_alloc(dptr, pitch * Height, A_PITCH);
    if (r == CUDA_SUCCESS) *pPitch = pitch;
    return r;
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    COUNT();
    NEED_CTX();
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) return CUDA_ERROR_INVALID_VALUE;
    return add_alloc(dptr, bytesize, A_MANAGED);
}

#include "fake_graph.c"

/* From `pool` (NULL: the current context's device's current pool); captured: a graph's node. */
static CUresult alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream h, int per_thread, int kind,
                            CUmemoryPool pool) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (s->capturing) return fk_graph_capture_alloc(s, dptr, bytesize);
    r = add_alloc(dptr, bytesize, kind);
    if (!r) fk_pool_note_alloc(pool ? pool : fk_current_pool(fk_cur_dev()), *dptr, bytesize);
    return r;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    COUNT();
    return alloc_async(dptr, bytesize, hStream, 0, A_ASYNC, NULL);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    COUNT();
    return alloc_async(dptr, bytesize, hStream, 1, A_ASYNC, NULL);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream) {
    COUNT();
    if (!fk_pool_ok(pool)) return CUDA_ERROR_INVALID_VALUE;
    return alloc_async(dptr, bytesize, hStream, 0, A_POOL, pool);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) {
    COUNT();
    if (!fk_pool_ok(pool)) return CUDA_ERROR_INVALID_VALUE;
    return alloc_async(dptr, bytesize, hStream, 1, A_POOL, pool);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    COUNT();
    NEED_CTX();
    wait_device(); /* cuMemFree synchronises */
    return free_alloc(dptr);
}

static CUresult free_async(CUdeviceptr dptr, CUstream h, int per_thread) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    if (s->capturing) return fk_graph_capture_free(s, dptr);
    if (fk_owned_free(dptr)) return CUDA_SUCCESS; /* a graph's allocation */
    return free_alloc(dptr);
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    COUNT();
    return free_async(dptr, hStream, 0);
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    COUNT();
    return free_async(dptr, hStream, 1);
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    COUNT();
    NEED_CTX();
    pthread_mutex_lock(&g_lock);
    struct fk_alloc *a = find_alloc_locked((uintptr_t)dptr, 1);
    CUresult r = CUDA_ERROR_NOT_FOUND;
    if (a) {
        if (pbase) *pbase = (CUdeviceptr)a->base;
        if (psize) *psize = a->size;
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* CUpointer_attribute values answered here. */
enum {
    FK_PA_CONTEXT = 1,
    FK_PA_MEMORY_TYPE = 2,
    FK_PA_DEVICE_POINTER = 3,
    FK_PA_IS_MANAGED = 8,
    FK_PA_DEVICE_ORDINAL = 9,
    FK_PA_RANGE_START_ADDR = 11,
    FK_PA_RANGE_SIZE = 12,
};

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    COUNT();
    NEED_INIT();
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct fk_alloc *a = find_alloc_locked((uintptr_t)ptr, 1);
    struct fk_alloc copy = a ? *a : (struct fk_alloc){0};
    int mapped = !a && mapped_locked((uintptr_t)ptr, 1);
    pthread_mutex_unlock(&g_lock);
    if (!a && !mapped) return CUDA_ERROR_INVALID_VALUE;
    switch (attribute) {
    case FK_PA_CONTEXT: *(CUcontext *)data = &g_primary[0]; break;
    case FK_PA_MEMORY_TYPE: *(unsigned int *)data = 2; break; /* CU_MEMORYTYPE_DEVICE */
    case FK_PA_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
    case FK_PA_IS_MANAGED: *(unsigned int *)data = a && copy.kind == A_MANAGED; break;
    case FK_PA_DEVICE_ORDINAL: *(int *)data = 0; break;
    case FK_PA_RANGE_START_ADDR: *(CUdeviceptr *)data = a ? (CUdeviceptr)copy.base : ptr; break;
    case FK_PA_RANGE_SIZE: *(size_t *)data = a ? copy.size : 0; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* GPUSHARE_FAKE_OTHER_BYTES: memory other processes hold on the device. */
static unsigned long long fk_other_bytes(void) {
    return fk_parse_bytes(getenv("GPUSHARE_FAKE_OTHER_BYTES"), 0);
}

CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    COUNT();
    NEED_CTX();
    if (!free || !total) return CUDA_ERROR_INVALID_VALUE;
    int phys = fk_cur_phys();
    pthread_mutex_lock(&g_lock);
    unsigned long long used = g_dev_resident[phys];
    pthread_mutex_unlock(&g_lock);
    /* GPUSHARE_FAKE_OTHER_BYTES: memory other processes hold on the device (core). */
    used += fk_other_bytes();
    unsigned long long t = fk_device_total();
    *total = (size_t)t;
    *free = (size_t)(used >= t ? 0 : t - used);
    return CUDA_SUCCESS;
}

/* Virtual memory management: cuMemCreate handles are memfds, cuMemMap maps them into a range
 * reserved with cuMemAddressReserve (PROT_NONE until mapped), so data written through a mapping
 * is really there. */
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       int option) {
    COUNT();
    NEED_INIT();
    if (!granularity || !prop) return CUDA_ERROR_INVALID_VALUE;
    *granularity = 2u << 20;
    return CUDA_SUCCESS;
}

/* CUmemAllocationProp.requestedHandleTypes: the int after `type` (cuda.h's layout). */
static int prop_handle_types(const void *prop) {
    int t;
    memcpy(&t, (const char *)prop + sizeof(int), sizeof t);
    return t;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags) {
    COUNT();
    NEED_CTX();
    if (!handle || !prop || size == 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (size % (2u << 20)) return CUDA_ERROR_INVALID_VALUE; /* must be granularity-aligned */
    /* Only POSIX file descriptors are shareable here (no fabric, no Win32); with
     * GPUSHARE_FAKE_NO_SHAREABLE set, none (as a driver or container that refuses them). */
    int types = prop_handle_types(prop);
    if ((types & ~1) || (types && getenv("GPUSHARE_FAKE_NO_SHAREABLE")))
        return CUDA_ERROR_NOT_SUPPORTED;
    /* The memory lives on the device prop->location names (CU_MEM_LOCATION_TYPE_DEVICE = 1),
     * whichever context is current. */
    int loc[2];
    memcpy(loc, (const char *)prop + 2 * sizeof(int), sizeof loc);
    int phys = loc[0] == 1 ? fk_phys(loc[1]) : -1;
    if (phys < 0) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    /* What other processes hold (GPUSHARE_FAKE_OTHER_BYTES) is not free either, as on a card. */
    unsigned long long other = fk_other_bytes();
    pthread_mutex_lock(&g_lock);
    if (g_dev_resident[phys] + other + size > fk_phys_total(phys)) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    int fd = memfd_create("fakecuda-handle", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    GROW(g_handles, g_nhandles, g_caphandles);
    unsigned long long id = g_next_handle++;
    g_handles[g_nhandles++] =
        (struct fk_handle){id, fd, size, 0, 0, 0, prop_handle_types(prop) & 1, 0, phys};
    g_live_device_bytes += size;
    g_dev_resident[phys] += size;
    note_peak();
    pthread_mutex_unlock(&g_lock);
    *handle = id;
    return CUDA_SUCCESS;
}

static struct fk_handle *find_handle_locked(unsigned long long id) {
    for (size_t i = 0; i < g_nhandles; i++)
        if (g_handles[i].id == id) return &g_handles[i];
    return NULL;
}

/* Physical memory is given back when the handle is released and no longer mapped. */
static void maybe_drop_handle_locked(struct fk_handle *h) {
    if (!h->released || h->maps > 0) return;
    close(h->fd);
    if (!h->imported) {
        g_live_device_bytes -= h->size;
        g_dev_resident[h->phys] -= h->size;
    }
    *h = g_handles[--g_nhandles];
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    COUNT();
    NEED_INIT();
    pthread_mutex_lock(&g_lock);
    struct fk_handle *h = find_handle_locked(handle);
    if (!h || h->released) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (h->extra_refs > 0) {
        h->extra_refs--;
        pthread_mutex_unlock(&g_lock);
        return CUDA_SUCCESS;
    }
    h->released = 1;
    maybe_drop_handle_locked(h);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    COUNT();
    NEED_INIT();
    if (!ptr || size == 0 || size % (2u << 20)) return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    GROW(g_allocs, g_nalloc, g_capalloc);
    g_allocs[g_nalloc++] = (struct fk_alloc){(uintptr_t)p, size, A_RESERVED, 0, 0};
    pthread_mutex_unlock(&g_lock);
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    COUNT();
    NEED_INIT();
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_nalloc; i++) {
        if (g_allocs[i].kind == A_RESERVED && g_allocs[i].base == (uintptr_t)ptr &&
            g_allocs[i].size == size) {
            g_allocs[i] = g_allocs[--g_nalloc];
            pthread_mutex_unlock(&g_lock);
            munmap((void *)(uintptr_t)ptr, size);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_INVALID_VALUE;
}

static int reserved_locked(uintptr_t p, size_t n) {
    for (size_t i = 0; i < g_nalloc; i++) {
        struct fk_alloc *a = &g_allocs[i];
        if (a->kind == A_RESERVED && p >= a->base && p < a->base + a->size &&
            n <= a->base + a->size - p)
            return 1;
    }
    return 0;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    COUNT();
    NEED_INIT();
    if (!ptr || size == 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    /* GPUSHARE_FAKE_MAP_DELAY_US: a mapping takes that long (a large one on a real card takes
     * milliseconds), so a call let through before its memory is mapped is caught every time. */
    static long map_delay = -1;
    delay_us(env_delay_us("GPUSHARE_FAKE_MAP_DELAY_US", &map_delay));
    pthread_mutex_lock(&g_lock);
    struct fk_handle *h = find_handle_locked(handle);
    if (!h || h->released || offset + size > h->size || !reserved_locked((uintptr_t)ptr, size) ||
        mapped_locked((uintptr_t)ptr, 1)) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                   h->fd, (off_t)offset);
    if (p == MAP_FAILED) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->maps++;
    GROW(g_maps, g_nmaps, g_capmaps);
    g_maps[g_nmaps++] = (struct fk_mapping){(uintptr_t)ptr, size, handle};
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    COUNT();
    NEED_INIT();
    /* GPUSHARE_FAKE_UNMAP_DELAY_US: an unmap takes that long, so an eviction lasts as a real
     * one of many GiB does (seconds), and what waits on it can be seen. */
    static long unmap_delay = -1;
    delay_us(env_delay_us("GPUSHARE_FAKE_UNMAP_DELAY_US", &unmap_delay));
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_nmaps; i++) {
        if (g_maps[i].base != (uintptr_t)ptr || g_maps[i].size != size) continue;
        unsigned long long hid = g_maps[i].handle;
        g_maps[i] = g_maps[--g_nmaps];
        fk_async_unmapped_locked((uintptr_t)ptr, size);
        mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED |
             MAP_NORESERVE, -1, 0);
        struct fk_handle *h = find_handle_locked(hid);
        if (h) {
            h->maps--;
            maybe_drop_handle_locked(h);
        }
        pthread_mutex_unlock(&g_lock);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    COUNT();
    NEED_INIT();
    if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
    return dev_range_ok(ptr, size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------------------------------ */
/* Memory: prefetch and advice                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* To the host (to_host), else to physical device `phys`: managed memory migrates there. */
static CUresult prefetch(CUdeviceptr p, size_t count, int to_host, int phys, CUstream h,
                         int per_thread, const char *via) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (!cur_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    if (count == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct fk_alloc *a = find_alloc_locked((uintptr_t)p, count);
    if (!a || a->kind != A_MANAGED) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE; /* only managed memory can be prefetched */
    }
    if (to_host) {
        g_prefetch_to_host_bytes += count;
        g_prefetch_to_host_calls++;
        if (!a->on_host) {
            g_managed_on_host_bytes += a->size;
            g_dev_resident[a->phys] -= a->size;
        }
        a->on_host = 1;
    } else {
        g_prefetch_to_device_bytes += count;
        g_prefetch_to_device_calls++;
        if (!a->on_host) g_dev_resident[a->phys] -= a->size;
        if (a->on_host) g_managed_on_host_bytes -= a->size;
        a->phys = phys;
        g_dev_resident[a->phys] += a->size;
        a->on_host = 0;
        note_peak();
    }
    pthread_mutex_unlock(&g_lock);
    const char *gbps = getenv("GPUSHARE_FAKE_PREFETCH_GBPS");
    double rate = gbps ? atof(gbps) : 0.0;
    if (rate > 0) stream_add_busy(s, (uint64_t)((double)count / rate));
    FILE *f = trace_file();
    if (f) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        fprintf(f, "{\"event\":\"prefetch\",\"via\":\"%s\",\"to\":\"%s\",\"bytes\":%zu,\"t_mono\":%.6f,\"pid\":%d}\n",
                via, to_host ? "host" : "device", count,
                (double)ts.tv_sec + (double)ts.tv_nsec / 1e9, (int)getpid());
    }
    return CUDA_SUCCESS;
}

static CUresult prefetch_v1(CUdeviceptr p, size_t count, CUdevice dst, CUstream h, int pt,
                            const char *via) {
    if (dst != CU_DEVICE_CPU && fk_phys(dst) < 0)
        return g_inited ? FK_ERROR_INVALID_DEVICE : CUDA_ERROR_NOT_INITIALIZED;
    return prefetch(p, count, dst == CU_DEVICE_CPU, dst == CU_DEVICE_CPU ? 0 : fk_phys(dst), h,
                    pt, via);
}

static CUresult prefetch_v2(CUdeviceptr p, size_t count, CUmemLocation loc, unsigned int flags,
                            CUstream h, int pt, const char *via) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    int to_host, type = (int)loc.type;
    if (type == CU_MEM_LOCATION_TYPE_HOST || type == FK_MEM_LOCATION_TYPE_HOST_NUMA ||
        type == FK_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT)
        to_host = 1;
    else if (type == CU_MEM_LOCATION_TYPE_DEVICE && fk_phys(loc.id) >= 0)
        to_host = 0;
    else
        return CUDA_ERROR_INVALID_VALUE;
    return prefetch(p, count, to_host, to_host ? 0 : fk_phys(loc.id), h, pt, via);
}

CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream) {
    COUNT();
    return prefetch_v1(devPtr, count, dstDevice, hStream, 0, __func__);
}

CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice,
                                 CUstream hStream) {
    COUNT();
    return prefetch_v1(devPtr, count, dstDevice, hStream, 1, __func__);
}

CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                               unsigned int flags, CUstream hStream) {
    COUNT();
    return prefetch_v2(devPtr, count, location, flags, hStream, 0, __func__);
}

CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                    unsigned int flags, CUstream hStream) {
    COUNT();
    return prefetch_v2(devPtr, count, location, flags, hStream, 1, __func__);
}

CUresult cuMemAdvise(CUdeviceptr devPtr, size_t count, int advice, CUdevice device) {
    COUNT();
    NEED_INIT();
    return dev_range_ok(devPtr, count) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemAdvise_v2(CUdeviceptr devPtr, size_t count, int advice, CUmemLocation location) {
    COUNT();
    NEED_INIT();
    return dev_range_ok(devPtr, count) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------------------------------ */
/* Modules and launches                                                                         */
/* ------------------------------------------------------------------------------------------ */

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    COUNT();
    NEED_CTX();
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    *module = &g_module;
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule hmod) {
    COUNT();
    NEED_INIT();
    return hmod == &g_module ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    COUNT();
    NEED_CTX();
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    if (hmod != &g_module) return CUDA_ERROR_INVALID_HANDLE;
    for (int i = 0; i < K_COUNT; i++) {
        if (strcmp(g_funcs[i].name, name) == 0) {
            *hfunc = &g_funcs[i];
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}

/* A kernel that touches a managed allocation living on the host faults it in. */
static void fault_in(CUdeviceptr p) {
    pthread_mutex_lock(&g_lock);
    struct fk_alloc *a = find_alloc_locked((uintptr_t)p, 1);
    if (a && a->kind == A_MANAGED && a->on_host) {
        a->on_host = 0;
        g_managed_on_host_bytes -= a->size;
        g_dev_resident[a->phys] += a->size;
        g_fault_to_device_bytes += a->size;
        note_peak();
    }
    pthread_mutex_unlock(&g_lock);
}

static CUresult launch_now(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                           unsigned int bx, unsigned int by, unsigned int bz, CUstream h,
                           int per_thread, void **params, void **extra);

/* GPUSHARE_FAKE_LAUNCH_DELAY_US: a launch spends that long inside the driver before its work is
 * queued (a thread descheduled between the gate and the driver's enqueue). g_calls_in_driver
 * counts launches in that window; each cuCtxSynchronize traces it. */

static CUresult launch(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                       unsigned int bx, unsigned int by, unsigned int bz, CUstream h, int per_thread,
                       void **params, void **extra) {
    static long launch_delay = -1;
    long us = env_delay_us("GPUSHARE_FAKE_LAUNCH_DELAY_US", &launch_delay);
    __atomic_fetch_add(&g_calls_in_driver, 1, __ATOMIC_SEQ_CST);
    delay_us(us);
    CUresult r = launch_now(f, gx, gy, gz, bx, by, bz, h, per_thread, params, extra);
    __atomic_fetch_sub(&g_calls_in_driver, 1, __ATOMIC_SEQ_CST);
    return r;
}

static CUresult launch_now(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                           unsigned int bx, unsigned int by, unsigned int bz, CUstream h,
                           int per_thread, void **params, void **extra) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (!cur_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    if (!f || f < &g_funcs[0] || f >= &g_funcs[K_COUNT]) return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (extra && !params) return CUDA_ERROR_NOT_SUPPORTED;
    if (fk_stream_captured(s)) return CUDA_SUCCESS;
    fk_async_complete(s == &g_legacy_stream ? NULL : s, UINT64_MAX); /* stream order */
    switch (f->kind) {
    case K_SLEEP: {
        if (!params || !params[0]) return CUDA_ERROR_INVALID_VALUE;
        unsigned long long us = *(const unsigned long long *)params[0];
        if (us > 60ULL * 1000 * 1000) return CUDA_ERROR_INVALID_VALUE; /* a garbage argument */
        stream_add_busy(s, us * 1000ULL);
        break;
    }
    case K_SAXPY: {
        if (!params || !params[0] || !params[1] || !params[2] || !params[3])
            return CUDA_ERROR_INVALID_VALUE;
        float a = *(const float *)params[0];
        CUdeviceptr x = *(const CUdeviceptr *)params[1];
        CUdeviceptr y = *(const CUdeviceptr *)params[2];
        int n = *(const int *)params[3];
        if (n < 0) return CUDA_ERROR_INVALID_VALUE;
        if (n > 0 && (!dev_range_ok(x, (size_t)n * sizeof(float)) ||
                      !dev_range_ok(y, (size_t)n * sizeof(float))))
            return FK_ERROR_ILLEGAL_ADDRESS;
        fault_in(x);
        fault_in(y);
        const float *xp = (const float *)(uintptr_t)x;
        float *yp = (float *)(uintptr_t)y;
        for (int i = 0; i < n; i++) yp[i] = a * xp[i] + yp[i];
        stream_add_busy(s, 1000); /* a microsecond of "work" */
        break;
    }
    default:
        break;
    }
    pthread_mutex_lock(&g_lock);
    g_kernel_counts[f->kind]++;
    g_launches++;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra) {
    COUNT();
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 0,
                  kernelParams, extra);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                             unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                             void **kernelParams, void **extra) {
    COUNT();
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 1,
                  kernelParams, extra);
}

static CUresult launch_ex(const CUlaunchConfig *c, CUfunction f, void **params, void **extra,
                          int per_thread) {
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    if (c->numAttrs > 0 && !c->attrs) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,
                  c->blockDimZ, c->hStream, per_thread, params, extra);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra) {
    COUNT();
    return launch_ex(config, f, kernelParams, extra, 0);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra) {
    COUNT();
    return launch_ex(config, f, kernelParams, extra, 1);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                   unsigned int gridDimZ, unsigned int blockDimX,
                                   unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream,
                                   void **kernelParams) {
    COUNT();
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 0,
                  kernelParams, NULL);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX,
                                        unsigned int blockDimY, unsigned int blockDimZ,
                                        unsigned int sharedMemBytes, CUstream hStream,
                                        void **kernelParams) {
    COUNT();
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 1,
                  kernelParams, NULL);
}

/* Any non-NULL executable graph is accepted; a launch is a microsecond of work. */
static CUresult graph_launch(CUgraphExec g, CUstream h, int per_thread) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (!g) return CUDA_ERROR_INVALID_VALUE;
    if (fk_stream_captured(s)) return CUDA_SUCCESS;
    r = fk_exec_launch(g);
    if (r) return r;
    stream_add_busy(s, 1000);
    pthread_mutex_lock(&g_lock);
    g_graph_launches++;
    g_launches++;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    COUNT();
    return graph_launch(hGraphExec, hStream, 0);
}

CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    COUNT();
    return graph_launch(hGraphExec, hStream, 1);
}

#include "fake_vmm.c"
#include "fake_checkpoint.c"

/* ------------------------------------------------------------------------------------------ */
/* Copies and sets                                                                              */
/* ------------------------------------------------------------------------------------------ */

/* Synchronous copies wait for earlier work, as the legacy stream does. dst_dev/src_dev say which
 * sides must be device memory handed out by this driver. */
/* GPUSHARE_FAKE_LOSE_H2D_HEAD / _D2H_HEAD (above): each once per process. */
static void lose_head_once(void *dst, size_t n, int to_device) {
    static atomic_int lost[2];
    const char *v = getenv(to_device ? "GPUSHARE_FAKE_LOSE_H2D_HEAD" : "GPUSHARE_FAKE_LOSE_D2H_HEAD");
    size_t head = v ? (size_t)strtoull(v, NULL, 10) : 0;
    const char *armed = getenv("GPUSHARE_FAKE_FAULTS_ARMED");
    if (!head || n < 2 * head || (armed && access(armed, F_OK) != 0)) return;
    if (!atomic_exchange(&lost[to_device], 1)) memset(dst, 0, head);
}

static CUresult copy(void *dst, const void *src, size_t n, int dst_dev, int src_dev, CUstream h,
                     int per_thread, int is_async) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!cur_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUstream_st *s = NULL;
    if (is_async) {
        CUresult r = get_stream(h, per_thread, &s);
        if (r) return r;
    }
    if (n == 0) return CUDA_SUCCESS;
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    if (dst_dev && !dev_range_ok((CUdeviceptr)(uintptr_t)dst, n)) return CUDA_ERROR_INVALID_VALUE;
    if (src_dev && !dev_range_ok((CUdeviceptr)(uintptr_t)src, n)) return CUDA_ERROR_INVALID_VALUE;
    if (!is_async) wait_device();
    if (!is_async || !fk_async_queue(dst, src, n, s)) memmove(dst, src, n);
    if (is_async && dst_dev != src_dev) lose_head_once(dst, n, dst_dev);
    fk_note_copy(dst, src, n, dst_dev, src_dev, s);
    return CUDA_SUCCESS;
}

#define D2P(d) ((void *)(uintptr_t)(d))

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    COUNT();
    return copy(D2P(dst), D2P(src), ByteCount, 0, 0, NULL, 0, 0);
}
CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    COUNT();
    return copy(D2P(dst), D2P(src), ByteCount, 0, 0, NULL, 1, 0);
}
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
    COUNT();
    return copy(D2P(dst), D2P(src), ByteCount, 0, 0, hStream, 0, 1);
}
CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
    COUNT();
    return copy(D2P(dst), D2P(src), ByteCount, 0, 0, hStream, 1, 1);
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    COUNT();
    return copy(D2P(dstDevice), srcHost, ByteCount, 1, 0, NULL, 0, 0);
}
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    COUNT();
    return copy(D2P(dstDevice), srcHost, ByteCount, 1, 0, NULL, 1, 0);
}
CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    COUNT();
    return copy(dstHost, D2P(srcDevice), ByteCount, 0, 1, NULL, 0, 0);
}
CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    COUNT();
    return copy(dstHost, D2P(srcDevice), ByteCount, 0, 1, NULL, 1, 0);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
    COUNT();
    return copy(D2P(dstDevice), D2P(srcDevice), ByteCount, 1, 1, NULL, 0, 0);
}
CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
    COUNT();
    return copy(D2P(dstDevice), D2P(srcDevice), ByteCount, 1, 1, NULL, 1, 0);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                              CUstream hStream) {
    COUNT();
    return copy(D2P(dstDevice), srcHost, ByteCount, 1, 0, hStream, 0, 1);
}
CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                   CUstream hStream) {
    COUNT();
    return copy(D2P(dstDevice), srcHost, ByteCount, 1, 0, hStream, 1, 1);
}
CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream) {
    COUNT();
    return copy(dstHost, D2P(srcDevice), ByteCount, 0, 1, hStream, 0, 1);
}
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                   CUstream hStream) {
    COUNT();
    return copy(dstHost, D2P(srcDevice), ByteCount, 0, 1, hStream, 1, 1);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream) {
    COUNT();
    return copy(D2P(dstDevice), D2P(srcDevice), ByteCount, 1, 1, hStream, 0, 1);
}
CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                   CUstream hStream) {
    COUNT();
    return copy(D2P(dstDevice), D2P(srcDevice), ByteCount, 1, 1, hStream, 1, 1);
}

static CUresult peer_ctx_ok(CUcontext a, CUcontext b) {
    return ctx_ok(a) && ctx_ok(b) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                      CUcontext srcContext, size_t ByteCount) {
    COUNT();
    CUresult r = peer_ctx_ok(dstContext, srcContext);
    return r ? r : copy(D2P(dstDevice), D2P(srcDevice), ByteCount, 1, 1, NULL, 0, 0);
}
CUresult cuMemcpyPeer_ptds(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                           CUcontext srcContext, size_t ByteCount) {
    COUNT();
    CUresult r = peer_ctx_ok(dstContext, srcContext);
    return r ? r : copy(D2P(dstDevice), D2P(srcDevice), ByteCount, 1, 1, NULL, 1, 0);
}
CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                           CUcontext srcContext, size_t ByteCount, CUstream hStream) {
    COUNT();
    CUresult r = peer_ctx_ok(dstContext, srcContext);
    return r ? r : copy(D2P(dstDevice), D2P(srcDevice), ByteCount, 1, 1, hStream, 0, 1);
}
CUresult cuMemcpyPeerAsync_ptsz(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                CUcontext srcContext, size_t ByteCount, CUstream hStream) {
    COUNT();
    CUresult r = peer_ctx_ok(dstContext, srcContext);
    return r ? r : copy(D2P(dstDevice), D2P(srcDevice), ByteCount, 1, 1, hStream, 1, 1);
}

static CUresult set(CUdeviceptr dst, unsigned int value, unsigned int width, size_t n, CUstream h,
                    int per_thread, int is_async) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!cur_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
    if (is_async) {
        struct CUstream_st *s;
        CUresult r = get_stream(h, per_thread, &s);
        if (r) return r;
    }
    if (n == 0) return CUDA_SUCCESS;
    if (!dev_range_ok(dst, n * width) || dst % width) return CUDA_ERROR_INVALID_VALUE;
    if (!is_async) wait_device();
    unsigned char *p = D2P(dst);
    if (width == 1) {
        memset(p, (int)(value & 0xff), n);
    } else if (width == 2) {
        uint16_t v = (uint16_t)value;
        for (size_t i = 0; i < n; i++) memcpy(p + 2 * i, &v, 2);
    } else {
        uint32_t v = value;
        for (size_t i = 0; i < n; i++) memcpy(p + 4 * i, &v, 4);
    }
    return CUDA_SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char uc, size_t N) {
    COUNT();
    return set(d, uc, 1, N, NULL, 0, 0);
}
CUresult cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char uc, size_t N) {
    COUNT();
    return set(d, uc, 1, N, NULL, 1, 0);
}
CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short us, size_t N) {
    COUNT();
    return set(d, us, 2, N, NULL, 0, 0);
}
CUresult cuMemsetD16_v2_ptds(CUdeviceptr d, unsigned short us, size_t N) {
    COUNT();
    return set(d, us, 2, N, NULL, 1, 0);
}
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int ui, size_t N) {
    COUNT();
    return set(d, ui, 4, N, NULL, 0, 0);
}
CUresult cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int ui, size_t N) {
    COUNT();
    return set(d, ui, 4, N, NULL, 1, 0);
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char uc, size_t N, CUstream hStream) {
    COUNT();
    return set(d, uc, 1, N, hStream, 0, 1);
}
CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char uc, size_t N, CUstream hStream) {
    COUNT();
    return set(d, uc, 1, N, hStream, 1, 1);
}
CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short us, size_t N, CUstream hStream) {
    COUNT();
    return set(d, us, 2, N, hStream, 0, 1);
}
CUresult cuMemsetD16Async_ptsz(CUdeviceptr d, unsigned short us, size_t N, CUstream hStream) {
    COUNT();
    return set(d, us, 2, N, hStream, 1, 1);
}
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int ui, size_t N, CUstream hStream) {
    COUNT();
    return set(d, ui, 4, N, hStream, 0, 1);
}
CUresult cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int ui, size_t N, CUstream hStream) {
    COUNT();
    return set(d, ui, 4, N, hStream, 1, 1);
}

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                       */
/* ------------------------------------------------------------------------------------------ */

static const char *err_name(CUresult e) {
    switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_DEINITIALIZED: return "CUDA_ERROR_DEINITIALIZED";
    case FK_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case FK_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case CUDA_ERROR_NOT_PERMITTED: return "CUDA_ERROR_NOT_PERMITTED";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    default: return NULL;
    }
}

CUresult cuGetErrorName(CUresult error, const char **pStr) {
    COUNT();
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    *pStr = err_name(error);
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **pStr) {
    COUNT();
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    *pStr = err_name(error);
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------------------------------ */
/* core: captures, contexts and launch paths                                                    */
/* ------------------------------------------------------------------------------------------ */

/* Every stream made, so that a context's teardown can end its streams (a stream of a destroyed
 * or reset context is a dangling handle, as on the real driver). */
#define FK_MAX_STREAMS 4096
static struct CUstream_st *g_streams[FK_MAX_STREAMS];
static int g_nstreams;
static int g_unsafe_captures; /* captures in progress in global or relaxed mode */

static void fk_register_stream(struct CUstream_st *s) {
    pthread_mutex_lock(&g_lock);
    if (g_nstreams < FK_MAX_STREAMS) g_streams[g_nstreams++] = s;
    pthread_mutex_unlock(&g_lock);
}

static void fk_end_streams_of(struct CUctx_st *ctx) {
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_nstreams; i++)
        if (g_streams[i]->ctx == ctx) g_streams[i]->magic = 0;
    pthread_mutex_unlock(&g_lock);
}

/* An H100 answers cuCtxSynchronize, cuStreamQuery and cuStreamSynchronize made while a stream
 * captures in global or relaxed mode with 900, and the capture's end then fails with 901. */
static int fk_capture_unsafe_call(void) {
    pthread_mutex_lock(&g_lock);
    int unsafe = g_unsafe_captures > 0;
    if (unsafe) {
        g_capture_unsafe_calls++;
        for (int i = 0; i < g_nstreams; i++)
            if (g_streams[i]->capturing) g_streams[i]->invalidated = 1;
        if (g_legacy_stream.capturing) g_legacy_stream.invalidated = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return unsafe;
}

static int fk_stream_captured(struct CUstream_st *s) {
    if (!s->capturing) return 0;
    pthread_mutex_lock(&g_lock);
    g_captured_launches++;
    pthread_mutex_unlock(&g_lock);
    return 1;
}

static CUresult begin_capture(CUstream h, int per_thread, int mode) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (s == &g_legacy_stream) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (mode < 0 || mode > 2) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    r = s->capturing ? FK_ERROR_ILLEGAL_STATE : CUDA_SUCCESS;
    if (!r) {
        s->capturing = 1 + mode;
        s->invalidated = 0;
        if (mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) g_unsafe_captures++;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

CUresult cuStreamBeginCapture(CUstream hStream) {
    COUNT();
    return begin_capture(hStream, 0, CU_STREAM_CAPTURE_MODE_GLOBAL);
}
CUresult cuStreamBeginCapture_ptsz(CUstream hStream) {
    COUNT();
    return begin_capture(hStream, 1, CU_STREAM_CAPTURE_MODE_GLOBAL);
}
CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
    COUNT();
    return begin_capture(hStream, 0, mode);
}
CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode) {
    COUNT();
    return begin_capture(hStream, 1, mode);
}

static CUresult end_capture(CUstream h, int per_thread, CUgraph *phGraph) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    if (!s->capturing) {
        pthread_mutex_unlock(&g_lock);
        return FK_ERROR_ILLEGAL_STATE;
    }
    if (s->capturing - 1 != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) g_unsafe_captures--;
    s->capturing = 0;
    int bad = s->invalidated;
    s->invalidated = 0;
    if (bad)
        g_captures_invalidated++;
    else
        g_captures_ended++;
    pthread_mutex_unlock(&g_lock);
    *phGraph = fk_graph_end_capture(s, bad);
    return bad ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
}

CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    COUNT();
    return end_capture(hStream, 0, phGraph);
}
CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph) {
    COUNT();
    return end_capture(hStream, 1, phGraph);
}

static CUresult is_capturing(CUstream h, int per_thread, CUstreamCaptureStatus *st) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (!st) return CUDA_ERROR_INVALID_VALUE;
    *st = s->capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    COUNT();
    return is_capturing(hStream, 0, captureStatus);
}
CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    COUNT();
    return is_capturing(hStream, 1, captureStatus);
}

/* Primary context teardown: Release drops a reference (the last one destroys the context),
 * Reset destroys it at once; either way its streams die with it. */
CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    COUNT();
    CUresult r = cuDevicePrimaryCtxRelease_v2(dev);
    if (!r && !__atomic_load_n(&g_primary_refs[dev], __ATOMIC_RELAXED)) fk_end_streams_of(&g_primary[dev]);
    return r;
}

static CUresult primary_reset(CUdevice dev) {
    NEED_INIT();
    if (fk_phys(dev) < 0) return FK_ERROR_INVALID_DEVICE;
    __atomic_store_n(&g_primary_refs[dev], 0, __ATOMIC_RELAXED);
    fk_end_streams_of(&g_primary[dev]);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxReset(CUdevice dev) {
    COUNT();
    return primary_reset(dev);
}
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    COUNT();
    return primary_reset(dev);
}

/* Launch paths and stream memory operations beyond cuLaunchKernel: counted, their stream
 * checked (so a lost per-thread variant shows), and a microsecond of work queued. */
static CUresult stream_op(CUstream h, int per_thread) {
    struct CUstream_st *s;
    CUresult r = get_stream(h, per_thread, &s);
    if (r) return r;
    if (!cur_ctx() && !s->ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (!fk_stream_captured(s)) stream_add_busy(s, 1000);
    return CUDA_SUCCESS;
}

CUresult cuLaunch(CUfunction f) {
    COUNT();
    return f ? stream_op(NULL, 0) : CUDA_ERROR_INVALID_HANDLE;
}
CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height) {
    COUNT();
    return f ? stream_op(NULL, 0) : CUDA_ERROR_INVALID_HANDLE;
}
CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream) {
    COUNT();
    return f ? stream_op(hStream, 0) : CUDA_ERROR_INVALID_HANDLE;
}
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                              unsigned int numDevices, unsigned int flags) {
    COUNT();
    return launchParamsList && numDevices ? stream_op(NULL, 0) : CUDA_ERROR_INVALID_VALUE;
}

#define FK_STREAM_OP(name, per_thread, params, stream)                                           \
    CUresult name params {                                                                       \
        COUNT();                                                                                 \
        return stream_op(stream, per_thread);                                                    \
    }
#define FK_STREAM_OP4(base, params)                                                              \
    FK_STREAM_OP(base, 0, params, stream)                                                        \
    FK_STREAM_OP(base##_ptsz, 1, params, stream)                                                 \
    FK_STREAM_OP(base##_v2, 0, params, stream)                                                   \
    FK_STREAM_OP(base##_v2_ptsz, 1, params, stream)
FK_STREAM_OP4(cuStreamBatchMemOp, (CUstream stream, unsigned int count,
                                   CUstreamBatchMemOpParams *paramArray, unsigned int flags))
FK_STREAM_OP4(cuStreamWriteValue32,
              (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags))
FK_STREAM_OP4(cuStreamWriteValue64,
              (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags))
FK_STREAM_OP4(cuStreamWaitValue32,
              (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags))
FK_STREAM_OP4(cuStreamWaitValue64,
              (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags))

#define FK_OP4_EXPORTS(X, base) X(base) X(base##_ptsz) X(base##_v2) X(base##_v2_ptsz)
#define FK_EXPORTS_CORE(X)                                                                       \
    X(cuStreamBeginCapture) X(cuStreamBeginCapture_ptsz) X(cuStreamBeginCapture_v2)              \
    X(cuStreamBeginCapture_v2_ptsz) X(cuStreamEndCapture) X(cuStreamEndCapture_ptsz)             \
    X(cuStreamIsCapturing) X(cuStreamIsCapturing_ptsz) X(cuDevicePrimaryCtxRelease)              \
    X(cuDevicePrimaryCtxReset) X(cuDevicePrimaryCtxReset_v2) X(cuLaunch) X(cuLaunchGrid)         \
    X(cuLaunchGridAsync) X(cuLaunchCooperativeKernelMultiDevice)                                 \
    FK_OP4_EXPORTS(X, cuStreamBatchMemOp) FK_OP4_EXPORTS(X, cuStreamWriteValue32)               \
    FK_OP4_EXPORTS(X, cuStreamWriteValue64) FK_OP4_EXPORTS(X, cuStreamWaitValue32)              \
    FK_OP4_EXPORTS(X, cuStreamWaitValue64)

/* cuGetProcAddress entries (cudaTypedefs.h versions). */
#define FK_OP4_PROCS(base, v1, v2)                                                               \
    {#base, v1, 0, #base}, {#base, v1, 1, #base "_ptsz"}, {#base, v2, 0, #base "_v2"},           \
        {#base, v2, 1, #base "_v2_ptsz"},
#define FK_PROCS_CORE                                                                            \
    {"cuStreamBeginCapture", 10000, 0, "cuStreamBeginCapture"},                                  \
    {"cuStreamBeginCapture", 10000, 1, "cuStreamBeginCapture_ptsz"},                             \
    {"cuStreamBeginCapture", 10010, 0, "cuStreamBeginCapture_v2"},                               \
    {"cuStreamBeginCapture", 10010, 1, "cuStreamBeginCapture_v2_ptsz"},                          \
    {"cuStreamEndCapture", 10000, 0, "cuStreamEndCapture"},                                      \
    {"cuStreamEndCapture", 10000, 1, "cuStreamEndCapture_ptsz"},                                 \
    {"cuStreamIsCapturing", 10000, 0, "cuStreamIsCapturing"},                                    \
    {"cuStreamIsCapturing", 10000, 1, "cuStreamIsCapturing_ptsz"},                               \
    {"cuDevicePrimaryCtxRelease", 7000, 0, "cuDevicePrimaryCtxRelease"},                         \
    {"cuDevicePrimaryCtxRelease", 11000, 0, "cuDevicePrimaryCtxRelease_v2"},                     \
    {"cuDevicePrimaryCtxReset", 7000, 0, "cuDevicePrimaryCtxReset"},                             \
    {"cuDevicePrimaryCtxReset", 11000, 0, "cuDevicePrimaryCtxReset_v2"},                         \
    {"cuLaunch", 2000, 0, "cuLaunch"}, {"cuLaunchGrid", 2000, 0, "cuLaunchGrid"},                \
    {"cuLaunchGridAsync", 2000, 0, "cuLaunchGridAsync"},                                         \
    {"cuLaunchCooperativeKernelMultiDevice", 9000, 0, "cuLaunchCooperativeKernelMultiDevice"},   \
    FK_OP4_PROCS(cuStreamBatchMemOp, 8000, 11070) FK_OP4_PROCS(cuStreamWriteValue32, 8000, 11070) \
    FK_OP4_PROCS(cuStreamWriteValue64, 9000, 11070) FK_OP4_PROCS(cuStreamWaitValue32, 8000, 11070) \
    FK_OP4_PROCS(cuStreamWaitValue64, 9000, 11070)

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

/* ------------------------------------------------------------------------------------------ */
/* Test-only exports                                                                            */
/* ------------------------------------------------------------------------------------------ */

unsigned long fakecuda_call_count(const char *name) {
    unsigned long n = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_nfn; i++)
        if (strcmp(g_fn_names[i], name) == 0) n = __atomic_load_n(&g_fn_counts[i], __ATOMIC_RELAXED);
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* The resident bytes the device would report (used by the fake NVML through dlsym). */
unsigned long long fakecuda_device_used_bytes(void) {
    pthread_mutex_lock(&g_lock);
    unsigned long long used = g_live_device_bytes + g_live_managed_bytes - g_managed_on_host_bytes;
    pthread_mutex_unlock(&g_lock);
    return used;
}

/* What physical device `phys` holds of this process's (0 for a device that does not exist). */
unsigned long long fakecuda_resident_bytes(int phys) {
    if (phys < 0 || phys >= fk_ndev()) return 0;
    pthread_mutex_lock(&g_lock);
    unsigned long long r = g_dev_resident[phys];
    pthread_mutex_unlock(&g_lock);
    return r;
}

int fakecuda_stats_json(char *buf, size_t n) {
    char tmp[16384];
    size_t off = 0;
#define APPEND(...)                                                                              \
    do {                                                                                         \
        int w_ = snprintf(tmp + off, off < sizeof(tmp) ? sizeof(tmp) - off : 0, __VA_ARGS__);    \
        if (w_ > 0) off += (size_t)w_;                                                           \
    } while (0)
    pthread_mutex_lock(&g_lock);
    APPEND("{\"calls\":{");
    int first = 1;
    for (int i = 0; i < g_nfn; i++) {
        unsigned long c = __atomic_load_n(&g_fn_counts[i], __ATOMIC_RELAXED);
        if (!c) continue;
        APPEND("%s\"%s\":%lu", first ? "" : ",", g_fn_names[i], c);
        first = 0;
    }
    unsigned long by_kind[6] = {0};
    for (size_t i = 0; i < g_nalloc; i++) by_kind[g_allocs[i].kind]++;
    APPEND("},\"launches\":%lu,\"graph_launches\":%lu,\"kernels\":{\"sleep\":%lu,\"saxpy\":%lu,"
           "\"noop\":%lu},",
           g_launches, g_graph_launches, g_kernel_counts[K_SLEEP], g_kernel_counts[K_SAXPY],
           g_kernel_counts[K_NOOP]);
    APPEND("\"prefetch_to_host_bytes\":%llu,\"prefetch_to_device_bytes\":%llu,"
           "\"prefetch_to_host_calls\":%lu,\"prefetch_to_device_calls\":%lu,"
           "\"fault_to_device_bytes\":%llu,",
           g_prefetch_to_host_bytes, g_prefetch_to_device_bytes, g_prefetch_to_host_calls,
           g_prefetch_to_device_calls, g_fault_to_device_bytes);
    FK_VMM_STATS(APPEND);
    FK_ASYNC_STATS(APPEND);
    FK_GRAPH_STATS(APPEND);
    APPEND("\"live_device_bytes\":%llu,\"live_managed_bytes\":%llu,\"managed_on_host_bytes\":%llu,"
           "\"peak_device_bytes\":%llu,\"device_total\":%llu,\"live_handles\":%zu,\"live_maps\":%zu,"
           "\"live_allocations\":{",
           g_live_device_bytes, g_live_managed_bytes, g_managed_on_host_bytes, g_peak_device_bytes,
           fk_device_total(), g_nhandles, g_nmaps);
    for (int k = 0; k < 6; k++) APPEND("%s\"%s\":%lu", k ? "," : "", kind_names[k], by_kind[k]);
    int refs = 0;
    for (int d = 0; d < FK_MAX_DEV; d++) refs += g_primary_refs[d];
    APPEND("},\"primary_ctx_refs\":%d,\"device_resident_bytes\":[", refs);
    for (int d = 0; d < fk_ndev(); d++) APPEND("%s%llu", d ? "," : "", g_dev_resident[d]);
    APPEND("],");
    APPEND("\"captures\":{\"ended\":%lu,\"invalidated\":%lu,\"unsafe_calls\":%lu,"
           "\"captured_launches\":%lu}}",
           g_captures_ended, g_captures_invalidated, g_capture_unsafe_calls, g_captured_launches);
    pthread_mutex_unlock(&g_lock);
#undef APPEND
    if (off >= sizeof(tmp)) off = sizeof(tmp) - 1;
    if (buf && n) {
        size_t c = off < n - 1 ? off : n - 1;
        memcpy(buf, tmp, c);
        buf[c] = 0;
    }
    return (int)off;
}

__attribute__((destructor)) static void fk_write_stats_at_exit(void) {
    const char *path = getenv("GPUSHARE_FAKE_STATS_FILE");
    if (!path || !*path) return;
    char buf[16384];
    fakecuda_stats_json(buf, sizeof(buf));
    FILE *f = fopen(path, "w");
    if (!f) return;
    fprintf(f, "%s\n", buf);
    fclose(f);
}

/* ---- core2: several devices (issue 12 item 3). The shim asks a stream for its context to know
 * which device a stream-ordered call works on; the stand-in's explicit streams keep the context
 * that was current when they were made. ---- */
CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx) {
    struct CUstream_st *s;
    CUresult r = get_stream(hStream, 0, &s);
    if (r != CUDA_SUCCESS) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = s->ctx ? s->ctx : cur_ctx();
    return *pctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}
/* ---- end core2 ---- */

#else /* GPUSHARE_FAKE_NVML */

/* ------------------------------------------------------------------------------------------ */
/* The NVML stand-in: every physical device (NVML ignores CUDA_VISIBLE_DEVICES), the fake      */
/* driver's resident bytes as used on the device this process's context is on.                */
/* ------------------------------------------------------------------------------------------ */

struct nvmlDevice_st {
    int index;
};
static struct nvmlDevice_st g_nvml_devs[FK_MAX_DEV] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static int g_nvml_inited;

enum {
    FK_NVML_ERROR_UNINITIALIZED = 1,
    FK_NVML_ERROR_INVALID_ARGUMENT = 2,
    FK_NVML_ERROR_NOT_FOUND = 6,
    FK_NVML_ERROR_INSUFFICIENT_SIZE = 7,
};

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} fk_nvmlUtilization_t;

static void *fk_driver_sym(const char *name) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    void *sym = lib ? dlsym(lib, name) : NULL;
    if (lib) dlclose(lib); /* NOLOAD: only drops the reference just taken; the symbol stays */
    return sym;
}

static unsigned long long nvml_used(int index) {
    unsigned long long (*used)(void) =
        (unsigned long long (*)(void))fk_driver_sym("fakecuda_device_used_bytes");
    int (*phys)(void) = (int (*)(void))fk_driver_sym("fakecuda_physical_device");
    if (!used || (phys ? phys() : 0) != index) return 0;
    return used();
}

static int nvml_dev_ok(nvmlDevice_t device) {
    return device && device >= &g_nvml_devs[0] && device < &g_nvml_devs[fk_ndev()];
}

nvmlReturn_t nvmlInit_v2(void) {
    g_nvml_inited = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit(void) {
    g_nvml_inited = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    g_nvml_inited = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
    g_nvml_inited = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!count) return FK_NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)fk_ndev();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!device || index >= (unsigned int)fk_ndev()) return FK_NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_nvml_devs[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return FK_NVML_ERROR_INVALID_ARGUMENT;
    for (int d = 0; d < fk_ndev(); d++) {
        char u[64];
        fk_phys_uuid_string(d, u, sizeof u);
        if (strcasecmp(u, uuid) == 0) {
            *device = &g_nvml_devs[d];
            return NVML_SUCCESS;
        }
    }
    return FK_NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !index) return FK_NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)device->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !uuid) return FK_NVML_ERROR_INVALID_ARGUMENT;
    char u[64];
    fk_phys_uuid_string(device->index, u, sizeof u);
    if (length <= strlen(u)) return FK_NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(uuid, u, strlen(u) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !name || !length) return FK_NVML_ERROR_INVALID_ARGUMENT;
    snprintf(name, length, "%s", "gpushare stand-in GPU");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, fk_nvmlUtilization_t *util) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !util) return FK_NVML_ERROR_INVALID_ARGUMENT;
    util->gpu = 0;
    util->memory = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !memory) return FK_NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long total = fk_phys_total(device->index), used = nvml_used(device->index);
    if (used > total) used = total;
    memory->total = total;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (!g_nvml_inited) return FK_NVML_ERROR_UNINITIALIZED;
    if (!nvml_dev_ok(device) || !memory) return FK_NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long total = fk_phys_total(device->index), used = nvml_used(device->index);
    if (used > total) used = total;
    memory->total = total;
    memory->reserved = 0;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

#endif /* GPUSHARE_FAKE_NVML */
