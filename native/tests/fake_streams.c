/*
 * The stand-in driver's streams and events: cuStream* create, query, synchronise, destroy and
 * cuEvent* (included by fake_libcuda.c, which owns the lock, the state and the checks this file
 * uses; not compiled alone).
 */

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
