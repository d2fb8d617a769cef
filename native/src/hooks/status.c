/* The public status API (native/include/gpushare.h), read by the %gpushare magic through cffi:
 * a snapshot of the session, and gpushare_release(). */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "gpushare.h"
#include "client/session.h"

static void snapshot(struct gs_session *s, struct gpushare_status *out)
{
    struct gs_mem_totals t;
    gs_mem_totals_now(&t); /* a snapshot never waits for an eviction or a restore in flight */
    double now = gs_now();
    pthread_mutex_lock(&s->mu);
    int st = s->state;
    /* A call that waits for any of the process's devices (a later one while the first is held,
     * link.c) is what the wait line reports. */
    if ((st == GPUSHARE_STATE_IDLE && s->waiters > 0) || gs_session_link_waiters_locked(s) > 0)
        st = GPUSHARE_STATE_WAITING;
    /* A holder whose calls wait because its memory went past the grant's room (memory/api.h):
     * the thread is giving the device back to ask for more. (Only then: a waiter the grant has
     * not woken yet is a holder's call about to pass.) */
    if (st == GPUSHARE_STATE_HOLDING && s->waiters > 0 &&
        (gs_gate_holds() >> gs_mem_slot(s->devs.dev) & 1u))
        st = GPUSHARE_STATE_WAITING;
    if (s->asleep && st != GPUSHARE_STATE_HOLDING)
        st = GPUSHARE_STATE_ASLEEP; /* a waiter of a sleeping process waits for the wake */
    out->state = (uint32_t)st;
    out->connected = (uint32_t)s->conn.connected;
    out->evicted = t.evicted > 0;
    out->used_bytes = t.used;
    out->managed_bytes = t.managed;
    out->pinned_bytes = t.pinned;
    out->evicted_bytes = t.evicted;
    out->quota_bytes = t.quota;
    out->pool_bytes = t.pool;
    out->gated_calls = gs_total_gated_calls();
    out->waits = s->stats.waits;
    out->current_wait_seconds = s->waiters ? now - s->stats.wait_began : 0;
    out->wait_seconds = s->stats.wait_seconds + out->current_wait_seconds;
    out->holding_seconds =
        s->stats.holding_seconds + (s->state == GPUSHARE_STATE_HOLDING ? now - s->stats.hold_since : 0);
    int active = atomic_load_explicit(&gs_activity, memory_order_relaxed);
    out->idle_seconds = (!s->started || active) ? 0 : now - s->last_activity;
    snprintf(out->client_id, sizeof out->client_id, "%s", s->id.client_id);
    snprintf(out->socket_path, sizeof out->socket_path, "%s", s->id.socket_path);
    snprintf(out->device_uuid, sizeof out->device_uuid, "%s", s->devs.uuid);
    out->precopied_bytes = t.precopied;
    out->staging_pinned_bytes = t.staging_pinned;
    out->staging_pageable_bytes = t.staging_pageable;
    out->staging_fallbacks = t.staging_fallbacks;
    out->restores = s->stats.restores;
    out->last_restore_bytes = s->stats.last_restore_bytes;
    out->last_restore_seconds = s->stats.last_restore_seconds;
    pthread_mutex_unlock(&s->mu);
}

static int release(struct gs_session *s)
{
    pthread_mutex_lock(&s->mu);
    if (!s->conn.connected) {
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    if (s->state != GPUSHARE_STATE_HOLDING) {
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    s->want_release = 1;
    gs_session_wake(s);
    while (s->want_release && s->conn.connected)
        pthread_cond_wait(&s->cv, &s->mu);
    int r = s->conn.connected ? 0 : -1;
    pthread_mutex_unlock(&s->mu);
    return r;
}


GS_EXPORT int gpushare_get_status(struct gpushare_status *out, size_t size)
{
    /* Every field this library knows must fit: a caller built against an older, shorter struct
     * would otherwise get a partial copy it cannot tell from a full one. */
    if (!out || size < sizeof(struct gpushare_status))
        return -1;
    memset(out, 0, size);
    out->version = GPUSHARE_STATUS_VERSION;
    snapshot(gs_session_get(), out);
    return 0;
}

GS_EXPORT int gpushare_release(void) { return release(gs_session_get()); }

GS_EXPORT const char *gpushare_version(void) { return GS_VERSION; }
