/*
 * The grant/revoke/evict lifecycle: what the shim does for each message the scheduler sends
 * (docs/protocol.md). Runs on the shim's thread only. This connection is the first device's: it
 * moves and reports that device's memory (a later device's link does the same for its own).
 */
#include <ctype.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

#include "gpushare.h"
#include "session.h"

/* The answer to a move (RELEASED, EVICTED, RESTORED): its flag, what it moved in how long, and
 * what is on the host now; a RESTORED also says what is clean (restored blocks are not). */
static void answer_move(struct gs_session *s, uint8_t type, int flag, uint64_t moved, uint64_t us)
{
    struct gs_mem_totals t;
    gs_mem_totals_dev(s->devs.dev, &t);
    /* Frees since the last (coalesced) MEMORY report go first: the scheduler otherwise took the
     * freed bytes, which this move did not copy, for memory that could not move and granted a
     * waiter beside them (640 MiB counted in a 400 MiB pool, tests/native/test_pool_accounting.py).
     * Not while memory waits past a room: no report as a holder may show it. */
    if (!gs_mem_past_room() && gs_conn_memory_differs(&s->mem_report, &t))
        gs_conn_send_memory(s);
    struct gs_writer w;
    gs_conn_begin(s, &w, type);
    gs_w_u64(&w, GS_TAG_FLAG, flag ? 1 : 0);
    gs_w_u64(&w, GS_TAG_EVICTED_BYTES, t.evicted);
    gs_w_u64(&w, GS_TAG_BYTES_MOVED, moved);
    gs_w_u64(&w, GS_TAG_MICROS, us);
    if (type == GS_MSG_RESTORED)
        gs_w_u64(&w, GS_TAG_PRECOPIED_BYTES, t.precopied);
    gs_conn_put_host(&w, &t); /* with the move's answer: the node's host budget sees it at once */
    gs_conn_send(s, &w);
}

void gs_life_release(struct gs_session *s, int evict, const char *reason, int solicited)
{
    pthread_mutex_lock(&s->mu);
    if (solicited && s->state != GPUSHARE_STATE_HOLDING) {
        /* A REVOKE that crossed our own unsolicited RELEASED on the wire: the scheduler takes
         * that RELEASED as the answer. Answering twice could arrive after a new GRANT and mark
         * us idle while we run, so a stale REVOKE is dropped (the socket keeps order). */
        pthread_mutex_unlock(&s->mu);
        GS_DEBUG("ignored a revoke (%s): not holding the device", reason ? reason : "");
        return;
    }
    if (s->state == GPUSHARE_STATE_HOLDING)
        s->stats.holding_seconds += gs_now() - s->stats.hold_since;
    if (s->conn.connected)
        gs_session_set_state_locked(s, GPUSHARE_STATE_RELEASING);
    pthread_mutex_unlock(&s->mu);

    /* The gate is closed: wait for the calls that passed it before, then for their work. */
    double t0 = gs_now();
    int stuck = gs_gate_drain(GS_DRAIN_WAIT_S);
    if (stuck) /* a synchronous call waiting for long GPU work, or a call that never returns: the
                  synchronisation below waits for the work itself */
        GS_INFO("%d call(s) still inside the driver after %.0f s: going on with the release",
                stuck, GS_DRAIN_WAIT_S);
    uint64_t moved = 0, us = 0;
    int evicted = 0;
    CUdevice dev = s->devs.dev;
    gs_drain_work(s, "the release", dev, evict, !solicited, &evicted, &moved, &us);
    if (evict && !evicted)
        GS_WARN("the eviction failed: the scheduler keeps counting this process's memory on the "
                "device");
    answer_move(s, GS_MSG_RELEASED, evicted, moved, us);
    const char *why = reason && *reason ? reason : "no reason";
    if (evict) {
        char b[32];
        GS_INFO("%s (%s): released after %.1f ms, evicted %s in %.1f ms",
                solicited ? "revoked" : "released", why, gs_ms(gs_now() - t0),
                gs_format_size(moved, b, sizeof b), us / 1000.0);
    } else {
        GS_INFO("%s (%s): released after %.1f ms", solicited ? "revoked" : "released", why,
                gs_ms(gs_now() - t0));
    }

    pthread_mutex_lock(&s->mu);
    int again = 0;
    if (s->conn.connected) {
        gs_session_set_state_locked(s, GPUSHARE_STATE_IDLE);
        gs_mem_defer_backing(dev); /* a waiter's new memory is never made resident, never evicted */
        s->requested = 0;
        /* Threads that blocked meanwhile still want the device (those that wait for another
         * device wait on its link), unless its memory gave up waiting for room (memory/defer.c):
         * the waiting call then fails, and a grant now would go unused. */
        if (s->waiters > gs_session_link_waiters_locked(s) && !gs_mem_hopeless(dev)) {
            s->requested = 1;
            again = 1;
        }
    }
    s->want_release = 0;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (again)
        gs_conn_send_request(s);
}

