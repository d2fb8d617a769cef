/*
 * Host staging prepared in the background: a block allocated now gets its staging from a thread
 * of the engine's own, so neither the program's cudaMalloc nor the shim's thread (which answers
 * the scheduler) waits for it, and an eviction — of a busy kernel at a quantum's end as much as
 * of an idle one — copies into registered, touched host memory from its first byte.
 *
 * Populating and registering host memory is slow (16 GiB: ~1.8 s to register touched memory,
 * several more to touch it), so the thread takes the engine's lock only to pick a block and to
 * hand it the buffer; a block freed meanwhile is found gone by its id and the buffer released.
 */
#include "memory_vmm.h"

static pthread_cond_t prepare_cv = PTHREAD_COND_INITIALIZER;
static int prepare_pending, prepare_started;

static struct block *block_by_id(uint64_t id)
{
    for (size_t i = 0; i < gs_vmm_nblocks; i++)
        if (gs_vmm_blocks[i]->id == id)
            return gs_vmm_blocks[i];
    return NULL;
}

static void *preparer(void *arg)
{
    (void)arg;
    typedef CUresult (*set_ctx_fn)(CUcontext);
    set_ctx_fn set_ctx = (set_ctx_fn)gs_driver_sym("cuCtxSetCurrent");
    pthread_mutex_lock(&gs_vmm_mu);
    for (;;) {
        while (!prepare_pending)
            pthread_cond_wait(&prepare_cv, &gs_vmm_mu);
        struct block *b = NULL;
        for (size_t i = 0; i < gs_vmm_nblocks && !b; i++)
            if (!gs_vmm_blocks[i]->staging.host && !gs_vmm_blocks[i]->preparing)
                b = gs_vmm_blocks[i];
        if (!b) {
            prepare_pending = 0;
            continue;
        }
        b->preparing = 1;
        uint64_t id = b->id, size = b->size;
        CUcontext ctx = b->ctx;
        pthread_mutex_unlock(&gs_vmm_mu);

        /* Registering host memory needs a context current on this thread. */
        if (set_ctx)
            set_ctx(ctx);
        struct gs_staging st;
        int have = gs_staging_get(&st, size) == 0;

        pthread_mutex_lock(&gs_vmm_mu);
        struct block *nb = block_by_id(id);
        if (nb)
            nb->preparing = 0;
        if (have && nb && !nb->staging.host) {
            nb->staging = st;
            have = 0;
        }
        if (!nb || !have)
            continue;
        pthread_mutex_unlock(&gs_vmm_mu); /* an eviction made its own meanwhile */
        gs_staging_put(&st);
        pthread_mutex_lock(&gs_vmm_mu);
    }
    return NULL;
}

void gs_vmm_prepare_kick_locked(void)
{
    prepare_pending = 1;
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
    pthread_cond_signal(&prepare_cv);
}

void gs_vmm_prepare_after_fork_child(void)
{
    /* Threads do not survive fork: the child starts its own when it allocates. */
    pthread_cond_init(&prepare_cv, NULL);
    prepare_pending = prepare_started = 0;
}
