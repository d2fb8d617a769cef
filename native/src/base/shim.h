/*
 * Declarations shared by the shim's files. Nothing here is exported: the exports are generated in
 * hook.c from hooks.def, plus dlsym and the gpushare.h status API.
 *
 * The base room's header (native/README.md): the driver ABI, the hook table, the loader, the
 * configuration, logging, the gate, capture. It names nothing of the rooms above it but two things
 * they implement for it: the gate's slow path (gs_gate_slow, client/wait.c), reached only from
 * the inline fast path the doors expand, and the hand-written handlers that hooks.def names.
 */
#ifndef GPUSHARE_SHIM_H
#define GPUSHARE_SHIM_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "cuda_abi.h"

#define GS_EXPORT __attribute__((visibility("default")))
#define GS_LIKELY(x) __builtin_expect(!!(x), 1)
#define GS_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define GS_VERSION "0.2.0"

/* ---- ABI bits the shim needs beyond cuda_abi.h (kept here so the shared header stays small) --- */

typedef struct CUexecAffinityParam_st CUexecAffinityParam;

/* Special stream handles (cuda.h CU_STREAM_LEGACY / CU_STREAM_PER_THREAD). */
#define GS_STREAM_LEGACY ((CUstream)0x1)
#define GS_STREAM_PER_THREAD ((CUstream)0x2)
#define GS_STREAM_NON_BLOCKING 0x1u /* CU_STREAM_NON_BLOCKING, a cuStreamCreate flag */

#define GS_NVML_ERROR_FUNCTION_NOT_FOUND 13

#define GS_LAUNCH_CONFIG_STREAM(cfg) ((cfg) ? (cfg)->hStream : GS_NO_STREAM)

/* A stream value that cannot be a real handle: "this call has no stream". */
#define GS_NO_STREAM ((CUstream)(uintptr_t)-1)

/* ---- the hook table ---- */

enum gs_lib { GS_LIB_CUDA = 0, GS_LIB_NVML = 1 };

/* One index per hooked name. */
enum gs_hook_index {
#define GS_GATED(name, params, args, stream, per_thread) GS_IDX_##name,
#define GS_CUSTOM(name, ret, params, args, handler, lib) GS_IDX_##name,
#include "hooks.def"
#undef GS_GATED
#undef GS_CUSTOM
    GS_N_HOOKS
};

/* The real function's type for every hooked name: gs_fn_<name>. */
#define GS_GATED(name, params, args, stream, per_thread) typedef CUresult(*gs_fn_##name) params;
#define GS_CUSTOM(name, ret, params, args, handler, lib) typedef ret(*gs_fn_##name) params;
#include "hooks.def"
#undef GS_GATED
#undef GS_CUSTOM

/* The real function behind a hooked name (resolving the library on first use); NULL when the real
 * library lacks the symbol or cannot be loaded. */
extern _Atomic(void *) gs_real_ptrs[GS_N_HOOKS];
void *gs_real_slow(enum gs_hook_index idx);
static inline void *gs_real(enum gs_hook_index idx)
{
    void *p = atomic_load_explicit(&gs_real_ptrs[idx], memory_order_acquire);
    return GS_LIKELY(p) ? p : gs_real_slow(idx);
}
#define GS_REAL(name) ((gs_fn_##name)gs_real(GS_IDX_##name))

/* Real functions the shim calls but does not hook (cuCtxSynchronize, cuStreamQuery, ...). */
void *gs_driver_sym(const char *name);
void *gs_nvml_sym(const char *name);
int gs_driver_loaded(void);
/* loader.c: load a real library once; its real dlsym; whether this thread is loading one (its
 * constructors' dlsym calls must not be mapped); whether the driver could be loaded. */
typedef void *(*dlsym_fn)(void *, const char *);
void gs_loader_load(enum gs_lib lib);
dlsym_fn gs_loader_real_dlsym(void);
int gs_loader_busy(void);
int gs_driver_loaded_ok(void);

/* ---- configuration (config.c) ---- */

enum gs_log_level { GS_LOG_QUIET = 0, GS_LOG_WARN = 1, GS_LOG_INFO = 2, GS_LOG_DEBUG = 3 };

enum gs_memory_mode {
    GS_MEMORY_VMM = 0,     /* reserved ranges backed by physical allocations (default) */
    GS_MEMORY_MANAGED = 1, /* every cuMemAlloc becomes managed memory (the first generation) */
    GS_MEMORY_DEVICE = 2   /* plain device memory: counted, never moved */
};

