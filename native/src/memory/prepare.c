/*
 * Host staging prepared in the background: a block allocated now gets its staging from a thread
 * of the engine's own, so neither the program's cudaMalloc nor the shim's thread (which answers
 * the scheduler) waits for it, and an eviction — of a busy kernel at a quantum's end as much as
 * of an idle one — copies into registered, touched host memory from its first byte.
 *
 * The same thread runs the pre-copies the scheduler asks for (PRECOPY), after the staging they
 * copy into is ready: the shim's own thread answers at once and reports progress in MEMORY.
 *
 * Populating and registering host memory is slow (16 GiB: ~1.8 s to register touched memory,
 * several more to touch it), so the thread takes the engine's lock only to pick a block and to
 * hand it the buffer; a block freed meanwhile is found gone by its id and the buffer released.
 *
 * Host memory is a node-wide budget (docs/architecture.md, "Host memory is a budget"): once the
 * scheduler has said how much staging this process may hold for its resident memory (STAGING),
 * the thread makes staging only for resident blocks and only up to that allowance, and gives
 * back the staging of resident blocks past a lowered one (never an evicted block's: its data
 * lives only there). Without a scheduler every block gets staging, as before.
 */
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "vmm.h"

static int prepare_started;

static struct block *block_by_id(uint64_t id)
{
    for (size_t i = 0; i < gs_vmm_nblocks; i++)
        if (gs_vmm_blocks[i]->id == id)
            return gs_vmm_blocks[i];
    return NULL;
}

/* Registering host memory and copying are calls that fail a global or relaxed stream capture
 * another thread makes (cudaErrorStreamCaptureInvalidated: seen on an H100 under
 * torch.cuda.graph): wait until no stream captures, and keep new captures from beginning until
 * gs_capture_unlock(). This is a background thread, so it waits as long as captures last. */
static void hold_off_captures(void)
{
    while (!gs_capture_hold_off(gs_config()->capture_wait))
        GS_DEBUG("host staging waits for a stream capture to end");
}

/* Populating and registering host memory holds the process's memory-map lock, which the
 * program's own cudaMalloc and cudaFree need: on an H100, 40 blocks of 1 GiB allocated in a burst
 * took 25 s under the shim (0.015 s without) while their staging was made one 4 KiB page at a time
 * beside them. GPUSHARE_STAGING_QUIET (seconds, default 0.1) makes the preparer wait until the
 * program has made or freed no block for that long (at most max(5 s, it) in all), so that a
 * burst is not slowed and a temporary freed within the pause needs no staging at all. The pause
 * is short: an eviction 0.5 s after a large allocation must find staging under way, and staging
 * is populated in huge pages by several threads, a batch at a time (memory/staging.c). With no
 * pause at all (0), the H100 burst of 40 x 1 GiB took 1.25 s under the shim against 0.014 s
 * without (docs/gpu-verification.md, 2026-11-27). */
#define PREPARE_MAX_DEFER 5.0

/* With gs_vmm_mu held; lets it go while it waits. 1: it waited (look again). */
static int wait_for_a_pause(double *deferring_since)
{
    double quiet_for = gs_config()->staging_quiet;
    double now = gs_now(), quiet = now - gs_vmm_last_change;
    if (quiet >= quiet_for) {
        *deferring_since = 0;
        return 0;
    }
    if (*deferring_since == 0)
        *deferring_since = now;
    if (now - *deferring_since >= (quiet_for > PREPARE_MAX_DEFER ? quiet_for : PREPARE_MAX_DEFER))
        return 0;
    /* On the condition, not a plain sleep: a pre-copy the scheduler asks for meanwhile (an idle
     * kernel, whose next cell may come soon) must start at once, not after the pause. */
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until); /* the condition's clock */
    long ns = until.tv_nsec + (long)((quiet_for - quiet) * 1e9);
    until.tv_sec += ns / 1000000000L;
    until.tv_nsec = ns % 1000000000L;
    pthread_cond_timedwait(&gs_vmm_prepare_cv, &gs_vmm_mu, &until);
    return 1;
}

