/*
 * The work gate. Every work-submission entry point calls gs_gate_enter() (shim.h): while the
 * process holds the device the gate word is 1 and the call goes straight on. Otherwise the call
 * lands in gs_gate_slow(), which waits (client.c) until the scheduler grants the device.
 *
 * Also here: the per-thread call counters and the table of recently used streams (for the idle
 * detector). The slow path itself is wait.c's.
 */
#include "shim.h"

/* Closed until the process has a context and a scheduler verdict: the first gated call then finds
 * out what to do in the slow path (start the client, or pass through when there is no context). */
atomic_int gs_gate_word = 0;
atomic_int gs_activity = 0;
_Atomic(uintptr_t) gs_stream_slots[GS_STREAM_SLOTS];

static pthread_mutex_t streams_mu = PTHREAD_MUTEX_INITIALIZER;

/* ---- per-thread call counters ---- */

__thread struct gs_thread_calls gs_tl_calls __attribute__((tls_model("initial-exec")));
static pthread_mutex_t calls_mu = PTHREAD_MUTEX_INITIALIZER;
static struct gs_thread_calls *calls_list;
static uint64_t calls_retired; /* counts of threads that have exited */
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
}

void gs_gate_set_open(int open)
{
    /* release: work the client thread did before opening (a restore) happens-before the calls
     * that see the gate open. */
    atomic_store_explicit(&gs_gate_word, open ? 1 : 0, memory_order_release);
}

void gs_streams_after_fork_child(void)
{
    pthread_mutex_init(&streams_mu, NULL);
    for (int i = 0; i < GS_STREAM_SLOTS; i++)
        atomic_store_explicit(&gs_stream_slots[i], 0, memory_order_relaxed);
}

/* ---- streams ---- */

void gs_streams_lock(void) { pthread_mutex_lock(&streams_mu); }
void gs_streams_unlock(void) { pthread_mutex_unlock(&streams_mu); }

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
    return busy;
}

CUresult gs_stream_destroy(gs_fn_cuStreamDestroy_v2 real, CUstream hStream)
{
    /* Under the lock, so the idle detector never queries a handle being destroyed. */
    gs_streams_lock();
    gs_stream_forget(hStream);
    CUresult r = real(hStream);
    gs_streams_unlock();
    return r;
}
