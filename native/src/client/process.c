/*
 * Fork, exit and signals: the quit path (atexit and the fatal signals make the shim's thread
 * synchronise and say GOODBYE, bounded), the fork handlers (a child starts over), and the chaining
 * SIGINT handler that lets Ctrl-C / a Jupyter interrupt end a wait for the device.
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "session.h"

#define QUIT_WAIT_MS 5000

/* Ask the thread to synchronise and say GOODBYE; wait for it at most QUIT_WAIT_MS.
 * Async-signal-safe (atomics, write, poll): the signal handlers below call it. The work itself
 * (cuCtxSynchronize, the socket) happens on the shim's thread, never in the handler: neither the
 * driver nor our locks may be entered from a handler that interrupted a thread holding them. If
 * the interrupted thread does hold something the shim's thread then needs (a driver lock, s->mu),
 * the wait runs out after QUIT_WAIT_MS and the process ends anyway: bounded, never a hang. */
static void quit_and_wait(struct gs_session *s)
{
    if (!s->thread_running || s->done_pipe[0] < 0)
        return;
    atomic_store(&s->quit_requested, 1);
    if (s->wake_pipe[1] >= 0) {
        ssize_t w = write(s->wake_pipe[1], "q", 1);
        (void)w;
    }
    struct pollfd pfd = {s->done_pipe[0], POLLIN, 0};
    while (poll(&pfd, 1, QUIT_WAIT_MS) < 0 && errno == EINTR) {
    }
}

static void at_exit(void) { quit_and_wait(gs_session_get()); }

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
    quit_and_wait(gs_session_get());
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
    struct gs_session *s = gs_session_get();
    pthread_mutex_lock(&s->mu);
    gs_mem_lock_for_fork();
    gs_streams_lock();
}

static void fork_parent(void)
{
    struct gs_session *s = gs_session_get();
    gs_streams_unlock();
    gs_mem_unlock_after_fork();
    pthread_mutex_unlock(&s->mu);
}

static void fork_child(void)
{
    gs_streams_after_fork_child();
    gs_capture_after_fork_child();
    gs_calls_after_fork_child();
    gs_mem_after_fork_child();
    gs_session_reset_after_fork(gs_session_get());
}

/* atexit, pthread_atfork (each once per process) and the quit handlers. */
void gs_proc_install(struct gs_session *s)
{
    static int atexit_registered, atfork_registered;
    if (!atexit_registered) {
        atexit_registered = 1;
        atexit(at_exit);
    }
    if (!atfork_registered) {
        atfork_registered = 1;
        pthread_atfork(fork_prepare, fork_parent, fork_child);
    }
    install_quit_handlers();
}

/* ---- SIGINT while waiting ---- */

static atomic_uint sigint_count;
static struct sigaction sigint_prev;
static int sigint_installed;

static void on_sigint(int sig, siginfo_t *info, void *uctx)
{
    int saved = errno;
    atomic_fetch_add_explicit(&sigint_count, 1, memory_order_relaxed);
    /* Chain, so the program sees its interrupt (Python raises KeyboardInterrupt). */
    if (sigint_prev.sa_flags & SA_SIGINFO) {
        if (sigint_prev.sa_sigaction)
            sigint_prev.sa_sigaction(sig, info, uctx);
    } else if (sigint_prev.sa_handler == SIG_DFL) {
        /* Without us the process would have died of SIGINT: let it. */
        sigaction(SIGINT, &sigint_prev, NULL);
        raise(SIGINT);
    } else if (sigint_prev.sa_handler != SIG_IGN) {
        sigint_prev.sa_handler(sig);
    }
    errno = saved;
}

unsigned gs_sigint_count(void) { return atomic_load_explicit(&sigint_count, memory_order_relaxed); }

/* Called by the client, under its lock, when the first waiter starts / the last one ends. */
void gs_sigint_begin(void)
{
    struct sigaction cur;
    if (sigint_installed || sigaction(SIGINT, NULL, &cur) != 0)
        return;
    if (!(cur.sa_flags & SA_SIGINFO) && cur.sa_handler == SIG_IGN)
        return; /* an ignored interrupt must not end the wait either */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigint;
    sa.sa_flags = SA_SIGINFO | SA_RESTART | (cur.sa_flags & SA_ONSTACK);
    sigemptyset(&sa.sa_mask);
    sigint_prev = cur;
    if (sigaction(SIGINT, &sa, NULL) == 0)
        sigint_installed = 1;
}

void gs_sigint_end(void)
{
    struct sigaction cur;
    if (!sigint_installed)
        return;
    sigint_installed = 0;
    /* Put the previous handler back only if ours is still in place: the program may have
     * installed a new one meanwhile, and that one wins. */
    if (sigaction(SIGINT, NULL, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) &&
        cur.sa_sigaction == on_sigint)
        sigaction(SIGINT, &sigint_prev, NULL);
}
