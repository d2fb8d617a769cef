/*
 * The scheduler connection and the state the gate waits on.
 *
 * The client starts when the process first gets a CUDA context (so `ls` or nvidia-smi under the
 * shim never register): it connects and says HELLO synchronously (at most ~500 ms), then hands the
 * socket to a background thread that owns all further socket I/O: grants, revokes, evictions,
 * coalesced MEMORY reports, the idle detector, reconnects, and the GOODBYE at exit.
 *
 * Application threads never touch the socket. A gated call that needs the device sets a flag and
 * wakes the thread through a pipe; the thread sends REQUEST; the GRANT handler opens the gate and
 * broadcasts the condition variable the callers wait on. All state below is under C.mu; the gate
 * word itself is an atomic the fast path reads without the lock.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "gpushare.h"
#include "protocol.h"
#include "shim.h"

#define CONNECT_TIMEOUT_S 0.5
#define BACKOFF_MIN_S 0.1
#define BACKOFF_MAX_S 2.0
#define MEMORY_REPORT_MIN_S 0.05
#define WAIT_SLICE_NS 20000000L /* 20 ms: how quickly a waiter notices SIGINT */
#define QUIT_WAIT_MS 5000
#define RESUME_HOLDING 1
#define RESUME_WAITING 2

static struct client {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state;          /* enum gpushare_state; never WAITING (that is IDLE with waiters) */
    int started;        /* the client was started (or is starting) in this process */
    int thread_running;
    int connected;
    int fd;
    int requested;      /* a REQUEST is outstanding (no GRANT yet) */
    int want_request;   /* a waiter asks the thread to send REQUEST */
    int want_release;   /* gpushare_release() asks the thread to release */
    int waiters;
    int quitting;       /* GOODBYE said or being said: gate open for good, no reconnects */
    int warned;         /* the "not reachable" line was printed for this outage */
    CUcontext ctx;
    CUdevice dev;
    int ctx_is_primary;
    char client_id[128];
    char socket_path[108];
    char device_uuid[48];
    char device_name[256];
    char user[128];
    char token[160]; /* GPUSHARE_USER_TOKEN: proves `user` where many users share a uid */
    char label[1024];
    uint64_t device_total;
    uint64_t quantum_ms;
    /* statistics */
    uint64_t waits;
    double wait_seconds, wait_began, holding_seconds, hold_since;
    /* thread-side bookkeeping */
    double last_activity;
    int idle_sent;
    uint64_t mem_gen_sent;
    struct gs_mem_totals mem_sent;
    double mem_sent_at;
    double next_connect_at, backoff;
    /* Losing the scheduler (docs/reliability.md): what to say when it comes back, and when a
     * non-holder stops waiting for it and runs unshared. */
    int resume;          /* RESUME_HOLDING or RESUME_WAITING: said in the next HELLO */
    double resume_since; /* when that grant or that wait began */
    double unshare_at;   /* > 0: the gate stays closed until then, waiting for the scheduler */
    /* socket buffers: used only by whoever does the socket I/O (start, then the thread) */
    uint8_t rx[GS_PROTO_HEADER + GS_PROTO_MAX_PAYLOAD + 4096];
    size_t rx_len;
    uint8_t tx[8192];
} C = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .fd = -1,
};

static int wake_pipe[2] = {-1, -1};
static int done_pipe[2] = {-1, -1};
static atomic_int wake_pending;
static atomic_int quit_requested;
static pthread_once_t cv_once = PTHREAD_ONCE_INIT;
static int atexit_registered, atfork_registered;

static void init_cv(void)
{
    /* CLOCK_MONOTONIC: the 20 ms wait slices must not jump with the wall clock. */
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&C.cv, &a);
    pthread_condattr_destroy(&a);
}

/* ---- driver functions the client calls (never hooked ones: those would gate the gatekeeper) -- */

static struct {
    CUresult (*ctx_push)(CUcontext);
    CUresult (*ctx_pop)(CUcontext *);
    CUresult (*ctx_sync)(void);
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*ctx_get_device)(CUdevice *);
    CUresult (*primary_state)(CUdevice, unsigned int *, int *);
    CUresult (*uuid_v2)(CUuuid *, CUdevice);
    CUresult (*uuid)(CUuuid *, CUdevice);
    CUresult (*name)(char *, int, CUdevice);
    CUresult (*total_mem)(size_t *, CUdevice);
} D;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

static void load_driver_fns(void)
{
    *(void **)&D.ctx_push = gs_driver_sym("cuCtxPushCurrent_v2");
    *(void **)&D.ctx_pop = gs_driver_sym("cuCtxPopCurrent_v2");
    *(void **)&D.ctx_sync = gs_driver_sym("cuCtxSynchronize");
    *(void **)&D.ctx_get_current = gs_driver_sym("cuCtxGetCurrent");
    *(void **)&D.ctx_get_device = gs_driver_sym("cuCtxGetDevice");
    *(void **)&D.primary_state = gs_driver_sym("cuDevicePrimaryCtxGetState");
    *(void **)&D.uuid_v2 = gs_driver_sym("cuDeviceGetUuid_v2");
    *(void **)&D.uuid = gs_driver_sym("cuDeviceGetUuid");
    *(void **)&D.name = gs_driver_sym("cuDeviceGetName");
    *(void **)&D.total_mem = gs_driver_sym("cuDeviceTotalMem_v2");
}

static void drv(void) { pthread_once(&drv_once, load_driver_fns); }

/* Make the application's context current on this (the shim's) thread. 0 on success. */
static int push_ctx(CUdevice *dev_out)
{
    drv();
    pthread_mutex_lock(&C.mu);
    CUcontext ctx = C.ctx;
    CUdevice dev = C.dev;
    int primary = C.ctx_is_primary;
    pthread_mutex_unlock(&C.mu);
    if (dev_out)
        *dev_out = dev;
    if (!ctx || !D.ctx_push || !D.ctx_pop)
        return -1;
    if (primary && D.primary_state) {
        /* The program may have released its primary context: never push a dead one. */
        unsigned int flags = 0;
        int active = 0;
        if (D.primary_state(dev, &flags, &active) != CUDA_SUCCESS || !active)
            return -1;
    }
    return D.ctx_push(ctx) == CUDA_SUCCESS ? 0 : -1;
}

static void pop_ctx(void)
{
    CUcontext ignored;
    D.ctx_pop(&ignored);
}

