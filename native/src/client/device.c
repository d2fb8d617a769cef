/*
 * The application's contexts and devices, and the driver functions the shim calls on them itself
 * (never hooked ones: those would gate the gatekeeper).
 */
#include <stdio.h>
#include <string.h>

#include "session.h"

static struct {
    CUresult (*ctx_push)(CUcontext);
    CUresult (*ctx_pop)(CUcontext *);
    CUresult (*ctx_sync)(void);
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*ctx_get_device)(CUdevice *);
    CUresult (*primary_state)(CUdevice, unsigned int *, int *);
    CUresult (*uuid_v2)(CUuuid *, CUdevice);
    CUresult (*uuid)(CUuuid *, CUdevice);
    CUresult (*name)(char *, int, CUdevice);
    CUresult (*total_mem)(size_t *, CUdevice);
    CUresult (*stream_get_ctx)(CUstream, CUcontext *);
} D;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

static void load_driver_fns(void)
{
    *(void **)&D.ctx_push = gs_driver_sym("cuCtxPushCurrent_v2");
    *(void **)&D.ctx_pop = gs_driver_sym("cuCtxPopCurrent_v2");
    *(void **)&D.ctx_sync = gs_driver_sym("cuCtxSynchronize");
    *(void **)&D.ctx_get_current = gs_driver_sym("cuCtxGetCurrent");
    *(void **)&D.ctx_get_device = gs_driver_sym("cuCtxGetDevice");
    *(void **)&D.primary_state = gs_driver_sym("cuDevicePrimaryCtxGetState");
    *(void **)&D.uuid_v2 = gs_driver_sym("cuDeviceGetUuid_v2");
    *(void **)&D.uuid = gs_driver_sym("cuDeviceGetUuid");
    *(void **)&D.name = gs_driver_sym("cuDeviceGetName");
    *(void **)&D.total_mem = gs_driver_sym("cuDeviceTotalMem_v2");
    *(void **)&D.stream_get_ctx = gs_driver_sym("cuStreamGetCtx");
}

static void drv(void) { pthread_once(&drv_once, load_driver_fns); }

/* A context on a device the session has no registration for: from now on that device's calls
 * wait for its own grant. The link closes the gate before this returns, so no call on the new
 * device can pass the fast path on the first device's grant; the thread connects it. */
static void add_link_locked(struct gs_session *s, CUdevice dev)
{
    if (gs_session_link_locked(s, dev))
        return;
    if (s->links.n >= GS_MAX_LINKS) {
        GS_WARN("device %d: more than %d devices in one process; it waits for the first "
                "device's grant", (int)dev, GS_MAX_LINKS + 1);
        return;
    }
    struct gs_link *l = &s->links.l[s->links.n++];
    memset(l, 0, sizeof *l);
    l->dev = dev;
    l->fd = -1;
    /* The thread connects it once the first device's connection is up; until then its calls
     * wait like the first device's (and pass while the process runs unshared). */
    l->state = GS_LINK_CONNECTING;
    gs_session_regate_locked(s);
    gs_session_wake(s);
}

int gs_device_note_context_locked(struct gs_session *s, CUcontext ctx, CUdevice dev, int primary)
{
    struct gs_devices *d = &s->devs;
    int known = 0;
    for (int i = 0; i < d->n; i++)
        known |= d->ctxs[i].ctx == ctx;
    if (!known) {
        if (d->n < GS_MAX_CONTEXTS)
            d->ctxs[d->n++] = (struct gs_context){ctx, dev, primary};
        else if (!d->overflow) {
            d->overflow = 1;
            GS_WARN("more than %d CUDA contexts: a release drains the first %d only",
                    GS_MAX_CONTEXTS, GS_MAX_CONTEXTS);
        }
    }
    if (s->started && !s->quitting && dev != d->dev)
        add_link_locked(s, dev);
    if (s->started || s->quitting)
        return 0;
    s->started = 1;
    d->dev = dev;
    return 1;
}

static void remove_at_locked(struct gs_devices *d, int i)
{
    memmove(&d->ctxs[i], &d->ctxs[i + 1], (size_t)(d->n - i - 1) * sizeof d->ctxs[0]);
    d->n--;
}

void gs_device_forget_context(struct gs_session *s, CUcontext ctx)
{
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->devs.n; i++)
        if (s->devs.ctxs[i].ctx == ctx)
            remove_at_locked(&s->devs, i--);
    pthread_mutex_unlock(&s->mu);
}

void gs_device_forget_primary(struct gs_session *s, CUdevice dev)
{
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->devs.n; i++)
        if (s->devs.ctxs[i].primary && s->devs.ctxs[i].dev == dev)
            remove_at_locked(&s->devs, i--);
    pthread_mutex_unlock(&s->mu);
}

int gs_device_primary_active(CUdevice dev)
{
    drv();
    unsigned int flags = 0;
    int active = 0;
    return D.primary_state && D.primary_state(dev, &flags, &active) == CUDA_SUCCESS && active;
}

int gs_device_of_context(struct gs_session *s, CUcontext ctx, CUdevice *dev)
{
    int found = -1;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->devs.n && found; i++)
        if (s->devs.ctxs[i].ctx == ctx) {
            *dev = s->devs.ctxs[i].dev;
            found = 0;
        }
    pthread_mutex_unlock(&s->mu);
    return found;
}

