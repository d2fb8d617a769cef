/*
 * The shim's thread: it owns all socket I/O after the first HELLO. It sends REQUEST when a waiter
 * asks, handles the scheduler's messages (lifecycle.c), reports memory (coalesced), runs the idle
 * detector, reconnects after a loss, and says GOODBYE at exit.
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gpushare.h"
#include "session.h"

#define MEMORY_REPORT_MIN_S 0.05

static void try_reconnect(struct gs_session *s)
{
    char why[160] = "";
    int fd = gs_conn_handshake(s, why, sizeof why);
    pthread_mutex_lock(&s->mu);
    if (fd >= 0 && !s->quitting) {
        gs_conn_connected_locked(s, fd, 1);
    } else {
        if (fd >= 0)
            close(fd);
        if (!s->quitting)
            gs_conn_unreachable_locked(s, why, 0);
    }
    int ok = s->conn.connected;
    pthread_mutex_unlock(&s->mu);
    if (ok) {
        gs_conn_send_memory(s);
        gs_life_drain(s);
    }
}

/* A waiter that runs unshared after losing the scheduler: its evicted memory comes back only if
 * the card has room for it now (another kernel may hold the GPU and most of its memory). What
 * does not fit moves back page by page, on demand. Each device on its own. */
static void restore_within_free(struct gs_session *s)
{
    gs_mem_back_deferred(GS_MEM_ALL_DEVICES);
    CUdevice devs[GS_MAX_LINKS + 1];
    int n = gs_drain_devices(s, devs);
    for (int i = 0; i < n; i++) {
        struct gs_mem_totals t;
        gs_mem_totals_dev(devs[i], &t);
        if (!t.evicted)
            continue;
        uint64_t free_bytes = 0, total = 0, moved, us;
        char a[32], b[32];
        if (gs_device_mem_info(s, devs[i], &free_bytes, &total) != 0 || t.evicted > free_bytes) {
            GS_WARN("not restoring %s of evicted memory: only %s free on device %d",
                    gs_format_size(t.evicted, a, sizeof a),
                    gs_format_size(free_bytes, b, sizeof b), (int)devs[i]);
            continue;
        }
        gs_drain_restore(s, "the restore when running unshared", devs[i], &moved, &us);
    }
}

/* A scheduler that hangs with its connection open sends nothing: a waiter that heard nothing for
 * GPUSHARE_RECONNECT_WAIT seconds asks it for its status on a second connection, and one that
 * gets no answer treats the scheduler as lost (then runs unshared after the same wait). */
static void probe_if_silent(struct gs_session *s, double now)
{
    double window = gs_config()->reconnect_wait;
    pthread_mutex_lock(&s->mu);
    int waiting = s->conn.connected && s->waiters > 0 && s->state == GPUSHARE_STATE_IDLE;
    double since = s->conn.last_rx > s->stats.wait_began ? s->conn.last_rx : s->stats.wait_began;
    pthread_mutex_unlock(&s->mu);
    if (!waiting || window <= 0 || now - since < window)
        return;
    if (gs_conn_probe(s) == 0) {
        s->conn.last_rx = gs_now(); /* alive, only busy: look again after another window */
        return;
    }
    char why[96];
    snprintf(why, sizeof why, "it answered nothing for %.1f s", gs_now() - since);
    gs_conn_lost(s, why);
}

