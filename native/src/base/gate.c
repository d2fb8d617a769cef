/*
 * The work gate. Every work-submission entry point calls gs_gate_enter() (shim.h): while the
 * process holds the device the gate word is 1 and the call goes straight on. Otherwise the call
 * lands in gs_gate_slow(), which waits (client/wait.c) until the scheduler grants the device.
 *
 * Also here: the per-thread call counters and the table of recently used streams (for the idle
 * detector). The slow path itself is wait.c's.
 */
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

/* <linux/membarrier.h> values, spelled out: the header is not on every build host. */
#define GS_MEMBARRIER_CMD_PRIVATE_EXPEDITED (1 << 3)
#define GS_MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED (1 << 4)

/* Closed until the process has a context and a scheduler verdict: the first gated call then finds
 * out what to do in the slow path (start the client, or pass through when there is no context). */
atomic_int gs_gate_word = 0;
atomic_int gs_activity = 0;
_Atomic(uintptr_t) gs_stream_slots[GS_STREAM_SLOTS];

static pthread_mutex_t streams_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int streams_overflow;

/* ---- per-thread call counters ---- */

__thread struct gs_thread_calls gs_tl_calls __attribute__((tls_model("initial-exec")));
static pthread_mutex_t calls_mu = PTHREAD_MUTEX_INITIALIZER;
static struct gs_thread_calls *calls_list;
static uint64_t calls_retired; /* counts of threads that have exited */
/* A thread that used its per-thread stream exited: work it queued may still run. */
static atomic_int ptds_retired;
static pthread_key_t calls_key;
static pthread_once_t calls_once = PTHREAD_ONCE_INIT;
static int calls_key_ok;

static void retire_thread_calls(void *arg)
{
    struct gs_thread_calls *me = arg;
    pthread_mutex_lock(&calls_mu);
    for (struct gs_thread_calls **pp = &calls_list; *pp; pp = &(*pp)->next)
        if (*pp == me) {
            *pp = me->next;
            break;
        }
    calls_retired += atomic_load_explicit(&me->calls, memory_order_relaxed);
    if (atomic_load_explicit(&me->ptds, memory_order_relaxed))
        atomic_store_explicit(&ptds_retired, 1, memory_order_relaxed);
    pthread_mutex_unlock(&calls_mu);
}

static void make_calls_key(void) { calls_key_ok = pthread_key_create(&calls_key, retire_thread_calls) == 0; }

void gs_register_thread_calls(void)
{
    pthread_once(&calls_once, make_calls_key);
    /* Without a key the counter could not be unlinked at thread exit: leave it out then. */
    if (!calls_key_ok || pthread_setspecific(calls_key, &gs_tl_calls) != 0)
        return;
    pthread_mutex_lock(&calls_mu);
    gs_tl_calls.next = calls_list;
    calls_list = &gs_tl_calls;
    pthread_mutex_unlock(&calls_mu);
}

uint64_t gs_total_gated_calls(void)
{
    pthread_mutex_lock(&calls_mu);
    uint64_t total = calls_retired;
    for (struct gs_thread_calls *c = calls_list; c; c = c->next)
        total += atomic_load_explicit(&c->calls, memory_order_relaxed);
    pthread_mutex_unlock(&calls_mu);
    return total;
}

void gs_calls_after_fork_child(void)
{
    /* Only the forking thread lives on in the child: restart the list with it. */
    pthread_mutex_init(&calls_mu, NULL);
    calls_list = NULL;
    calls_retired = 0;
    if (atomic_load_explicit(&gs_tl_calls.calls, memory_order_relaxed)) {
        atomic_store_explicit(&gs_tl_calls.calls, 0, memory_order_relaxed);
    }
    atomic_store_explicit(&gs_tl_calls.inflight, 0, memory_order_relaxed);
    atomic_store_explicit(&gs_tl_calls.ptds, 0, memory_order_relaxed);
    atomic_store_explicit(&ptds_retired, 0, memory_order_relaxed);
}

atomic_int gs_gate_self_fence;
static int membarrier_ok;
static pthread_once_t barrier_once = PTHREAD_ONCE_INIT;

