/*
 * The memory engine's CPU workers: a few threads (GPUSHARE_STAGING_THREADS, the caller being one
 * of them) for the host work that one thread does too slowly. Faulting in fresh host memory runs
 * at ~4 GB/s per core (0.25 s per GiB in 4 KiB pages on one thread); a 20 GiB staging buffer or
 * an eviction through the bounce ring into pageable memory needs several cores to keep up with
 * the bus (50 GB/s on an H100).
 *
 * gs_workers_run() runs one batch at a time: a caller with more work (a staging buffer of many
 * pieces) runs it as several short batches, so an eviction that needs the workers waits at most
 * for one batch of another caller's, never for a whole buffer.
 */
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "memory.h"

#define MAX_WORKERS 64

static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER; /* one batch at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER, done_cv = PTHREAD_COND_INITIALIZER;
static unsigned started, generation, parts, next_part, parts_done;
static void (*job_fn)(void *, unsigned);
static void *job_arg;

/* Take parts of the current batch until none is left (mu held; let go while a part runs). */
static void take_parts_locked(void)
{
    while (next_part < parts) {
        unsigned i = next_part++;
        void (*fn)(void *, unsigned) = job_fn;
        void *arg = job_arg;
        pthread_mutex_unlock(&mu);
        fn(arg, i);
        pthread_mutex_lock(&mu);
        if (++parts_done == parts)
            pthread_cond_broadcast(&done_cv);
    }
}

static void *worker(void *unused)
{
    (void)unused;
    int nice_value = gs_config()->staging_nice;
    if (nice_value && setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice_value) != 0)
        GS_DEBUG("a memory worker keeps the process's priority");
    pthread_mutex_lock(&mu);
    unsigned seen = generation;
    for (;;) {
        while (generation == seen)
            pthread_cond_wait(&work_cv, &mu);
        seen = generation;
        take_parts_locked();
    }
    return NULL;
}

static void start_locked(void)
{
    unsigned want = gs_config()->staging_threads;
    want = want > MAX_WORKERS ? MAX_WORKERS : want;
    while (started + 1 < want) { /* the caller is one of them */
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&t, &attr, worker, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) {
            GS_DEBUG("the memory engine runs with %u CPU worker(s)", started + 1);
            break;
        }
        started++;
    }
}

unsigned gs_workers_count(void)
{
    unsigned n = gs_config()->staging_threads;
    return n < 1 ? 1 : n > MAX_WORKERS ? MAX_WORKERS : n;
}

void gs_workers_run(void (*fn)(void *, unsigned), void *arg, unsigned n)
{
    if (!n)
        return;
    pthread_mutex_lock(&run_mu);
    pthread_mutex_lock(&mu);
    start_locked();
    job_fn = fn;
    job_arg = arg;
    parts = n;
    next_part = parts_done = 0;
    generation++;
    pthread_cond_broadcast(&work_cv);
    take_parts_locked(); /* the caller works too: with no worker started it does it all */
    while (parts_done < parts)
        pthread_cond_wait(&done_cv, &mu);
    parts = 0;
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&run_mu);
}

void gs_workers_after_fork_child(void)
{
    /* Threads do not survive fork: the child starts its own when it needs them. */
    pthread_mutex_init(&run_mu, NULL);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&work_cv, NULL);
    pthread_cond_init(&done_cv, NULL);
    started = generation = parts = next_part = parts_done = 0;
}
