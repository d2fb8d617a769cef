/*
 * The connection to the scheduler: who this process is (HELLO), framing on the socket, the
 * bounded handshake, reconnect back-off, and what losing the connection means (docs/reliability.md).
 *
 * The socket is written only by the thread that owns it (the starting thread during the first
 * HELLO, then the shim's thread); application threads never touch it.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "gpushare.h"
#include "session.h"


#define BACKOFF_MIN_S 0.1
#define BACKOFF_MAX_S 2.0

/* ---- identity ---- */

static void read_cmdline(char *out, size_t cap)
{
    out[0] = 0;
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, out, cap - 1);
    close(fd);
    if (n <= 0)
        return;
    /* Arguments are NUL-separated: join them with spaces. */
    while (n > 0 && out[n - 1] == 0)
        n--;
    for (ssize_t i = 0; i < n; i++)
        if (out[i] == 0)
            out[i] = ' ';
    out[n] = 0;
}

void gs_conn_gather_identity(struct gs_session *s)
{
    const char *v;
    if ((v = getenv("GPUSHARE_CLIENT_ID")) && *v)
        snprintf(s->id.client_id, sizeof s->id.client_id, "%s", v);
    else
        snprintf(s->id.client_id, sizeof s->id.client_id, "pid-%d", (int)getpid());
    if ((v = getenv("GPUSHARE_USER")) && *v) {
        snprintf(s->id.user, sizeof s->id.user, "%s", v);
    } else {
        struct passwd pw, *res = NULL;
        char buf[1024];
        if (getpwuid_r(getuid(), &pw, buf, sizeof buf, &res) == 0 && res)
            snprintf(s->id.user, sizeof s->id.user, "%s", res->pw_name);
        else
            snprintf(s->id.user, sizeof s->id.user, "uid-%u", (unsigned)getuid());
    }
    if ((v = getenv("GPUSHARE_USER_TOKEN")) && *v)
        snprintf(s->id.token, sizeof s->id.token, "%s", v);
    if ((v = getenv("GPUSHARE_KERNEL_SECRET")) && *v)
        snprintf(s->id.kernel_secret, sizeof s->id.kernel_secret, "%s", v);
    if ((v = getenv("GPUSHARE_LABEL")) && *v)
        snprintf(s->id.label, sizeof s->id.label, "%s", v);
    else
        read_cmdline(s->id.label, sizeof s->id.label);
    gs_socket_default_path(s->id.socket_path, sizeof s->id.socket_path);
}

static int send_all(int fd, const uint8_t *p, size_t n)
{
    double deadline = gs_now() + 1.0; /* a scheduler that stops reading must not stall us */
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int left = (int)((deadline - gs_now()) * 1000);
            if (left <= 0)
                return -1;
            struct pollfd pfd = {fd, POLLOUT, 0};
            poll(&pfd, 1, left);
            continue;
        }
        return -1;
    }
    return 0;
}

void gs_conn_begin(struct gs_session *s, struct gs_writer *w, uint8_t type)
{
    gs_w_begin(w, s->conn.tx, sizeof s->conn.tx, type);
}

void gs_conn_put_memory(struct gs_writer *w, const struct gs_mem_totals *t)
{
    gs_w_u64(w, GS_TAG_USED_BYTES, t->used);
    gs_w_u64(w, GS_TAG_MANAGED_BYTES, t->managed);
    gs_w_u64(w, GS_TAG_PINNED_BYTES, t->pinned);
    gs_w_u64(w, GS_TAG_EVICTED_BYTES, t->evicted);
    gs_w_u64(w, GS_TAG_PRECOPIED_BYTES, t->precopied);
    if (t->short_bytes) /* the room the driver lacked: the scheduler makes it before the grant */
        gs_w_u64(w, GS_TAG_SHORT_BYTES, t->short_bytes);
}

void gs_conn_put_host(struct gs_writer *w, const struct gs_mem_totals *t)
{
    gs_w_u64(w, GS_TAG_HOST_BYTES, t->host_bytes);
    gs_w_u64(w, GS_TAG_STAGING_BYTES, t->staging_resident);
}


int gs_conn_send_fd(int fd, struct gs_writer *w)
{
    size_t n = gs_w_finish(w);
    return n && fd >= 0 ? send_all(fd, w->buf, n) : -1;
}

void gs_conn_put_identity(const struct gs_session *s, struct gs_writer *w)
{
    gs_w_str(w, GS_TAG_USER, s->id.user);
    if (s->id.token[0])
        gs_w_str(w, GS_TAG_TOKEN, s->id.token);
    if (s->id.kernel_secret[0])
        gs_w_str(w, GS_TAG_KERNEL_SECRET, s->id.kernel_secret);
    gs_w_str(w, GS_TAG_LABEL, s->id.label);
    gs_w_u64(w, GS_TAG_CONTEXT_BYTES, gs_config()->context_bytes);
    gs_w_str(w, GS_TAG_VERSION, GS_VERSION);
}