/* An eviction this thread runs for a REVOKE or EVICT stops when it is no longer needed: a GRANT
 * for this client is already behind it on the socket (the waiter it made room for left, or now
 * fits). This thread does not read the socket while it evicts, so the check reads what has
 * arrived (without blocking) into the receive buffer, behind the frame being handled, where
 * gs_life_drain finds it next. What was moved stays off the device; the GRANT restores it. */
static int eviction_cut;

static int eviction_unneeded(void *arg, uint64_t freed)
{
    (void)freed;
    struct gs_session *s = arg;
    struct pollfd p = {.fd = s->conn.fd, .events = POLLIN};
    if (s->conn.rx_len < sizeof s->conn.rx && poll(&p, 1, 0) == 1 && (p.revents & POLLIN)) {
        ssize_t r = recv(s->conn.fd, s->conn.rx + s->conn.rx_len,
                         sizeof s->conn.rx - s->conn.rx_len, MSG_DONTWAIT);
        if (r > 0) /* an end or error is left to the thread's loop, which polls again */
            s->conn.rx_len += (size_t)r;
    }
    size_t off = 0;
    for (int first = 1; off < s->conn.rx_len; first = 0) {
        struct gs_msg m;
        size_t flen;
        if (gs_parse(s->conn.rx + off, s->conn.rx_len - off, &m, &flen) != GS_PARSE_OK)
            break;
        if (!first && m.type == GS_MSG_GRANT) /* the first frame is the one being handled */
            return eviction_cut = 1;
        off += flen;
    }
    return 0;
}


static void handle_grant(struct gs_session *s, int restore, const struct gs_msg *m)
{
    /* An eviction cut short left memory off the device that this grant's sender may not have
     * known of yet: it comes back before the gate opens, whatever the flag says. */
    restore = restore || eviction_cut;
    eviction_cut = 0;
    double t0 = gs_now();
    char secret[GS_RESUME_SECRET_LEN + 2];
    if (gs_msg_str(m, GS_TAG_RESUME_SECRET, secret, sizeof secret)) {
        /* The latest one wins; one the scheduler could not have made is never sent back. */
        int ok = strlen(secret) == GS_RESUME_SECRET_LEN;
        for (int i = 0; ok && secret[i]; i++)
            ok = isxdigit((unsigned char)secret[i]);
        memcpy(s->resume.secret, ok ? secret : "", ok ? sizeof s->resume.secret : 1);
    }
    /* The room this grant gives (absent: no limit); before the deferred memory is backed, so
     * that an allocation after it is weighed against this grant's room, not an older one. */
    if (gs_msg_has(m, GS_TAG_ROOM_BYTES))
        gs_mem_set_room(s->devs.dev, gs_room_of(m));
    else
        gs_mem_set_room(s->devs.dev, 0);
    if (restore) {
        uint64_t moved = 0, us = 0;
        gs_drain_restore(s, "the restore", s->devs.dev, &moved, &us);
        answer_move(s, GS_MSG_RESTORED, 0, moved, us);
        pthread_mutex_lock(&s->mu); /* before the state says holding: the wait line reads both */
        s->stats.restores++;
        s->stats.last_restore_bytes = moved;
        s->stats.last_restore_seconds = us / 1e6;
        pthread_mutex_unlock(&s->mu);
        char b[32];
        GS_INFO("restored %s to the device in %.1f ms", gs_format_size(moved, b, sizeof b),
                us / 1000.0);
    }
    gs_mem_back_granted(s->devs.dev); /* before the gate opens: what waited gets backed */
    pthread_mutex_lock(&s->mu);
    if (s->conn.connected && !s->quitting) {
        double waited = s->waiters ? gs_now() - s->stats.wait_began : 0;
        s->requested = 0;
        s->stats.hold_since = gs_now();
        s->last_activity = s->stats.hold_since;
        s->idle_sent = 0;
        gs_session_set_state_locked(s, GPUSHARE_STATE_HOLDING);
        GS_INFO("granted the device (waited %.1f ms, restore took %.1f ms)", gs_ms(waited),
                restore ? gs_ms(gs_now() - t0) : 0.0);
    }
    pthread_mutex_unlock(&s->mu);
}