struct gs_config {
    int disabled;           /* GPUSHARE_DISABLE=1: pure pass-through */
    int log_level;          /* GPUSHARE_LOG */
    int memory_mode;        /* GPUSHARE_MEMORY: enum gs_memory_mode */
    uint64_t host_budget;   /* GPUSHARE_HOST_BUDGET: pinned host staging, bytes */
    uint64_t quota;         /* GPUSHARE_MEMORY_LIMIT, 0 = none */
    uint64_t context_bytes; /* GPUSHARE_CONTEXT_BYTES */
    uint64_t weight_milli;  /* GPUSHARE_WEIGHT x 1000 */
    double idle_seconds;    /* GPUSHARE_IDLE_SECONDS, 0 = off */
    double reconnect_wait;  /* GPUSHARE_RECONNECT_WAIT: seconds a non-holder waits for a lost
                               scheduler before it runs unshared */
    double capture_wait;    /* GPUSHARE_CAPTURE_WAIT: seconds a release (eviction, restore)
                               waits for a stream capture to end before it gives up */
    const char *real_libcuda;
    /* The memory engine's host side (memory/prepare.c, memory/staging.c, memory/bounce.c). */
    unsigned staging_threads; /* GPUSHARE_STAGING_THREADS: CPU threads that populate staging
                                 and copy out of the bounce ring */
    double staging_quiet;     /* GPUSHARE_STAGING_QUIET: seconds without a new or freed block
                                 before staging is prepared (0 = at once) */
    int staging_nice;         /* GPUSHARE_STAGING_NICE: those threads' nice value */
    uint64_t bounce_bytes;    /* GPUSHARE_BOUNCE_BYTES: the pinned ring, 0 = none */
    int verify_moves;         /* GPUSHARE_VERIFY_MOVES: check every move (memory/verify.c) */
    int check_copies;         /* GPUSHARE_CHECK_COPIES: sample each copy out (1, default) */
};

const struct gs_config *gs_config(void);
/* Parse "8GiB", "512M", "1.5G", "1073741824" (1024-based units). Returns 0 on success. */
int gs_parse_size(const char *text, uint64_t *out);
/* A bare number below this, other than 0, is refused as a memory limit (units.py's
 * BARE_NUMBER_FLOOR): 1 if ``text``, parsed as ``bytes``, is one. */
#define GS_BARE_NUMBER_FLOOR (1ull << 20)
int gs_forgotten_unit(const char *text, uint64_t bytes);
/* "2.00 GiB" etc. into buf. */
const char *gs_format_size(uint64_t bytes, char *buf, size_t len);
double gs_now(void); /* CLOCK_MONOTONIC seconds */

/* ---- logging (log.c) ---- */

/* GPUSHARE_LOG, read once (log.c). */
int gs_log_level_now(void);
void gs_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define GS_WARN(...) gs_log(GS_LOG_WARN, __VA_ARGS__)
#define GS_INFO(...) gs_log(GS_LOG_INFO, __VA_ARGS__)
#define GS_DEBUG(...) gs_log(GS_LOG_DEBUG, __VA_ARGS__)
static inline int gs_log_enabled(int level) { return gs_log_level_now() >= level; }

/* ---- the gate (gate.c) ---- */

/* Exactly GS_GATE_GRANTED = open (calls pass); anything else = closed (calls take the slow
 * path). Bit 0: the process holds every device it uses; bit 1 + d: device slot d is held shut
 * (gs_gate_hold: the memory engine left memory unbacked past the grant's room, and no call may
 * reach it until the next grant backs it). */
#define GS_GATE_GRANTED 1
#define GS_GATE_HOLD_MASK 0xFFu
extern atomic_int gs_gate_word;
/* Set by a gated call when it is 0; cleared by the client thread when it samples activity. */
extern atomic_int gs_activity;

/* Streams the idle detector asks about: an open-addressed set (a collision probes on, it never
 * overwrites a stream that may be busy). A full set, or a stream the detector cannot ask about,
 * makes the detector answer "busy": it must never call a busy process idle. */
#define GS_STREAM_SLOTS 256
extern _Atomic(uintptr_t) gs_stream_slots[GS_STREAM_SLOTS];
void gs_note_stream_slow(uintptr_t v, unsigned slot);

/* Gated calls are counted per thread (a shared counter would bounce its cache line between every
 * submitting thread); status sums the threads' counters. The thread's first call registers its
 * counter. initial-exec: a plain offset from the thread pointer, no __tls_get_addr call.
 * `inflight` is 1 while the thread is inside a gated call (past the gate, in the driver): a
 * release waits until no thread is (gs_gate_drain). `ptds` records that the thread submitted to
 * its per-thread default stream, which only that thread can name. */
struct gs_thread_calls {
    _Atomic(uint64_t) calls;
    atomic_int inflight;
    atomic_int ptds;
    struct gs_thread_calls *next;
};
extern __thread struct gs_thread_calls gs_tl_calls __attribute__((tls_model("initial-exec")));
void gs_register_thread_calls(void);
uint64_t gs_total_gated_calls(void);

static inline void gs_note_stream(CUstream s, int per_thread)
{
    if (s == GS_NO_STREAM)
        return;
    if (s == GS_STREAM_PER_THREAD || (per_thread && s == 0)) {
        /* The shim's thread cannot query this thread's per-thread stream by name: it asks the
         * legacy stream, which waits for every blocking stream (idle.c). */
        if (GS_UNLIKELY(!atomic_load_explicit(&gs_tl_calls.ptds, memory_order_relaxed)))
            atomic_store_explicit(&gs_tl_calls.ptds, 1, memory_order_relaxed);
        return;
    }
    uintptr_t v = s ? (uintptr_t)s : (uintptr_t)GS_STREAM_LEGACY;
    unsigned slot = (unsigned)((v >> 4) ^ (v >> 12)) & (GS_STREAM_SLOTS - 1);
    if (GS_UNLIKELY(atomic_load_explicit(&gs_stream_slots[slot], memory_order_relaxed) != v))
        gs_note_stream_slow(v, slot);
}

