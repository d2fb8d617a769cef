/*
 * The shim's session with the scheduler: one explicit object, passed to every module that needs it
 * (in the manner of libnvidia-container's `struct rpc *ctx`). Only entry points that have no
 * caller to hand it over (the hooks, the status API, the signal and fork handlers, the thread's
 * start routine) fetch it with gs_session_get(); everything below them takes `struct gs_session *`.
 *
 * The fields are grouped by the module that owns them; a module reads another's group only
 * through that module's functions, except for the few fields every module must see under the
 * lock (state, waiters, connected). All fields are under s->mu unless marked otherwise.
 *
 * Layering: see native/README.md. A file calls only files below it, never one above, so the
 * call graph between files has no cycle (tests/native/test_layering.py checks it).
 */
#ifndef GPUSHARE_SESSION_H
#define GPUSHARE_SESSION_H

#include <pthread.h>
#include <stdatomic.h>
#include <poll.h>
#include <stdint.h>

#include "base/protocol.h"
#include "base/shim.h"
#include "memory/api.h"

#define GS_RESUME_SECRET_LEN 32
#define GS_RESUME_HOLDING 1
#define GS_RESUME_WAITING 2

/* Identity said in HELLO (conn.c). Written once when the session starts. */
struct gs_identity {
    char client_id[128];
    char socket_path[108];
    char user[128];
    char token[160]; /* GPUSHARE_USER_TOKEN: proves `user` where many users share a uid */
    char kernel_secret[160]; /* GPUSHARE_KERNEL_SECRET: proves the kernel its id is bound to */
    char label[1024];
};

/* The application's contexts and their devices (device.c). A process may make several contexts,
 * on one device or several: a release drains every one of them. */
#define GS_MAX_CONTEXTS 16
struct gs_context {
    CUcontext ctx;
    CUdevice dev;
    int primary;
};
struct gs_devices {
    struct gs_context ctxs[GS_MAX_CONTEXTS];
    int n;
    int overflow; /* more contexts than the table holds: the release synchronises what it knows */
    CUdevice dev; /* the first context's device: the one registered with the scheduler */
    char uuid[48];
    char name[256];
    uint64_t total;
};

/* A device the process uses besides the first one (link.c): its own connection to the scheduler,
 * under the client id `<id>/<ordinal>`, so the process is a client of that device's pool too
 * (docs/protocol.md, "Several devices"). Under s->mu except rx, which only the thread uses. */
#define GS_MAX_LINKS 7
enum gs_link_state {
    GS_LINK_CONNECTING = 0, /* a context appeared on the device, or its connection was lost: the
                               thread connects once the first device's connection is up */
    GS_LINK_IDLE,      /* connected, not granted: calls on this device wait */
    GS_LINK_HOLDING,   /* granted: calls on this device pass */
    GS_LINK_RELEASING, /* a revoke drains this device's contexts */
    GS_LINK_UNSHARED,  /* no connection could be made: this device runs unshared */
};
/* What a connection last told the scheduler of its device's memory (the coalesced MEMORY). */
struct gs_mem_report {
    uint64_t gen_sent;
    struct gs_mem_totals sent;
    double sent_at;
};

struct gs_link {
    CUdevice dev;
    int fd;
    int state;
    int requested;    /* REQUEST sent, no GRANT yet */
    int waiters;      /* calls waiting for this device (also counted in s->waiters) */
    int tries;        /* connection attempts since it last had one */
    double next_connect_at;
    int want_request; /* a waiter asks the thread to send REQUEST */
    uint8_t rx[GS_PROTO_HEADER + 4096];
    size_t rx_len;
    struct gs_mem_report mem_report; /* thread side only */
};
struct gs_links {
    struct gs_link l[GS_MAX_LINKS];
    int n;
    int want_open; /* a waiter saw a context on a device without a link */
};

/* The socket (conn.c). rx/tx are used only by whoever does the socket I/O: the starting thread
 * during the first HELLO, then the shim's thread; never under the lock. */
struct gs_conn {
    int fd;
    int connected;
    int warned; /* the "not reachable" line was printed for this outage */
    int refused; /* the socket failed the trust check (said once, loudly) */
    double last_rx; /* when the scheduler last sent something (thread side) */
    double next_connect_at, backoff;
    uint8_t rx[GS_PROTO_HEADER + GS_PROTO_MAX_PAYLOAD + 4096];
    size_t rx_len;
    uint8_t tx[8192];
};

