/*
 * The stand-in driver's copies and sets: every cuMemcpy* and cuMemset* path, synchronous and
 * asynchronous, moving real bytes (included by fake_libcuda.c, which owns the lock, the state
 * and the checks this file uses; not compiled alone).
 */

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
