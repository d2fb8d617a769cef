/*
 * The stand-in driver's host staging, copy accounting and process checkpoint (included by
 * fake_libcuda.c, which owns the lock, the allocations and the streams this file uses).
 *
 * Host memory registered with cuMemHostRegister / allocated with cuMemHostAlloc is "pinned";
 * device<->host copies are counted by direction and by whether the host side was pinned, so tests
 * can tell an eviction at the bus's speed from one through pageable memory.
 * GPUSHARE_FAKE_COPY_GBPS makes async device<->host copies take time on their stream (pinned at
 * that rate, pageable at a quarter of it), as the real copy engines do.
 */

struct fk_host_range {
    uintptr_t base;
    size_t size;
    int allocated; /* cuMemHostAlloc (freed with cuMemFreeHost) rather than registered */
};
static struct fk_host_range *g_host;
static size_t g_nhost, g_caphost;
static unsigned long long g_host_pinned_bytes;
static unsigned long long g_imported_handles; /* cuMemImportFromShareableHandle calls that worked */
static unsigned long long g_d2h_bytes, g_d2h_pinned_bytes, g_h2d_bytes, g_h2d_pinned_bytes;

/* Caller holds g_lock. */
static int host_pinned_locked(uintptr_t p, size_t n) {
    for (size_t i = 0; i < g_nhost; i++)
        if (p >= g_host[i].base && p < g_host[i].base + g_host[i].size &&
            n <= g_host[i].base + g_host[i].size - p)
            return 1;
    return 0;
}

/* Called by copy() for every copy it performs. */
static void fk_note_copy(const void *dst, const void *src, size_t n, int dst_dev, int src_dev,
                         struct CUstream_st *s) {
    if (dst_dev == src_dev) return;
    pthread_mutex_lock(&g_lock);
    int pinned = host_pinned_locked((uintptr_t)(dst_dev ? src : dst), n);
    if (dst_dev) {
        g_h2d_bytes += n;
        if (pinned) g_h2d_pinned_bytes += n;
    } else {
        g_d2h_bytes += n;
        if (pinned) g_d2h_pinned_bytes += n;
    }
    pthread_mutex_unlock(&g_lock);
    const char *gbps = getenv("GPUSHARE_FAKE_COPY_GBPS");
    double rate = gbps ? atof(gbps) : 0.0;
    if (s && rate > 0) stream_add_busy(s, (uint64_t)((double)n / (pinned ? rate : rate / 4)));
}

static CUresult host_add(void *p, size_t size, int allocated) {
    pthread_mutex_lock(&g_lock);
    if (host_pinned_locked((uintptr_t)p, 1)) {
        pthread_mutex_unlock(&g_lock);
        return FK_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
    /* Pinned memory is the host's: past GPUSHARE_FAKE_HOST_LIMIT (every process of the card file
     * together, or this one alone) it is refused, as the real driver refuses it when exhausted. */
    unsigned long long limit = fk_host_limit();
    CUresult r = CUDA_SUCCESS;
    if (fk_card())
        r = fk_card_host_take(size, limit);
    else if (limit && g_host_pinned_bytes + size > limit)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r) {
        pthread_mutex_unlock(&g_lock);
        return r;
    }
    GROW(g_host, g_nhost, g_caphost);
    g_host[g_nhost++] = (struct fk_host_range){(uintptr_t)p, size, allocated};
    g_host_pinned_bytes += size;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

static CUresult host_remove(void *p, int allocated) {
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_nhost; i++) {
        if (g_host[i].base != (uintptr_t)p || g_host[i].allocated != allocated) continue;
        size_t size = g_host[i].size;
        g_host_pinned_bytes -= size;
        if (fk_card()) fk_card_host_give(size);
        g_host[i] = g_host[--g_nhost];
        pthread_mutex_unlock(&g_lock);
        if (allocated) munmap(p, size);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return FK_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
    COUNT();
    NEED_CTX();
    if (!p || !bytesize) return CUDA_ERROR_INVALID_VALUE;
    /* Registering takes time on a real driver (16 GiB: ~1.8 s on an H100): long enough that a
     * program frees a temporary while the shim's background thread still prepares its staging. */
    const char *ms = getenv("GPUSHARE_FAKE_HOST_REGISTER_MS");
    if (ms && atof(ms) > 0) sleep_until_ns(now_ns() + (uint64_t)(atof(ms) * 1e6));
    /* GPUSHARE_FAKE_HOST_REGISTER_UNTIL=PATH: registering lasts until PATH exists (at most 120 s),
     * so a test decides when staging becomes ready instead of racing a fixed delay. */
    const char *until = getenv("GPUSHARE_FAKE_HOST_REGISTER_UNTIL");
    uint64_t give_up = now_ns() + 120000000000ULL;
    while (until && *until && access(until, F_OK) != 0 && now_ns() < give_up)
        sleep_until_ns(now_ns() + 5000000ULL);
    return host_add(p, bytesize, 0);
}

CUresult cuMemHostUnregister(void *p) {
    COUNT();
    NEED_CTX();
    return host_remove(p, 0);
}

CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    COUNT();
    NEED_CTX();
    if (!pp || !bytesize) return CUDA_ERROR_INVALID_VALUE;
    void *p = map_anon(bytesize);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = host_add(p, bytesize, 1);
    if (r != CUDA_SUCCESS) munmap(p, bytesize);
    else *pp = p;
    return r;
}