/* Losing the scheduler (docs/reliability.md): what to say when it comes back, and when a
 * non-holder stops waiting for it and runs unshared. */
struct gs_resume {
    int mode;          /* GS_RESUME_HOLDING or GS_RESUME_WAITING: said in the next HELLO */
    double since;      /* when that grant or that wait began */
    double unshare_at; /* > 0: the gate stays closed until then, waiting for the scheduler */
    /* The secret of the latest GRANT (thread side only): sent back with resume = 1. */
    char secret[GS_RESUME_SECRET_LEN + 1];
};

/* Time spent waiting and holding (status.c reports it). */
struct gs_stats {
    uint64_t waits;
    double wait_seconds, wait_began, holding_seconds, hold_since;
    /* The RESTOREDs sent after grants, and the last one's figures (the wait line's "restored"). */
    uint64_t restores, last_restore_bytes;
    double last_restore_seconds;
};

/* The last MEMORY report sent (thread side only, no lock). */

/* The memory engine behind this session. memory.c keeps its state in file statics today; the
 * engine rewrite gives it an explicit object, and this pointer is where the session holds it.
 * Every call from the session into memory goes through the gs_mem_* API. */
struct gs_mem_engine;

struct gs_session {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state;          /* enum gpushare_state; never WAITING (that is IDLE with waiters) */
    int started;        /* the session was started (or is starting) in this process */
    int thread_running;
    int quitting;       /* GOODBYE said or being said: gate open for good, no reconnects */
    int requested;      /* a REQUEST is outstanding (no GRANT yet) */
    int want_request;   /* a waiter asks the thread to send REQUEST */
    int want_release;   /* gpushare_release() asks the thread to release */
    int asleep;         /* SLEEP flag 1: the scheduler checkpointed this process (deep idle) */
    int waiters;
    uint64_t quantum_ms;
    double last_activity; /* idle.c */
    int idle_sent;        /* idle.c */
    struct gs_identity id;
    struct gs_devices devs;
    struct gs_links links;
    struct gs_conn conn;
    struct gs_resume resume;
    struct gs_stats stats;
    struct gs_mem_report mem_report;
    struct gs_mem_engine *mem;
    /* Waking the thread and waiting for it to finish (async-signal-safe: pipes and atomics). */
    int wake_pipe[2];
    int done_pipe[2];
    atomic_int wake_pending;
    atomic_int quit_requested;
};

/* ---- session.c ---- */

/* The process's one session (its lock and condition variable initialised). */
struct gs_session *gs_session_get(void);
/* Set the state and re-evaluate the gate; wakes every waiter. Under s->mu. */
void gs_session_set_state_locked(struct gs_session *s, int state);
/* Re-evaluate the gate word: open while the first device and every linked device are held (or
 * unshared), or the session quits. Wakes every waiter. Under s->mu. */
void gs_session_regate_locked(struct gs_session *s);
/* How many of s->waiters wait for a linked device (not the first). Under s->mu. */
int gs_session_link_waiters_locked(const struct gs_session *s);
/* The link of `dev`, or NULL (the first device has none). Under s->mu. */
struct gs_link *gs_session_link_locked(struct gs_session *s, CUdevice dev);
/* Wake the shim's thread. Async-signal-safe. */
void gs_session_wake(struct gs_session *s);
/* In a forked child: the parent's thread, connection and context are not the child's. */
void gs_session_reset_after_fork(struct gs_session *s);
void gs_session_close_pipes(struct gs_session *s);

static inline double gs_ms(double seconds) { return seconds * 1000.0; }

/* ---- device.c: the application's contexts and devices ---- */

/* Record a context the application made. Returns 1 when the session must start (the first
 * context), 0 otherwise. Under s->mu. */
int gs_device_note_context_locked(struct gs_session *s, CUcontext ctx, CUdevice dev, int primary);
/* The context is gone (destroyed, or a primary context released for good or reset). */
void gs_device_forget_context(struct gs_session *s, CUcontext ctx);
void gs_device_forget_primary(struct gs_session *s, CUdevice dev);
/* Whether the primary context of `dev` is still alive. */
int gs_device_primary_active(CUdevice dev);
/* The device of a context the session knows (for the memory engine). 0 when found. */
int gs_device_of_context(struct gs_session *s, CUcontext ctx, CUdevice *dev);
/* The context current on the calling thread, and its device. 0 on success. */
int gs_device_current(CUcontext *ctx, CUdevice *dev);
/* Make the application's first live context current on this (the shim's) thread. 0 on success. */
int gs_device_push(struct gs_session *s, CUdevice *dev_out);
/* The same for a context of device `dev` (its memory moves in its own context). */
int gs_device_push_on(struct gs_session *s, CUdevice dev);
void gs_device_pop(void);
/* Wait for the application's outstanding work in every live context. The number of contexts
 * that failed to synchronise (0: all drained; errors of a context already gone do not count). */
