/*
 * The devices a process uses after its first (docs/protocol.md, "Several devices"). Each has its
 * own connection to the scheduler under the client id `<id>/<ordinal>`, so the process is a
 * client of that device's pool as well: it waits in that device's queue, holds that device for
 * that device's quantum, and a revoke of that device drains that device's contexts only. Each
 * link reports, evicts, restores and pre-copies its own device's memory (the memory engine keeps
 * an account per device), and its quota and pool are that device's. The first device keeps the
 * session's own connection (conn.c, lifecycle.c), which carries the idle detector and the
 * reconnect policy; a link follows it (it connects again once that connection is back). Runs on
 * the shim's thread, except what the gate's slow path reads under s->mu.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "session.h"

/* A link that cannot connect while the first device's connection is up tries this often, this
 * many times, then its device runs unshared (a scheduler that refuses it will not change). */
#define LINK_RETRY_S 0.2
#define LINK_MAX_TRIES 5

/* Send one frame on the link of `dev` (outside the lock: the socket is the thread's). */
static void send_frame(struct gs_session *s, CUdevice dev, struct gs_writer *w)
{
    pthread_mutex_lock(&s->mu);
    struct gs_link *l = gs_session_link_locked(s, dev);
    int fd = l ? l->fd : -1;
    pthread_mutex_unlock(&s->mu);
    if (gs_conn_send_fd(fd, w) != 0 && fd >= 0)
        GS_WARN("device %d: sending to the scheduler failed", (int)dev);
}

/* RELEASED, EVICTED, RESTORED or PRECOPIED for a link, with what moved and its device's memory
 * as it is now (flag: RELEASED and EVICTED, 1 = evicted). */
static void answer(struct gs_session *s, CUdevice dev, uint8_t type, int flag, uint64_t moved,
                   uint64_t us)
{
    struct gs_mem_totals t;
    gs_mem_totals_dev(dev, &t);
    uint8_t buf[128];
    struct gs_writer w;
    gs_w_begin(&w, buf, sizeof buf, type);
    if (type == GS_MSG_RELEASED || type == GS_MSG_EVICTED || type == GS_MSG_RESTORED)
        gs_w_u64(&w, GS_TAG_FLAG, (uint64_t)flag); /* RESTORED: 1 answers a RESTORE_AHEAD */
    if (type == GS_MSG_PRECOPIED || type == GS_MSG_RESTORED)
        gs_w_u64(&w, GS_TAG_PRECOPIED_BYTES, t.precopied);
    gs_w_u64(&w, GS_TAG_EVICTED_BYTES, t.evicted);
    gs_w_u64(&w, GS_TAG_BYTES_MOVED, moved);
    gs_w_u64(&w, GS_TAG_MICROS, us);
    send_frame(s, dev, &w);
}