CUresult cuMemFreeHost(void *p) {
    COUNT();
    NEED_CTX();
    return host_remove(p, 1);
}

CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
    COUNT();
    NEED_CTX();
    if (leastPriority) *leastPriority = 0;
    if (greatestPriority) *greatestPriority = -5;
    return CUDA_SUCCESS;
}

/* cuMemRetainAllocationHandle: the handle mapped at addr (the same id cuMemCreate gave). */
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    COUNT();
    NEED_INIT();
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_nmaps; i++) {
        struct fk_mapping *m = &g_maps[i];
        if ((uintptr_t)addr < m->base || (uintptr_t)addr >= m->base + m->size) continue;
        struct fk_handle *h = find_handle_locked(m->handle);
        if (h && h->released) {
            h->released = 0; /* released but still mapped: the retain holds it again */
        } else if (h) {
            h->extra_refs++;
        }
        *handle = m->handle;
        pthread_mutex_unlock(&g_lock);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_INVALID_VALUE;
}

/* CUDA arrays: device memory of the described size, no contents modelled. */
struct CUarray_st {
    size_t size;
};
struct CUmipmappedArray_st {
    size_t size;
};

static size_t fk_array_bytes(size_t w, size_t h, size_t d, int format, unsigned ch, unsigned lv) {
    size_t elem = (format == 0x01 || format == 0x08) ? 1 : (format == 0x02 || format == 0x09 ||
                                                            format == 0x10) ? 2 : 4;
    size_t total = 0;
    for (unsigned l = 0; l < (lv ? lv : 1); l++) {
        size_t lw = w >> l ? w >> l : 1, lh = h ? (h >> l ? h >> l : 1) : 1;
        size_t ld = d ? (d >> l ? d >> l : 1) : 1;
        total += lw * lh * ld * (ch ? ch : 1) * elem;
    }
    return total;
}

/* Arrays live on the current context's device (and are given back there). */
static CUresult fk_array_take(size_t size) {
    int phys = fk_cur_phys();
    pthread_mutex_lock(&g_lock);
    CUresult r = fk_dev_take_locked(phys, size, 0);
    if (!r) g_live_device_bytes += size;
    note_peak();
    pthread_mutex_unlock(&g_lock);
    return r;
}

static void fk_array_give(size_t size) {
    int phys = fk_cur_phys();
    pthread_mutex_lock(&g_lock);
    g_live_device_bytes -= size;
    fk_dev_give_locked(phys, size);
    pthread_mutex_unlock(&g_lock);
}

static CUresult fk_array_new(void **out, size_t size) {
    if (!out || !size) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = fk_array_take(size);
    if (r) return r;
    size_t *a = malloc(sizeof *a);
    if (!a) {
        fk_array_give(size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *a = size;
    *out = a;
    return CUDA_SUCCESS;
}

CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d) {
    COUNT();
    NEED_CTX();
    if (!d || !d->Width) return CUDA_ERROR_INVALID_VALUE;
    return fk_array_new((void **)pHandle,
                        fk_array_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels, 1));
}

CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    COUNT();
    NEED_CTX();
    if (!d || !d->Width) return CUDA_ERROR_INVALID_VALUE;
    return fk_array_new((void **)pHandle, fk_array_bytes(d->Width, d->Height, d->Depth, d->Format,
                                                         d->NumChannels, 1));
}

CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                unsigned int numMipmapLevels) {
    COUNT();
    NEED_CTX();
    if (!d || !d->Width || !numMipmapLevels) return CUDA_ERROR_INVALID_VALUE;
    return fk_array_new((void **)pHandle, fk_array_bytes(d->Width, d->Height, d->Depth, d->Format,
                                                         d->NumChannels, numMipmapLevels));
}

static CUresult fk_array_free(void *h) {
    if (!h) return CUDA_ERROR_INVALID_VALUE;
    fk_array_give(*(size_t *)h);
    free(h);
    return CUDA_SUCCESS;
}

CUresult cuArrayDestroy(CUarray hArray) {
    COUNT();
    NEED_INIT();
    return fk_array_free(hArray);
}

CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
    COUNT();
    NEED_INIT();
    return fk_array_free(hMipmappedArray);
}

/* The legacy IPC handle: like the real driver, only for cuMemAlloc memory (the VMM and managed
 * memory get "invalid argument"). The handle carries the allocation's address. */
CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
    COUNT();
    NEED_CTX();
    if (!pHandle) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct fk_alloc *a = find_alloc_locked((uintptr_t)dptr, 1);
    int ok = a && (a->kind == A_DEVICE || a->kind == A_PITCH);
    pthread_mutex_unlock(&g_lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    memset(pHandle, 0, sizeof *pHandle);
    memcpy(pHandle->reserved, &dptr, sizeof dptr);
    return CUDA_SUCCESS;
}

/* The driver's own IPC of cuMemAlloc memory is not modelled across processes: opening such a
 * handle answers "invalid value" (and is counted, so tests see that the shim passed it through). */
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
    COUNT();
    NEED_CTX();
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
    COUNT();
    NEED_CTX();
    return CUDA_ERROR_INVALID_VALUE;
}

/* Shareable handles: a cuMemCreate handle is a memfd, so its POSIX file descriptor is a dup of
 * it, and another process that imports it maps the very same bytes (as two processes share one
 * GPU's memory). Only handles created with the POSIX file descriptor type can be exported. */
CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      int handleType, unsigned long long flags) {
    COUNT();
    NEED_INIT();
    if (!shareableHandle || handleType != 1 || flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct fk_handle *h = find_handle_locked(handle);
    int fd = h && !h->released && h->exportable ? fcntl(h->fd, F_DUPFD_CLOEXEC, 0) : -1;
    pthread_mutex_unlock(&g_lock);
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    memcpy(shareableHandle, &fd, sizeof fd);
    return CUDA_SUCCESS;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                        int shHandleType) {
    COUNT();
    NEED_INIT();
    struct stat st;
    int fd = (int)(intptr_t)osHandle;
    if (!handle || shHandleType != 1 || fstat(fd, &st) != 0 || st.st_size <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    GROW(g_handles, g_nhandles, g_caphandles);
    unsigned long long id = g_next_handle++;
    g_handles[g_nhandles++] = (struct fk_handle){id, own, (size_t)st.st_size, 0, 0, 0, 1, 1, 0};
    g_imported_handles++;
    pthread_mutex_unlock(&g_lock);
    *handle = id;
    return CUDA_SUCCESS;
}

#define FK_VMM_EXPORTS(X)                                                                        \
    X(cuMemHostRegister_v2) X(cuMemHostUnregister) X(cuMemHostAlloc) X(cuMemFreeHost)            \
    X(cuCtxGetStreamPriorityRange) X(cuMemRetainAllocationHandle) X(cuArrayCreate_v2)            \
    X(cuArray3DCreate_v2) X(cuMipmappedArrayCreate) X(cuArrayDestroy) X(cuMipmappedArrayDestroy) \
    X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle_v2) X(cuIpcCloseMemHandle)                        \
    X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle)

/* Appended to the cuGetProcAddress table: (base name, version, per-thread, symbol). */
#define FK_VMM_PROCS                                                                             \
    {"cuMemHostRegister", 6050, 0, "cuMemHostRegister_v2"},                                      \
        {"cuMemHostUnregister", 4000, 0, "cuMemHostUnregister"},                                 \
        {"cuMemHostAlloc", 2020, 0, "cuMemHostAlloc"}, {"cuMemFreeHost", 2000, 0, "cuMemFreeHost"}, \
        {"cuCtxGetStreamPriorityRange", 5050, 0, "cuCtxGetStreamPriorityRange"},                 \
        {"cuMemRetainAllocationHandle", 11000, 0, "cuMemRetainAllocationHandle"},                \
        {"cuArrayCreate", 3020, 0, "cuArrayCreate_v2"},                                          \
        {"cuArray3DCreate", 3020, 0, "cuArray3DCreate_v2"},                                      \
        {"cuMipmappedArrayCreate", 5000, 0, "cuMipmappedArrayCreate"},                           \
        {"cuArrayDestroy", 2000, 0, "cuArrayDestroy"},                                           \
        {"cuMipmappedArrayDestroy", 5000, 0, "cuMipmappedArrayDestroy"},                         \
        {"cuIpcGetMemHandle", 4010, 0, "cuIpcGetMemHandle"},                                     \
        {"cuIpcOpenMemHandle", 11000, 0, "cuIpcOpenMemHandle_v2"},                               \
        {"cuIpcCloseMemHandle", 4010, 0, "cuIpcCloseMemHandle"},                                 \
        {"cuMemExportToShareableHandle", 10020, 0, "cuMemExportToShareableHandle"},              \
        {"cuMemImportFromShareableHandle", 10020, 0, "cuMemImportFromShareableHandle"},

/* Appended to fakecuda_stats_json (g_lock held). */
#define FK_VMM_STATS(APPEND)                                                                     \
    APPEND("\"host_pinned_bytes\":%llu,\"copy_to_host_bytes\":%llu,"                             \
           "\"copy_to_host_pinned_bytes\":%llu,\"copy_to_device_bytes\":%llu,"                   \
           "\"copy_to_device_pinned_bytes\":%llu,\"imported_handles\":%llu,",                    \
           g_host_pinned_bytes, g_d2h_bytes, g_d2h_pinned_bytes, g_h2d_bytes, g_h2d_pinned_bytes, \
           g_imported_handles)