/* Staging this thread holds outside any block for a resident one: made for it and not yet
 * handed over, or taken from it and not yet released (under gs_vmm_mu). The host memory is
 * counted from the moment it is made (memory/staging.c) until it is released: so that a report
 * in between does not read it as evicted memory, it counts as staging of resident memory. */
static uint64_t unattached;

/* Under gs_vmm_mu: `size` bytes of staging are no longer held outside a block (handed over,
 * released, or never made). The report the release itself woke may have read them still
 * counted (host memory already down, staging of resident memory not): without a report after
 * this one, the scheduler kept a client's staging above its host memory until the next change. */
static void unattached_done_locked(uint64_t size)
{
    if (!size)
        return;
    unattached -= size;
    gs_mem_changed_locked();
    gs_client_wake();
}

/* Staging held for resident blocks (under gs_vmm_mu): what the scheduler's allowance bounds. */
static uint64_t resident_staging_locked(void)
{
    uint64_t n = 0;
    for (size_t i = 0; i < gs_vmm_nblocks; i++)
        if (gs_vmm_blocks[i]->resident && gs_vmm_blocks[i]->staging.host)
            n += gs_vmm_blocks[i]->staging.size;
    return n;
}

uint64_t gs_vmm_resident_staging(void)
{
    pthread_mutex_lock(&gs_vmm_mu);
    uint64_t n = resident_staging_locked() + unattached;
    pthread_mutex_unlock(&gs_vmm_mu);
    return n;
}

void gs_vmm_staging_allowance_changed(void)
{
    gs_vmm_preparer_start();
    pthread_mutex_lock(&gs_vmm_mu);
    gs_vmm_wake_preparer_locked();
    pthread_mutex_unlock(&gs_vmm_mu);
}

/* A block whose staging the preparer makes: none yet, or pageable (made by an eviction before
 * the preparer got to it) and not yet tried. Under the scheduler's allowance, a resident block
 * whose staging fits it (`held`: the resident blocks' staging now). */
static int wants_staging(const struct block *b, uint64_t allowance, uint64_t held)
{
    if (b->preparing)
        return 0;
    if (allowance != UINT64_MAX && !b->staging.host &&
        (!b->resident || held > allowance || b->size > allowance - held))
        return 0;
    return !b->staging.host || (!b->staging.pinned && !b->staging_tried);
}

/* Under gs_vmm_mu: a resident block's staging to give back, the allowance being lower than what
 * resident blocks hold (the last one found: the most recently made block first). Not one that a
 * pre-copy reads or that is being prepared. */
static struct block *over_allowance_locked(uint64_t allowance, uint64_t held)
{
    if (allowance == UINT64_MAX || held <= allowance)
        return NULL;
    for (size_t i = gs_vmm_nblocks; i-- > 0;) {
        struct block *b = gs_vmm_blocks[i];
        if (b->resident && b->staging.host && !b->copying && !b->preparing)
            return b;
    }
    return NULL;
}

/* Give back b's staging (under gs_vmm_mu, which it lets go while the memory is released). */
static void give_back_locked(struct block *b)
{
    struct gs_staging st = b->staging;
    b->staging = (struct gs_staging){0};
    b->precopied = 0;
    b->staging_tried = 0;
    unattached += st.size;
    pthread_mutex_unlock(&gs_vmm_mu);
    char a[32];
    GS_DEBUG("gave back %s of host staging: past the scheduler's allowance",
             gs_format_size(st.size, a, sizeof a));
    hold_off_captures(); /* unregistering fails a capture another thread makes */
    uint64_t size = st.size;
    gs_staging_put(&st);
    gs_capture_unlock();
    pthread_mutex_lock(&gs_vmm_mu);
    unattached_done_locked(size);
}

