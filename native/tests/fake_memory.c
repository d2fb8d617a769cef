/*
 * The stand-in driver's device memory: every allocation path (classic, managed, stream-ordered,
 * VMM), cuMemGetInfo, prefetch and advice; it includes fake_graph.c (pools, graph memory). Included
 * by fake_libcuda.c, which owns the lock, the state and the checks it uses; not compiled alone.
 */

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

CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    COUNT();
    NEED_CTX();
    if (!free || !total) return CUDA_ERROR_INVALID_VALUE;
    int phys = fk_cur_phys();
    pthread_mutex_lock(&g_lock);
    unsigned long long used = g_dev_resident[phys];
    pthread_mutex_unlock(&g_lock);
    if (fk_card()) used = fk_card_used(fk_card(), phys); /* every process's on the card */
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
    CUresult r = fk_dev_take_locked(phys, size, other);
    if (r) {
        pthread_mutex_unlock(&g_lock);
        return r;
    }
    int fd = memfd_create("fakecuda-handle", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        fk_dev_give_locked(phys, size);
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    GROW(g_handles, g_nhandles, g_caphandles);
    unsigned long long id = g_next_handle++;
    g_handles[g_nhandles++] =
        (struct fk_handle){id, fd, size, 0, 0, 0, prop_handle_types(prop) & 1, 0, phys};
    g_live_device_bytes += size;
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
        fk_dev_give_locked(h->phys, h->size);
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
            fk_dev_give_locked(a->phys, a->size);
        }
        a->on_host = 1;
    } else {
        g_prefetch_to_device_bytes += count;
        g_prefetch_to_device_calls++;
        if (!a->on_host) { /* through the host (with a card file it stays there if full) */
            fk_dev_give_locked(a->phys, a->size);
            g_managed_on_host_bytes += a->size;
            a->on_host = 1;
        }
        if (fk_managed_onto_locked(phys, a->size)) {
            g_managed_on_host_bytes -= a->size;
            a->phys = phys;
            a->on_host = 0;
        }
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
