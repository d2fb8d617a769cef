/*
 * Stream capture. While a stream captures (torch.cuda.graph, torch.compile's reduce-overhead
 * mode), cuCtxSynchronize or cuStreamQuery from another thread make the driver answer 900 and the
 * capture's end 901: the user's capture fails. So the shim keeps the set of capturing streams
 * (from its hooks on cuStreamBeginCapture* / cuStreamEndCapture) and every synchronising step it
 * takes itself (release, eviction, restore, idle check, quit) first waits, bounded, until no
 * stream captures (docs/reliability.md).
 *
 * Captured calls do not run on the GPU: the gate lets a call on a capturing stream through even
 * when the device is not held (wait.c), or a revoke deferred for the capture would wait for a
 * capture that waits for the gate.
 */
#include <time.h>

#include "shim.h"

#define MAX_CAPTURES 128

struct capture {
    uintptr_t stream; /* 0: free slot */
    pthread_t owner;  /* for a per-thread default stream: the thread it belongs to */
    int per_thread;
};

static pthread_mutex_t cap_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cap_cv;
static pthread_once_t cap_once = PTHREAD_ONCE_INIT;
static struct capture captures[MAX_CAPTURES];
static atomic_int n_active;
/* Threads of the shim's holding captures off (gs_capture_hold_off): a hold, not the lock, so
 * holders do not wait for each other. A revoke's release must not wait behind the host staging
 * being populated beside it (seen on 2 cores: 2 s for 1 GiB); a capture begins only when none
 * holds. Under cap_mu. */
static int n_holders;
/* Capture begins waiting for the holders to finish: no new hold starts meanwhile, so a program's
 * capture is not starved by holds that overlap one another (the staging thread's, block after
 * block, and the idle detector's every tick). Under cap_mu. */
static int n_begins_waiting;
/* Begins seen while the table was full: counted, so the shim still knows captures are running. */
static int n_untracked;

static void init_cv(void)
{
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&cap_cv, &a);
    pthread_condattr_destroy(&a);
}

static int is_ptds(CUstream s, int per_thread)
{
    return s == GS_STREAM_PER_THREAD || (per_thread && s == 0);
}

static struct capture *find_locked(CUstream s, int per_thread)
{
    int pt = is_ptds(s, per_thread);
    for (int i = 0; i < MAX_CAPTURES; i++) {
        struct capture *c = &captures[i];
        if (!c->stream)
            continue;
        if (pt ? (c->per_thread && pthread_equal(c->owner, pthread_self()))
               : (!c->per_thread && c->stream == (uintptr_t)s))
            return c;
    }
    return NULL;
}

/* With cap_mu held. */
static void note_begin_locked(CUstream s, int per_thread)
{
    struct capture *slot = find_locked(s, per_thread);
    for (int i = 0; i < MAX_CAPTURES && !slot; i++)
        if (!captures[i].stream)
            slot = &captures[i];
    if (slot) {
        slot->per_thread = is_ptds(s, per_thread);
        slot->stream = slot->per_thread ? (uintptr_t)GS_STREAM_PER_THREAD : (uintptr_t)s;
        slot->owner = pthread_self();
    } else {
        n_untracked++;
    }
    atomic_fetch_add(&n_active, 1);
}

static void note_end(CUstream s, int per_thread)
{
    pthread_once(&cap_once, init_cv);
    pthread_mutex_lock(&cap_mu);
    struct capture *c = find_locked(s, per_thread);
    if (c) {
        c->stream = 0;
        atomic_fetch_sub(&n_active, 1);
    } else if (n_untracked > 0) {
        n_untracked--;
        atomic_fetch_sub(&n_active, 1);
    }
    pthread_cond_broadcast(&cap_cv);
    pthread_mutex_unlock(&cap_mu);
}