static void *preparer(void *arg)
{
    (void)arg;
    /* Populating host memory is CPU work the program did not ask for: GPUSHARE_STAGING_NICE
     * lowers its priority (Linux: a thread's own nice value). Not by default: at nice 19 beside
     * a busy program, 20 GiB of staging was not ready for many seconds, and every eviction
     * meanwhile ran at the pageable path's 1.4-2.4 GB/s. */
    int nice_value = gs_config()->staging_nice;
    if (nice_value && setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice_value) != 0)
        GS_DEBUG("the staging thread keeps the process's priority");
    typedef CUresult (*set_ctx_fn)(CUcontext);
    set_ctx_fn set_ctx = (set_ctx_fn)gs_driver_sym("cuCtxSetCurrent");
    double deferring_since = 0;
    int ring_made = 0;
    pthread_mutex_lock(&gs_vmm_mu);
    for (;;) {
        while (!gs_vmm_prepare_pending)
            pthread_cond_wait(&gs_vmm_prepare_cv, &gs_vmm_mu);
        if (!ring_made && gs_vmm_nblocks) {
            /* First of all, before any pause: the ring an eviction copies through until the
             * blocks' staging is ready, registered in the first block's context. */
            CUcontext ctx = gs_vmm_blocks[0]->ctx;
            ring_made = 1;
            pthread_mutex_unlock(&gs_vmm_mu);
            if (set_ctx && set_ctx(ctx) == CUDA_SUCCESS) {
                hold_off_captures();
                gs_bounce_prepare();
                gs_capture_unlock();
            }
            pthread_mutex_lock(&gs_vmm_mu);
            continue;
        }
        uint64_t allowance = gs_staging_allowance(), held = resident_staging_locked();
        struct block *over = over_allowance_locked(allowance, held);
        if (over) {
            give_back_locked(over);
            continue;
        }
        if (!gs_vmm_precopy_wanted && wait_for_a_pause(&deferring_since))
            continue;
        struct block *b = NULL;
        for (size_t i = 0; i < gs_vmm_nblocks && !b; i++)
            if (wants_staging(gs_vmm_blocks[i], allowance, held))
                b = gs_vmm_blocks[i];
        if (!b && gs_vmm_precopy_wanted) {
            /* Every block has its staging: the pre-copy the scheduler asked for runs here, so
             * the shim's thread stays free to answer (a revoke must not wait behind it). One
             * device at a time, in the context of one of its blocks. */
            CUdevice dev = __builtin_ctz(gs_vmm_precopy_wanted);
            gs_vmm_precopy_wanted &= ~(1u << dev);
            if (gs_total_gated_calls() != gs_vmm_precopy_asked_at[dev]) {
                /* Asked at an idle that has ended (staging took longer than the pause): the copy
                 * would be stale before it finished. The next idle asks again. */
                GS_DEBUG("pre-copy of device slot %d dropped: the program ran since it was asked",
                         (int)dev);
                continue;
            }
            CUcontext ctx = NULL;
            for (size_t i = 0; i < gs_vmm_nblocks && !ctx; i++)
                if (gs_vmm_on(gs_vmm_blocks[i], dev))
                    ctx = gs_vmm_blocks[i]->ctx;
            pthread_mutex_unlock(&gs_vmm_mu);
            uint64_t copied, us;
            if (ctx && set_ctx && set_ctx(ctx) == CUDA_SUCCESS) {
                hold_off_captures();
                /* Within the allowance: blocks without staging stay uncopied. */
                gs_staging_bound(allowance != UINT64_MAX, held > allowance ? 0 : allowance - held);
                gs_vmm_precopy(dev, &copied, &us);
                gs_staging_bound(0, 0);
                gs_capture_unlock();
            }
            pthread_mutex_lock(&gs_vmm_mu);
            continue;
        }
        if (!b) {
            gs_vmm_prepare_pending = 0;
            continue;
        }
        b->preparing = 1;
        uint64_t id = b->id, size = b->size, for_resident = b->resident ? b->size : 0;
        unattached += for_resident;
        double made_at = b->made_at;
        CUcontext ctx = b->ctx;
        pthread_mutex_unlock(&gs_vmm_mu);

        /* Registering host memory needs a context current on this thread. */
        if (set_ctx)
            set_ctx(ctx);
        struct gs_staging st;
        hold_off_captures();
        double made_from = gs_now();
        int have = gs_staging_get(&st, size) == 0;
        gs_capture_unlock();
        if (have) {
            char a[32];
            GS_INFO("host staging of %s (%s) ready %.3f s after its allocation, made in %.1f ms",
                    gs_format_size(size, a, sizeof a), st.pinned ? "registered" : "pageable",
                    gs_now() - made_at, (gs_now() - made_from) * 1e3);
        }

        pthread_mutex_lock(&gs_vmm_mu);
        struct block *nb = block_by_id(id);
        unattached_done_locked(for_resident); /* also where it was not made or not handed over */
        if (nb)
            nb->preparing = 0;
        if (nb)
            nb->staging_tried = 1;
        if (have && nb && !nb->staging.host) {
            nb->staging = st;
            have = 0;
            /* The next MEMORY report says it as staging of resident memory (the buffer was
             * counted as host memory when it was made, before it was the block's). */
            gs_mem_changed_locked();
            gs_client_wake();
        } else if (have && nb && st.pinned && !nb->staging.pinned && !nb->copying) {
            /* An eviction before this staging was ready copied the block into pageable memory
             * (memory/bounce.c): registered staging takes its place, so that the restore and
             * every later eviction run at the bus's speed. An evicted block's contents move
             * along, copied without the engine's lock (20 GiB take seconds): the block is marked
             * copying meanwhile, so it is neither freed nor evicted; a restore only reads the
             * pageable copy, which stays until the swap. A resident block's pre-copy is given
             * up instead (cheap to make again). */
            if (!nb->resident) {
                nb->copying = 1;
                gs_vmm_copies_begin_locked(1);
                pthread_mutex_unlock(&gs_vmm_mu);
                gs_staging_copy(&st, &nb->staging);
                pthread_mutex_lock(&gs_vmm_mu);
                nb->copying = nb->copy_spoiled = 0;
                gs_vmm_copies_end_locked(1);
            }
            nb->precopied = 0;
            char a[32];
            GS_INFO("registered staging replaced the pageable copy of %s (%s)",
                    gs_format_size(size, a, sizeof a), nb->resident ? "resident" : "evicted");
            struct gs_staging old = nb->staging;
            nb->staging = st;
            st = old; /* the pageable one is released below */
        }
        if (!have)
            continue;
        /* Not handed over: the block was freed meanwhile (a temporary, then empty_cache), or an
         * eviction made its own. Either way the buffer is nobody's: release it, or a freed
         * 60 GiB tensor leaves 60 GiB of the host populated and registered for good. */
        pthread_mutex_unlock(&gs_vmm_mu);
        hold_off_captures();
        gs_staging_put(&st);
        gs_capture_unlock();
        pthread_mutex_lock(&gs_vmm_mu);
    }
    return NULL;
}

void gs_vmm_preparer_start(void)
{
    pthread_mutex_lock(&gs_vmm_mu);
    if (!prepare_started) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        prepare_started = pthread_create(&t, &attr, preparer, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!prepare_started)
            GS_WARN("cannot start the thread that prepares host staging: evictions prepare it");
    }
    pthread_mutex_unlock(&gs_vmm_mu);
}

void gs_vmm_precopy_async(CUdevice dev)
{
    gs_vmm_preparer_start();
    pthread_mutex_lock(&gs_vmm_mu);
    gs_vmm_precopy_wanted |= 1u << gs_mem_slot(dev);
    gs_vmm_precopy_asked_at[gs_mem_slot(dev)] = gs_total_gated_calls();
    gs_vmm_wake_preparer_locked();
    pthread_mutex_unlock(&gs_vmm_mu);
}

void gs_vmm_prepare_after_fork_child(void)
{
    /* Threads do not survive fork: the child starts its own when it allocates. */
    prepare_started = 0;
}
