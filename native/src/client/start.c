/*
 * Starting the session: the client starts when the process first gets a CUDA context (so `ls` or
 * nvidia-smi under the shim never register). It connects and says HELLO synchronously (at most
 * ~500 ms), then hands the socket to the shim's thread (thread.c). Also here: the context hooks
 * of hooks.def, which are where a process starts to use the GPU.
 */
#include <fcntl.h>
#include <unistd.h>

#include "gpushare.h"
#include "session.h"

static void start_session(struct gs_session *s, CUdevice dev)
{
    gs_conn_gather_identity(s);
    gs_device_identify(s, dev);
    pthread_mutex_lock(&s->mu);
    s->last_activity = gs_now();
    pthread_mutex_unlock(&s->mu);
    if (pipe2(s->wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0 || pipe2(s->done_pipe, O_CLOEXEC) != 0)
        gs_session_close_pipes(s);
    gs_proc_install(s);

    char why[160] = "";
    int fd = gs_conn_handshake(s, why, sizeof why);

    pthread_mutex_lock(&s->mu);
    if (fd >= 0) {
        gs_conn_connected_locked(s, fd, 0);
        GS_DEBUG("registered with the scheduler at %s as %s", s->id.socket_path, s->id.client_id);
    } else {
        gs_session_set_state_locked(s, GPUSHARE_STATE_UNSHARED);
        gs_conn_unreachable_locked(s, why, 0);
    }
    gs_thread_start_locked(s);
    if (!s->thread_running) {
        /* Without the thread nobody can talk to the scheduler: run unshared. */
        GS_WARN("cannot start the scheduler thread; running unshared");
        if (s->conn.fd >= 0)
            close(s->conn.fd);
        s->conn.fd = -1;
        s->conn.connected = 0;
        gs_session_set_state_locked(s, GPUSHARE_STATE_UNSHARED);
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void gs_start_on_context(struct gs_session *s, CUcontext ctx, CUdevice dev, int primary)
{
    if (gs_config()->disabled || !ctx)
        return;
    pthread_mutex_lock(&s->mu);
    int first = gs_device_note_context_locked(s, ctx, dev, primary);
    pthread_mutex_unlock(&s->mu);
    gs_mem_count_context(dev); /* its estimate counts on its device, once per device */
    if (first)
        start_session(s, dev);
}

void gs_start_from_current(struct gs_session *s)
{
    CUcontext ctx;
    CUdevice dev;
    if (gs_device_current(&ctx, &dev) == 0)
        gs_start_on_context(s, ctx, dev, 0);
}

/* ---- context hooks (hooks.def) ---- */

CUresult gs_ctx_primary_retain(gs_fn_cuDevicePrimaryCtxRetain real, CUcontext *pctx, CUdevice dev)
{
    CUresult r = real(pctx, dev);
    if (r == CUDA_SUCCESS && pctx)
        gs_start_on_context(gs_session_get(), *pctx, dev, 1);
    return r;
}

CUresult gs_ctx_create_v2(gs_fn_cuCtxCreate_v2 real, CUcontext *pctx, unsigned int flags,
                          CUdevice dev)
{
    CUresult r = real(pctx, flags, dev);
    if (r == CUDA_SUCCESS && pctx)
        gs_start_on_context(gs_session_get(), *pctx, dev, 0);
    return r;
}

CUresult gs_ctx_create_v3(gs_fn_cuCtxCreate_v3 real, CUcontext *pctx,
                          CUexecAffinityParam *paramsArray, int numParams, unsigned int flags,
                          CUdevice dev)
{
    CUresult r = real(pctx, paramsArray, numParams, flags, dev);
    if (r == CUDA_SUCCESS && pctx)
        gs_start_on_context(gs_session_get(), *pctx, dev, 0);
    return r;
}

CUresult gs_ctx_create_v4(gs_fn_cuCtxCreate_v4 real, CUcontext *pctx,
                          CUctxCreateParams *ctxCreateParams, unsigned int flags, CUdevice dev)
{
    CUresult r = real(pctx, ctxCreateParams, flags, dev);
    if (r == CUDA_SUCCESS && pctx)
        gs_start_on_context(gs_session_get(), *pctx, dev, 0);
    return r;
}

/* ---- teardown: the context, and whatever the shim cached in it, are gone ---- */

static void context_gone(struct gs_session *s, CUcontext ctx, CUdevice dev, int primary)
{
    if (primary)
        gs_device_forget_primary(s, dev);
    else
        gs_device_forget_context(s, ctx);
    gs_mem_context_gone(ctx);
}

CUresult gs_ctx_destroy(gs_fn_cuCtxDestroy_v2 real, CUcontext ctx)
{
    CUresult r = real(ctx);
    if (r == CUDA_SUCCESS)
        context_gone(gs_session_get(), ctx, 0, 0);
    return r;
}

CUresult gs_ctx_primary_release(gs_fn_cuDevicePrimaryCtxRelease_v2 real, CUdevice dev)
{
    CUresult r = real(dev);
    /* The last release destroys the primary context; earlier ones only drop a reference. */
    if (r == CUDA_SUCCESS && !gs_device_primary_active(dev))
        context_gone(gs_session_get(), NULL, dev, 1);
    return r;
}

CUresult gs_ctx_primary_reset(gs_fn_cuDevicePrimaryCtxReset_v2 real, CUdevice dev)
{
    CUresult r = real(dev);
    if (r == CUDA_SUCCESS)
        context_gone(gs_session_get(), NULL, dev, 1);
    return r;
}