void gs_life_wait_for_room(struct gs_session *s)
{
    if (!(gs_mem_past_room() & (1u << gs_mem_slot(s->devs.dev))))
        return;
    pthread_mutex_lock(&s->mu);
    int holding = s->conn.connected && !s->quitting && s->state == GPUSHARE_STATE_HOLDING;
    pthread_mutex_unlock(&s->mu);
    if (!holding) /* released meanwhile: the next grant backs what waits */
        return;
    /* Unsolicited, without eviction: what is backed stays on the device (the scheduler counts it
     * there), what waits unbacked is on the host in every report; the REQUEST says how much. */
    gs_life_release(s, 0, "memory past the grant's room: waiting for room", 0);
    /* Given up for now (memory/defer.c): the program's next call asks again. */
    int gave_up = gs_mem_take_given_up(s->devs.dev);
    pthread_mutex_lock(&s->mu);
    int ask = s->conn.connected && s->state == GPUSHARE_STATE_IDLE && !s->requested && !gave_up;
    if (ask)
        s->requested = 1;
    pthread_mutex_unlock(&s->mu);
    if (ask)
        gs_conn_send_request(s);
}

static void handle_evict(struct gs_session *s)
{
    pthread_mutex_lock(&s->mu);
    int holding = s->state == GPUSHARE_STATE_HOLDING;
    pthread_mutex_unlock(&s->mu);
    uint64_t moved = 0, us = 0;
    int evicted = 0;
    /* The scheduler evicts only clients that do not hold the device; a holder's memory stays. */
    if (!holding)
        gs_drain_work(s, "the eviction", s->devs.dev, 1, 0, &evicted, &moved, &us);
    /* FLAG 0: the memory is still on the device; the scheduler must not count it as gone. */
    answer_move(s, GS_MSG_EVICTED, evicted, moved, us);
    char b[32];
    if (evicted)
        GS_INFO("evicted %s to the host in %.1f ms", gs_format_size(moved, b, sizeof b),
                us / 1000.0);
    else if (holding)
        GS_INFO("not evicted: this process holds the device");
    else
        GS_WARN("the eviction failed (%s moved): told the scheduler",
                gs_format_size(moved, b, sizeof b));
}

/* PRECOPY: copy resident memory to the host at low priority while it stays resident, so that a
 * later eviction is an unmap. The copy runs on the memory engine's own thread (this one must stay
 * free to answer a revoke); the answer says what is valid now, MEMORY reports the rest as it
 * completes. Any gated call after the copy started makes it stale (memory/move.c). */
static void handle_precopy(struct gs_session *s)
{
    pthread_mutex_lock(&s->mu);
    int waiting = s->waiters > 0;
    pthread_mutex_unlock(&s->mu);
    if (!waiting)
        gs_mem_precopy_async(s->devs.dev);
    struct gs_mem_totals t;
    gs_mem_totals_dev(s->devs.dev, &t);
    struct gs_writer w;
    gs_conn_begin(s, &w, GS_MSG_PRECOPIED);
    gs_w_u64(&w, GS_TAG_BYTES_MOVED, 0);
    gs_w_u64(&w, GS_TAG_MICROS, 0);
    gs_w_u64(&w, GS_TAG_PRECOPIED_BYTES, t.precopied);
    gs_conn_send(s, &w);
    GS_DEBUG("pre-copy %s", waiting ? "skipped: a thread waits for the device" : "started");
}

/* RESTORE_AHEAD: bring the evicted memory back while this process does not hold the device, so
 * that its turn starts warm. The gate stays as it is (closed: launches wait for a GRANT); the
 * answer is RESTORED with flag 1, what stayed on the host (no room on the device) and what is
 * clean (a restored block has no current host copy: memory/move.c). */
static void handle_restore_ahead(struct gs_session *s)
{
    pthread_mutex_lock(&s->mu);
    int holding = s->state == GPUSHARE_STATE_HOLDING, asleep = s->asleep;
    pthread_mutex_unlock(&s->mu);
    uint64_t moved = 0, us = 0;
    if (!holding && !asleep) /* a holder's grant restored it; a sleeper's process is locked */
        gs_drain_restore(s, "the restore ahead", s->devs.dev, &moved, &us);
    answer_move(s, GS_MSG_RESTORED, 1, moved, us);
    char b[32];
    GS_INFO("restored %s ahead of the grant in %.1f ms", gs_format_size(moved, b, sizeof b),
            us / 1000.0);
}