static void choose_barrier(void)
{
#ifdef SYS_membarrier
    membarrier_ok =
        syscall(SYS_membarrier, GS_MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
#endif
    atomic_store_explicit(&gs_gate_self_fence, !membarrier_ok, memory_order_relaxed);
}

/* A full barrier on every thread of the process (or, without membarrier, on this one: the
 * others fence themselves on every gated call). */
static void barrier_all_threads(void)
{
#ifdef SYS_membarrier
    if (membarrier_ok && syscall(SYS_membarrier, GS_MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0)
        return;
#endif
    atomic_thread_fence(memory_order_seq_cst);
}

static int count_inflight(void)
{
    int n = 0;
    pthread_mutex_lock(&calls_mu);
    for (struct gs_thread_calls *c = calls_list; c; c = c->next)
        n += atomic_load_explicit(&c->inflight, memory_order_acquire) != 0;
    pthread_mutex_unlock(&calls_mu);
    return n;
}

int gs_gate_drain(double seconds)
{
    barrier_all_threads();
    double deadline = gs_now() + seconds;
    int n;
    while ((n = count_inflight()) > 0 && gs_now() < deadline) {
        struct timespec ts = {0, 100000}; /* 100 us: a call in flight is a few microseconds */
        nanosleep(&ts, NULL);
    }
    return n;
}

void gs_gate_set_open(int open)
{
    if (open) /* before the gate first opens: the fast path reads gs_gate_self_fence */
        pthread_once(&barrier_once, choose_barrier);
    /* release: work the client thread did before opening (a restore) happens-before the calls
     * that see the gate open. One read-modify-write of the one word: a hold set meanwhile is
     * never overwritten (the word is open only while it is exactly 1). */
    if (open)
        atomic_fetch_or_explicit(&gs_gate_word, GS_GATE_GRANTED, memory_order_acq_rel);
    else
        atomic_fetch_and_explicit(&gs_gate_word, ~GS_GATE_GRANTED, memory_order_acq_rel);
}

void gs_gate_hold(unsigned devices)
{
    atomic_fetch_or_explicit(&gs_gate_word, (int)((devices & GS_GATE_HOLD_MASK) << 1),
                             memory_order_acq_rel);
}

void gs_gate_unhold(unsigned devices)
{
    atomic_fetch_and_explicit(&gs_gate_word, ~(int)((devices & GS_GATE_HOLD_MASK) << 1),
                              memory_order_acq_rel);
}

unsigned gs_gate_holds(void)
{
    return ((unsigned)atomic_load_explicit(&gs_gate_word, memory_order_acquire) >> 1) &
           GS_GATE_HOLD_MASK;
}

void gs_streams_after_fork_child(void)
{
    pthread_mutex_init(&streams_mu, NULL);
    for (int i = 0; i < GS_STREAM_SLOTS; i++)
        atomic_store_explicit(&gs_stream_slots[i], 0, memory_order_relaxed);
    atomic_store_explicit(&streams_overflow, 0, memory_order_relaxed);
}

/* ---- streams ---- */

void gs_streams_lock(void) { pthread_mutex_lock(&streams_mu); }
void gs_streams_unlock(void) { pthread_mutex_unlock(&streams_mu); }

/* A stream not at its home slot: find it further on, or take the first free slot. A full set is
 * remembered: the detector then cannot know every stream and answers "busy". */

void gs_note_stream_slow(uintptr_t v, unsigned slot)
{
    for (unsigned i = 0; i < GS_STREAM_SLOTS; i++) {
        unsigned k = (slot + i) & (GS_STREAM_SLOTS - 1);
        uintptr_t cur = atomic_load_explicit(&gs_stream_slots[k], memory_order_relaxed);
        if (cur == v)
            return;
        if (cur == 0) {
            uintptr_t expected = 0;
            if (atomic_compare_exchange_strong(&gs_stream_slots[k], &expected, v) ||
                expected == v)
                return;
        }
    }
    atomic_store_explicit(&streams_overflow, 1, memory_order_relaxed);
}

int gs_streams_ptds_used(void)
{
    int used = 0;
    pthread_mutex_lock(&calls_mu);
    for (struct gs_thread_calls *c = calls_list; c && !used; c = c->next)
        used = atomic_load_explicit(&c->ptds, memory_order_relaxed);
    pthread_mutex_unlock(&calls_mu);
    return used || atomic_load_explicit(&ptds_retired, memory_order_relaxed);
}

void gs_stream_forget(CUstream s)
{
    uintptr_t v = (uintptr_t)s;
    for (int i = 0; i < GS_STREAM_SLOTS; i++) {
        uintptr_t cur = v;
        atomic_compare_exchange_strong(&gs_stream_slots[i], &cur, 0);
    }
}

int gs_streams_busy(void)
{
    typedef CUresult (*query_fn)(CUstream);
    static query_fn query;
    if (!query)
        query = (query_fn)gs_driver_sym("cuStreamQuery");
    if (!query)
        return 0;
    int busy = 0;
    gs_streams_lock();
    for (int i = 0; i < GS_STREAM_SLOTS; i++) {
        uintptr_t v = atomic_load_explicit(&gs_stream_slots[i], memory_order_relaxed);
        if (!v)
            continue;
        CUresult r = query((CUstream)v);
        if (r == CUDA_ERROR_NOT_READY) {
            busy = 1;
        } else if (r != CUDA_SUCCESS) {
            /* Gone, or from another context: stop asking about it. */
            uintptr_t cur = v;
            atomic_compare_exchange_strong(&gs_stream_slots[i], &cur, 0);
        }
    }
    gs_streams_unlock();
    return busy || atomic_load_explicit(&streams_overflow, memory_order_relaxed);
}

CUresult gs_stream_destroy(gs_fn_cuStreamDestroy_v2 real, CUstream hStream)
{
    /* Under the lock, so the idle detector never queries a handle being destroyed. */
    gs_streams_lock();
    gs_stream_forget(hStream);
    CUresult r = real(hStream);
    gs_streams_unlock();
    /* After the streams' lock: the idle detector takes the capture lock, then this one. */
    if (r == CUDA_SUCCESS)
        gs_capture_forget_stream(hStream);
    return r;
}