/* Wait for all of the application's outstanding GPU work. Errors (a context already gone at exit)
 * are tolerated: there is nothing left to wait for then. */
static void sync_app(void)
{
    if (push_ctx(NULL) != 0)
        return;
    if (D.ctx_sync)
        D.ctx_sync();
    pop_ctx();
}

/* ---- small helpers ---- */

static void wake_locked_or_not(void)
{
    if (wake_pipe[1] >= 0 && !atomic_exchange(&wake_pending, 1)) {
        ssize_t w = write(wake_pipe[1], "w", 1);
        (void)w;
    }
}

void gs_client_wake(void) { wake_locked_or_not(); }

static void set_state_locked(int state)
{
    C.state = state;
    int open = state == GPUSHARE_STATE_HOLDING || state == GPUSHARE_STATE_UNSHARED || C.quitting;
    gs_gate_set_open(open);
    pthread_cond_broadcast(&C.cv);
}

static double ms(double seconds) { return seconds * 1000.0; }

/* ---- identity ---- */

static void default_socket_path(char *out, size_t cap)
{
    const char *s = getenv("GPUSHARE_SOCKET");
    if (s && *s) {
        snprintf(out, cap, "%s", s);
        return;
    }
    uid_t uid = getuid();
    if (uid == 0) {
        snprintf(out, cap, "/run/gpushare/scheduler.sock");
        return;
    }
    const char *rt = getenv("XDG_RUNTIME_DIR");
    if (!rt || !*rt)
        rt = "/tmp";
    snprintf(out, cap, "%s/gpushare-%u/scheduler.sock", rt, (unsigned)uid);
}

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

static void gather_identity(CUdevice dev)
{
    const char *v;
    if ((v = getenv("GPUSHARE_CLIENT_ID")) && *v)
        snprintf(C.client_id, sizeof C.client_id, "%s", v);
    else
        snprintf(C.client_id, sizeof C.client_id, "pid-%d", (int)getpid());
    if ((v = getenv("GPUSHARE_USER")) && *v) {
        snprintf(C.user, sizeof C.user, "%s", v);
    } else {
        struct passwd pw, *res = NULL;
        char buf[1024];
        if (getpwuid_r(getuid(), &pw, buf, sizeof buf, &res) == 0 && res)
            snprintf(C.user, sizeof C.user, "%s", res->pw_name);
        else
            snprintf(C.user, sizeof C.user, "uid-%u", (unsigned)getuid());
    }
    if ((v = getenv("GPUSHARE_USER_TOKEN")) && *v)
        snprintf(C.token, sizeof C.token, "%s", v);
    if ((v = getenv("GPUSHARE_LABEL")) && *v)
        snprintf(C.label, sizeof C.label, "%s", v);
    else
        read_cmdline(C.label, sizeof C.label);
    default_socket_path(C.socket_path, sizeof C.socket_path);

    drv();
    CUuuid u;
    memset(&u, 0, sizeof u);
    if ((D.uuid_v2 && D.uuid_v2(&u, dev) == CUDA_SUCCESS) ||
        (D.uuid && D.uuid(&u, dev) == CUDA_SUCCESS)) {
        const unsigned char *b = (const unsigned char *)u.bytes;
        snprintf(C.device_uuid, sizeof C.device_uuid,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                 b[14], b[15]);
    }
    if (!D.name || D.name(C.device_name, (int)sizeof C.device_name, dev) != CUDA_SUCCESS)
        C.device_name[0] = 0;
    C.device_name[sizeof C.device_name - 1] = 0;
    size_t total = 0;
    if (D.total_mem && D.total_mem(&total, dev) == CUDA_SUCCESS)
        C.device_total = total;
}

/* ---- socket I/O ---- */

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

static void begin(struct gs_writer *w, uint8_t type) { gs_w_begin(w, C.tx, sizeof C.tx, type); }

static void put_memory(struct gs_writer *w, const struct gs_mem_totals *t)
{
    gs_w_u64(w, GS_TAG_USED_BYTES, t->used);
    gs_w_u64(w, GS_TAG_MANAGED_BYTES, t->managed);
    gs_w_u64(w, GS_TAG_PINNED_BYTES, t->pinned);
    gs_w_u64(w, GS_TAG_EVICTED_BYTES, t->evicted);
}

static void connection_lost(const char *why);

/* Finish and send a frame on the current connection (thread side). */
static int send_frame(struct gs_writer *w)
{
    size_t n = gs_w_finish(w);
    pthread_mutex_lock(&C.mu);
    int fd = C.connected ? C.fd : -1;
    pthread_mutex_unlock(&C.mu);
    if (fd < 0 || !n)
        return -1;
    if (send_all(fd, w->buf, n) != 0) {
        connection_lost("send failed");
        return -1;
    }
    return 0;
}

static void send_memory_now(void)
{
    struct gs_writer w;
    struct gs_mem_totals t;
    uint64_t gen = gs_mem_generation();
    gs_mem_totals(&t);
    begin(&w, GS_MSG_MEMORY);
    put_memory(&w, &t);
    if (send_frame(&w) == 0) {
        C.mem_gen_sent = gen;
        C.mem_sent = t;
        C.mem_sent_at = gs_now();
    }
}

static void send_request(void)
{
    struct gs_writer w;
    struct gs_mem_totals t;
    gs_mem_totals(&t);
    begin(&w, GS_MSG_REQUEST);
    put_memory(&w, &t);
    send_frame(&w);
    GS_DEBUG("requested the device");
}

static int connect_socket(char *why, size_t whylen)
{
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (strlen(C.socket_path) >= sizeof addr.sun_path) {
        snprintf(why, whylen, "path too long");
        return -1;
    }
    memcpy(addr.sun_path, C.socket_path, strlen(C.socket_path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        snprintf(why, whylen, "%s", strerror(errno));
        return -1;
    }
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int e = errno;
        if (e == EINPROGRESS || e == EAGAIN) {
            struct pollfd pfd = {fd, POLLOUT, 0};
            int soerr = 0;
            socklen_t sl = sizeof soerr;
            if (poll(&pfd, 1, (int)(CONNECT_TIMEOUT_S * 1000)) == 1 &&
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 && soerr == 0)
                return fd;
            e = soerr ? soerr : ETIMEDOUT;
        }
        snprintf(why, whylen, "%s", strerror(e));
        close(fd);
        return -1;
    }
    return fd;
}

