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

#define FK_VMM_EXPORTS(X)                                                                        \
    X(cuMemHostRegister_v2) X(cuMemHostUnregister) X(cuMemHostAlloc) X(cuMemFreeHost)            \
    X(cuCtxGetStreamPriorityRange)

/* Appended to fakecuda_stats_json (g_lock held). */
#define FK_VMM_STATS(APPEND)                                                                     \
    APPEND("\"host_pinned_bytes\":%llu,\"copy_to_host_bytes\":%llu,"                             \
           "\"copy_to_host_pinned_bytes\":%llu,\"copy_to_device_bytes\":%llu,"                   \
           "\"copy_to_device_pinned_bytes\":%llu,",                                              \
           g_host_pinned_bytes, g_d2h_bytes, g_d2h_pinned_bytes, g_h2d_bytes, g_h2d_pinned_bytes)