CUresult gs_gate_slow(CUstream s, int per_thread);

static inline void gs_count_call(void)
{
    /* Only this thread writes its counter: load + store, no atomic read-modify-write. */
    uint64_t n = atomic_load_explicit(&gs_tl_calls.calls, memory_order_relaxed);
    atomic_store_explicit(&gs_tl_calls.calls, n + 1, memory_order_relaxed);
    if (GS_UNLIKELY(n == 0))
        gs_register_thread_calls();
}

/* Set when the asymmetric barrier (membarrier) is not available: the fast path then fences
 * itself. Written once, before the gate first opens. */
extern atomic_int gs_gate_self_fence;

/* This thread is inside a gated call from here on. The store must be visible before the gate
 * word is read (a release closes the gate, then looks at every thread's flag: Dekker). The
 * releaser issues membarrier(), which orders every thread's store for it, so the fast path needs
 * only a compiler barrier; without membarrier each call fences. */
static inline void gs_gate_inflight_begin(void)
{
    atomic_store_explicit(&gs_tl_calls.inflight, 1, memory_order_relaxed);
    if (GS_UNLIKELY(atomic_load_explicit(&gs_gate_self_fence, memory_order_relaxed)))
        atomic_thread_fence(memory_order_seq_cst);
    else
        atomic_signal_fence(memory_order_seq_cst);
}

static inline void gs_gate_leave(void)
{
    atomic_store_explicit(&gs_tl_calls.inflight, 0, memory_order_release);
}

/* Every gated call starts here, and ends with gs_gate_leave() once the driver returned. While the
 * process holds the device this is the per-thread call count, the per-thread in-flight flag, one
 * acquire load of the gate word, a relaxed load of the activity word and (for stream-ordered
 * calls) of one stream slot: no locks, no shared writes after the first call. */
static inline CUresult gs_gate_enter(CUstream s, int per_thread)
{
    gs_count_call();
    gs_gate_inflight_begin();
    if (GS_LIKELY(atomic_load_explicit(&gs_gate_word, memory_order_acquire) == GS_GATE_GRANTED)) {
        if (!atomic_load_explicit(&gs_activity, memory_order_relaxed))
            atomic_store_explicit(&gs_activity, 1, memory_order_relaxed);
        gs_note_stream(s, per_thread);
        return CUDA_SUCCESS;
    }
    return gs_gate_slow(s, per_thread);
}

void gs_gate_set_open(int open);
/* Hold the gate shut for the device slots in `devices` (bit d: slot d), whatever the grant says,
 * until gs_gate_unhold; the slow path lets no call on such a device through (client/wait.c). */
void gs_gate_hold(unsigned devices);
void gs_gate_unhold(unsigned devices);
unsigned gs_gate_holds(void);
/* After closing the gate: wait (at most `seconds`) until no thread is inside a gated call.
 * Returns the number still inside (0: drained). */
int gs_gate_drain(double seconds);
/* Query the recorded streams (context must be current). Returns 1 when any has work pending. */
int gs_streams_busy(void);
/* Whether some thread submitted to its per-thread default stream. */
int gs_streams_ptds_used(void);
void gs_stream_forget(CUstream s);
void gs_streams_lock(void);
void gs_streams_unlock(void);
void gs_streams_after_fork_child(void);
void gs_calls_after_fork_child(void);

/* ---- stream capture (capture.c) ---- */

/* Captures in progress in this process (any mode). Cheap: an atomic load. */
int gs_capture_active(void);
/* Wait until no stream captures, at most `seconds`. 1: none captures, and none can begin until
 * gs_capture_unlock() (a shared hold: several threads may hold captures off at once); 0: timed
 * out (not held). */
int gs_capture_hold_off(double seconds);
/* Whether `s` captures now (asked from the calling thread, which owns its per-thread stream). */
int gs_capture_stream_capturing(CUstream s, int per_thread);
/* Ends a hold gs_capture_hold_off returned 1 for. */
void gs_capture_unlock(void);
void gs_capture_forget_stream(CUstream s);
void gs_capture_after_fork_child(void);

/* ---- hand-written handlers, declared from hooks.def so their signatures are checked ---- */
#define GS_GATED(name, params, args, stream, per_thread)
#define GS_CUSTOM(name, ret, params, args, handler, lib)                                          \
    ret handler(gs_fn_##name real, GS_UNPAREN params);
#define GS_UNPAREN(...) __VA_ARGS__
#include "hooks.def"
#undef GS_GATED
#undef GS_CUSTOM

#endif /* GPUSHARE_SHIM_H */