static void apply_welcome(const struct gs_msg *m)
{
    if (gs_msg_has(m, GS_TAG_POOL_BYTES))
        gs_mem_set_pool(m->u64[GS_TAG_POOL_BYTES]);
    if (gs_msg_has(m, GS_TAG_QUOTA))
        gs_mem_set_quota(m->u64[GS_TAG_QUOTA]);
    pthread_mutex_lock(&C.mu);
    C.quantum_ms = gs_msg_u64(m, GS_TAG_QUANTUM_MS, C.quantum_ms);
    pthread_mutex_unlock(&C.mu);
}

/* Connect, say HELLO and wait for WELCOME (bounded). Returns the fd, or -1 with `why` set. */
static int handshake(char *why, size_t whylen)
{
    int fd = connect_socket(why, whylen);
    if (fd < 0)
        return -1;
    double deadline = gs_now() + CONNECT_TIMEOUT_S;
    const struct gs_config *cfg = gs_config();
    struct gs_writer w;
    begin(&w, GS_MSG_HELLO);
    gs_w_str(&w, GS_TAG_CLIENT_ID, C.client_id);
    gs_w_u64(&w, GS_TAG_PID, (uint64_t)getpid());
    gs_w_str(&w, GS_TAG_DEVICE_UUID, C.device_uuid);
    gs_w_str(&w, GS_TAG_DEVICE_NAME, C.device_name);
    gs_w_u64(&w, GS_TAG_DEVICE_TOTAL, C.device_total);
    struct gs_mem_totals mem;
    gs_mem_totals(&mem);
    pthread_mutex_lock(&C.mu);
    int reconnect = C.started && C.thread_running;
    int resume = C.resume;
    if (resume == RESUME_WAITING && C.waiters == 0)
        resume = 0; /* the call that waited was interrupted meanwhile */
    double since = C.resume_since;
    double gpu = C.holding_seconds;
    pthread_mutex_unlock(&C.mu);
    /* A reconnect keeps the quota in force (an operator may have changed it) and tells the new
     * scheduler what this process holds, so that its state equals the one the old one had. */
    gs_w_u64(&w, GS_TAG_QUOTA, reconnect ? mem.quota : cfg->quota);
    gs_w_u64(&w, GS_TAG_WEIGHT_MILLI, cfg->weight_milli);
    if (reconnect) {
        put_memory(&w, &mem);
        gs_w_u64(&w, GS_TAG_RESUME, (uint64_t)resume);
        gs_w_u64(&w, GS_TAG_SINCE_MS, resume ? (uint64_t)(ms(gs_now() - since) + 0.5) : 0);
        gs_w_u64(&w, GS_TAG_GPU_MS, (uint64_t)(ms(gpu) + 0.5));
    }
    gs_w_str(&w, GS_TAG_USER, C.user);
    if (C.token[0])
        gs_w_str(&w, GS_TAG_TOKEN, C.token);
    gs_w_str(&w, GS_TAG_LABEL, C.label);
    gs_w_u64(&w, GS_TAG_CONTEXT_BYTES, cfg->context_bytes);
    gs_w_str(&w, GS_TAG_VERSION, GS_VERSION);
    size_t n = gs_w_finish(&w);
    if (!n || send_all(fd, C.tx, n) != 0) {
        snprintf(why, whylen, "sending HELLO failed");
        close(fd);
        return -1;
    }
    C.rx_len = 0;
    for (;;) {
        struct gs_msg m;
        size_t flen;
        int pr = gs_parse(C.rx, C.rx_len, &m, &flen);
        if (pr == GS_PARSE_ERROR) {
            snprintf(why, whylen, "malformed answer");
            break;
        }
        if (pr == GS_PARSE_OK) {
            int type = m.type;
            if (type == GS_MSG_WELCOME) {
                apply_welcome(&m);
                pthread_mutex_lock(&C.mu);
                if (C.resume == RESUME_HOLDING && gs_msg_u64(&m, GS_TAG_RESUME, 0) != 1)
                    C.resume = 0; /* the scheduler did not give the grant back */
                pthread_mutex_unlock(&C.mu);
            }
            else if (type == GS_MSG_ERROR) {
                char msg[128];
                gs_msg_str(&m, GS_TAG_MESSAGE, msg, sizeof msg);
                snprintf(why, whylen, "refused: %s", msg);
            }
            memmove(C.rx, C.rx + flen, C.rx_len - flen);
            C.rx_len -= flen;
            if (type == GS_MSG_WELCOME)
                return fd; /* anything after it stays in C.rx for the thread */
            if (type == GS_MSG_ERROR)
                break;
            continue;
        }
        int left = (int)((deadline - gs_now()) * 1000);
        if (left <= 0) {
            snprintf(why, whylen, "no answer to HELLO within %d ms", (int)(CONNECT_TIMEOUT_S * 1000));
            break;
        }
        struct pollfd pfd = {fd, POLLIN, 0};
        if (poll(&pfd, 1, left) <= 0)
            continue;
        ssize_t r = recv(fd, C.rx + C.rx_len, sizeof C.rx - C.rx_len, 0);
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
        C.rx_len += (size_t)r;
    }
    close(fd);
    C.rx_len = 0;
    return -1;
}

static void schedule_retry_locked(void)
{
    C.backoff = C.backoff <= 0 ? BACKOFF_MIN_S : C.backoff * 2;
    if (C.backoff > BACKOFF_MAX_S)
        C.backoff = BACKOFF_MAX_S;
    C.next_connect_at = gs_now() + C.backoff;
}

static void unreachable_locked(const char *why, int lost)
{
    if (!C.warned) {
        C.warned = 1;
        GS_WARN("%s %s (%s); running unshared, will keep trying",
                lost ? "lost the scheduler at" : "scheduler not reachable at", C.socket_path, why);
    } else {
        GS_DEBUG("scheduler still not reachable at %s (%s)", C.socket_path, why);
    }
    schedule_retry_locked();
}