/* The real cuStreamIsCapturing (or its per-thread twin) on the calling thread. */
static int ask_capturing(CUstream s, int per_thread, int *capturing)
{
    typedef CUresult (*is_capturing_fn)(CUstream, CUstreamCaptureStatus *);
    static _Atomic(is_capturing_fn) fns[2];
    is_capturing_fn fn = atomic_load(&fns[per_thread != 0]);
    if (!fn) {
        fn = (is_capturing_fn)gs_driver_sym(per_thread ? "cuStreamIsCapturing_ptsz"
                                                       : "cuStreamIsCapturing");
        atomic_store(&fns[per_thread != 0], fn);
    }
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    if (!fn)
        return -1;
    CUresult r = fn(s, &st);
    if (r != CUDA_SUCCESS)
        return -1;
    *capturing = st == CU_STREAM_CAPTURE_STATUS_ACTIVE;
    return 0;
}

int gs_capture_active(void) { return atomic_load_explicit(&n_active, memory_order_acquire) > 0; }

int gs_capture_stream_capturing(CUstream s, int per_thread)
{
    if (s == GS_NO_STREAM || !gs_capture_active())
        return 0;
    /* Asked of the driver, not of the table: a stream joins a capture through an event wait,
     * without a begin of its own. */
    int capturing = 0;
    return ask_capturing(s, per_thread, &capturing) == 0 && capturing;
}

static void deadline_in(double seconds, struct timespec *until)
{
    clock_gettime(CLOCK_MONOTONIC, until);
    long ns = (long)(seconds * 1e9);
    until->tv_sec += ns / 1000000000L;
    until->tv_nsec += ns % 1000000000L;
    if (until->tv_nsec >= 1000000000L) {
        until->tv_sec++;
        until->tv_nsec -= 1000000000L;
    }
}

int gs_capture_hold_off(double seconds)
{
    pthread_once(&cap_once, init_cv);
    struct timespec until;
    deadline_in(seconds, &until);
    pthread_mutex_lock(&cap_mu);
    int r = 0;
    while ((atomic_load(&n_active) > 0 || n_begins_waiting > 0) && r == 0)
        r = pthread_cond_timedwait(&cap_cv, &cap_mu, &until);
    int held = atomic_load(&n_active) == 0 && n_begins_waiting == 0;
    n_holders += held; /* no capture can begin until gs_capture_unlock() */
    pthread_mutex_unlock(&cap_mu);
    return held;
}

void gs_capture_unlock(void)
{
    pthread_mutex_lock(&cap_mu);
    n_holders--;
    pthread_cond_broadcast(&cap_cv);
    pthread_mutex_unlock(&cap_mu);
}

/* With cap_mu held: a capture may begin once no thread of the shim holds captures off. */
static void wait_for_no_holders_locked(void)
{
    n_begins_waiting++;
    while (n_holders > 0)
        pthread_cond_wait(&cap_cv, &cap_mu);
}

/* After the begin (noted, or refused by the driver): holds that waited for it look again. */
static void begin_done_locked(void)
{
    n_begins_waiting--;
    pthread_cond_broadcast(&cap_cv);
}

void gs_capture_forget_stream(CUstream s)
{
    /* A destroyed stream's capture has ended with it. */
    if (gs_capture_active() && s && s != GS_STREAM_LEGACY && s != GS_STREAM_PER_THREAD)
        note_end(s, 0);
}

void gs_capture_after_fork_child(void)
{
    pthread_mutex_init(&cap_mu, NULL);
    init_cv();
    for (int i = 0; i < MAX_CAPTURES; i++)
        captures[i].stream = 0;
    n_untracked = 0;
    n_holders = n_begins_waiting = 0;
    atomic_store(&n_active, 0);
}

/* ---- hooks (hooks.def) ---- */

/* The begin is made under the table's lock: the idle detector holds it while it uses the legacy
 * stream, and a capture that began in the middle of that would be invalidated. The capture is
 * counted before the lock is let go: a thread that then holds captures off (host staging, a
 * release) must find it, not a window in which it runs uncounted (seen on an H100: host
 * registration in that window invalidated torch.cuda.graph's capture, error 900). */