int gs_device_current(CUcontext *ctx, CUdevice *dev)
{
    drv();
    *ctx = NULL;
    *dev = 0;
    if (D.ctx_get_current && D.ctx_get_current(ctx) == CUDA_SUCCESS && *ctx &&
        D.ctx_get_device && D.ctx_get_device(dev) == CUDA_SUCCESS)
        return 0;
    return -1;
}

static int snapshot(struct gs_session *s, struct gs_context *out)
{
    pthread_mutex_lock(&s->mu);
    int n = s->devs.n;
    memcpy(out, s->devs.ctxs, (size_t)n * sizeof *out);
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* Push one context. The program may have released its primary context: never push a dead one. */
static int push_one(const struct gs_context *c)
{
    if (!D.ctx_push || !D.ctx_pop)
        return -1;
    if (c->primary && D.primary_state && !gs_device_primary_active(c->dev))
        return -1;
    return D.ctx_push(c->ctx) == CUDA_SUCCESS ? 0 : -1;
}

/* Push the first live context (of device `only`, when only >= 0). */
static int push_first(struct gs_session *s, CUdevice only, CUdevice *dev_out)
{
    drv();
    struct gs_context ctxs[GS_MAX_CONTEXTS];
    int n = snapshot(s, ctxs);
    for (int i = 0; i < n; i++)
        if ((only < 0 || ctxs[i].dev == only) && push_one(&ctxs[i]) == 0) {
            if (dev_out)
                *dev_out = ctxs[i].dev;
            return 0;
        }
    return -1;
}

int gs_device_push(struct gs_session *s, CUdevice *dev_out) { return push_first(s, -1, dev_out); }

int gs_device_push_on(struct gs_session *s, CUdevice dev) { return push_first(s, dev, NULL); }

void gs_device_pop(void)
{
    CUcontext ignored;
    D.ctx_pop(&ignored);
}

static int sync_contexts(struct gs_session *s, int only, CUdevice dev)
{
    drv();
    struct gs_context ctxs[GS_MAX_CONTEXTS];
    int n = snapshot(s, ctxs), failed = 0;
    for (int i = 0; i < n; i++) {
        if (only && ctxs[i].dev != dev)
            continue;
        if (push_one(&ctxs[i]) != 0)
            continue; /* gone (released, destroyed at exit): nothing left to wait for */
        CUresult r = D.ctx_sync ? D.ctx_sync() : CUDA_SUCCESS;
        gs_device_pop();
        if (r != CUDA_SUCCESS) {
            failed++;
            GS_WARN("cuCtxSynchronize failed (error %d) on device %d", r, ctxs[i].dev);
        }
    }
    return failed;
}

int gs_device_sync_all(struct gs_session *s) { return sync_contexts(s, 0, 0); }

int gs_device_sync_dev(struct gs_session *s, CUdevice dev) { return sync_contexts(s, 1, dev); }

int gs_device_of_call(struct gs_session *s, CUstream stream, CUdevice *dev)
{
    drv();
    /* A stream belongs to one context, whichever is current: ask the stream first. The special
     * handles (no stream, the legacy and per-thread streams) mean the current context's. */
    CUcontext ctx = NULL;
    if (stream != GS_NO_STREAM && stream != 0 && stream != GS_STREAM_LEGACY &&
        stream != GS_STREAM_PER_THREAD && D.stream_get_ctx &&
        D.stream_get_ctx(stream, &ctx) == CUDA_SUCCESS && ctx &&
        gs_device_of_context(s, ctx, dev) == 0)
        return 0;
    return gs_device_current(&ctx, dev);
}

int gs_device_mem_info(struct gs_session *s, CUdevice dev, uint64_t *free_bytes,
                       uint64_t *total_bytes)
{
    typedef CUresult (*mem_info_fn)(size_t *, size_t *);
    mem_info_fn info = (mem_info_fn)gs_driver_sym("cuMemGetInfo_v2");
    size_t f = 0, t = 0;
    if (!info || gs_device_push_on(s, dev) != 0)
        return -1;
    CUresult r = info(&f, &t); /* the real one: the shim's answers the quota */
    gs_device_pop();
    *free_bytes = f;
    *total_bytes = t;
    return r == CUDA_SUCCESS ? 0 : -1;
}

void gs_device_describe(CUdevice dev, char *uuid, size_t uuid_cap, char *name, size_t name_cap,
                        uint64_t *total)
{
    drv();
    CUuuid u;
    memset(&u, 0, sizeof u);
    uuid[0] = 0;
    if ((D.uuid_v2 && D.uuid_v2(&u, dev) == CUDA_SUCCESS) ||
        (D.uuid && D.uuid(&u, dev) == CUDA_SUCCESS)) {
        const unsigned char *b = (const unsigned char *)u.bytes;
        snprintf(uuid, uuid_cap,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                 b[14], b[15]);
    }
    if (!D.name || D.name(name, (int)name_cap, dev) != CUDA_SUCCESS)
        name[0] = 0;
    name[name_cap - 1] = 0;
    size_t t = 0;
    *total = D.total_mem && D.total_mem(&t, dev) == CUDA_SUCCESS ? t : 0;
}

void gs_device_identify(struct gs_session *s, CUdevice dev)
{
    uint64_t total = 0;
    char uuid[sizeof s->devs.uuid];
    gs_device_describe(dev, uuid, sizeof uuid, s->devs.name, sizeof s->devs.name, &total);
    if (uuid[0]) /* keep what was known when the driver does not say */
        memcpy(s->devs.uuid, uuid, sizeof uuid);
    if (total)
        s->devs.total = total;
}