/* A fresh connection: the gate closes, so the next call asks for the device. */
static void connected_locked(int fd, int reconnect)
{
    C.fd = fd;
    C.connected = 1;
    C.requested = 0;
    C.backoff = 0;
    if (C.warned || reconnect)
        GS_INFO("connected to the scheduler at %s", C.socket_path);
    C.warned = 0;
    C.mem_gen_sent = (uint64_t)-1;
    C.idle_sent = 0; /* a new scheduler must hear it too: an idle holder is revoked at once */
    C.unshare_at = 0;
    if (C.resume == RESUME_HOLDING) {
        /* The new scheduler gave the grant back (WELCOME resume = 1): keep running. */
        C.hold_since = gs_now();
        GS_INFO("kept the device across the scheduler's restart");
        set_state_locked(GPUSHARE_STATE_HOLDING);
    } else {
        set_state_locked(GPUSHARE_STATE_IDLE);
    }
    C.resume = 0;
    if (C.waiters > 0 && C.state != GPUSHARE_STATE_HOLDING)
        C.want_request = 1;
}

static void connection_lost(const char *why)
{
    pthread_mutex_lock(&C.mu);
    if (!C.connected) {
        pthread_mutex_unlock(&C.mu);
        return;
    }
    close(C.fd);
    C.fd = -1;
    C.connected = 0;
    C.requested = 0;
    C.rx_len = 0;
    int was_holding = C.state == GPUSHARE_STATE_HOLDING;
    if (was_holding)
        C.holding_seconds += gs_now() - C.hold_since;
    if (!C.quitting) {
        /* The holder runs on (unshared) and asks for its grant back when the scheduler returns.
         * Others keep waiting for it, at most GPUSHARE_RECONNECT_WAIT seconds, then run unshared
         * rather than block the program on a scheduler that is gone (docs/reliability.md). */
        double wait = gs_config()->reconnect_wait;
        if (was_holding) {
            C.resume = RESUME_HOLDING;
            C.resume_since = C.hold_since;
        } else if (C.waiters > 0) {
            C.resume = RESUME_WAITING;
            C.resume_since = C.wait_began;
        } else {
            C.resume = 0;
        }
        if (was_holding || wait <= 0 || C.state == GPUSHARE_STATE_UNSHARED) {
            set_state_locked(GPUSHARE_STATE_UNSHARED);
        } else {
            C.unshare_at = gs_now() + wait;
            set_state_locked(GPUSHARE_STATE_IDLE);
        }
        unreachable_locked(why, 1);
    }
    pthread_mutex_unlock(&C.mu);

    /* Memory we evicted would come back page by page on demand; bring it back in bulk. */
    struct gs_mem_totals t;
    gs_mem_totals(&t);
    CUdevice dev;
    if (!C.quitting && t.evicted && push_ctx(&dev) == 0) {
        uint64_t moved, us;
        gs_mem_restore(dev, &moved, &us);
        pop_ctx();
    }
}

/* ---- scheduler messages (thread) ---- */

static void release_device(int evict, const char *reason, int solicited)
{
    pthread_mutex_lock(&C.mu);
    if (solicited && C.state != GPUSHARE_STATE_HOLDING) {
        /* A REVOKE that crossed our own unsolicited RELEASED on the wire: the scheduler takes
         * that RELEASED as the answer. Answering twice could arrive after a new GRANT and mark
         * us idle while we run, so a stale REVOKE is dropped (the socket keeps order). */
        pthread_mutex_unlock(&C.mu);
        GS_DEBUG("ignored a revoke (%s): not holding the device", reason ? reason : "");
        return;
    }
    if (C.state == GPUSHARE_STATE_HOLDING)
        C.holding_seconds += gs_now() - C.hold_since;
    if (C.connected)
        set_state_locked(GPUSHARE_STATE_RELEASING);
    pthread_mutex_unlock(&C.mu);

    double t0 = gs_now();
    uint64_t moved = 0, us = 0;
    int evicted = 0;
    CUdevice dev;
    if (push_ctx(&dev) == 0) {
        if (D.ctx_sync)
            D.ctx_sync();
        if (evict)
            evicted = gs_mem_evict(dev, &moved, &us) == 0;
        pop_ctx();
    }
    struct gs_mem_totals t;
    gs_mem_totals(&t);
    struct gs_writer w;
    begin(&w, GS_MSG_RELEASED);
    gs_w_u64(&w, GS_TAG_FLAG, evicted ? 1 : 0);
    gs_w_u64(&w, GS_TAG_EVICTED_BYTES, t.evicted);
    gs_w_u64(&w, GS_TAG_BYTES_MOVED, moved);
    gs_w_u64(&w, GS_TAG_MICROS, us);
    send_frame(&w);
    if (evict) {
        char b[32];
        GS_INFO("%s (%s): released after %.1f ms, evicted %s in %.1f ms",
                solicited ? "revoked" : "released", reason && *reason ? reason : "no reason",
                ms(gs_now() - t0), gs_format_size(moved, b, sizeof b), us / 1000.0);
    } else {
        GS_INFO("%s (%s): released after %.1f ms", solicited ? "revoked" : "released",
                reason && *reason ? reason : "no reason", ms(gs_now() - t0));
    }

    pthread_mutex_lock(&C.mu);
    int again = 0;
    if (C.connected) {
        set_state_locked(GPUSHARE_STATE_IDLE);
        C.requested = 0;
        /* Threads that blocked meanwhile still want the device. */
        if (C.waiters > 0) {
            C.requested = 1;
            again = 1;
        }
    }
    C.want_release = 0;
    pthread_cond_broadcast(&C.cv);
    pthread_mutex_unlock(&C.mu);
    if (again)
        send_request();
}

static void handle_grant(int restore)
{
    double t0 = gs_now();
    if (restore) {
        uint64_t moved = 0, us = 0;
        CUdevice dev;
        struct gs_mem_totals t;
        gs_mem_totals(&t);
        if (t.evicted && push_ctx(&dev) == 0) {
            gs_mem_restore(dev, &moved, &us);
            pop_ctx();
        }
        struct gs_writer w;
        begin(&w, GS_MSG_RESTORED);
        gs_w_u64(&w, GS_TAG_BYTES_MOVED, moved);
        gs_w_u64(&w, GS_TAG_MICROS, us);
        send_frame(&w);
        char b[32];
        GS_INFO("restored %s to the device in %.1f ms", gs_format_size(moved, b, sizeof b),
                us / 1000.0);
    }
    pthread_mutex_lock(&C.mu);
    if (C.connected && !C.quitting) {
        double waited = C.waiters ? gs_now() - C.wait_began : 0;
        C.requested = 0;
        C.hold_since = gs_now();
        C.last_activity = C.hold_since;
        C.idle_sent = 0;
        set_state_locked(GPUSHARE_STATE_HOLDING);
        GS_INFO("granted the device (waited %.1f ms, restore took %.1f ms)", ms(waited),
                restore ? ms(gs_now() - t0) : 0.0);
    }
    pthread_mutex_unlock(&C.mu);
}

