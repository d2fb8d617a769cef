/*
 * The gate's slow path: a gated call found the gate closed. It starts the session if a context
 * appeared without a hook, asks the shim's thread for the device, and waits (in 20 ms slices, so
 * SIGINT can end the wait) until the GRANT handler opens the gate.
 */
#include <time.h>

#include "gpushare.h"
#include "session.h"

#define WAIT_SLICE_NS 20000000L /* 20 ms: how quickly a waiter notices SIGINT */

/* Whether a call on `dev` (has_dev: known) may pass now; asks the thread for that device's grant
 * when it may not. `link` is the call's device's link (NULL: the first device's). Under s->mu. */
static int may_pass_locked(struct gs_session *s, struct gs_link *link)
{
    int st = s->state;
    /* Memory past the grant's room waits unbacked on this device (memory/api.h): no call on it
     * passes, whatever the state says, until the next grant backs that memory. A holder's
     * thread gives the device back and asks for it again. */
    int held = (gs_gate_holds() >> gs_mem_slot(link ? link->dev : s->devs.dev)) & 1u;
    if (held && (link ? link->state == GS_LINK_HOLDING : st == GPUSHARE_STATE_HOLDING)) {
        gs_session_wake(s);
        return 0;
    }
    if (s->quitting || st == GPUSHARE_STATE_UNSHARED)
        return !held;
    if (link) {
        if (link->state == GS_LINK_HOLDING || link->state == GS_LINK_UNSHARED)
            return !held;
        if (link->state == GS_LINK_IDLE && !link->requested && !link->want_request) {
            link->want_request = 1;
            gs_session_wake(s);
        }
        return 0;
    }
    if (st == GPUSHARE_STATE_HOLDING)
        return 1;
    if (st == GPUSHARE_STATE_IDLE && s->conn.connected && !s->requested && !s->want_request) {
        s->want_request = 1;
        gs_session_wake(s);
    }
    return 0;
}

/* The device of the call, when the process uses several (one only: no driver call). */
static int call_device(struct gs_session *s, CUstream stream, CUdevice *dev)
{
    pthread_mutex_lock(&s->mu);
    int several = s->links.n > 0;
    pthread_mutex_unlock(&s->mu);
    return several && gs_device_of_call(s, stream, dev) == 0;
}

static CUresult wait_for_device(struct gs_session *s, CUstream stream)
{
    CUresult result = CUDA_SUCCESS;
    int waiting = 0;
    unsigned sig0 = 0;
    double t0 = 0;
    CUdevice dev = 0;
    int has_dev = call_device(s, stream, &dev);
    struct gs_link *link = NULL;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        /* Links are only ever added (and the table never moves): the pointer stays valid. */
        if (has_dev && !link && dev != s->devs.dev)
            link = gs_session_link_locked(s, dev);
        if (s->state == GPUSHARE_STATE_INACTIVE && !s->started) {
            pthread_mutex_unlock(&s->mu);
            gs_start_from_current(s);
            pthread_mutex_lock(&s->mu);
            if (s->state == GPUSHARE_STATE_INACTIVE && !s->started)
                break; /* no context at all: nothing to share, let the driver answer */
            continue;
        }
        CUdevice on = link ? link->dev : s->devs.dev;
        if ((gs_gate_holds() >> gs_mem_slot(on) & 1u) && gs_mem_take_hopeless(on)) {
            /* Its memory found no room after the scheduler moved what it could (defer.c said
             * why on stderr): this call fails; the next one asks again. */
            result = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        if (may_pass_locked(s, link))
            break;
        if (!waiting) {
            waiting = 1;
            t0 = gs_now();
            sig0 = gs_sigint_count();
            if (s->waiters++ == 0) {
                s->stats.wait_began = t0;
                gs_sigint_begin();
            }
            if (link)
                link->waiters++;
            s->stats.waits++;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += WAIT_SLICE_NS;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        if (gs_sigint_count() != sig0) {
            result = CUDA_ERROR_NOT_PERMITTED;
            break;
        }
    }
    if (result == CUDA_SUCCESS) {
        /* A call that waited was counted before its wait: it counts again as it passes, so a
         * host copy made meanwhile (a restore, a pre-copy: memory/move.c) is seen as older than
         * what this call may write. */
        if (waiting)
            gs_count_call();
        gs_gate_inflight_begin(); /* under the lock: a release that closes the gate after this
                                     point sees the flag, one that closed it before was seen */
    }
    if (waiting) {
        if (link)
            link->waiters--;
        s->stats.wait_seconds += gs_now() - t0;
        if (--s->waiters == 0)
            gs_sigint_end();
    }
    pthread_mutex_unlock(&s->mu);
    if (result == CUDA_ERROR_NOT_PERMITTED)
        GS_INFO("interrupted while waiting for the device");
    return result;
}


CUresult gs_gate_slow(CUstream s, int per_thread)
{
    if (gs_config()->disabled) {
        gs_gate_set_open(1);
        return CUDA_SUCCESS; /* still in flight: the export's gs_gate_leave() ends it */
    }
    gs_gate_leave(); /* a thread waiting for the grant is not inside a gated call */
    if (gs_capture_stream_capturing(s, per_thread)) {
        /* Captured, not run: it needs no device, and a revoke may be waiting for this capture
         * to end. */
        gs_gate_inflight_begin();
        return CUDA_SUCCESS;
    }
    CUresult r = wait_for_device(gs_session_get(), s);
    if (r == CUDA_SUCCESS) {
        atomic_store_explicit(&gs_activity, 1, memory_order_relaxed);
        gs_note_stream(s, per_thread);
    }
    return r;
}