/* Finish and send a frame on the current connection (thread side). */
int gs_conn_send(struct gs_session *s, struct gs_writer *w)
{
    size_t n = gs_w_finish(w);
    pthread_mutex_lock(&s->mu);
    int fd = s->conn.connected ? s->conn.fd : -1;
    pthread_mutex_unlock(&s->mu);
    if (fd < 0 || !n)
        return -1;
    if (send_all(fd, w->buf, n) != 0) {
        gs_conn_lost(s, "send failed");
        return -1;
    }
    return 0;
}

void gs_conn_send_memory(struct gs_session *s)
{
    struct gs_writer w;
    struct gs_mem_totals t;
    uint64_t gen = gs_mem_generation();
    gs_mem_totals_dev(s->devs.dev, &t);
    gs_conn_begin(s, &w, GS_MSG_MEMORY);
    gs_conn_put_memory(&w, &t);
    gs_conn_put_host(&w, &t);
    if (gs_conn_send(s, &w) == 0) {
        s->mem_report.gen_sent = gen;
        s->mem_report.sent = t;
        s->mem_report.sent_at = gs_now();
    }
}

int gs_conn_memory_differs(const struct gs_mem_report *r, const struct gs_mem_totals *t)
{
    return t->used != r->sent.used || t->managed != r->sent.managed ||
           t->pinned != r->sent.pinned || t->evicted != r->sent.evicted ||
           t->precopied != r->sent.precopied || t->host_bytes != r->sent.host_bytes ||
           t->staging_resident != r->sent.staging_resident;
}

void gs_conn_send_request(struct gs_session *s)
{
    struct gs_writer w;
    struct gs_mem_totals t;
    gs_mem_totals_dev(s->devs.dev, &t);
    gs_conn_begin(s, &w, GS_MSG_REQUEST);
    gs_conn_put_memory(&w, &t);
    gs_conn_put_host(&w, &t);
    gs_conn_send(s, &w);
    GS_DEBUG("requested the device");
}

int gs_conn_connect(struct gs_session *s, char *why, size_t whylen)
{
    int refused = 0;
    int fd = gs_socket_connect(s->id.socket_path, (int)(GS_CONNECT_TIMEOUT_S * 1000), &refused,
                               why, whylen);
    if (fd < 0 && refused && !s->conn.refused) {
        /* Loud, once: this is an attack or a misconfiguration, not an outage. It is also this
         * episode's warning: gs_conn_unreachable_locked does not say it again. */
        s->conn.refused = 1;
        s->conn.warned = 1;
        gs_log(GS_LOG_QUIET, "%s; running unshared, will keep trying", why);
    }
    return fd;
}

int gs_conn_probe(struct gs_session *s)
{
    char why[160];
    int fd = gs_conn_connect(s, why, sizeof why);
    if (fd < 0)
        return -1;
    uint8_t buf[256];
    struct gs_writer w;
    gs_w_begin(&w, buf, sizeof buf, GS_MSG_STATUS_REQUEST);
    gs_w_str(&w, GS_TAG_BODY, "{}");
    size_t n = gs_w_finish(&w);
    int alive = -1;
    if (n && send_all(fd, buf, n) == 0) {
        struct pollfd pfd = {fd, POLLIN, 0};
        char c;
        /* Any byte back is an answer: a scheduler that reads and writes is not hung. */
        if (poll(&pfd, 1, 1000) == 1 && recv(fd, &c, 1, 0) == 1)
            alive = 0;
    }
    close(fd);
    return alive;
}

static void apply_welcome_memory(CUdevice dev, const struct gs_msg *m)
{
    if (gs_msg_has(m, GS_TAG_POOL_BYTES))
        gs_mem_set_pool(dev, m->u64[GS_TAG_POOL_BYTES]);
    if (gs_msg_has(m, GS_TAG_QUOTA))
        gs_mem_set_quota(dev, m->u64[GS_TAG_QUOTA]);
}

void gs_conn_apply_welcome(struct gs_session *s, const struct gs_msg *m)
{
    apply_welcome_memory(s->devs.dev, m);
    pthread_mutex_lock(&s->mu);
    s->quantum_ms = gs_msg_u64(m, GS_TAG_QUANTUM_MS, s->quantum_ms);
    pthread_mutex_unlock(&s->mu);
}

