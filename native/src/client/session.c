/*
 * The session object: its lock, its condition variable, its state and the pipe that wakes the
 * shim's thread. The lowest layer of the client: it calls only the gate (to open or close it) and
 * the utilities, so that every other module, the memory engine included, may call it.
 */
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "gpushare.h"
#include "memory/client.h"
#include "session.h"

static struct gs_session the_session = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .conn = {.fd = -1},
    .wake_pipe = {-1, -1},
    .done_pipe = {-1, -1},
};
static pthread_once_t cv_once = PTHREAD_ONCE_INIT;

static void init_cv(struct gs_session *s)
{
    /* CLOCK_MONOTONIC: the 20 ms wait slices must not jump with the wall clock. */
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &a);
    pthread_condattr_destroy(&a);
}

static void init_once(void) { init_cv(&the_session); }

struct gs_session *gs_session_get(void)
{
    pthread_once(&cv_once, init_once);
    return &the_session;
}

void gs_session_regate_locked(struct gs_session *s)
{
    /* One gate word for every device keeps the fast path one load: it is open only while every
     * device the process uses is held. When some are not, calls take the slow path, which lets a
     * call through on a device that is held (wait.c). */
    int open = s->state == GPUSHARE_STATE_HOLDING;
    for (int i = 0; i < s->links.n && open; i++)
        open = s->links.l[i].state == GS_LINK_HOLDING || s->links.l[i].state == GS_LINK_UNSHARED;
    /* Unshared (no scheduler), every device runs, whatever its link's state. */
    gs_gate_set_open(open || s->state == GPUSHARE_STATE_UNSHARED || s->quitting);
    pthread_cond_broadcast(&s->cv);
}

void gs_session_set_state_locked(struct gs_session *s, int state)
{
    s->state = state;
    gs_session_regate_locked(s);
}

int gs_session_link_waiters_locked(const struct gs_session *s)
{
    int n = 0;
    for (int i = 0; i < s->links.n; i++)
        n += s->links.l[i].waiters;
    return n;
}

struct gs_link *gs_session_link_locked(struct gs_session *s, CUdevice dev)
{
    for (int i = 0; i < s->links.n; i++)
        if (s->links.l[i].dev == dev)
            return &s->links.l[i];
    return NULL;
}

void gs_session_wake(struct gs_session *s)
{
    if (s->wake_pipe[1] >= 0 && !atomic_exchange(&s->wake_pending, 1)) {
        ssize_t w = write(s->wake_pipe[1], "w", 1);
        (void)w;
    }
}

static void close_pipe(int p[2])
{
    for (int i = 0; i < 2; i++) {
        if (p[i] >= 0)
            close(p[i]);
        p[i] = -1;
    }
}

void gs_session_close_pipes(struct gs_session *s)
{
    close_pipe(s->wake_pipe);
    close_pipe(s->done_pipe);
}

void gs_session_reset_after_fork(struct gs_session *s)
{
    /* The child has the parent's memory but not its thread, its CUDA context or its place with the
     * scheduler: it starts over as INACTIVE and registers itself if it uses CUDA. */
    pthread_mutex_init(&s->mu, NULL);
    init_cv(s);
    if (s->conn.fd >= 0)
        close(s->conn.fd); /* the child's copy only; the parent's connection is untouched */
    s->conn.fd = -1;
    for (int i = 0; i < s->links.n; i++)
        if (s->links.l[i].fd >= 0)
            close(s->links.l[i].fd); /* the child's copies, as above */
    memset(&s->links, 0, sizeof s->links);
    s->conn.connected = s->started = s->thread_running = s->quitting = 0;
    s->requested = s->want_request = s->want_release = s->waiters = s->conn.warned = 0;
    s->devs.n = 0;
    s->id.client_id[0] = s->devs.uuid[0] = 0;
    s->conn.rx_len = 0;
    s->conn.backoff = 0;
    s->stats.holding_seconds = s->stats.wait_seconds = 0;
    s->stats.waits = 0;
    s->state = GPUSHARE_STATE_INACTIVE;
    gs_session_close_pipes(s);
    atomic_store(&s->wake_pending, 0);
    atomic_store(&s->quit_requested, 0);
    gs_gate_set_open(0);
}

/* ---- what the memory engine needs of the client (memory/client.h) ---- */

void gs_client_wake(void) { gs_session_wake(&the_session); }

int gs_client_has_context(void)
{
    struct gs_session *s = gs_session_get();
    pthread_mutex_lock(&s->mu);
    int r = s->started && s->devs.n > 0;
    pthread_mutex_unlock(&s->mu);
    return r;
}

int gs_client_device_matches_uuid(const char *uuid)
{
    struct gs_session *s = gs_session_get();
    pthread_mutex_lock(&s->mu);
    int r = !s->devs.uuid[0] || strcasecmp(uuid, s->devs.uuid) == 0;
    pthread_mutex_unlock(&s->mu);
    return r;
}