static void handle_evict(void)
{
    pthread_mutex_lock(&C.mu);
    int holding = C.state == GPUSHARE_STATE_HOLDING;
    pthread_mutex_unlock(&C.mu);
    uint64_t moved = 0, us = 0;
    CUdevice dev;
    /* The scheduler evicts only clients that do not hold the device; a holder's memory stays. */
    if (!holding && push_ctx(&dev) == 0) {
        gs_mem_evict(dev, &moved, &us);
        pop_ctx();
    }
    struct gs_mem_totals t;
    gs_mem_totals(&t);
    struct gs_writer w;
    begin(&w, GS_MSG_EVICTED);
    gs_w_u64(&w, GS_TAG_BYTES_MOVED, moved);
    gs_w_u64(&w, GS_TAG_MICROS, us);
    gs_w_u64(&w, GS_TAG_EVICTED_BYTES, t.evicted);
    send_frame(&w);
    char b[32];
    GS_INFO("evicted %s to the host in %.1f ms", gs_format_size(moved, b, sizeof b), us / 1000.0);
}

static void dispatch(const struct gs_msg *m)
{
    char text[256];
    switch (m->type) {
    case GS_MSG_GRANT:
        handle_grant(gs_msg_u64(m, GS_TAG_FLAG, 0) != 0);
        break;
    case GS_MSG_REVOKE:
        gs_msg_str(m, GS_TAG_REASON, text, sizeof text);
        release_device(gs_msg_u64(m, GS_TAG_FLAG, 0) != 0, text, 1);
        break;
    case GS_MSG_EVICT:
        handle_evict();
        break;
    case GS_MSG_SET_QUOTA: {
        uint64_t q = gs_msg_u64(m, GS_TAG_QUOTA, 0);
        gs_mem_set_quota(q);
        char b[32];
        GS_INFO("quota set to %s", q ? gs_format_size(q, b, sizeof b) : "none");
        break;
    }
    case GS_MSG_WELCOME:
        apply_welcome(m);
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

/* Dispatch every complete frame in C.rx. */
static void drain_rx(void)
{
    for (;;) {
        struct gs_msg m;
        size_t flen;
        int pr = gs_parse(C.rx, C.rx_len, &m, &flen);
        if (pr == GS_PARSE_MORE)
            return;
        if (pr == GS_PARSE_ERROR) {
            connection_lost("malformed frame from the scheduler");
            return;
        }
        /* Copy the frame out first: handlers may run for a while but never touch C.rx. */
        dispatch(&m);
        if (C.rx_len < flen) /* the connection was lost while dispatching */
            return;
        memmove(C.rx, C.rx + flen, C.rx_len - flen);
        C.rx_len -= flen;
    }
}

/* ---- the thread ---- */

static void try_reconnect(void)
{
    char why[160] = "";
    int fd = handshake(why, sizeof why);
    pthread_mutex_lock(&C.mu);
    if (fd >= 0 && !C.quitting) {
        connected_locked(fd, 1);
    } else {
        if (fd >= 0)
            close(fd);
        if (!C.quitting)
            unreachable_locked(why, 0);
    }
    int ok = C.connected;
    pthread_mutex_unlock(&C.mu);
    if (ok) {
        send_memory_now();
        drain_rx();
    }
}

/* Fold the gated calls' activity flag into a timestamp (the fast path only sets a flag: reading
 * the clock there would cost more than the rest of the gate). */
static void sample_activity(double now)
{
    if (atomic_exchange_explicit(&gs_activity, 0, memory_order_relaxed)) {
        pthread_mutex_lock(&C.mu);
        C.last_activity = now;
        C.idle_sent = 0;
        pthread_mutex_unlock(&C.mu);
    }
}

static void idle_check(double now)
{
    double window = gs_config()->idle_seconds;
    pthread_mutex_lock(&C.mu);
    int holding = C.connected && C.state == GPUSHARE_STATE_HOLDING;
    int due = holding && window > 0 && !C.idle_sent && now - C.last_activity >= window;
    double idle_for = now - C.last_activity;
    pthread_mutex_unlock(&C.mu);
    if (!due)
        return;
    int busy = 0;
    if (push_ctx(NULL) == 0) {
        busy = gs_streams_busy();
        pop_ctx();
    }
    if (busy)
        return; /* work is still running: look again on the next tick */
    struct gs_writer w;
    begin(&w, GS_MSG_IDLE);
    gs_w_u64(&w, GS_TAG_IDLE_MS, (uint64_t)(idle_for * 1000));
    if (send_frame(&w) == 0) {
        pthread_mutex_lock(&C.mu);
        C.idle_sent = 1;
        pthread_mutex_unlock(&C.mu);
        GS_DEBUG("idle for %.1f s: told the scheduler", idle_for);
    }
}

static void do_quit(void)
{
    pthread_mutex_lock(&C.mu);
    C.quitting = 1;
    if (C.state == GPUSHARE_STATE_HOLDING)
        C.holding_seconds += gs_now() - C.hold_since;
    int connected = C.connected;
    set_state_locked(C.state); /* re-evaluates the gate: open for good */
    pthread_mutex_unlock(&C.mu);

    sync_app();
    if (connected) {
        struct gs_writer w;
        begin(&w, GS_MSG_GOODBYE);
        send_frame(&w);
    }
    pthread_mutex_lock(&C.mu);
    if (C.fd >= 0)
        close(C.fd);
    C.fd = -1;
    C.connected = 0;
    pthread_cond_broadcast(&C.cv);
    pthread_mutex_unlock(&C.mu);
    GS_DEBUG("said goodbye to the scheduler");
}

static void *client_main(void *arg)
{
    (void)arg;
    /* Signals belong to the program's threads: SIGINT must reach the waiting thread (Python's main
     * thread), not ours. */
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);

    drain_rx(); /* frames that arrived together with WELCOME */
    if (C.connected)
        send_memory_now();
    for (;;) {
        if (atomic_load(&quit_requested)) {
            do_quit();
            break;
        }
        double now = gs_now();
        pthread_mutex_lock(&C.mu);
        int reconnect = !C.connected && !C.quitting && now >= C.next_connect_at;
        if (!C.connected && C.unshare_at > 0 && now >= C.unshare_at) {
            C.unshare_at = 0;
            if (C.state == GPUSHARE_STATE_IDLE) {
                GS_WARN("the scheduler did not come back within %.1f s: running unshared",
                        gs_config()->reconnect_wait);
                C.resume = 0; /* it runs now: no place in a queue to claim back */
                set_state_locked(GPUSHARE_STATE_UNSHARED);
            }
        }
        pthread_mutex_unlock(&C.mu);
        if (reconnect)
            try_reconnect();

        pthread_mutex_lock(&C.mu);
        int do_request = C.connected && C.want_request && C.state == GPUSHARE_STATE_IDLE &&
                         !C.requested && C.waiters > 0;
        if (do_request)
            C.requested = 1;
        C.want_request = 0;
        int do_release = C.want_release;
        int holding = C.state == GPUSHARE_STATE_HOLDING;
        if (do_release && !(C.connected && holding)) {
            C.want_release = 0;
            do_release = 0;
            pthread_cond_broadcast(&C.cv);
        }
        int connected = C.connected;
        int fd = C.fd;
        double next_connect = C.next_connect_at;
        pthread_mutex_unlock(&C.mu);

        if (do_request)
            send_request();
        if (do_release)
            release_device(0, "released by the program", 0);

        now = gs_now();
        sample_activity(now);
        int mem_dirty = 0;
        if (connected) {
            if (gs_mem_generation() != C.mem_gen_sent) {
                struct gs_mem_totals t;
                gs_mem_totals(&t);
                if (t.used == C.mem_sent.used && t.managed == C.mem_sent.managed &&
                    t.pinned == C.mem_sent.pinned && t.evicted == C.mem_sent.evicted)
                    C.mem_gen_sent = gs_mem_generation(); /* nothing the scheduler would see */
                else if (now - C.mem_sent_at >= MEMORY_REPORT_MIN_S)
                    send_memory_now();
                else
                    mem_dirty = 1;
            }
            idle_check(now);
        }

        /* Sleep until a message, a wake-up, or the next thing to do. */
        int timeout_ms;
        if (!connected) {
            double until = next_connect;
            pthread_mutex_lock(&C.mu);
            if (C.unshare_at > 0 && C.unshare_at < until)
                until = C.unshare_at;
            pthread_mutex_unlock(&C.mu);
            timeout_ms = (int)((until - now) * 1000) + 1;
        }
        else if (mem_dirty)
            timeout_ms = (int)(MEMORY_REPORT_MIN_S * 1000);
        else if (holding && gs_config()->idle_seconds > 0)
            timeout_ms = 100;
        else
            timeout_ms = 1000;
        if (timeout_ms < 1)
            timeout_ms = 1;
        struct pollfd pfd[2] = {{wake_pipe[0], POLLIN, 0}, {connected ? fd : -1, POLLIN, 0}};
        int pr = poll(pfd, 2, timeout_ms);
        if (pr <= 0)
            continue;
        if (pfd[0].revents & POLLIN) {
            char buf[64];
            atomic_store(&wake_pending, 0);
            while (read(wake_pipe[0], buf, sizeof buf) > 0) {
            }
        }
        if (connected && (pfd[1].revents & (POLLIN | POLLHUP | POLLERR))) {
            ssize_t r = recv(fd, C.rx + C.rx_len, sizeof C.rx - C.rx_len, 0);
            if (r == 0)
                connection_lost("the scheduler closed the connection");
            else if (r < 0 && errno != EINTR && errno != EAGAIN)
                connection_lost(strerror(errno));
            else if (r > 0) {
                C.rx_len += (size_t)r;
                drain_rx();
            }
        }
    }
    ssize_t w = write(done_pipe[1], "d", 1);
    (void)w;
    return NULL;
}

/* ---- quitting: atexit and the fatal signals ---- */

/* Ask the thread to synchronise and say GOODBYE; wait for it at most QUIT_WAIT_MS.
 * Async-signal-safe (atomics, write, poll): the signal handlers below call it. The work itself
 * (cuCtxSynchronize, the socket) happens on the shim's thread, never in the handler: neither the
 * driver nor our locks may be entered from a handler that interrupted a thread holding them. If
 * the interrupted thread does hold something the shim's thread then needs (a driver lock, C.mu),
 * the wait runs out after QUIT_WAIT_MS and the process ends anyway: bounded, never a hang. */
static void quit_and_wait(void)
{
    if (!C.thread_running || done_pipe[0] < 0)
        return;
    atomic_store(&quit_requested, 1);
    if (wake_pipe[1] >= 0) {
        ssize_t w = write(wake_pipe[1], "q", 1);
        (void)w;
    }
    struct pollfd pfd = {done_pipe[0], POLLIN, 0};
    while (poll(&pfd, 1, QUIT_WAIT_MS) < 0 && errno == EINTR) {
    }
}

static void at_exit(void) { quit_and_wait(); }

/* The signals whose default action ends the process: a kernel ended by one of them while its work
 * runs on the GPU is what leaves an MPS server (and its other clients) in an undefined state, so
 * the shim synchronises first. SIGTERM: Jupyter's shutdown after its timeout, `kill`; SIGHUP: the
 * terminal or the server went away; SIGQUIT: Ctrl-\; SIGINT: Ctrl-C of a program that does not
 * handle it (Python does, and then leaves through exit(), i.e. at_exit); SIGXCPU: a batch
 * system's CPU limit, before its SIGKILL; SIGPIPE, SIGALRM, SIGUSR1/2: unhandled, they kill too.
 * Crashes (SIGABRT from abort(), SIGSEGV, SIGBUS, SIGFPE, SIGILL) as well: the crashed thread runs
 * the handler and only waits; the shim's thread, which has every signal blocked, does the work (a
 * fault on the shim's thread itself cannot be handled and ends the process at once). If the crash
 * left the driver unusable the wait runs out after QUIT_WAIT_MS. SIGKILL cannot be caught: there
 * the provisioner asks the scheduler for MPS's terminate_client first. */
static const int quit_signals[] = {SIGTERM, SIGHUP,  SIGQUIT, SIGINT,  SIGXCPU,
                                   SIGPIPE, SIGALRM, SIGUSR1, SIGUSR2, SIGABRT,
                                   SIGSEGV, SIGBUS,  SIGFPE,  SIGILL};

static void on_quit_signal(int sig)
{
    int saved = errno;
    /* The work happens on the shim's thread; the handler only asks and waits (bounded). */
    quit_and_wait();
    /* Then what the default action would have done: ours was only installed over SIG_DFL. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    errno = saved;
    raise(sig); /* blocked while the handler runs: delivered as it returns, and the process ends
                   as that signal would have ended it (status, core dump for SIGQUIT) */
}

static void install_quit_handlers(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_quit_signal;
    /* One quit at a time: a second fatal signal waits until the first one's handler is done. */
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof quit_signals / sizeof quit_signals[0]; i++)
        sigaddset(&sa.sa_mask, quit_signals[i]);
    for (size_t i = 0; i < sizeof quit_signals / sizeof quit_signals[0]; i++) {
        struct sigaction cur;
        if (sigaction(quit_signals[i], NULL, &cur) != 0)
            continue;
        /* Only where the signal would simply kill the process. A program's own handler decides
         * how it quits (it usually leaves through exit(), where at_exit synchronises), and an
         * ignored signal stays ignored. So nothing of the program's is replaced or lost. */
        if ((cur.sa_flags & SA_SIGINFO) || cur.sa_handler != SIG_DFL)
            continue;
        sigaction(quit_signals[i], &sa, NULL);
    }
}