static void do_quit(struct gs_session *s)
{
    gs_mem_back_deferred(GS_MEM_ALL_DEVICES); /* the gate opens for good below */
    pthread_mutex_lock(&s->mu);
    s->quitting = 1;
    if (s->state == GPUSHARE_STATE_HOLDING)
        s->stats.holding_seconds += gs_now() - s->stats.hold_since;
    int connected = s->conn.connected;
    gs_session_set_state_locked(s, s->state); /* re-evaluates the gate: open for good */
    pthread_mutex_unlock(&s->mu);

    /* Bounded by the quit's own wait: a capture still running at exit is not failed. */
    if (gs_drain_quiesce("the goodbye", 1.0)) {
        gs_device_sync_all(s);
        gs_capture_unlock();
    }
    if (connected) {
        struct gs_writer w;
        gs_conn_begin(s, &w, GS_MSG_GOODBYE);
        gs_conn_send(s, &w);
    }
    gs_link_close_all(s, 1);
    pthread_mutex_lock(&s->mu);
    if (s->conn.fd >= 0)
        close(s->conn.fd);
    s->conn.fd = -1;
    s->conn.connected = 0;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    GS_DEBUG("said goodbye to the scheduler");
}

static void *thread_main(void *arg)
{
    struct gs_session *s = arg;
    /* Signals belong to the program's threads: SIGINT must reach the waiting thread (Python's main
     * thread), not ours. */
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);

    gs_life_drain(s); /* frames that arrived together with WELCOME */
    if (s->conn.connected)
        gs_conn_send_memory(s);
    for (;;) {
        if (atomic_load(&s->quit_requested)) {
            do_quit(s);
            break;
        }
        double now = gs_now();
        pthread_mutex_lock(&s->mu);
        int reconnect = !s->conn.connected && !s->quitting && now >= s->conn.next_connect_at;
        int unshared = 0;
        if (!s->conn.connected && s->resume.unshare_at > 0 && now >= s->resume.unshare_at) {
            s->resume.unshare_at = 0;
            if (s->state == GPUSHARE_STATE_IDLE) {
                if (gs_config()->reconnect_wait > 0) /* else the loss said it runs unshared */
                    GS_WARN("the scheduler did not come back within %.1f s: running unshared",
                            gs_config()->reconnect_wait);
                s->resume.mode = 0; /* it runs now: no place in a queue to claim back */
                unshared = 1;
            }
        }
        pthread_mutex_unlock(&s->mu);
        if (unshared) {
            /* Memory first, then the gate: a call let through before its block is backed would
             * reach an address with nothing mapped (as the grant does, lifecycle.c). Only this
             * thread connects, so the state is still idle and unconnected here. */
            restore_within_free(s);
            pthread_mutex_lock(&s->mu);
            gs_session_set_state_locked(s, GPUSHARE_STATE_UNSHARED);
            pthread_mutex_unlock(&s->mu);
        }
        if (reconnect)
            try_reconnect(s);
        else
            probe_if_silent(s, now);

        pthread_mutex_lock(&s->mu);
        int do_request = s->conn.connected && s->want_request && s->state == GPUSHARE_STATE_IDLE &&
                         !s->requested && s->waiters > 0;
        if (do_request)
            s->requested = 1;
        s->want_request = 0;
        int do_release = s->want_release;
        int holding = s->state == GPUSHARE_STATE_HOLDING;
        if (do_release && !(s->conn.connected && holding)) {
            s->want_release = 0;
            do_release = 0;
            pthread_cond_broadcast(&s->cv);
        }
        int connected = s->conn.connected;
        int fd = s->conn.fd;
        double next_connect = s->conn.next_connect_at;
        pthread_mutex_unlock(&s->mu);

        if (do_request)
            gs_conn_send_request(s);
        gs_link_open_new(s);
        gs_link_send_requests(s);
        if (do_release) {
            gs_link_release_all(s, "released by the program");
            gs_life_release(s, 0, "released by the program", 0);
        }
        /* Memory past a grant's room: that device is given back and asked for again, before any
         * MEMORY report could show a holder with memory the scheduler would think resident. */
        gs_life_wait_for_room(s);
        gs_link_wait_for_room(s);

        now = gs_now();
        gs_idle_sample(s, now);
        int mem_dirty = 0;
        if (connected) {
            if (gs_mem_generation() != s->mem_report.gen_sent) {
                struct gs_mem_totals t;
                gs_mem_totals_dev(s->devs.dev, &t);
                /* Read after the totals: a block past the room sets the bit before it counts. */
                int past = gs_mem_past_room() >> gs_mem_slot(s->devs.dev) & 1u;
                pthread_mutex_lock(&s->mu);
                past = past && s->state == GPUSHARE_STATE_HOLDING;
                pthread_mutex_unlock(&s->mu);
                if (past)
                    mem_dirty = 1; /* the next pass gives the device back first (above) */
                else if (!gs_conn_memory_differs(&s->mem_report, &t))
                    s->mem_report.gen_sent = gs_mem_generation(); /* nothing the scheduler would see */
                else if (now - s->mem_report.sent_at >= MEMORY_REPORT_MIN_S)
                    gs_conn_send_memory(s);
                else
                    mem_dirty = 1;
            }
            mem_dirty |= gs_link_report_memory(s, now, MEMORY_REPORT_MIN_S);
            gs_idle_check(s, now);
        }

        /* Sleep until a message, a wake-up, or the next thing to do. */
        int timeout_ms;
        if (!connected) {
            double until = next_connect;
            pthread_mutex_lock(&s->mu);
            if (s->resume.unshare_at > 0 && s->resume.unshare_at < until)
                until = s->resume.unshare_at;
            pthread_mutex_unlock(&s->mu);
            timeout_ms = (int)((until - now) * 1000) + 1;
        }
        else if (mem_dirty)
            timeout_ms = (int)(MEMORY_REPORT_MIN_S * 1000);
        else if (holding && gs_config()->idle_seconds > 0)
            timeout_ms = 100;
        else if (!holding && s->waiters > 0)
            timeout_ms = 250; /* probe_if_silent's clock */
        else
            timeout_ms = 1000;
        if (timeout_ms < 1)
            timeout_ms = 1;
        struct pollfd pfd[2 + GS_MAX_LINKS] = {{s->wake_pipe[0], POLLIN, 0},
                                               {connected ? fd : -1, POLLIN, 0}};
        CUdevice link_devs[GS_MAX_LINKS];
        int nlinks = gs_link_pollfds(s, pfd + 2, GS_MAX_LINKS, link_devs);
        int pr = poll(pfd, (nfds_t)(2 + nlinks), timeout_ms);
        if (pr <= 0)
            continue;
        for (int i = 0; i < nlinks; i++)
            if (pfd[2 + i].revents & (POLLIN | POLLHUP | POLLERR))
                gs_link_on_readable(s, link_devs[i]);
        if (pfd[0].revents & POLLIN) {
            char buf[64];
            atomic_store(&s->wake_pending, 0);
            while (read(s->wake_pipe[0], buf, sizeof buf) > 0) {
            }
        }
        if (connected && (pfd[1].revents & (POLLIN | POLLHUP | POLLERR))) {
            ssize_t r = recv(fd, s->conn.rx + s->conn.rx_len, sizeof s->conn.rx - s->conn.rx_len, 0);
            if (r == 0)
                gs_conn_lost(s, "the scheduler closed the connection");
            else if (r < 0 && errno != EINTR && errno != EAGAIN)
                gs_conn_lost(s, strerror(errno));
            else if (r > 0) {
                s->conn.rx_len += (size_t)r;
                s->conn.last_rx = gs_now();
                gs_life_drain(s);
            }
        }
    }
    ssize_t w = write(s->done_pipe[1], "d", 1);
    (void)w;
    return NULL;
}


void gs_thread_start_locked(struct gs_session *s)
{
    if (s->wake_pipe[0] < 0)
        return;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t tid;
    /* The thread starts with every signal blocked, before it can run a single instruction with
     * SIGINT deliverable. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    if (pthread_create(&tid, &attr, thread_main, s) == 0) {
        s->thread_running = 1;
        pthread_setname_np(tid, "gpushare");
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}