int gs_conn_await_welcome(struct gs_session *s, CUdevice link_dev, int fd, uint8_t *rx,
                          size_t cap, size_t *rx_len, double deadline, char *why, size_t whylen)
{
    for (;;) {
        struct gs_msg m;
        size_t flen;
        int pr = gs_parse(rx, *rx_len, &m, &flen);
        if (pr == GS_PARSE_ERROR) {
            snprintf(why, whylen, "malformed answer");
            break;
        }
        if (pr == GS_PARSE_OK) {
            int type = m.type;
            if (type == GS_MSG_WELCOME && s) {
                gs_conn_apply_welcome(s, &m);
                pthread_mutex_lock(&s->mu);
                if (s->resume.mode == GS_RESUME_HOLDING && gs_msg_u64(&m, GS_TAG_RESUME, 0) != 1)
                    s->resume.mode = 0; /* the scheduler did not give the grant back */
                pthread_mutex_unlock(&s->mu);
            }
            else if (type == GS_MSG_WELCOME) {
                apply_welcome_memory(link_dev, &m); /* a link's: its device's pool and quota */
            } else if (type == GS_MSG_ERROR) {
                char msg[128];
                gs_msg_str(&m, GS_TAG_MESSAGE, msg, sizeof msg);
                snprintf(why, whylen, "refused: %s", msg);
            }
            memmove(rx, rx + flen, *rx_len - flen);
            *rx_len -= flen;
            if (type == GS_MSG_WELCOME)
                return 0;
            if (type == GS_MSG_ERROR)
                break;
            continue;
        }
        int left = (int)((deadline - gs_now()) * 1000);
        if (left <= 0) {
            snprintf(why, whylen, "no answer to HELLO within %d ms", (int)(GS_CONNECT_TIMEOUT_S * 1000));
            break;
        }
        struct pollfd pfd = {fd, POLLIN, 0};
        if (poll(&pfd, 1, left) <= 0)
            continue;
        ssize_t r = recv(fd, rx + *rx_len, cap - *rx_len, 0);
        if (r == 0) {
            snprintf(why, whylen, "connection closed");
            break;
        }
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            snprintf(why, whylen, "%s", strerror(errno));
            break;
        }
        *rx_len += (size_t)r;
    }
    return -1;
}

/* Connect, say HELLO and wait for WELCOME (bounded). Returns the fd, or -1 with `why` set. */
int gs_conn_handshake(struct gs_session *s, char *why, size_t whylen)
{
    int fd = gs_conn_connect(s, why, whylen);
    if (fd < 0)
        return -1;
    double deadline = gs_now() + GS_CONNECT_TIMEOUT_S;
    const struct gs_config *cfg = gs_config();
    struct gs_writer w;
    gs_conn_begin(s, &w, GS_MSG_HELLO);
    gs_w_str(&w, GS_TAG_CLIENT_ID, s->id.client_id);
    gs_w_u64(&w, GS_TAG_PID, (uint64_t)getpid());
    gs_w_str(&w, GS_TAG_DEVICE_UUID, s->devs.uuid);
    gs_w_str(&w, GS_TAG_DEVICE_NAME, s->devs.name);
    gs_w_u64(&w, GS_TAG_DEVICE_TOTAL, s->devs.total);
    struct gs_mem_totals mem;
    gs_mem_totals_dev(s->devs.dev, &mem);
    pthread_mutex_lock(&s->mu);
    int reconnect = s->started && s->thread_running;
    int resume = s->resume.mode;
    if (resume == GS_RESUME_WAITING && s->waiters == 0)
        resume = 0; /* the call that waited was interrupted meanwhile */
    double since = s->resume.since;
    double gpu = s->stats.holding_seconds;
    pthread_mutex_unlock(&s->mu);
    /* A reconnect keeps the quota in force (an operator may have changed it) and tells the new
     * scheduler what this process holds, so that its state equals the one the old one had. */
    gs_w_u64(&w, GS_TAG_QUOTA, reconnect ? mem.quota : cfg->quota);
    gs_w_u64(&w, GS_TAG_WEIGHT_MILLI, cfg->weight_milli);
    if (reconnect) {
        gs_conn_put_memory(&w, &mem);
        gs_conn_put_host(&w, &mem);
        gs_w_u64(&w, GS_TAG_RESUME, (uint64_t)resume);
        gs_w_u64(&w, GS_TAG_SINCE_MS, resume ? (uint64_t)(gs_ms(gs_now() - since) + 0.5) : 0);
        gs_w_u64(&w, GS_TAG_GPU_MS, (uint64_t)(gs_ms(gpu) + 0.5));
        /* The proof that this is the process the old scheduler granted. */
        if (resume == GS_RESUME_HOLDING && s->resume.secret[0])
            gs_w_str(&w, GS_TAG_RESUME_SECRET, s->resume.secret);
    }
    gs_conn_put_identity(s, &w);
    size_t n = gs_w_finish(&w);
    if (!n || send_all(fd, s->conn.tx, n) != 0) {
        snprintf(why, whylen, "sending HELLO failed");
        close(fd);
        return -1;
    }
    s->conn.rx_len = 0;
    if (gs_conn_await_welcome(s, 0, fd, s->conn.rx, sizeof s->conn.rx, &s->conn.rx_len, deadline, why,
                      whylen) == 0)
        return fd; /* anything after it stays in s->conn.rx for the thread */
    close(fd);
    s->conn.rx_len = 0;
    return -1;
}