int gs_device_sync_all(struct gs_session *s);
/* The same for the contexts on one device only (a revoke of that device's link). */
int gs_device_sync_dev(struct gs_session *s, CUdevice dev);
/* The device a gated call works on: the context of its stream, else the current context.
 * 0 when known. */
int gs_device_of_call(struct gs_session *s, CUstream stream, CUdevice *dev);
/* UUID, name and total memory of `dev` into s->devs. */
void gs_device_identify(struct gs_session *s, CUdevice dev);
/* The same, of any device, into the given buffers (empty / 0 where the driver does not say). */
void gs_device_describe(CUdevice dev, char *uuid, size_t uuid_cap, char *name, size_t name_cap,
                        uint64_t *total);
/* Free and total memory of the device of the first live context (cuMemGetInfo). 0 on success. */
int gs_device_mem_info(struct gs_session *s, CUdevice dev, uint64_t *free_bytes,
                       uint64_t *total_bytes);

/* ---- drain.c: synchronising without failing a capture ---- */

/* How long a release waits for gated calls still inside the driver before it goes on anyway
 * (how long it waits for a capture to end is GPUSHARE_CAPTURE_WAIT; docs/reliability.md). */
#define GS_DRAIN_WAIT_S 5.0

/* Wait (bounded, logged) until no stream captures, holding new captures off: 1 then, and the
 * caller synchronises and calls gs_capture_unlock(); 0 when a capture outlived the bound. */
int gs_drain_quiesce(const char *what, double seconds);
/* Synchronise device `dev`'s contexts (every context when the process uses one device, or when
 * every_device) and, if `evict`, move device dev's movable memory to the host. Returns whether
 * the work drained; *evicted says whether the eviction succeeded. */
int gs_drain_work(struct gs_session *s, const char *what, CUdevice dev, int evict,
                  int every_device, int *evicted, uint64_t *moved, uint64_t *us);
/* Bring device dev's evicted memory back to it, once no stream captures (bounded). */
void gs_drain_restore(struct gs_session *s, const char *what, CUdevice dev, uint64_t *moved,
                      uint64_t *us);
/* The devices the process uses, the first device's first (devs: GS_MAX_LINKS + 1). */
int gs_drain_devices(struct gs_session *s, CUdevice *devs);
/* gs_drain_restore of every device (the process runs on unshared). */
void gs_drain_restore_every_device(struct gs_session *s, const char *what);

/* ---- socket_trust.c: which socket, and whether to trust it ---- */

void gs_socket_default_path(char *out, size_t cap);
/* Connect (non-blocking fd, bounded by timeout_ms) to the socket at path if it is trusted: its
 * directory and the socket checked on the opened directory and connected through it, the peer's
 * uid checked (SO_PEERCRED) before the caller sends anything. -1 with `why` set and *refused 1
 * for a refusal (an attack or a misconfiguration), 0 for an outage (missing, refused). */
int gs_socket_connect(const char *path, int timeout_ms, int *refused, char *why, size_t whylen);

/* ---- conn.c: the scheduler connection ---- */

void gs_conn_gather_identity(struct gs_session *s);
void gs_conn_begin(struct gs_session *s, struct gs_writer *w, uint8_t type);
void gs_conn_put_memory(struct gs_writer *w, const struct gs_mem_totals *t);
/* host_bytes and staging_bytes: the process's host memory (the first device's connection says
 * it for the process; a later device's link does not, so the node counts it once). */
void gs_conn_put_host(struct gs_writer *w, const struct gs_mem_totals *t);
/* Who speaks and what runs, as every HELLO says it: user, token, label, context estimate,
 * version. */
