/*
 * The stand-in driver's stream capture (cuStreamBeginCapture*, cuStreamEndCapture,
 * cuStreamIsCapturing), primary-context teardown, the other launch paths and stream memory
 * operations (included by fake_libcuda.c, which owns what this file uses; not compiled alone).
 */

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