static void set_state(struct gs_session *s, CUdevice dev, int state)
{
    pthread_mutex_lock(&s->mu);
    struct gs_link *l = gs_session_link_locked(s, dev);
    if (l) {
        l->state = state;
        if (state != GS_LINK_IDLE)
            l->requested = 0;
        gs_session_regate_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
}

/* The link is gone (a scheduler restart, usually): it connects again once the first device's
 * connection is back, and meanwhile calls on its device wait like the first device's waiters do
 * (they pass once the session runs unshared: docs/reliability.md). */
static void link_lost(struct gs_session *s, CUdevice dev, const char *why)
{
    pthread_mutex_lock(&s->mu);
    struct gs_link *l = gs_session_link_locked(s, dev);
    if (l && l->fd >= 0) {
        close(l->fd);
        l->fd = -1;
        l->rx_len = 0;
        l->requested = 0;
        l->tries = 0;
        l->next_connect_at = gs_now() + LINK_RETRY_S;
        l->state = s->quitting ? GS_LINK_UNSHARED : GS_LINK_CONNECTING;
        gs_session_regate_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
    GS_INFO("device %d: lost the scheduler (%s); connecting again", (int)dev, why);
}

/* HELLO for a device after the first (docs/protocol.md, "Several devices"): its own client id and
 * that device's identity. Its memory follows in MEMORY (memory in a HELLO says "resume"). */
static int handshake(struct gs_session *s, CUdevice dev, uint8_t *rx, size_t cap,
                     size_t *rx_len, char *why, size_t whylen)
{
    int fd = gs_conn_connect(s, why, whylen);
    if (fd < 0)
        return -1;
    double deadline = gs_now() + GS_CONNECT_TIMEOUT_S;
    const struct gs_config *cfg = gs_config();
    char id[sizeof s->id.client_id + 16], uuid[48] = "", name[256] = "";
    uint64_t total = 0;
    snprintf(id, sizeof id, "%s/%d", s->id.client_id, (int)dev);
    gs_device_describe(dev, uuid, sizeof uuid, name, sizeof name, &total);
    uint8_t buf[4096];
    struct gs_writer w;
    gs_w_begin(&w, buf, sizeof buf, GS_MSG_HELLO);
    gs_w_str(&w, GS_TAG_CLIENT_ID, id);
    gs_w_u64(&w, GS_TAG_PID, (uint64_t)getpid());
    gs_w_str(&w, GS_TAG_DEVICE_UUID, uuid);
    gs_w_str(&w, GS_TAG_DEVICE_NAME, name);
    gs_w_u64(&w, GS_TAG_DEVICE_TOTAL, total);
    gs_w_u64(&w, GS_TAG_QUOTA, cfg->quota);
    gs_w_u64(&w, GS_TAG_WEIGHT_MILLI, cfg->weight_milli);
    gs_conn_put_identity(s, &w);
    if (gs_conn_send_fd(fd, &w) != 0) {
        snprintf(why, whylen, "sending HELLO failed");
        close(fd);
        return -1;
    }
    *rx_len = 0;
    if (gs_conn_await_welcome(NULL, dev, fd, rx, cap, rx_len, deadline, why, whylen) == 0)
        return fd;
    close(fd);
    return -1;
}

void gs_link_open_new(struct gs_session *s)
{
    CUdevice todo[GS_MAX_LINKS];
    int n = 0;
    double now = gs_now();
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->links.n && s->conn.connected && !s->quitting; i++)
        if (s->links.l[i].state == GS_LINK_CONNECTING && now >= s->links.l[i].next_connect_at)
            todo[n++] = s->links.l[i].dev;
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < n; i++) {
        static struct gs_link fresh; /* thread side only: the handshake fills its rx */
        char why[160] = "";
        int fd = handshake(s, todo[i], fresh.rx, sizeof fresh.rx, &fresh.rx_len, why, sizeof why);
        pthread_mutex_lock(&s->mu);
        struct gs_link *l = gs_session_link_locked(s, todo[i]);
        int gave_up = 0;
        if (l && fd >= 0 && !s->quitting) {
            l->fd = fd;
            memcpy(l->rx, fresh.rx, fresh.rx_len);
            l->rx_len = fresh.rx_len;
            l->state = GS_LINK_IDLE;
            l->tries = 0;
            /* Nothing reported yet: the thread's next pass sends this device's MEMORY. */
            l->mem_report = (struct gs_mem_report){gs_mem_generation() - 1, {0}, 0};
        } else {
            if (fd >= 0)
                close(fd);
            if (l && (s->quitting || ++l->tries >= LINK_MAX_TRIES)) {
                gave_up = 1; /* unshared once its memory is back (below) */
            } else if (l) {
                l->next_connect_at = gs_now() + LINK_RETRY_S * l->tries;
            }
        }
        gs_session_regate_locked(s);
        pthread_mutex_unlock(&s->mu);
        if (fd >= 0)
            GS_DEBUG("device %d registered with the scheduler as %s/%d", (int)todo[i],
                     s->id.client_id, (int)todo[i]);
        else if (gave_up)
            GS_WARN("device %d: cannot register with the scheduler (%s); it runs unshared",
                    (int)todo[i], why);
        if (gave_up) {
            /* Its calls pass from now on: memory evicted or left unbacked while it waited must be
             * on the device first. */
            uint64_t moved, us;
            gs_mem_back_deferred(todo[i]);
            gs_drain_restore(s, "the restore of a device that runs unshared", todo[i], &moved, &us);
            set_state(s, todo[i], GS_LINK_UNSHARED);
        }
    }
}

/* REQUEST with this device's memory. */
static void send_request(struct gs_session *s, CUdevice dev)
{
    uint8_t buf[256];
    struct gs_writer w;
    struct gs_mem_totals t;
    gs_mem_totals_dev(dev, &t);
    gs_w_begin(&w, buf, sizeof buf, GS_MSG_REQUEST);
    gs_conn_put_memory(&w, &t);
    send_frame(s, dev, &w);
    GS_DEBUG("requested device %d", (int)dev);
}

