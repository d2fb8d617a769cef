/*
 * The idle detector: a holder that has submitted nothing for GPUSHARE_IDLE_SECONDS and whose
 * recorded streams have no work pending tells the scheduler, which may then hand the device on
 * without waiting for the quantum to end (docs/architecture.md).
 */
#include "gpushare.h"
#include "session.h"

/* Fold the gated calls' activity flag into a timestamp (the fast path only sets a flag: reading
 * the clock there would cost more than the rest of the gate). */
void gs_idle_sample(struct gs_session *s, double now)
{
    if (atomic_exchange_explicit(&gs_activity, 0, memory_order_relaxed)) {
        pthread_mutex_lock(&s->mu);
        s->last_activity = now;
        s->idle_sent = 0;
        pthread_mutex_unlock(&s->mu);
    }
}

/* Work queued on some thread's per-thread default stream: the shim's thread cannot name that
 * stream, but an event recorded on the legacy stream completes only after the work of every
 * blocking stream of the context (per-thread default streams are blocking streams) before it. */
static int legacy_stream_busy(void)
{
    typedef CUresult (*create_fn)(CUevent *, unsigned int);
    typedef CUresult (*record_fn)(CUevent, CUstream);
    typedef CUresult (*event_fn)(CUevent);
    create_fn create = (create_fn)gs_driver_sym("cuEventCreate");
    record_fn record = (record_fn)gs_driver_sym("cuEventRecord");
    event_fn query = (event_fn)gs_driver_sym("cuEventQuery");
    event_fn destroy = (event_fn)gs_driver_sym("cuEventDestroy_v2");
    CUevent ev = NULL;
    if (!create || !record || !query || !destroy || create(&ev, 0x2 /* DISABLE_TIMING */))
        return 1; /* cannot tell: busy */
    int busy = record(ev, GS_STREAM_LEGACY) != CUDA_SUCCESS || query(ev) != CUDA_SUCCESS;
    destroy(ev);
    return busy;
}

void gs_idle_check(struct gs_session *s, double now)
{
    double window = gs_config()->idle_seconds;
    pthread_mutex_lock(&s->mu);
    int holding = s->conn.connected && s->state == GPUSHARE_STATE_HOLDING;
    int due = holding && window > 0 && !s->idle_sent && now - s->last_activity >= window;
    double idle_for = now - s->last_activity;
    pthread_mutex_unlock(&s->mu);
    if (!due)
        return;
    /* A capture in progress is work in progress; and asking about streams then would fail it.
     * Holding captures off also keeps one from beginning while the legacy stream is used. */
    if (!gs_capture_hold_off(0))
        return;
    int busy = gs_device_push(s, NULL) != 0;
    if (!busy) {
        busy = gs_streams_busy() || (gs_streams_ptds_used() && legacy_stream_busy());
        gs_device_pop();
    }
    gs_capture_unlock();
    if (busy)
        return; /* work is still running: look again on the next tick */
    struct gs_mem_totals t;
    gs_mem_totals_dev(s->devs.dev, &t); /* the first device's: this is its connection */
    struct gs_writer w;
    gs_conn_begin(s, &w, GS_MSG_IDLE);
    gs_w_u64(&w, GS_TAG_IDLE_MS, (uint64_t)(idle_for * 1000));
    /* What of a former pre-copy is still valid (calls since then made the rest stale). */
    gs_w_u64(&w, GS_TAG_PRECOPIED_BYTES, t.precopied);
    if (gs_conn_send(s, &w) == 0) {
        pthread_mutex_lock(&s->mu);
        s->idle_sent = 1;
        pthread_mutex_unlock(&s->mu);
        GS_DEBUG("idle for %.1f s: told the scheduler", idle_for);
        /* Host staging is prepared now, off the critical path: an eviction of this idle
         * process then copies at the bus's speed from its first byte. Registering host memory
         * needs the application's context. */
        if (gs_device_push(s, NULL) == 0) {
            gs_mem_prepare_staging();
            gs_device_pop();
        }
    }
}