void gs_conn_put_identity(const struct gs_session *s, struct gs_writer *w);
/* Finish and send a frame on the current connection (thread side). 0 when sent. */
int gs_conn_send(struct gs_session *s, struct gs_writer *w);
void gs_conn_send_memory(struct gs_session *s);
/* 1 when *t differs from what *r last sent in anything the scheduler sees. */
int gs_conn_memory_differs(const struct gs_mem_report *r, const struct gs_mem_totals *t);
void gs_conn_send_request(struct gs_session *s);
/* Connect, say HELLO and wait for WELCOME (bounded). The fd, or -1 with `why` set. */
int gs_conn_handshake(struct gs_session *s, char *why, size_t whylen);
void gs_conn_connected_locked(struct gs_session *s, int fd, int reconnect);
void gs_conn_unreachable_locked(struct gs_session *s, const char *why, int lost);
void gs_conn_lost(struct gs_session *s, const char *why);
/* Ask the scheduler for its status on a second connection: 0 when it answers within a second. */
int gs_conn_probe(struct gs_session *s);
void gs_conn_apply_welcome(struct gs_session *s, const struct gs_msg *m);
/* How long connecting and the HELLO's answer may take. */
#define GS_CONNECT_TIMEOUT_S 0.5
/* Connect to the scheduler's socket (trust check, bounded): the fd, or -1 with `why` set. */
int gs_conn_connect(struct gs_session *s, char *why, size_t whylen);
/* Wait (until `deadline`) for the WELCOME that answers a HELLO on `fd`; frames after it stay in
 * rx. With a session, the WELCOME's pool, quota, quantum and resume verdict apply to it; without
 * (a link's connection), its pool and quota apply to device link_dev. 0 when welcomed, -1 with
 * `why` set. */
int gs_conn_await_welcome(struct gs_session *s, CUdevice link_dev, int fd, uint8_t *rx,
                          size_t cap, size_t *rx_len, double deadline, char *why, size_t whylen);
/* Send one finished frame on `fd` (bounded). 0 when sent. */
int gs_conn_send_fd(int fd, struct gs_writer *w);

/* ---- link.c: the devices after the first ---- */

/* Open a link for every device with a context but none yet (thread side). */
void gs_link_open_new(struct gs_session *s);
/* Send the REQUESTs waiters asked for (thread side). */
void gs_link_send_requests(struct gs_session *s);
/* Fill pollfds for the links' sockets; returns how many. */
int gs_link_pollfds(struct gs_session *s, struct pollfd *pfd, int cap, CUdevice *devs);
/* Read and handle what arrived on the link of `dev` (thread side). */
void gs_link_on_readable(struct gs_session *s, CUdevice dev);
/* The gs_life_wait_for_room of every linked device (thread side). */
void gs_link_wait_for_room(struct gs_session *s);
/* Give back every linked device this process holds (unsolicited RELEASED; thread side). */
void gs_link_release_all(struct gs_session *s, const char *reason);
/* MEMORY on every link whose device's memory changed (coalesced like the first device's);
 * returns 1 when a report waits for its minimum interval (thread side). */
int gs_link_report_memory(struct gs_session *s, double now, double min_interval);
/* GOODBYE on every link and close them (thread side, at exit). */
void gs_link_close_all(struct gs_session *s, int goodbye);

/* ---- lifecycle.c: grant, revoke, evict ---- */

void gs_life_release(struct gs_session *s, int evict, const char *reason, int solicited);
/* The first device's memory went past its grant's room (memory/api.h, gs_mem_past_room): give
 * the device back (no eviction) and ask for it again at once, so that the scheduler sees a waiter
 * whose deferred memory is on the host, and grants it with room once there is some. */
void gs_life_wait_for_room(struct gs_session *s);
/* The room a GRANT gives (its room_bytes; 1 for 0: no memory may be backed past the grant). */
static inline uint64_t gs_room_of(const struct gs_msg *m)
{
    uint64_t room = gs_msg_u64(m, GS_TAG_ROOM_BYTES, 0);
    return room ? room : 1;
}

/* Dispatch every complete frame in s->conn.rx. */
void gs_life_drain(struct gs_session *s);

/* ---- idle.c: the idle detector ---- */

void gs_idle_sample(struct gs_session *s, double now);
void gs_idle_check(struct gs_session *s, double now);

/* ---- thread.c: the shim's thread ---- */

/* Start the thread (s->thread_running says whether it did). Under s->mu. */
void gs_thread_start_locked(struct gs_session *s);

/* ---- process.c: fork, exit and the fatal signals ---- */

void gs_proc_install(struct gs_session *s);
/* SIGINT while waiting: install/remove the chaining handler, read its counter. */
void gs_sigint_begin(void);
void gs_sigint_end(void);
unsigned gs_sigint_count(void);

/* ---- start.c: starting the session from a context ---- */

void gs_start_on_context(struct gs_session *s, CUcontext ctx, CUdevice dev, int primary);
void gs_start_from_current(struct gs_session *s);

#endif /* GPUSHARE_SESSION_H */