void gs_link_send_requests(struct gs_session *s)
{
    CUdevice todo[GS_MAX_LINKS];
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->links.n; i++) {
        struct gs_link *l = &s->links.l[i];
        if (l->want_request && l->state == GS_LINK_IDLE && !l->requested && l->waiters > 0) {
            l->requested = 1;
            todo[n++] = l->dev;
        }
        l->want_request = 0;
    }
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < n; i++)
        send_request(s, todo[i]);
}

int gs_link_pollfds(struct gs_session *s, struct pollfd *pfd, int cap, CUdevice *devs)
{
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->links.n && n < cap; i++)
        if (s->links.l[i].fd >= 0) {
            pfd[n] = (struct pollfd){s->links.l[i].fd, POLLIN, 0};
            devs[n++] = s->links.l[i].dev;
        }
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* REVOKE: close the gate, wait for the calls inside the driver, then for this device's work, and
 * (flag 1) move this device's memory to the host; the other devices' work and memory are not
 * touched. */
static void release(struct gs_session *s, CUdevice dev, int evict, const char *reason)
{
    pthread_mutex_lock(&s->mu);
    struct gs_link *l = gs_session_link_locked(s, dev);
    int holding = l && l->state == GS_LINK_HOLDING;
    if (holding) {
        l->state = GS_LINK_RELEASING;
        gs_session_regate_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
    if (!holding) { /* crossed on the wire with nothing to give back (lifecycle.c says why) */
        GS_DEBUG("device %d: ignored a revoke (%s): not holding it", (int)dev, reason);
        return;
    }
    double t0 = gs_now();
    int stuck = gs_gate_drain(GS_DRAIN_WAIT_S);
    if (stuck)
        GS_INFO("device %d: %d call(s) still inside the driver after %.0f s: going on", (int)dev,
                stuck, GS_DRAIN_WAIT_S);
    uint64_t moved = 0, us = 0;
    int evicted = 0;
    gs_drain_work(s, "the release", dev, evict, 0, &evicted, &moved, &us);
    if (evict && !evicted)
        GS_WARN("device %d: the eviction failed: the scheduler keeps counting its memory there",
                (int)dev);
    answer(s, dev, GS_MSG_RELEASED, evicted, moved, us);
    char b[32];
    GS_INFO("device %d revoked (%s): released after %.1f ms, evicted %s in %.1f ms", (int)dev,
            reason, gs_ms(gs_now() - t0), gs_format_size(moved, b, sizeof b), us / 1000.0);
    pthread_mutex_lock(&s->mu);
    int again = 0;
    if ((l = gs_session_link_locked(s, dev)) && l->state == GS_LINK_RELEASING) {
        gs_mem_defer_backing(dev); /* a waiter's new memory is never made resident, never evicted */
        l->state = GS_LINK_IDLE;
        /* Calls that blocked meanwhile still want it, unless they are to fail (lifecycle.c). */
        l->requested = again = l->waiters > 0 && !gs_mem_hopeless(dev);
        gs_session_regate_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
    if (again)
        send_request(s, dev);
}

void gs_link_wait_for_room(struct gs_session *s)
{
    unsigned past = gs_mem_past_room();
    CUdevice todo[GS_MAX_LINKS];
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; past && i < s->links.n; i++) {
        struct gs_link *l = &s->links.l[i];
        if ((past >> gs_mem_slot(l->dev) & 1u) && l->state == GS_LINK_HOLDING && !s->quitting)
            todo[n++] = l->dev;
    }
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < n; i++) {
        release(s, todo[i], 0, "memory past the grant's room: waiting for room");
        /* Given up for now (memory/defer.c): the program's next call there asks again. */
        int gave_up = gs_mem_take_given_up(todo[i]);
        pthread_mutex_lock(&s->mu);
        struct gs_link *l = gs_session_link_locked(s, todo[i]);
        int ask = l && l->state == GS_LINK_IDLE && !l->requested && !gave_up;
        if (ask)
            l->requested = 1;
        pthread_mutex_unlock(&s->mu);
        if (ask)
            send_request(s, todo[i]);
    }
}

/* GRANT (flag 1: bring this device's evicted memory back, in its own context, first). */
static void grant(struct gs_session *s, CUdevice dev, int restore, const struct gs_msg *m)
{
    /* Its room (absent: no limit), before what waited is backed (lifecycle.c says why). */
    gs_mem_set_room(dev, gs_msg_has(m, GS_TAG_ROOM_BYTES) ? gs_room_of(m) : 0);
    if (restore) {
        uint64_t moved = 0, us = 0;
        gs_drain_restore(s, "the restore", dev, &moved, &us);
        answer(s, dev, GS_MSG_RESTORED, 0, moved, us);
        char b[32];
        GS_INFO("device %d: restored %s in %.1f ms", (int)dev,
                gs_format_size(moved, b, sizeof b), us / 1000.0);
    }
    gs_mem_back_granted(dev); /* before the gate opens: what waited gets backed */
    set_state(s, dev, GS_LINK_HOLDING);
    GS_INFO("granted device %d", (int)dev);
}

