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
 * One card (fake_card.c): by default each process has a device of its own, full when its own
 * memory fills it. With GPUSHARE_FAKE_CARD_FILE=PATH (tests/conftest.py's harness sets one per
 * test) every process accounts in that shared file, as on one real card: an allocation is
 * refused with CUDA_ERROR_OUT_OF_MEMORY when all processes together would pass the device's
 * total, a killed process's memory is freed, cuMemGetInfo and NVML (memory, and
 * nvmlDeviceGetComputeRunningProcesses) answer card-wide, and the file keeps per device and per
 * process the bytes held now and their peak (tests/native/card_file.py reads it).
 * GPUSHARE_FAKE_HOST_LIMIT=BYTES: pinned host memory (cuMemHostRegister, cuMemHostAlloc) past it
 * is refused with CUDA_ERROR_OUT_OF_MEMORY, all processes of the card file together (without
 * one, each process alone); the file keeps the host bytes pinned and their peak.
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
 * GPUSHARE_FAKE_HOST_REGISTER_MS (each cuMemHostRegister takes that long) and
 * GPUSHARE_FAKE_HOST_REGISTER_UNTIL=PATH (it lasts until PATH exists): host staging made late.
 */
#include "base/cuda_abi.h"

#include <ctype.h>
#include <stdatomic.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
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

/* One card shared by every process of a test (GPUSHARE_FAKE_CARD_FILE), both libraries. */
#include "fake_card.c"

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
 * launch paths" in fake_capture.c) ---- */
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

/* Physical device `phys` takes `size` more bytes of this process's (caller holds g_lock): with a
 * card file (fake_card.c) against every process's bytes and GPUSHARE_FAKE_OTHER_BYTES, without
 * one against this process's own and `other`. */
static CUresult fk_dev_take_locked(int phys, size_t size, unsigned long long other) {
    if (fk_card()) {
        CUresult r = fk_card_take(phys, size, fk_phys_total(phys), fk_other_bytes());
        if (r) return r;
    } else if (g_dev_resident[phys] + other + size > fk_phys_total(phys)) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_dev_resident[phys] += size;
    return CUDA_SUCCESS;
}

static void fk_dev_give_locked(int phys, size_t size) {
    g_dev_resident[phys] -= size;
    if (fk_card()) fk_card_give(phys, size);
}

/* Managed memory moving onto device `phys` (caller holds g_lock): 1 when it is there now. With a
 * card file it stays on the host when the card is full (managed memory never passes the card);
 * without one it always moves. */
static int fk_managed_onto_locked(int phys, size_t size) {
    if (fk_card() && fk_card_take(phys, size, fk_phys_total(phys), fk_other_bytes())) return 0;
    g_dev_resident[phys] += size;
    return 1;
}

/* With a card file, a process's first context on a device takes GPUSHARE_FAKE_CONTEXT_BYTES
 * there (a real context's own memory), until the process exits. */
static unsigned long long fk_context_bytes(void); /* fake_checkpoint.c */
static CUresult fk_context_take(int phys) {
    static int taken[FK_MAX_DEV];
    if (!fk_card() || !fk_context_bytes()) return CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_SUCCESS;
    if (!taken[phys]) r = fk_card_take(phys, fk_context_bytes(), fk_phys_total(phys), fk_other_bytes());
    if (!r) taken[phys] = 1;
    pthread_mutex_unlock(&g_lock);
    return r;
}

static CUresult add_alloc(CUdeviceptr *dptr, size_t size, int kind) {
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    int phys = fk_cur_phys();
    pthread_mutex_lock(&g_lock);
    int on_host = 0;
    CUresult r = CUDA_SUCCESS;
    if (kind == A_MANAGED)
        on_host = !fk_managed_onto_locked(phys, size);
    else
        r = fk_dev_take_locked(phys, size, 0);
    void *p = r ? NULL : map_anon(size);
    if (!p) {
        if (!r && !on_host) fk_dev_give_locked(phys, size);
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    GROW(g_allocs, g_nalloc, g_capalloc);
    g_allocs[g_nalloc++] = (struct fk_alloc){(uintptr_t)p, size, kind, on_host, phys};
    if (kind == A_MANAGED) {
        g_live_managed_bytes += size;
        if (on_host) g_managed_on_host_bytes += size;
    } else {
        g_live_device_bytes += size;
    }
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
        if (a.kind != A_MANAGED || !a.on_host) fk_dev_give_locked(a.phys, a.size);
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

/* The driver's API, family by family; each fragment uses what the ones before it define. */
#include "fake_devices.c"
#include "fake_streams.c"
#include "fake_memory.c"
#include "fake_modules.c"
#include "fake_vmm.c"
#include "fake_checkpoint.c"
#include "fake_copies.c"
#include "fake_errors.c"
#include "fake_capture.c"
#include "fake_procaddr.c"
#include "fake_exports.c"

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

#include "fake_nvml.c"

#endif /* GPUSHARE_FAKE_NVML */