static CUresult begin(CUresult (*call)(void *, CUstream, CUstreamCaptureMode), void *real,
                      CUstream s, CUstreamCaptureMode mode, int per_thread)
{
    pthread_once(&cap_once, init_cv);
    pthread_mutex_lock(&cap_mu);
    wait_for_no_holders_locked();
    CUresult r = call(real, s, mode);
    if (r == CUDA_SUCCESS)
        note_begin_locked(s, per_thread);
    begin_done_locked();
    pthread_mutex_unlock(&cap_mu);
    return r;
}

static CUresult call_v1(void *real, CUstream s, CUstreamCaptureMode mode)
{
    return ((gs_fn_cuStreamBeginCapture)real)(s);
}

static CUresult call_v2(void *real, CUstream s, CUstreamCaptureMode mode)
{
    return ((gs_fn_cuStreamBeginCapture_v2)real)(s, mode);
}

CUresult gs_capture_begin_v1(gs_fn_cuStreamBeginCapture real, CUstream hStream)
{
    return begin(call_v1, (void *)real, hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, 0);
}

CUresult gs_capture_begin_v1_ptsz(gs_fn_cuStreamBeginCapture_ptsz real, CUstream hStream)
{
    return begin(call_v1, (void *)real, hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, 1);
}

CUresult gs_capture_begin(gs_fn_cuStreamBeginCapture_v2 real, CUstream hStream,
                          CUstreamCaptureMode mode)
{
    return begin(call_v2, (void *)real, hStream, mode, 0);
}

CUresult gs_capture_begin_ptsz(gs_fn_cuStreamBeginCapture_v2_ptsz real, CUstream hStream,
                               CUstreamCaptureMode mode)
{
    return begin(call_v2, (void *)real, hStream, mode, 1);
}

static CUresult begin_to_graph(gs_fn_cuStreamBeginCaptureToGraph real, CUstream hStream,
                               CUgraph hGraph, const CUgraphNode *deps,
                               const CUgraphEdgeData *data, size_t n, CUstreamCaptureMode mode,
                               int per_thread)
{
    pthread_once(&cap_once, init_cv);
    pthread_mutex_lock(&cap_mu);
    wait_for_no_holders_locked();
    CUresult r = real(hStream, hGraph, deps, data, n, mode);
    if (r == CUDA_SUCCESS)
        note_begin_locked(hStream, per_thread);
    begin_done_locked();
    pthread_mutex_unlock(&cap_mu);
    return r;
}

CUresult gs_capture_begin_to_graph(gs_fn_cuStreamBeginCaptureToGraph real, CUstream hStream,
                                   CUgraph hGraph, const CUgraphNode *dependencies,
                                   const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                   CUstreamCaptureMode mode)
{
    return begin_to_graph(real, hStream, hGraph, dependencies, dependencyData, numDependencies,
                          mode, 0);
}

CUresult gs_capture_begin_to_graph_ptsz(gs_fn_cuStreamBeginCaptureToGraph_ptsz real,
                                        CUstream hStream, CUgraph hGraph,
                                        const CUgraphNode *dependencies,
                                        const CUgraphEdgeData *dependencyData,
                                        size_t numDependencies, CUstreamCaptureMode mode)
{
    return begin_to_graph(real, hStream, hGraph, dependencies, dependencyData, numDependencies,
                          mode, 1);
}

static CUresult end(gs_fn_cuStreamEndCapture real, CUstream hStream, CUgraph *phGraph,
                    int per_thread)
{
    CUresult r = real(hStream, phGraph);
    /* The capture is over unless the driver says the stream still captures (an end from the
     * wrong thread in thread-local mode). */
    int capturing = 0;
    if (ask_capturing(hStream, per_thread, &capturing) != 0 || !capturing)
        note_end(hStream, per_thread);
    return r;
}

CUresult gs_capture_end(gs_fn_cuStreamEndCapture real, CUstream hStream, CUgraph *phGraph)
{
    return end(real, hStream, phGraph, 0);
}

CUresult gs_capture_end_ptsz(gs_fn_cuStreamEndCapture_ptsz real, CUstream hStream,
                             CUgraph *phGraph)
{
    return end(real, hStream, phGraph, 1);
}