/* EVICT (the scheduler evicts a device's memory only while the process does not hold it) and
 * PRECOPY (in the background, unless a call waits for the device). */
static void evict_or_precopy(struct gs_session *s, CUdevice dev, int evict)
{
    pthread_mutex_lock(&s->mu);
    struct gs_link *l = gs_session_link_locked(s, dev);
    int holding = l && l->state == GS_LINK_HOLDING, waiting = l && l->waiters > 0;
    pthread_mutex_unlock(&s->mu);
    uint64_t moved = 0, us = 0;
    int evicted = 0;
    if (evict && !holding)
        gs_drain_work(s, "the eviction", dev, 1, 0, &evicted, &moved, &us);
    else if (!evict && !waiting)
        gs_mem_precopy_async(dev);
    answer(s, dev, evict ? GS_MSG_EVICTED : GS_MSG_PRECOPIED, evicted, moved, us);
    char b[32];
    if (evicted)
        GS_INFO("device %d: evicted %s to the host in %.1f ms", (int)dev,
                gs_format_size(moved, b, sizeof b), us / 1000.0);
}

/* RESTORE_AHEAD (lifecycle.c says what): this device's evicted memory back; its gate is left as
 * it is, so launches on it wait for the GRANT. */
static void restore_ahead(struct gs_session *s, CUdevice dev)
{
    pthread_mutex_lock(&s->mu);
    struct gs_link *l = gs_session_link_locked(s, dev);
    int holding = l && l->state == GS_LINK_HOLDING;
    pthread_mutex_unlock(&s->mu);
    uint64_t moved = 0, us = 0;
    if (!holding)
        gs_drain_restore(s, "the restore ahead", dev, &moved, &us);
    answer(s, dev, GS_MSG_RESTORED, 1, moved, us);
}

static void dispatch(struct gs_session *s, CUdevice dev, const struct gs_msg *m)
{
    char text[256] = "";
    switch (m->type) {
    case GS_MSG_GRANT:
        grant(s, dev, gs_msg_u64(m, GS_TAG_FLAG, 0) != 0, m);
        break;
    case GS_MSG_REVOKE:
        gs_msg_str(m, GS_TAG_REASON, text, sizeof text);
        gs_mem_set_evict_target(dev, gs_msg_u64(m, GS_TAG_EVICT_BYTES, 0)); /* 0: everything */
        release(s, dev, gs_msg_u64(m, GS_TAG_FLAG, 0) != 0, text[0] ? text : "no reason");
        gs_mem_set_evict_target(dev, 0);
        break;
    case GS_MSG_EVICT:
    case GS_MSG_PRECOPY:
        gs_mem_set_evict_target(dev, gs_msg_u64(m, GS_TAG_EVICT_BYTES, 0));
        evict_or_precopy(s, dev, m->type == GS_MSG_EVICT);
        gs_mem_set_evict_target(dev, 0);
        break;
    case GS_MSG_ROOM: { /* as on the first device (lifecycle.c): a holder's only */
        pthread_mutex_lock(&s->mu);
        struct gs_link *l = gs_session_link_locked(s, dev);
        int holding = l && l->state == GS_LINK_HOLDING;
        pthread_mutex_unlock(&s->mu);
        if (holding)
            gs_mem_set_room(dev, gs_msg_has(m, GS_TAG_ROOM_BYTES) ? gs_room_of(m) : 0);
        break;
    }
    case GS_MSG_RESTORE_AHEAD:
        restore_ahead(s, dev);
        break;
    case GS_MSG_SET_QUOTA:
        gs_mem_set_quota(dev, gs_msg_u64(m, GS_TAG_QUOTA, 0)); /* this device's registration's */
        break;
    case GS_MSG_ERROR:
        gs_msg_str(m, GS_TAG_MESSAGE, text, sizeof text);
        GS_WARN("device %d: scheduler error %llu: %s", (int)dev,
                (unsigned long long)gs_msg_u64(m, GS_TAG_ERROR_CODE, 0), text);
        break;
    default:
        break;
    }
}