static void schedule_retry_locked(struct gs_session *s)
{
    s->conn.backoff = s->conn.backoff <= 0 ? BACKOFF_MIN_S : s->conn.backoff * 2;
    if (s->conn.backoff > BACKOFF_MAX_S)
        s->conn.backoff = BACKOFF_MAX_S;
    s->conn.next_connect_at = gs_now() + s->conn.backoff;
}

void gs_conn_unreachable_locked(struct gs_session *s, const char *why, int lost)
{
    if (!s->conn.warned) {
        s->conn.warned = 1;
        GS_WARN("%s %s (%s); running unshared, will keep trying",
                lost ? "lost the scheduler at" : "scheduler not reachable at", s->id.socket_path, why);
    } else {
        GS_DEBUG("scheduler still not reachable at %s (%s)", s->id.socket_path, why);
    }
    schedule_retry_locked(s);
}

/* A fresh connection: the gate closes, so the next call asks for the device. */
void gs_conn_connected_locked(struct gs_session *s, int fd, int reconnect)
{
    s->conn.fd = fd;
    s->conn.connected = 1;
    s->conn.last_rx = gs_now();
    s->requested = 0;
    s->conn.backoff = 0;
    if (s->conn.warned || reconnect)
        GS_INFO("connected to the scheduler at %s", s->id.socket_path);
    s->conn.warned = 0;
    s->mem_report.gen_sent = (uint64_t)-1;
    s->idle_sent = 0; /* a new scheduler must hear it too: an idle holder is revoked at once */
    s->resume.unshare_at = 0;
    if (s->resume.mode == GS_RESUME_HOLDING) {
        /* The new scheduler gave the grant back (WELCOME resume = 1): keep running. */
        s->stats.hold_since = gs_now();
        GS_INFO("kept the device across the scheduler's restart");
        gs_session_set_state_locked(s, GPUSHARE_STATE_HOLDING);
    } else {
        gs_session_set_state_locked(s, GPUSHARE_STATE_IDLE);
        gs_mem_defer_backing(s->devs.dev); /* what it allocates before its grant: backed then */
    }
    s->resume.mode = 0;
    if (s->waiters > 0 && s->state != GPUSHARE_STATE_HOLDING)
        s->want_request = 1;
}

void gs_conn_lost(struct gs_session *s, const char *why)
{
    pthread_mutex_lock(&s->mu);
    if (!s->conn.connected) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    close(s->conn.fd);
    s->conn.fd = -1;
    s->conn.connected = 0;
    s->requested = 0;
    s->conn.rx_len = 0;
    int was_holding = s->state == GPUSHARE_STATE_HOLDING;
    if (was_holding)
        s->stats.holding_seconds += gs_now() - s->stats.hold_since;
    if (!s->quitting) {
        /* The holder runs on (unshared) and asks for its grant back when the scheduler returns.
         * Others keep waiting for it, at most GPUSHARE_RECONNECT_WAIT seconds, then run unshared
         * rather than block the program on a scheduler that is gone (docs/reliability.md). */
        double wait = gs_config()->reconnect_wait;
        if (was_holding) {
            s->resume.mode = GS_RESUME_HOLDING;
            s->resume.since = s->stats.hold_since;
        } else if (s->waiters > 0) {
            s->resume.mode = GS_RESUME_WAITING;
            s->resume.since = s->stats.wait_began;
        } else {
            s->resume.mode = 0;
        }
        if (was_holding || s->state == GPUSHARE_STATE_UNSHARED) {
            gs_session_set_state_locked(s, GPUSHARE_STATE_UNSHARED);
        } else {
            /* Even with no wait, the shim's thread opens the gate (thread.c): memory allocated
             * while waiting is backed first. */
            s->resume.unshare_at = gs_now() + (wait > 0 ? wait : 0);
            gs_session_set_state_locked(s, GPUSHARE_STATE_IDLE);
        }
        gs_conn_unreachable_locked(s, why, 1);
    }
    pthread_mutex_unlock(&s->mu);

    /* The holder runs on unshared: memory it had evicted (a later device's, revoked while the
     * first was held, included) would come back page by page on demand, or not at all for
     * explicit memory, so bring it back in bulk. A waiter's stays on the host: another kernel may
     * hold the GPU (thread.c restores it, within the card's free memory, once the waiter runs
     * unshared). */
    if (!s->quitting && was_holding)
        gs_drain_restore_every_device(s, "the restore after losing the scheduler");
}