/* ---- fork ---- */

static void fork_prepare(void)
{
    pthread_mutex_lock(&C.mu);
    gs_mem_lock_for_fork();
    gs_streams_lock();
}

static void fork_parent(void)
{
    gs_streams_unlock();
    gs_mem_unlock_after_fork();
    pthread_mutex_unlock(&C.mu);
}

static void close_pipe(int p[2])
{
    for (int i = 0; i < 2; i++) {
        if (p[i] >= 0)
            close(p[i]);
        p[i] = -1;
    }
}

static void fork_child(void)
{
    /* The child has the parent's memory but not its thread, its CUDA context or its place with the
     * scheduler: it starts over as INACTIVE and registers itself if it uses CUDA. */
    gs_streams_after_fork_child();
    gs_calls_after_fork_child();
    gs_mem_after_fork_child();
    pthread_mutex_init(&C.mu, NULL);
    init_cv();
    if (C.fd >= 0)
        close(C.fd); /* the child's copy only; the parent's connection is untouched */
    C.fd = -1;
    C.connected = C.started = C.thread_running = C.quitting = 0;
    C.requested = C.want_request = C.want_release = C.waiters = C.warned = 0;
    C.ctx = NULL;
    C.client_id[0] = C.device_uuid[0] = 0;
    C.rx_len = 0;
    C.backoff = 0;
    C.holding_seconds = C.wait_seconds = 0;
    C.waits = 0;
    C.state = GPUSHARE_STATE_INACTIVE;
    close_pipe(wake_pipe);
    close_pipe(done_pipe);
    atomic_store(&wake_pending, 0);
    atomic_store(&quit_requested, 0);
    gs_gate_set_open(0);
}