static void dispatch(struct gs_session *s, const struct gs_msg *m)
{
    char text[256];
    switch (m->type) {
    case GS_MSG_GRANT:
        handle_grant(s, gs_msg_u64(m, GS_TAG_FLAG, 0) != 0, m);
        break;
    case GS_MSG_REVOKE:
        gs_msg_str(m, GS_TAG_REASON, text, sizeof text);
        /* evict_bytes: a partial eviction (absent or 0: everything, as before the field). */
        gs_mem_set_evict_target(s->devs.dev, gs_msg_u64(m, GS_TAG_EVICT_BYTES, 0));
        gs_mem_set_evict_check(eviction_unneeded, s);
        gs_life_release(s, gs_msg_u64(m, GS_TAG_FLAG, 0) != 0, text, 1);
        gs_mem_set_evict_check(NULL, NULL);
        gs_mem_set_evict_target(s->devs.dev, 0); /* used, or not evicted: no later one has it */
        break;
    case GS_MSG_EVICT:
        gs_mem_set_evict_target(s->devs.dev, gs_msg_u64(m, GS_TAG_EVICT_BYTES, 0));
        gs_mem_set_evict_check(eviction_unneeded, s);
        handle_evict(s);
        gs_mem_set_evict_check(NULL, NULL);
        gs_mem_set_evict_target(s->devs.dev, 0);
        break;
    case GS_MSG_PRECOPY:
        handle_precopy(s);
        break;
    case GS_MSG_RESTORE_AHEAD:
        handle_restore_ahead(s);
        break;
    case GS_MSG_ROOM: {
        /* Only this thread changes the state: a holder's room is the grant's it holds now. One
         * that is not holding (it gave the device back as this crossed on the wire) drops it. */
        pthread_mutex_lock(&s->mu);
        int holding = s->state == GPUSHARE_STATE_HOLDING;
        pthread_mutex_unlock(&s->mu);
        if (holding)
            gs_mem_set_room(s->devs.dev, gs_msg_has(m, GS_TAG_ROOM_BYTES) ? gs_room_of(m) : 0);
        break;
    }
    case GS_MSG_STAGING: /* the node's host budget: this process's share for staging */
        gs_mem_set_staging_allowance(gs_msg_u64(m, GS_TAG_STAGING_BYTES, UINT64_MAX));
        break;
    case GS_MSG_SLEEP: {
        /* Only the status changes: the driver itself blocks this process's CUDA calls while it
         * is locked, and the scheduler grants nothing before it restored and unlocked it. */
        int asleep = gs_msg_u64(m, GS_TAG_FLAG, 0) != 0;
        pthread_mutex_lock(&s->mu);
        s->asleep = asleep;
        pthread_mutex_unlock(&s->mu);
        GS_INFO("%s", asleep ? "asleep: memory and context checkpointed to the host (deep idle)"
                             : "awake: restored from deep idle");
        break;
    }
    case GS_MSG_SET_QUOTA: {
        uint64_t q = gs_msg_u64(m, GS_TAG_QUOTA, 0);
        gs_mem_set_quota(s->devs.dev, q);
        char b[32];
        GS_INFO("quota set to %s", q ? gs_format_size(q, b, sizeof b) : "none");
        break;
    }
    case GS_MSG_WELCOME:
        gs_conn_apply_welcome(s, m);
        break;
    case GS_MSG_ERROR:
        gs_msg_str(m, GS_TAG_MESSAGE, text, sizeof text);
        GS_WARN("scheduler error %llu: %s", (unsigned long long)gs_msg_u64(m, GS_TAG_ERROR_CODE, 0),
                text);
        break;
    default:
        break; /* not for shims: ignore */
    }
}

/* Dispatch every complete frame in s->conn.rx. */
void gs_life_drain(struct gs_session *s)
{
    for (;;) {
        struct gs_msg m;
        size_t flen;
        int pr = gs_parse(s->conn.rx, s->conn.rx_len, &m, &flen);
        if (pr == GS_PARSE_MORE)
            return;
        if (pr == GS_PARSE_ERROR) {
            gs_conn_lost(s, "malformed frame from the scheduler");
            return;
        }
        /* Copy the frame out first: handlers may run for a while but never touch s->conn.rx. */
        dispatch(s, &m);
        if (s->conn.rx_len < flen) /* the connection was lost while dispatching */
            return;
        memmove(s->conn.rx, s->conn.rx + flen, s->conn.rx_len - flen);
        s->conn.rx_len -= flen;
    }
}