void gs_link_on_readable(struct gs_session *s, CUdevice dev)
{
    static struct gs_link in; /* thread side only: frames are handled outside the lock */
    pthread_mutex_lock(&s->mu);
    struct gs_link *l = gs_session_link_locked(s, dev);
    int fd = l ? l->fd : -1;
    if (l) {
        memcpy(in.rx, l->rx, l->rx_len);
        in.rx_len = l->rx_len;
    }
    pthread_mutex_unlock(&s->mu);
    if (fd < 0)
        return;
    ssize_t r = recv(fd, in.rx + in.rx_len, sizeof in.rx - in.rx_len, 0);
    if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) {
        link_lost(s, dev, r == 0 ? "the scheduler closed the connection" : strerror(errno));
        return;
    }
    in.rx_len += r > 0 ? (size_t)r : 0;
    for (;;) {
        struct gs_msg m;
        size_t flen;
        int pr = gs_parse(in.rx, in.rx_len, &m, &flen);
        if (pr == GS_PARSE_MORE)
            break;
        if (pr == GS_PARSE_ERROR) {
            link_lost(s, dev, "malformed frame from the scheduler");
            return;
        }
        dispatch(s, dev, &m);
        memmove(in.rx, in.rx + flen, in.rx_len - flen);
        in.rx_len -= flen;
    }
    pthread_mutex_lock(&s->mu);
    if ((l = gs_session_link_locked(s, dev)) && l->fd == fd) {
        memcpy(l->rx, in.rx, in.rx_len);
        l->rx_len = in.rx_len;
    }
    pthread_mutex_unlock(&s->mu);
}

void gs_link_release_all(struct gs_session *s, const char *reason)
{
    CUdevice devs[GS_MAX_LINKS];
    struct pollfd pfd[GS_MAX_LINKS];
    int n = gs_link_pollfds(s, pfd, GS_MAX_LINKS, devs);
    for (int i = 0; i < n; i++)
        release(s, devs[i], 0, reason); /* only those it holds */
}

int gs_link_report_memory(struct gs_session *s, double now, double min_interval)
{
    CUdevice devs[GS_MAX_LINKS];
    struct pollfd pfd[GS_MAX_LINKS];
    int n = gs_link_pollfds(s, pfd, GS_MAX_LINKS, devs), later = 0;
    uint64_t gen = gs_mem_generation();
    for (int i = 0; i < n; i++) {
        pthread_mutex_lock(&s->mu);
        struct gs_link *l = gs_session_link_locked(s, devs[i]);
        struct gs_mem_report r = l ? l->mem_report : (struct gs_mem_report){gen, {0}, now};
        pthread_mutex_unlock(&s->mu);
        if (r.gen_sent == gen)
            continue;
        struct gs_mem_totals t;
        gs_mem_totals_dev(devs[i], &t);
        int send = gs_conn_memory_differs(&r, &t) && now - r.sent_at >= min_interval;
        later |= gs_conn_memory_differs(&r, &t) && !send;
        if (send) {
            uint8_t buf[256];
            struct gs_writer w;
            gs_w_begin(&w, buf, sizeof buf, GS_MSG_MEMORY);
            gs_conn_put_memory(&w, &t);
            send_frame(s, devs[i], &w);
            r = (struct gs_mem_report){gen, t, now};
        } else if (!gs_conn_memory_differs(&r, &t)) {
            r.gen_sent = gen; /* nothing the scheduler would see */
        }
        pthread_mutex_lock(&s->mu);
        if ((l = gs_session_link_locked(s, devs[i])) && l->fd == pfd[i].fd)
            l->mem_report = r;
        pthread_mutex_unlock(&s->mu);
    }
    return later;
}

void gs_link_close_all(struct gs_session *s, int goodbye)
{
    CUdevice devs[GS_MAX_LINKS];
    struct pollfd pfd[GS_MAX_LINKS];
    int n = gs_link_pollfds(s, pfd, GS_MAX_LINKS, devs);
    for (int i = 0; i < n; i++) {
        if (goodbye) {
            uint8_t buf[64];
            struct gs_writer w;
            gs_w_begin(&w, buf, sizeof buf, GS_MSG_GOODBYE);
            gs_conn_send_fd(pfd[i].fd, &w);
        }
        pthread_mutex_lock(&s->mu);
        struct gs_link *l = gs_session_link_locked(s, devs[i]);
        if (l && l->fd == pfd[i].fd) {
            close(l->fd);
            l->fd = -1;
        }
        pthread_mutex_unlock(&s->mu);
    }
}