/* ---- starting ---- */

static void start_client(CUdevice dev)
{
    gather_identity(dev);
    gs_mem_count_context();
    pthread_mutex_lock(&C.mu);
    C.last_activity = gs_now();
    pthread_mutex_unlock(&C.mu);
    if (pipe2(wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0 || pipe2(done_pipe, O_CLOEXEC) != 0) {
        close_pipe(wake_pipe);
        close_pipe(done_pipe);
    }
    if (!atexit_registered) {
        atexit_registered = 1;
        atexit(at_exit);
    }
    if (!atfork_registered) {
        atfork_registered = 1;
        pthread_atfork(fork_prepare, fork_parent, fork_child);
    }
    install_quit_handlers();

    char why[160] = "";
    int fd = handshake(why, sizeof why);

    pthread_mutex_lock(&C.mu);
    if (fd >= 0) {
        connected_locked(fd, 0);
        GS_DEBUG("registered with the scheduler at %s as %s", C.socket_path, C.client_id);
    } else {
        set_state_locked(GPUSHARE_STATE_UNSHARED);
        unreachable_locked(why, 0);
    }
    if (wake_pipe[0] >= 0) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t tid;
        /* The thread starts with every signal blocked, before it can run a single instruction
         * with SIGINT deliverable. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        if (pthread_create(&tid, &attr, client_main, NULL) == 0) {
            C.thread_running = 1;
            pthread_setname_np(tid, "gpushare");
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
    }
    if (!C.thread_running) {
        /* Without the thread nobody can talk to the scheduler: run unshared. */
        GS_WARN("cannot start the scheduler thread; running unshared");
        if (C.fd >= 0)
            close(C.fd);
        C.fd = -1;
        C.connected = 0;
        set_state_locked(GPUSHARE_STATE_UNSHARED);
    }
    pthread_cond_broadcast(&C.cv);
    pthread_mutex_unlock(&C.mu);
}

static void on_context(CUcontext ctx, CUdevice dev, int primary)
{
    if (gs_config()->disabled || !ctx)
        return;
    pthread_once(&cv_once, init_cv);
    pthread_mutex_lock(&C.mu);
    if (C.started || C.quitting) {
        if (!C.ctx) { /* the context we knew was destroyed: follow the new one */
            C.ctx = ctx;
            C.dev = dev;
            C.ctx_is_primary = primary;
        }
        pthread_mutex_unlock(&C.mu);
        return;
    }
    C.started = 1;
    C.ctx = ctx;
    C.dev = dev;
    C.ctx_is_primary = primary;
    pthread_mutex_unlock(&C.mu);
    start_client(dev);
}

void gs_client_on_context(CUcontext ctx, CUdevice dev) { on_context(ctx, dev, 0); }

void gs_client_on_context_destroyed(CUcontext ctx)
{
    pthread_mutex_lock(&C.mu);
    if (C.ctx == ctx)
        C.ctx = NULL;
    pthread_mutex_unlock(&C.mu);
}

int gs_client_has_context(void)
{
    pthread_mutex_lock(&C.mu);
    int r = C.started && C.ctx != NULL;
    pthread_mutex_unlock(&C.mu);
    return r;
}

int gs_client_device_matches_uuid(const char *uuid)
{
    pthread_mutex_lock(&C.mu);
    int r = !C.device_uuid[0] || strcasecmp(uuid, C.device_uuid) == 0;
    pthread_mutex_unlock(&C.mu);
    return r;
}

/* A gated call found no client running: if this thread has a context the shim did not see being
 * made (a path without a hook), start from it. */
static void start_from_current(void)
{
    drv();
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    if (D.ctx_get_current && D.ctx_get_current(&ctx) == CUDA_SUCCESS && ctx &&
        D.ctx_get_device && D.ctx_get_device(&dev) == CUDA_SUCCESS)
        on_context(ctx, dev, 0);
}

/* ---- the gate's slow path ---- */

CUresult gs_client_wait_for_device(void)
{
    pthread_once(&cv_once, init_cv);
    CUresult result = CUDA_SUCCESS;
    int waiting = 0;
    unsigned sig0 = 0;
    double t0 = 0;
    pthread_mutex_lock(&C.mu);
    for (;;) {
        int st = C.state;
        if (C.quitting || st == GPUSHARE_STATE_UNSHARED || st == GPUSHARE_STATE_HOLDING)
            break;
        if (st == GPUSHARE_STATE_INACTIVE && !C.started) {
            pthread_mutex_unlock(&C.mu);
            start_from_current();
            pthread_mutex_lock(&C.mu);
            if (C.state == GPUSHARE_STATE_INACTIVE && !C.started)
                break; /* no context at all: nothing to share, let the driver answer */
            continue;
        }
        if (!waiting) {
            waiting = 1;
            t0 = gs_now();
            sig0 = gs_sigint_count();
            if (C.waiters++ == 0) {
                C.wait_began = t0;
                gs_sigint_begin();
            }
            C.waits++;
        }
        if (st == GPUSHARE_STATE_IDLE && C.connected && !C.requested && !C.want_request) {
            C.want_request = 1;
            wake_locked_or_not();
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += WAIT_SLICE_NS;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&C.cv, &C.mu, &ts);
        if (gs_sigint_count() != sig0) {
            result = CUDA_ERROR_NOT_PERMITTED;
            break;
        }
    }
    if (waiting) {
        C.wait_seconds += gs_now() - t0;
        if (--C.waiters == 0)
            gs_sigint_end();
    }
    pthread_mutex_unlock(&C.mu);
    if (result != CUDA_SUCCESS)
        GS_INFO("interrupted while waiting for the device");
    return result;
}

/* ---- status API support ---- */

void gs_client_status(struct gpushare_status *out)
{
    struct gs_mem_totals t;
    gs_mem_totals(&t);
    double now = gs_now();
    pthread_once(&cv_once, init_cv);
    pthread_mutex_lock(&C.mu);
    int st = C.state;
    if (st == GPUSHARE_STATE_IDLE && C.waiters > 0)
        st = GPUSHARE_STATE_WAITING;
    out->state = (uint32_t)st;
    out->connected = (uint32_t)C.connected;
    out->evicted = t.evicted > 0;
    out->used_bytes = t.used;
    out->managed_bytes = t.managed;
    out->pinned_bytes = t.pinned;
    out->evicted_bytes = t.evicted;
    out->quota_bytes = t.quota;
    out->pool_bytes = t.pool;
    out->gated_calls = gs_total_gated_calls();
    out->waits = C.waits;
    out->current_wait_seconds = C.waiters ? now - C.wait_began : 0;
    out->wait_seconds = C.wait_seconds + out->current_wait_seconds;
    out->holding_seconds =
        C.holding_seconds + (C.state == GPUSHARE_STATE_HOLDING ? now - C.hold_since : 0);
    int active = atomic_load_explicit(&gs_activity, memory_order_relaxed);
    out->idle_seconds = (!C.started || active) ? 0 : now - C.last_activity;
    snprintf(out->client_id, sizeof out->client_id, "%s", C.client_id);
    snprintf(out->socket_path, sizeof out->socket_path, "%s", C.socket_path);
    snprintf(out->device_uuid, sizeof out->device_uuid, "%s", C.device_uuid);
    pthread_mutex_unlock(&C.mu);
}

int gs_client_release(void)
{
    pthread_once(&cv_once, init_cv);
    pthread_mutex_lock(&C.mu);
    if (!C.connected) {
        pthread_mutex_unlock(&C.mu);
        return -1;
    }
    if (C.state != GPUSHARE_STATE_HOLDING) {
        pthread_mutex_unlock(&C.mu);
        return 0;
    }
    C.want_release = 1;
    wake_locked_or_not();
    while (C.want_release && C.connected)
        pthread_cond_wait(&C.cv, &C.mu);
    int r = C.connected ? 0 : -1;
    pthread_mutex_unlock(&C.mu);
    return r;
}

/* ---- context hooks (hooks.def) ---- */

CUresult gs_ctx_primary_retain(gs_fn_cuDevicePrimaryCtxRetain real, CUcontext *pctx, CUdevice dev)
{
    CUresult r = real(pctx, dev);
    if (r == CUDA_SUCCESS && pctx)
        on_context(*pctx, dev, 1);
    return r;
}

CUresult gs_ctx_create_v2(gs_fn_cuCtxCreate_v2 real, CUcontext *pctx, unsigned int flags,
                          CUdevice dev)
{
    CUresult r = real(pctx, flags, dev);
    if (r == CUDA_SUCCESS && pctx)
        on_context(*pctx, dev, 0);
    return r;
}

CUresult gs_ctx_create_v3(gs_fn_cuCtxCreate_v3 real, CUcontext *pctx,
                          CUexecAffinityParam *paramsArray, int numParams, unsigned int flags,
                          CUdevice dev)
{
    CUresult r = real(pctx, paramsArray, numParams, flags, dev);
    if (r == CUDA_SUCCESS && pctx)
        on_context(*pctx, dev, 0);
    return r;
}

CUresult gs_ctx_create_v4(gs_fn_cuCtxCreate_v4 real, CUcontext *pctx,
                          CUctxCreateParams *ctxCreateParams, unsigned int flags, CUdevice dev)
{
    CUresult r = real(pctx, ctxCreateParams, flags, dev);
    if (r == CUDA_SUCCESS && pctx)
        on_context(*pctx, dev, 0);
    return r;
}

CUresult gs_ctx_destroy(gs_fn_cuCtxDestroy_v2 real, CUcontext ctx)
{
    CUresult r = real(ctx);
    if (r == CUDA_SUCCESS)
        gs_client_on_context_destroyed(ctx);
    return r;
}
